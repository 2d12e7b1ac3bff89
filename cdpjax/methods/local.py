"""`local`: sequential local learning on one device, the reference for `ppll`.

Runs on the mesh's first device (like `e2e`), whatever the mesh.

Timing: for every batch, the stages run one after the other, j = 0..L-1.
Stage j takes the output of stage j-1 with the gradient stopped, runs its body,
computes its local loss through its auxiliary head (the last stage: the
network's own loss), and updates its body and head at once with its own optax
state. Its output, computed before that update, is handed to stage j+1.

Update rule: theta_j <- opt_j(theta_j, grad_{theta_j} l_j(theta_j; h_{j-1})),
where theta_j = (body_j, head_j), l_j is stage j's local loss and h_{j-1} the
stopped output of stage j-1. Bodies and heads use the config's optimizer; the
heads' learning rate is scaled by `aux_kwargs.head_lr_scale` (via
`optax.partition`). No gradient crosses a stage boundary.

Train state: `{'params': {'body': [per stage], 'head': [per stage]},
'model_state': [per stage], 'opt_state': [per stage]}`; `export` gives the
bodies (the plain network), `info['export_heads']` the heads.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import SingleDeviceSharding

from cdpjax import optim
from cdpjax.errors import ConfigError
from cdpjax.methods.common import Context, Method
from cdpjax.models import aux_heads

HEADS_KEY = 1 << 20  # folded into the run's key for the heads, so the bodies start as in every other method


def setup(ctx: Context, method: str, stages=None):
    """The net, its heads and the body / head optimizers shared by `local` and `ppll`."""
    cfg = ctx.config
    kwargs = dict(cfg.get("aux_kwargs", {}) or {})
    kind = cfg.get("aux_head", "greedy")
    aux_heads.check_options(kind, kwargs)
    scale = aux_heads.head_lr_scale(kwargs)
    net = ctx.net(stages=stages)
    if net.num_stages < 2 and method == "ppll":
        raise ConfigError(f"{method} needs at least 2 stages, got stages={cfg.stages!r}")
    heads = aux_heads.build(kind, net, ctx.num_classes, kwargs)
    return net, heads, ctx.optimizer(), optim.make(cfg, learning_rate_scale=scale)


def stage_grads(net, heads, j, body, head, model_state, x, labels, images=None):
    """Stage j's local step on input `x`: gradients of its body and head, output, new state, loss, accuracy."""
    x = lax.stop_gradient(x)

    def local_loss(body, head):
        y, new_state = net.apply_stage(j, body, model_state, x, True)
        loss, acc = heads.loss(j, head, y, labels, images)
        return loss, (y, new_state, acc)

    (loss, (y, new_state, acc)), (g_body, g_head) = jax.value_and_grad(
        local_loss, argnums=(0, 1), has_aux=True)(body, head)
    return g_body, g_head, y, new_state, loss, acc


def build(ctx: Context) -> Method:
    net, heads, body_tx, head_tx = setup(ctx, "local")
    tx = optax.partition({"body": body_tx, "head": head_tx}, {"body": "body", "head": "head"})
    device = ctx.mesh.devices.flat[0]
    num_stages = net.num_stages

    def init(rng):
        body, model_state = net.init(rng)
        head = heads.init(jax.random.fold_in(rng, HEADS_KEY))
        params = {"body": body, "head": head}
        opt_state = [tx.init({"body": b, "head": h}) for b, h in zip(body, head)]
        return jax.device_put({"params": params, "model_state": model_state, "opt_state": opt_state}, device)

    def train_step(state, batch):
        body, head = list(state["params"]["body"]), list(state["params"]["head"])
        model_state, opt_state = list(state["model_state"]), list(state["opt_state"])
        x, losses, accs = batch["image"], [], []
        for j in range(num_stages):
            g_body, g_head, y, model_state[j], loss, acc = stage_grads(
                net, heads, j, body[j], head[j], model_state[j], x, batch["label"], batch["image"])
            theta = {"body": body[j], "head": head[j]}
            theta, opt_state[j] = optim.apply(tx, theta, opt_state[j], {"body": g_body, "head": g_head})
            body[j], head[j] = theta["body"], theta["head"]
            x = y
            losses.append(loss)
            accs.append(acc)
        new = {"params": {"body": body, "head": head}, "model_state": model_state, "opt_state": opt_state}
        metrics = {"loss": losses[-1], "accuracy": accs[-1], "stage_loss": jnp.stack(losses),
                   "stage_accuracy": jnp.stack(accs)}
        return new, metrics

    def export(state):
        return state["params"]["body"], state["model_state"]

    info = {"heads": heads, "export_heads": lambda state: state["params"]["head"]}
    return Method("local", net, init, jax.jit(train_step, donate_argnums=0), export, devices=1, info=info,
                  input_sharding=SingleDeviceSharding(device))

