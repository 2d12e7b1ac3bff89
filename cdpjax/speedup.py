"""A speedup model: predicted step time of a method on K real devices.

From per-stage forward and backward times measured on ONE device, a method's
time table, and a transfer bandwidth, an event simulation replays the table on
K devices and predicts the step time, and hence the speedup over running the
same work sequentially on one device.

Assumptions (stated, not hidden):
- An op takes the measured time of its stage on one device, whatever else runs
  (no contention, no kernel overlap between ops on one device); `FB` (PPLL's
  forward + local backward + update) takes forward + backward of the stage body
  plus its auxiliary head's forward and backward (`StageCosts.head`, measured
  unless `heads=False`: the heads are much of a ViT's local-learning work and the
  reason for PPLL's uneven module groups).
- A device runs its ops in the table's tick order, each as soon as its inputs
  are there: a forward needs the previous stage's forward of the same
  micro-batch, a backward the next stage's backward (the last stage: its own
  forward); crossing devices adds bytes / bandwidth (activation or cotangent of
  the boundary, one hop, no latency term).
- An op reading parameter version v >= 1 of stage j waits for stage j's update
  v-1, which is ready when the last backward of that stage's step is done plus
  its gradient synchronisation: `dp` one ring all-reduce of the whole model,
  2(N-1)/N x model bytes / bandwidth, after the last backward of the step; CDP
  the arrival of the completed stage sum at the op's device along the table's
  delivery plan (its 'sum' messages: one hop of the stage's gradient each, from
  the worker that completed it; partial-sum hops overlap compute and are not on
  the critical path); pipelines none (the stage owns its parameters).
- Steady state: the step time is the slope of step completion times over the
  laid-out steps, so fill and drain at the ends of a run are excluded.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from collections import defaultdict
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class StageCosts:
    forward: tuple[float, ...]  # seconds per micro-batch, per stage
    backward: tuple[float, ...]
    activation_bytes: tuple[float, ...]  # output of each stage, per micro-batch
    gradient_bytes: tuple[float, ...]  # parameters of each stage
    head: tuple[float, ...] = ()  # auxiliary head forward + backward per micro-batch, per stage (local learning)

    def local(self, j: int) -> float:
        """An 'FB' op of stage j: body forward and backward, and its head."""
        return self.forward[j] + self.backward[j] + (self.head[j] if self.head else 0.0)


def simulate(table, costs: StageCosts, bandwidth: float) -> dict:
    """Replays `table` with `costs`; returns finish times and the predicted step time."""
    L = table.stages
    n_workers = max(int(table.workers), 1)
    bw = float(bandwidth)
    device_free = defaultdict(float)
    done: dict[tuple, tuple[float, int]] = {}  # (kind, stage, step, micro) -> (finish, device)
    last_backward: dict[tuple[int, int], float] = defaultdict(float)  # (stage, step) -> finish
    step_finish: dict[int, float] = defaultdict(float)
    ops = sorted(table.ops, key=lambda o: (o.tick, o.device))

    allreduce = {(m.stage, m.step) for m in table.messages if m.kind == "allreduce"}
    sum_hops = defaultdict(list)  # (stage, step) -> the completed sum's hops, in tick order
    for m in sorted(table.messages, key=lambda m: m.tick):
        if m.kind == "sum":
            sum_hops[(m.stage, m.step)].append(m)

    def update_ready(stage: int, step: int, device: int) -> float:
        if (stage, step) in allreduce:  # one all-reduce of the whole model after the step's last backward
            model = float(sum(costs.gradient_bytes))
            return max(last_backward[(j, step)] for j in range(L)) + 2 * (n_workers - 1) / n_workers * model / bw
        done = last_backward[(stage, step)]
        hops = sum_hops[(stage, step)]
        if not hops:  # one worker, or a table that applies everywhere at completion
            return done
        arrive = {hops[0].src: done}  # the worker that completed it holds it first
        for m in hops:
            arrive[m.dst] = arrive.get(m.src, done) + costs.gradient_bytes[stage] / bw
        return arrive.get(device, done)

    def after(key, device, nbytes):
        finish, dev = done[key]
        return finish + (nbytes / bw if dev != device else 0.0)

    for op in ops:
        j, mb = op.stage, (op.step, op.micro)
        ready = device_free[op.device]
        if op.kind in ("F", "FB") and j > 0:
            ready = max(ready, after((op.kind, j - 1, *mb), op.device, costs.activation_bytes[j - 1]))
        if op.kind == "B":
            if j < L - 1:
                ready = max(ready, after(("B", j + 1, *mb), op.device, costs.activation_bytes[j]))
            else:
                ready = max(ready, after(("F", j, *mb), op.device, 0.0))
        if op.kind in ("F", "FB") and op.version >= 1:
            ready = max(ready, update_ready(j, op.version - 1, op.device))
        duration = {"F": costs.forward[j], "B": costs.backward[j], "FB": costs.local(j)}[op.kind]
        finish = ready + duration
        device_free[op.device] = finish
        done[(op.kind, j, *mb)] = (finish, op.device)
        if op.kind in ("B", "FB"):
            last_backward[(j, op.step)] = max(last_backward[(j, op.step)], finish)
        step_finish[op.step] = max(step_finish[op.step], finish)
    steps = sorted(step_finish)
    ends = np.array([step_finish[s] for s in steps])
    if len(ends) >= 3:
        step_time = float(np.polyfit(np.arange(len(ends))[1:], ends[1:], 1)[0])
    elif len(ends) == 2:
        step_time = float(ends[1] - ends[0])
    else:
        step_time = float(ends[0])
    sequential = _sequential_step(table, costs)
    return {"step_seconds": step_time, "sequential_step_seconds": sequential,
            "speedup": sequential / step_time if step_time > 0 else float("nan"),
            "total_seconds": float(ends[-1]), "devices": int(table.devices)}


def _sequential_step(table, costs: StageCosts) -> float:
    """The same work on one device: every op of one step, back to back."""
    per_step = defaultdict(float)
    for op in table.ops:
        per_step[op.step] += {"F": costs.forward[op.stage], "B": costs.backward[op.stage],
                              "FB": costs.local(op.stage)}[op.kind]
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


def measure_stage_costs(net, micro_batch: int, repeats: int = 5, heads=None) -> StageCosts:
    """Per-stage forward and backward (recomputing the forward inside, as the pipelines do) on one
    device; with `heads` (local learning's `AuxHeads`), each head's forward and backward too."""
    import jax
    import jax.numpy as jnp

    params, state = net.init(jax.random.key(0))
    image = x = jnp.zeros((micro_batch, *net.input_shape), jnp.float32)
    labels = jnp.zeros((micro_batch,), jnp.int32)
    head_params = head_state = None
    if heads is not None:
        head_params, head_state = heads.init(jax.random.key(1))
    fwd, bwd, act, grad, head = [], [], [], [], []
    for j in range(net.num_stages):
        f = jax.jit(lambda p, s, v, j=j: net.apply_stage(j, p, s, v, True)[0])
        y = f(params[j], state[j], x)

        def backward(p, s, v, ct, j=j):
            _, vjp = jax.vjp(lambda p_, v_: net.apply_stage(j, p_, s, v_, True)[0], p, v)
            return vjp(ct)

        b = jax.jit(backward)
        fwd.append(median_seconds(f, params[j], state[j], x, repeats=repeats))
        bwd.append(median_seconds(b, params[j], state[j], x, jnp.ones_like(y), repeats=repeats))
        act.append(float(y.size * y.dtype.itemsize))
        grad.append(float(sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params[j]))))
        if heads is not None:
            step = jax.jit(jax.grad(lambda p, s, v, j=j: heads.loss(j, p, s, v, labels, image)[0], argnums=(0, 2)))
            head.append(median_seconds(step, head_params[j], head_state[j], y, repeats=repeats))
        x = y
    return StageCosts(tuple(fwd), tuple(bwd), tuple(act), tuple(grad), tuple(head))


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


def predict_for_config(config, devices: int, bandwidth: float, heads: bool = True) -> dict:
    """Measures stage costs of `config`'s model here and predicts `config.method` on `devices`.

    Local learning (a table of 'FB' ops) also times each stage's auxiliary head, forward and
    backward, unless `heads=False`; its modules are grouped on the devices as the config says,
    else by measured time (`group_by_time`)."""
    from cdpjax import data, models
    from cdpjax.errors import ConfigError
    from cdpjax.layouts import LAYOUTS

    ds = data.build(config)
    net = models.build(config, ds.image_shape, ds.num_classes)
    method = config.method
    stages = net.num_stages
    try:
        tbl = table_for(config, devices, stages)
    except (ConfigError, AssertionError) as e:  # e.g. sizes a CDP table refuses
        return {"method": method, "error": str(e)}
    if tbl is None:
        return {"method": method, "error": "no time table (single-device method)"}
    per_step = config.microbatches if LAYOUTS[method].microbatches else max(tbl.workers, 1)
    mb = max(config.global_batch_size // per_step, 1)
    local = any(op.kind == "FB" for op in tbl.ops)
    aux = None
    if local and heads:
        from cdpjax.models import aux_heads

        aux = aux_heads.build(config.get("aux_head", "greedy"), net, ds.num_classes,
                              dict(config.get("aux_kwargs", {}) or {}))
    costs = measure_stage_costs(net, mb, heads=aux)
    if tbl.devices != devices and local and "module_groups" in LAYOUTS[method].table_sizes() \
            and not config.get("module_groups", None):
        points = _balanced([costs.local(j) for j in range(stages)], devices)
        tbl = LAYOUTS[method].make_table(stages=stages, steps=max(6, 2 * devices), module_groups=points)
    if tbl.devices != devices:
        return {"method": method, "error": f"{method} with {stages} stages runs on {tbl.devices} devices, "
                                           f"not {devices}"}
    out = simulate(tbl, costs, bandwidth)
    per_stage = np.array([costs.local(j) for j in range(stages)])
    out.update(method=method, bandwidth=bandwidth, stage_forward=costs.forward, stage_backward=costs.backward,
               stage_head=costs.head, heads_timed=bool(costs.head), micro_batch=mb,
               activation_bytes=costs.activation_bytes,
               imbalance=float(per_stage.max() / per_stage.mean()),
               assumptions=__doc__.split("Assumptions (stated, not hidden):")[1].strip())
    return out


def _balanced(costs, devices) -> tuple[int, ...]:
    """Contiguous group sizes of `costs` over `devices` minimising the largest group."""
    from cdpjax.models.partition import balanced_points

    bounds = (0, *balanced_points(costs, devices), len(costs))
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


def balance_by_time(blocks: Sequence, input_shape, stages: int, batch_size: int, repeats: int = 5):
    """Split points minimising the slowest stage by MEASURED forward+backward time per block.

    Returns (points, report) where the report gives the per-stage times and the
    imbalance (slowest / mean) of these points and of the even split by block count.
    """
    import jax
    import jax.numpy as jnp

    from cdpjax.models.partition import balanced_points, even_points

    x = jnp.zeros((batch_size, *input_shape), jnp.float32)
    costs = []
    for k, block in enumerate(blocks):
        variables = block.init(jax.random.key(k), x, train=False)

        def fwd_bwd(v, inp, block=block):
            def f(params, i):
                return block.apply({**v, "params": params}, i, train=False).sum()

            return jax.grad(f, argnums=(0, 1))(v["params"], inp)

        costs.append(median_seconds(jax.jit(fwd_bwd), variables, x, repeats=repeats))
        x = block.apply(variables, x, train=False)
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


def format_predictions(records: list[dict]) -> str:
    lines = ["prediction on real devices (cdpjax.speedup; assumptions in its docstring):"]
    for r in records:
        p, name = r.get("prediction", {}), r.get("label", r["method"])  # the label names a variant
        if "error" in p:
            lines.append(f"  {name:>8}: {p['error']}")
        elif p:
            lines.append(f"  {name:>8}: step {p['step_seconds'] * 1e3:.2f} ms on {p['devices']} devices, "
                         f"speedup {p['speedup']:.2f}x over one device, stage imbalance {p['imbalance']:.2f}")
    return "\n".join(lines)
