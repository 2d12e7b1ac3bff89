"""`local`: sequential local learning on one device, the reference for `ppll`.

Runs on the mesh's first device (like `e2e`), whatever the mesh.

Timing: for every batch, the stages run one after the other, j = 0..L-1.
Stage j takes the output of stage j-1 with the gradient stopped, runs its body,
computes its local loss through its auxiliary head (the last stage: the
network's own loss, or with a last head, `aux_kwargs.last_head`, that head's loss
on the features before the classifier plus the network's loss of the classifier
run on those features stopped), and updates its body and head at once with its own optax
state. Its output, computed before that update, is handed to stage j+1.

Update rule: theta_j <- opt_j(theta_j, grad_{theta_j} l_j(theta_j; h_{j-1})),
where theta_j = (body_j, head_j), l_j is stage j's local loss
(`cdpjax.models.aux_heads`: its head's loss, weighted as the head's kind
says) and h_{j-1} the stopped output of stage j-1. Bodies and heads use the
config's optimizer; the heads' learning rate is scaled by
`aux_kwargs.head_lr_scale` (via `optax.partition`). No gradient crosses a
stage boundary. BatchNorm in bodies and heads normalises with the batch's own
statistics and updates its running averages (`model_state`, `head_state`).
A head that follows the next stage (`aux_head='man'`) then moves its EMA copy
towards body_{j+1} as it is before stage j+1's update on the same batch
(`AuxHeads.follow`), where the two stages share a device in `ppll`: heads are
built for `config.module_groups` (one stage per device when not given), the
grouping `ppll` runs, so that the two methods stay equal.

Train state: `LocalState(params=BodiesAndHeads(body=[per stage], head=[per stage]),
model_state=[per stage], head_state=[per stage], opt_state=[per stage])`;
`export` gives the bodies (the plain network),
`Method.export_heads` the heads' parameters, `Method.export_head_state` their
state (BatchNorm averages and EMA copies).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import SingleDeviceSharding

from cdpjax import optim
from cdpjax.errors import ConfigError
from cdpjax.methods.common import Context, Method, step_metrics
from cdpjax.models import aux_heads
from cdpjax.train_state import typed_state

HEADS_KEY = 1 << 20  # folded into the run's key for the heads, so the bodies start as in every other method


@typed_state
class BodiesAndHeads(NamedTuple):
    """Per stage (module), the network's parameters and its auxiliary head's."""

    body: list
    head: list


@typed_state
class LocalState(NamedTuple):
    """`local`'s train state: every module's body and head, stepped once per batch, module after module.

    params: the bodies and heads. model_state, head_state: per module, the body's and the head's
    running statistics (and a head's EMA copies). opt_state: per module, one optax state over its
    `{'body', 'head'}` parameters (`optax.partition`'s labels).
    """

    params: BodiesAndHeads
    model_state: list
    head_state: list
    opt_state: list


def setup(ctx: Context, stages=None, groups=None):
    """The net, its heads (built for `groups`, default `config.module_groups`) and the body /
    head optimizers shared by `local` and `ppll`."""
    cfg = ctx.config
    kwargs = dict(cfg.get("aux_kwargs", {}) or {})
    kind = cfg.get("aux_head", "greedy")
    aux_heads.check_options(kind, kwargs)
    scale = aux_heads.head_lr_scale(kwargs)
    net = ctx.net(stages=stages)
    takes_pixels = "pixel_mean" in aux_heads.REGISTRY.lookup(kind).options
    if takes_pixels and kwargs.get("reconstruction") and not {"pixel_mean", "pixel_std"} <= set(kwargs):
        for key, value in pixel_stats(cfg).items():
            kwargs.setdefault(key, value)
    groups = cfg.get("module_groups", None) if groups is None else groups
    heads = aux_heads.build(kind, net, ctx.num_classes, kwargs, groups=groups, task=ctx.task)
    return net, heads, ctx.optimizer(), optim.make(cfg, learning_rate_scale=scale)


def pixel_stats(cfg) -> dict:
    """`pixel_mean` and `pixel_std` of the config's dataset ([0, 1] units per channel; its
    `dataset_kwargs` where they set them), which map the network's input back to the raw image
    that InfoPro's decoder reconstructs."""
    from cdpjax.data import tfds_data

    if cfg.dataset in tfds_data.SPECS:
        spec, given = tfds_data.SPECS[cfg.dataset], dict(cfg.get("dataset_kwargs", {}) or {})
        return {"pixel_mean": given.get("pixel_mean", spec.mean), "pixel_std": given.get("pixel_std", spec.std)}
    if cfg.dataset == "digits":  # read in [0, 1] already, so its normalisation is in pixel units
        from cdpjax.data.digits import digits

        data = digits()
        return {"pixel_mean": data.mean, "pixel_std": data.std}
    raise ConfigError(f"aux_kwargs.reconstruction=True on dataset {cfg.dataset!r}: give aux_kwargs.pixel_mean "
                      f"and pixel_std (per channel, in [0, 1] pixel units: raw = input * std + mean)")


def stage_grads(net, heads, j, body, head, model_state, head_state, x, labels, images=None):
    """Stage j's local step on input `x`: `(g_body, g_head, y, new_model_state, new_head_state,
    loss, accuracy)`, the gradients of its body and head on its local loss and its output `y`.

    The last stage with a head of its own (`AuxHeads.splits_last`): its local loss is the head's
    loss on the features h before the classifier plus the task's loss of the classifier's output
    on stop_gradient(h); its accuracy is the task's score of that output (the network's)."""
    x = lax.stop_gradient(x)
    split = j == net.num_stages - 1 and heads.splits_last

    def local_loss(body, head):
        if not split:
            y, new_model_state = net.apply_stage(j, body, model_state, x, True)
            loss, (acc, new_head_state) = heads.loss(j, head, head_state, y, labels, images, True)
            return loss, (y, new_model_state, new_head_state, acc)
        h, y, new_model_state = net.apply_stage_split(j, body, model_state, x, True)
        head_loss, (_, new_head_state) = heads.loss(j, head, head_state, h, labels, images, True)
        classifier_loss, acc = heads.output_loss(y, labels)
        return head_loss + classifier_loss, (y, new_model_state, new_head_state, acc)

    (loss, (y, new_model_state, new_head_state, acc)), (g_body, g_head) = jax.value_and_grad(
        local_loss, argnums=(0, 1), has_aux=True)(body, head)
    return g_body, g_head, y, new_model_state, new_head_state, loss, acc


def build(ctx: Context) -> Method:
    net, heads, body_tx, head_tx = setup(ctx)
    tx = optax.partition({"body": body_tx, "head": head_tx}, {"body": "body", "head": "head"})
    device = ctx.mesh.devices.flat[0]
    num_stages = net.num_stages

    def init(rng):
        body, model_state = net.init(rng)
        head, head_state = heads.init(jax.random.fold_in(rng, HEADS_KEY))
        opt_state = [tx.init({"body": b, "head": h}) for b, h in zip(body, head)]
        return jax.device_put(LocalState(BodiesAndHeads(body, head), model_state, head_state, opt_state), device)

    def train_step(state, batch):
        body, head = list(state.params.body), list(state.params.head)
        model_state, head_state = list(state.model_state), list(state.head_state)
        opt_state = list(state.opt_state)
        x, losses, accs = batch["image"], [], []
        for j in range(num_stages):
            g_body, g_head, y, model_state[j], head_state[j], loss, acc = stage_grads(
                net, heads, j, body[j], head[j], model_state[j], head_state[j], x, batch["label"], batch["image"])
            if j + 1 < num_stages:  # body[j + 1] before its update on this batch
                head_state[j] = heads.follow(j, head[j], head_state[j], body[j + 1])
            theta = {"body": body[j], "head": head[j]}
            theta, opt_state[j] = optim.apply(tx, theta, opt_state[j], {"body": g_body, "head": g_head})
            body[j], head[j] = theta["body"], theta["head"]
            x = y
            losses.append(loss)
            accs.append(acc)
        new = LocalState(BodiesAndHeads(body, head), model_state, head_state, opt_state)
        # x: the network's outputs; its metrics are the task's (as ppll's), every module's local loss beside them
        sums = ctx.task.metric_sums(x, batch["label"])
        metrics = {**step_metrics(ctx.task, ctx.task.finish(sums)["loss"], sums),
                   "stage_loss": jnp.stack(losses), "stage_accuracy": jnp.stack(accs),
                   "stage_valid": jnp.ones((num_stages,), bool)}
        return new, metrics

    def export(state):
        return state.params.body, state.model_state

    return Method("local", net, init, jax.jit(train_step, donate_argnums=0), export, devices=1, heads=heads,
                  export_heads=lambda state: state.params.head,
                  export_head_state=lambda state: state.head_state,
                  input_sharding=SingleDeviceSharding(device))

