"""Lowering for the ring engine: a cyclic table, one worker per device of the `data` axis.

`lower_ring` turns the table it is given (CDP's cdp-v1, cdp-v2, paper-code, whole,
split or paired ticks, or any other table with `axis='data'`: its own ops and the
version each reads, its updates, 'partial' and 'sum' messages and `Apply` records;
nothing is rebuilt from a rule) into the `Program` the ring runtime
(`cdpjax.methods.ring`) runs: one steady-state period of T ticks from worker 0's
start of a step (`RingTicks`, every tick's typed events, from which it emits
`Program.events`; the runtime reads the period back from those events alone,
`program_period`, and `RingRouting`, the integer arrays its scan reads by tick and
worker, from that: `ring_program_routing`),
every buffer in its natural shape (a worker holds every stage: nothing is padded)
and every message at its stage's size:

- ops: each worker's op of the tick (F, B, W), its step named by its lag (0: the
  step fed in this call, 1: the previous call's...);
- gradient sums: the gradient op of a (worker, stage) adds its gradient to the
  partial sum it received (or starts one), and the last worker's completes the sum;
  'partial' and 'sum' messages hop them along the table's delivery plan;
- applies: each worker applies a completed sum to its own copy at the table's
  `Apply` tick; an op reads the version its worker stores that many applies back
  (`RingTick.depths`, the `Compute.version` it emits: 0 the newest), and the
  program stores as many versions as the oldest read needs (`Program.versions`;
  one for CDP's plans, which apply each update between a worker's last read of
  the old version and its first of the new).

A table the ring cannot serve is refused in one line naming the op or update that
lacks what the ring needs (`_refuse_unservable`, `_fold`).

Gradient buffers are keyed (kind, stage, lag); those a period reads before writing
(`RingTicks.live`) are part of the train state, renamed lag -> lag + 1 at the end
of each period.
"""
from __future__ import annotations

import bisect
import dataclasses
from typing import NamedTuple

import numpy as np

from cdpjax.errors import ConfigError
from cdpjax.gc_paused import gc_paused
from cdpjax.kinds import KINDS, gradient_kind, lookup
from cdpjax.program import Buffer, Placement, Program, Size, carries, op_branches
from cdpjax.program.events import Apply, Compute, Event, Receive, Send, messages, sorted_events
from cdpjax.timetable import TimeTable

# The name scope of the scanned ring's switch over ticks that sends each tick's messages (its
# branch t runs at tick t): `cdpjax.bench` counts each branch once per pass of the loop.
SENDS_BY_TICK = "ring_sends_by_tick"

Pairs = tuple[tuple[int, int], ...]  # (source worker, destination worker) of each message


class RingOp(NamedTuple):
    """Worker `worker` runs `kind` on stage `stage` for the step fed `lag` calls ago."""

    worker: int
    kind: str
    stage: int
    lag: int


class Completes(NamedTuple):
    """Worker `worker`'s gradient op completes stage `stage`'s sum of the step fed `lag` calls ago."""

    worker: int
    stage: int
    lag: int


class Partial(NamedTuple):
    """Stage `stage`'s running sum of step `lag`, sent from each source to its destination."""

    stage: int
    lag: int
    pairs: Pairs


class SumSend(NamedTuple):
    """Stage `stage`'s completed sum of step `lag` sent along `pairs`; `merge`: a worker that is
    not a receiver still holds its copy after the send (else only the receivers do)."""

    stage: int
    lag: int
    pairs: Pairs
    merge: bool


class RingApply(NamedTuple):
    """`workers` apply stage `stage`'s sum of step `lag` to their copies, before the tick's sends
    or after them (`after_send`: a sum received in this tick)."""

    stage: int
    lag: int
    workers: tuple[int, ...]
    after_send: bool


