"""Lowering for cdp-zero: the plan (`cdpjax.layouts.cdp_zero.zero_plan`) as the per-tick events
of one period, with every buffer a worker holds given a row.

cdp-zero runs on the ring engine's machinery (`cdpjax.methods.cdp_zero`, built on
`cdpjax.methods.ring`): one worker per device of `data`, the period unrolled. What
differs from the ring is where the parameters live, so its program names rows:

- `master[k][r]`: a worker's k-th owned stage, version row r (0 current, 1 previous),
  `opt[k]` its optimizer state; `relay`: the stage a worker is visiting, brought by
  its owner at the start of the visit (one row per stage it visits at once; in the
  train state, since a visit may run on into the next call);
  `grad[g]`: gradient rows, a partial sum received and not yet added to, a partial
  sum about to be sent, or the owner's own contribution waiting for the others'.
  Every row is as long as the largest stage (one shape on every device); every
  message is of its stage's real size (a slice of the row).
- per tick, in order: the refreshes (an owner sends a stage's version to a visiting
  worker, read after the previous tick's updates), the ops (F, B, W reading the
  relay or, for the owner, its own row; a gradient op adds its gradient to the
  partial sum it received, or starts one, in a gradient row), the partial sums sent
  at the end of the tick, the owners' updates at the end of their update ticks.

Rows of gradient sums that span the period's end stay in the train state; a
gradient row's index is the same for the same event in every period (circular
interval colouring over the period).
"""
from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict

from cdpjax.kinds import gradient_kind
from cdpjax.layouts.cdp_zero import zero_plan
from cdpjax.program import Buffer, Placement, Program, Send, Size


@dataclasses.dataclass(frozen=True)
class ZeroOp:
    """Worker `worker`'s op of the tick. params: ('relay', r) or ('master', k, row). Gradient ops:
    `grad_in` the row of the partial sum it adds to (-1: it starts one), `grad_out` the row its
    sum goes to."""

    worker: int
    kind: str
    stage: int
    lag: int
    params: tuple
    grad_in: int = -1
    grad_out: int = -1


@dataclasses.dataclass(frozen=True)
class ZeroTick:
    """refreshes: (stage, owner, worker, k, row, relay row) the owner's row sent to the worker's
    relay row at the tick's start. ops. sends: (stage, src, dst, src row, dst row) partial sums sent at its end.
    applies: (stage, owner, lag, k, rows summed) updates at its end."""

    refreshes: tuple = ()
    ops: tuple = ()
    sends: tuple = ()
    applies: tuple = ()


@dataclasses.dataclass(frozen=True)
class ZeroTicks:
    rule: str
    workers: int
    stages: int
    ticks: tuple[ZeroTick, ...]
    owners: tuple[int, ...]
    local: tuple[int, ...]  # stage -> its index among its owner's stages
    owned: int  # K: the most stages one worker owns
    versions: int  # V: rows per owned stage
    grad_rows: int  # G
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


