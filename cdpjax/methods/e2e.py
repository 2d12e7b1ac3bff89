"""`e2e`: one device, plain backprop over the whole network. The reference.

Update rule: theta_{k+1} = opt(theta_k, grad L(theta_k; batch_k)), L the task's loss
(`ctx.task`: cross-entropy per example or per token, averaged over the batch), one optax
state per stage (the same update as one state over the whole model for the
elementwise optimizers used here, and the same layout as the staged methods).
"""
from __future__ import annotations

import jax
from jax.sharding import SingleDeviceSharding

from cdpjax import optim
from cdpjax.methods.common import Context, Method, loss_and_metrics, step_metrics
from cdpjax.train_state import Dense


def build(ctx: Context) -> Method:
    net = ctx.net()
    tx = ctx.optimizer()
    device = ctx.mesh.devices.flat[0]

    def init(rng):
        params, model_state = net.init(rng)
        return jax.device_put(Dense(params, model_state, [tx.init(p) for p in params]), device)

    @jax.jit
    def train_step(state, batch):
        grad_fn = jax.value_and_grad(loss_and_metrics, argnums=1, has_aux=True)
        (loss, (model_state, sums)), grads = grad_fn(net, state.params, state.model_state,
                                                      batch["image"], batch["label"], True, ctx.task)
        params, opt_state = optim.apply_per_stage(tx, state.params, state.opt_state, grads)
        return Dense(params, model_state, opt_state), step_metrics(ctx.task, loss, sums)

    def export(state):
        return state.params, state.model_state

    return Method("e2e", net, init, train_step, export, devices=1, input_sharding=SingleDeviceSharding(device))
