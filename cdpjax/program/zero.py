"""Lowering for cdp-zero: the plan (`cdpjax.layouts.cdp_zero.zero_plan`) as the per-tick events
of one period, with every buffer a worker holds named.

cdp-zero runs on the ring engine's machinery (`cdpjax.methods.cdp_zero`, built on
`cdpjax.methods.ring`): one worker per device of `data`, the period unrolled. What
differs from the ring is where the parameters live: every worker keeps its piece (1/N)
of every stage, so its program names

- `master[j][r]`: the worker's piece of stage j, version row r (0 current, 1 previous),
  `opt[j]` the optimizer state of that piece, `sums[j]` its running sum of that piece
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
import functools
from collections import defaultdict

from cdpjax.kinds import gradient_kind
from cdpjax.layouts.cdp_zero import zero_plan
from cdpjax.program import Buffer, Placement, Program, Send, Size, carries
from cdpjax.program.ring import refuse_other_tables


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


@dataclasses.dataclass(frozen=True)
class ZeroTick:
    """gathers: (stage, worker, version row, relay row), the stage gathered into the worker's
    relay row at the tick's start. ops. applies: (stage, lag), every worker's update of its
    pieces at the tick's end."""

    gathers: tuple = ()
    ops: tuple = ()
    applies: tuple = ()


@dataclasses.dataclass(frozen=True)
class ZeroTicks:
    rule: str
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


def _relay_rows(plan, lo: int, T: int) -> tuple[dict, int]:
    """Visit -> its relay row, the same for a visit of another step shifted by whole periods; and
    how many rows. A visit holds its row from its first tick to its last."""
    arcs = defaultdict(dict)
    for v in plan.visits:
        arcs[v.worker][(v.stage, v.kinds[0], v.step)] = (v.ticks[0], v.ticks[-1])
    rows = {w: _circular_slots({k: x for k, x in a.items() if lo <= x[0] < lo + T}, T) for w, a in arcs.items()}

    def row(v) -> int:
        shift = -((v.ticks[0] - lo) // T)  # whole periods that bring its start into the period
        return rows[v.worker][0][(v.stage, v.kinds[0], v.step + shift)]

    return row, max((n for _, n in rows.values()), default=1)


@functools.lru_cache(maxsize=64)
def zero_ticks(rule: str, workers: int, stages: int, ticks: str = "whole") -> ZeroTicks:
    """The per-tick events of one steady period of cdp-zero's plan (module docstring)."""
    plan = zero_plan(rule, workers, stages, ticks)
    base = plan.table
    T, m = base.period, 3  # a steady period: steps m-1..m+1 are laid out whole around it
    lo, hi = m * T, (m + 1) * T
    grad = gradient_kind(ticks == "split")
    relay_row, relay_rows = _relay_rows(plan, lo, T)
    events = [dict(gathers=[], ops=[], applies=[]) for _ in range(T)]
    visit_of = {(v.worker, t, v.stage): v for v in plan.visits for t in v.ticks}
    for v in plan.visits:
        if lo <= v.ticks[0] < hi:
            events[v.ticks[0] - lo]["gathers"].append((v.stage, v.worker, v.row, relay_row(v)))
    for o in base.ops:
        if lo <= o.tick < hi:
            v = visit_of[(o.device, o.tick, o.stage)]
            first = plan.gradients.get((o.stage, o.step), ((None, None),))[0]
            events[o.tick - lo]["ops"].append(ZeroOp(o.device, o.kind, o.stage, m - o.step, relay_row(v),
                                                     o.kind == grad, o.kind == grad and first == (o.tick, o.device)))
    for (j, k), u in plan.update_tick.items():
        if lo <= u < hi:
            events[u - lo]["applies"].append((j, m - k))
    out = tuple(ZeroTick(tuple(e["gathers"]), tuple(sorted(e["ops"], key=lambda z: (z.worker, z.kind, z.stage))),
                         tuple(sorted(e["applies"]))) for e in events)
    lags = [op.lag for tk in out for op in tk.ops] + [lag for tk in out for _, lag in tk.applies]
    if plan.versions == 2 and max(lags) > 1:  # the runtime's restart after an unfed call assumes it
        raise AssertionError(f"cdp-zero {rule}, N={workers}, L={stages}: ops {max(lags)} calls back read a "
                             f"previous version")
    return ZeroTicks(rule, workers, stages, out, plan.versions, relay_rows, max(lags))


def _gradient_ticks(z: ZeroTicks) -> tuple[int, int]:
    ticks = [t for t, tk in enumerate(z.ticks) if any(op.gradient for op in tk.ops)]
    return (ticks[0], ticks[-1]) if ticks else (0, 0)


def lower_zero(table, residuals: str = "recompute") -> Program:
    """cdp-zero's program for its table (rule, workers, stages, ticks)."""
    refuse_other_tables(table, "the cdp-zero engine")
    carry = carries(residuals)
    rule = table.meta["rule"]
    ticks = table.meta.get("ticks", "whole")
    z = zero_ticks(rule, table.workers, table.stages, ticks)
    L, N = z.stages, z.workers
    stages = range(L)
    every = tuple((j,) for j in stages)
    piece = Size.stages("param", stages, parts=N)  # a worker's piece of every stage
    buffers = [Buffer("master", "parameters", piece, True),
               Buffer("opt", "optimizer_state", piece, True),
               Buffer("sums", "gradients", piece, True),
               Buffer("relay", "relayed_parameters", Size("param", every, True, z.relay_rows), True),
               # one op's whole gradient, before its pieces go out
               Buffer("gradient", "gradients", Size("param", every, True, 1), False, _gradient_ticks(z)),
               Buffer("model_state", "model_state", Size.stages("model_state", stages), True),
               Buffer("acts", "activations", Size.stages("input", stages), True),
               Buffer("cots", "cotangents", Size.stages("input", range(1, L)), True),
               Buffer("labels", "labels", Size.stage("label", 0), True)]
    if z.versions == 2:
        buffers.append(Buffer("previous", "previous_parameters", piece, True))
    if carry:
        buffers.append(Buffer("kept", "residuals", Size.stages("residual", stages), True))
    sends = []
    for t, tk in enumerate(z.ticks):
        # a gather at the start of tick t is the messages that end tick t - 1
        for j, w, *_ in tk.gathers:
            if N > 1:
                sends.append(Send((t - 1) % len(z.ticks), "parameters", Size.stage("param", j, parts=N),
                                  tuple((u, w) for u in range(N) if u != w), j))
        for op in tk.ops:
            if op.gradient and N > 1:
                sends.append(Send(t, "partial", Size.stage("param", op.stage, parts=N),
                                  tuple((op.worker, u) for u in range(N) if u != op.worker), op.stage))
    kinds = tuple(k for k in ("F", "B", "W") if any(op.kind == k for tk in z.ticks for op in tk.ops))
    placement = Placement(every, (0,) * L, tuple(stages), N, L)
    return Program("cdp-zero", "ring", len(z.ticks), z.max_lag, N, 1, kinds, ticks == "split", residuals,
                   z.versions, True, placement, tuple(buffers), tuple(sends), z)


__all__ = ["ZeroOp", "ZeroTick", "ZeroTicks", "lower_zero", "zero_ticks"]