@dataclasses.dataclass(frozen=True)
class RingTick:
    """What happens in one tick of the ring's steady-state period, in this order: the ops,
    the sums they complete, the applies from the sums held before the sends, the sends,
    the applies from the sums received. Every event names its step by `lag`: 0 for the
    step fed in the call, 1 for the previous call's, and so on; gradient buffers are keyed
    (kind, stage, lag).

    ops: at most one per (kind, stage). chain_start: (worker, stage) gradient ops that start a
    partial sum (nothing received). completes: the gradient ops that complete a stage's sum.
    gradient_kinds: the kinds whose ops add to a partial sum (those that complete a micro-batch's
    weight gradient, `OpKind.completes_gradient`: B, or W where split).
    partials: running sums sent at the end of the tick. sums: completed sums sent. applies.
    depths: (op, depth) of each op that reads a version older than the newest its worker
    stores: depth d >= 1, the version d applies before the newest (the worker keeps the newest
    `RingTicks.stored_versions` of each stage); every other op reads the newest.
    """

    ops: tuple[RingOp, ...] = ()
    chain_start: frozenset[tuple[int, int]] = frozenset()
    completes: tuple[Completes, ...] = ()
    partials: tuple[Partial, ...] = ()
    sums: tuple[SumSend, ...] = ()
    applies: tuple[RingApply, ...] = ()
    gradient_kinds: tuple[str, ...] = (gradient_kind(False),)
    depths: tuple[tuple[RingOp, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class RingTicks:
    """One steady-state period (T ticks, from worker 0's start of a step) of a CDP table, as
    the ring runs it. `max_lag`: the oldest step a period touches; `live`: the gradient
    buffers (kind, stage, lag) whose values come from the previous period (where they had
    lag - 1); `newest[j]`: a worker that has applied, at a period boundary, every update of
    stage j complete by then (the others may still be waiting for theirs); `min_versions`: the
    versions of each stage a worker keeps at least, where the runtime adds a per-step depth to
    each read (`lower_ring`'s `versions`, `cdpjax.methods.ring.Period`'s `read_depths`)."""

    workers: int
    stages: int
    ticks: tuple[RingTick, ...]
    max_lag: int
    live: tuple[tuple[str, int, int], ...]
    newest: tuple[int, ...]
    min_versions: int = 1

    @property
    def period_ticks(self) -> int:
        return len(self.ticks)

    @property
    def stored_versions(self) -> int:
        """Versions of each stage a worker keeps: the newest and as many before it as its oldest
        read reaches."""
        return max(1 + max((d for tk in self.ticks for _, d in tk.depths), default=0), self.min_versions)

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


def op_order(tk: RingTick) -> list[RingOp]:
    """The tick's ops in the order a worker runs its own: forwards, then backward ops by stage
    (earlier stages first: the larger activations), those that start a new partial sum last
    (their new gradient buffer then never meets another op's workspace)."""
    return sorted(tk.ops, key=lambda o: (not lookup(o.kind).forward, (o.worker, o.stage) in tk.chain_start, o.stage,
                                         lookup(o.kind).splits_backward))


class RingRouting(NamedTuple):
    """The ring's period as data, for a scanned runtime: per tick t, worker w and position k (a
    worker's ops of one tick in `op_order`, k < positions), which op it runs and on which
    buffers; per tick, worker and position a, which stage's update it applies from which slot.

    Gradient buffers: stage j's named buffers (kind, j, lag) in `slot_count[j]` slots, names
    whose lives in the period do not overlap sharing one (`names[j][i]` in slot
    `slot_index[j][i]`); a name lives from its first access (the period's start where it is
    `live`) to its last (the period's end where the next period takes it as lag + 1). A
    message zeroes the slot of the workers it does not reach (as the unrolled period did):
    no other name of that slot lives then, and the next is written before it is read.

    op_branch[t, w, k]: index into `op_kinds[k]` ((kind, stage) pairs), len(op_kinds[k]) where
    the worker has no k-th op. op_lag: the step's lag (the op runs iff that step was fed).
    op_read: the slot of the partial sum a gradient op adds to; op_start: it starts one instead
    (reads nothing); op_write: the slot its sum (partial or completed) goes to. op_depth: the
    parameter version the op reads, as a depth below the newest its worker stores (0: the newest;
    `RingTick.depths`).
    apply_stage[p, t, w, a]: the stage whose completed sum the worker applies before the tick's
    sends (p = 0) or after them (p = 1), `stages` where none; apply_lag, apply_slot likewise.
    reads[(t, w, k)] / writes[(t, w, k)]: the names of the buffers a gradient op reads (its
    partial sum; absent where it starts one) and writes (its partial or completed sum), which
    `ring_pool` places.
    """

    op_kinds: tuple[tuple[tuple[str, int], ...], ...]
    op_branch: np.ndarray
    op_lag: np.ndarray
    op_read: np.ndarray
    op_write: np.ndarray
    op_start: np.ndarray
    op_depth: np.ndarray
    apply_stage: np.ndarray
    apply_lag: np.ndarray
    apply_slot: np.ndarray
    names: tuple[tuple[tuple[str, int, int], ...], ...]
    slot_index: tuple[tuple[int, ...], ...]
    slot_count: tuple[int, ...]
    reads: dict[tuple[int, int, int], tuple[str, int, int]]
    writes: dict[tuple[int, int, int], tuple[str, int, int]]

    def slot(self, name: tuple[str, int, int]) -> int:
        """The slot of gradient buffer `name` in its stage's stack."""
        j = name[1]
        return self.slot_index[j][self.names[j].index(name)]


@gc_paused()
def ring_routing(ticks: RingTicks) -> RingRouting:
    """`ticks` as the integer arrays a scanned period indexes by (tick, worker): linear in the
    number of events."""
    T, N, L = len(ticks.ticks), ticks.workers, ticks.stages
    names = set(ticks.live) | {(kind, j, lag - 1) for kind, j, lag in ticks.live}
    for tk in ticks.ticks:
        names.update(name for name, _, _ in accesses(tk))
    per_stage = tuple(tuple(sorted(n for n in names if n[1] == j)) for j in range(L))
    slot_of = _slots(ticks, names)
    per_worker = [[[] for _ in range(N)] for _ in range(T)]
    for t, tk in enumerate(ticks.ticks):
        for op in op_order(tk):
            per_worker[t][op.worker].append(op)
    kinds, branch = op_branches(per_worker)
    shape = branch.shape
    lag, read, write, version = (np.zeros(shape, np.int32) for _ in range(4))
    start = np.zeros(shape, bool)
    reads, writes = {}, {}
    for t, tk in enumerate(ticks.ticks):
        done = {(c.worker, c.stage, c.lag) for c in tk.completes}
        depth = dict(tk.depths)
        for w in range(N):
            for k, o in enumerate(per_worker[t][w]):
                lag[t, w, k] = o.lag
                version[t, w, k] = depth.get(o, 0)
                if o.kind in tk.gradient_kinds:
                    start[t, w, k] = (w, o.stage) in tk.chain_start
                    if not start[t, w, k]:
                        reads[(t, w, k)] = ("partial", o.stage, o.lag)
                        read[t, w, k] = slot_of[reads[(t, w, k)]]
                    writes[(t, w, k)] = ("sum" if (w, o.stage, o.lag) in done else "partial", o.stage, o.lag)
                    write[t, w, k] = slot_of[writes[(t, w, k)]]
    applies = [[[[] for _ in range(N)] for _ in range(T)] for _ in range(2)]
    for t, tk in enumerate(ticks.ticks):
        for j, a_lag, workers, after in tk.applies:
            for w in workers:
                applies[int(after)][t][w].append((j, a_lag))
    A = max((len(a) for p in applies for row in p for a in row), default=0)
    a_shape = (2, T, N, max(A, 1))
    a_stage, a_lag, a_slot = np.full(a_shape, L, np.int32), np.zeros(a_shape, np.int32), np.zeros(a_shape, np.int32)
    for p in range(2):
        for t in range(T):
            for w in range(N):
                for a, (j, lg) in enumerate(applies[p][t][w]):
                    a_stage[p, t, w, a], a_lag[p, t, w, a] = j, lg
                    a_slot[p, t, w, a] = slot_of[("sum", j, lg)]
    return RingRouting(kinds, branch, lag, read, write, start, version, a_stage, a_lag, a_slot, per_stage,
                       tuple(tuple(slot_of[n] for n in per) for per in per_stage),
                       tuple(max((slot_of[n] + 1 for n in per), default=0) for per in per_stage), reads, writes)


class RingPool(NamedTuple):
    """Where each worker keeps its gradient sums: one flat pool of `size` elements per worker
    (the train state between calls, the scan's carry within one), each buffer at an offset
    chosen for that worker alone, so that a worker holds what it needs at once, not every buffer
    any worker needs at a tick (what one slot per name shared by every worker held: L running
    and L completed sums, 2 models, at every N).

    A buffer is one (kind, stage, step) on one worker, from its first access by that worker to
    its last (the ring's events repeated over periods: a buffer may cross a period's end, its
    lag then one more); its offset repeats every period, so the pool passes from call to call
    as it is, but for a buffer living a period or more: one buffer per period of its life, each
    moved on to the next at the period's end (`moves`). Two buffers of a worker share bytes only
    if their lives share no tick.

    op_read[t, w, k] / op_write[t, w, k]: the offsets of the partial sum worker w's k-th op of
    tick t adds to and of the sum it writes (`RingRouting`'s op_read / op_write, as offsets);
    apply_at[p, t, w, a]: the offset of the sum of `RingRouting.apply_stage[p, t, w, a]`;
    at[(t, name)][w]: the offset of gradient buffer `name` on worker w at tick t (0 where w
    does not hold it: a message or sum not meant for w reads and writes back its own bytes).
    moves: `PoolMove`s. held: each distinct set of stages whose sums a worker holds at once (a
    stage twice where it holds two of its sums), sorted: the pool holds the largest at least.
    """

    size: int
    op_read: np.ndarray
    op_write: np.ndarray
    apply_at: np.ndarray
    at: dict
    moves: tuple = ()
    held: tuple = ()


class PoolMove(NamedTuple):
    """A buffer held across a period's end placed elsewhere in the next period (it lives a period
    or more: its two periods' lives meet): `size` elements of stage `stage` moved from `source[w]`
    to `target[w]` on each worker w with `held[w]`."""

    size: int
    stage: int
    source: np.ndarray
    target: np.ndarray
    held: np.ndarray


def ring_pool(ticks: RingTicks, routing: RingRouting, sizes) -> RingPool:
    """Each worker's buffers placed in its own pool (`RingPool`); `sizes[j]`: stage j's gradient
    elements. Offsets are first fit, by the buffers' birth tick and then by size (the smaller
    pool of the two orders)."""
    T, N = ticks.period_ticks, ticks.workers
    periods = 2 * max(ticks.max_lag, 1) + 3
    middle = periods // 2
    touched = [list(_touches(tk)) for tk in ticks.ticks]
    spans: dict = {}  # (kind, stage, step, worker) -> (first, last) absolute tick
    for per in range(periods):
        for t, tk in enumerate(touched):
            for (kind, j, lag), w in tk:
                key, now = (kind, j, per - lag, w), per * T + t
                first, last = spans.get(key, (now, now))
                spans[key] = (min(first, now), max(last, now))
    at: dict = {}
    lives: list[dict] = [{} for _ in range(N)]  # per worker: buffer -> (ticks of the period it holds, size)
    moved: dict = {}  # (buffer, its next period's) -> workers: moved at the period's end
    for t, tk in enumerate(touched):
        for (kind, j, lag), w in tk:
            first, last = spans[(kind, j, middle - lag, w)]
            # the same buffer in every period: born at the same tick of a period, as the same lag; one
            # living a period or more is one buffer per period of its life, moved on at each period's end
            born = (kind, j, first % T, first // T - (middle - lag))
            if last - first < T:
                lives[w][born + (0,)] = (_mask(first, last, T), int(sizes[j]))
                at.setdefault((t, (kind, j, lag)), {})[w] = born + (0,)
                continue
            periods_held = range(first // T, last // T + 1)
            for i, per in enumerate(periods_held):
                lives[w][born + (i,)] = (_mask(max(first, per * T), min(last, per * T + T - 1), T), int(sizes[j]))
                if per < last // T:
                    moved.setdefault((born + (i,), born + (i + 1,)), set()).add(w)
            at.setdefault((t, (kind, j, lag)), {})[w] = born + (middle - first // T,)
    offset = [_first_fit(mine) for mine in lives]
    moves = tuple(PoolMove(int(sizes[a[1]]), a[1], np.array([offset[w][a] if w in ws else 0 for w in range(N)]),
                           np.array([offset[w][b] if w in ws else 0 for w in range(N)]),
                           np.array([w in ws for w in range(N)]))
                  for (a, b), ws in sorted(moved.items()) if any(offset[w][a] != offset[w][b] for w in ws))
    size = max([max(sizes, default=0)] + [o + lives[w][b][1] for w in range(N) for b, o in offset[w].items()])
    where = {key: np.array([offset[w][b] if (b := on.get(w)) is not None else 0 for w in range(N)], np.int64)
             for key, on in at.items()}
    nowhere = np.zeros((N,), np.int64)

    def placed(t, name):
        return where.get((t, name), nowhere)

    read, write = np.zeros(routing.op_read.shape, np.int64), np.zeros(routing.op_write.shape, np.int64)
    for offsets, names in ((read, routing.reads), (write, routing.writes)):
        for (t, w, k), name in names.items():
            offsets[t, w, k] = placed(t, name)[w]
    apply_at = np.zeros(routing.apply_slot.shape, np.int64)
    for p, t, w, a in zip(*np.nonzero(routing.apply_stage < ticks.stages)):
        name = ("sum", int(routing.apply_stage[p, t, w, a]), int(routing.apply_lag[p, t, w, a]))
        apply_at[p, t, w, a] = placed(t, name)[w]
    held = {tuple(sorted(b[1] for b, (mask, _) in mine.items() if mask >> t & 1)) for mine in lives for t in range(T)}
    return RingPool(int(size), read, write, apply_at, where, moves, tuple(sorted(held - {()})))


def with_pool(program: Program, pool: RingPool) -> Program:
    """`program` declaring the gradient buffers its runtime holds: each worker's pool (`ring_pool`),
    between calls, as large as the most sums a worker holds at once (the first fit places them within
    15% of it in the cases tests/test_ring_memory.py checks), in place of one buffer per name for every
    worker."""
    kept = tuple(b for b in program.buffers if b.holds != "gradients")
    pooled = Buffer("pool", "gradients", Size("param", pool.held, True), True)
    return dataclasses.replace(program, buffers=kept + (pooled,))


def _mask(first: int, last: int, T: int) -> int:
    """Ticks first..last (absolute) as a bit mask over the period's T ticks."""
    held = 0
    for now in range(first, last + 1):
        held |= 1 << (now % T)
    return held


def _touches(tk: RingTick):
    """(gradient buffer, worker) of every access of the tick (`accesses`), and the two a tick may
    make of a running sum it starts and sends on at once: the op's write, the send's read."""
    yield from ((name, w) for name, w, _ in accesses(tk))
    done = {(c.worker, c.stage, c.lag) for c in tk.completes}
    for w, kind, j, lag in tk.ops:
        if kind in tk.gradient_kinds and (w, j, lag) not in done:
            yield ("partial", j, lag), w
    for j, lag, pairs in tk.partials:
        for src, _ in pairs:
            yield ("partial", j, lag), src


def _first_fit(lives: dict) -> dict:
    """buffer -> offset, each at the lowest offset clear of every placed buffer whose ticks meet
    its own; `lives`: buffer -> (ticks held, as a bit mask; size). Tried in two orders (birth
    tick; size, largest first), the one whose pool ends lower kept."""
    best, end = {}, None
    for order in (sorted(lives, key=lambda b: (b[2], b)), sorted(lives, key=lambda b: (-lives[b][1], b))):
        placed: dict = {}
        for b in order:
            held, size = lives[b]
            taken = sorted((placed[o], placed[o] + lives[o][1]) for o in placed if lives[o][0] & held)
            at = 0
            for lo, hi in taken:
                if at + size <= lo:
                    break
                at = max(at, hi)
            placed[b] = at
        top = max((placed[b] + lives[b][1] for b in placed), default=0)
        if end is None or top < end:
            best, end = placed, top
    return best


def name_lives(ticks: RingTicks, names) -> dict:
    """Gradient buffer name -> (first, last) tick of its life in the period: from its first
    access (0 where the previous period hands it on: `live`) to its last (T - 1 where the next
    period takes it as lag + 1)."""
    T = len(ticks.ticks)
    carried = {(kind, j, lag - 1) for kind, j, lag in ticks.live}
    first, last = {}, {}
    for t, tk in enumerate(ticks.ticks):
        for name, _, _ in accesses(tk):
            first.setdefault(name, t)
            last[name] = t
    return {n: (0 if n in ticks.live else first.get(n, 0), T - 1 if n in carried else last.get(n, T - 1))
            for n in names}


def _slots(ticks: RingTicks, names) -> dict:
    """Per stage, its names packed into the fewest slots whose lives do not overlap (greedy by
    start: optimal for intervals): name -> slot."""
    lives = name_lives(ticks, names)
    slot_of = {}
    for j in range(ticks.stages):
        ends: list[int] = []  # per slot, the last tick of the life it holds
        for n in sorted((n for n in names if n[1] == j), key=lambda n: (lives[n], n)):
            first, last = lives[n]
            free = next((i for i, end in enumerate(ends) if end < first), None)
            if free is None:
                free = len(ends)
                ends.append(last)
            ends[free] = last
            slot_of[n] = free
    return slot_of


def ring_ticks(table: TimeTable) -> RingTicks:
    """The ring's period of a cyclic `table`, from its own events: ops (with the version each
    reads), updates, 'partial' and 'sum' messages and applies. Every event of one fully laid-out
    step k, at tick t, lands at tick t mod T of the period with lag t // T - k (T the table's
    period: worker 0 starts a step every T ticks); the other whole steps must land on the same
    events (the table repeats every T ticks). A table the ring cannot run is refused in one line
    naming the first op or update that lacks what the ring needs (`_refuse_unservable`)."""
    N, L, T = table.workers, table.stages, table.period
    applies = _applies(table)
    _refuse_unservable(table, applies)
    whole = _whole_steps(table, applies)
    if not whole:
        raise ConfigError(f"the ring engine needs one step of this {table.method} table laid out whole (every "
                          f"worker's apply of every stage's update): lay out more steps than {table.steps}")
    steps = _by_step(table, applies, set(whole))
    held = _held(applies)
    ticks = _fold(table, whole[-1], *steps[whole[-1]], held)
    unversioned = [dataclasses.replace(tk, depths=()) for tk in ticks]
    updates = _shifted_updates(table, T)
    last = (_shifted(steps[whole[-1]], whole[-1], T), updates.get(whole[-1]))
    for k in whole[:-1]:
        if (_shifted(steps[k], k, T), updates.get(k)) == last:
            continue  # the same events T ticks apart fold into the same period (the reads aside)
        # early steps' reads clamp at version 0: their depths differ
        other = [dataclasses.replace(tk, depths=()) for tk in _fold(table, k, *steps[k], held)]
        if other != unversioned:
            t = next(t for t, (a, b) in enumerate(zip(unversioned, other)) if a != b)
            raise ConfigError(f"the ring engine runs a table that repeats every {T} ticks, and this {table.method} "
                              f"table's step {k} differs from step {whole[-1]} at tick {t} of the "
                              f"period: {other[t]} != {unversioned[t]}")
    _refuse_other_reads(table, ticks, held, set(whole))
    lags = [op[3] for tk in ticks for op in tk.ops] + [a[1] for tk in ticks for a in tk.applies]
    lag_of = [{} for _ in range(L)]
    for tk in ticks:
        for j, lag, ws, _ in tk.applies:
            lag_of[j].update(dict.fromkeys(ws, lag))
    # the worker whose apply of stage j is fewest calls late: it holds the newest version
    newest = [min(range(N), key=lambda w: (lag_of[j].get(w, 0), w)) for j in range(L)]
    return RingTicks(N, L, ticks, max(lags), _live(ticks, N), tuple(newest))


def _refuse_other_reads(table: TimeTable, ticks: tuple[RingTick, ...], held, whole: set) -> None:
    """A ConfigError naming the first op of a whole step whose read the period does not serve: the
    period reads at depth d below the newest version its worker stores (the last whole step's
    depth), which is version max(newest - d, 0) (a worker starts with every stored version the
    initial parameters: a read before version 0 is of version 0)."""
    T = table.period
    depth = [{op[:4]: d for op, d in tk.depths} for tk in ticks]
    for o in sorted(table.ops, key=lambda o: (o.tick, o.device, o.stage)):
        if o.step not in whole:
            continue
        lag = o.tick // T - o.step
        d = depth[o.tick % T].get((o.device, o.kind, o.stage, lag), 0)
        if max(held(o) - d, 0) != o.version:
            raise ConfigError(f"the ring engine cannot run this {table.method} table: worker {o.device}'s "
                              f"{o.kind}{o.stage} of step {o.step} at tick {o.tick} reads version {o.version}, and "
                              f"the period's op there reads {d} version(s) before the newest the worker stores "
                              f"({held(o)}): the steps read differently")


def _applies(table: TimeTable) -> dict:
    """(worker, stage, step) -> the tick at whose end the worker applies that update (a table
    without `applies`: every worker at the update's tick)."""
    if table.applies:
        return {(a.worker, a.stage, a.step): a.tick for a in table.applies}
    return {(w, u.stage, u.step): u.tick for u in table.updates for w in range(table.workers)}


def runs(kind: str) -> bool:
    """Whether the ring has a piece for op kind `kind` (`cdpjax.methods.ring`): a forward, or backward
    work that runs no forward of its own (the ring's pieces read the input the forward stashed); not
    an op that does both (local learning's)."""
    return lookup(kind).single_direction


def _held(applies: dict):
    """op -> the newest version of its stage its worker stores at its tick: how many of that
    stage's updates the worker applied at the end of an earlier tick (`applies`: `_applies`)."""
    applied: dict = {}
    for (w, j, k), t in applies.items():
        applied.setdefault((w, j), []).append(t)
    for ts in applied.values():
        ts.sort()
    return lambda o: bisect.bisect_left(applied.get((o.device, o.stage), []), o.tick)


def _refuse_unservable(table: TimeTable, applies: dict) -> None:
    """A ConfigError naming the first op or update the ring cannot serve: an op kind it has no
    piece for, an op reading a version its worker has not applied by that tick,
    a gradient op with no partial sum to add to, an update whose tick is not its last gradient
    op's, an apply before its worker holds the sum. `applies`: the table's (`_applies`)."""
    what = f"the ring engine cannot run this {table.method} table"
    runnable = {kind for kind in {o.kind for o in table.ops} if runs(kind)}  # a look-up per kind, not per op
    for o in table.ops:
        if o.kind not in runnable:
            raise ConfigError(f"{what}: worker {o.device}'s op {o.kind}{o.stage} at tick {o.tick} is of kind "
                              f"{o.kind!r}, which the ring has no piece for (it runs {', '.join(filter(runs, KINDS))})")
    applied = {}
    for (w, j, k), t in applies.items():
        applied.setdefault((w, j), []).append(t)
    for ts in applied.values():
        ts.sort()

    held = _held(applies)
    ahead = [o for o in table.ops if held(o) < o.version]
    if ahead:
        o = min(ahead, key=lambda o: (o.tick, o.device, o.stage))  # the first in time
        raise ConfigError(f"{what}: worker {o.device}'s {o.kind}{o.stage} of step {o.step} at tick {o.tick} "
                          f"reads version {o.version}, and the newest version the worker stores then is {held(o)} "
                          f"(its applies of stage {o.stage} end ticks "
                          f"{applied.get((o.device, o.stage), [])[:o.version + 1]}); use cdp_impl='simulate'")
    grad = gradient_kind(table.split_backward)
    received = {(m.dst, m.stage, m.step): m.tick for m in table.messages if m.kind == "partial"}
    sent = {(m.src, m.stage, m.step) for m in table.messages if m.kind == "partial"}
    last = {}
    for o in sorted(table.ops, key=lambda o: o.tick):
        if o.kind != grad:
            continue
        key = (o.stage, o.step)
        got = received.get((o.device, o.stage, o.step))
        if key in last and (got is None or got >= o.tick):
            raise ConfigError(f"{what}: worker {o.device}'s {o.kind}{o.stage} of step {o.step} at tick {o.tick} "
                              f"adds to stage {o.stage}'s running sum, and no 'partial' message brings it the sum "
                              f"before then")
        last[key] = o
    for u in table.updates:
        o = last.get((u.stage, u.step))
        if o is not None and o.tick != u.tick:
            raise ConfigError(f"{what}: stage {u.stage}'s update of step {u.step} is at tick {u.tick}, not at the "
                              f"tick of its last gradient op (worker {o.device}'s, tick {o.tick})")
        if o is not None and (o.device, o.stage, o.step) in sent:
            raise ConfigError(f"{what}: worker {o.device} completes stage {u.stage}'s sum of step {u.step} at tick "
                              f"{u.tick} and also sends it on as a 'partial'")
    has = {(last[(u.stage, u.step)].device, u.stage, u.step): u.tick for u in table.updates
           if (u.stage, u.step) in last}
    for m in sorted((m for m in table.messages if m.kind == "sum"), key=lambda m: m.tick):
        has.setdefault((m.dst, m.stage, m.step), m.tick)
    for (w, j, k), t in sorted(applies.items(), key=lambda kv: kv[1]):
        if (j, k) in last and has.get((w, j, k), t + 1) > t:
            raise ConfigError(f"{what}: worker {w} applies stage {j}'s update of step {k} at tick {t}, and no "
                              f"'sum' message brings it the sum by then")


def _whole_steps(table: TimeTable, applies: dict) -> list[int]:
    """The steps all of whose applies (every worker, every stage) are laid out (`applies`: the
    table's, `_applies`)."""
    return [k for k in range(table.steps)
            if all((w, j, k) in applies for w in range(table.workers) for j in range(table.stages))]


def _by_step(table: TimeTable, applies: dict, steps: set) -> dict:
    """step -> (its ops, its messages, its applies {(stage, worker): tick}) for each of `steps`."""
    out = {k: ([], [], {}) for k in steps}
    for o in table.ops:
        if o.step in out:
            out[o.step][0].append(o)
    for m in table.messages:
        if m.step in out:
            out[m.step][1].append(m)
    for (w, j, k), t in applies.items():
        if k in out:
            out[k][2][(j, w)] = t
    return out


def _shifted(events: tuple, step: int, T: int) -> tuple:
    """A step's ops, messages and applies (`_by_step`'s) with their ticks counted from the step's
    start, in a canonical order, versions aside: two steps whose shifted events are equal fold
    into the same period (`_fold` reads nothing else of them but the versions)."""
    ops, messages, applied = events
    start = step * T
    return (sorted((o.tick - start, o.device, o.stage, o.kind) for o in ops),
            sorted((m.tick - start, m.src, m.dst, m.stage, m.kind) for m in messages),
            sorted((j, w, t - start) for (j, w), t in applied.items()))


def _shifted_updates(table: TimeTable, T: int) -> dict:
    """step -> its updates' (stage, tick from the step's start), sorted."""
    out: dict = {}
    for u in table.updates:
        out.setdefault(u.step, []).append((u.stage, u.tick - u.step * T))
    return {k: sorted(v) for k, v in out.items()}


def _fold(table: TimeTable, step: int, ops: list, messages: list, applied: dict, held) -> tuple[RingTick, ...]:
    """The period's events from those of `step` (each at tick t mod T, lag t // T - step): its
    `ops`, `messages` and `applied` ((stage, worker) -> apply tick), `_by_step`'s; each op's read
    as a depth below the newest version its worker stores then (`held`: `_held`)."""
    # Long on purpose: one pass over the step's ops and messages fills every event list of its ticks.
    T, N = table.period, table.workers
    grad = gradient_kind(table.split_backward)

    def early(t: int, what: str):
        raise ConfigError(f"the ring engine cannot run this {table.method} table: its {what} of step {step} "
                          f"at tick {t} is before worker 0 starts that step (tick {step * T})")

    def at(t: int, what) -> tuple[int, int]:  # what(): the event's words, made only for the error
        lag = t // T - step
        if lag < 0:
            early(t, what())
        return t % T, lag

    ticks = [dict(ops=[], chain_start=set(), completes=[], partials={}, sums={}, applies={}, depths=[])
             for _ in range(T)]
    u_tick = {u.stage: u.tick for u in table.updates if u.step == step}
    received = {(m.dst, m.stage) for m in messages if m.kind == "partial"}
    completer = {}
    for o in ops:
        lag = o.tick // T - step  # `at`, inline: one call less per op
        if lag < 0:
            early(o.tick, f"{o.kind}{o.stage} of worker {o.device}")
        tk = ticks[o.tick % T]
        tk["ops"].append(RingOp(o.device, o.kind, o.stage, lag))
        newest = held(o)
        if newest > o.version:
            tk["depths"].append((tk["ops"][-1], newest - o.version))
        if o.kind == grad:
            if (o.device, o.stage) not in received:
                tk["chain_start"].add((o.device, o.stage))
            if u_tick[o.stage] == o.tick:
                completer[o.stage] = o.device
                tk["completes"].append(Completes(o.device, o.stage, lag))
    # Who holds each sum when: from its arrival (the completer: u) to its last use.
    arrive = {(j, c): u_tick[j] for j, c in completer.items()}
    end = {}
    for m in messages:
        if m.kind == "sum":
            arrive[(m.stage, m.dst)] = m.tick
            end[(m.stage, m.src)] = max(end.get((m.stage, m.src), -1), m.tick)
    for (j, w), t in applied.items():
        end[(j, w)] = max(end.get((j, w), -1), t)
    for m in messages:
        lag = m.tick // T - step
        if lag < 0:
            early(m.tick, f"'{m.kind}' message of stage {m.stage}")
        if m.kind == "partial":
            ticks[m.tick % T]["partials"].setdefault((m.stage, lag), []).append((m.src, m.dst))
        elif m.kind == "sum":
            ticks[m.tick % T]["sums"].setdefault((m.stage, lag, m.tick), []).append((m.src, m.dst))
    applies_at = [[] for _ in range(T)]  # per tick of the period: (stage, lag, worker)
    for (j, w), tick in applied.items():
        at_t, lag = at(tick, lambda: f"apply of stage {j} by worker {w}")
        applies_at[at_t].append((j, lag, w))
    # Per stage, each worker's arrival and last use of the sum (none: never, -1), as arrays: whether a
    # worker that a send does not reach still holds the sum after it is one vector test per send.
    stages = sorted({j for j, _ in arrive} | {j for j, _ in end})
    row = {j: i for i, j in enumerate(stages)}
    held_from = np.full((len(stages), N), np.iinfo(np.int64).max, np.int64)
    held_to = np.full((len(stages), N), -1, np.int64)
    for (j, w), t in arrive.items():
        held_from[row[j], w] = t
    for (j, w), t in end.items():
        held_to[row[j], w] = t
    out = []
    for t, tk in enumerate(ticks):
        sums = []
        for (j, lag, tick), pairs in sorted(tk["sums"].items()):
            c, got, until = completer.get(j), held_from[row[j]], held_to[row[j]]
            holds = (got < tick) & (until > tick)  # held before this tick, used after it
            if c is not None:  # the completer holds it from its own tick
                holds[c] |= bool(got[c] == tick and until[c] > tick)
            for _, d in pairs:
                holds[d] = False
            sums.append(SumSend(j, lag, tuple(sorted(pairs)), bool(holds.any())))
        receivers = {(j, lag, d) for j, lag, pairs, _ in sums for _, d in pairs}
        applies = {}
        for j, lag, w in applies_at[t]:
            applies.setdefault((j, lag, (j, lag, w) in receivers), []).append(w)
        out.append(RingTick(
            gradient_kinds=(grad,),
            ops=tuple(sorted(tk["ops"])),
            depths=tuple(sorted(tk["depths"])),
            chain_start=frozenset(tk["chain_start"]),
            completes=tuple(sorted(tk["completes"])),
            partials=tuple(Partial(j, lag, tuple(sorted(p))) for (j, lag), p in sorted(tk["partials"].items())),
            sums=tuple(sums),
            applies=tuple(RingApply(j, lag, tuple(sorted(ws)), after)
                          for (j, lag, after), ws in sorted(applies.items())),
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


@gc_paused()
def lower_ring(table: TimeTable, residuals: str = "recompute", deeper: int = 0) -> Program:
    """The ring's program of a cyclic table: its period from the table's own events (`ring_ticks`),
    keeping `deeper` versions of each stage more than its reads need (where the runtime reads
    deeper at some steps: `cdpjax.methods.ring.Period`'s `read_depths`)."""
    carry = carries(residuals)
    ticks = ring_ticks(table)
    if deeper > 0:
        ticks = dataclasses.replace(ticks, min_versions=ticks.stored_versions + int(deeper))
    N, L = ticks.workers, ticks.stages
    stages = range(L)
    between = [Buffer("params", "parameters", Size.stages("param", stages), True),
               Buffer("opt_state", "optimizer_state", Size.stages("param", stages), True),
               Buffer("model_state", "model_state", Size.stages("model_state", stages), True),
               Buffer("acts", "activations", Size.stages("input", stages), True),
               Buffer("cots", "cotangents", Size.stages("input", range(1, L)), True),
               Buffer("labels", "labels", Size.stage("label", 0), True)]
    if carry:
        between.append(Buffer("residuals", "residuals", Size.stages("residual", stages), True))
    if ticks.stored_versions > 1:
        between.append(Buffer("older", "previous_parameters",
                              Size.stages("param", stages, count=ticks.stored_versions - 1), True))
    # which of the last calls fed a batch (an op of an unfed call's step does nothing)
    between.append(Buffer("fed", "flags", Size("flag", ((0,),), False, max(ticks.max_lag, 1)), True))
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
    kinds = tuple(k for k in KINDS if any(op.kind == k for tk in ticks.ticks for op in tk.ops))
    placement = Placement(tuple((j,) for j in stages), (0,) * L, tuple(stages), N, L)
    return Program(table.method, "ring", ticks.period_ticks, ticks.max_lag, N, 1, kinds, table.split_backward,
                   residuals, ticks.stored_versions, bool(ticks.live), placement, tuple(between + gradients),
                   ring_events(ticks))


def ring_events(ticks: RingTicks) -> tuple[Event, ...]:
    """The period's typed events: each worker's op as a `Compute` (one micro-batch, the one copy
    it stores; a gradient op says whether it starts its stage's running sum and whether it
    completes it), each hop of a running or completed gradient sum as a `Send` and its `Receive` at
    its stage's size, each worker's apply of a completed sum to its copy as an `Apply`."""
    events: list[Event] = []
    sends: list[Send] = []
    size = [Size.stage("param", j) for j in range(ticks.stages)]  # one record per stage, shared
    for t, tk in enumerate(ticks.ticks):
        done = {(c.worker, c.stage, c.lag) for c in tk.completes}
        depth = dict(tk.depths)
        events += [Compute(t, op.worker, op.kind, op.stage, 0, depth.get(op, 0), op.lag,
                           starts_sum=op.kind in tk.gradient_kinds and (op.worker, op.stage) in tk.chain_start,
                           completes_sum=(op.worker, op.stage, op.lag) in done) for op in tk.ops]
        for what, hops in (("partial", [(p.stage, p.lag, p.pairs) for p in tk.partials]),
                           ("sum", [(s.stage, s.lag, s.pairs) for s in tk.sums])):
            sends += [Send(t, what, size[j], src, dst, j, lag)
                      for j, lag, pairs in hops for src, dst in pairs]
        events += [Apply(t, w, a.stage, 1, a.lag) for a in tk.applies for w in a.workers]
    return sorted_events(events + messages(sends))



@gc_paused()
def program_period(program: Program) -> RingTicks:
    """The ring's period as `program`'s events say it, what the runtime runs (`ring_program_routing`,
    `cdpjax.methods.ring.Period`): read from `program.events` and its typed fields (period, devices,
    placement, split_backward) alone, never from the lowering's own `RingTicks`. Per tick: each
    `Compute` an op (its `starts_sum` / `completes_sum` the gradient sum it starts or completes), the
    'partial' and 'sum' `Send`s the hops of running and completed sums, each `Apply` a worker's update
    from a completed sum, after the tick's sends where that worker receives the sum in the same tick.
    A completed sum's send keeps the copies of the workers it does not reach (`SumSend.merge`) where
    one of them received or completed it before the send and reads it after (an apply or a send of its
    own), on the timeline of one step (an event at tick t of lag l is at t + l * T of its step)."""
    T, N, L = program.period, program.devices, len(program.placement.units)
    grad = (gradient_kind(program.split_backward),)
    by_tick: list[dict] = [dict(ops=[], starts=set(), completes=[], partials={}, sums={}, applies=[], got=set(),
                                depths=[]) for _ in range(T)]
    arrive: dict = {}  # (stage, worker) -> when (on the step's timeline) it first holds the completed sum
    end: dict = {}  # (stage, worker) -> its last read of it
    completer: dict = {}  # stage -> the worker that completes its sum
    for e in program.events:
        at, now = by_tick[e.tick], e.tick + e.lag * T
        if isinstance(e, Compute):
            at["ops"].append(RingOp(e.device, e.kind, e.stage, e.lag))
            if e.version:
                at["depths"].append((at["ops"][-1], e.version))
            if e.starts_sum:
                at["starts"].add((e.device, e.stage))
            if e.completes_sum:
                at["completes"].append(Completes(e.device, e.stage, e.lag))
                completer[e.stage] = e.device
                arrive.setdefault((e.stage, e.device), now)
        elif isinstance(e, Send) and e.what in ("partial", "sum"):
            at[e.what + "s"].setdefault((e.stage, e.lag), []).append((e.src, e.dst))
            if e.what == "sum":
                end[(e.stage, e.src)] = max(end.get((e.stage, e.src), -1), now)
        elif isinstance(e, Receive) and e.what == "sum":
            at["got"].add((e.stage, e.lag, e.dst))
            arrive[(e.stage, e.dst)] = now
        elif isinstance(e, Apply):
            at["applies"].append((e.stage, e.lag, e.device))
            end[(e.stage, e.device)] = max(end.get((e.stage, e.device), -1), e.tick + e.lag * T)

    def merges(j: int, sent: int, pairs) -> bool:
        reached = {d for _, d in pairs}
        c = completer.get(j)
        return any(arrive.get((j, w), sent + 1) < sent < end.get((j, w), -1)
                   or (w == c and arrive.get((j, w)) == sent < end.get((j, w), -1))
                   for w in range(N) if w not in reached)

    ticks = []
    for t, at in enumerate(by_tick):
        applies: dict = {}
        for j, lag, w in at["applies"]:
            applies.setdefault((j, lag, (j, lag, w) in at["got"]), []).append(w)
        ticks.append(RingTick(
            ops=tuple(sorted(at["ops"])), chain_start=frozenset(at["starts"]), depths=tuple(sorted(at["depths"])),
            completes=tuple(sorted(at["completes"])),
            partials=tuple(Partial(j, lag, tuple(sorted(p))) for (j, lag), p in sorted(at["partials"].items())),
            sums=tuple(SumSend(j, lag, tuple(sorted(p)), merges(j, t + lag * T, p))
                       for (j, lag), p in sorted(at["sums"].items())),
            applies=tuple(RingApply(j, lag, tuple(sorted(ws)), after)
                          for (j, lag, after), ws in sorted(applies.items())),
            gradient_kinds=grad))
    ticks = tuple(ticks)
    lag_of: list[dict] = [{} for _ in range(L)]
    for tk in ticks:
        for j, lag, ws, _ in tk.applies:
            lag_of[j].update(dict.fromkeys(ws, lag))
    newest = tuple(min(range(N), key=lambda w: (lag_of[j].get(w, 0), w)) for j in range(L))
    lags = [op.lag for tk in ticks for op in tk.ops] + [a.lag for tk in ticks for a in tk.applies]
    period = RingTicks(N, L, ticks, max(lags, default=0), _live(ticks, N), newest)
    # versions kept beyond the static reads' need: the runtime's per-step depths (`lower_ring`)
    return dataclasses.replace(period, min_versions=program.versions) if program.versions > period.stored_versions \
        else period


def ring_program_routing(program: Program) -> RingRouting:
    """The routing the ring's scan reads (`RingRouting`), compiled from the program's events
    (`program_period`)."""
    return ring_routing(program_period(program))


__all__ = ["SENDS_BY_TICK", "Completes", "Partial", "PoolMove", "RingApply", "RingOp", "RingPool", "RingRouting",
           "RingTick", "RingTicks", "SumSend", "accesses", "lower_ring", "name_lives", "op_order", "program_period",
           "ring_events", "ring_pool", "ring_program_routing", "ring_routing", "ring_ticks", "with_pool"]
