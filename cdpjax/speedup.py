"""Speedup models: predicted step time of a method on K real devices.

From per-stage costs measured on ONE device (forward, backward, and the backward split
into its input and weight parts), a method's time table, and a transfer bandwidth, a
model replays the table on K devices and predicts the step time, and hence the speedup
over running the same work sequentially on one device. Two models:

- `lockstep` (the default): what cdpjax's SPMD programs do. Every tick is a lockstep
  (its collective-permutes rendezvous, the tick is fenced), so a tick lasts as long as
  the slowest device's ops in it, plus the transfers sent at its end; the table's ticks
  are replayed as they are.
- `async`: each device runs its ops in the table's order, each as soon as its inputs
  are there, as a runtime with one host queue per device does (the PPLL authors' MPMD
  code, torch.distributed.pipelining); for comparisons with such runtimes.

Assumptions (stated, not hidden):
- An op takes the measured time of its stage, whatever else runs (no kernel overlap
  between ops on one device), timed on one device with the others idle (`calibrate=
  'alone'`, devices that share nothing) or on all K devices at once, each on its own
  micro-batch (`'together'`: what K simulated CPU devices sharing the cores see). Its duration comes
  from its kind (`cdpjax.kinds.cost_field`): `F` the stage's forward, `B` the whole
  backward (`StageCosts.backward`) or, in a table that splits the backward, the input
  cotangent only (`backward_input`), `W` the weight gradient (`backward_weight`), `FB`
  (PPLL's forward + local backward + update) forward + backward of the stage body plus
  its auxiliary head's forward and backward (`StageCosts.head`, measured unless
  `heads=False`: the heads are much of a ViT's local-learning work and the reason for
  PPLL's uneven module groups). The backwards are measured as the run does them:
  recomputing the forward (`residuals='recompute'`) or from kept residuals (`'carry'`);
  `StageCosts.residuals` says which.
- An op's output crossing devices (an activation to the next stage's forward, a
  cotangent to the previous stage's backward) is one message of the boundary's bytes,
  bytes / bandwidth, one hop, no latency term; through a codec (`Link`, lockstep only), its
  wire bytes / bandwidth plus the codec's encode and decode time measured for that size.
- lockstep: a tick's time is the largest, over devices, of the sum of the device's ops
  in it, plus the largest message sent at its end (messages of one tick travel in
  parallel): activations and cotangents, and the table's gradient traffic ('partial',
  'sum', 'param' messages: the stage's parameter bytes each; dp's 'allreduce': a ring
  all-reduce, 2(N-1)/N x the bytes of the stages reduced in that tick). The step time
  is the time of the steady-state window (`TimeTable.steady`) per period.
- async: an op reading parameter version v >= 1 of stage j waits for stage j's update
  v-1, which is ready when the op completing the last weight gradient of that stage's
  step is done (`B`, or `W` where the backward is split) plus its gradient
  synchronisation: `dp` one ring all-reduce of the whole model, 2(N-1)/N x model bytes /
  bandwidth, after the step's last backward; CDP the arrival of the completed stage sum
  at the op's device along the table's delivery plan (its 'sum' messages: one hop of the
  stage's gradient each, from the worker that completed it; partial-sum hops overlap
  compute and are not on the critical path); pipelines none (the stage owns its
  parameters). The step time is the slope of step completion times over the laid-out
  steps, so fill and drain at the ends of a run are excluded.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from collections import defaultdict
from typing import Sequence

import numpy as np

from cdpjax import kinds
from cdpjax.errors import ConfigError
from cdpjax.program import carries

MODELS = ("lockstep", "async")


@dataclasses.dataclass(frozen=True)
class StageCosts:
    """Seconds per micro-batch, per stage, and the bytes the speedup models move.

    backward: the whole backward (input cotangent and weight gradient); backward_input and
    backward_weight: its two halves apart (the vjp w.r.t. the stage's input only, and w.r.t.
    its parameters only), the costs of `B` and `W` in a table that splits the backward.
    residuals: how the backwards were measured: 'recompute' (the forward recomputed inside, as
    the recompute runtimes do) or 'carry' (from residuals kept by the forward).
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    activation_bytes: tuple[float, ...]  # output of each stage, per micro-batch
    gradient_bytes: tuple[float, ...]  # parameters of each stage
    head: tuple[float, ...] = ()  # auxiliary head forward + backward per micro-batch, per stage (local learning)
    backward_input: tuple[float, ...] = ()
    backward_weight: tuple[float, ...] = ()
    residuals: str = "recompute"

    def local(self, j: int) -> float:
        """An 'FB' op of stage j: body forward and backward, and its head."""
        return self.forward[j] + self.backward[j] + (self.head[j] if self.head else 0.0)

    def seconds(self, kind: str, stage: int, split_backward: bool) -> float:
        """An op of `kind` on `stage` in a table that does (or does not) split its backwards."""
        field = kinds.cost_field(kind, split_backward)
        values = getattr(self, field)
        if callable(values):  # a cost made of others (`local`)
            return values(stage)
        if len(values) <= stage:
            raise ConfigError(f"the stage costs give no {field} for stage {stage} (an op of kind {kind!r}); "
                              f"measure_stage_costs measures every field")
        return float(values[stage])


