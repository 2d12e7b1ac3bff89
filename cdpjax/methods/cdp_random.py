"""`cdp-random`: CDP under a delay model (`cdpjax.layouts.delays`), the table's reads as data.

Update rule (one optax state per stage; g_i^j is worker i's gradient of its micro-batch mean
loss w.r.t. stage j, tau(k, i, j) the staleness the table gives worker i's read of stage j at
step k, `cdpjax.staleness.per_read`):

    theta^j_{k+1} = opt^j(theta^j_k, c^j(mean_i g_i^j(theta^j_{k - tau(k, i, j)}), tau(k, ., j)))

where c^j is the delay correction (`config.delay.correction`, `cdpjax.delay_corrections`;
'none': the identity; 'nesterov' carries the momentum, beta = `config.momentum` or 0.9 where it is
0, and the optimizer then runs without its own; 'staleness-lr' scales the optimizer's update, not
the gradient, so that it is a learning rate under Adam too) and a version before 0 is theta_0.
'pipenag' moves the read instead: worker i's gradient is taken at PipeNAG's predicted weights
theta_{v} + lambda tau (theta_{v} - theta_{v-1}), v = k - tau(k, i, j)
(`delay_corrections.look_ahead`), and c^j is the identity (or, combined, 'pipenag+staleness-lr', its other part).
'fresh-weighted' (and 'fresh-sharp', 'freshest') weighs the reads: mean_i w_i g_i^j, w_i =
`delay_corrections.read_weights` of tau(k, ., j) (mean 1), and c^j is the identity.
The table lays out `LAID_OUT` steps; step k reads its row k, and past the table the
second half of the rows again and again (`table_row`).

Two realisations, `config.cdp_impl`:
- `simulate`: every worker at once each step (vmapped inside `shard_map` over `data`, N a
  multiple of the data axis, down to one device), reading from the last H = max tau + 1 versions
  of each stage kept in the state (`history[j][t]` = theta^j_{k-t}); gradients summed over
  workers by shard_map's transpose. Any table of the layout.
- `ring`: one worker per device, by the ring engine (`cdpjax.methods.ring`). The tables that carry
  CDP's delivery plan (the 'uniform' model, 'per-stage' with every tau_j >= 1) run as they are,
  each op at one depth every step. Every other table runs its reads as per-step depths
  (`_ring_by_depths`): the carrier's program (`ring_carrier`: CDP's traffic, every read fresh),
  each read tau(k, i, j) versions below the newest its worker stores, max tau + 1 kept.
- `zero`: cdp-zero (`cdpjax.methods.cdp_zero`: every stage partitioned over the workers) for
  the tables whose every read is cdp-v1's or cdp-v2's (`cdp_rule_of`), run as that rule; the
  others are refused: its plan keeps each piece's current and previous version only.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from cdpjax import delay_corrections, optim, staleness
from cdpjax.errors import ConfigError
from cdpjax.layouts.cdp import cdp_table
from cdpjax.layouts.cdp_zero import ZERO_RULES
from cdpjax.layouts.delays import Delay, delay_table, ring_carrier
from cdpjax.methods import cdp, cdp_zero, ring
from cdpjax.methods.common import Context, Method, step_metrics
from cdpjax.timetable import TimeTable
from cdpjax.train_state import typed_state

AXIS = "data"
LAID_OUT = 64  # steps of the table a run reads (then they repeat)


@typed_state
class History(NamedTuple):
    """cdp-random's simulated train state: the last versions of every stage, which each step's
    delays index.

    history: per stage, the parameters stacked `[depth, ...]`, newest first (row tau: theta_{k-tau};
      before step 0 every row is theta_0). model_state: BatchNorm's statistics, the workers' mean.
    opt_state: per-stage optax states, stepped once per step. correction: per-stage states of the
      delay correction (`()` without one). step: the step number k, which row of the table it reads.
    """

    history: list
    model_state: list
    opt_state: list
    correction: list
    step: jax.Array


def build(ctx: Context) -> Method:
    return make(ctx)


def make(ctx: Context, table: TimeTable | None = None) -> Method:
    """The method for `ctx.config.delay`; `table` overrides its table (same N and L)."""
    cfg = ctx.config
    ctx.require_axes("cdp-random", (AXIS,))
    impl = cfg.get("cdp_impl", "ring")
    devices = ctx.axis(AXIS)
    workers = int(cfg.get("workers", 0)) or devices
    delay = Delay.of(cfg.get("delay", None))
    net = ctx.net(bn_axis_name=None)
    if table is None:
        table = delay_table(workers, net.num_stages, LAID_OUT, delay, cfg.get("cdp_ticks", "whole"))
    elif (table.workers, table.stages) != (workers, net.num_stages):
        raise ConfigError(f"table has N={table.workers}, L={table.stages}; the run has "
                          f"workers={workers}, stages={net.num_stages}")
    if impl == "zero":
        return _zero(ctx, table, delay)
    if impl == "ring":
        if delay.correction != "none":
            raise ConfigError(f"delay.correction={delay.correction!r} runs in cdp_impl='simulate' only")
        if table.applies or workers == 1:  # the table's own ring traffic, each read at one depth every step
            return cdp.make(ctx, "cdp-random", table)
        return _ring_by_depths(ctx, net, table, workers)
    if impl != "simulate":
        raise ConfigError(f"cdp_impl={impl!r} is not one of simulate, ring, zero")
    ctx.require_divisible("global_batch_size", cfg.global_batch_size, workers, "workers")
    if workers % devices:
        raise ConfigError(f"workers={workers} is not a multiple of mesh.data={devices}: "
                          f"cdp_impl='simulate' vmaps workers/mesh.data workers on each device")
    return _simulate(ctx, net, table, workers, delay)


def _ring_by_depths(ctx: Context, net, table: TimeTable, workers: int) -> Method:
    """The ring running `table`'s reads as per-step depths (`ring.ReadDepths`) on the carrier
    (`delays.ring_carrier`: CDP's ring traffic, every read fresh): worker i's read of stage j at
    step k is tau(k, i, j) versions below the newest it stores, tau the table's staleness; the
    ring keeps max tau + 1 versions. What the ring needs of the table: a read of every stage by
    every worker at every step (its versions, nothing else: its ticks and traffic are the
    carrier's)."""
    taus = staleness.per_read(table)[:, :workers]
    if (taus < 0).any():
        k, i, j = (int(x[0]) for x in np.nonzero(taus < 0))
        raise ConfigError(f"table {table.method!r} has no read of stage {j} by worker {i} at step {k}: the ring runs a "
                          f"delay table's reads as per-step depths and needs every (step, worker, stage) read")
    ctx.require_divisible("global_batch_size", ctx.config.global_batch_size, workers, "workers")
    carrier = ring_carrier(workers, net.num_stages, ctx.config.get("cdp_ticks", "whole"))
    depths = ring.ReadDepths(taus.astype(np.int32), len(taus) // 2)  # the rows `table_row` reads
    m = ring.build(ctx, "cdp-random", net, carrier, ctx.config.get("residuals", "recompute"), read_depths=depths)
    return dataclasses.replace(m, table=table, stale=table.stale,
                               report={**m.report, "delay": Delay.of(ctx.config.get("delay", None)).to_json(),
                                       "carrier_period": carrier.period})


def cdp_rule_of(table: TimeTable, ticks: str = "whole") -> str | None:
    """The CDP rule (cdp-v1, cdp-v2) whose table reads the same version at every (step, worker,
    stage) as `table` does, or None: the delay tables cdp-zero can run."""
    reads = staleness.per_read(table)
    for rule in ZERO_RULES:
        cdp_reads = staleness.per_read(cdp_table(rule, table.workers, table.stages, table.steps, ticks))
        if cdp_reads.shape == reads.shape and (cdp_reads == reads).all():
            return rule
    return None


def _zero(ctx: Context, table: TimeTable, delay: Delay) -> Method:
    """cdp-zero (`cdpjax.methods.cdp_zero`) for a table whose reads are CDP's own (`cdp_rule_of`:
    the 'uniform' model, and the models at the parameters where they reduce to cdp-v1 / cdp-v2),
    run as that rule: same reads, same update rule, so the same parameters after T steps."""
    rule = cdp_rule_of(table, ctx.config.get("cdp_ticks", "whole"))
    if rule is None:
        raise ConfigError(f"delay.model={delay.model!r} reads other versions than cdp-v1's or cdp-v2's and cdp-zero's "
                          f"plan keeps each piece's current and previous version only, applying each update at CDP's "
                          f"update tick: use cdp_impl='simulate' (cdp-zero runs model 'uniform', per-stage with "
                          f"every tau 1, and the timed models where they reduce to cdp-v2)")
    if delay.correction != "none":
        raise ConfigError(f"delay.correction={delay.correction!r} runs in cdp_impl='simulate' only")
    config = ctx.config.copy_and_resolve_references()
    config.cdp_rule = rule
    return cdp_zero.build(dataclasses.replace(ctx, config=config))


def table_row(step, laid_out: int):
    """The row of the table's staleness that `step` reads: itself within the table, then the
    second half over and over (the first steps' reads are of theta_0, at most k behind, and the
    timed models start from rest: neither is the model's steady draw): the ring's `ReadDepths` rule
    with the rows from the second half on cycling."""
    return ring.depth_row(step, laid_out, laid_out // 2)


def _simulate(ctx: Context, net, table: TimeTable, workers: int, delay: Delay) -> Method:
    # Long on purpose: the method's closures (init, step, export) share what is built here.
    mesh, L, task = ctx.mesh, net.num_stages, ctx.task
    momentum = float(ctx.config.get("momentum", 0.0)) or 0.9
    # the correction carries the momentum: the optimizer's own is off
    if "nesterov" in delay_corrections.parts(delay.correction):
        plain = ctx.config.copy_and_resolve_references()
        plain.momentum, plain.nesterov = 0.0, False
        tx = optim.make(plain)
    else:
        tx = ctx.optimizer()
    per_device = workers // ctx.axis(AXIS)
    taus = staleness.per_read(table)[:, :workers]
    if (taus < 0).any():
        raise ConfigError(f"table {table.method!r} lacks a forward of some (step, worker, stage): every worker reads "
                          f"every stage at every step in cdp-random")
    look_ahead = delay_corrections.moves_read(delay.correction)
    weighted = delay_corrections.weighs_reads(delay.correction)
    # versions kept: theta_k .. theta_{k - max tau}, and one more for the look-ahead's last difference
    depth = int(taus.max()) + 1 + int(look_ahead)
    correction = delay_corrections.make(delay.correction, depth - 1, momentum, delay.strength)
    replicated = NamedSharding(mesh, P())
    taus_dev = jax.device_put(jnp.asarray(taus, jnp.int32), replicated)

    def stage_step(grads, params, opt_state, corr_state, tau):
        """One stage's update: the correction on the gradient before the optimizer, or (a learning
        rate scaled by staleness) on the optimizer's update, as `delay_corrections.ON_UPDATES` says."""
        if correction is None:
            return (*optim.apply(tx, params, opt_state, grads), corr_state)
        if delay_corrections.on_updates(delay.correction):
            updates, opt_state = tx.update(grads, opt_state, params)
            updates, corr_state = correction.update(updates, corr_state, params, staleness=tau)
            return optax.apply_updates(params, updates), opt_state, corr_state
        grads, corr_state = correction.update(grads, corr_state, params, staleness=tau)
        return (*optim.apply(tx, params, opt_state, grads), corr_state)

    def worker_loss(history, tau_row, weight_row, model_state, images, labels):
        if look_ahead:
            # the coefficients (1 + s tau, -s tau) sum to 1: summed over versions, the gradient is g(theta_hat)
            params = [jax.tree.map(lambda h: delay_corrections.look_ahead(h, tau_row[j], delay.strength), history[j])
                      for j in range(L)]
        else:
            params = [jax.tree.map(lambda h: h[tau_row[j]], history[j]) for j in range(L)]
        if weighted:  # the read's value unchanged, its gradient times w: p + (w - 1) (p - p) with p - p's gradient 1
            params = [jax.tree.map(lambda p: p + (weight_row[j] - 1) * (p - lax.stop_gradient(p)), params[j])
                      for j in range(L)]
        outputs, new_state = net.apply(params, model_state, images, True)
        return task.loss(outputs, labels), (new_state, task.metric_sums(outputs, labels))

    def local_step(state, tau_all, tau_rows, weight_rows, images, labels):
        images = images.reshape(per_device, -1, *images.shape[1:])
        labels = labels.reshape(per_device, -1, *labels.shape[1:])

        def total(history):
            run = jax.vmap(worker_loss, in_axes=(None, 0, 0, None, 0, 0))
            losses, aux = run(history, tau_rows, weight_rows, state.model_state, images, labels)
            # shard_map's transpose sums the replicated history's gradients over `data`: / N makes it the mean
            return losses.sum() / workers, (losses, aux)

        (_, (losses, (model_state, sums))), g_hist = jax.value_and_grad(total, has_aux=True)(state.history)
        grads = [jax.tree.map(lambda g: g.sum(0), g) for g in g_hist]
        params = [jax.tree.map(lambda h: h[0], h) for h in state.history]
        stepped = [stage_step(g, p, o, c, tau_all[:, j]) for j, (g, p, o, c) in
                   enumerate(zip(grads, params, state.opt_state, state.correction))]
        new_params, opt_state, corr_state = ([x[i] for x in stepped] for i in range(3))
        history = [jax.tree.map(lambda p, h: jnp.concatenate([p[None], h[:-1]]), p, h)
                   for p, h in zip(new_params, state.history)]
        model_state = lax.pmean(jax.tree.map(lambda s: s.mean(0), model_state), AXIS)
        new = History(history, model_state, opt_state, corr_state, state.step + 1)
        metrics = step_metrics(task, lax.psum(losses.sum(), AXIS) / workers, lax.psum(sums.sum(0), AXIS))
        return new, metrics

    sharded = jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P(), P(AXIS), P(AXIS), P(AXIS), P(AXIS)),
                            out_specs=(P(), P()), check_vma=True)

    def init(rng):
        params, model_state = net.init(rng)
        return jax.device_put(History(
            history=[jax.tree.map(lambda p: jnp.stack([p] * depth), p) for p in params],  # before 0: theta_0
            model_state=model_state,
            opt_state=[tx.init(p) for p in params],
            correction=[correction.init(p) if correction is not None else () for p in params],
            step=jnp.zeros((), jnp.int32),
        ), replicated)

    @jax.jit
    def train_step(state, batch):
        tau = taus_dev[table_row(state.step, taus_dev.shape[0])]  # [N, L]
        weights = delay_corrections.read_weights(delay.correction, tau)
        return sharded(state, tau, tau, weights, batch["image"], batch["label"])

    def export(state):
        return [jax.tree.map(lambda h: h[0], h) for h in state.history], state.model_state

    return Method("cdp-random", net, init, train_step, export, table=table, stale=table.stale, workers=workers,
                  devices=ctx.axis(AXIS), stored_versions=depth,
                  report={"impl": "simulate", "delay": delay.to_json(),
                          "mean_staleness": float(np.mean(taus[min(depth, len(taus) - 1):]))})
