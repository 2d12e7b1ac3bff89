"""`cdp-v1`, `cdp-v2`: cyclic data parallelism (Fournier and Oyallon, 2024).

Timing (`cdpjax.timetable.cdp_table`, the only place the rules live): N workers,
L stages, one tick = one stage-forward or one stage-backward of one micro-batch.
Worker i starts its micro-batch of step k at tick 2L*i/N + 2L*k, so the workers'
phases are spread evenly over the step instead of all peaking together. Stage
j's update for step k is applied at the end of the tick in which the last worker
finishes its backward of stage j.

Update rule, one optax state per stage, two stored versions per stage (current,
previous); g_i^j is worker i's gradient of its micro-batch mean loss w.r.t. stage j:

    theta^j_{k+1} = opt^j(theta^j_k, mean_i g_i^j(read_i(k)))
    previous^j <- current^j,  current^j <- theta^j_{k+1}

where worker i reads, for every stage j, theta_k (current) or theta_{k-1}
(previous, the stale pairs of the table; at step 0 both are theta_0):
- cdp-v2: the version the table names: the new one iff worker i's forward of
  stage j comes after the update (N = L: stale iff j < L-1-i; N = 8, L = 4: half
  of the pairs, where the paper's code, which hard-codes the N = L rule, delays
  about 19%).
- cdp-v1: theta_{k-1} everywhere. This read-version form equals the paper code's
  delayed-gradient form (compute g(theta_k) at step k, apply it at step k+1,
  no update at step 0) shifted by one step: our parameters after S steps are the
  paper code's after S+1 steps (its first step only computes a gradient).

BatchNorm (norm='batch'): statistics per micro-batch (per worker), running
averages averaged over workers, like the paper's code. `bn_cross_device` is
ignored: a cyclic worker's micro-batch is alone in its tick.

Two realisations, `config.cdp_impl`:
- `simulate`: all workers compute at once each step, each (worker, stage) reading
  the version of `table.stale` (a select per stage); workers are vmapped inside
  `shard_map` over the `data` axis (N a multiple of the data axis, down to one
  device); gradients summed by the all-reduce of shard_map's transpose.
- `ring`: the real schedule, one worker per device (N = the data axis), in ONE
  `shard_map`: `lax.scan` over the ticks of the table's steady-state period
  (`timetable.period_arrays`, each device reads its own column with
  `lax.axis_index('data')`), one `lax.switch` per tick over [idle, forward of
  stage j, backward of stage j] on a uniform carrier (raveled zero-padded
  gradients, padded activation buffers), backward by recomputation from the
  stashed stage input. Each stage's running partial sum hops one worker along
  the ring (`ppermute`) as workers finish that stage; the last worker completes
  it and relays it on within the update tick, and every worker applies the same
  optax update to its own copy. No model-sized all-reduce: only the loss and
  accuracy scalars are summed. Layout: steady state, one call = one period of
  2L ticks that feeds one new micro-batch per worker and finishes the previous
  one, so in-flight state (stashed stage inputs, cotangent, partial sums, both
  versions) lives in the train state and steady state has no fill or drain.
  `flush(state)` runs one period without a new micro-batch (masked updates), so
  that after S `train_step` calls and `flush` the parameters equal `simulate`
  after S steps; training on after a flush restarts the cycle from the flushed
  parameters (both slots hold them, as at step 0). A call's metrics are those
  of the micro-batches whose forward pass ended in that call (worker i's, of
  this step if 2L*i/N + L <= 2L, else of the previous step).
  At tick level a stale forward reads the `current` slot (the update it misses
  is not applied yet) and its backward the `previous` one (it has been since):
  the table's slots, not the step-level stale matrix, drive the ring.
  Costs: every worker stores both versions and the optimizer state of every
  stage; each tick sends one collective-permute of the largest stage's
  gradient (`info['padding']` gives the carrier's padding), plus N-2 relay hops
  in the L update ticks of a period.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from cdpjax import models, optim
from cdpjax.carrier import FlatLayout
from cdpjax.errors import ConfigError
from cdpjax.methods.common import Context, Method, tree_select, varying
from cdpjax.layouts.cdp import cdp_table, period_arrays
from cdpjax.timetable import TimeTable

AXIS = "data"


def build_v1(ctx: Context) -> Method:
    return make(ctx, "cdp-v1")


def build_v2(ctx: Context) -> Method:
    return make(ctx, "cdp-v2")


def make(ctx: Context, method: str, table: TimeTable | None = None) -> Method:
    """The method `method` ('cdp-v1' | 'cdp-v2'); `table` overrides its time table
    (same N and L; e.g. `cdp_table('dp', N, L)` removes the delay, for `simulate`)."""
    cfg = ctx.config
    ctx.require_axes(method, (AXIS,))
    impl = cfg.get("cdp_impl", "ring")
    if impl not in ("simulate", "ring"):
        raise ConfigError(f"cdp_impl={impl!r} is not one of simulate, ring")
    devices = ctx.axis(AXIS)
    workers = int(cfg.get("workers", 0)) or devices
    net = ctx.net(bn_axis_name=None)
    if table is None:
        table = cdp_table(method, workers, net.num_stages)
    elif (table.workers, table.stages) != (workers, net.num_stages):
        raise ConfigError(f"table has N={table.workers}, L={table.stages}; the run has "
                          f"workers={workers}, stages={net.num_stages}")
    ctx.require_divisible("global_batch_size", cfg.global_batch_size, workers, "workers")
    if impl == "simulate":
        if workers % devices:
            raise ConfigError(f"workers={workers} is not a multiple of mesh.data={devices}: "
                              f"cdp_impl='simulate' vmaps workers/mesh.data workers on each device")
        return _simulate(ctx, method, net, table, workers)
    if workers != devices:
        raise ConfigError(f"cdp_impl='ring' runs one worker per device: workers={workers} must equal "
                          f"mesh.data={devices} (or be 0); use cdp_impl='simulate' for fewer devices")
    return _ring(ctx, method, net, table, workers)


def _init_state(net, tx, rng):
    params, model_state = net.init(rng)
    return {
        "params": params,
        "previous": jax.tree.map(jnp.copy, params),  # step 0 reads theta_0 from either slot
        "model_state": model_state,
        "opt_state": [tx.init(p) for p in params],
    }


# =================================================================== simulate


def _simulate(ctx: Context, method: str, net, table: TimeTable, workers: int) -> Method:
    mesh, tx, L = ctx.mesh, ctx.optimizer(), net.num_stages
    per_device = workers // ctx.axis(AXIS)
    replicated = NamedSharding(mesh, P())
    stale = jax.device_put(np.asarray(table.stale), NamedSharding(mesh, P(AXIS)))

    def worker_loss(current, previous, stale_row, model_state, images, labels):
        params = [tree_select(stale_row[j], previous[j], current[j]) for j in range(L)]
        logits, new_state = net.apply(params, model_state, images, True)
        return models.cross_entropy(logits, labels), (new_state, models.accuracy(logits, labels))

    def by_worker(images, labels):
        return images.reshape(per_device, -1, *images.shape[1:]), labels.reshape(per_device, -1)

    def local_losses(state, stale_rows, images, labels):
        images, labels = by_worker(images, labels)
        run = jax.vmap(worker_loss, in_axes=(None, None, 0, None, 0, 0))
        return run(state["params"], state["previous"], stale_rows, state["model_state"], images, labels)

    def local_step(state, stale_rows, images, labels):
        def total(current, previous):
            losses, aux = local_losses({**state, "params": current, "previous": previous}, stale_rows, images, labels)
            # shard_map's transpose sums the replicated parameters' gradients over `data`:
            # dividing by N makes that sum the mean over workers.
            return losses.sum() / workers, (losses, aux)

        (_, (losses, (model_state, acc))), (g_cur, g_prev) = jax.value_and_grad(
            total, argnums=(0, 1), has_aux=True)(state["params"], state["previous"])
        grads = jax.tree.map(jnp.add, g_cur, g_prev)
        params, opt_state = optim.apply_per_stage(tx, state["params"], state["opt_state"], grads)
        model_state = lax.pmean(jax.tree.map(lambda s: s.mean(0), model_state), AXIS)
        new = {"params": params, "previous": state["params"], "model_state": model_state, "opt_state": opt_state}
        metrics = {"loss": lax.psum(losses.sum(), AXIS) / workers, "accuracy": lax.psum(acc.sum(), AXIS) / workers}
        return new, metrics

    sharded = jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P(AXIS), P(AXIS), P(AXIS)),
                            out_specs=(P(), P()), check_vma=True)
    losses = jax.shard_map(lambda s, r, x, y: local_losses(s, r, x, y)[0], mesh=mesh,
                           in_specs=(P(), P(AXIS), P(AXIS), P(AXIS)), out_specs=P(AXIS), check_vma=True)

    def init(rng):
        return jax.device_put(_init_state(net, tx, rng), replicated)

    @jax.jit
    def train_step(state, batch):
        return sharded(state, stale, batch["image"], batch["label"])

    @jax.jit
    def worker_losses(state, batch):
        """[N] each worker's loss on its micro-batch, reading the versions the table names."""
        return losses(state, stale, batch["image"], batch["label"])

    def export(state):
        return state["params"], state["model_state"]

    info = {"impl": "simulate", "worker_losses": worker_losses}
    return Method(method, net, init, train_step, export, table=table, stale=table.stale, workers=workers,
                  devices=ctx.axis(AXIS), info=info)