# The longest an op may take in `uniform_costs` (any unit): a replay of the largest table stays finite.
COST_LIMIT = 1e12


def uniform_costs(per_kind: dict[str, float], stages: int, activation_bytes: float = 0.0,
                  gradient_bytes: float = 0.0) -> StageCosts:
    """The same costs for every stage, from {kind or StageCosts field: seconds} (e.g. F=1, B=2, W=1):
    a kind sets its `cost` field ('B': the whole backward, 'W': the weight gradient); where the
    input backward is not given it is the whole backward less the weight gradient (the same work
    split in two), where the weight gradient is not given, half the backward."""
    fields = {}
    for key, value in per_kind.items():
        field = kinds.lookup(key).cost if key in kinds.KINDS else key
        if field not in ("forward", "backward", "backward_input", "backward_weight"):
            raise ConfigError(f"cost {key}={value}: give F, B, W or forward, backward, backward_input, "
                              f"backward_weight")
        fields[field] = float(value)
    if "forward" not in fields or "backward" not in fields and "backward_input" not in fields:
        raise ConfigError(f"costs {per_kind}: give at least F and B (e.g. F=1,B=2,W=1)")
    backward = fields.get("backward", fields.get("backward_input", 0.0) + fields.get("backward_weight", 0.0))
    weight = fields.get("backward_weight", backward / 2)
    each = {"forward": fields["forward"], "backward": backward, "activation_bytes": float(activation_bytes),
            "gradient_bytes": float(gradient_bytes), "backward_input": fields.get("backward_input", backward - weight),
            "backward_weight": weight}
    # Every op takes time (an op of none would end a replay on a tick of no length), and a bounded one,
    # so that a replay's sums stay finite.
    for field in ("forward", "backward", "backward_input", "backward_weight"):
        if not (math.isfinite(each[field]) and 0 < each[field] <= COST_LIMIT):
            raise ConfigError(f"costs {per_kind}: the {field} time is {each[field]:g}; each op's time must be a "
                              f"finite number > 0 and at most {COST_LIMIT:g} (W, the weight half, less than B, "
                              f"the whole backward)")
    return StageCosts(**{name: (value,) * stages for name, value in each.items()})


def simulate(table, costs: StageCosts, bandwidth: float, model: str = "lockstep") -> dict:
    """Replays `table` with `costs` under `model` ('lockstep' or 'async', module docstring);
    returns the predicted step time, the same work on one device, the speedup and the model."""
    if model not in MODELS:
        raise ConfigError(f"speedup model {model!r}: choose {' or '.join(MODELS)}")
    out = (_lockstep if model == "lockstep" else _async)(table, costs, float(bandwidth))
    sequential = _sequential_step(table, costs)
    step = out["step_seconds"]
    return {**out, "model": model, "sequential_step_seconds": sequential,
            "speedup": sequential / step if step > 0 else float("nan"), "devices": int(table.devices)}


