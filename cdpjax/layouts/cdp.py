"""dp, cdp-v1, cdp-v2: the data-parallel layouts and their time table.

CDP timing (`cdp_table`). N workers, L stages. A worker's step is a sequence of
T ticks (`phase_ops`, `cdp_ticks`): 'whole', one op a tick, the forwards of stages
0..L-1 then the backwards of stages L-1..0 (T = 2L, the paper's figure); 'split',
the forwards, then for stages L-1..0 the input-cotangent backward B and the weight
gradient W (T = 3L); 'paired', the forwards two stages a tick, then the whole
backwards (T = ceil(L/2) + L). The choice is about cost: an SPMD tick lasts as long
as its slowest op on any device, and a whole backward costs two forwards with kept
residuals (three when it recomputes), so in 'whole' ticks every forward waits for a
backward elsewhere; paired forwards cost what a backward costs. Worker i starts
its step-k micro-batch at tick `T*i/N + T*k` (dp: every worker at `T*k`), so the
workers' phases are spread uniformly over the step. Stage j's update for step k is
complete at the end of the tick in which the last worker finishes its gradient
op of stage j for step k (B, or W where split; dp: every stage at the end of the
step, after one all-reduce of the whole model). Versions: theta^j_v is stage j
after v updates.

Rules (which version each read takes; `stale` marks the pairs on the delayed one):
- dp: step k reads version k.
- cdp-v1: step k reads version k-1 everywhere (step 0 reads theta_0).
- cdp-v2: worker i's forward of stage j at step k reads version k if the update of
  step k-1 is complete before that tick, else version k-1. Computed from the ticks,
  so it holds for every N, L and op sequence; for N = L and whole backwards it is
  "stale iff j < L-1-i".
- paper-code: the rule of the authors' released code, for any N and L: worker i
  reads the current version of stage j iff j >= L-1-i (N = 8, L = 4: 6 of 32 pairs
  stale). For N < L it is more stale than the timing allows (realisable). For N > L,
  at T ticks a step some reads would come before the update they need is complete
  (N = 8, L = 4: worker 4's forward of stage 0 at step k+1, 2 ticks before stage 0's
  update of step k) or before its sum can reach them; the table then lengthens the
  step with idle ticks, the fewest that serve every read (N = 8, L = 4: 16 ticks, the
  workers 2 ticks apart as at N = L: the rule's own spacing), and the ring runs it.
A backward (B and W) reads the version its forward read. `Op.slot` says which of two
stored versions (`current`, `previous`) holds an op's version at its tick when every
worker applies each update at its `updates` tick (what `cdp-mp` does).

Gradient traffic: the running partial sums ('partial') and the completed sums
('sum') of the ring's delivery plan, `cdpjax.layouts.cdp_delivery`. dp sends one
'allreduce' per stage in the step's last tick.
"""
from __future__ import annotations

import bisect
import operator
from typing import NamedTuple

from cdpjax.errors import ConfigError
from cdpjax import kinds
from cdpjax.gc_paused import gc_paused
from cdpjax.layouts import Layout, Reference, register
from cdpjax.layouts.cdp_delivery import check_one_version, delivery, messages_and_applies
from cdpjax.timetable import Apply, Message, Op, TimeTable, Update, positive

RULES = ("dp", "cdp-v1", "cdp-v2", "paper-code")
V2_RULES = ("cdp-v2", "paper-code")  # the rules the cdp-v2 layout takes (`cdp_rule`)
# A worker's ops per tick: one op a tick with whole backwards (F, B: 2L ticks), with split ones
# (F, B, W: 3L ticks), or two forwards a tick and whole backwards ('paired': L/2 + L ticks).
TICKS = ("whole", "split", "paired")
FUTURE = 2  # steps laid out past the table's own to find the windows of its last updates


class _Read(NamedTuple):
    """A read of an op of the steps laid out past the table's (`FUTURE`): what the delivery
    windows and the one-version check read of it (an `Op` each would cost a third of the table's
    time at N = L = 128, for ops the table drops)."""

    tick: int
    device: int
    stage: int
    version: int


def phase_ops(stages: int, ticks: str = "whole") -> tuple[tuple[tuple[str, int], ...], ...]:
    """A worker's ticks of one step, in order: each tick's ops (kind, stage), run one after the
    other by the worker within the tick."""
    if ticks not in TICKS:
        raise ConfigError(f"cdp_ticks={ticks!r} is not one of {', '.join(TICKS)}")
    L = int(stages)
    F, B, W = kinds.FORWARD.name, kinds.BACKWARD.name, kinds.WEIGHT.name
    backwards = [((B, j),) for j in reversed(range(L))]
    if ticks == "whole":
        return tuple([((F, j),) for j in range(L)] + backwards)
    if ticks == "split":
        return tuple([((F, j),) for j in range(L)]
                     + [(op,) for j in reversed(range(L)) for op in ((B, j), (W, j))])
    return tuple([tuple((F, j) for j in range(a, min(a + 2, L))) for a in range(0, L, 2)] + backwards)


