"""`cdp-mp`: cyclic data parallelism with model parallelism (the cyclic pipeline).

Timing (`cdpjax.timetable.cdp_mp_table`: the CDP table of N = L workers with every
op moved to the device of its stage). Stage j lives on device j of the `stage`
axis. Worker i's micro-batch of step k enters stage 0 at tick 2i + 2Lk, runs the
forwards of stages 0..L-1 on devices 0..L-1 at consecutive ticks, then the
backwards of stages L-1..0 back down. With N = L every stage is used by exactly
one worker at every tick, so in steady state every device runs exactly ONE op per
tick, a forward when tick - j is even and a backward when it is odd (one forward
and one backward per tick would take N = 2L): busy fraction 1.0, and no fill,
drain or flush between steps. At the end of every tick the forward output goes to
stage j+1 and the input cotangent to stage j-1: two `ppermute`s (shifts +1 and -1
on `stage`) after the switch, of one micro-batch's padded activation each.

Update rule: CDP's, with the staleness of `config.cdp_rule` ('cdp-v2', default, or
'cdp-v1'), one optax state per stage, two stored versions per stage (current,
previous). Each op reads the version the table's `slot` names (a backward reads
its forward's version). Stage j sums the gradients of the N micro-batches that
pass through it where it lives, and applies

    theta^j_{k+1} = opt^j(theta^j_k, sum_i g_i^j / N),  previous^j <- current^j

at the end of the tick the table gives (the last worker's backward of stage j).
No gradient crosses a device: there is no gradient communication at all, only
activations and cotangents move, one hop per tick. After S steps and a flush the
parameters equal `cdp_impl='simulate'` of the same rule with workers = L after S
steps. BatchNorm (norm='batch'): statistics per micro-batch; running averages as in
simulate, the mean over the step's micro-batches of each one's update from the same
starting value (every forward of step k on stage j starts from the averages of step
k; their mean update lands just before the stage's first forward of step k+1).

Residuals (`config.residuals`): 'recompute' stashes each micro-batch's stage input
at its forward and reruns the stage under `jax.vjp` at its backward; 'carry'
stashes the residuals of the forward's `jax.vjp` but the stage's own parameters
(raveled, zero-padded to the largest stage's; the backward takes the parameters
from the slot its forward read) and the backward only runs the pullback, rebuilt
on the structure of a template vjp traced in the same branch. Both give the same
parameters; `info['padding']` and `cdpjax bench` give their memory (measured: on
CPU, carry stores 4 to 14 times more per device and is faster for a ResNet, slower
for a ViT; recompute is the default).

SPMD realisation: one `shard_map`, `lax.scan` over the 2L ticks of the table's
steady-state period (each device reads its column with `axis_index('stage')`),
one `lax.switch` per tick over [idle, forward of stage j, backward of stage j] on
the uniform carrier (`cdpjax.carrier`: parameters, optimizer and model state as
padded rows sharded `P('stage')`, activations as padded buffers), the optimizer
on the padded row outside the switch. One `train_step` = one period: it feeds the
N micro-batches of one global batch and finishes the previous step's, so the
in-flight state (stashes, labels, the activation and cotangent inboxes, gradient
sums, both versions) lives in the train state. `flush(state)` runs one period with
nothing fed (its ops of the unfed step are idle, updates masked), so that the
parameters account for every batch fed; training on after a flush restarts the
cycle from the flushed parameters. `info['run_steps'](state, batches)` scans over
S periods in one program (compile time does not grow with S); `info['run']` is the
one jitted program behind all three. A call's metrics are those of the
micro-batches whose loss was computed in it. The whole global batch reaches every
device (stage 0 reads the images, every device keeps the labels).

With a `data` axis, each data group runs its own cyclic pipeline on its slice of
the batch, and at every tick where some stage updates every device all-reduces its
stage's gradient sum over `data` (zeros where its stage does not update): data
parallelism over pipelines, the only case with gradient traffic.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.flatten_util import ravel_pytree
from jax.sharding import NamedSharding, PartitionSpec as P

from cdpjax import carrier as carriers
from cdpjax import models, optim
from cdpjax.errors import ConfigError
from cdpjax.methods.common import Context, Method, tree_select, varying
from cdpjax.methods.ppll import check_mesh, net_stages
from cdpjax.layouts.cdp_mp import cdp_mp_table

RULES = ("cdp-v2", "cdp-v1")
RESIDUALS = ("recompute", "carry")
FORWARD, BACKWARD = 0, 1


@functools.lru_cache(maxsize=32)
def _program(rule: str, stages: int) -> dict:
    L, T, m = stages, 2 * stages, 2
    table = cdp_mp_table(L, steps=4, rule=rule)
    lo = m * T  # steps 1 and 2 only: no step-0 special case leaks in
    kind = np.full((T, L), -1, np.int32)
    worker = np.zeros((T, L), np.int32)
    slot = np.zeros((T, L), np.int32)
    step = np.zeros((T, L), np.int32)
    update = np.zeros((T, L), bool)
    update_step = np.zeros((T, L), np.int32)
    feed = np.full((T,), -1, np.int32)
    for op in table.ops:
        if lo <= op.tick < lo + T:
            t, j = op.tick - lo, op.device
            if kind[t, j] >= 0:
                raise AssertionError(f"cdp-mp L={L}: device {j} has two ops at tick {t}")
            kind[t, j] = FORWARD if op.kind == "F" else BACKWARD
            worker[t, j], slot[t, j], step[t, j] = op.micro, int(op.slot == "previous"), op.step - m
            if op.kind == "F" and op.stage == 0:
                feed[t] = op.micro
    if np.any(kind < 0):
        raise AssertionError(f"cdp-mp L={L}: a device idles in steady state")
    for u in table.updates:
        if lo <= u.tick < lo + T:
            update[u.tick - lo, u.stage] = True
            update_step[u.tick - lo, u.stage] = u.step - m
    if np.any(feed[feed >= 0] != np.arange(L)) or np.any(step[feed >= 0, 0] != 0):
        raise AssertionError(f"cdp-mp L={L}: worker i's micro-batch must enter stage 0 at tick 2i of its period")
    return {"kind": kind, "worker": worker, "slot": slot, "step": step, "update": update,
            "update_step": update_step, "feed": feed, "any_update": update.any(1).astype(np.int32)}


def period_program(rule: str, stages: int) -> dict[str, np.ndarray]:
    """One steady-state period (2L ticks) of `cdp_mp_table(stages, rule=rule)` as arrays
    for the SPMD scan, indexed [tick, device] unless noted; a period starts at worker 0's
    new step:
      kind: 0 forward, 1 backward (every device has an op at every tick).
      worker: whose micro-batch it is. slot: 0 current, 1 previous version.
      step: 0 the step fed in this period, -1 the previous one.
      update: the device's stage updates at the end of the tick; update_step: 0 / -1.
      feed [tick]: the worker whose micro-batch enters stage 0 at this tick, -1 none.
      any_update [tick]: some stage updates at the end of the tick (1) or none (0).
    """
    if rule not in RULES:
        raise ConfigError(f"cdp_rule={rule!r} is not one of {', '.join(RULES)}")
    return {k: v.copy() for k, v in _program(rule, int(stages)).items()}


def _flat_size(tree) -> int:
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(tree)))


def build(ctx: Context) -> Method:
    cfg = ctx.config
    num_stages, groups = check_mesh(ctx, "cdp-mp")
    net_stages(ctx, "cdp-mp", num_stages)
    rule = cfg.get("cdp_rule", "cdp-v2")
    if rule not in RULES:
        raise ConfigError(f"cdp_rule={rule!r} is not one of {', '.join(RULES)}")
    residuals = cfg.get("residuals", "recompute")
    if residuals not in RESIDUALS:
        raise ConfigError(f"residuals={residuals!r} is not one of {', '.join(RESIDUALS)}")
    L = N = num_stages
    if int(cfg.get("workers", 0)) not in (0, N):
        raise ConfigError(f"cdp-mp runs N = L workers, one per stage device: workers={cfg.workers} must be "
                          f"0 or mesh.stage={N}")
    batch = cfg.global_batch_size // groups
    ctx.require_divisible("global_batch_size / mesh.data", batch, N, "workers (= mesh.stage)")
    micro = batch // N
    net = ctx.net()
    tx = ctx.optimizer()
    mesh = ctx.mesh
    carrier = carriers.StageCarrier.from_net(net, micro)
    data = "data" in mesh.axis_names
    axes = ("stage", "data") if data else ("stage",)
    last = L - 1
    has_state = max(carrier.model_state.sizes) > 0
    share = 1.0 / (N * groups)  # the sum of the N x groups micro-batch gradients is then their mean
    image_shape = tuple(net.input_shape)
    program = period_program(rule, L)

    # ------------------------------------------------------------- one stage's vjp

    def stage_vjp(j, p, model_state, x, labels):
        """Stage j's output (last stage: its share of the loss), pullback and (new model state, loss, accuracy)."""
        def run(p, x):
            y, new_state = net.apply_stage(j, p, model_state, x, True)
            if j == last:
                loss = models.cross_entropy(y, labels)
                return loss * share, (new_state, loss, models.accuracy(y, labels))
            zero = jnp.zeros((), jnp.float32)
            return y, (new_state, zero, zero)

        if j == 0:  # the image needs no cotangent
            return jax.vjp(lambda p: run(p, x), p, has_aux=True)
        return jax.vjp(run, p, x, has_aux=True)

    abstract_params, abstract_state = jax.eval_shape(lambda: net.init(jax.random.key(0)))

    def abstract_inputs(j):
        x = jax.ShapeDtypeStruct((micro, *carrier.acts.shapes[j]), jnp.float32)
        return abstract_params[j], abstract_state[j], x, jax.ShapeDtypeStruct((micro,), jnp.int32)

    def split_residuals(pullback, p):
        """The pullback's leaves, its structure, and which leaves are stashed: all but the
        stage's own parameters, which the backward reads from the slot its forward read."""
        own = {id(q) for q in jax.tree.leaves(p)}
        leaves, structure = jax.tree.flatten(pullback)
        return leaves, structure, [i for i, leaf in enumerate(leaves) if id(leaf) not in own]

    def traced_residual_sizes():
        """Per stage, the stashed residuals of one micro-batch's vjp, counted inside `shard_map`
        with device-varying inputs as in the tick (outside it, a few scalars differ)."""
        sizes = []

        def probe():
            for j in range(L):
                p, s, x, labels = jax.tree.map(lambda a: varying(jnp.zeros(a.shape, a.dtype), axes),
                                               abstract_inputs(j))
                leaves, _, stashed = split_residuals(stage_vjp(j, p, s, x, labels)[1], p)
                sizes.append(_flat_size([leaves[i] for i in stashed]))
            return varying(jnp.zeros((1,)), axes)

        jax.eval_shape(jax.shard_map(probe, mesh=mesh, in_specs=(), out_specs=P(axes), check_vma=True))
        return tuple(sizes)

    if residuals == "carry":
        residual_sizes = traced_residual_sizes()
        stash_width = max(1, *residual_sizes)
    else:
        residual_sizes = tuple(micro * math.prod(s) for s in carrier.acts.shapes)
        stash_width = micro * carrier.acts.width

    def check_residuals(j, size):
        if size != residual_sizes[j]:  # the stash layout would not be the one the backward reads
            raise AssertionError(f"cdp-mp stage {j}: {size} residuals in the tick, {residual_sizes[j]} counted")

    # --------------------------------------------- the switch's branches (no collectives)
    # Operands: (params, model_state, image, act_in, cot_in, stash_row, labels), all rows
    # padded. Results: (stash_row, model_state, act_out, cot_out, gradient, loss, correct, counted).

    width = carrier.acts.width
    zeros_act = lambda: jnp.zeros((micro, width), jnp.float32)  # noqa: E731
    zeros_grad = lambda: jnp.zeros((carrier.params.width,), jnp.float32)  # noqa: E731
    scalar = lambda v=0.0: jnp.asarray(v, jnp.float32)  # noqa: E731

    def idle(params, ms, image, act_in, cot_in, stash_row, labels):
        return stash_row, ms, zeros_act(), zeros_act(), zeros_grad(), scalar(), scalar(), scalar()

    def unpacked(j, params, ms):
        return carrier.params.unpack_one(j, params), carrier.model_state.unpack_one(j, ms)

    def forward(j):
        def branch(params, ms, image, act_in, cot_in, stash_row, labels):
            p, s = unpacked(j, params, ms)
            x_buf = carrier.pack_act(0, image) if j == 0 else act_in
            x = carrier.unpack_act(j, x_buf)
            loss = correct = counted = scalar()
            if residuals == "recompute":
                stash_row = x_buf.reshape(-1)
                if j == last and carrier.model_state.sizes[j] == 0:
                    return stash_row, ms, zeros_act(), zeros_act(), zeros_grad(), loss, correct, counted
                y, new_state = net.apply_stage(j, p, s, x, True)
            else:
                y, pullback, (new_state, loss_j, acc_j) = stage_vjp(j, p, s, x, labels)
                leaves, _, stashed = split_residuals(pullback, p)
                flat, _ = ravel_pytree([leaves[i] for i in stashed])
                check_residuals(j, flat.size)
                stash_row = jnp.pad(flat.astype(jnp.float32), (0, stash_width - flat.size))
                if j == last:
                    loss, correct, counted = loss_j, acc_j, scalar(1.0)
            act_out = carrier.pack_act(j + 1, y) if j < last else zeros_act()
            ms = carrier.model_state.pack_one(j, new_state)
            return stash_row, ms, act_out, zeros_act(), zeros_grad(), loss, correct, counted
        return branch

    def backward(j):
        def branch(params, ms, image, act_in, cot_in, stash_row, labels):
            p, s = unpacked(j, params, ms)
            seed = varying(scalar(1.0), axes) if j == last else carrier.unpack_act(j + 1, cot_in)
            loss = correct = counted = scalar()
            if residuals == "recompute":  # BatchNorm's running averages are the forward's to update
                x = carrier.unpack_act(j, stash_row.reshape(micro, width))
                _, pullback, (_, loss_j, acc_j) = stage_vjp(j, p, s, x, labels)
                if j == last:
                    loss, correct, counted = loss_j, acc_j, scalar(1.0)
            else:
                # A template pullback traced here on a stand-in input gives the structure; its
                # stashed leaves are replaced by the forward's (the unused rest is dead code).
                stand_in = carrier.unpack_act(j, act_in)
                leaves, structure, stashed = split_residuals(stage_vjp(j, p, s, stand_in, labels)[1], p)
                _, unravel = ravel_pytree([leaves[i] for i in stashed])
                size = _flat_size([leaves[i] for i in stashed])
                check_residuals(j, size)
                for i, leaf in zip(stashed, unravel(stash_row[:size])):
                    leaves[i] = leaf
                pullback = jax.tree.unflatten(structure, leaves)
            cotangents = pullback(seed)
            gradient = carrier.params.pack_one(j, cotangents[0])
            cot_out = carrier.pack_act(j, cotangents[1]) if j > 0 else zeros_act()
            return stash_row, ms, zeros_act(), cot_out, gradient, loss, correct, counted
        return branch

    branches = [idle] + [forward(j) for j in range(L)] + [backward(j) for j in range(L)]
    branches = [lambda *ops, b=b: varying(b(*ops), axes) for b in branches]

    # ------------------------------------------------------------------ one tick

    def update_stage(params, previous, opt, gradient):
        new, opt = optim.apply(tx, params, opt, gradient)
        return new, params, opt

    def keep(params, previous, opt, gradient):
        return params, previous, opt

    def tick(c, x, feeding, images, new_labels):
        me = lax.axis_index("stage")
        kind, worker, slot, step = x["kind"][me], x["worker"][me], x["slot"][me], x["step"][me]
        valid = jnp.where(step == 0, feeding, c["inflight"])
        # The labels of a micro-batch reach every device with the batch; stored as it enters stage 0.
        fed = jnp.maximum(x["feed"], 0)
        labels = jnp.where((x["feed"] >= 0) & feeding, c["labels"].at[fed].set(new_labels[fed]), c["labels"])
        read = jnp.where(slot == 1, c["previous"], c["params"])
        ms, state_sums = c["model_state"], c["state_sums"]
        if has_state:  # the previous step's mean update lands before this step's first forward
            first = valid & (kind == FORWARD) & (worker == 0)
            ms = jnp.where(first, ms + state_sums, ms)
            state_sums = jnp.where(first, jnp.zeros_like(state_sums), state_sums)
        index = jnp.where(valid, 1 + me + L * kind, 0)
        stash_row, new_ms, act_out, cot_out, gradient, loss, correct, counted = lax.switch(
            index, branches, *varying((read, ms), axes), images[worker], c["act_in"],
            c["cot_in"], c["stash"][worker], labels[worker])
        stash = c["stash"].at[worker].set(stash_row)
        if has_state:  # every forward of a step starts from the same running averages, as in simulate
            update = (new_ms - ms) / N
            state_sums = state_sums + (lax.pmean(update, "data") if data else update)
        sums = c["sums"] + gradient
        metrics = c["metrics"] + jnp.stack([loss, correct, counted])
        if L > 1:
            act_in = lax.ppermute(act_out, "stage", [(j, j + 1) for j in range(L - 1)])
            cot_in = lax.ppermute(cot_out, "stage", [(j, j - 1) for j in range(1, L)])
        else:
            act_in, cot_in = act_out, cot_out
        total = sums
        if data:  # sum over data groups, at ticks where some stage updates (a loop, not a branch)
            total = lax.fori_loop(0, x["any_update"], lambda _, acc: lax.psum(sums, "data"),
                                  varying(jnp.zeros((carrier.params.width,), jnp.float32), "stage"))
        apply = x["update"][me] & jnp.where(x["update_step"][me] == 0, feeding, c["inflight"])
        params, previous, opt = lax.cond(apply, update_stage, keep, c["params"], c["previous"], c["opt_state"],
                                         total)
        sums = jnp.where(apply, jnp.zeros_like(sums), sums)
        new = dict(c, params=params, previous=previous, opt_state=opt, model_state=ms, state_sums=state_sums,
                   sums=sums, stash=stash, labels=labels, act_in=act_in, cot_in=cot_in, metrics=metrics)
        return new, None

    def period(state, step_batch):
        images, new_labels, feeding = step_batch
        images = images.reshape(N, micro, *image_shape)
        new_labels = new_labels.reshape(N, micro)
        carry = dict(state, metrics=varying(jnp.zeros((3,), jnp.float32), axes))
        carry, _ = lax.scan(lambda c, x: tick(c, x, feeding, images, new_labels), carry,
                            jax.tree.map(jnp.asarray, program))
        metrics = carry.pop("metrics")
        # After a flush both slots hold the newest version, as at step 0.
        carry["previous"] = tree_select(feeding, carry["previous"], carry["params"])
        carry["inflight"] = jnp.logical_and(jnp.ones_like(carry["inflight"]), feeding)
        loss, correct, counted = lax.psum(metrics, axes)  # three scalars: the only all-reduce
        counted = jnp.maximum(counted, 1.0)
        return carry, {"loss": loss / counted, "accuracy": correct / counted}

    # Per data group: what is in flight, and the group's part of each stage's gradient sum.
    inflight_keys = ("stash", "labels", "act_in", "cot_in", "sums")

    def local_run(state, images, labels, feeding):
        s = carriers.squeeze(state)
        s.update({k: s[k][0] for k in inflight_keys})  # this data group's block
        s, metrics = lax.scan(period, s, (images, labels, feeding))
        s.update({k: s[k][None] for k in inflight_keys})
        return carriers.unsqueeze(s), metrics

    def specs_of(state):
        specs = carriers.stage_specs(state)
        for k in inflight_keys:
            specs[k] = P("stage", "data") if data else P("stage", None)
        return specs

    def initial_state(rng):
        params, model_state = net.init(rng)
        rows = carrier.pack_params(params)
        state = {
            "params": rows,
            "previous": jnp.copy(rows),  # step 0 reads theta_0 from either slot
            "opt_state": carriers.init_opt(tx, rows),
            "model_state": carrier.pack_state(model_state),
            "state_sums": jnp.zeros_like(carrier.pack_state(model_state)),  # a step's mean running-average update
            "inflight": jnp.zeros((L,), bool),
            "sums": jnp.zeros((L, groups, carrier.params.width), jnp.float32),
            "stash": jnp.zeros((L, groups, N, stash_width), jnp.float32),
            "labels": jnp.zeros((L, groups, N, micro), jnp.int32),
            "act_in": jnp.zeros((L, groups, micro, width), jnp.float32),
            "cot_in": jnp.zeros((L, groups, micro, width), jnp.float32),
        }
        return state

    shapes = jax.eval_shape(initial_state, jax.random.key(0))
    init = jax.jit(initial_state, out_shardings=jax.tree.map(lambda s: NamedSharding(mesh, s), specs_of(shapes)))

    batch_spec = P(None, "data") if data else P()

    def run(state, images, labels, feeding):
        """S periods: images [S, B, ...], labels [S, B], feeding [S] bool."""
        specs = specs_of(state)
        sharded = jax.shard_map(local_run, mesh=mesh, in_specs=(specs, batch_spec, batch_spec, P()),
                                out_specs=(specs, P()), check_vma=True)
        return sharded(state, images, labels, feeding)

    # One program serves train_step, flush and run_steps (S = 1 for the first two): `feeding`
    # is an argument, not a constant.
    run_jit = jax.jit(run, donate_argnums=0)

    def train_step(state, batch):
        state, metrics = run_jit(state, batch["image"][None], batch["label"][None], np.ones((1,), bool))
        return state, jax.tree.map(lambda m: m[0], metrics)

    def run_steps(state, batches):
        """S steps in one call: batches {'image': [S, B, ...], 'label': [S, B]} -> (state, metrics [S])."""
        return run_jit(state, batches["image"], batches["label"], np.ones((batches["label"].shape[0],), bool))

    def flush(state):
        images = np.zeros((1, cfg.global_batch_size, *image_shape), np.float32)
        labels = np.zeros((1, cfg.global_batch_size), np.int32)
        return run_jit(state, images, labels, np.zeros((1,), bool))[0]

    @jax.jit
    def export(state):
        # The last step's running-average update is pending until the next step starts.
        return carrier.unpack_params(state["params"]), carrier.unpack_state(state["model_state"] + state["state_sums"])

    table = cdp_mp_table(L, steps=3, rule=rule)
    report = carrier.padding_report()
    report["stash"] = L * stash_width / max(sum(residual_sizes), 1)
    report["stash_sizes"] = list(residual_sizes)
    print(f"cdp-mp: {L} stages = {N} workers on {L} devices x {groups} data groups, rule {rule}, "
          f"residuals {residuals}; {carriers.format_report(report)}")
    info = {"dp_mp_devices": N * L * groups, "rule": rule, "residuals": residuals, "padding": report,
            "stash_width": stash_width, "run": run_jit}
    return Method("cdp-mp", net, init, train_step, export, flush=flush, table=table, run_steps=run_steps,
                  carrier=carrier, stale=table.stale, workers=N, devices=L * groups, state_depends_on_mesh=True,
                  info=info)