@dataclasses.dataclass(frozen=True)
class Link:
    """How a message crosses: `bandwidth` bytes/s, through codec `codec` (a `cdpjax.compress` name)
    that sends a message of n float32 bytes as `wire_bytes(n / 4)` bytes and takes `coding` seconds
    to encode it and decode it, given per message size as (float32 bytes, seconds) pairs (measured:
    `measure_coding`). A message's time is its wire bytes / bandwidth plus its coding time."""

    bandwidth: float
    codec: str = "none"
    coding: tuple[tuple[float, float], ...] = ()

    def seconds(self, nbytes: float) -> float:
        from cdpjax import compress

        codec = compress.lookup(self.codec)
        wire = codec.wire_bytes(-(-int(nbytes) // 4))
        if codec.lossless:
            return wire / self.bandwidth
        coding = dict(self.coding)
        if float(nbytes) not in coding:
            raise ConfigError(f"Link(codec={self.codec!r}) has no coding time for a message of {nbytes:g} bytes; "
                              f"measured for: {', '.join(f'{b:g}' for b in sorted(coding)) or 'none'}")
        return wire / self.bandwidth + coding[float(nbytes)]


def lockstep_ticks(table, costs: StageCosts, bandwidth: float = float("inf"),
                   link: Link | None = None) -> tuple[np.ndarray, np.ndarray]:
    """([ticks] compute seconds, [ticks] transfer seconds) of `table` run in lockstep: a tick's
    compute is its busiest device's ops, its transfer the longest message sent at its end (bytes /
    bandwidth; with `link`, `link.seconds(bytes)`: through its codec, coding time added)."""
    split = table.split_backward
    busy = np.zeros((table.num_ticks, max(table.devices, 1)))
    for op in table.ops:
        busy[op.tick, op.device] += costs.seconds(op.kind, op.stage, split)
    transfer = np.zeros(table.num_ticks)
    for tick, nbytes in _messages(table, costs):
        transfer[tick] = max(transfer[tick], link.seconds(nbytes) if link is not None else nbytes / bandwidth)
    return busy.max(1), transfer


def lockstep_step_seconds(table, costs: StageCosts, link: Link) -> float:
    """The lockstep model's step time (`simulate`'s, its steady window per period) with every
    message crossing `link`."""
    compute, transfer = lockstep_ticks(table, costs, link=link)
    return _steady_step(table, compute + transfer)


def break_even_bandwidth(table, costs: StageCosts, codec: str, coding, low: float = 1.0,
                         high: float = 1e15) -> float:
    """The bandwidth (bytes/s) below which `codec` (its `Link.coding` times) shortens the lockstep
    step and above which its coding costs more than its fewer bytes save: where the step through
    the codec equals the step without one, found by bisection on log(bandwidth) in [low, high]
    (the difference grows with the bandwidth: bytes saved count less, coding the same). `high`
    where the codec is no slower anywhere in the range, `low` where it is slower everywhere."""
    def slower(bandwidth):
        return lockstep_step_seconds(table, costs, Link(bandwidth, codec, tuple(coding))) > \
            lockstep_step_seconds(table, costs, Link(bandwidth))

    if not slower(high):
        return high
    if slower(low):
        return low
    lo, hi = math.log(low), math.log(high)
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if slower(math.exp(mid)) else (mid, hi)
    return math.exp(lo)


def message_sizes(table, costs: StageCosts) -> tuple[float, ...]:
    """The distinct sizes (float32 bytes) of the messages the lockstep model sends in `table`."""
    return tuple(sorted({float(nbytes) for _, nbytes in _messages(table, costs)}))


def measure_coding(codec: str, sizes, repeats: int = 5) -> tuple[tuple[float, float], ...]:
    """(bytes, seconds) of `codec`'s encode and decode of a float32 message of each size in `sizes`,
    jitted, on this process's first device (the median of `repeats` runs): `Link.coding`."""
    import jax

    from cdpjax import compress

    c = compress.lookup(codec)
    trip = jax.jit(lambda x: c.decode(c.encode(x), x))
    out = []
    for nbytes in sizes:
        x = jax.random.normal(jax.random.key(0), (-(-int(nbytes) // 4),), "float32")
        out.append((float(nbytes), median_seconds(trip, x, repeats=repeats)))
    return tuple(out)


# The op costs a busy fraction is weighed with where none are measured: a backward takes two forwards, and
# where it is split, its input half and its weight half one each (`StageCosts` fields, not kinds).
UNIT_COSTS = {"forward": 1.0, "backward": 2.0, "backward_weight": 1.0}


def lockstep_busy_fraction(table, costs: StageCosts | None = None) -> float:
    """The devices' busy share of `table`'s steady state run in lockstep: every tick lasts as long as
    its slowest device's ops (`lockstep_ticks`, transfers free), and a device is busy for its own
    ops' time; `costs`: measured ones, else `UNIT_COSTS`. Beside `TimeTable.busy_fraction`, which
    counts every op as one tick: 1f1b at L = 8, M = 32 is busy 0.82 of its ticks and 0.65 of its
    lockstep time."""
    costs = costs or uniform_costs(UNIT_COSTS, table.stages)
    lo, hi = table.steady
    compute, _ = lockstep_ticks(table, costs)
    span = float(compute[lo:hi].sum()) * max(table.devices, 1)
    work = sum(costs.seconds(op.kind, op.stage, table.split_backward) for op in table.ops if lo <= op.tick < hi)
    return work / span if span > 0 else 0.0


def lockstep_starts(table, costs: StageCosts, bandwidth: float = float("inf")) -> np.ndarray:
    """[ticks + 1] the time each tick starts in lockstep (the last entry: when the table ends)."""
    compute, transfer = lockstep_ticks(table, costs, bandwidth)
    return np.concatenate([[0.0], np.cumsum(compute + transfer)])


def lockstep_summary(table, costs: StageCosts, bandwidth: float = float("inf")) -> dict:
    """The lockstep replay as `cdpjax schedule --costs` reports it: the step time, the same work
    on one device, the devices' busy share of the step, and when each tick starts."""
    r = simulate(table, costs, bandwidth, "lockstep")
    lo, hi = table.steady
    work = sum(costs.seconds(op.kind, op.stage, table.split_backward) for op in table.ops if lo <= op.tick < hi)
    span = float(lockstep_starts(table, costs, bandwidth)[hi] - lockstep_starts(table, costs, bandwidth)[lo])
    return {"model": "lockstep", "step_time": r["step_seconds"], "sequential_step_time": r["sequential_step_seconds"],
            "speedup": r["speedup"], "device_busy": work / (span * max(table.devices, 1)) if span > 0 else 0.0,
            "tick_starts": [float(t) for t in lockstep_starts(table, costs, bandwidth)]}


def format_lockstep(table, costs: StageCosts, bandwidth: float = float("inf"), described: str = "") -> str:
    """The table replayed in lockstep as text, one column per time unit (the largest unit every
    op's and tick's time is a multiple of): an op's cell, then '-' while it lasts, '.' idle."""
    from fractions import Fraction

    starts = lockstep_starts(table, costs, bandwidth)
    split = table.split_backward
    times = [Fraction(float(t)).limit_denominator(1000) for t in starts]
    times += [Fraction(costs.seconds(op.kind, op.stage, split)).limit_denominator(1000) for op in table.ops]
    unit = functools.reduce(math.gcd, [t.numerator for t in times]) / functools.reduce(
        math.lcm, [t.denominator for t in times]) or 1.0
    rounded = starts[-1] / unit > 400  # costs with no small common unit: columns of a 400th, ops rounded to them
    unit = starts[-1] / 400 if rounded else unit
    columns = int(round(starts[-1] / unit))
    grid = [["."] * columns for _ in range(table.devices)]
    for op in table.ops:
        first = int(round(starts[op.tick] / unit))
        cells = max(int(round(costs.seconds(op.kind, op.stage, split) / unit)), 1)
        label = table.label(op)
        grid[op.device][first] = label if grid[op.device][first] == "." else grid[op.device][first] + "+" + label
        for c in range(first + 1, min(first + cells, columns)):
            grid[op.device][c] = "-"
    width = max(3, max(len(c) for row in grid for c in row), len(f"{(columns - 1) * unit:g}")) + 1
    head = f"{table.format_grid().splitlines()[0]}, replayed in lockstep{' under ' + described if described else ''}"
    lines = [head, f"one column = {unit:g} time units{' (ops rounded to columns)' if rounded else ''}; a cell: the "
                   f"op starts, '-': it runs on, '.': idle",
             "time".ljust(6) + "".join(f"{c * unit:g}".rjust(width) for c in range(columns))]
    lines += [f"d{d}".ljust(6) + "".join(c.rjust(width) for c in row) for d, row in enumerate(grid)]
    r = lockstep_summary(table, costs, bandwidth)
    lines.append(f"step time {r['step_time']:g} (lockstep: each tick as long as its slowest op), the same work on "
                 f"one device {r['sequential_step_time']:g} ({r['speedup']:.2f}x); devices busy "
                 f"{r['device_busy']:.3f} of the step")
    return "\n".join(lines)


def _steady_step(table, tick_seconds: np.ndarray) -> float:
    """Seconds per step of the table's steady window (`TimeTable.steady`), ticks of `tick_seconds`."""
    lo, hi = table.steady
    periods = max(hi - lo, 1) / max(table.period, 1)
    return float(tick_seconds[lo:hi].sum() / periods)


def _lockstep(table, costs: StageCosts, bandwidth: float) -> dict:
    compute, transfer = lockstep_ticks(table, costs, bandwidth)
    lo, hi = table.steady
    return {"step_seconds": _steady_step(table, compute + transfer),
            "total_seconds": float((compute + transfer).sum()),
            "transfer_fraction": float(transfer[lo:hi].sum() / max((compute + transfer)[lo:hi].sum(), 1e-300))}


def _boundary_bytes(costs: StageCosts, a: int, b: int) -> float:
    """Bytes crossing from stage a's op to stage b's: the activation (or its cotangent) between them."""
    return float(costs.activation_bytes[min(a, b)]) if a != b else 0.0


def _messages(table, costs: StageCosts):
    """(tick, bytes) of every message sent at the end of a tick: each op's output to the op of the
    same micro-batch that waits for it on another device, and the table's gradient traffic."""
    L = table.stages
    place = {(op.kind, op.stage, op.step, op.micro): op.device for op in table.ops}
    for op in table.ops:
        for kind, stage in _dependents(op.kind, op.stage, L):
            device = place.get((kind, stage, op.step, op.micro))
            if device is not None and device != op.device:
                yield op.tick, _boundary_bytes(costs, op.stage, stage)
    n = max(int(table.workers), 1)
    reduced = defaultdict(float)
    for m in table.messages:
        if m.kind == "allreduce":
            reduced[m.tick] += costs.gradient_bytes[m.stage]
        else:
            yield m.tick, float(costs.gradient_bytes[m.stage])
    for tick, nbytes in reduced.items():
        yield tick, 2 * (n - 1) / n * nbytes


def _dependents(kind: str, stage: int, stages: int) -> list[tuple[str, int]]:
    """The (kind, stage) ops of the same micro-batch whose `after` rule names this op."""
    return [(k, j) for k in kinds.KINDS for j in (stage - 1, stage, stage + 1)
            if 0 <= j < stages and kinds.KINDS[k].after(j, stages) == (kind, stage)]


def _async(table, costs: StageCosts, bw: float) -> dict:
    """Each device runs its ops in tick order, each as soon as its inputs and parameters are there."""
    L, split = table.stages, table.split_backward
    n_workers = max(int(table.workers), 1)
    device_free = defaultdict(float)
    done: dict[tuple, tuple[float, int]] = {}  # (kind, stage, step, micro) -> (finish, device)
    last_gradient: dict[tuple[int, int], float] = defaultdict(float)  # (stage, step) -> finish
    step_finish: dict[int, float] = defaultdict(float)
    allreduce = {(m.stage, m.step) for m in table.messages if m.kind == "allreduce"}
    sum_hops = defaultdict(list)  # (stage, step) -> the completed sum's hops, in tick order
    for m in sorted(table.messages, key=lambda m: m.tick):
        if m.kind == "sum":
            sum_hops[(m.stage, m.step)].append(m)

    def update_ready(stage: int, step: int, device: int) -> float:
        if (stage, step) in allreduce:  # one all-reduce of the whole model after the step's last backward
            model = float(sum(costs.gradient_bytes))
            return max(last_gradient[(j, step)] for j in range(L)) + 2 * (n_workers - 1) / n_workers * model / bw
        complete = last_gradient[(stage, step)]
        hops = sum_hops[(stage, step)]
        if not hops:  # one worker, or a table that applies everywhere at completion
            return complete
        arrive = {hops[0].src: complete}  # the worker that completed it holds it first
        for m in hops:
            arrive[m.dst] = arrive.get(m.src, complete) + costs.gradient_bytes[stage] / bw
        return arrive.get(device, complete)

    for op in sorted(table.ops, key=lambda o: (o.tick, o.device)):
        j, mb, kind = op.stage, (op.step, op.micro), kinds.KINDS[op.kind]
        ready = device_free[op.device]
        need = kind.after(j, L)
        if need is not None:
            finish, device = done[(*need, *mb)]
            ready = max(ready, finish + (_boundary_bytes(costs, need[1], j) / bw if device != op.device else 0.0))
        if kind.forward and op.version >= 1:
            ready = max(ready, update_ready(j, op.version - 1, op.device))
        finish = ready + costs.seconds(op.kind, j, split)
        device_free[op.device] = finish
        done[(op.kind, j, *mb)] = (finish, op.device)
        if kind.completes_gradient(split):
            last_gradient[(j, op.step)] = max(last_gradient[(j, op.step)], finish)
        step_finish[op.step] = max(step_finish[op.step], finish)
    ends = np.array([step_finish[s] for s in sorted(step_finish)])
    if len(ends) >= 3:
        step_time = float(np.polyfit(np.arange(len(ends))[1:], ends[1:], 1)[0])
    elif len(ends) == 2:
        step_time = float(ends[1] - ends[0])
    else:
        step_time = float(ends[0])
    return {"step_seconds": step_time, "total_seconds": float(ends[-1])}


def _sequential_step(table, costs: StageCosts) -> float:
    """The same work on one device: every op of one step, back to back."""
    per_step = defaultdict(float)
    for op in table.ops:
        per_step[op.step] += costs.seconds(op.kind, op.stage, table.split_backward)
    return float(np.median(list(per_step.values())))


def median_seconds(fn, *args, repeats: int = 5) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_stage_costs(net, micro_batch: int, repeats: int = 5, heads=None,
                        residuals: str = "recompute", together: int = 1) -> StageCosts:
    """Per-stage forward and backward, the backward whole and in its two halves (the vjp w.r.t. the
    stage's input only, and w.r.t. its parameters only), each recomputing the forward inside
    (`residuals='recompute'`, as the recompute runtimes do) or from the residuals a forward kept
    (`'carry'`: the pullback of `jax.vjp` alone is timed); with `heads` (local learning's
    `AuxHeads`), each head's forward and backward too.

    together: 1 times each op on one device with the others idle; K > 1 on the first K devices at
    once, each on its own micro-batch (`_on_devices`), as a lockstep tick runs them. On devices that
    share nothing (GPUs) the two agree; simulated CPU devices share the cores, which only the
    second sees."""
    import jax
    import jax.numpy as jnp

    carries(residuals)
    params, state = net.init(jax.random.key(0))
    image = x = jnp.zeros((micro_batch, *net.input_shape), net.input_dtype)  # token ids: integers
    task = heads.task if heads is not None and heads.task is not None else None
    label_shape = tuple(task.label_shape(tuple(net.input_shape))) if task is not None else ()
    labels = jnp.zeros((micro_batch, *label_shape), task.label_dtype if task is not None else jnp.int32)
    head_params = head_state = None
    if heads is not None:
        head_params, head_state = heads.init(jax.random.key(1))
    times = defaultdict(list)
    act, grad = [], []
    timed = _Timer(together, repeats)
    for j in range(net.num_stages):
        def stage(p, v, s=state[j], j=j):
            return net.apply_stage(j, p, s, v, True)[0]

        y = jax.jit(stage)(params[j], x)
        times["forward"].append(timed(stage, params[j], x))
        for field, wrt in (("backward", (0, 1)), ("backward_input", (1,)), ("backward_weight", (0,))):
            pullback = _pullback(stage, wrt)
            if residuals == "recompute":
                times[field].append(timed(lambda p, v, ct, pb=pullback: pb(p, v)(ct), params[j], x, jnp.ones_like(y)))
            else:  # the pullback alone, from the residuals a forward kept
                times[field].append(timed.from_kept(pullback, (params[j], x), jnp.ones_like(y)))
        act.append(float(y.size * y.dtype.itemsize))
        grad.append(float(sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params[j]))))
        if heads is not None:
            step = jax.grad(lambda p, s, v, j=j: heads.loss(j, p, s, v, labels, image)[0], argnums=(0, 2))
            last_head = heads.splits_last and j == net.num_stages - 1  # reads the classifier's input
            read = jnp.zeros((micro_batch, *heads.feature_shapes[j]), jnp.float32) if last_head else y
            times["head"].append(timed(step, head_params[j], head_state[j], read))
        x = y
    return StageCosts(tuple(times["forward"]), tuple(times["backward"]), tuple(act), tuple(grad),
                      tuple(times["head"]), tuple(times["backward_input"]), tuple(times["backward_weight"]),
                      residuals)


def _on_devices(fn, devices: int):
    """`fn` run on each of the first `devices` devices at once, each on its own copy of the inputs:
    (the jitted function over stacked inputs, the stacking of one set of inputs)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    if len(jax.devices()) < devices:
        raise ConfigError(f"timing ops on {devices} devices at once needs {devices} devices; "
                          f"{len(jax.devices())} are present")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("together",))
    first = lambda tree: jax.tree.map(lambda a: a[0], tree)  # noqa: E731
    again = lambda tree: jax.tree.map(lambda a: a[None], tree)  # noqa: E731
    run = jax.jit(jax.shard_map(lambda *args: again(fn(*map(first, args))), mesh=mesh,
                                in_specs=P("together"), out_specs=P("together"), check_vma=False))

    def stack(*args):
        return jax.device_put(jax.tree.map(lambda a: jnp.broadcast_to(a, (devices, *jnp.shape(a))), args),
                              NamedSharding(mesh, P("together")))

    return run, stack


def _pullback(stage, wrt: tuple[int, ...]):
    """(p, v) -> the vjp of `stage(p, v)` w.r.t. the arguments `wrt` (0: parameters, 1: input)."""
    import jax

    def pullback(p, v):
        def of_chosen(*chosen):
            args = [p, v]
            for i, a in zip(wrt, chosen):
                args[i] = a
            return stage(*args)

        return jax.vjp(of_chosen, *[(p, v)[i] for i in wrt])[1]

    return pullback


class _Timer:
    """Median seconds of a function, jitted, on one device (`devices=1`) or on the first `devices`
    devices at once, each on its own copy of the inputs (`_on_devices`)."""

    def __init__(self, devices: int, repeats: int):
        self.devices, self.repeats = devices, repeats

    def _compiled(self, fn):
        if self.devices == 1:
            import jax

            return jax.jit(fn), lambda *args: args
        return _on_devices(fn, self.devices)

    def __call__(self, fn, *args) -> float:
        run, stack = self._compiled(fn)
        return median_seconds(run, *stack(*args), repeats=self.repeats)

    def from_kept(self, pullback, primals, cotangent) -> float:
        """The pullback alone: its residuals kept first (as the forward would keep them), then timed."""
        keep, stack = self._compiled(pullback)
        run, stack_ct = self._compiled(lambda vjp, ct: vjp(ct))
        return median_seconds(run, keep(*stack(*primals)), *stack_ct(cotangent), repeats=self.repeats)


def group_by_time(net, heads, devices: int, batch_size: int, repeats: int = 3) -> tuple[int, ...]:
    """Contiguous groups of local modules for `devices` devices that minimise the slowest device,
    by each module's MEASURED forward, backward and head time on this device (PPLL's uneven groups)."""
    costs = measure_stage_costs(net, batch_size, repeats, heads)
    return _balanced([costs.local(j) for j in range(net.num_stages)], devices)


def table_for(config, devices: int, stages: int, steps: int | None = None):
    """The table `config.method` runs on `devices` devices (None: a method without one), laid
    out over enough steps for a steady state (the slope of step completion times)."""
    from cdpjax.layouts import table_for_config

    return table_for_config(config, devices, stages, steps or max(6, 2 * devices))


CALIBRATIONS = ("alone", "together")


def predict_for_config(config, devices: int, bandwidth: float, heads: bool = True, model: str = "lockstep",
                       calibrate: str = "alone", repeats: int = 5) -> dict:
    """Measures stage costs of `config`'s model here and predicts `config.method` on `devices`
    under the speedup `model` ('lockstep', the SPMD runtimes; 'async', MPMD host queues).

    calibrate: 'alone' times each op on one device with the others idle (a prediction for devices
    that share nothing); 'together' on `devices` devices at once, as a lockstep tick runs them
    (a prediction for these devices, simulated CPU devices sharing cores included). `repeats`:
    timed runs per op (median).

    The backwards are timed as the config runs them (`config.residuals`: recomputing the forward,
    or from kept residuals). Local learning (a table of 'FB' ops) also times each stage's
    auxiliary head, forward and backward, unless `heads=False`; its modules are grouped on the
    devices as the config says, else by measured time (`group_by_time`)."""
    if model not in MODELS:
        raise ConfigError(f"speedup model {model!r}: choose {' or '.join(MODELS)}")
    measured = _table_and_costs(config, devices, heads, calibrate, repeats)
    if isinstance(measured, str):
        return {"method": config.method, "model": model, "error": measured}
    tbl, costs, mb = measured
    stages = len(costs.forward)
    out = simulate(tbl, costs, bandwidth, model)
    per_stage = np.array([costs.local(j) for j in range(stages)])
    out.update(method=config.method, bandwidth=bandwidth, stage_forward=costs.forward, stage_backward=costs.backward,
               stage_backward_input=costs.backward_input, stage_backward_weight=costs.backward_weight,
               backward_from=costs.residuals, split_backward=tbl.split_backward, calibrate=calibrate,
               stage_head=costs.head, heads_timed=bool(costs.head), micro_batch=mb, repeats=repeats,
               activation_bytes=costs.activation_bytes,
               imbalance=float(per_stage.max() / per_stage.mean()),
               busy_fraction=tbl.busy_fraction()["devices"], busy_fraction_lockstep=lockstep_busy_fraction(tbl, costs),
               assumptions=__doc__.split("Assumptions (stated, not hidden):")[1].strip())
    return out


def _table_and_costs(config, devices: int, heads: bool, calibrate: str, repeats: int):
    """(table, measured StageCosts, micro-batch) of `config.method` on `devices` devices
    (`predict_for_config` says how), or why there is none (a string)."""
    from cdpjax import data, models
    from cdpjax.layouts import LAYOUTS

    if calibrate not in CALIBRATIONS:
        raise ConfigError(f"calibrate={calibrate!r}: choose {' or '.join(CALIBRATIONS)}")
    ds = data.build(config)
    net = models.build(config, ds.image_shape, ds.num_classes, input_dtype=ds.input_dtype)
    method = config.method
    stages = net.num_stages
    try:
        tbl = table_for(config, devices, stages)
    except (ConfigError, AssertionError) as e:  # e.g. sizes a CDP table refuses
        return str(e)
    if tbl is None:
        return "no time table (single-device method)"
    per_step = config.microbatches if LAYOUTS[method].microbatches else max(tbl.workers, 1)
    mb = max(config.global_batch_size // per_step, 1)
    local = any(kinds.lookup(op.kind).forward and kinds.lookup(op.kind).backward for op in tbl.ops)  # ppll
    aux = None
    if local and heads:
        from cdpjax.models import aux_heads

        from cdpjax import tasks

        aux = aux_heads.build(config.get("aux_head", "greedy"), net, ds.num_classes,
                              dict(config.get("aux_kwargs", {}) or {}), task=tasks.resolve(config, ds))
    costs = measure_stage_costs(net, mb, repeats, heads=aux, residuals=config.get("residuals", "recompute"),
                                together=devices if calibrate == "together" else 1)
    if tbl.devices != devices and local and "module_groups" in LAYOUTS[method].table_sizes() \
            and not config.get("module_groups", None):
        points = _balanced([costs.local(j) for j in range(stages)], devices)
        tbl = LAYOUTS[method].make_table(stages=stages, steps=max(6, 2 * devices), module_groups=points)
    if tbl.devices != devices:
        return f"{method} with {stages} stages runs on {tbl.devices} devices, not {devices}"
    return tbl, costs, mb


def measured_costs(config, devices: int, heads: bool = True, calibrate: str = "alone", repeats: int = 5):
    """(table, StageCosts) `predict_for_config` replays, measured here; a ConfigError where there is none."""
    measured = _table_and_costs(config, devices, heads, calibrate, repeats)
    if isinstance(measured, str):
        raise ConfigError(f"no speedup model for method {config.method!r} on {devices} devices: {measured}")
    return measured[:2]


def _balanced(costs, devices) -> tuple[int, ...]:
    """Contiguous group sizes of `costs` over `devices` minimising the largest group."""
    from cdpjax.models.partition import balanced_points

    bounds = (0, *balanced_points(costs, devices), len(costs))
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


def balance_by_time(blocks: Sequence, input_shape, stages: int, batch_size: int, repeats: int = 5):
    """Split points minimising the slowest stage by MEASURED forward+backward time per block
    (`partition='time'`). Returns (points, report) where the report gives the per-stage times and
    the imbalance (slowest / mean) of these points and of the even split by block count."""
    from cdpjax.models.partition import balanced_points, block_seconds, even_points

    costs = block_seconds(blocks, input_shape, batch_size, repeats=repeats)
    points = balanced_points(costs, stages)
    even = even_points(len(blocks), stages)

    def per_stage(pts):
        bounds = list(zip((0, *pts), (*pts, len(blocks))))
        return [float(sum(costs[a:b])) for a, b in bounds]

    report = {}
    for name, pts in (("by_time", points), ("even", even)):
        t = per_stage(pts)
        report[name] = {"points": list(pts), "stage_seconds": t, "imbalance": max(t) / (sum(t) / len(t))}
    return points, report


# How far a prediction may lie from the step measured beside it before the output says why it differs.
PREDICTION_TOLERANCE = 0.25


def why_it_differs(p: dict, measured: float) -> str | None:
    """One line saying what the model assumes that the measured step does not, when the predicted
    step is off the measured one by more than PREDICTION_TOLERANCE either way; None within it."""
    ratio = p["step_seconds"] / measured
    if 1 / (1 + PREDICTION_TOLERANCE) <= ratio <= 1 + PREDICTION_TOLERANCE:
        return None
    timed = ("each timed alone on one device, the others idle" if p.get("calibrate", "alone") == "alone"
             else f"each timed with {p['devices']} devices running at once")
    uneven = (f"; its stages' op times are uneven (imbalance {p['imbalance']:.2f}), which a noisy calibration on "
              f"a busy machine also gives" if p.get("imbalance", 1.0) > 2 else "")
    replay = ("in lockstep ticks, each as long as its slowest device" if p.get("model", "lockstep") == "lockstep"
              else "on each device in its table's order, as soon as their inputs arrive")
    return (f"why {ratio:.2f}x, not within {PREDICTION_TOLERANCE:.0%}: the model adds up ops {replay}, {timed} "
            f"and each paying its own launch, and charges a transfer its bytes / --bandwidth only; the measured "
            f"step is one compiled program on simulated devices sharing the cores{uneven}")


def format_predictions(records: list[dict]) -> str:
    lines = ["prediction on real devices (cdpjax.speedup; assumptions in its docstring):"]
    for r in records:
        p, name = r.get("prediction", {}), r.get("label", r["method"])  # the label names a variant
        if "error" in p:
            lines.append(f"  {name:>8}: {p['error']} ({p.get('model', '?')} model)")
        elif p:
            lines.append(f"  {name:>8}: step {p['step_seconds'] * 1e3:.2f} ms on {p['devices']} devices "
                         f"({p['model']} model, ops timed {p.get('calibrate', 'alone')}), speedup "
                         f"{p['speedup']:.2f}x over one device, stage imbalance {p['imbalance']:.2f}"
                         + (f", devices busy {p['busy_fraction_lockstep']:.2f} of the time in lockstep with these op "
                            f"times ({p['busy_fraction']:.2f} of the ticks)" if "busy_fraction_lockstep" in p else "")
                         + (f"; {p['step_seconds'] / r['step_seconds']:.2f}x the measured step"
                            if r.get("step_seconds") else ""))
            why = why_it_differs(p, r["step_seconds"]) if r.get("step_seconds") else None
            if why:
                lines.append(f"  {'':>8}  {why}")
            lines.append(f"  {'':>8}  {op_times_words(p)}")
    return "\n".join(lines)


def op_times_words(p: dict) -> str:
    """The per-op times a prediction replayed and where they came from, in one line: ms per
    micro-batch, one value per stage, for each cost the table's ops read."""
    def ms(values) -> str:
        return "[" + ", ".join(f"{v * 1e3:.3g}" for v in values) + "]"

    where = ("on one device, the others idle" if p.get("calibrate", "alone") == "alone"
             else f"on {p['devices']} devices at once")
    kind_of = {k.cost: k.name for k in kinds.KINDS.values()}  # a cost field -> the kind it times
    fields = [(kind_of["forward"], p.get("stage_forward", ())), (kind_of["backward"], p.get("stage_backward", ()))]
    if p.get("split_backward"):
        fields += [(f"{kind_of['backward']} input", p.get("stage_backward_input", ())),
                   (kind_of["backward_weight"], p.get("stage_backward_weight", ()))]
    if p.get("heads_timed"):
        fields.append(("head F+B", p.get("stage_head", ())))
    return (f"op times used (ms per micro-batch of {p.get('micro_batch', '?')}, per stage; measured here by "
            f"cdpjax.speedup.measure_stage_costs, median of {p.get('repeats', '?')} runs {where}, backwards "
            f"{'recomputing the forward' if p.get('backward_from') == 'recompute' else 'from kept residuals'}): "
            + "; ".join(f"{name} {ms(v)}" for name, v in fields if len(v)))