def check_sizes(workers: int, stages: int, ticks: str = "whole") -> None:
    """Refuses sizes for which the worker offsets T*i/N are not whole ticks ('whole', 'split': the
    paper's uniform delay), or more workers than ticks ('paired', whose offsets are T*i/N rounded
    down: as uniform as whole ticks allow)."""
    positive(workers=workers, stages=stages)
    T = len(phase_ops(stages, ticks))
    if ticks == "paired" and workers > T:
        raise ConfigError(f"workers={workers} is more than the {T} ticks of a step (cdp_ticks='paired', "
                          f"stages={stages}): choose workers in 1..{T}")
    if ticks != "paired" and T % workers:
        ok = [n for n in range(1, T + 1) if T % n == 0]
        raise ConfigError(
            f"workers={workers} does not divide the {T} ticks of a step (cdp_ticks={ticks!r}, "
            f"stages={stages}): worker i starts at tick {T}*i/N, which must be whole; choose workers in {ok}"
        )


def worker_offsets(method: str, workers: int, stages: int, ticks: str = "whole", period: int = 0) -> tuple[int, ...]:
    """Worker i's first tick: T*i/N rounded down (dp: 0), T the ticks of a step (`period`, where
    idle ticks lengthen it, else the phases')."""
    if method == "dp":
        return (0,) * workers
    T = period or len(phase_ops(stages, ticks))
    return tuple(T * i // workers for i in range(workers))


@gc_paused()
def cdp_table(method: str, workers: int = 4, stages: int = 4, steps: int = 3, ticks: str = "whole") -> TimeTable:
    """The dp / cdp-v1 / cdp-v2 / paper-code table of `steps` steps for N workers and L
    stages, with whole or split backwards (`method` is the rule; a paper-code table is a
    cdp-v2 table, `meta['rule']` 'paper-code').

    paper-code with N > L: at the T ticks of a step some fresh reads would precede their update
    (N = 8, L = 4: worker 4's forward of stage 0, two ticks early) or come before the sum can
    reach them; the step is then lengthened by idle ticks at its end (worker i starting at
    T'*i/N), the fewest (with T' a multiple of N, so that offsets stay whole, except with paired
    ticks) for which every read is served from one stored version."""
    if method not in RULES:
        raise ConfigError(f"method={method!r} is not one of {', '.join(RULES)}")
    check_sizes(workers, stages, ticks)
    positive(steps=steps)
    T = len(phase_ops(int(stages), ticks))
    if method != "paper-code" or workers <= stages:
        return _laid_out(method, int(workers), int(stages), int(steps), ticks, T)
    step = 1 if ticks == "paired" else int(workers)
    for period in range(-(-max(T, workers) // step) * step, 4 * T + 1, step):
        t = _laid_out(method, int(workers), int(stages), int(steps), ticks, period)
        if not t.meta.get("unserved"):
            return t
    raise AssertionError(f"paper-code N={workers} L={stages}: no step of up to {4 * T} ticks serves every read")


def _laid_out(method: str, N: int, L: int, S: int, ticks: str, period: int) -> TimeTable:
    """`cdp_table`'s table with steps of `period` ticks (the phases, then idle ticks)."""
    phases = phase_ops(L, ticks)
    phases = phases + ((),) * (period - len(phases))
    T = len(phases)
    offsets = worker_offsets(method, N, L, ticks, T)
    ops, future, updates, completer = _ops(method, N, L, S, FUTURE, offsets, phases)
    messages, applies, plans = [], [], {}
    if method == "dp":
        if N > 1:
            messages = [Message(u.tick, -1, -1, u.stage, "allreduce", u.step) for u in updates]
    else:
        messages = _partials(ops, N)
        reads = ops + future
        plans = delivery(reads, updates, completer, N, L, S, T)
        if any(d.late for d in plans.values()):  # one 'sum' a tick is not enough: two
            plans = delivery(reads, updates, completer, N, L, S, T, capacity=2)
        sums, applies = messages_and_applies(plans, updates)
        messages += sums
        skip = {(r, j) for j, d in plans.items() for r in d.late + d.acausal}
        check_one_version(reads, applies, method, skip)
    num_ticks = max(o.tick for o in ops) + 1
    keep = lambda t, k: k < S and t < num_ticks  # noqa: E731
    ops = tuple(ops)
    updates = tuple(u for u in updates if u.step < S)
    messages = tuple(sorted((m for m in messages if keep(m.tick, m.step)),
                            key=lambda m: (m.tick, m.kind != "partial", m.stage, m.src)))
    # Steady state: a window whose updates' whole traffic (it reaches into the next step)
    # and whose late deliveries of the previous steps are all laid out.
    steady = (2 * T, 3 * T) if S >= 3 else (T, 2 * T) if S >= 2 else (0, num_ticks)
    meta, notes = {"ticks": ticks} if ticks != "whole" else {}, []
    if method != "dp":
        meta["rule"] = method
        notes = _notes(method, N, L, ops, plans, T - len(phase_ops(L, ticks)))
        unserved = sorted({(r, j) for j, d in plans.items() for r in d.late + d.acausal})
        if unserved:  # readers no plan serves in time: the ring refuses such a table (`lower_ring`)
            meta["unserved"] = [list(p) for p in unserved]
    name = "cdp-v2" if method == "paper-code" else method
    applies = tuple(Apply(*a) for a in sorted(a for a in applies if keep(a[0], a[3])))
    return TimeTable(name, N, L, S, num_ticks, N, T, ops, updates, messages, offsets, 1, steady,
                     meta=meta, notes=tuple(notes), applies=applies, axis="data")


# --------------------------------------------------------------------- the ops


def _ops(method, N, L, S, future, offsets, phases):
    """The ops of S steps (with versions and slots), the reads of the `future` steps after them
    (`_Read`s), and the updates and each update's completing worker of all S + future."""
    T, steps = len(phases), S + future
    grad = kinds.gradient_kind(kinds.split(kind for tick in phases for kind, _ in tick))
    forward = {kind: kinds.lookup(kind).forward for tick in phases for kind, _ in tick}
    # Lay out step -1 as well (then drop it), so that step 0 obeys the same rule as
    # the steady state: its stale reads are of "theta_{-1}" := theta_0.
    raw = [(offsets[i] + T * k + p, i, j, kind, k)  # (tick, worker, stage, kind, step)
           for k in range(-1, steps) for i in range(N) for p, tick_ops in enumerate(phases) for kind, j in tick_ops]
    back_tick = {(i, j, k): t for t, i, j, kind, k in raw if kind == grad}  # the gradient ops
    fwd_tick = {(i, j, k): t for t, i, j, kind, k in raw if forward[kind]}
    if method == "dp":
        update_tick = {(j, k): T * k + T - 1 for j in range(L) for k in range(-1, steps)}
    else:
        update_tick = {(j, k): max(back_tick[(i, j, k)] for i in range(N)) for j in range(L) for k in range(-1, steps)}
    completer = {(j, k): max(range(N), key=lambda i: back_tick[(i, j, k)]) for j in range(L) for k in range(steps)}
    # Whether worker i's ops of stage j at step k follow the delayed rule (its backward: as its forward).
    if method == "cdp-v2":  # the update is not complete yet at the forward's tick
        stale = {(i, j, k): t <= update_tick[(j, k - 1)] for (i, j, k), t in fwd_tick.items() if k >= 0}
    else:
        rule = {"dp": lambda i, j: False, "cdp-v1": lambda i, j: True, "paper-code": lambda i, j: j < L - 1 - i}
        stale = {(i, j, k): rule[method](i, j) for i, j, k in fwd_tick if k >= 0}

    ticks = {j: sorted(update_tick[(j, k)] for k in range(steps)) for j in range(L)}
    ops, reads = [], []
    # in (tick, worker) order, a worker's ops of one tick in the order the phase lists them
    for t, i, j, kind, k in sorted((r for r in raw if r[4] >= 0), key=operator.itemgetter(0, 1)):
        is_stale = stale[(i, j, k)]
        version = k - 1 if is_stale and k > 0 else k
        n = bisect.bisect_left(ticks[j], t)  # updates of stage j complete before tick t
        if version == n:
            slot = "current"
        elif version == n - 1:
            slot = "previous"
        elif method == "paper-code" and version > n:
            slot = "future"  # reads an update that is not complete yet: simulate only
        else:  # two stored versions would not suffice: a schedule bug, not a user error
            raise AssertionError(f"{method}: op {(t, i, j, kind, k)} reads version {version} with {n} applied")
        if k < S:
            ops.append(Op(t, i, j, kind, k, i, version, slot, is_stale))
        else:
            reads.append(_Read(t, i, j, version))
    updates = sorted((Update(update_tick[(j, k)], j, k) for j in range(L) for k in range(steps)),
                     key=lambda u: (u.tick, u.stage))
    return ops, reads, updates, completer


def _partials(ops, N):
    """The running partial sum of each (stage, step) hops from worker to worker in the order
    they finish its gradient op (B, or W where the backward is split)."""
    grad = kinds.gradient_kind(kinds.split(o.kind for o in ops))
    by = {}
    for o in ops:
        if o.kind == grad:
            by.setdefault((o.stage, o.step), []).append(o)
    out = []
    for (j, k), bs in by.items():
        bs.sort(key=lambda o: o.tick)
        out += [Message(a.tick, a.device, b.device, j, "partial", k) for a, b in zip(bs, bs[1:])]
    return out



def applies_of(table: TimeTable) -> dict:
    """(worker, stage, step) -> the tick at whose end that worker applies that update."""
    if not table.applies:  # dp: every worker at the update
        return {(w, u.stage, u.step): u.tick for u in table.updates for w in range(table.workers)}
    return {(a.worker, a.stage, a.step): a.tick for a in table.applies}


def _notes(rule, N, L, ops, plans, idle=0):
    notes = []
    if rule == "paper-code":
        notes.append("rule paper-code (the authors' released code): worker i reads the current version of "
                     "stage j iff j >= L-1-i")
    if idle:
        notes.append(f"each step ends with {idle} idle tick(s), the fewest with which every read of this rule comes "
                     f"after its update and its sum reaches the reader in time")
        first = {}
        for o in ops:
            if o.slot == "future":
                first.setdefault((o.device, o.stage), o)
        if first:
            cells = "; ".join(f"w{i} F{j} at tick {o.tick}" for (i, j), o in sorted(first.items()))
            notes.append(f"reads that precede their update ({len(first)} worker/stage pairs; simulate only, "
                         f"the ring cannot run them): {cells}")
    late = [(r, j) for j, d in plans.items() for r in d.late]
    if late:
        notes.append("readers the plan serves after their deadline: " + "; ".join(f"w{r} stage {j}" for r, j in late))
    if N > 1:
        notes.append("gradients: 'partial' sums hop worker to worker; each completed 'sum' goes on point to point "
                     "(at most one 'sum' and one 'partial' send per worker per tick), each worker applying it "
                     "between its last read of the old version and its first of the new: one stored version")
    return notes


# ------------------------------------------------------------------ the layouts


_CDP_LOOK = dict(axes=("data",), device_axis="data", colour="worker", label="{kind}{stage}",
                 diagram_label="{kind}w{micro}",
                 legend="F<j>/B<j>/W<j>: forward/backward (input cotangent where split)/weight gradient of stage j",
                 columns="worker",
                 title="{method}: N={workers} workers, L={stages} stages, {steps} steps, offsets {offsets}")


def dp_table(workers: int = 4, stages: int = 4, steps: int = 3) -> TimeTable:
    return cdp_table("dp", workers, stages, steps)


def cdp_v1_table(workers: int = 4, stages: int = 4, steps: int = 3, ticks: str = "whole") -> TimeTable:
    return cdp_table("cdp-v1", workers, stages, steps, ticks)


def cdp_v2_table(workers: int = 4, stages: int = 4, steps: int = 3, rule: str = "cdp-v2",
                 ticks: str = "whole") -> TimeTable:
    """cdp-v2 with `rule` 'cdp-v2' (the version each forward finds, from the ticks) or
    'paper-code' (the authors' released rule: current iff stage >= L-1-worker)."""
    if rule not in V2_RULES:
        raise ConfigError(f"cdp-v2 rule={rule!r} is not one of {', '.join(V2_RULES)} (cdp-v1 is its own method)")
    return cdp_table(rule, workers, stages, steps, ticks)


register(Layout("dp", "cdpjax.methods.dp:build", table=dp_table,
                summary="data parallel: every device a worker, gradients averaged once per step", **_CDP_LOOK,
                reference=Reference("e2e"), state_as="e2e"))
register(Layout("cdp-v1", "cdpjax.methods.cdp:build_v1", table=cdp_v1_table,
                summary="cyclic data parallel, every step reads the previous version", **_CDP_LOOK,
                reference=Reference("cdp-v1", (("cdp_impl", "simulate"),))))
register(Layout("cdp-v2", "cdpjax.methods.cdp:build_v2", table=cdp_v2_table,
                summary="cyclic data parallel, the version each forward finds (derived from the ticks; "
                        "--rule paper-code: the authors' released rule)", **_CDP_LOOK,
                reference=Reference("cdp-v2", (("cdp_impl", "simulate"),))))
