"""Time tables: for every tick and every device, which stage of which micro-batch runs,
forward or backward, and which parameter version it reads.

The single source of truth for timing (DESIGN.md, "The time table is data"). The
staleness rules, the SPMD ring's per-tick program (`period_arrays`), the schedule
pictures, busy fractions, the activation-memory model and the communication
profile all derive from one `TimeTable`. Pure Python and numpy: no JAX here, so
`cdpjax schedule` is instant.

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

Gradient relay (CDP): workers finish stage j's backward one after another, so a
running partial sum hops one worker along the ring each time a worker finishes
('partial' messages); the last worker completes the sum and relays it on within
the update tick ('sum' messages, a chain of hops) so that every worker applies
the same update. dp sends one 'allreduce' per stage in the step's last tick.

Pipelines: `ppll_table` (stage j runs batch t-j at tick t, forward, local
backward and update in one tick) and `gpipe_table` (forward fill, backward drain,
flush every step; M=1 is plain model parallelism). For them a device holds one
stage, and ops are coloured by (micro-)batch rather than by worker.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Sequence

import numpy as np

from cdpjax.config import ConfigError

CDP_METHODS = ("dp", "cdp-v1", "cdp-v2")
PIPELINE_METHODS = ("ppll", "gpipe")
MP_METHODS = ("cdp-mp",)  # CDP's ops on stage devices: `cdp_mp_table`
ZERO_METHODS = ("cdp-zero",)  # CDP's ops with sharded, relayed parameters: `cdp_zero_table`
METHODS = CDP_METHODS + PIPELINE_METHODS + MP_METHODS + ZERO_METHODS


@dataclasses.dataclass(frozen=True)
class Op:
    """One tick of work on one device.

    device: the worker (CDP) or the device holding the stage (pipelines).
    kind: 'F' forward, 'B' backward, 'FB' forward + local backward + update (ppll).
    step: the training step (ppll: the batch). micro: the micro-batch within the
    step (CDP: the worker's, = device). version: the absolute parameter version
    read. slot: 'current' or 'previous', which stored version holds it at this tick.
    stale: the op follows the delayed rule (reads theta_{k-1} at step k; at step 0
    theta_0, which is both stored versions then).
    """

    tick: int
    device: int
    stage: int
    kind: str
    step: int
    micro: int = 0
    version: int = 0
    slot: str = "current"
    stale: bool = False

    @property
    def worker(self) -> int:
        return self.device


@dataclasses.dataclass(frozen=True)
class Update:
    """Stage `stage`'s update for `step` is applied at the end of `tick`."""

    tick: int
    stage: int
    step: int


@dataclasses.dataclass(frozen=True)
class Message:
    """Gradient traffic sent at the end of `tick` (src = dst = -1 for an all-reduce)."""

    tick: int
    src: int
    dst: int
    stage: int
    kind: str  # 'partial' | 'sum' | 'allreduce'
    step: int = 0


@dataclasses.dataclass(frozen=True)
class TimeTable:
    """The laid-out schedule of `steps` training steps.

    workers: CDP workers N (pipelines: 1). devices: columns of the grid (CDP: N,
    pipelines: one per stage). period: ticks per training step in steady state.
    offsets: each worker's starting tick (CDP). steady: a [start, stop) tick window
    of steady state, over which the busy, activation and comm figures are taken.
    """

    method: str
    workers: int
    stages: int
    steps: int
    num_ticks: int
    devices: int
    period: int
    ops: tuple[Op, ...]
    updates: tuple[Update, ...]
    messages: tuple[Message, ...] = ()
    offsets: tuple[int, ...] = ()
    microbatches: int = 1
    steady: tuple[int, int] = (0, 0)

    @property
    def is_cdp(self) -> bool:
        return self.method in CDP_METHODS

    # ----------------------------------------------------------------- staleness

    @functools.cached_property
    def stale(self) -> np.ndarray:
        """[workers, stages] bool: worker i's forward of stage j reads the previous version."""
        out = np.zeros((self.workers, self.stages), bool)
        if not (self.is_cdp or self.method == "cdp-mp"):
            return out
        seen = {}
        for op in self.ops:
            if op.kind == "F":
                key = (op.micro if self.method == "cdp-mp" else op.device, op.stage)
                if seen.setdefault(key, op.stale) != op.stale:
                    raise AssertionError(f"{self.method}: worker/stage {key} changes rule between steps")
                out[key] = op.stale
        return out

    # ---------------------------------------------------------------------- grid

    def label(self, op: Op) -> str:
        """Cell text: CDP 'F<stage>'; gpipe 'F<micro-batch>'; cdp-mp 'F<worker>'; ppll 'FB<batch>'."""
        if self.is_cdp:
            return f"{op.kind}{op.stage}"
        return f"{op.kind}{op.micro if self.method in ('gpipe', 'cdp-mp') else op.step}"

    def grid(self) -> np.ndarray:
        """[ticks, devices] array of cell strings ('.' when idle)."""
        g = np.full((self.num_ticks, self.devices), ".", dtype=object)
        for op in self.ops:
            g[op.tick, op.device] = self.label(op)
        return g

    def format_grid(self) -> str:
        return format_grid(self)

    # ----------------------------------------------------------------- busy time

    def busy_fraction(self, window: tuple[int, int] | None = None) -> dict:
        """Busy (stage, tick) slots over all slots, and per stage and per device.

        Over the steady-state window by default (CDP: one period; gpipe: one step,
        bubble included; ppll: all stages busy); 'whole' is over every tick laid out.
        """
        lo, hi = self.steady if window is None else window
        stage_busy = np.zeros((self.num_ticks, self.stages), bool)
        device_busy = np.zeros((self.num_ticks, self.devices), bool)
        for op in self.ops:
            stage_busy[op.tick, op.stage] = True
            device_busy[op.tick, op.device] = True
        s, d = stage_busy[lo:hi], device_busy[lo:hi]
        return {
            "overall": float(s.mean()),
            "per_stage": [float(x) for x in s.mean(0)],
            "per_device": [float(x) for x in d.mean(0)],
            "whole": float(stage_busy.mean()),
        }

    # -------------------------------------------------------- activation memory

    def activation_per_worker(self) -> np.ndarray:
        """[ticks, devices] stage-activations held (CDP: p+1 at forward phase p, 2L-1-p
        at backward phase p, 0 idle). A stage-activation is held from its forward's
        tick until before its backward's tick; a ppll op holds one during its tick."""
        return _activations(self)

    def activation_total(self) -> np.ndarray:
        """[ticks] stage-activations held over all devices."""
        return self.activation_per_worker().sum(1)

    def activation_stats(self) -> dict:
        """Peak and mean over the steady-state window, in stage-activations."""
        lo, hi = self.steady
        per = self.activation_per_worker()[lo:hi]
        total = per.sum(1)
        return {
            "total_peak": int(total.max()) if total.size else 0,
            "total_mean": float(total.mean()) if total.size else 0.0,
            "worker_peak": int(per.max()) if per.size else 0,
            "worker_mean": float(per.mean()) if per.size else 0.0,
        }

    # ------------------------------------------------------------ communication

    def bytes_per_tick(self, stage_bytes: Sequence[float]) -> np.ndarray:
        """[ticks] gradient bytes sent: one stage's bytes per 'partial'/'sum' hop;
        2(N-1) x the stage's bytes for an 'allreduce' (a ring all-reduce's traffic)."""
        stage_bytes = _check_stage_bytes(stage_bytes, self.stages)
        out = np.zeros(self.num_ticks)
        for m in self.messages:
            scale = 2 * (self.workers - 1) if m.kind == "allreduce" else 1
            out[m.tick] += scale * stage_bytes[m.stage]
        return out

    def comm_balance(self, stage_bytes: Sequence[float]) -> float:
        """Busiest tick's bytes over the mean bytes per tick, in steady state (1 = flat;
        dp = 2L, one burst per step); 0 when nothing is sent."""
        lo, hi = self.steady
        b = self.bytes_per_tick(stage_bytes)[lo:hi]
        return float(b.max() / b.mean()) if b.size and b.mean() > 0 else 0.0

    # --------------------------------------------------------------------- json

    def to_json(self, stage_bytes: Sequence[float] | None = None) -> dict:
        d = {
            "method": self.method,
            "workers": self.workers,
            "stages": self.stages,
            "steps": self.steps,
            "devices": self.devices,
            "period": self.period,
            "offsets": list(self.offsets),
            "stale": [[bool(x) for x in row] for row in self.stale],
            "busy_fraction": self.busy_fraction(),
            "activation": self.activation_stats(),
            "ticks": [list(row) for row in self.grid().tolist()],
            "ops": [dataclasses.asdict(op) for op in self.ops],
            "updates": [dataclasses.asdict(u) for u in self.updates],
            "messages": [dataclasses.asdict(m) for m in self.messages],
        }
        if self.method == "gpipe":
            d["microbatches"] = self.microbatches
        if stage_bytes is not None:
            d["bytes_per_tick"] = [float(x) for x in self.bytes_per_tick(stage_bytes)]
            d["comm_balance"] = self.comm_balance(stage_bytes)
        return d

    def dumps(self) -> str:
        return json.dumps(self.to_json())

    # ---------------------------------------------------- the SPMD ring's program

    def period_arrays(self) -> dict[str, np.ndarray]:
        """The steady-state period as small integer arrays for an SPMD scan. See `period_arrays`."""
        return period_arrays(self.method, self.workers, self.stages)


# ============================================================================ CDP


def check_sizes(workers: int, stages: int) -> None:
    """Refuses sizes for which the worker offsets 2L*i/N are not whole ticks."""
    for name, v in (("workers", workers), ("stages", stages)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ConfigError(f"{name}={v!r} must be a positive integer")
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


def cdp_table(method: str, workers: int, stages: int, steps: int = 3) -> TimeTable:
    """The dp / cdp-v1 / cdp-v2 table of `steps` steps for N workers and L stages."""
    if method not in CDP_METHODS:
        raise ConfigError(f"method={method!r} is not one of {', '.join(CDP_METHODS)}")
    check_sizes(workers, stages)
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ConfigError(f"steps={steps!r} must be a positive integer")
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
                     tuple(messages), offsets, 1, steady)


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


# ====================================================================== pipelines


def ppll_table(stages: int, batches: int) -> TimeTable:
    """PPLL: at tick t stage j (on device j) runs batch t-j: forward, local backward
    through its auxiliary head, and its own update. Fill and drain only at the ends."""
    for name, v in (("stages", stages), ("batches", batches)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ConfigError(f"{name}={v!r} must be a positive integer")
    K, T = int(stages), int(batches)
    ops, updates = [], []
    for t in range(T + K - 1):
        for j in range(K):
            b = t - j
            if 0 <= b < T:
                ops.append(Op(t, j, j, "FB", b, 0, version=b))
                updates.append(Update(t, j, b))
    steady = (K - 1, T) if T >= K else (0, T + K - 1)
    return TimeTable("ppll", 1, K, T, T + K - 1, K, 1, tuple(ops), tuple(updates), (), (), 1, steady)


def gpipe_table(stages: int, microbatches: int, steps: int = 1) -> TimeTable:
    """GPipe: every step, forwards of M micro-batches fill the pipeline, backwards drain
    it (the last stage starts as soon as all forwards are done), then every stage
    updates (flush). M=1 is plain model parallelism."""
    for name, v in (("stages", stages), ("microbatches", microbatches), ("steps", steps)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ConfigError(f"{name}={v!r} must be a positive integer")
    K, M, S = int(stages), int(microbatches), int(steps)
    span = 2 * (M + K - 1)
    ops, updates = [], []
    for k in range(S):
        base = span * k
        for j in range(K):
            for m in range(M):
                ops.append(Op(base + j + m, j, j, "F", k, m, version=k))
                ops.append(Op(base + (M + K - 1) + (K - 1 - j) + m, j, j, "B", k, m, version=k))
            updates.append(Update(base + span - 1, j, k))
    ops.sort(key=lambda o: (o.tick, o.device))
    return TimeTable("gpipe", 1, K, S, span * S, K, span, tuple(ops), tuple(updates), (), (), M, (0, span))


def cdp_mp_table(stages: int, steps: int = 3, rule: str = "cdp-v2") -> TimeTable:
    """cdp-mp: CDP with model parallelism. The `rule` table of N = L workers and L stages,
    with each op moved from its worker to the device of its stage (device j = stage j);
    `micro` keeps the worker. With N = L every stage is used by exactly one worker at
    every tick, so every device runs exactly one op per tick in steady state (a forward
    when tick - j is even, a backward when odd): checked here. Updates, versions and
    slots are the CDP table's; no gradient crosses devices (each stage's gradient is
    summed where the stage lives), so there are no messages."""
    if rule not in ("cdp-v1", "cdp-v2"):
        raise ConfigError(f"cdp-mp rule={rule!r} is not one of cdp-v1, cdp-v2")
    base = cdp_table(rule, stages, stages, steps)
    ops = tuple(sorted((dataclasses.replace(op, device=op.stage) for op in base.ops),
                       key=lambda o: (o.tick, o.device)))
    per_cell = np.zeros((base.num_ticks, base.stages), np.int64)
    for op in ops:
        per_cell[op.tick, op.device] += 1
    lo, hi = base.steady
    if per_cell.max() > 1 or (steps >= 2 and not np.all(per_cell[lo:hi] == 1)):
        raise AssertionError(f"cdp-mp L={stages}: a device does not run exactly one op per steady-state tick")
    return dataclasses.replace(base, method="cdp-mp", ops=ops, messages=(), devices=base.stages)


# ====================================================================== CDP with ZeRO


ZERO_RULES = ("cdp-v1", "cdp-v2")


@dataclasses.dataclass(frozen=True)
class ZeroTable(TimeTable):
    """cdp-zero: the `rule` table's ops and updates with each stage's parameters (its stored
    versions and optimizer state) kept by one worker, `owners[stage]`. Every op gets its
    stage's parameters by a 'param' hop from the previous worker (one per tick and worker,
    `versions` parameter versions each), the owner's hop sending its own copy; the gradient
    sum goes from the last worker only as far as the owner ('sum' hops)."""

    rule: str = "cdp-v2"
    owners: tuple[int, ...] = ()
    versions: int = 1

    @property
    def is_cdp(self) -> bool:
        return True

    def to_json(self, stage_bytes: Sequence[float] | None = None) -> dict:
        return {**super().to_json(stage_bytes), "rule": self.rule, "owners": list(self.owners),
                "versions_per_hop": self.versions}

    def format_grid(self) -> str:
        owned = "; ".join(f"stage {j}: w{o}" for j, o in enumerate(self.owners))
        return (f"{format_grid(self)}\nrule {self.rule}; owners (parameters and optimizer state): {owned}; "
                f"each tick every worker sends one 'param' hop of {self.versions} version(s)")


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
    lo = m * T  # the window of `_period_arrays`
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
    out = period_arrays(rule, workers, stages)
    out.pop("send"), out.pop("recv"), out.pop("sum_hop")  # the ring's relay-to-all: not used
    for k, v in plan.items():
        out[k] = np.array(v) if isinstance(v, (tuple, np.ndarray)) else v
    return out


def cdp_zero_table(workers: int, stages: int, steps: int = 3, rule: str = "cdp-v2") -> ZeroTable:
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
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(TimeTable)}
    fields.update(method="cdp-zero", messages=tuple(messages))
    return ZeroTable(**fields, rule=rule, owners=owners, versions=plan["versions"])


def table(method: str, workers: int = 1, stages: int = 4, steps: int = 3, microbatches: int = 4,
          rule: str = "cdp-v2") -> TimeTable:
    """Any method's table by name (the `cdpjax schedule` entry point)."""
    if method in CDP_METHODS:
        return cdp_table(method, workers, stages, steps)
    if method == "ppll":
        return ppll_table(stages, steps)
    if method == "gpipe":
        return gpipe_table(stages, microbatches, steps)
    if method == "cdp-mp":  # N = L workers: `workers` does not apply; `rule`: its staleness
        return cdp_mp_table(stages, steps, rule)
    if method in ZERO_METHODS:  # `rule`: its staleness, cdp-v2 or cdp-v1
        return cdp_zero_table(workers, stages, steps, rule)
    raise ConfigError(f"method={method!r} is not one of {', '.join(METHODS)}")


# ======================================================================= helpers


def _activations(t: TimeTable) -> np.ndarray:
    out = np.zeros((t.num_ticks, t.devices), np.int64)
    forward, backward = {}, {}
    for op in t.ops:
        key = (op.device, op.stage, op.step, op.micro)
        if op.kind == "FB":
            out[op.tick, op.device] += 1
        elif op.kind == "F":
            forward[key] = op.tick
        else:
            backward[key] = op.tick
    for key, f in forward.items():
        b = backward.get(key, t.num_ticks)
        out[f:b, key[0]] += 1
    return out


def _check_stage_bytes(stage_bytes, stages):
    b = np.asarray(stage_bytes, float).reshape(-1)
    if b.size == 1:
        b = np.full(stages, float(b[0]))
    if b.size != stages:
        raise ConfigError(f"stage_bytes has {b.size} entries; the table has {stages} stages")
    return b


def format_grid(t: TimeTable) -> str:
    """The table as text: one row per device, one column per tick; '*' marks an op on
    the delayed rule, the last row shows which stages update at the end of each tick."""
    g = t.grid()
    stale = {(o.tick, o.device) for o in t.ops if o.stale}
    cells = [[g[tick, d] + ("*" if (tick, d) in stale else "") for tick in range(t.num_ticks)]
             for d in range(t.devices)]
    updated = [[] for _ in range(t.num_ticks)]
    for u in t.updates:
        updated[u.tick].append(u.stage)
    upd = ["all" if len(s) == t.stages > 1 else ",".join(map(str, s)) for s in updated]
    width = max(3, max(len(c) for row in cells for c in row)) + 1
    who = "w" if t.is_cdp else "d"
    head = f"{t.method}: " + (
        f"N={t.workers} workers, L={t.stages} stages, {t.steps} steps, offsets {list(t.offsets)}"
        if t.is_cdp else
        f"{t.stages} stages on {t.devices} devices, {t.steps} {'batches' if t.method == 'ppll' else 'steps'}"
        + (f", M={t.microbatches} micro-batches" if t.method == "gpipe" else "")
    )
    legend = ("F<j>/B<j>: forward/backward of stage j; *: reads the previous version (delayed)"
              if t.is_cdp else
              "F<i>/B<i>: forward/backward of worker i's micro-batch; *: reads the previous version (delayed)"
              if t.method == "cdp-mp" else
              "F<m>/B<m>: forward/backward of micro-batch m" if t.method == "gpipe" else
              "FB<b>: forward, local backward and update of batch b")
    lines = [head, legend, "tick".ljust(6) + "".join(str(i).rjust(width) for i in range(t.num_ticks))]
    for d, row in enumerate(cells):
        lines.append(f"{who}{d}".ljust(6) + "".join(c.rjust(width) for c in row))
    if t.method != "ppll":  # every ppll op updates its stage: the row would repeat the grid
        lines.append("upd".ljust(6) + "".join(c.rjust(width) for c in upd))
    bf = t.busy_fraction()
    lines.append(f"busy fraction (steady state): {bf['overall']:.3f}; over all ticks: {bf['whole']:.3f}")
    if (t.is_cdp or t.method == "cdp-mp") and t.method != "dp":
        lines.append(f"stale (worker, stage) pairs: {int(t.stale.sum())} of {t.stale.size}")
    return "\n".join(lines)
