"""Lowering for cdp-zero: a cyclic table's ops and updates as the per-tick events of one period,
with every buffer a worker holds named (the table alone: any table the engine can serve).

cdp-zero runs on the ring engine's machinery (`cdpjax.methods.cdp_zero`, built on
`cdpjax.methods.ring`): one worker per device of `data`, the period unrolled or one scan
over its ticks whose ops and messages are data (`zero_period`, `zero_routing`; its sends
`zero_events(as_data=True)`). What differs from the ring is where the parameters live:
every worker keeps its piece (1/N) of every stage, so its program names

- `master[j][r]`: the worker's piece of stage j, version row r (0 current, 1 previous),
  `opt_state[j]` the optimizer state of that piece, `sums[j]` its running sum of that piece
  of the stage's gradient (train state: a step's sum may span a call's end); each in
  the piece's own size, the same on every device;
- `relay[r]`: a stage a worker is visiting, gathered from every worker's piece at the
  start of the visit (one row per stage it visits at once; in the train state, since a
  visit may run on into the next call), as long as the largest stage.

Per tick, in order: the gathers (each other worker sends its piece of the version a visit
reads, read after the previous tick's updates), the ops (F, B, W reading a relay row; a
gradient op's gradient cut into pieces, each sent to its keeper and added to its running
sum at the end of the tick, or starting it for the step's first), the updates at the end of
their update ticks (every worker, its pieces). A relay row's index is the same for the same
event in every period (circular interval colouring over the period).
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import NamedTuple

import numpy as np

from cdpjax import kinds as op_kinds
from cdpjax.errors import ConfigError
from cdpjax.kinds import gradient_kind
from cdpjax.program import Buffer, Placement, Program, Size, carries, op_branches
from cdpjax.program import events as ev


def served() -> tuple[str, ...]:
    """The kinds the engine has a piece for, by their flags, as registered now: a forward alone, or
    backward work that starts from its output's cotangent; not local learning's op."""
    return tuple(k.name for k in op_kinds.KINDS.values() if k.single_direction)


@dataclasses.dataclass(frozen=True)
class ZeroOp:
    """Worker `worker`'s op of the tick, reading relay row `relay`; `gradient`: it completes a
    gradient of its stage, whose pieces go to their keepers at the tick's end; `starts`: it is
    the first of its step's, whose pieces start the keepers' sums (the previous step's applied)."""

    worker: int
    kind: str
    stage: int
    lag: int
    relay: int
    gradient: bool = False
    starts: bool = False


class Gather(NamedTuple):
    """Stage `stage`'s version row `row` (0 current, 1 previous), gathered from every worker's
    piece into worker `worker`'s relay row `relay` at the tick's start."""

    stage: int
    worker: int
    row: int
    relay: int


class ZeroApply(NamedTuple):
    """Every worker's update of its pieces of stage `stage` by the sum of the step fed `lag`
    calls ago, at the tick's end."""

    stage: int
    lag: int


@dataclasses.dataclass(frozen=True)
class ZeroTick:
    """One tick of cdp-zero's period: its gathers, ops and applies (in that order)."""

    gathers: tuple[Gather, ...] = ()
    ops: tuple[ZeroOp, ...] = ()
    applies: tuple[ZeroApply, ...] = ()


@dataclasses.dataclass(frozen=True)
class ZeroTicks:
    """One steady period of cdp-zero's events (`ticks`), the version rows every worker keeps of
    its pieces (`versions`), its relay rows and the oldest step a period touches (`max_lag`)."""

    workers: int
    stages: int
    ticks: tuple[ZeroTick, ...]
    versions: int  # V: version rows per stage piece
    relay_rows: int  # R: the most stages a worker visits at once (2 with paired forwards)
    max_lag: int


def _circular_slots(arcs: dict, period: int) -> tuple[dict, int]:
    """A row per arc (key -> (start, end) ticks, end >= start, length <= period), the same rows
    every period: greedy by start over the circle, an arc taking the first row none of whose
    arcs shares a tick with it modulo the period."""
    taken = defaultdict(set)  # row -> ticks modulo the period
    out = {}
    for key, (start, end) in sorted(arcs.items(), key=lambda kv: (kv[1][0] % period, kv[1][0], str(kv[0]))):
        ticks = {t % period for t in range(start, end + 1)}
        row = next(r for r in range(len(taken) + 1) if not taken[r] & ticks)
        taken[row] |= ticks
        out[key] = row
    return out, max(len([r for r in taken if taken[r]]), 1)


@dataclasses.dataclass(frozen=True)
class Visit:
    """A worker's consecutive ops on one stage of one step: their ticks, kinds and the version
    they read, and the row every worker keeps its piece of that version in at the visit's first
    tick (0 current, 1 previous: updates apply at their update ticks, every worker at once)."""

    worker: int
    stage: int
    step: int
    ticks: tuple[int, ...]
    kinds: tuple[str, ...]
    version: int
    row: int


def visits(table) -> list[Visit]:
    """The table's visits (`Visit`), in order of their first tick; a ConfigError naming the first op
    whose visit reads two versions or a version neither stored row holds (updates of a stage
    applied at their update ticks, every worker at once)."""
    done = {}
    for u in table.updates:
        done.setdefault(u.stage, []).append(u.tick)
    by_worker = {}
    for o in sorted(table.ops, key=lambda o: (o.tick, o.stage)):
        by_worker.setdefault(o.device, []).append(o)
    out = []
    for ops in by_worker.values():
        group = [ops[0]]
        for o in ops[1:] + [None]:
            prev = group[-1]
            if o is not None and (o.stage, o.step, o.tick) == (prev.stage, prev.step, prev.tick + 1):
                group.append(o)
                continue
            first = group[0]
            applied = sum(t < first.tick for t in done.get(first.stage, []))
            row = applied - first.version
            bad = next((x for x in group if x.version != first.version), None)
            if bad is not None or row not in (0, 1):
                x = bad or first
                raise ConfigError(f"the cdp-zero engine cannot run this {table.method} table: worker {x.device}'s "
                                  f"{x.kind}{x.stage} of step {x.step} at tick {x.tick} reads version {x.version}, "
                                  f"with {applied} update(s) of stage {x.stage} applied: every worker keeps the "
                                  f"current and the previous version only, one per visit")
            out.append(Visit(first.device, first.stage, first.step, tuple(x.tick for x in group),
                             tuple(x.kind for x in group), first.version, row))
            group = [o]
    return sorted(out, key=lambda v: (v.ticks[0], v.worker))


def zero_ticks(table) -> ZeroTicks:
    """The per-tick events of one period of `table` for cdp-zero (module docstring), from the
    table's own ops and updates: every event of one whole step k at tick t lands at tick t mod T
    with lag t // T - k, and every other whole step must land on the same events. A ConfigError
    names the first op the engine cannot serve."""
    # Long on purpose: the checks of what the engine needs, then one pass that folds a step's events.
    N, L, T = table.workers, table.stages, table.period
    op_kinds.refuse_unknown(sorted({o.kind for o in table.ops}), served(), "the cdp-zero engine")
    grad = gradient_kind(table.split_backward)
    all_visits = visits(table)
    gradients = {}
    for o in sorted(table.ops, key=lambda o: (o.tick, o.device)):
        if o.kind == grad:
            gradients.setdefault((o.stage, o.step), []).append((o.tick, o.device))
    update_tick = {(u.stage, u.step): u.tick for u in table.updates}
    for (j, k), ops in gradients.items():  # one running sum per stage: a step's sum is applied before the next's
        u, later = update_tick.get((j, k)), gradients.get((j, k + 1))
        if u is not None and (ops[-1][0] > u or (later and later[0][0] <= u)):
            raise ConfigError(f"the cdp-zero engine cannot run this {table.method} table: stage {j}'s gradient "
                              f"sums of steps {k} and {k + 1} overlap (one running sum per stage)")
    whole = [k for k in range(table.steps) if all((j, k) in update_tick for j in range(L))]
    if not whole:
        raise ConfigError(f"the cdp-zero engine needs one step of this {table.method} table laid out whole")

    def fold(step):
        def at(t):
            lag = t // T - step
            if lag < 0:
                raise ConfigError(f"the cdp-zero engine cannot run this {table.method} table: an event of step "
                                  f"{step} at tick {t} is before worker 0 starts that step (tick {step * T})")
            return t % T, lag

        mine = [v for v in all_visits if v.step == step]
        rows, relay_rows = {}, 1
        for w in range(N):
            arcs = {(v.stage, v.kinds[0]): (v.ticks[0], v.ticks[-1]) for v in mine if v.worker == w}
            got, n = _circular_slots(arcs, T)
            rows[w], relay_rows = got, max(relay_rows, n if arcs else 1)
        events = [dict(gathers=[], ops=[], applies=[]) for _ in range(T)]
        visit_of = {(v.worker, t, v.stage): v for v in mine for t in v.ticks}
        for v in mine:
            relay = rows[v.worker][(v.stage, v.kinds[0])]
            events[at(v.ticks[0])[0]]["gathers"].append(Gather(v.stage, v.worker, v.row, relay))
        for o in table.ops:
            if o.step == step:
                v = visit_of[(o.device, o.tick, o.stage)]
                t, lag = at(o.tick)
                first = gradients.get((o.stage, o.step), ((None, None),))[0]
                events[t]["ops"].append(ZeroOp(o.device, o.kind, o.stage, lag, rows[v.worker][(v.stage, v.kinds[0])],
                                               o.kind == grad, o.kind == grad and first == (o.tick, o.device)))
        for j in range(L):
            t, lag = at(update_tick[(j, step)])
            events[t]["applies"].append(ZeroApply(j, lag))
        ticks = tuple(ZeroTick(tuple(e["gathers"]), tuple(sorted(e["ops"], key=lambda z: (z.worker, z.kind,
                                                                                          z.stage))),
                               tuple(sorted(e["applies"]))) for e in events)
        return ticks, relay_rows

    folds = {k: fold(k) for k in whole}
    ticks, relay_rows = folds[whole[-1]]

    def any_row(z):  # step 0's stale reads take theta_0, which both rows hold then
        return tuple(dataclasses.replace(tk, gathers=tuple((j, w, 0, r) for j, w, _, r in tk.gathers)) for tk in z)

    if any((any_row(f[0]), f[1]) != (any_row(ticks), relay_rows) if k == 0 else f != (ticks, relay_rows)
           for k, f in folds.items()):
        raise ConfigError(f"the cdp-zero engine runs a table that repeats every {T} ticks, and the steps of this "
                          f"{table.method} table {whole} differ once folded onto one period")
    versions = 2 if any(v.row == 1 for v in all_visits) else 1
    lags = [op.lag for tk in ticks for op in tk.ops] + [lag for tk in ticks for _, lag in tk.applies]
    if versions == 2 and max(lags) > 1:  # the runtime's restart after an unfed call assumes it
        raise ConfigError(f"the cdp-zero engine cannot run this {table.method} table: ops {max(lags)} calls back "
                          f"read a previous version")
    return ZeroTicks(N, L, ticks, versions, relay_rows, max(lags))


def zero_program_period(program: Program) -> ZeroTicks:
    """cdp-zero's period as `program`'s events say it, what both runtimes run
    (`cdpjax.methods.cdp_zero`): read from `program.events` and its typed fields (period, devices,
    placement, split_backward, versions, lag) alone, never from the lowering's own `ZeroTicks`.

    On the timeline of one step (an event at tick t of lag l is at t + l * T), each `Gather` starts
    a visit of its worker to its stage and each of that worker's `Compute`s on the stage belongs to
    the visit of the latest gather at or before it; a visit's relay row is a pure function of the
    visits (`_circular_slots`, as the lowering assigns them). A `Compute` is an op reading its
    visit's row; it is a gradient op (its pieces sent to their keepers) iff its kind is the
    gradient kind, and starts its step's sums iff it says so (`starts_sum`); the `Apply`s of a
    stage (one on every worker) are its update."""
    T, N, L = program.period, program.devices, len(program.placement.units)
    grad = gradient_kind(program.split_backward)
    at = lambda e: e.tick + e.lag * T  # noqa: E731
    computes = [e for e in program.events if isinstance(e, ev.Compute)]
    gathers = sorted((e for e in program.events if isinstance(e, ev.Gather)), key=lambda g: (at(g), g.device,
                                                                                              g.stage))
    starts: dict = defaultdict(list)  # (worker, stage) -> its visits' first ticks on the step's timeline
    for g in gathers:
        starts[(g.device, g.stage)].append(at(g))

    def visit_of(c):  # (worker, stage, first tick): the visit of the latest gather at or before it
        first = max((s for s in starts[(c.device, c.stage)] if s <= at(c)), default=None)
        if first is None:
            raise ValueError(f"{program.method}: {c} reads a stage its worker never gathered before it (each of "
                             f"cdp-zero's Computes reads the stage of its worker's latest Gather of that stage)")
        return c.device, c.stage, first

    first_kind, last = {}, {}  # visit -> the kind of its first op, the tick of its last
    for c in sorted(computes, key=lambda c: (at(c), c.stage)):
        v = visit_of(c)
        first_kind.setdefault(v, c.kind)
        last[v] = max(last.get(v, at(c)), at(c))
    idle = next((g for g in gathers if (g.device, g.stage, at(g)) not in first_kind), None)
    if idle is not None:
        raise ValueError(f"{program.method}: {idle} starts a visit with no Compute (each of cdp-zero's Gathers "
                         f"starts a visit of at least one op of its worker on its stage)")
    visits_of = defaultdict(list)  # worker -> its visits' (stage, first tick)
    for w, j, s in first_kind:
        visits_of[w].append((j, s))
    relay, relay_rows = {}, 1
    for w, mine in visits_of.items():
        rows, n = _circular_slots({(j, first_kind[(w, j, s)]): (s, last[(w, j, s)]) for j, s in mine}, T)
        relay.update({(w, j, s): rows[(j, first_kind[(w, j, s)])] for j, s in mine})
        relay_rows = max(relay_rows, n)
    by_tick = [dict(gathers=[], ops=[], applies=set()) for _ in range(T)]
    for g in gathers:
        by_tick[g.tick]["gathers"].append(Gather(g.stage, g.device, g.row, relay[(g.device, g.stage, at(g))]))
    for c in computes:
        by_tick[c.tick]["ops"].append(ZeroOp(c.device, c.kind, c.stage, c.lag, relay[visit_of(c)], c.kind == grad,
                                             c.starts_sum))
    for e in program.events:
        if isinstance(e, ev.Apply):
            by_tick[e.tick]["applies"].add(ZeroApply(e.stage, e.lag))
    ticks = tuple(ZeroTick(tuple(x["gathers"]), tuple(sorted(x["ops"], key=lambda z: (z.worker, z.kind, z.stage))),
                           tuple(sorted(x["applies"]))) for x in by_tick)
    return ZeroTicks(N, L, ticks, program.versions, relay_rows, program.lag)


def worker_ops(tk: ZeroTick, worker: int) -> list[ZeroOp]:
    """The worker's ops of the tick in the order it runs them (`tk.ops`' order: by kind, then stage)."""
    return [op for op in tk.ops if op.worker == worker]


class ZeroRouting(NamedTuple):
    """cdp-zero's period as data, for a scanned period (every array indexed by tick t, then worker w).

    Ops: per position k (a worker's ops of one tick in `worker_ops` order, k < positions),
    `op_branch[t, w, k]`: index into `op_kinds[k]` ((kind, stage) pairs; len(op_kinds[k]) where the
    worker has no k-th op), `op_lag` its step's lag (it runs iff that step was fed), `op_relay` the
    relay row it reads, `op_slot` the gradient slot its gradient op writes (0 for other ops).

    Gathers: per gather slot g (a worker's gathers of one tick, g < gather_slots), the stage
    `gather_stage[t, w, g]` (stages where none) whose version row `gather_row` every worker's piece
    of lands in the visitor's relay row `gather_relay`. Gradient pieces: per gradient slot s,
    `grad_stage[t, w, s]` (stages where none) of worker w's s-th gradient op of the tick, its lag
    `grad_lag` and whether it starts its step's sums (`grad_starts`). Each slot crosses every route
    every tick (one all-to-all each, whether used or not): the messages as data."""

    op_kinds: tuple[tuple[tuple[str, int], ...], ...]
    op_branch: np.ndarray
    op_lag: np.ndarray
    op_relay: np.ndarray
    op_slot: np.ndarray
    gather_stage: np.ndarray
    gather_row: np.ndarray
    gather_relay: np.ndarray
    grad_stage: np.ndarray
    grad_lag: np.ndarray
    grad_starts: np.ndarray


def slots(z: ZeroTicks) -> tuple[int, int]:
    """(gather slots, gradient slots): the most gathers, and the most gradient ops, one worker has in
    one tick of `z` (at least 1 each: an all-to-all of each kind crosses every tick)."""
    per = [(sum(g.worker == w for g in tk.gathers), sum(op.gradient for op in worker_ops(tk, w)))
           for tk in z.ticks for w in range(z.workers)]
    return max([1] + [g for g, _ in per]), max([1] + [s for _, s in per])


def zero_routing(z: ZeroTicks) -> ZeroRouting:
    """`z`'s ops and messages as the integer arrays a scanned period indexes by (tick, worker, slot)."""
    T, N, L = len(z.ticks), z.workers, z.stages
    per_worker = [[worker_ops(tk, w) for w in range(N)] for tk in z.ticks]
    kinds, branch = op_branches(per_worker)
    lag, relay, slot = (np.zeros(branch.shape, np.int32) for _ in range(3))
    G, S = slots(z)
    gather_stage, gather_row, gather_relay = np.full((T, N, G), L, np.int32), *(np.zeros((T, N, G), np.int32)
                                                                                for _ in range(2))
    grad_stage, grad_lag, grad_starts = np.full((T, N, S), L, np.int32), np.zeros((T, N, S), np.int32), \
        np.zeros((T, N, S), bool)
    for t, tk in enumerate(z.ticks):
        for w in range(N):
            s = 0
            for k, o in enumerate(per_worker[t][w]):
                lag[t, w, k], relay[t, w, k] = o.lag, o.relay
                if o.gradient:
                    slot[t, w, k] = s
                    grad_stage[t, w, s], grad_lag[t, w, s], grad_starts[t, w, s] = o.stage, o.lag, o.starts
                    s += 1
            for g, gather in enumerate(x for x in tk.gathers if x.worker == w):
                gather_stage[t, w, g], gather_row[t, w, g], gather_relay[t, w, g] = gather.stage, gather.row, \
                    gather.relay
    return ZeroRouting(kinds, branch, lag, relay, slot, gather_stage, gather_row, gather_relay, grad_stage, grad_lag,
                       grad_starts)


def _gradient_ticks(z: ZeroTicks) -> tuple[int, int]:
    ticks = [t for t, tk in enumerate(z.ticks) if any(op.gradient for op in tk.ops)]
    return (ticks[0], ticks[-1]) if ticks else (0, 0)


PERIODS = ("unrolled", "scan")


def lower_zero(table, residuals: str = "recompute", period: str = "unrolled") -> Program:
    """cdp-zero's program of a cyclic table: its period from the table's own events (`zero_ticks`),
    its messages as the period form sends them (`zero_events`)."""
    if period not in PERIODS:
        raise ConfigError(f"zero_period={period!r} is not one of {', '.join(PERIODS)}")
    carry = carries(residuals)
    z = zero_ticks(table)
    L, N = z.stages, z.workers
    stages = range(L)
    every = tuple((j,) for j in stages)
    piece = Size.stages("param", stages, parts=N)  # a worker's piece of every stage
    buffers = [Buffer("master", "parameters", piece, True),
               Buffer("opt_state", "optimizer_state", piece, True),
               Buffer("sums", "gradients", piece, True),
               Buffer("relay", "relayed_parameters", Size("param", every, True, z.relay_rows), True),
               # one op's whole gradient, before its pieces go out
               Buffer("gradient", "gradients", Size("param", every, True, 1), False, _gradient_ticks(z)),
               Buffer("model_state", "model_state", Size.stages("model_state", stages), True),
               Buffer("acts", "activations", Size.stages("input", stages), True),
               Buffer("cots", "cotangents", Size.stages("input", range(1, L)), True),
               Buffer("labels", "labels", Size.stage("label", 0), True),
               # which of the last calls fed a batch (an op of an unfed call's step does nothing)
               Buffer("fed", "flags", Size("flag", ((0,),), False, max(z.max_lag, 1)), True)]
    if period == "scan":  # the all-to-alls' slots, each a stage's N pieces at the widest piece's length: the
        G, S = slots(z)  # gathers' sent and received, the gradients' received (sent: the ops' `gradient`)
        buffers += [Buffer("gather_slots", "relayed_parameters", Size("param", every, True, 2 * G), False),
                    Buffer("gradient_slots", "gradients", Size("param", every, True, S), False)]
    if z.versions == 2:
        buffers.append(Buffer("previous", "previous_parameters", piece, True))
    if carry:
        buffers.append(Buffer("residuals", "residuals", Size.stages("residual", stages), True))
    kinds = tuple(k for k in served() if any(op.kind == k for tk in z.ticks for op in tk.ops))
    placement = Placement(every, (0,) * L, tuple(stages), N, L)
    return Program(table.method, "ring", len(z.ticks), z.max_lag, N, 1, kinds, table.split_backward, residuals,
                   z.versions, True, placement, tuple(buffers), zero_events(z, period == "scan"))


def zero_events(z: ZeroTicks, as_data: bool = False) -> tuple[ev.Event, ...]:
    """The period's typed events: each visit's `Gather` of its stage's version row at the start of
    its first tick, from the pieces every other worker sent at the end of the tick before (a
    'parameters' `Send` and `Receive` each; they carry no step: lag 0); each op as a `Compute`
    reading the row its visit gathered (a step's first gradient op `starts_sum`: its pieces start
    the keepers' sums); each gradient op's pieces sent to their keepers ('partial'); each update as
    every worker's `Apply` to its piece (`zero_program_period` reads the period back from these).

    Unrolled (`as_data` False), each piece crosses at its own size from its sender to its visitor
    or keeper only. As data (the scanned period, `zero_routing`), every tick every worker sends
    every other one each gather slot and each gradient slot (`slots`), each a piece of the largest
    stage, used or not: what its all-to-alls carry."""
    N, T = z.workers, len(z.ticks)
    parts = max(N, 1)
    events: list[ev.Event] = []
    sends: list[ev.Send] = []
    gathered = {}  # (worker, relay row) -> the version row its latest gather holds
    for t, tk in enumerate(z.ticks + z.ticks):  # twice round: a visit may start in the previous period
        for g in tk.gathers:
            gathered[(g.worker, g.relay)] = g.row
        if t < T:
            continue
        t -= T
        for g in tk.gathers:
            lag = next(op.lag for op in tk.ops if (op.worker, op.stage) == (g.worker, g.stage))
            events.append(ev.Gather(t, g.worker, g.stage, parts, g.row, lag))
            if not as_data:
                sends += [ev.Send((t - 1) % T, "parameters", Size.stage("param", g.stage, parts=N), u, g.worker,
                                  g.stage) for u in range(N) if u != g.worker]
        for op in tk.ops:
            events.append(ev.Compute(t, op.worker, op.kind, op.stage, 0, gathered[(op.worker, op.relay)], op.lag,
                                     starts_sum=op.starts))
            if op.gradient and not as_data:
                sends += [ev.Send(t, "partial", Size.stage("param", op.stage, parts=N), op.worker, u, op.stage, op.lag)
                          for u in range(N) if u != op.worker]
        events += [ev.Apply(t, w, j, parts, lag) for j, lag in tk.applies for w in range(N)]
    if as_data:
        sends = _slot_sends(z)
    return ev.sorted_events(events + ev.messages(sends))


def _slot_sends(z: ZeroTicks) -> list[ev.Send]:
    """The scanned period's messages (`zero_events`): per tick and route, each gather slot's piece at
    the end of the tick before and each gradient slot's after the tick's ops, as long as the largest
    stage's piece; a used slot names the stage it carries (an unused one stage 0)."""
    N, T, L = z.workers, len(z.ticks), z.stages
    widest = Size("param", tuple((j,) for j in range(L)), True, 1, N)
    r = zero_routing(z)
    G, S = r.gather_stage.shape[-1], r.grad_stage.shape[-1]
    sends = []
    for t in range(T):
        for u in range(N):
            for w in range(N):
                if u == w:
                    continue
                for g in range(G):  # u's piece for w's g-th gather
                    j = int(r.gather_stage[t, w, g])
                    sends.append(ev.Send((t - 1) % T, "parameters", widest, u, w, j if j < L else 0))
                for s in range(S):  # u's s-th gradient's piece w
                    j = int(r.grad_stage[t, u, s])
                    sends.append(ev.Send(t, "partial", widest, u, w, j if j < L else 0,
                                         int(r.grad_lag[t, u, s]) if j < L else 0))
    return sends


__all__ = ["PERIODS", "Gather", "Visit", "ZeroApply", "ZeroOp", "ZeroRouting", "ZeroTick", "ZeroTicks", "lower_zero",
           "slots", "visits", "worker_ops", "zero_events", "zero_program_period", "zero_routing", "zero_ticks"]
