"""`dp`: data parallel over the `data` axis, gradients averaged once per step.

Timing: every worker runs forward and backward of its slice of the global batch
at the same time; all gradients are ready together at the end of backward, so
the whole model is all-reduced in one burst.
Update rule: theta_{k+1} = opt(theta_k, mean_i g_i(theta_k)), identical to
`e2e` on the global batch (with cross-device BatchNorm statistics).
"""
from __future__ import annotations

import jax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from cdpjax import optim
from cdpjax.methods.common import Context, Method, loss_and_metrics, step_metrics
from cdpjax.train_state import Dense


def build(ctx: Context) -> Method:
    ctx.require_axes("dp", ("data",))
    cfg = ctx.config
    workers = ctx.axis("data")
    ctx.require_divisible("global_batch_size", cfg.global_batch_size, workers, "mesh.data")
    cross = bool(cfg.get("bn_cross_device", True))
    net = ctx.net(bn_axis_name="data" if cross else None)
    tx = ctx.optimizer()
    mesh = ctx.mesh
    replicated = NamedSharding(mesh, P())

    def init(rng):
        params, model_state = net.init(rng)
        return jax.device_put(Dense(params, model_state, [tx.init(p) for p in params]), replicated)

    def local_step(state, images, labels):
        def local_loss(params):
            loss, aux = loss_and_metrics(net, params, state.model_state, images, labels, True, ctx.task)
            # The gradient of a replicated parameter is summed over `data` by shard_map's
            # transpose; dividing the local mean by the worker count makes that sum the mean.
            return loss / workers, aux

        (loss, (model_state, sums)), grads = jax.value_and_grad(local_loss, has_aux=True)(state.params)
        if not cross:  # per-device statistics: average the running estimates like the paper's code
            model_state = lax.pmean(model_state, "data")
        params, opt_state = optim.apply_per_stage(tx, state.params, state.opt_state, grads)
        metrics = step_metrics(ctx.task, lax.psum(loss, "data"), lax.psum(sums, "data"))
        return Dense(params, model_state, opt_state), metrics

    sharded = jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                            out_specs=(P(), P()), check_vma=True)

    @jax.jit
    def train_step(state, batch):
        return sharded(state, batch["image"], batch["label"])

    def export(state):
        return state.params, state.model_state

    return Method("dp", net, init, train_step, export, table=_table(workers, net.num_stages), workers=workers,
                  devices=workers)


def _table(workers: int, stages: int):
    """dp's time table (for the benches and pictures); None where the CDP layout refuses the sizes."""
    from cdpjax.errors import ConfigError
    from cdpjax.layouts.cdp import cdp_table

    try:
        return cdp_table("dp", workers, stages)
    except ConfigError:
        return None
