"""`cdp-v1`, `cdp-v2`: cyclic data parallelism (Fournier and Oyallon, 2024).

Timing (`cdpjax.layouts.cdp.cdp_table`, the only place the rules live): N workers,
L stages, one tick = one stage-forward or one stage-backward of one micro-batch.
Worker i starts its micro-batch of step k at tick 2L*i/N + 2L*k, so the workers'
phases are spread evenly over the step instead of all peaking together. Stage
j's update for step k is complete at the end of the tick in which the last worker
finishes its backward of stage j.

Update rule, one optax state per stage; g_i^j is worker i's gradient of its
micro-batch mean loss w.r.t. stage j:

    theta^j_{k+1} = opt^j(theta^j_k, mean_i g_i^j(read_i(k)))

where worker i reads, for every stage j, theta_k or theta_{k-1} (the stale pairs of
the table; at step 0 both are theta_0):
- cdp-v2 (`cdp_rule='cdp-v2'`, the default): the version the table names: the new
  one iff worker i's forward of stage j comes after the update (N = L: stale iff
  j < L-1-i; N = 8, L = 4: half of the pairs).
- cdp-v2 with `cdp_rule='paper-code'`: the authors' released rule, for any N and L:
  current iff j >= L-1-i (N = 8, L = 4: 6 of 32 pairs stale; for N > L the table
  lengthens each step with idle ticks until every read follows its update, so that
  the ring runs it: 16 ticks instead of 8 at N = 8, L = 4).
- cdp-v1: theta_{k-1} everywhere. This read-version form equals the paper code's
  delayed-gradient form (compute g(theta_k) at step k, apply it at step k+1,
  no update at step 0) shifted by one step: our parameters after S steps are the
  paper code's after S+1 steps (its first step only computes a gradient).

BatchNorm (norm='batch'): statistics per micro-batch (per worker), running
averages averaged over workers, like the paper's code. `bn_cross_device` is
ignored: a cyclic worker's micro-batch is alone in its tick.

Two realisations, `config.cdp_impl`:
- `simulate`: all workers compute at once each step, each (worker, stage) reading
  the version of `table.stale` (current and previous stored, a select per stage);
  workers are vmapped inside `shard_map` over the `data` axis (N a multiple of the
  data axis, down to one device); gradients summed by the all-reduce of
  shard_map's transpose.
- `ring`: the real schedule, one worker per device, by the ring engine
  (`cdpjax.methods.ring`, read its docstring); where N is less than the data axis,
  data / N rings of N side by side, each fed its share of every global batch, each
  completed sum summed over the rings once per stage and step (workers=0: every
  device in one ring where the table takes that many workers, else the largest ring
  that divides both: `ring_workers`): the table's steady-state
  period one `lax.scan` over ticks, every op a `lax.switch` branch on natural-shape buffers,
  every message
  one static partial `ppermute` of the stage's real size (the running partial sum
  hopping worker to worker, the completed sum chained on to every other worker
  by the table's delivery plan, at most one 'sum' and one 'partial' send per
  worker per tick whatever N), each worker applying every update between its last
  read of the old version and its first of the new, so that ONE stored version
  per stage suffices. Backward by recomputation from the stashed stage input
  (`config.residuals='recompute'`, default) or from the forward's kept `jax.vjp`
  residuals ('carry': DP's FLOPs, more memory between steps). No model-sized
  all-reduce: only the loss and accuracy scalars are summed. One call = one
  period of 2L ticks that feeds one new micro-batch per worker and finishes older
  ones, so in-flight state (stashed inputs, cotangents, partial and completed
  sums of up to `max_lag` steps) lives in the train state; `flush(state)` runs
  `max_lag` periods with nothing fed, after which the parameters equal
  `simulate`'s after the same steps; training on after a flush restarts the
  cycle from the flushed parameters. A call's metrics are those of the
  micro-batches whose forward pass ended in that call. `run_steps` scans over
  periods (compile time does not grow with the steps).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from cdpjax import optim
from cdpjax.errors import ConfigError
from cdpjax.layouts.cdp import V2_RULES, cdp_table, check_sizes
from cdpjax.methods import ring
from cdpjax.methods.common import Context, Method, step_metrics, tree_select
from cdpjax.timetable import TimeTable
from cdpjax.train_state import typed_state

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
    net = ctx.net(bn_axis_name=None)
    ticks = cfg.get("cdp_ticks", "whole")  # checked by the table (`phase_ops`)
    asked = int(cfg.get("workers", 0))
    workers = asked or (ring_workers(devices, net.num_stages, ticks) if impl == "ring" else devices)
    if table is None:
        if impl == "ring":
            check_ring_workers(workers, asked, devices, net.num_stages, ticks)
        table = cdp_table(_rule(method, cfg), workers, net.num_stages, ticks=ticks)
    elif (table.workers, table.stages) != (workers, net.num_stages):
        raise ConfigError(f"table has N={table.workers}, L={table.stages}; the run has "
                          f"workers={workers}, stages={net.num_stages}")
    ctx.require_divisible("global_batch_size", cfg.global_batch_size, workers, "workers")
    if impl == "simulate":
        if workers % devices:
            raise ConfigError(f"workers={workers} is not a multiple of mesh.data={devices}: "
                              f"cdp_impl='simulate' vmaps workers/mesh.data workers on each device")
        return _simulate(ctx, method, net, table, workers)
    if devices % workers:
        raise ConfigError(f"cdp_impl='ring' runs rings of workers={workers} devices side by side: workers must "
                          f"divide mesh.data={devices} (or be 0); use cdp_impl='simulate' for fewer devices")
    return _ring(ctx, method, net, table, workers)


def ring_workers(devices: int, stages: int, ticks: str) -> int:
    """The ring's default worker count on `devices` devices: all of them where the table takes that
    many workers, else the most (at least 2: one worker has no delay, it is dp) that divides the
    devices and that the table takes (64 devices, L = 8, whole ticks: 4 rings of 16); where none
    does, all of them (refused by `check_ring_workers`)."""
    return max([n for n in ring_fits(devices, stages, ticks) if n > 1] or [devices])


def ring_fits(devices: int, stages: int, ticks: str) -> list[int]:
    """The worker counts that divide `devices` and that CDP's table takes at `stages` stages."""
    fits = []
    for n in range(1, devices + 1):
        if devices % n == 0:
            try:
                check_sizes(n, stages, ticks)
            except ConfigError:
                continue
            fits.append(n)
    return fits


