"""dp, cdp-v1, cdp-v2: the data-parallel layouts and their time table.

CDP timing (`cdp_table`). N workers, L stages, one tick = one stage-forward or one
stage-backward of one micro-batch. Worker i starts its step-k micro-batch at tick
`2L*i/N + 2L*k` (dp: every worker at `2L*k`); at phase p of a step it runs the
forward of stage p (p < L) or the backward of stage 2L-1-p. Stage j's update for
step k is applied at the end of the tick in which the last worker finishes its
backward of stage j for step k (dp: every stage at the end of the step, after one
all-reduce of the whole model). Versions: theta^j_v is stage j after v updates.

- dp: step k reads version k.
- cdp-v1: step k reads version k-1 everywhere (step 0 reads theta_0).
- cdp-v2: worker i's forward of stage j at step k reads version k if the update of
  step k-1 was applied before that tick, else version k-1. Computed from the
  ticks, so it holds for every N and L; for N = L it is "stale iff j < L-1-i".

A backward reads the version its forward read. Two stored versions per stage
(`current`, `previous`) always suffice: an op's `slot` says which one holds its
version at its tick.

Gradient relay: workers finish stage j's backward one after another, so a running
partial sum hops one worker along the ring each time a worker finishes ('partial'
messages); the last worker completes the sum and relays it on within the update
tick ('sum' messages, a chain of hops) so that every worker applies the same
update. dp sends one 'allreduce' per stage in the step's last tick.
"""
from __future__ import annotations

import functools

import numpy as np

from cdpjax.errors import ConfigError
from cdpjax.layouts import Layout, register
from cdpjax.timetable import Message, Op, TimeTable, Update, positive

RULES = ("dp", "cdp-v1", "cdp-v2")


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
    """The dp / cdp-v1 / cdp-v2 table of `steps` steps for N workers and L stages."""
    if method not in RULES:
        raise ConfigError(f"method={method!r} is not one of {', '.join(RULES)}")
    check_sizes(workers, stages)
    positive(steps=steps)
    N, L, T = int(workers), int(stages), 2 * int(stages)
    offsets = worker_offsets(method, N, L)

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

    def is_stale(i, j, k):
        if method == "dp":
            return False
        if method == "cdp-v1":
            return True
        return fwd_tick[(i, j, k)] <= update_tick[(j, k - 1)]  # the update is not applied yet

    def applied(j, t):  # real updates of stage j applied before tick t
        return sum(1 for k in range(steps) if update_tick[(j, k)] < t)

    ops = []
    for t, i, j, kind, k in raw:
        if k < 0:
            continue
        stale = is_stale(i, j, k)
        version = max(k - int(stale), 0)
        n = applied(j, t)
        if version == n:
            slot = "current"
        elif version == n - 1:
            slot = "previous"
        else:  # two stored versions would not suffice: a schedule bug, not a user error
            raise AssertionError(f"{method}: op {(t, i, j, kind, k)} reads version {version} with {n} applied")
        ops.append(Op(t, i, j, kind, k, micro=i, version=version, slot=slot, stale=stale))
    ops.sort(key=lambda o: (o.tick, o.device))
    updates = sorted((Update(update_tick[(j, k)], j, k) for j in range(L) for k in range(steps)),
                     key=lambda u: (u.tick, u.stage))

    messages = []
    for k in range(steps):
        for j in range(L):
            if method == "dp":
                if N > 1:
                    messages.append(Message(update_tick[(j, k)], -1, -1, j, "allreduce", k))
                continue
            order = sorted(range(N), key=lambda i: back_tick[(i, j, k)])
            for a, b in zip(order, order[1:]):
                messages.append(Message(back_tick[(a, j, k)], a, b, j, "partial", k))
            last = order[-1]
            for h in range(N - 1):  # relay the completed sum along the ring, within the update tick
                messages.append(Message(update_tick[(j, k)], (last + h) % N, (last + h + 1) % N, j, "sum", k))
    messages.sort(key=lambda m: (m.tick, m.kind != "partial", m.stage))

    num_ticks = max(o.tick for o in ops) + 1
    steady = (T, 2 * T) if steps >= 2 else (0, num_ticks)
    return TimeTable(method, N, L, int(steps), num_ticks, N, T, tuple(ops), tuple(updates),
                     tuple(messages), offsets, 1, steady, meta={"rule": method} if method != "dp" else {})