# ====================================================================== ring
# --- stage inputs and gradient sizes of the ring (parameter rows use carrier.FlatLayout;
# --- this activation stash is still apart from carrier.ActLayout).


@dataclasses.dataclass(frozen=True)
class Carrier:
    """Flat zero-padded buffers: per-stage gradients [P_max], stage inputs [A_max].

    param_sizes[j]: stage j's parameter count; inputs[j]: stage j's input shape for
    one micro-batch (inputs[L] = the logits' shape)."""

    param_sizes: tuple[int, ...]
    inputs: tuple[tuple[int, ...], ...]

    @property
    def p_max(self) -> int:
        return max(self.param_sizes)

    @property
    def a_max(self) -> int:
        return max(math.prod(s) for s in self.inputs[:-1])

    def padding(self) -> dict:
        """Storage reserved over storage needed: gradient buffers and stage-input stash."""
        L = len(self.param_sizes)
        return {"gradients": L * self.p_max / max(sum(self.param_sizes), 1),
                "activations": L * self.a_max / sum(math.prod(s) for s in self.inputs[:-1])}


def make_carrier(net, micro_batch: int) -> Carrier:
    params, _ = jax.eval_shape(lambda: net.init(jax.random.key(0)))
    sizes = tuple(int(sum(math.prod(x.shape) for x in jax.tree.leaves(p))) for p in params)
    outputs = net.stage_output_shapes(micro_batch)
    return Carrier(sizes, ((micro_batch, *net.input_shape), *(tuple(s) for s in outputs)))


