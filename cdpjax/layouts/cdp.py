"""dp, cdp-v1, cdp-v2: the data-parallel layouts, their time table and the ring's delivery plan.

CDP timing (`cdp_table`). N workers, L stages, one tick = one stage-forward or one
stage-backward of one micro-batch. Worker i starts its step-k micro-batch at tick
`2L*i/N + 2L*k` (dp: every worker at `2L*k`); at phase p of a step it runs the
forward of stage p (p < L) or the backward of stage 2L-1-p. Stage j's update for
step k is complete at the end of the tick in which the last worker finishes its
backward of stage j for step k (`updates`; dp: every stage at the end of the step,
after one all-reduce of the whole model). Versions: theta^j_v is stage j after v
updates.

Rules (which version each read takes; `stale` marks the pairs on the delayed one):
- dp: step k reads version k.
- cdp-v1: step k reads version k-1 everywhere (step 0 reads theta_0).
- cdp-v2: worker i's forward of stage j at step k reads version k if the update of
  step k-1 is complete before that tick, else version k-1. Computed from the ticks,
  so it holds for every N and L; for N = L it is "stale iff j < L-1-i".
- paper-code: the rule of the authors' released code, for any N and L: worker i
  reads the current version of stage j iff j >= L-1-i (N = 8, L = 4: 6 of 32 pairs
  stale). For N < L it is more stale than the timing allows (realisable); for N > L
  some reads come before the update they need is complete (e.g. N = 8, L = 4:
  worker 4's forward of stage 0 at step k+1, 2 ticks before stage 0's update of step
  k): those ops have `slot='future'`, the table's notes list them, `simulate` runs
  the rule (it has no timing) and the ring refuses it.
A backward reads the version its forward read. `Op.slot` says which of two stored
versions (`current`, `previous`) holds an op's version at its tick when every
worker applies each update at its `updates` tick (what `cdp-mp` does).

Gradient traffic (messages), the plan the ring runs:
- 'partial': workers finish stage j's backward one after another, so a running
  partial sum hops one worker along the ring each time a worker finishes.
- 'sum': the last worker completes the sum, then the sum travels as a chain, one
  hop per tick at most, to every other worker, each of which applies the update to
  its own copy. A worker's delivery window for update k of stage j opens when the
  sum is complete and it has done its last op reading the old version (`lo`), and
  closes before its first op reading the new one (`hi`); the chain visits workers
  in order of their windows, each holder forwarding it no earlier than the tick
  after it arrived and not before it has applied it, with at most one 'sum' send
  and one 'sum' receive per worker per tick (plus at most one 'partial' send, one
  per backward). Each worker applies the update at the end of tick
  max(arrival, lo) (`applies`, in `meta`), so ONE stored version per stage
  suffices: an op always reads its worker's current copy. A reader whose window
  cannot be met (only the paper-code rule for N > L) is named in the notes.
dp sends one 'allreduce' per stage in the step's last tick.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from cdpjax.errors import ConfigError
from cdpjax.layouts import Layout, register
from cdpjax.timetable import Message, Op, TimeTable, Update, positive

RULES = ("dp", "cdp-v1", "cdp-v2", "paper-code")
V2_RULES = ("cdp-v2", "paper-code")  # the rules the cdp-v2 layout takes (`cdp_rule`)
FUTURE = 2  # steps laid out past the table's own to find the windows of its last updates


def check_sizes(workers: int, stages: int) -> None:
    """Refuses sizes for which the worker offsets 2L*i/N are not whole ticks."""
    positive(workers=workers, stages=stages)
    if (2 * stages) % workers:
        ok = [n for n in range(1, 2 * stages + 1) if (2 * stages) % n == 0]
        raise ConfigError(
            f"workers={workers} does not divide 2*stages={2 * stages}: worker i starts at tick "
            f"2L*i/N, which must be whole; for stages={stages} choose workers in {ok}"
        )


def worker_offsets(method: str, workers: int, stages: int) -> tuple[int, ...]:
    if method == "dp":
        return (0,) * workers
    return tuple(2 * stages * i // workers for i in range(workers))


def _phase_op(p: int, stages: int) -> tuple[str, int]:
    return ("F", p) if p < stages else ("B", 2 * stages - 1 - p)


def cdp_table(method: str, workers: int = 4, stages: int = 4, steps: int = 3) -> TimeTable:
    """The dp / cdp-v1 / cdp-v2 / paper-code table of `steps` steps for N workers and L
    stages (`method` is the rule; a paper-code table is a cdp-v2 table, `meta['rule']`
    'paper-code')."""
    if method not in RULES:
        raise ConfigError(f"method={method!r} is not one of {', '.join(RULES)}")
    check_sizes(workers, stages)
    positive(steps=steps)
    N, L, T, S = int(workers), int(stages), 2 * int(stages), int(steps)
    offsets = worker_offsets(method, N, L)
    ops, updates, completer = _ops(method, N, L, S + FUTURE, offsets)
    messages, applies, plans = [], [], {}
    if method == "dp":
        if N > 1:
            messages = [Message(u.tick, -1, -1, u.stage, "allreduce", u.step) for u in updates]
    else:
        messages = _partials(ops, N)
        plans = _delivery(ops, updates, completer, N, L, S)
        sums, applies = _messages_and_applies(plans, updates)
        messages += sums
        skip = {(r, j) for j, d in plans.items() for r in d.late + d.acausal}
        _check_one_version(ops, applies, method, skip)
    num_ticks = max(o.tick for o in ops if o.step < S) + 1
    keep = lambda t, k: k < S and t < num_ticks  # noqa: E731
    ops = tuple(o for o in ops if o.step < S)
    updates = tuple(u for u in updates if u.step < S)
    messages = tuple(sorted((m for m in messages if keep(m.tick, m.step)),
                            key=lambda m: (m.tick, m.kind != "partial", m.stage, m.src)))
    # Steady state: a window whose updates' whole traffic (it reaches into the next step)
    # and whose late deliveries of the previous steps are all laid out.
    steady = (2 * T, 3 * T) if S >= 3 else (T, 2 * T) if S >= 2 else (0, num_ticks)
    meta, notes = {}, []
    if method != "dp":
        meta = {"rule": method, "applies": sorted(list(a) for a in applies if keep(a[0], a[3])),
                "late": sorted([r, j] for j, d in plans.items() for r in d.late)}
        notes = _notes(method, N, L, ops, plans)
    name = "cdp-v2" if method == "paper-code" else method
    return TimeTable(name, N, L, S, num_ticks, N, T, ops, updates, messages, offsets, 1, steady,
                     meta=meta, notes=tuple(notes))


# --------------------------------------------------------------------- the ops


def _ops(method, N, L, steps, offsets):
    """Ops (with versions and slots), updates and each update's completing worker."""
    T = 2 * L
    # Lay out step -1 as well (then drop it), so that step 0 obeys the same rule as
    # the steady state: its stale reads are of "theta_{-1}" := theta_0.
    raw = []  # (tick, worker, stage, kind, step)
    for k in range(-1, steps):
        for i in range(N):
            for p in range(T):
                kind, j = _phase_op(p, L)
                raw.append((offsets[i] + T * k + p, i, j, kind, k))
    back_tick = {(i, j, k): t for t, i, j, kind, k in raw if kind == "B"}
    fwd_tick = {(i, j, k): t for t, i, j, kind, k in raw if kind == "F"}
    if method == "dp":
        update_tick = {(j, k): T * k + T - 1 for j in range(L) for k in range(-1, steps)}
    else:
        update_tick = {(j, k): max(back_tick[(i, j, k)] for i in range(N)) for j in range(L) for k in range(-1, steps)}
    completer = {(j, k): max(range(N), key=lambda i: back_tick[(i, j, k)]) for j in range(L) for k in range(steps)}

    def is_stale(i, j, k):
        if method == "dp":
            return False
        if method == "cdp-v1":
            return True
        if method == "paper-code":
            return j < L - 1 - i
        return fwd_tick[(i, j, k)] <= update_tick[(j, k - 1)]  # the update is not complete yet

    ticks = {j: sorted(update_tick[(j, k)] for k in range(steps)) for j in range(L)}
    ops = []
    for t, i, j, kind, k in raw:
        if k < 0:
            continue
        stale = is_stale(i, j, k)
        version = max(k - int(stale), 0)
        n = int(np.searchsorted(ticks[j], t))  # updates of stage j complete before tick t
        if version == n:
            slot = "current"
        elif version == n - 1:
            slot = "previous"
        elif method == "paper-code" and version > n:
            slot = "future"  # reads an update that is not complete yet: simulate only
        else:  # two stored versions would not suffice: a schedule bug, not a user error
            raise AssertionError(f"{method}: op {(t, i, j, kind, k)} reads version {version} with {n} applied")
        ops.append(Op(t, i, j, kind, k, micro=i, version=version, slot=slot, stale=stale))
    ops.sort(key=lambda o: (o.tick, o.device))
    updates = sorted((Update(update_tick[(j, k)], j, k) for j in range(L) for k in range(steps)),
                     key=lambda u: (u.tick, u.stage))
    return ops, updates, completer


