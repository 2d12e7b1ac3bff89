"""Lowering for the ring engine: a CDP table, one worker per device of the `data` axis.

`lower_ring` turns a cyclic table (cdp-v1, cdp-v2, paper-code; whole or split
backwards) into the `Program` the ring runtime (`cdpjax.methods.ring`) runs: one
steady-state period of T ticks from worker 0's start of a step (`RingTicks`, every
tick's static events, unrolled by the runtime), every buffer in its natural
shape (a worker holds every stage: nothing is padded) and every message at its
stage's size:

- ops: each worker's op of the tick (F, B, W), its step named by its lag (0: the
  step fed in this call, 1: the previous call's...);
- gradient sums: the gradient op of a (worker, stage) adds its gradient to the
  partial sum it received (or starts one), and the last worker's completes the sum;
  'partial' and 'sum' messages hop them along the table's delivery plan;
- applies: each worker applies a completed sum to its own copy between its last
  read of the old version and its first of the new (one stored version).

Gradient buffers are keyed (kind, stage, lag); those a period reads before writing
(`RingTicks.live`) are part of the train state, renamed lag -> lag + 1 at the end
of each period.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from cdpjax import kinds as op_kinds
from cdpjax.errors import ConfigError
from cdpjax.kinds import gradient_kind
from cdpjax.layouts.cdp import acausal_reads, cdp_table, check_sizes
from cdpjax.program import Buffer, Placement, Program, Send, Size, carries
from cdpjax.timetable import TimeTable

@dataclasses.dataclass(frozen=True)
class RingTick:
    """What happens in one tick of the ring's steady-state period, in this order: the ops,
    the sums they complete, the applies from the sums held before the sends, the sends,
    the applies from the sums received. Every event names its step by `lag`: 0 for the
    step fed in the call, 1 for the previous call's, and so on; gradient buffers are keyed
    (kind, stage, lag).

    ops: (worker, kind, stage, lag), at most one per (kind, stage).
    chain_start: (worker, stage) gradient ops that start a partial sum (nothing received).
    completes: (worker, stage, lag) gradient ops that complete a stage's sum.
    gradient_kinds: the kinds whose ops add to a partial sum (('B',), or ('W',) where split).
    partials: (stage, lag, ((src, dst), ...)) running sums sent at the end of the tick.
    sums: (stage, lag, ((src, dst), ...), merge) completed sums sent; `merge`: a worker that
      is not a receiver still holds its copy after the send (else only the receivers do).
    applies: (stage, lag, workers, after_send).
    """

    ops: tuple = ()
    chain_start: frozenset = frozenset()
    completes: tuple = ()
    partials: tuple = ()
    sums: tuple = ()
    applies: tuple = ()
    gradient_kinds: tuple = ("B",)


@dataclasses.dataclass(frozen=True)
class RingTicks:
    """One steady-state period (T ticks, from worker 0's start of a step) of a CDP table, as
    the ring runs it. `max_lag`: the oldest step a period touches; `live`: the gradient
    buffers (kind, stage, lag) whose values come from the previous period (where they had
    lag - 1); `newest[j]`: a worker that has applied, at a period boundary, every update of
    stage j complete by then (the others may still be waiting for theirs)."""

    rule: str
    workers: int
    stages: int
    ticks: tuple[RingTick, ...]
    max_lag: int
    live: tuple
    newest: tuple

    @property
    def period_ticks(self) -> int:
        return len(self.ticks)

    def held_bytes(self, stage_bytes) -> np.ndarray:
        """[ticks + 1] gradient bytes held (partial and completed sums, over all workers' buffers:
        what each device of the SPMD program allocates) at the period's start and after each
        tick, for stage gradients of `stage_bytes`."""
        carried = {(kind, j, lag - 1) for kind, j, lag in self.live}
        last = {}
        for t, tk in enumerate(self.ticks):
            for name, _, _ in accesses(tk):
                last[name] = t
        held = set(self.live)
        out = [sum(stage_bytes[j] for _, j, _ in held)]
        for t, tk in enumerate(self.ticks):
            held |= {name for name, _, how in accesses(tk) if how == "write"}
            held -= {name for name, lt in last.items() if lt == t and name not in carried}
            out.append(sum(stage_bytes[j] for _, j, _ in held))
        return np.asarray(out, float)

    def sends_per_tick(self) -> np.ndarray:
        """[ticks, workers] point-to-point sends (partial and sum) each worker makes."""
        out = np.zeros((len(self.ticks), self.workers), np.int64)
        for t, tk in enumerate(self.ticks):
            for _, _, pairs in tk.partials:
                for src, _ in pairs:
                    out[t, src] += 1
            for _, _, pairs, _ in tk.sums:
                for src, _ in pairs:
                    out[t, src] += 1
        return out


@functools.lru_cache(maxsize=64)
def ring_ticks(rule: str, workers: int, stages: int, ticks: str = "whole") -> RingTicks:
    """The ring's period for `rule` (cdp-v1, cdp-v2, paper-code), read from `cdp_table`;
    a ConfigError naming the read and the ticks where the table has a read the ring
    cannot serve."""
    if rule not in ("cdp-v1", "cdp-v2", "paper-code"):
        raise ConfigError(f"the ring runs the cyclic rules cdp-v1, cdp-v2, paper-code, not {rule!r}")
    check_sizes(workers, stages, ticks)
    N, L = int(workers), int(stages)
    table = cdp_table(rule, N, L, steps=8, ticks=ticks)
    problems = acausal_reads(table) + [f"worker {r} gets stage {j}'s sum after its deadline"
                                       for r, j in table.meta["late"]]
    if problems:
        raise ConfigError(f"cdp_impl='ring' cannot run rule {rule} with workers={N}, stages={L}: "
                          f"{problems[0]} ({len(problems)} worker/stage pairs read that early); "
                          f"use cdp_impl='simulate'")
    periods = [_ring_window(table, m) for m in (4, 5)]
    if periods[0] != periods[1]:
        raise AssertionError(f"{rule} N={N} L={L}: the ring's period is not periodic")
    ticks = periods[0]
    lags = [op[3] for tk in ticks for op in tk.ops] + [a[1] for tk in ticks for a in tk.applies]
    counts = np.zeros((N, L), int)
    for t, w, j, _ in table.meta["applies"]:
        counts[w, j] += t < 4 * table.period
    newest = tuple(int(np.argmax(counts[:, j])) for j in range(L))
    return RingTicks(rule, N, L, ticks, max(lags), _live(ticks, N), newest)


def _ring_window(table, m):
    # Long on purpose: one pass over the window's ops and messages fills every event list of its ticks.
    T = table.period
    grad = gradient_kind(any(o.kind == "W" for o in table.ops))
    lo, hi = m * T, (m + 1) * T
    ticks = [dict(ops=[], chain_start=set(), completes=[], partials={}, sums={}, applies={}) for _ in range(T)]
    u_tick = {(u.stage, u.step): u.tick for u in table.updates}
    received = {(msg.dst, msg.stage, msg.step) for msg in table.messages if msg.kind == "partial"}
    completer = {}
    for o in table.ops:
        if o.kind == grad and u_tick[(o.stage, o.step)] == o.tick:
            completer[(o.stage, o.step)] = o.device
        if lo <= o.tick < hi:
            tk = ticks[o.tick - lo]
            tk["ops"].append((o.device, o.kind, o.stage, m - o.step))
            if o.kind == grad and (o.device, o.stage, o.step) not in received:
                tk["chain_start"].add((o.device, o.stage))
            if o.kind == grad and u_tick[(o.stage, o.step)] == o.tick:
                tk["completes"].append((o.device, o.stage, m - o.step))
    # Who holds each sum when: from its arrival (the completer: u) to its last use.
    arrive, end = {}, {}
    for (j, k), c in completer.items():
        arrive[(j, k, c)] = u_tick[(j, k)]
    for msg in table.messages:
        if msg.kind == "sum":
            arrive[(msg.stage, msg.step, msg.dst)] = msg.tick
            key = (msg.stage, msg.step, msg.src)
            end[key] = max(end.get(key, -1), msg.tick)
    applied = {}
    for t, w, j, k in table.meta["applies"]:
        applied[(j, k, w)] = t
        end[(j, k, w)] = max(end.get((j, k, w), -1), t)
    for msg in table.messages:
        if not lo <= msg.tick < hi:
            continue
        tk, lag = ticks[msg.tick - lo], m - msg.step
        if msg.kind == "partial":
            tk["partials"].setdefault((msg.stage, lag), []).append((msg.src, msg.dst))
        else:
            tk["sums"].setdefault((msg.stage, lag), []).append((msg.src, msg.dst))
    out = []
    for t, tk in enumerate(ticks):
        tick = lo + t
        sums = []
        for (j, lag), pairs in sorted(tk["sums"].items()):
            k = m - lag
            dst = {d for _, d in pairs}
            keep = any(arrive.get((j, k, w), tick) < tick or (w == completer[(j, k)] and arrive[(j, k, w)] == tick)
                       for w in range(table.workers) if w not in dst and end.get((j, k, w), -1) > tick)
            sums.append((j, lag, tuple(sorted(pairs)), keep))
        receivers = {(j, lag, d) for j, lag, pairs, _ in sums for _, d in pairs}
        applies = {}
        for (j, k, w), at in applied.items():
            if at == tick:
                lag = m - k
                applies.setdefault((j, lag, (j, lag, w) in receivers), []).append(w)
        out.append(RingTick(
            gradient_kinds=(grad,),
            ops=tuple(sorted(tk["ops"])),
            chain_start=frozenset(tk["chain_start"]),
            completes=tuple(sorted(tk["completes"])),
            partials=tuple((j, lag, tuple(sorted(p))) for (j, lag), p in sorted(tk["partials"].items())),
            sums=tuple(sums),
            applies=tuple((j, lag, tuple(sorted(ws)), after) for (j, lag, after), ws in sorted(applies.items())),
        ))
    return tuple(out)


def accesses(tk):
    """(gradient buffer, worker, 'read' | 'write') of one tick, in the order the tick runs them."""
    for w, kind, j, lag in tk.ops:
        if kind in tk.gradient_kinds and (w, j) not in tk.chain_start:
            yield ("partial", j, lag), w, "read"
    for w, j, lag in tk.completes:
        yield ("sum", j, lag), w, "write"
    for j, lag, ws, after in tk.applies:
        if not after:
            for w in ws:
                yield ("sum", j, lag), w, "read"
    for j, lag, pairs, _ in tk.sums:
        for src, _ in pairs:
            yield ("sum", j, lag), src, "read"
    for j, lag, pairs in tk.partials:
        for _, dst in pairs:
            yield ("partial", j, lag), dst, "write"
    for j, lag, pairs, _ in tk.sums:
        for _, dst in pairs:
            yield ("sum", j, lag), dst, "write"
    for j, lag, ws, after in tk.applies:
        if after:
            for w in ws:
                yield ("sum", j, lag), w, "read"


def _live(ticks, N):
    """Gradient buffers a period reads before writing them (on some worker): they come from
    the previous period, where the same step's buffer had lag - 1; one a period never
    writes but must hand on (its step is idle in between) is live at every lag it spans."""
    first, written = {}, set()
    for tk in ticks:
        for buf, w, how in accesses(tk):
            first.setdefault((buf, w), how)
            if how == "write":
                written.add((buf, w))
    live = {(buf, w) for (buf, w), how in first.items() if how == "read"}
    todo = list(live)
    while todo:  # the previous period's value comes from lag - 1, written there or handed on
        (kind, j, lag), w = todo.pop()
        src = ((kind, j, lag - 1), w)
        if lag - 1 >= 1 and src not in written and src not in live and first.get(src) != "write":
            live.add(src)
            todo.append(src)
    return tuple(sorted({buf for buf, _ in live}))


def refuse_other_tables(table: TimeTable, engine: str) -> None:
    """The ring engines build their period from CDP's own table of the same rule, workers,
    stages and ticks, not from `table`'s ops: a ConfigError naming the first op where
    `table` is another schedule (or has a kind with no ring piece), rather than running
    CDP's in its place."""
    op_kinds.refuse_unknown(sorted({o.kind for o in table.ops}), ("F", "B", "W"), engine)
    rule = table.meta.get("rule", table.method)
    own = cdp_table(rule, table.workers, table.stages, table.steps, table.meta.get("ticks", "whole"))
    theirs, ours = set(table.ops), set(own.ops)
    if theirs != ours:  # name an op of the other schedule's own first, else one of CDP's it lacks
        op = min(theirs - ours or ours - theirs, key=lambda o: (o.tick, o.device, o.stage))
        where = "has" if op in theirs else "lacks"
        raise ConfigError(f"{engine} runs CDP's own {rule} tables, and this {table.method} table {where} "
                          f"{op.kind}{op.stage} of worker {op.device}, step {op.step} at tick {op.tick}, "
                          f"which CDP's (workers={table.workers}, stages={table.stages}) "
                          f"{'does not' if where == 'has' else 'does'}: a new schedule runs on the "
                          f"stage-axis engine (docs/extending.md)")


def lower_ring(table: TimeTable, residuals: str = "recompute") -> Program:
    """The ring's program of a cyclic table (its rule, workers, stages and ticks)."""
    refuse_other_tables(table, "the ring engine")
    carry = carries(residuals)
    rule = table.meta.get("rule", table.method)
    cdp_ticks = table.meta.get("ticks", "whole")
    ticks = ring_ticks(rule, table.workers, table.stages, cdp_ticks)
    N, L = ticks.workers, ticks.stages
    stages = range(L)
    between = [Buffer("params", "parameters", Size.stages("param", stages), True),
               Buffer("opt", "optimizer_state", Size.stages("param", stages), True),
               Buffer("model_state", "model_state", Size.stages("model_state", stages), True),
               Buffer("acts", "activations", Size.stages("input", stages), True),
               Buffer("cots", "cotangents", Size.stages("input", range(1, L)), True),
               Buffer("labels", "labels", Size.stage("label", 0), True)]
    if carry:
        between.append(Buffer("kept", "residuals", Size.stages("residual", stages), True))
    carried = {(kind, j, lag - 1) for kind, j, lag in ticks.live}
    first, last = {}, {}
    for t, tk in enumerate(ticks.ticks):
        for name, _, _ in accesses(tk):
            first.setdefault(name, t)
            last[name] = t
    gradients = []
    for name in sorted(set(first) | set(ticks.live)):
        kind, j, lag = name
        label = f"{kind}.{j}.{lag}"
        if name in ticks.live:
            gradients.append(Buffer(label, "gradients", Size.stage("param", j), True))
        else:  # written and last read within the call (or handed on to the next call under another lag)
            end = ticks.period_ticks - 1 if name in carried else last[name]
            gradients.append(Buffer(label, "gradients", Size.stage("param", j), False, (first[name], end)))
    sends = []
    for t, tk in enumerate(ticks.ticks):
        for j, _, pairs in tk.partials:
            sends.append(Send(t, "partial", Size.stage("param", j), tuple(pairs), j))
        for j, _, pairs, _ in tk.sums:
            sends.append(Send(t, "sum", Size.stage("param", j), tuple(pairs), j))
    kinds = tuple(k for k in ("F", "B", "W") if any(op[1] == k for tk in ticks.ticks for op in tk.ops))
    placement = Placement(tuple((j,) for j in stages), (0,) * L, tuple(stages), N, L)
    return Program(table.method, "ring", ticks.period_ticks, ticks.max_lag, N, 1, kinds, cdp_ticks == "split",
                   residuals, 1, bool(ticks.live), placement, tuple(between + gradients), tuple(sends), ticks)


__all__ = ["RingTick", "RingTicks", "accesses", "lower_ring", "ring_ticks"]
