"""`ppll`: local learning pipelined over the `stage` axis (Guo et al., 2024).

Timing: K stages, one per device of the `stage` axis. At tick t stage j runs
batch t-j: it takes what its predecessor handed on at tick t-1 (a `ppermute`
queue of depth one, shift +1 on `stage`), runs its body, computes its local
loss through its auxiliary head, updates with its own optimizer state, and
hands its output on, with the batch's labels (and the image, for heads that
reconstruct it) and a `valid` flag. No gradient crosses a stage boundary, so
every device works at every tick once the pipeline is full; the only bubbles
are the K-1 fill ticks at the start of the run and the K-1 drain ticks of
`flush` at its end (not at every step: the queues are part of the train state).

Update rule: exactly `local`'s. Stage j sees the batches in order and updates
on each with its own optimizer, so after T batches and a flush the parameters
are those of `local` after T steps. Ticks whose input is not a batch (fill and
drain) are masked: `new = where(valid, new, old)` for parameters, optimizer
and model state.

SPMD realisation: one `shard_map` over the mesh, `lax.scan` over ticks,
`lax.switch(axis_index('stage'))` over the stage carrier (parameters, heads,
optimizer, model and head state as zero-padded rows, activations as padded flat
buffers); the optimizer updates the padded rows outside the switch; the
`ppermute` follows the switch. The batch is placed like any method's (over
`data`, replicated over `stage`) and read by stage 0 only.
With a `data` axis, each data group runs its own pipeline on its slice of the
batch; gradients are averaged over `data` after the switch, so the update is
that of the whole batch (BatchNorm statistics are then per data group, and
their running estimates, of bodies and heads, are averaged).

Entry points: `train_step(state, batch)` is one tick (one new batch into stage
0); `flush(state)` runs K-1 ticks with no input; `info['run_ticks'](state,
batches)` scans over T ticks (batches stacked `[T, B, ...]`) in one jit.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from cdpjax import carrier as carriers
from cdpjax import optim
from cdpjax.errors import ConfigError
from cdpjax.methods.common import Context, Method, tree_select, varying
from cdpjax.methods.local import HEADS_KEY, setup, stage_grads


def check_mesh(ctx: Context, method: str):
    """(stages, data groups) of a pipeline on `stage` (x `data`); refuses what it cannot run."""
    cfg = ctx.config
    ctx.require_axes(method, ("stage", "data"))
    stages, groups = ctx.axis("stage"), ctx.axis("data")
    if "stage" not in ctx.mesh.axis_names:
        raise ConfigError(f"method {method!r} needs a 'stage' mesh axis: set --config.mesh.stage=K")
    if groups > 1 and cfg.get("norm", "none") == "batch" and cfg.get("bn_cross_device", True):
        raise ConfigError(f"{method} with mesh.data={groups} and norm='batch' would need a cross-device "
                          f"BatchNorm inside a pipeline stage: set bn_cross_device=False (statistics per "
                          f"data group) or norm='group'")
    ctx.require_divisible("global_batch_size", cfg.global_batch_size, groups, "mesh.data")
    return stages, groups


def net_stages(ctx: Context, method: str, stages: int) -> None:
    spec = ctx.config.stages
    count = len(spec) + 1 if isinstance(spec, (list, tuple)) else spec
    if count != stages:
        raise ConfigError(f"{method} runs one stage per device of the stage axis: stages={spec!r} gives "
                          f"{count} stages but mesh.stage={stages}")


def build(ctx: Context) -> Method:
    num_stages, groups = check_mesh(ctx, "ppll")
    net_stages(ctx, "ppll", num_stages)
    net, heads, body_tx, head_tx = setup(ctx, "ppll")
    mesh = ctx.mesh
    batch = ctx.config.global_batch_size // groups
    head_shapes, head_state_shapes = jax.eval_shape(heads.init, jax.random.key(0))
    carrier = carriers.StageCarrier.from_net(net, batch, extra={"head": head_shapes, "head_state": head_state_shapes})
    head_layout, head_state_layout = carrier.extra["head"], carrier.extra["head_state"]
    data = "data" in mesh.axis_names
    axes = ("stage", "data") if data else ("stage",)
    image_shape = tuple(net.input_shape)
    last = num_stages - 1

    def state_specs(state):
        specs = carriers.stage_specs(state)
        if data:  # a data group's queue holds its own slice of the batch
            specs["inbox"] = {k: P("stage", "data") if k != "valid" else P("stage") for k in state["inbox"]}
        return specs

    def init(rng):
        body, model_state = net.init(rng)
        body = carrier.pack_params(body)
        head, head_state = heads.init(jax.random.fold_in(rng, HEADS_KEY))
        head, head_state = head_layout.pack(head), head_state_layout.pack(head_state)
        inbox = {"act": jnp.zeros((num_stages, groups * batch, carrier.acts.width)),
                 "label": jnp.zeros((num_stages, groups * batch), jnp.int32),
                 "valid": jnp.zeros((num_stages,), bool)}
        if heads.needs_image:
            inbox["image"] = jnp.zeros((num_stages, groups * batch, *image_shape))
        state = {"body": body, "head": head, "model_state": carrier.pack_state(model_state), "head_state": head_state,
                 "opt_body": carriers.init_opt(body_tx, body), "opt_head": carriers.init_opt(head_tx, head),
                 "inbox": inbox}
        specs = state_specs(state)
        return jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))

    def branch(j, body, head, model_state, head_state, x, labels, images):
        g_body, g_head, y, new_state, new_head_state, loss, acc = stage_grads(
            net, heads, j, carrier.params.unpack_one(j, body), head_layout.unpack_one(j, head),
            carrier.model_state.unpack_one(j, model_state), head_state_layout.unpack_one(j, head_state),
            carrier.unpack_act(j, x), labels, images)
        out = carrier.pack_act(j + 1, y) if j < last else jnp.zeros_like(x)
        return (carrier.params.pack_one(j, g_body), head_layout.pack_one(j, g_head),
                carrier.model_state.pack_one(j, new_state), head_state_layout.pack_one(j, new_head_state), out,
                loss, acc)

    def tick(state, feed):
        image, label, fed = feed
        first = lax.axis_index("stage") == 0
        inbox = state["inbox"]
        x = jnp.where(first, carrier.pack_act(0, image), inbox["act"])
        labels = jnp.where(first, label, inbox["label"])
        valid = jnp.where(first, fed, inbox["valid"])
        images = jnp.where(first, image, inbox["image"]) if heads.needs_image else None
        # Replicated rows enter the switch varying over every axis: their gradients are
        # then per data group, and the mean over `data` (a collective) stays outside.
        g_body, g_head, model_state, head_state, out, loss, acc = carrier.switch(
            branch, *varying((state["body"], state["head"], state["model_state"], state["head_state"]), axes),
            x, labels, images, axes=axes)
        if data:
            g_body, g_head = lax.pmean((g_body, g_head), "data")
            model_state, head_state = lax.pmean((model_state, head_state), "data")
            loss, acc = lax.pmean((loss, acc), "data")
        body, opt_body = optim.apply(body_tx, state["body"], state["opt_body"], g_body)
        head, opt_head = optim.apply(head_tx, state["head"], state["opt_head"], g_head)
        new = {"body": body, "head": head, "model_state": model_state, "head_state": head_state, "opt_body": opt_body,
               "opt_head": opt_head}
        new = tree_select(valid, new, {k: state[k] for k in new})
        outbox = {"act": out, "label": labels, "valid": valid}
        if heads.needs_image:
            outbox["image"] = images
        if num_stages > 1:
            outbox = lax.ppermute(outbox, "stage", [(j, j + 1) for j in range(num_stages - 1)])
        new["inbox"] = outbox
        zero = jnp.zeros_like(loss)
        metrics = {"loss": jnp.where(valid, loss, zero), "accuracy": jnp.where(valid, acc, zero), "valid": valid}
        return new, jax.tree.map(lambda m: m[None], metrics)

    def local_ticks(state, images, labels, fed):
        state, metrics = lax.scan(tick, carriers.squeeze(state), (images, labels, fed))
        return carriers.unsqueeze(state), metrics

    def run(state, images, labels, fed):
        specs = state_specs(state)
        feed = P(None, "data") if data else P()
        sharded = jax.shard_map(local_ticks, mesh=mesh, in_specs=(specs, feed, feed, P()),
                                out_specs=(specs, P(None, "stage")), check_vma=True)
        return sharded(state, images, labels, fed)

    def summary(metrics):
        """Per-tick metrics `[T, K]`; the network's own loss is the last stage's (0 while it has
        no batch yet)."""
        return {"loss": metrics["loss"][:, last], "accuracy": metrics["accuracy"][:, last],
                "stage_loss": metrics["loss"], "stage_valid": metrics["valid"]}

    def one_tick(state, image, label, fed):
        """One tick: `image`, `label` enter stage 0 as a batch when `fed`, as nothing otherwise."""
        state, metrics = run(state, image[None], label[None], fed[None])
        return state, jax.tree.map(lambda m: m[0], summary(metrics))

    def many_ticks(state, batches):
        ticks = batches["label"].shape[0]
        state, metrics = run(state, batches["image"], batches["label"], jnp.ones((ticks,), bool))
        return state, summary(metrics)

    tick_fn = jax.jit(one_tick, donate_argnums=0)
    feed_sharding = NamedSharding(mesh, P("data") if data else P())  # the trainer's default placement
    run_ticks = jax.jit(many_ticks, donate_argnums=0)

    def train_step(state, batch):
        batch = jax.device_put(batch, feed_sharding)  # a no-op for the trainer's batches
        return tick_fn(state, batch["image"], batch["label"], jnp.ones((), bool))

    def flush(state):
        # The same compiled tick, K-1 times, with nothing fed.
        image = jax.device_put(jnp.zeros((groups * batch, *image_shape)), feed_sharding)
        label = jax.device_put(jnp.zeros((groups * batch,), jnp.int32), feed_sharding)
        for _ in range(num_stages - 1):
            state, _ = tick_fn(state, image, label, jnp.zeros((), bool))
        return state

    def export(state):
        return carrier.unpack_params(state["body"]), carrier.unpack_state(state["model_state"])

    report = carrier.padding_report()
    print(f"ppll: {num_stages} stages x {groups} data groups; {carriers.format_report(report)}")
    info = {"heads": heads, "padding": report, "run_ticks": run_ticks, "tick": tick_fn,
            "export_heads": lambda state: head_layout.unpack(state["head"])}
    return Method("ppll", net, init, train_step, export, flush=flush, run_steps=run_ticks, carrier=carrier,
                  devices=num_stages * groups, info=info)