def _partials(ops, N):
    """The running partial sum of each (stage, step) hops from worker to worker in the order
    they finish its backward."""
    by = {}
    for o in ops:
        if o.kind == "B":
            by.setdefault((o.stage, o.step), []).append(o)
    out = []
    for (j, k), bs in by.items():
        bs.sort(key=lambda o: o.tick)
        out += [Message(a.tick, a.device, b.device, j, "partial", k) for a, b in zip(bs, bs[1:])]
    return out


# ------------------------------------------------------------ the delivery plan


def windows(ops, updates, completer) -> dict:
    """(stage, step) -> {worker: (lo, hi)}: the ticks at whose end each worker may apply the
    update (lo: the sum is complete and its last op reading an older version is done; hi:
    the tick before its first op reading the new version, None where the table does not
    reach it). hi < u marks a read that comes before the update is complete (paper-code,
    N > L)."""
    reads = {}
    for o in ops:
        reads.setdefault((o.device, o.stage), []).append((o.tick, o.version))
    out = {}
    for u in updates:
        per = {}
        for (r, j), rs in reads.items():
            if j != u.stage:
                continue
            old = [t for t, v in rs if v <= u.step]
            new = [t for t, v in rs if v >= u.step + 1]
            per[r] = (max([u.tick] + old), min(new) - 1 if new else None)
        out[(u.stage, u.step)] = per
    return out