@functools.lru_cache(maxsize=64)
def zero_ticks(rule: str, workers: int, stages: int, ticks: str = "whole") -> ZeroTicks:
    plan = zero_plan(rule, workers, stages, ticks)
    base = plan.table
    T, N, L = base.period, workers, stages
    m = 3  # a steady period: steps m-1..m+1 are laid out whole around it
    lo, hi = m * T, (m + 1) * T
    owners = plan.owners
    local = tuple(sorted(j2 for j2 in range(L) if owners[j2] == owners[j]).index(j) for j in range(L))
    owned = max(local) + 1
    grad = gradient_kind(ticks == "split")
    grad_op = {(o.device, o.stage, o.step): o.tick for o in base.ops if o.kind == grad}
    # Gradient rows: an arc per worker and sum from its first to its last tick there.
    arcs = defaultdict(dict)  # worker -> key -> (start, end)
    incoming = {}  # (worker, stage, step) -> key of the row its received partial sum is in
    # Ticks: a message lands at the end of its tick (after the ops and sends), so a row it fills
    # is taken from the next tick; an update reads its rows after the landings at the end of its
    # tick, so a row it reads stays taken into the next tick.
    for h in plan.hops:
        key = ("sum", h.stage, h.step)
        u = plan.update_tick[(h.stage, h.step)]
        last = u + 1 if h.dst == owners[h.stage] else grad_op[(h.dst, h.stage, h.step)]
        arcs[h.dst][("in",) + key] = (h.tick + 1, max(last, h.tick + 1))
        incoming[(h.dst, h.stage, h.step)] = ("in",) + key
    for (w, j, k), t in grad_op.items():  # a gradient op's sum lives in a row to the end of its tick
        u = plan.update_tick[(j, k)]
        if w == owners[j] and t != u:  # the owner's own, waiting for the others'
            arcs[w][("own", j, k)] = (t, u + 1)
        elif (w, j, k) not in incoming:  # a sum it starts: sent at the end of the tick, or applied
            arcs[w][("start", j, k)] = (t, t + 1 if w == owners[j] else t)
    # One arc per periodic event: those starting in the period; the same event of another step
    # is this one shifted by whole periods, and has its row.
    rows = {w: _circular_slots({k: v for k, v in a.items() if lo <= v[0] < hi}, T) for w, a in arcs.items()}
    G = max((n for _, n in rows.values()), default=1)

    class _Rows(dict):
        def __missing__(self, wkey):
            w, key = wkey
            start = arcs[w][key][0]
            shift = -((start - lo) // T)  # whole periods that bring its start into the period
            return rows[w][0][key[:-1] + (key[-1] + shift,)]

    row_of = _Rows()

    def early_owner(w, j, k):  # the owner's own gradient op before the others are all in
        return w == owners[j] and grad_op[(w, j, k)] != plan.update_tick[(j, k)]

    def rows_of_op(w, j, k):
        """(row it adds to or -1, row its sum goes to) of worker w's gradient op of (j, k)."""
        if early_owner(w, j, k):
            return -1, row_of[(w, ("own", j, k))]
        if (w, j, k) in incoming:
            r = row_of[(w, incoming[(w, j, k)])]
            return r, r
        return -1, row_of[(w, ("start", j, k))]

    # Relay rows: a worker's relayed visits, one row each while it lasts (two where paired
    # forwards visit two stages in one tick).
    spans = defaultdict(dict)  # a visit is known by (stage, its first op's kind, step)
    for v in plan.visits:
        if v.worker != owners[v.stage]:
            spans[v.worker][(v.stage, v.kinds[0], v.step)] = (v.ticks[0], v.ticks[-1])
    relay = {w: _circular_slots({k: x for k, x in a.items() if lo <= x[0] < hi}, T) for w, a in spans.items()}
    R = max((n for _, n in relay.values()), default=1)

    def relay_row(v):
        start = spans[v.worker][(v.stage, v.kinds[0], v.step)][0]
        return relay[v.worker][0][(v.stage, v.kinds[0], v.step - (start - lo) // T)]

    ticks = [dict(refreshes=[], ops=[], sends=[], applies=[]) for _ in range(T)]
    visit_of = {}
    for v in plan.visits:
        for t in v.ticks:
            visit_of[(v.worker, t, v.stage)] = v
        if lo <= v.ticks[0] < hi and v.worker != owners[v.stage]:
            ticks[v.ticks[0] - lo]["refreshes"].append((v.stage, owners[v.stage], v.worker, local[v.stage], v.row,
                                                        relay_row(v)))
    for o in base.ops:
        if not lo <= o.tick < hi:
            continue
        v = visit_of[(o.device, o.tick, o.stage)]
        params = ("master", local[o.stage], v.row) if o.device == owners[o.stage] else ("relay", relay_row(v))
        g_in = g_out = -1
        if o.kind == grad:
            g_in, g_out = rows_of_op(o.device, o.stage, o.step)
        ticks[o.tick - lo]["ops"].append(ZeroOp(o.device, o.kind, o.stage, m - o.step, params, g_in, g_out))
    for h in plan.hops:
        if lo <= h.tick < hi:
            src_row = rows_of_op(h.src, h.stage, h.step)[1]
            dst_row = row_of[(h.dst, incoming[(h.dst, h.stage, h.step)])]
            ticks[h.tick - lo]["sends"].append((h.stage, h.src, h.dst, src_row, dst_row))
    for (j, k), u in plan.update_tick.items():
        if lo <= u < hi:
            o = owners[j]
            if early_owner(o, j, k):  # the others' sum arrives now; its own waited since its gradient op
                summed = (row_of[(o, incoming[(o, j, k)])], row_of[(o, ("own", j, k))])
            else:  # it finished last and added the others' sum in its op
                summed = (rows_of_op(o, j, k)[1],)
            ticks[u - lo]["applies"].append((j, o, m - k, local[j], summed))
    events = tuple(ZeroTick(tuple(t["refreshes"]), tuple(sorted(t["ops"], key=lambda z: (z.worker, z.kind))),
                            tuple(t["sends"]), tuple(t["applies"])) for t in ticks)
    lags = [op.lag for tk in events for op in tk.ops] + [a[2] for tk in events for a in tk.applies]
    return ZeroTicks(rule, N, L, events, owners, local, owned, plan.versions, G, R, max(lags))


def lower_zero(table, residuals: str = "recompute") -> Program:
    """cdp-zero's program for its table (rule, workers, stages, ticks)."""
    rule = table.meta["rule"]
    ticks = table.meta.get("ticks", "whole")
    z = zero_ticks(rule, table.workers, table.stages, ticks)
    L, N = z.stages, z.workers
    stages = range(L)
    every = tuple((j,) for j in stages)
    buffers = [Buffer("master", "parameters", Size("param", every, True, z.owned), True),
               Buffer("opt", "optimizer_state", Size("param", every, True, z.owned), True),
               Buffer("relay", "relayed_parameters", Size("param", every, True, z.relay_rows), True),
               Buffer("grad", "gradients", Size("param", every, True, z.grad_rows), True),
               Buffer("model_state", "model_state", Size.stages("model_state", stages), True),
               Buffer("acts", "activations", Size.stages("input", stages), True),
               Buffer("cots", "cotangents", Size.stages("input", range(1, L)), True),
               Buffer("labels", "labels", Size.stage("label", 0), True)]
    if z.versions == 2:
        buffers.append(Buffer("previous", "previous_parameters", Size("param", every, True, z.owned), True))
    if residuals == "carry":
        buffers.append(Buffer("kept", "residuals", Size.stages("residual", stages), True))
    sends = []
    for t, tk in enumerate(z.ticks):
        # a refresh at the start of tick t is the message that ends tick t - 1
        for j, owner, w, *_ in tk.refreshes:
            sends.append(Send((t - 1) % len(z.ticks), "parameters", Size.stage("param", j), ((owner, w),), j))
        for j, src, dst, _, _ in tk.sends:
            sends.append(Send(t, "partial", Size.stage("param", j), ((src, dst),), j))
    kinds = tuple(k for k in ("F", "B", "W") if any(op.kind == k for tk in z.ticks for op in tk.ops))
    placement = Placement(every, (0,) * L, tuple(stages), N, L)
    return Program("cdp-zero", "ring", len(z.ticks), z.max_lag, N, 1, kinds, ticks == "split", residuals,
                   z.versions, True, placement, tuple(buffers), tuple(sends), z)


__all__ = ["ZeroOp", "ZeroTick", "ZeroTicks", "lower_zero", "zero_ticks"]
