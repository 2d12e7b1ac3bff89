"""cdp-zero: CDP's ops with each stage's parameters kept by one worker and relayed point to
point just before use (the plan the `cdp-zero` method runs)."""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from cdpjax.errors import ConfigError
from cdpjax.layouts import Layout, register
from cdpjax.layouts.cdp import check_sizes, cdp_table
from cdpjax.timetable import Message, TimeTable

ZERO_RULES = ("cdp-v1", "cdp-v2")


def _check_zero(rule, workers, stages):
    if rule not in ZERO_RULES:
        raise ConfigError(f"cdp-zero rule={rule!r} is not one of {', '.join(ZERO_RULES)}")
    check_sizes(workers, stages)


@functools.lru_cache(maxsize=64)
def _zero_plan(rule: str, N: int, L: int) -> dict:
    """Owners and the per-tick relay program of cdp-zero (steady state, one period).

    Forward (and backward) ops of stage j run worker after worker, one hop along the ring
    every d = 2L/N ticks, so a stage's parameters can follow them: each worker passes
    the buffer it used d-1 ticks ago to the next worker, who needs it in the next tick.
    The owner o of stage j instead sends its stored version(s): a "pass" is the N ops
    from worker o+1 round to o fed by one such refresh. A pass whose ops all read one
    version carries that one; a pass spanning an update carries both stored versions
    (current, previous), each op reading the row of its version. The owner of each stage
    is chosen among the workers whose refresh leaves every op its version (the update it
    needs is applied before the refresh, no op needs a version older than the owner's
    previous), with as few stages per worker as possible, then as few versions per hop.
    """
    _check_zero(rule, N, L)
    T, d, m = 2 * L, 2 * L // N, 2
    lo = m * T  # the window of `_cdp_period`
    base = cdp_table(rule, N, L, steps=m + 4)
    at = {(o.tick, o.device): o for o in base.ops}
    upd = [sorted(u.tick for u in base.updates if u.stage == j) for j in range(L)]

    def applied(j, s):  # stage j's updates applied by the end of tick s
        return sum(1 for u in upd[j] if u <= s)

    def ring_pass(op, owner):
        """(refresh tick, the pass's ops) of the pass that feeds `op` when `owner` refreshes."""
        h = (op.device - owner - 1) % N
        s = op.tick - 1 - h * d
        ops = [at[(s + 1 + k * d, (owner + 1 + k) % N)] for k in range(N)]
        if any((o.stage, o.kind) != (op.stage, op.kind) for o in ops):
            raise AssertionError(f"{rule} N={N} L={L}: stage {op.stage} does not move one hop per {d} ticks")
        return s, ops

    def rows(s, ops):
        """Versions the pass carries (newest first) -> master slot of each row; None: impossible."""
        j, newest = ops[0].stage, max(o.version for o in ops)
        count = newest - min(o.version for o in ops) + 1
        slots = [applied(j, s) - (newest - r) for r in range(count)]
        return slots if all(x in (0, 1) for x in slots) else None

    window = [o for o in base.ops if lo <= o.tick < lo + 2 * T]  # two periods: the plan must repeat
    need = {}  # (stage, owner) -> versions per hop, None where that owner cannot serve the stage
    for j in range(L):
        for owner in range(N):
            counts = [rows(*ring_pass(o, owner)) for o in window if o.stage == j]
            need[(j, owner)] = None if any(c is None for c in counts) else max(len(c) for c in counts)
    best = None
    for versions in (1, 2):
        for per_worker in range(-(-L // N), L + 1):
            owners = _assign(L, N, per_worker,
                             [[o for o in _by_hops(N, base, j) if need[(j, o)] is not None and need[(j, o)] <= versions]
                              for j in range(L)])
            if owners is not None:
                if best is None or per_worker < best[0]:
                    best = (per_worker, versions, owners)
                break
    if best is None:  # not expected for any size `check_sizes` accepts; said plainly if it happens
        raise ConfigError(f"cdp-zero finds no owner layout for workers={N}, stages={L} with rule {rule}")
    per_worker, versions, owners = best
    local = [sorted(j2 for j2 in range(L) if owners[j2] == owners[j]).index(j) for j in range(L)]

    read = np.zeros((T, N), np.int32)
    refresh = np.full((T, N), -1, np.int32)
    send_slot = np.zeros((T, N, versions), np.int32)
    first = np.zeros((T, N), bool)
    sum_hop = np.full((T, N), -1, np.int32)
    partial_in = {(msg.dst, msg.stage, msg.step): msg for msg in base.messages if msg.kind == "partial"}
    for t in range(T):
        for w in range(N):
            op = at[(lo + t, w)]
            s, ops = ring_pass(op, owners[op.stage])
            newest = max(o.version for o in ops)
            read[t, w] = newest - op.version
            if op.kind == "B":
                msg = partial_in.get((w, op.stage, op.step))
                first[t, w] = msg is None
                if msg is not None and msg.tick != op.tick - d:
                    raise AssertionError(f"partial sum {msg} does not arrive {d} ticks before its use")
            nxt = at[(lo + t + 1, (w + 1) % N)]
            if owners[nxt.stage] == w:  # this worker's hop is its stage's refresh
                refresh[t, w] = local[nxt.stage]
                slots = rows(*ring_pass(nxt, w))
                send_slot[t, w] = (slots + [0] * versions)[:versions]
    for u in base.updates:
        if lo <= u.tick < lo + T:
            last = [o.device for o in base.ops if o.tick == u.tick and o.kind == "B" and o.stage == u.stage]
            sum_hop[u.tick - lo, owners[u.stage]] = (owners[u.stage] - last[0]) % N
    # Worker w's relay buffers at the start of a period: slot 0 for its op at tick 0, slot k > 0
    # the buffer it used at tick k - d (passed on at the end of tick k - 1).
    seed = np.array([[at[(lo + (k - d if k else 0), w)].stage for k in range(d)] for w in range(N)], np.int32)
    return {"owners": tuple(owners), "local": tuple(local), "per_worker": per_worker, "versions": versions,
            "read": read, "refresh": refresh, "send_slot": send_slot, "first": first, "sum_hop": sum_hop,
            "seed": seed}


def _by_hops(N, base, j):
    """Workers in order of the gradient sum's hops from the last worker to finish stage j."""
    last = max((o for o in base.ops if o.kind == "B" and o.stage == j), key=lambda o: o.tick).device
    return sorted(range(N), key=lambda o: (o - last) % N)


def _assign(L, N, per_worker, candidates):
    """Stage -> owner with at most `per_worker` stages each (bipartite matching), or None."""
    owner = [-1] * L
    load = {}

    def place(j, seen):
        for o in candidates[j]:
            if o in seen:
                continue
            seen.add(o)
            if load.get(o, 0) < per_worker:
                owner[j] = o
                load[o] = load.get(o, 0) + 1
                return True
            for j2 in range(L):  # move a stage that o holds to another of its candidates
                if owner[j2] == o and place(j2, seen):
                    owner[j] = o
                    return True
        return False

    for j in sorted(range(L), key=lambda j: len(candidates[j])):
        if not place(j, set()):
            return None
    return owner


@functools.lru_cache(maxsize=64)
def _cdp_period(rule: str, N: int, L: int) -> dict:
    """One steady-state period of the `rule` table as arrays [tick, worker]: op (0 idle, 1+j
    forward of stage j, 1+L+j backward), slot (1: the previous version), step (0 the step
    fed in the period, -1 the previous one); update / update_step [tick] (-1: none)."""
    T, m = 2 * L, 2
    table = cdp_table(rule, N, L, steps=4)
    lo = m * T  # steps 1 and 2 only, so no step-0 special case leaks in
    op, slot, step = (np.zeros((T, N), np.int32) for _ in range(3))
    update, update_step = np.full((T,), -1, np.int32), np.zeros((T,), np.int32)
    for o in table.ops:
        if lo <= o.tick < lo + T:
            t = o.tick - lo
            op[t, o.device] = 1 + o.stage + (L if o.kind == "B" else 0)
            slot[t, o.device] = int(o.slot == "previous")
            step[t, o.device] = o.step - m
    for u in table.updates:
        if lo <= u.tick < lo + T:
            update[u.tick - lo], update_step[u.tick - lo] = u.stage, u.step - m
    return {"op": op, "slot": slot, "step": step, "update": update, "update_step": update_step}


def zero_period_arrays(workers: int, stages: int, rule: str = "cdp-v2") -> dict[str, np.ndarray]:
    """cdp-zero's steady-state period: `period_arrays(rule, ...)` (op, step, update, ...) plus
    the relay program, indexed [tick_in_period, worker] unless noted:
      read: which row of the received parameter buffer the op reads (0 the newest version).
      refresh: at the end of the tick this worker sends the next worker its own stored copy
        of the stage at this index among the stages it owns (its rows per `send_slot`),
        -1: it passes on the buffer it used d-1 ticks ago.
      send_slot [tick, worker, row]: stored version (0 current, 1 previous) sent in each row.
      first: the op is a backward that starts its stage's partial sum (nothing received).
      sum_hop: hops the completed sum of stage `update[t]` takes to reach its owner, at
        the owner (0: it completed the sum itself), -1 elsewhere.
      seed [worker, d]: stage of each relay buffer at the start of a period.
      owners [stage], local [stage]: the owner, and the stage's index among its stages.
    Scalars: `versions` (rows per buffer), `per_worker` (stages owned by the busiest worker).
    """
    _check_zero(rule, workers, stages)
    plan = _zero_plan(rule, int(workers), int(stages))
    out = {k: v.copy() for k, v in _cdp_period(rule, int(workers), int(stages)).items()}
    for k, v in plan.items():
        out[k] = np.array(v) if isinstance(v, (tuple, np.ndarray)) else v
    return out


def cdp_zero_table(workers: int = 4, stages: int = 4, steps: int = 3, rule: str = "cdp-v2") -> TimeTable:
    """cdp-zero's table: the `rule` table (same ops, versions, updates) with the 'param' hop
    that brings each op its parameters (one Message per version carried; the op at tick 0 of
    worker 0 is fed from the initial buffers), the 'partial' sums of the ring, and 'sum' hops
    only from the last worker to the owner."""
    _check_zero(rule, workers, stages)
    base = cdp_table(rule, workers, stages, steps)
    N, L = int(workers), int(stages)
    plan = _zero_plan(rule, N, L)
    owners = plan["owners"]
    messages = [m for m in base.messages if m.kind == "partial"]
    for u in base.updates:
        last = [o.device for o in base.ops if o.tick == u.tick and o.kind == "B" and o.stage == u.stage][0]
        for h in range((owners[u.stage] - last) % N):
            messages.append(Message(u.tick, (last + h) % N, (last + h + 1) % N, u.stage, "sum", u.step))
    for op in base.ops:
        if op.tick > 0:
            messages += [Message(op.tick - 1, (op.device - 1) % N, op.device, op.stage, "param", op.step)] * plan["versions"]
    messages.sort(key=lambda m: (m.tick, m.kind != "partial", m.stage))
    owned = "; ".join(f"stage {j}: w{o}" for j, o in enumerate(owners))
    note = (f"rule {rule}; owners (parameters and optimizer state): {owned}; each tick every worker sends one "
            f"'param' hop of {plan['versions']} version(s)")
    T = 2 * L  # its traffic all lands within the step's own period: one period from step 1 is steady
    steady = (T, 2 * T) if steps >= 2 else base.steady
    return dataclasses.replace(base, method="cdp-zero", messages=tuple(messages), steady=steady,
                               meta={"rule": rule, "owners": list(owners), "versions_per_hop": plan["versions"]},
                               notes=(note,))


register(Layout("cdp-zero", "cdpjax.methods.cdp_zero:build", axes=("data",), device_axis="data",
                table=cdp_zero_table, colour="worker", label="{kind}{stage}", diagram_label="{kind}w{micro}", columns="worker",
                legend="F<j>/B<j>: forward/backward of stage j",
                title="{method}: N={workers} workers, L={stages} stages, {steps} steps, offsets {offsets}",
                summary="CDP with parameters sharded over workers, relayed point-to-point"))