@dataclasses.dataclass(frozen=True)
class Delivery:
    """One update's plan, as offsets from its completion tick u: `hops` (send offset, src, dst),
    `arrive`/`apply`/`hold_until` per worker (the completer arrives at 0), `late`: readers
    served after their deadline, `acausal`: readers whose read precedes the update."""

    completer: int
    hops: tuple
    arrive: dict
    apply: dict
    hold_until: dict
    late: tuple = ()
    acausal: tuple = ()


def _delivery(ops, updates, completer, N, L, steps):
    """The delivery plan of every stage: one list-scheduled plan per stage, the same for
    every step (the windows repeat every 2L ticks). At every tick, pending readers are
    served in order of their deadlines (acausal ones last), each from a holder free to
    send (one 'sum' send and one receive per worker per tick, counted modulo 2L so that the
    plans of consecutive steps share the ticks too), holders that have applied first."""
    T = 2 * L
    win = windows(ops, updates, completer)
    u_tick = {(u.stage, u.step): u.tick for u in updates}
    ref = 1  # a step whose windows are those of every step
    busy_send, busy_recv = set(), set()
    pending, holders, arrive, lo_of, hi_of, done = {}, {}, {}, {}, {}, {}
    for j in range(L):
        u, c = u_tick[(j, ref)], completer[(j, ref)]
        w = win[(j, ref)]
        lo_of[j] = {r: lo - u for r, (lo, _) in w.items()}
        hi_of[j] = {r: (hi - u if hi is not None else 10 * T) for r, (_, hi) in w.items()}
        pending[j] = sorted(r for r in w if r != c)
        arrive[j] = {c: 0}
        holders[j] = {c}
        done[j] = []
    start = min(u_tick[(j, ref)] for j in range(L))
    tick = start
    while any(pending.values()):
        if tick > start + 6 * T:
            raise AssertionError(f"no delivery plan for N={N}, L={L}")
        cands = []
        for j in range(L):
            u = u_tick[(j, ref)]
            if tick < u:
                continue
            for r in pending[j]:
                acausal = hi_of[j][r] < 0
                cands.append((acausal, hi_of[j][r], lo_of[j][r], j, r))
        for *_, j, r in sorted(cands):
            if r not in pending[j] or (r, tick % T) in busy_recv:
                continue
            u = u_tick[(j, ref)]
            free = [h for h in holders[j] if arrive[j][h] < tick - u or (arrive[j][h] == 0 and h == completer[(j, ref)])]
            free = [h for h in free if (h, tick % T) not in busy_send]
            if not free:
                continue
            applied = lambda h: max(arrive[j][h], lo_of[j][h]) <= tick - u  # noqa: E731
            h = min(free, key=lambda h: (not applied(h), h))
            busy_send.add((h, tick % T))
            busy_recv.add((r, tick % T))
            done[j].append((tick - u, h, r))
            arrive[j][r] = tick - u
            holders[j].add(r)
            pending[j].remove(r)
        tick += 1
    plans = {}
    for j in range(L):
        c = completer[(j, ref)]
        apply = {w: max(a, lo_of[j][w]) for w, a in arrive[j].items()}
        last_send = {}
        for s, h, _ in done[j]:
            last_send[h] = max(last_send.get(h, 0), s)
        hold = {w: max(apply[w], last_send.get(w, 0)) for w in arrive[j]}
        late = tuple(sorted(r for r in arrive[j] if r != c and 0 <= hi_of[j][r] < apply[r]))
        acausal = tuple(sorted(r for r in arrive[j] if r != c and hi_of[j][r] < 0))
        plans[j] = Delivery(c, tuple(done[j]), arrive[j], apply, hold, late, acausal)
    # Every step's windows are the reference step's, shifted: checked (where laid out whole).
    for (j, k), w in win.items():
        if k >= steps:
            continue
        u, d = u_tick[(j, k)], plans[j]
        if completer[(j, k)] != d.completer:
            raise AssertionError(f"stage {j}: the completing worker changes between steps")
        for r, (lo, hi) in w.items():
            if lo - u != lo_of[j][r] or (hi is not None and hi - u != hi_of[j][r]):
                raise AssertionError(f"stage {j} step {k}: worker {r}'s window differs from the reference step's")
    return plans