def pad(x, size: int):
    flat = x.reshape(-1)
    return jnp.pad(flat, (0, size - flat.shape[0]))


def unpad(buf, shape):
    return buf[: math.prod(shape)].reshape(shape)


def _replace(items, j, value):
    return [value if k == j else v for k, v in enumerate(items)]


def worker_branches(net, workers: int, layout, inputs, a_max: int, row_of):
    """A CDP worker's ops for the per-tick `lax.switch`: [idle, forward of stage j..., backward of stage j...].

    Each maps (params, model_state, stash, cotangent, labels, images, new_labels) to
    (stash, cotangent, labels, model_state, gradient row, loss, correct, counted).
    `row_of(j, params)` is stage j's parameters as one padded row of `layout`, from
    whatever the realisation holds (`ring`: the slot the table names; `cdp-zero`: the
    row just relayed); the gradient comes back as such a row. A backward recomputes
    its stage from the stashed input.
    """
    L, p_max = net.num_stages, layout.width

    def idle(params, ms, stash, cot, labels, images, new_labels):
        zero = jnp.zeros((), jnp.float32)
        return varying((stash, cot, labels, ms, jnp.zeros((p_max,), jnp.float32), zero, zero, zero), AXIS)

    def forward(j):
        def branch(params, ms, stash, cot, labels, images, new_labels):
            if j == 0:  # a new micro-batch: stash its input and labels for the backward
                x, labels = images, new_labels
                stash = stash.at[0].set(pad(images, a_max))
            else:
                x = unpad(stash[j], inputs[j])
            y, ms_j = net.apply_stage(j, layout.unpack_one(j, row_of(j, params)), ms[j], x, True)
            ms = _replace(ms, j, ms_j)
            zero = jnp.zeros((), jnp.float32)
            if j < L - 1:
                stash = stash.at[j + 1].set(pad(y, a_max))
                loss = correct = counted = zero
            else:
                loss, correct, counted = models.cross_entropy(y, labels), models.accuracy(y, labels), zero + 1
            return varying((stash, cot, labels, ms, jnp.zeros((p_max,), jnp.float32), loss, correct, counted), AXIS)
        return branch

    def backward(j):
        def branch(params, ms, stash, cot, labels, images, new_labels):
            x = unpad(stash[j], inputs[j])

            def stage(row, x):  # recomputed from the stashed input; BN state updates are the forward's
                y, _ = net.apply_stage(j, layout.unpack_one(j, row), ms[j], x, True)
                # the 1/N makes the ring's sum of worker gradients their mean
                return models.cross_entropy(y, labels) / workers if j == L - 1 else y

            seed = varying(jnp.ones((), jnp.float32), AXIS) if j == L - 1 else unpad(cot, inputs[j + 1])
            row = row_of(j, params)
            if j == 0:  # the input needs no gradient
                _, vjp = jax.vjp(lambda r: stage(r, x), row)
                (g,) = vjp(seed)
            else:
                _, vjp = jax.vjp(stage, row, x)
                g, gx = vjp(seed)
                cot = pad(gx, a_max)
            zero = jnp.zeros((), jnp.float32)
            return varying((stash, cot, labels, ms, g, zero, zero, zero), AXIS)
        return branch

    return [idle] + [forward(j) for j in range(L)] + [backward(j) for j in range(L)]


