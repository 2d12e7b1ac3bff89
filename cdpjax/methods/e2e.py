"""`e2e`: one device, plain backprop over the whole network. The reference.

Update rule: theta_{k+1} = opt(theta_k, grad L(theta_k; batch_k)), one optax
state per stage (the same update as one state over the whole model for the
elementwise optimizers used here, and the same layout as the staged methods).
"""
from __future__ import annotations

import jax
from jax.sharding import SingleDeviceSharding

from cdpjax.methods.common import Context, Method, loss_and_metrics, register


def _update(tx, params, opt_state, grads):
    new_params, new_opt = [], []
    for p, s, g in zip(params, opt_state, grads):
        u, s = tx.update(g, s, p)
        new_params.append(jax.tree.map(lambda a, b: a + b, p, u))
        new_opt.append(s)
    return new_params, new_opt


@register("e2e")
def build(ctx: Context) -> Method:
    net = ctx.net()
    tx = ctx.optimizer()
    device = ctx.mesh.devices.flat[0]

    def init(rng):
        params, model_state = net.init(rng)
        state = {"params": params, "model_state": model_state, "opt_state": [tx.init(p) for p in params]}
        return jax.device_put(state, device)

    @jax.jit
    def train_step(state, batch):
        grad_fn = jax.value_and_grad(loss_and_metrics, argnums=1, has_aux=True)
        (loss, (model_state, acc)), grads = grad_fn(net, state["params"], state["model_state"],
                                                     batch["image"], batch["label"])
        params, opt_state = _update(tx, state["params"], state["opt_state"], grads)
        new = {"params": params, "model_state": model_state, "opt_state": opt_state}
        return new, {"loss": loss, "accuracy": acc}

    def export(state):
        return state["params"], state["model_state"]

    return Method("e2e", net, init, train_step, export, info={"devices": 1},
                  input_sharding=SingleDeviceSharding(device))


apply_updates = _update