def _messages_and_applies(plans, updates):
    messages, applies = [], []
    for up in updates:
        d = plans[up.stage]
        messages += [Message(up.tick + s, h, r, up.stage, "sum", up.step) for s, h, r in d.hops]
        applies += [(up.tick + a, w, up.stage, up.step) for w, a in d.apply.items()]
    return messages, applies


def _check_one_version(ops, applies, method, skip=()):
    """Every op reads the version its worker holds: the updates it applied before the op's
    tick (except the pairs in `skip`, which no plan serves in time)."""
    done = {}
    for t, w, j, k in applies:
        done.setdefault((w, j), []).append(t)
    for ts in done.values():
        ts.sort()
    for o in ops:
        if (o.device, o.stage) in skip:
            continue
        n = int(np.searchsorted(done.get((o.device, o.stage), []), o.tick))
        if n != o.version:
            raise AssertionError(f"{method}: worker {o.device} holds version {n} of stage {o.stage} at tick "
                                 f"{o.tick}; its op reads {o.version}")


def applies_of(table: TimeTable) -> dict:
    """(worker, stage, step) -> the tick at whose end that worker applies that update."""
    if table.meta.get("applies") is None:  # dp: every worker at the update
        return {(w, u.stage, u.step): u.tick for u in table.updates for w in range(table.workers)}
    return {(w, j, k): t for t, w, j, k in table.meta["applies"]}


def _notes(rule, N, L, ops, plans):
    notes = []
    if rule == "paper-code":
        notes.append("rule paper-code (the authors' released code): worker i reads the current version of "
                     "stage j iff j >= L-1-i")
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


def acausal_reads(table: TimeTable) -> list[str]:
    """The reads that come before their update is complete, in words, the first of each
    (worker, stage) pair (empty if none)."""
    out, seen = [], set()
    u_tick = {(u.stage, u.step): u.tick for u in table.updates}
    for o in sorted(table.ops, key=lambda o: o.tick):
        if o.slot == "future" and o.kind == "F" and (o.device, o.stage) not in seen:
            seen.add((o.device, o.stage))
            u = u_tick.get((o.stage, o.version - 1))
            out.append(f"worker {o.device}'s forward of stage {o.stage} at step {o.step} (tick {o.tick}) reads "
                       f"version {o.version}, whose update is complete at the end of tick {u}, "
                       f"{u - o.tick + 1} tick(s) later")
    return out


# ------------------------------------------------------------- the ring program