@functools.lru_cache(maxsize=64)
def _period_arrays(method: str, workers: int, stages: int) -> dict:
    N, L, T = workers, stages, 2 * stages
    table = cdp_table(method, N, L, steps=4)
    m = 2  # window [2T, 3T): steps 1 and 2 only, so no step-0 special case leaks in
    lo = m * T
    op = np.zeros((T, N), np.int32)
    slot = np.zeros((T, N), np.int32)
    step = np.zeros((T, N), np.int32)
    send = np.full((T, N), -1, np.int32)
    recv = np.full((T, N), -1, np.int32)
    sum_hop = np.full((T, N), -1, np.int32)
    update = np.full((T,), -1, np.int32)
    update_step = np.zeros((T,), np.int32)
    for o in table.ops:
        if lo <= o.tick < lo + T:
            t = o.tick - lo
            op[t, o.device] = 1 + o.stage + (L if o.kind == "B" else 0)
            slot[t, o.device] = int(o.slot == "previous")
            step[t, o.device] = o.step - m
    for u in table.updates:
        if lo <= u.tick < lo + T:
            t = u.tick - lo
            if update[t] >= 0:
                raise ConfigError(f"{method}: several stages update in one tick; the ring realises one update per tick")
            update[t], update_step[t] = u.stage, u.step - m
    hops = {}
    for msg in table.messages:
        if not lo <= msg.tick < lo + T:
            continue
        t = msg.tick - lo
        if msg.kind == "allreduce":
            raise ConfigError(f"{method} sends an all-reduce; the ring realises only point-to-point tables")
        if msg.dst != (msg.src + 1) % N:
            raise AssertionError(f"message {msg} is not one hop along the ring")
        if msg.kind == "partial":
            send[t, msg.src] = msg.stage
            recv[t, msg.dst] = msg.stage
        else:
            h = hops.get((t, msg.stage), 0) + 1
            hops[(t, msg.stage)] = h
            if h == 1:
                if recv[t, msg.dst] >= 0:  # one receive buffer per worker and tick
                    raise AssertionError(f"worker {msg.dst} receives a partial and the sum at tick {t}")
                send[t, msg.src] = msg.stage
                sum_hop[t, msg.src] = 0
            sum_hop[t, msg.dst] = h
    for t in range(T):
        if update[t] >= 0 and N == 1:
            sum_hop[t, 0] = 0
    return {"op": op, "slot": slot, "step": step, "send": send, "recv": recv,
            "sum_hop": sum_hop, "update": update, "update_step": update_step}


def period_arrays(method: str, workers: int, stages: int) -> dict[str, np.ndarray]:
    """One steady-state period (2L ticks) of a cyclic table, as arrays an SPMD scan reads.

    Indexed [tick_in_period, worker] unless noted; a period starts when worker 0
    starts a new step:
      op: 0 idle, 1+j forward of stage j, 1+L+j backward of stage j.
      slot: version read, 0 current, 1 previous.
      step: 0 if the op belongs to the step fed in this period, -1 for the previous one.
      send: stage of the gradient buffer this worker sends one hop along the ring at
        the end of the tick (its running partial sum, or, for the last worker, the
        completed sum: the relay's first hop), -1 none.
      recv: stage of the partial sum this worker receives at the end of the tick, -1 none.
      sum_hop: at which relay hop this worker gets stage `update[t]`'s completed sum
        (0: it completed it), -1 no update this tick.
      update [tick]: stage updated at the end of the tick, -1 none.
      update_step [tick]: 0 / -1 as `step`, for that update.
    """
    if method not in ("cdp-v1", "cdp-v2"):
        raise ConfigError(f"period arrays are for the cyclic tables cdp-v1, cdp-v2, not {method!r}")
    check_sizes(workers, stages)
    return {k: v.copy() for k, v in _period_arrays(method, int(workers), int(stages)).items()}


_CDP_LOOK = dict(axes=("data",), device_axis="data", colour="worker", label="{kind}{stage}", diagram_label="{kind}w{micro}",
                 legend="F<j>/B<j>: forward/backward of stage j", columns="worker",
                 title="{method}: N={workers} workers, L={stages} stages, {steps} steps, offsets {offsets}")


def _table(method):
    def make(workers: int = 4, stages: int = 4, steps: int = 3) -> TimeTable:
        return cdp_table(method, workers, stages, steps)

    make.__name__ = f"{method.replace('-', '_')}_table"
    return make


register(Layout("dp", "cdpjax.methods.dp:build", table=_table("dp"),
                summary="data parallel: every device a worker, gradients averaged once per step", **_CDP_LOOK))
register(Layout("cdp-v1", "cdpjax.methods.cdp:build_v1", table=_table("cdp-v1"),
                summary="cyclic data parallel, every step reads the previous version", **_CDP_LOOK))
register(Layout("cdp-v2", "cdpjax.methods.cdp:build_v2", table=_table("cdp-v2"),
                summary="cyclic data parallel, the version each forward finds (derived from the ticks)",
                **_CDP_LOOK))