# --- the ring itself


def _ring(ctx: Context, method: str, net, table: TimeTable, workers: int) -> Method:
    mesh, tx, L, N = ctx.mesh, ctx.optimizer(), net.num_stages, workers
    batch = int(ctx.config.global_batch_size)
    micro = batch // N
    carrier = make_carrier(net, micro)
    p_max, a_max, inputs = carrier.p_max, carrier.a_max, carrier.inputs
    arrays = period_arrays(method, N, L)
    ring = [(i, (i + 1) % N) for i in range(N)]
    per_worker = NamedSharding(mesh, P(AXIS))

    layout = FlatLayout.from_trees(jax.eval_shape(lambda: net.init(jax.random.key(0)))[0])

    def read(j, versions):  # stage j's row from the slot the table names for this op
        current, previous, slot = versions
        return layout.pack_one(j, tree_select(slot == 1, previous[j], current[j]))

    branches = worker_branches(net, N, layout, inputs, a_max, read)

    def keep(current, previous, opt, gradient):
        return current, previous, opt

    def update(j):
        def branch(current, previous, opt, gradient):
            g = layout.unpack_one(j, gradient)
            new, new_opt = optim.apply_per_stage(tx, [current[j]], [opt[j]], [g])
            return _replace(current, j, new[0]), _replace(previous, j, current[j]), _replace(opt, j, new_opt[0])
        return branch

    updates = [keep] + [update(j) for j in range(L)]

    def tick(carry, x, feeding, inflight, images, new_labels):
        me = lax.axis_index(AXIS)
        current, previous, opt, ms, stash, cot, labels, inbox, metrics = carry
        planned = x["op"][me]
        # Ops of a step that was never fed (before the first call, or the step a flush
        # would start) run as idle; their zero gradients keep the partial sums exact.
        valid = jnp.where(x["step"][me] == 0, feeding, inflight)
        op = jnp.where(valid, planned, 0)
        stash, cot, labels, ms, grad, loss, correct, counted = lax.switch(
            op, branches, (current, previous, x["slot"][me]), ms, stash, cot, labels, images, new_labels)
        metrics = metrics + jnp.stack([loss, correct, counted])

        # The running partial sum of the stage just finished goes on one hop.
        finished = planned > L
        stage = jnp.where(finished, planned - 1 - L, 0)
        total = inbox[stage] + grad
        inbox = jnp.where(finished, inbox.at[stage].set(0.0), inbox)
        got = total  # the completed sum, where this worker is the last to finish
        if N > 1:
            hop = x["sum_hop"][me]
            out = jnp.where(x["send"][me] >= 0, total, 0.0)
            buf = lax.ppermute(out, AXIS, ring)
            recv = x["recv"][me]
            inbox = jnp.where(recv >= 0, inbox.at[jnp.maximum(recv, 0)].set(buf), inbox)
            got = jnp.where(hop == 1, buf, got)

            def relay(h, c):  # the completed sum goes on, one hop at a time, within the tick
                buf, got = c
                buf = lax.ppermute(buf, AXIS, ring)
                return buf, jnp.where(hop == h, buf, got)

            # The hop count is the tick's (the same on every device): a loop, not a switch,
            # so no collective sits in a branch, and ticks without an update send nothing more.
            _, got = lax.fori_loop(2, x["relay_hops"] + 1, relay, (buf, got))

        u = x["update"]
        apply = (u >= 0) & jnp.where(x["update_step"] == 0, feeding, inflight)
        current, previous, opt = lax.switch(jnp.where(apply, u + 1, 0), updates, current, previous, opt, got)
        return (current, previous, opt, ms, stash, cot, labels, inbox, metrics), None

    xs = {k: np.asarray(v) for k, v in arrays.items()}
    xs["relay_hops"] = xs["sum_hop"].max(axis=1)

    def local_period(state, images, new_labels, feeding):
        s = jax.tree.map(lambda a: a[0], state)
        inflight = s["inflight"]
        carry = (s["params"], s["previous"], s["opt_state"], s["model_state"], s["stash"], s["cotangent"],
                 s["labels"], s["inbox"], varying(jnp.zeros((3,), jnp.float32), AXIS))
        carry, _ = lax.scan(lambda c, x: tick(c, x, feeding, inflight, images, new_labels), carry,
                            jax.tree.map(jnp.asarray, xs))
        current, previous, opt, ms, stash, cot, labels, inbox, metrics = carry
        # After a flush both slots hold the newest version, as at step 0: training on from
        # a flushed state restarts the cycle from it (its first stale reads read it too).
        previous = tree_select(feeding, previous, current)
        new = {"params": current, "previous": previous, "opt_state": opt, "model_state": ms, "stash": stash,
               "cotangent": cot, "labels": labels, "inbox": inbox,
               "inflight": jnp.logical_and(jnp.ones_like(inflight), feeding)}
        loss, correct, counted = lax.psum(metrics, AXIS)  # three scalars: the only all-reduce
        counted = jnp.maximum(counted, 1.0)
        return jax.tree.map(lambda a: a[None], new), {"loss": loss / counted, "accuracy": correct / counted}

    sharded = jax.shard_map(local_period, mesh=mesh, in_specs=(P(AXIS), P(AXIS), P(AXIS), P()),
                            out_specs=(P(AXIS), P()), check_vma=True)
    period = jax.jit(sharded)  # not donated: the trainer keeps the old state when it skips a non-finite step

    def init(rng):
        state = _init_state(net, tx, rng)
        state.update(
            stash=jnp.zeros((L, a_max), jnp.float32),
            cotangent=jnp.zeros((a_max,), jnp.float32),
            labels=jnp.zeros((micro,), jnp.int32),
            inbox=jnp.zeros((L, p_max), jnp.float32),
            inflight=jnp.zeros((), bool),
        )
        # Every worker holds its own copy of everything: a leading worker axis on `data`.
        return jax.device_put(jax.tree.map(lambda a: jnp.broadcast_to(a, (N, *a.shape)), state), per_worker)

    def train_step(state, batch):
        return period(state, batch["image"], batch["label"], True)

    def flush(state):
        images = jnp.zeros((batch, *net.input_shape), jnp.float32, device=per_worker)
        labels = jnp.zeros((batch,), jnp.int32, device=per_worker)
        return period(state, images, labels, False)[0]

    def export(state):
        # Every worker applied the same updates: worker 0's copy is the model. Running
        # averages (EMA, linear) averaged over workers = averaging them every step.
        params = jax.tree.map(lambda a: a[0], state["params"])
        model_state = jax.tree.map(lambda a: a.mean(0), state["model_state"])
        return params, model_state

    info = {"impl": "ring", "padding": carrier.padding(), "period": period}
    return Method(method, net, init, train_step, export, flush, table, carrier=carrier, stale=table.stale,
                  workers=N, devices=N, state_depends_on_mesh=True, info=info)
