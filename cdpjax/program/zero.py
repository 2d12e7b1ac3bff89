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

Rows of gradient sums that span the period's end stay in the train state
(`kept_grad_rows`); the others are temporaries of the call, live from the first tick
that uses them to the last (`temporary_grad_rows`). A gradient row's index is the same
for the same event in every period (circular interval colouring over the period).
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
    kept_grad_rows: tuple[int, ...]  # the gradient rows some sum spans the period's end in: train state
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


class _PeriodRows:
    """The rows of one steady period [lo, hi) of a plan: gradient rows (`grad_row`), relay rows
    (`relay_row`), each event's row the same in every period (circular colouring of the arcs that
    start in the period; an event of another step is one of those shifted by whole periods)."""

    def __init__(self, plan, grad_kind: str, lo: int, hi: int):
        self.plan, self.lo, self.T = plan, lo, hi - lo
        owners = plan.owners
        self.grad_op = {(o.device, o.stage, o.step): o.tick for o in plan.table.ops if o.kind == grad_kind}
        # Gradient arcs, per worker and sum, from its first to its last tick in a row. A message lands
        # at the end of its tick (after the ops and sends), so a row it fills is taken from the next
        # tick; an update reads its rows after the landings, so a row it reads stays taken into the next.
        self.grad_arcs = defaultdict(dict)
        self.incoming = {}  # (worker, stage, step) -> the key of the row its received partial sum is in
        for h in plan.hops:
            u = plan.update_tick[(h.stage, h.step)]
            last = u + 1 if h.dst == owners[h.stage] else self.grad_op[(h.dst, h.stage, h.step)]
            key = ("in", "sum", h.stage, h.step)
            self.grad_arcs[h.dst][key] = (h.tick + 1, max(last, h.tick + 1))
            self.incoming[(h.dst, h.stage, h.step)] = key
        for (w, j, k), t in self.grad_op.items():
            u = plan.update_tick[(j, k)]
            if self.early_owner(w, j, k):  # the owner's own contribution, waiting for the others'
                self.grad_arcs[w][("own", j, k)] = (t, u + 1)
            elif (w, j, k) not in self.incoming:  # a sum it starts: sent at the end of the tick, or applied
                self.grad_arcs[w][("start", j, k)] = (t, t + 1 if w == owners[j] else t)
        # Relay arcs: a worker's relayed visits, known by (stage, first op's kind, step), one row each
        # while it lasts (two where paired forwards visit two stages in one tick).
        self.relay_arcs = defaultdict(dict)
        for v in plan.visits:
            if v.worker != owners[v.stage]:
                self.relay_arcs[v.worker][(v.stage, v.kinds[0], v.step)] = (v.ticks[0], v.ticks[-1])
        self.grad_rows = self._colour(self.grad_arcs)
        self.relay_rows = self._colour(self.relay_arcs)

    def _colour(self, arcs) -> dict:
        return {w: _circular_slots({k: x for k, x in a.items() if self.lo <= x[0] < self.lo + self.T}, self.T)
                for w, a in arcs.items()}

    def spanning(self, rows, arcs) -> tuple[int, ...]:
        """The rows an arc runs past the period's end in (for some worker): they hold a value from
        one call to the next; the others are empty at the end of every call. A received sum's arc
        starts the tick after its message lands: one landing at the end of the period's last tick
        spans it too."""
        lo, hi = self.lo, self.lo + self.T
        return tuple(sorted({rows[w][0][key] for w in rows for key, (start, end) in arcs[w].items()
                             if key in rows[w][0] and lo <= start < hi
                             and (end >= hi or start - (key[0] == "in") < lo)}))

    def count(self, rows) -> int:
        return max((n for _, n in rows.values()), default=1)

    def _row(self, rows, arcs, w, key):
        shift = -((arcs[w][key][0] - self.lo) // self.T)  # whole periods that bring its start into the period
        return rows[w][0][key[:-1] + (key[-1] + shift,)]

    def grad_row(self, w, key) -> int:
        return self._row(self.grad_rows, self.grad_arcs, w, key)

    def relay_row(self, v) -> int:
        return self._row(self.relay_rows, self.relay_arcs, v.worker, (v.stage, v.kinds[0], v.step))

    def early_owner(self, w, j, k) -> bool:
        """The owner's own gradient op comes before the others' are all in."""
        return w == self.plan.owners[j] and self.grad_op[(w, j, k)] != self.plan.update_tick[(j, k)]

    def op_rows(self, w, j, k) -> tuple[int, int]:
        """(row it adds to or -1, row its sum goes to) of worker w's gradient op of (j, k)."""
        if self.early_owner(w, j, k):
            return -1, self.grad_row(w, ("own", j, k))
        if (w, j, k) in self.incoming:
            r = self.grad_row(w, self.incoming[(w, j, k)])
            return r, r
        return -1, self.grad_row(w, ("start", j, k))

    def applied_rows(self, j, k) -> tuple[int, ...]:
        """The owner's rows an update sums: the others' sum and its own contribution, or (it finished
        last and added the others' sum in its op) its op's row."""
        o = self.plan.owners[j]
        if self.early_owner(o, j, k):
            return self.grad_row(o, self.incoming[(o, j, k)]), self.grad_row(o, ("own", j, k))
        return (self.op_rows(o, j, k)[1],)


@functools.lru_cache(maxsize=64)
def zero_ticks(rule: str, workers: int, stages: int, ticks: str = "whole") -> ZeroTicks:
    """The per-tick events of one steady period of cdp-zero's plan (module docstring)."""
    plan = zero_plan(rule, workers, stages, ticks)
    base, owners = plan.table, plan.owners
    T, m = base.period, 3  # a steady period: steps m-1..m+1 are laid out whole around it
    lo, hi = m * T, (m + 1) * T
    local = tuple(sorted(j2 for j2 in range(stages) if owners[j2] == owners[j]).index(j) for j in range(stages))
    grad = gradient_kind(ticks == "split")
    rows = _PeriodRows(plan, grad, lo, hi)
    events = [dict(refreshes=[], ops=[], sends=[], applies=[]) for _ in range(T)]
    visit_of = {(v.worker, t, v.stage): v for v in plan.visits for t in v.ticks}
    for v in plan.visits:
        if lo <= v.ticks[0] < hi and v.worker != owners[v.stage]:
            events[v.ticks[0] - lo]["refreshes"].append((v.stage, owners[v.stage], v.worker, local[v.stage], v.row,
                                                         rows.relay_row(v)))
    for o in base.ops:
        if lo <= o.tick < hi:
            v = visit_of[(o.device, o.tick, o.stage)]
            params = ("master", local[o.stage], v.row) if o.device == owners[o.stage] else ("relay", rows.relay_row(v))
            g_in, g_out = rows.op_rows(o.device, o.stage, o.step) if o.kind == grad else (-1, -1)
            events[o.tick - lo]["ops"].append(ZeroOp(o.device, o.kind, o.stage, m - o.step, params, g_in, g_out))
    for h in plan.hops:
        if lo <= h.tick < hi:
            dst_row = rows.grad_row(h.dst, rows.incoming[(h.dst, h.stage, h.step)])
            events[h.tick - lo]["sends"].append((h.stage, h.src, h.dst, rows.op_rows(h.src, h.stage, h.step)[1],
                                                 dst_row))
    for (j, k), u in plan.update_tick.items():
        if lo <= u < hi:
            events[u - lo]["applies"].append((j, owners[j], m - k, local[j], rows.applied_rows(j, k)))
    out = tuple(ZeroTick(tuple(e["refreshes"]), tuple(sorted(e["ops"], key=lambda z: (z.worker, z.kind))),
                         tuple(e["sends"]), tuple(e["applies"])) for e in events)
    lags = [op.lag for tk in out for op in tk.ops] + [a[2] for tk in out for a in tk.applies]
    return ZeroTicks(rule, workers, stages, out, owners, local, max(local) + 1, plan.versions,
                     rows.count(rows.grad_rows), rows.spanning(rows.grad_rows, rows.grad_arcs),
                     rows.count(rows.relay_rows), max(lags))


def temporary_grad_rows(z: ZeroTicks) -> tuple[int, ...]:
    """The gradient rows that are not train state: empty at every call's start and end."""
    return tuple(g for g in range(z.grad_rows) if g not in z.kept_grad_rows)


def _grad_rows_used(tk: ZeroTick) -> set[int]:
    rows = {r for op in tk.ops for r in (op.grad_in, op.grad_out) if r >= 0}
    rows |= {r for _, _, _, src, dst in tk.sends for r in (src, dst)}
    return rows | {r for *_, summed in tk.applies for r in summed}


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
               Buffer("grad", "gradients", Size("param", every, True, len(z.kept_grad_rows)), True),
               Buffer("model_state", "model_state", Size.stages("model_state", stages), True),
               Buffer("acts", "activations", Size.stages("input", stages), True),
               Buffer("cots", "cotangents", Size.stages("input", range(1, L)), True),
               Buffer("labels", "labels", Size.stage("label", 0), True)]
    for g in temporary_grad_rows(z):  # a row no sum spans the period's end in: live from its first use to its last
        used = [t for t, tk in enumerate(z.ticks) if g in _grad_rows_used(tk)]
        buffers.append(Buffer(f"grad{g}", "gradients", Size("param", every, True, 1), False, (used[0], used[-1])))
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


__all__ = ["ZeroOp", "ZeroTick", "ZeroTicks", "lower_zero", "temporary_grad_rows", "zero_ticks"]
