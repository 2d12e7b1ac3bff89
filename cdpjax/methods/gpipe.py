"""`gpipe`: the backprop pipeline baseline (GPipe) on the `stage` axis.

Timing: K stages, one per device of the `stage` axis; the global batch is cut
into M = `microbatches` micro-batches. Forward fill: at tick t stage j runs the
forward of micro-batch t-j and stashes its input (M+K-1 ticks). Backward
drain: at tick s stage j runs the backward of micro-batch s-(K-1-j),
recomputing its forward from the stashed input (`jax.vjp` inside the switch
branch), and hands the input cotangent to stage j-1 (M+K-1 ticks). Then the
pipeline is empty (the flush): every step pays 2(K-1) idle ticks per device
out of 2(M+K-1), the bubble that PPLL and CDP avoid. M=1 is plain model
parallelism without micro-batches, the "conventional pipeline" of PPLL's code.

Update rule: exactly backprop's. The gradient is the sum over micro-batches of
the gradients of (micro-batch mean loss) / M, i.e. the gradient of the mean
loss over the batch; one update per step with one optax state per stage, the
same as `e2e` (BatchNorm statistics are per micro-batch, as in GPipe).

SPMD realisation: one `shard_map`, two `lax.scan`s over ticks, and
`lax.switch(axis_index('stage'))` over the stage carrier; the forward output
is `ppermute`d to stage j+1 and the cotangent to stage j-1 after the switch.
With a `data` axis each data group runs its own pipeline on its slice of the
batch and gradients are averaged over `data`. Residuals: `recompute` only.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from cdpjax import carrier as carriers
from cdpjax import models, optim
from cdpjax.errors import ConfigError
from cdpjax.methods.common import Context, Method, varying
from cdpjax.methods.ppll import check_mesh, net_stages


def build(ctx: Context) -> Method:
    cfg = ctx.config
    num_stages, groups = check_mesh(ctx, "gpipe")
    net_stages(ctx, "gpipe", num_stages)
    if cfg.get("residuals", "recompute") != "recompute":
        raise ConfigError(f"gpipe implements residuals='recompute' only (backward recomputes each stage "
                          f"from its stashed input), got residuals={cfg.residuals!r}")
    micro_count = int(cfg.microbatches)
    batch = cfg.global_batch_size // groups
    ctx.require_divisible("global_batch_size / mesh.data", batch, micro_count, "microbatches")
    micro = batch // micro_count
    net = ctx.net()
    tx = ctx.optimizer()
    mesh = ctx.mesh
    carrier = carriers.StageCarrier.from_net(net, micro)
    data = "data" in mesh.axis_names
    axes = ("stage", "data") if data else ("stage",)
    last = num_stages - 1
    ticks = micro_count + num_stages - 1
    last_has_state = carrier.model_state.sizes[last] > 0

    def init(rng):
        params, model_state = net.init(rng)
        params = carrier.pack_params(params)
        state = {"params": params, "model_state": carrier.pack_state(model_state),
                 "opt_state": carriers.init_opt(tx, params)}
        return jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), carriers.stage_specs(state)))

    def forward(j, params, model_state, x):
        """Stage j's forward of one micro-batch: its output buffer and new model state."""
        if j == last and not last_has_state:  # the loss is computed in the backward recompute
            return jnp.zeros_like(x), model_state
        y, new_state = net.apply_stage(j, carrier.params.unpack_one(j, params),
                                       carrier.model_state.unpack_one(j, model_state), carrier.unpack_act(j, x), True)
        out = carrier.pack_act(j + 1, y) if j < last else jnp.zeros_like(x)
        return out, carrier.model_state.pack_one(j, new_state)

    def backward(j, params, model_state, x, cotangent, labels):
        """Stage j's backward of one micro-batch by recomputation: parameter gradient, input cotangent."""
        p = carrier.params.unpack_one(j, params)
        s = carrier.model_state.unpack_one(j, model_state)
        x_in = carrier.unpack_act(j, x)

        def run(p, x_in):
            return net.apply_stage(j, p, s, x_in, True)[0]

        if j == last:
            def micro_loss(p, x_in):
                logits = run(p, x_in)
                return models.cross_entropy(logits, labels) / micro_count, models.accuracy(logits, labels)

            (loss, acc), (g, g_x) = jax.value_and_grad(micro_loss, argnums=(0, 1), has_aux=True)(p, x_in)
        else:
            _, pullback = jax.vjp(run, p, x_in)
            g, g_x = pullback(carrier.unpack_act(j + 1, cotangent))
            loss = acc = jnp.zeros((), jnp.float32)
        g_x = carrier.pack_act(j, g_x) if j > 0 else jnp.zeros_like(x)
        return carrier.params.pack_one(j, g), g_x, loss, acc

    def local_grads(state, images, labels):
        """One step's gradient row on this device (its stage, its data group's slice)."""
        stage = lax.axis_index("stage")
        images = images.reshape(micro_count, micro, *images.shape[1:])
        labels = labels.reshape(micro_count, micro)
        # Replicated over `data`, the rows enter the switch varying so that the gradients stay
        # per data group there; the average over `data` (a collective) comes after.
        params, model_state = varying((state["params"], state["model_state"]), axes)
        zeros = varying(jnp.zeros((micro, carrier.acts.width)), axes)

        def fill(carry, t):
            inbox, stash, model_state = carry
            m = t - stage
            active = (m >= 0) & (m < micro_count)
            m = jnp.clip(m, 0, micro_count - 1)
            x = jnp.where(stage == 0, carrier.pack_act(0, images[m]), inbox)
            stash = stash.at[m].set(jnp.where(active, x, stash[m]))
            out, new_state = carrier.switch(forward, params, model_state, x, axes=axes)
            model_state = jnp.where(active, new_state, model_state)
            inbox = lax.ppermute(out, "stage", [(j, j + 1) for j in range(last)]) if last else out
            return (inbox, stash, model_state), None

        stash = varying(jnp.zeros((micro_count, micro, carrier.acts.width)), axes)
        (_, stash, model_state), _ = lax.scan(fill, (zeros, stash, model_state), jnp.arange(ticks))

        def drain(carry, s):
            inbox, grads, loss, acc = carry
            m = s - (last - stage)
            active = (m >= 0) & (m < micro_count)
            m = jnp.clip(m, 0, micro_count - 1)
            g, g_x, l, a = carrier.switch(backward, params, model_state, stash[m], inbox, labels[m], axes=axes)
            grads = grads + jnp.where(active, g, 0.0)
            loss, acc = loss + jnp.where(active, l, 0.0), acc + jnp.where(active, a, 0.0)
            inbox = lax.ppermute(g_x, "stage", [(j, j - 1) for j in range(1, num_stages)]) if last else g_x
            return (inbox, grads, loss, acc), None

        start = (zeros, jnp.zeros_like(params), *varying((jnp.zeros(()), jnp.zeros(())), axes))
        (_, grads, loss, acc), _ = lax.scan(drain, start, jnp.arange(ticks))
        loss, acc = lax.psum((loss, acc / micro_count), "stage")  # only the last stage's are nonzero
        if data:
            grads, model_state, loss, acc = lax.pmean((grads, model_state, loss, acc), "data")
        return grads, model_state, {"loss": loss, "accuracy": acc}

    def local_step(state, images, labels):
        st = carriers.squeeze(state)
        grads, model_state, metrics = local_grads(st, images, labels)
        params, opt_state = optim.apply(tx, st["params"], st["opt_state"], grads)
        new = {"params": params, "model_state": model_state, "opt_state": opt_state}
        return carriers.unsqueeze(new), metrics

    feed = P("data") if data else P()

    def train_step(state, batch):
        specs = carriers.stage_specs(state)
        step = jax.shard_map(local_step, mesh=mesh, in_specs=(specs, feed, feed),
                             out_specs=(specs, P()), check_vma=True)
        return step(state, batch["image"], batch["label"])

    def gradients(state, batch):
        """The step's gradient per stage (StagedNet layout), for the equality tests."""
        specs = carriers.stage_specs(state)
        grad_rows = jax.shard_map(lambda s, x, y: local_grads(carriers.squeeze(s), x, y)[0][None], mesh=mesh,
                                  in_specs=(specs, feed, feed), out_specs=P("stage"), check_vma=True)
        return carrier.unpack_params(grad_rows(state, batch["image"], batch["label"]))

    def export(state):
        return carrier.unpack_params(state["params"]), carrier.unpack_state(state["model_state"])

    report = carrier.padding_report()
    print(f"gpipe: {num_stages} stages x {groups} data groups, {micro_count} micro-batches of {micro}; "
          f"{carriers.format_report(report)}")
    info = {"padding": report, "gradients": jax.jit(gradients), "ticks": 2 * ticks,
            "bubble": (num_stages - 1) / ticks}
    return Method("gpipe", net, init, jax.jit(train_step, donate_argnums=0), export, carrier=carrier,
                  devices=num_stages * groups, info=info)
