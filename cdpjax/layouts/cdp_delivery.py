"""The ring's delivery plan: how each completed gradient sum reaches every worker (pure Python).

Part of a CDP table (`cdpjax.layouts.cdp.cdp_table`: its 'partial' and 'sum'
messages, `meta['applies']`):
- 'partial': workers finish stage j's gradient op one after another, so a running
  partial sum hops one worker along the ring each time a worker finishes.
- 'sum': the last worker completes the sum, then the sum travels as a chain, one
  hop per tick at most, to every other worker, each of which applies the update to
  its own copy. A worker's delivery window for update k of stage j opens when the
  sum is complete and it has done its last op reading the old version (`lo`), and
  closes before its first op reading the new one (`hi`); the chain visits workers
  in order of their windows, each holder forwarding it no earlier than the tick
  after it arrived and not before it has applied it, with at most one 'sum' send
  and one 'sum' receive per worker per tick (two where one cannot meet every
  deadline: paired forwards at N = L), plus at most one 'partial' send, one per
  gradient op. Each worker applies the update at the end of tick
  max(arrival, lo), so ONE stored version per stage suffices: an op always reads
  its worker's current copy. A reader whose window cannot be met (only the
  paper-code rule for N > L) is named in the table's notes.
"""
from __future__ import annotations

import bisect
import dataclasses

from cdpjax.timetable import Message

def windows(ops, updates, completer) -> dict:
    """(stage, step) -> {worker: (lo, hi)}: the ticks at whose end each worker may apply the
    update (lo: the sum is complete and its last op reading an older version is done; hi:
    the tick before its first op reading the new version, None where the table does not
    reach it). hi < u marks a read that comes before the update is complete (paper-code,
    N > L)."""
    # Per stage and worker, its read versions in order, with the last tick of the reads of each
    # version or an older one and the first tick of those of each version or a newer one: then
    # each update's window is two look-ups, not a pass over the worker's reads.
    by_pair = {}
    for o in ops:
        by_pair.setdefault((o.stage, o.device), []).append((o.version, o.tick))
    reads = {}
    for (j, r), rs in by_pair.items():
        rs.sort()
        versions, last_old, first_new = [], [], []
        for v, t in rs:  # by version, then tick
            if not versions or versions[-1] != v:
                versions.append(v)
                first_new.append(t)
                last_old.append(max(t, last_old[-1]) if last_old else t)
            else:
                last_old[-1] = max(t, last_old[-1])
        for i in range(len(first_new) - 2, -1, -1):
            first_new[i] = min(first_new[i], first_new[i + 1])
        reads.setdefault(j, {})[r] = (versions, last_old, first_new)
    out = {}
    for u in updates:
        per = {}
        for r, (versions, last_old, first_new) in reads.get(u.stage, {}).items():
            n = bisect.bisect_right(versions, u.step)  # versions[:n] <= step < versions[n:]
            lo = max(u.tick, last_old[n - 1]) if n else u.tick
            per[r] = (lo, first_new[n] - 1 if n < len(versions) else None)
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


def delivery(ops, updates, completer, N, L, steps, T, capacity: int = 1):
    """The delivery plan of every stage: one list-scheduled plan per stage, the same for
    every step (the windows repeat every T ticks). At every tick, pending readers are
    served in order of their deadlines (acausal ones last), each from a holder free to
    send (at most `capacity` 'sum' sends and receives per worker per tick, counted modulo T
    so that the plans of consecutive steps share the ticks too), holders that have applied
    first."""
    # Long on purpose: one list scheduler, its state (pending readers, holders, busy ticks) read by each step.
    win = windows(ops, updates, completer)
    u_tick = {(u.stage, u.step): u.tick for u in updates}
    ref = 1  # a step whose windows are those of every step
    busy_send = [[0] * N for _ in range(T)]  # [tick mod T][worker]: 'sum' sends in that tick
    busy_recv = [[0] * N for _ in range(T)]
    holders, arrive, lo_of, hi_of, done, u_of = {}, {}, {}, {}, {}, {}
    starting = {}  # tick -> the pending readers of the stages whose sums complete then
    for j in range(L):
        u, c = u_tick[(j, ref)], completer[(j, ref)]
        w = win[(j, ref)]
        lo_of[j] = {r: lo - u for r, (lo, _) in w.items()}
        hi_of[j] = {r: (hi - u if hi is not None else 10 * T) for r, (_, hi) in w.items()}
        # a reader's rank among all (its key is fixed): deadline first, acausal ones last
        starting.setdefault(u, []).extend((hi_of[j][r] < 0, hi_of[j][r], lo_of[j][r], j, r) for r in w if r != c)
        arrive[j] = {c: 0}
        holders[j] = [c]
        done[j] = []
        u_of[j] = u
    start = min(starting)
    queue = []  # the pending readers of the stages complete by this tick, in rank order
    waiting = sum(len(rs) for rs in starting.values())
    tick = start
    while waiting:
        if tick > start + 6 * T:
            raise AssertionError(f"no delivery plan for N={N}, L={L}")
        if tick in starting:
            queue = sorted(queue + starting[tick])
        sends, recvs = busy_send[tick % T], busy_recv[tick % T]
        free = {}  # stage -> its holders able to send now, best first (made at the stage's first reader)
        left = []
        for key in queue:
            j, r = key[3], key[4]
            if recvs[r] >= capacity:
                left.append(key)
                continue
            off = tick - u_of[j]
            senders = free.get(j)
            if senders is None:
                # a holder sends from the tick after the sum reached it (the completer from its own);
                # the sum received this tick is not held yet, so the list holds for the whole tick
                c = completer[(j, ref)]
                ready = [h for h in holders[j] if arrive[j][h] < off or (arrive[j][h] == 0 and h == c)]
                senders = free[j] = sorted(ready, key=lambda h: (max(arrive[j][h], lo_of[j][h]) > off, h))
            busy = 0  # a holder busy now stays busy for the rest of the tick
            while busy < len(senders) and sends[senders[busy]] >= capacity:
                busy += 1
            del senders[:busy]
            if not senders:
                left.append(key)
                continue
            h = senders[0]
            sends[h] += 1
            recvs[r] += 1
            done[j].append((off, h, r))
            arrive[j][r] = off
            holders[j].append(r)
            waiting -= 1
        queue = left
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


def messages_and_applies(plans, updates):
    messages, applies = [], []
    for up in updates:
        d = plans[up.stage]
        messages += [Message(up.tick + s, h, r, up.stage, "sum", up.step) for s, h, r in d.hops]
        applies += [(up.tick + a, w, up.stage, up.step) for w, a in d.apply.items()]
    return messages, applies


def check_one_version(ops, applies, method, skip=()):
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
        n = bisect.bisect_left(done.get((o.device, o.stage), []), o.tick)
        if n != o.version:
            raise AssertionError(f"{method}: worker {o.device} holds version {n} of stage {o.stage} at tick "
                                 f"{o.tick}; its op reads {o.version}")