@dataclasses.dataclass(frozen=True)
class RingTick:
    """What happens in one tick of the ring's steady-state period, in this order: the ops,
    the sums they complete, the applies from the sums held before the sends, the sends,
    the applies from the sums received. Every event names its step by `lag`: 0 for the
    step fed in the call, 1 for the previous call's, and so on; gradient buffers are keyed
    (kind, stage, lag).

    ops: (worker, kind, stage, lag), at most one per (kind, stage).
    chain_start: (worker, stage) backwards that start a partial sum (nothing received).
    completes: (worker, stage, lag) backwards that complete a stage's sum.
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


@dataclasses.dataclass(frozen=True)
class RingProgram:
    """One steady-state period (2L ticks, from worker 0's start of a step) of a CDP table, as
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
def ring_program(rule: str, workers: int, stages: int) -> RingProgram:
    """The ring's period for `rule` (cdp-v1, cdp-v2, paper-code), read from `cdp_table`;
    a ConfigError naming the read and the ticks where the table has a read the ring
    cannot serve."""
    if rule not in ("cdp-v1", "cdp-v2", "paper-code"):
        raise ConfigError(f"the ring runs the cyclic rules cdp-v1, cdp-v2, paper-code, not {rule!r}")
    check_sizes(workers, stages)
    N, L = int(workers), int(stages)
    table = cdp_table(rule, N, L, steps=8)
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
        counts[w, j] += t < 4 * 2 * L
    newest = tuple(int(np.argmax(counts[:, j])) for j in range(L))
    return RingProgram(rule, N, L, ticks, max(lags), _live(ticks, N), newest)


def _ring_window(table, m):
    T = table.period
    lo, hi = m * T, (m + 1) * T
    ticks = [dict(ops=[], chain_start=set(), completes=[], partials={}, sums={}, applies={}) for _ in range(T)]
    u_tick = {(u.stage, u.step): u.tick for u in table.updates}
    received = {(msg.dst, msg.stage, msg.step) for msg in table.messages if msg.kind == "partial"}
    completer = {}
    for o in table.ops:
        if o.kind == "B" and u_tick[(o.stage, o.step)] == o.tick:
            completer[(o.stage, o.step)] = o.device
        if lo <= o.tick < hi:
            tk = ticks[o.tick - lo]
            tk["ops"].append((o.device, o.kind, o.stage, m - o.step))
            if o.kind == "B" and (o.device, o.stage, o.step) not in received:
                tk["chain_start"].add((o.device, o.stage))
            if o.kind == "B" and u_tick[(o.stage, o.step)] == o.tick:
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
            ops=tuple(sorted(tk["ops"])),
            chain_start=frozenset(tk["chain_start"]),
            completes=tuple(sorted(tk["completes"])),
            partials=tuple((j, lag, tuple(sorted(p))) for (j, lag), p in sorted(tk["partials"].items())),
            sums=tuple(sums),
            applies=tuple((j, lag, tuple(sorted(ws)), after) for (j, lag, after), ws in sorted(applies.items())),
        ))
    return tuple(out)


def accesses(tk):
    """(buffer, worker, 'read' | 'write') of one tick, in the order the tick runs them."""
    for w, kind, j, lag in tk.ops:
        if kind == "B" and (w, j) not in tk.chain_start:
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


# ------------------------------------------------------------------ the layouts


_CDP_LOOK = dict(axes=("data",), device_axis="data", colour="worker", label="{kind}{stage}", diagram_label="{kind}w{micro}",
                 legend="F<j>/B<j>: forward/backward of stage j", columns="worker",
                 title="{method}: N={workers} workers, L={stages} stages, {steps} steps, offsets {offsets}")


def dp_table(workers: int = 4, stages: int = 4, steps: int = 3) -> TimeTable:
    return cdp_table("dp", workers, stages, steps)


def cdp_v1_table(workers: int = 4, stages: int = 4, steps: int = 3) -> TimeTable:
    return cdp_table("cdp-v1", workers, stages, steps)


def cdp_v2_table(workers: int = 4, stages: int = 4, steps: int = 3, rule: str = "cdp-v2") -> TimeTable:
    """cdp-v2 with `rule` 'cdp-v2' (the version each forward finds, from the ticks) or
    'paper-code' (the authors' released rule: current iff stage >= L-1-worker)."""
    if rule not in V2_RULES:
        raise ConfigError(f"cdp-v2 rule={rule!r} is not one of {', '.join(V2_RULES)} (cdp-v1 is its own method)")
    return cdp_table(rule, workers, stages, steps)


register(Layout("dp", "cdpjax.methods.dp:build", table=dp_table,
                summary="data parallel: every device a worker, gradients averaged once per step", **_CDP_LOOK))
register(Layout("cdp-v1", "cdpjax.methods.cdp:build_v1", table=cdp_v1_table,
                summary="cyclic data parallel, every step reads the previous version", **_CDP_LOOK))
register(Layout("cdp-v2", "cdpjax.methods.cdp:build_v2", table=cdp_v2_table,
                summary="cyclic data parallel, the version each forward finds (derived from the ticks; "
                        "--rule paper-code: the authors' released rule)", **_CDP_LOOK))