def check_ring_workers(workers: int, asked: int, devices: int, stages: int, ticks: str) -> None:
    """Refuses a worker count the table does not take, naming the rings that fit the devices."""
    try:
        check_sizes(workers, stages, ticks)
    except ConfigError as e:
        fits = [n for n in ring_fits(devices, stages, ticks) if n > 1]
        meshes = ", ".join(f"workers={n}: {{'data': {devices // n}, 'worker': {n}}}" for n in reversed(fits))
        where = (f"on mesh.data={devices} devices rings side by side fit ({meshes}: rings x workers)" if fits
                 else f"no ring of 2 or more workers the table takes divides mesh.data={devices}")
        raise ConfigError(f"{e}; {where}") from None


def _rule(method: str, cfg) -> str:
    """The table rule of `method`: cdp-v1's own, or cdp-v2's `cdp_rule` ('cdp-v2' or 'paper-code')."""
    if method == "cdp-v1":
        return method
    rule = cfg.get("cdp_rule", "cdp-v2")
    if rule not in V2_RULES:
        raise ConfigError(f"cdp_rule={rule!r} is not a rule of cdp-v2 (one of {', '.join(V2_RULES)}); "
                          f"for cdp-v1's rule set method=cdp-v1")
    return rule


@typed_state
class TwoVersions(NamedTuple):
    """CDP's simulated train state: the parameters of this step and of the one before, which the
    table's stale (worker, stage) pairs read.

    params: theta_k, per stage. previous: theta_{k-1} (theta_0 at step 0: either slot reads it).
    model_state: BatchNorm's statistics, the workers' mean at each step. opt_state: per-stage
    optax states, stepped once per step with the sum of every worker's gradient.
    """

    params: list
    previous: list
    model_state: list
    opt_state: list


def _init_state(net, tx, rng) -> TwoVersions:
    params, model_state = net.init(rng)
    return TwoVersions(params, jax.tree.map(jnp.copy, params), model_state, [tx.init(p) for p in params])


# =================================================================== simulate


def _simulate(ctx: Context, method: str, net, table: TimeTable, workers: int) -> Method:
    # Long on purpose: the method's closures (init, steps, flush, export) share what is built here.
    mesh, tx, L = ctx.mesh, ctx.optimizer(), net.num_stages
    per_device = workers // ctx.axis(AXIS)
    replicated = NamedSharding(mesh, P())
    stale = jax.device_put(np.asarray(table.stale), NamedSharding(mesh, P(AXIS)))

    task = ctx.task

    def worker_loss(current, previous, stale_row, model_state, images, labels):
        params = [tree_select(stale_row[j], previous[j], current[j]) for j in range(L)]
        outputs, new_state = net.apply(params, model_state, images, True)
        return task.loss(outputs, labels), (new_state, task.metric_sums(outputs, labels))

    def by_worker(images, labels):
        return (images.reshape(per_device, -1, *images.shape[1:]),
                labels.reshape(per_device, -1, *labels.shape[1:]))

    def local_losses(state, stale_rows, images, labels):
        images, labels = by_worker(images, labels)
        run = jax.vmap(worker_loss, in_axes=(None, None, 0, None, 0, 0))
        return run(state.params, state.previous, stale_rows, state.model_state, images, labels)

    def local_step(state, stale_rows, images, labels):
        def total(current, previous):
            losses, aux = local_losses(state._replace(params=current, previous=previous), stale_rows, images, labels)
            # shard_map's transpose sums the replicated parameters' gradients over `data`:
            # dividing by N makes that sum the mean over workers.
            return losses.sum() / workers, (losses, aux)

        (_, (losses, (model_state, sums))), (g_cur, g_prev) = jax.value_and_grad(
            total, argnums=(0, 1), has_aux=True)(state.params, state.previous)
        grads = jax.tree.map(jnp.add, g_cur, g_prev)
        params, opt_state = optim.apply_per_stage(tx, state.params, state.opt_state, grads)
        model_state = lax.pmean(jax.tree.map(lambda s: s.mean(0), model_state), AXIS)
        new = TwoVersions(params, state.params, model_state, opt_state)
        metrics = step_metrics(task, lax.psum(losses.sum(), AXIS) / workers, lax.psum(sums.sum(0), AXIS))
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
        return state.params, state.model_state

    return Method(method, net, init, train_step, export, table=table, stale=table.stale, workers=workers,
                  devices=ctx.axis(AXIS), worker_losses=worker_losses, stored_versions=2,
                  report={"impl": "simulate"})


# ====================================================================== ring


def _ring(ctx: Context, method: str, net, table: TimeTable, workers: int) -> Method:
    # the lowering refuses a table the ring cannot serve, naming the op (`cdpjax.program.ring`)
    return ring.build(ctx, method, net, table, ctx.config.get("residuals", "recompute"))  # checked by the lowering
