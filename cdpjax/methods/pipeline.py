"""The tick runtime: every stage-axis layout runs from its time table through this module.

gpipe, 1f1b, interleaved-1f1b, cdp-mp and ppll differ in their tables (and in a
few declared rules); the program is this one. Per tick each device of the
`stage` axis reads its op from the table's program (`cdpjax.methods.program`),
runs it behind the stage carrier, and the transfers follow the table:

- **Ops.** 'F': a unit's forward of one micro-batch (its input kept to recompute
  the backward, or its `jax.vjp` residuals kept with `residuals='carry'`). 'B':
  the backward, seeded by the loss (last stage) or by the cotangent the next
  unit's backward sent; its parameter gradient accumulates until the unit's
  update. 'FB' (local learning): each module of the unit runs forward and its
  local backward through its auxiliary head; no gradient leaves the unit.
- **Transfers.** After every tick one `ppermute` carries each forward's output
  (with the micro-batch's labels, and its image for heads that reconstruct it)
  to the next unit's device, and one carries each backward's input cotangent
  back; the receiver stores them in the slots the program names.
- **Updates.** At the ticks the table gives, a unit applies its optax update to
  its accumulated gradient (averaged over `data` groups first), keeping the
  previous version where the table reads it (cdp-mp).

Update rule: that of the table. A flushed layout (gpipe, 1f1b, interleaved-1f1b)
updates every stage once per step with the gradient of the batch's mean loss:
backprop's, so it equals `e2e`. cdp-mp updates stage j when its last worker's
backward ends, reading the versions of CDP's table: it equals CDP `simulate`
with N = L workers. ppll updates every module at every tick from its local
loss: it equals sequential `local`.

SPMD realisation: one `shard_map` over (`stage`, `data`), a `lax.scan` over the
ticks of one period inside a `lax.scan` over the steps of a call, one
`lax.switch` per tick over [idle, F of unit u..., B of unit u...] (or [idle, FB
of unit u...]) on the uniform carrier (`cdpjax.carrier`: parameters, optimizer
and model state as padded rows, a device's units as its rows), collectives
outside the switch. A period's ops that belong to the previous steps (cdp-mp,
ppll) find their inputs in the train state, so one `train_step` feeds one batch
and in-flight work resumes from checkpoints; `flush` runs the periods that
finish it with nothing fed.

BatchNorm running averages (`model_state`): 'sequential' applies each forward's
update in tick order (gpipe: micro-batch by micro-batch); 'step_mean' (cdp-mp)
averages the step's updates taken from the same starting value and applies the
mean before the stage's first forward of the next step, as CDP `simulate` does.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.flatten_util import ravel_pytree
from jax.sharding import NamedSharding, PartitionSpec as P

from cdpjax import carrier as carriers
from cdpjax import models, optim
from cdpjax.errors import ConfigError
from cdpjax.methods.common import Context, Method, varying
from cdpjax.methods.local import stage_grads
from cdpjax.methods.program import BACKWARD, FORWARD, LOCAL, Program, compile_table
from cdpjax.timetable import TimeTable

RESIDUALS = ("recompute", "carry")
MODEL_STATE = ("sequential", "step_mean")


@dataclasses.dataclass(frozen=True)
class Rules:
    """What a layout declares beyond its table.

    local: 'FB' ops with auxiliary heads (ppll) instead of F/B ops with backprop.
    model_state: 'sequential' or 'step_mean' (see the module docstring).
    residuals: 'recompute' or 'carry' (backprop layouts).
    """

    local: bool = False
    model_state: str = "sequential"
    residuals: str = "recompute"


def check_mesh(ctx: Context, method: str, devices: int) -> int:
    """The data groups of a pipeline on `stage` (x `data`) of `devices` stage devices; refuses what
    it cannot run, naming the mesh."""
    cfg = ctx.config
    ctx.require_axes(method, ("stage", "data"))
    if "stage" not in ctx.mesh.axis_names:
        raise ConfigError(f"method {method!r} needs a 'stage' mesh axis (mesh {dict(ctx.mesh.shape)}): set "
                          f"--config.mesh.stage={devices}")
    if ctx.axis("stage") != devices:
        raise ConfigError(f"{method}'s table runs on {devices} stage devices but mesh.stage={ctx.axis('stage')} "
                          f"(mesh {dict(ctx.mesh.shape)}): set --config.mesh.stage={devices} or leave the mesh out")
    groups = ctx.axis("data")
    if groups > 1 and cfg.get("norm", "none") == "batch" and cfg.get("bn_cross_device", True):
        raise ConfigError(f"{method} with mesh.data={groups} and norm='batch' would need a cross-device "
                          f"BatchNorm inside a pipeline stage: set bn_cross_device=False (statistics per "
                          f"data group) or norm='group'")
    ctx.require_divisible("global_batch_size", cfg.global_batch_size, groups, "mesh.data")
    return groups


@dataclasses.dataclass(frozen=True)
class _Layouts:
    """The carrier of one run: a flat layout per kind of per-unit row, the activation layout."""

    params: carriers.FlatLayout
    model_state: carriers.FlatLayout
    acts: carriers.ActLayout
    head: carriers.FlatLayout | None = None
    head_state: carriers.FlatLayout | None = None
    residual_width: int = 1

    def padding_report(self) -> dict:
        report = {"params": self.params.padding(), "model_state": self.model_state.padding(),
                  "activations": self.acts.padding(), "param_sizes": list(self.params.sizes),
                  "activation_sizes": [math.prod(s) for s in self.acts.shapes]}
        if self.head is not None:
            report.update(head=self.head.padding(), head_sizes=list(self.head.sizes))
        return report


def build(ctx: Context, method: str, table: TimeTable, rules: Rules = Rules(), shown: TimeTable | None = None,
          heads=None, optimizers: dict | None = None) -> Method:
    """The method `method` running `table` (laid out over enough steps for `program.period_window`).

    `heads`, `optimizers` ({'body': tx, 'head': tx}): local learning's auxiliary heads and
    optimizers (default: the config's optimizer for the bodies). `shown`: the table the
    method reports (a few steps), default `table`.
    """
    if rules.residuals not in RESIDUALS:
        raise ConfigError(f"residuals={rules.residuals!r} is not one of {', '.join(RESIDUALS)}")
    if rules.model_state not in MODEL_STATE:
        raise ValueError(f"model_state={rules.model_state!r} is not one of {', '.join(MODEL_STATE)}")
    carry = rules.residuals == "carry"
    if carry and rules.local:
        raise ConfigError(f"{method} has no backward to carry residuals to: use residuals='recompute'")
    program = compile_table(table, carry_residuals=carry)
    place = program.placement
    groups = check_mesh(ctx, method, place.devices)
    net = ctx.net(stages=ctx.config.stages)
    if net.num_stages != table.stages:
        raise ConfigError(f"{method}'s table has {table.stages} stages but stages={ctx.config.stages!r} cuts "
                          f"{net.name} into {net.num_stages}")
    batch = ctx.config.global_batch_size // groups
    ctx.require_divisible("global_batch_size / mesh.data", batch, program.microbatches,
                          "micro-batches per step" if not rules.local else "1")
    micro = batch // program.microbatches
    optimizers = optimizers or {"body": ctx.optimizer()}
    runtime = _Runtime(ctx, method, table, program, rules, net, heads, optimizers, groups, micro)
    return runtime.method(shown or table)


class _Runtime:
    """The pieces of one built layout (a class only to share the set-up; every piece is a pure function)."""

    def __init__(self, ctx, method, table, program: Program, rules: Rules, net, heads, optimizers, groups, micro):
        self.ctx, self.name, self.table, self.program, self.rules = ctx, method, table, program, rules
        self.net, self.heads, self.optimizers, self.groups, self.micro = net, heads, optimizers, groups, micro
        self.mesh = ctx.mesh
        self.data = "data" in self.mesh.axis_names
        self.axes = ("stage", "data") if self.data else ("stage",)
        place = program.placement
        self.units, self.U, self.V, self.D = place.units, len(place.units), place.chunks, place.devices
        # unit at (device, chunk), -1 where a device holds fewer units
        self.unit_at = np.full((self.D, self.V), -1, np.int32)
        for u in range(self.U):
            self.unit_at[place.device[u], place.chunk[u]] = u
        self.chunk_of = np.asarray(place.chunk, np.int32)
        self.image_shape = tuple(net.input_shape)
        self.layouts = self._layouts()
        self.lag = program.lag
        self.grads_in_flight = _grads_in_flight(program)

    # ------------------------------------------------------------------ layouts

    def _layouts(self) -> _Layouts:
        params, state = jax.eval_shape(lambda: self.net.init(jax.random.key(0)))
        per_unit = lambda tree: [[tree[j] for j in stages] for stages in self.units]  # noqa: E731
        inputs = [tuple(self.net.input_shape)] + [s[1:] for s in self.net.stage_output_shapes(1)[:-1]]
        acts = carriers.ActLayout.from_shapes([inputs[stages[0]] for stages in self.units])
        layouts = dict(params=carriers.FlatLayout.from_trees(per_unit(params)),
                       model_state=carriers.FlatLayout.from_trees(per_unit(state)), acts=acts)
        if self.heads is not None:
            head_params, head_state = jax.eval_shape(self.heads.init, jax.random.key(0))
            layouts.update(head=carriers.FlatLayout.from_trees(per_unit(head_params)),
                           head_state=carriers.FlatLayout.from_trees(per_unit(head_state)))
        if self.rules.residuals == "carry":
            layouts["residual_width"] = max(1, *self._residual_sizes())
        return _Layouts(**layouts)

    def rows(self, layout: carriers.FlatLayout, trees_per_unit) -> jax.Array:
        """[D, V, width]: each device's units as its rows (zeros where it holds fewer)."""
        zero = jnp.zeros((layout.width,), jnp.float32)
        return jnp.stack([jnp.stack([layout.pack_one(u, trees_per_unit[u]) if u >= 0 else zero for u in row])
                          for row in self.unit_at.tolist()])

    def unrows(self, layout: carriers.FlatLayout, rows) -> list:
        """Per stage, from [D, V, width] rows."""
        out = [None] * self.net.num_stages
        place = self.program.placement
        for u, stages in enumerate(self.units):
            for j, tree in zip(stages, layout.unpack_one(u, rows[place.device[u], place.chunk[u]])):
                out[j] = tree
        return out

    # ------------------------------------------------------------- one stage's vjp

    def stage_vjp(self, j, p, s, x, labels):
        """Stage j's output (last stage: its share of the mean loss), pullback, (new state, loss, accuracy)."""
        last = j == self.net.num_stages - 1
        scale = 1.0 / self.program.microbatches

        def run(p, x):
            y, new_state = self.net.apply_stage(j, p, s, x, True)
            if last:
                loss = models.cross_entropy(y, labels)
                return loss * scale, (new_state, loss, models.accuracy(y, labels))
            zero = jnp.zeros((), jnp.float32)
            return y, (new_state, zero, zero)

        if j == 0:  # the image needs no cotangent
            return jax.vjp(lambda p: run(p, x), p, has_aux=True)
        return jax.vjp(run, p, x, has_aux=True)

    @staticmethod
    def split_residuals(pullback, p):
        """The pullback's leaves, its structure, and which leaves are kept: all but the stage's own
        parameters, which the backward reads from the version its forward read."""
        own = {id(q) for q in jax.tree.leaves(p)}
        leaves, structure = jax.tree.flatten(pullback)
        return leaves, structure, [i for i, leaf in enumerate(leaves) if id(leaf) not in own]

    def _residual_sizes(self) -> list[int]:
        """Per unit, one micro-batch's kept residuals, counted inside `shard_map` with device-varying
        inputs as in the tick (outside it, a few scalars differ)."""
        params, state = jax.eval_shape(lambda: self.net.init(jax.random.key(0)))
        inputs = [tuple(self.net.input_shape)] + [s[1:] for s in self.net.stage_output_shapes(1)[:-1]]
        sizes = []

        def probe():
            for (j,) in self.units:
                p, s, x, y = jax.tree.map(lambda a: varying(jnp.zeros(a.shape, a.dtype), self.axes), (
                    params[j], state[j], jax.ShapeDtypeStruct((self.micro, *inputs[j]), jnp.float32),
                    jax.ShapeDtypeStruct((self.micro,), jnp.int32)))
                leaves, _, kept = self.split_residuals(self.stage_vjp(j, p, s, x, y)[1], p)
                sizes.append(int(sum(leaves[i].size for i in kept)))
            return varying(jnp.zeros((1,)), self.axes)

        jax.eval_shape(jax.shard_map(probe, mesh=self.mesh, in_specs=(), out_specs=P(self.axes), check_vma=True))
        return sizes

    # ------------------------------------------------------------------ branches

    def _zeros(self) -> dict:
        lay, mb = self.layouts, self.micro
        out = {"act": jnp.zeros((mb, lay.acts.width), jnp.float32), "cot": jnp.zeros((mb, lay.acts.width), jnp.float32),
               "residual": jnp.zeros((lay.residual_width,), jnp.float32),
               "grad": {"body": jnp.zeros((lay.params.width,), jnp.float32)},
               "loss": jnp.zeros((), jnp.float32), "correct": jnp.zeros((), jnp.float32),
               "counted": jnp.zeros((), jnp.float32), "stage_loss": jnp.zeros((self.net.num_stages,), jnp.float32),
               "stage_valid": jnp.zeros((self.net.num_stages,), jnp.float32)}
        if lay.head is not None:
            out["grad"]["head"] = jnp.zeros((lay.head.width,), jnp.float32)
        return out

    def branches(self) -> list:
        """[idle, forward of unit u..., backward of unit u...] or [idle, local op of unit u...].

        Each maps the operands of `_tick` (the op's rows, its input buffers) to the results
        `_tick` scatters back: messages, the kept input or residuals, gradients, new states,
        metrics. No collectives inside."""
        def idle(ops):
            return {**self._zeros(), "stash": ops["x"], "ms": ops["ms"], "hs": ops["hs"]}

        if self.rules.local:
            units = [self._local(u) for u in range(self.U)]
        else:
            units = [self._forward(u) for u in range(self.U)] + [self._backward(u) for u in range(self.U)]
        return [lambda ops, f=f: varying(f(ops), self.axes) for f in [idle, *units]]

    def _forward(self, u):
        (j,) = self.units[u]
        lay, last = self.layouts, u == self.U - 1

        def branch(ops):
            out = {**self._zeros(), "ms": ops["ms"], "hs": ops["hs"]}
            p = lay.params.unpack_one(u, ops["rows"]["body"])[0]
            s = lay.model_state.unpack_one(u, ops["ms"])[0]
            x_buf = lay.acts.pack_one(0, ops["image"]) if u == 0 else ops["x"]
            out["stash"] = x_buf
            x = lay.acts.unpack_one(u, x_buf)
            if self.rules.residuals == "carry":
                y, pullback, (new_state, loss, acc) = self.stage_vjp(j, p, s, x, ops["label"])
                leaves, _, kept = self.split_residuals(pullback, p)
                flat, _ = ravel_pytree([leaves[i] for i in kept])
                out["residual"] = jnp.pad(flat.astype(jnp.float32), (0, lay.residual_width - flat.size))
                if last:
                    out.update(loss=loss, correct=acc, counted=jnp.ones((), jnp.float32))
            elif last and lay.model_state.sizes[u] == 0:  # the backward computes the loss; nothing to run
                return out
            else:
                y, new_state = self.net.apply_stage(j, p, s, x, True)
            out["ms"] = lay.model_state.pack_one(u, [new_state])
            if not last:
                out["act"] = lay.acts.pack_one(u + 1, y)
            return out
        return branch

    def _backward(self, u):
        (j,) = self.units[u]
        lay, last = self.layouts, u == self.U - 1

        def branch(ops):
            out = {**self._zeros(), "stash": ops["x"], "ms": ops["ms"], "hs": ops["hs"]}
            p = lay.params.unpack_one(u, ops["rows"]["body"])[0]
            s = lay.model_state.unpack_one(u, ops["ms"])[0]
            seed = varying(jnp.ones((), jnp.float32), self.axes) if last else lay.acts.unpack_one(u + 1, ops["cot"])
            if self.rules.residuals == "carry":
                # A template pullback traced here gives the structure; its kept leaves are the forward's.
                stand_in = lay.acts.unpack_one(u, ops["x"])
                leaves, structure, kept = self.split_residuals(self.stage_vjp(j, p, s, stand_in, ops["label"])[1], p)
                _, unravel = ravel_pytree([leaves[i] for i in kept])
                size = int(sum(leaves[i].size for i in kept))
                for i, leaf in zip(kept, unravel(ops["residual"][:size])):
                    leaves[i] = leaf
                pullback = jax.tree.unflatten(structure, leaves)
            else:  # recomputed from the kept input; the running averages are the forward's to update
                _, pullback, (_, loss, acc) = self.stage_vjp(j, p, s, lay.acts.unpack_one(u, ops["x"]), ops["label"])
                if last:
                    out.update(loss=loss, correct=acc, counted=jnp.ones((), jnp.float32))
            cotangents = pullback(seed)
            out["grad"] = {**out["grad"], "body": lay.params.pack_one(u, [cotangents[0]])}
            if u > 0:
                out["cot"] = lay.acts.pack_one(u, cotangents[1])
            return out
        return branch

    def _local(self, u):
        """Unit u's modules one after another, each on its own local loss (`local`'s stage step)."""
        lay, stages, last = self.layouts, self.units[u], u == self.U - 1

        def branch(ops):
            out = {**self._zeros(), "stash": ops["x"]}
            bodies = lay.params.unpack_one(u, ops["rows"]["body"])
            heads = lay.head.unpack_one(u, ops["rows"]["head"])
            states = lay.model_state.unpack_one(u, ops["ms"])
            head_states = lay.head_state.unpack_one(u, ops["hs"])
            x = ops["image"] if u == 0 else lay.acts.unpack_one(u, ops["x"])
            grads_body, grads_head, new_states, new_head_states = [], [], [], []
            stage_loss = out["stage_loss"]
            for k, j in enumerate(stages):
                g_body, g_head, x, s, hs, loss, acc = stage_grads(
                    self.net, self.heads, j, bodies[k], heads[k], states[k], head_states[k], x, ops["label"],
                    ops["image"])
                if k + 1 < len(stages):  # the next module runs here: its head may follow it (pre-update)
                    hs = self.heads.follow(j, heads[k], hs, bodies[k + 1])
                grads_body.append(g_body)
                grads_head.append(g_head)
                new_states.append(s)
                new_head_states.append(hs)
                stage_loss = stage_loss.at[j].set(loss)
            out["stage_valid"] = out["stage_valid"].at[jnp.asarray(stages)].set(1.0)
            out["grad"] = {"body": lay.params.pack_one(u, grads_body), "head": lay.head.pack_one(u, grads_head)}
            out["ms"] = lay.model_state.pack_one(u, new_states)
            out["hs"] = lay.head_state.pack_one(u, new_head_states)
            out["stage_loss"] = stage_loss
            if last:
                out.update(loss=loss, correct=acc, counted=jnp.ones((), jnp.float32))
            else:
                out["act"] = lay.acts.pack_one(u + 1, x)
            return out
        return branch

    # ------------------------------------------------------------------ the tick

    def _tick(self, c, x, feeding, images, labels, branches, apply_updates):
        """One tick on one device: its op, the messages, the updates the table gives."""
        me = lax.axis_index("stage")
        pick = lambda name: x[name][me]  # noqa: E731
        kind, u, m, rel = pick("kind"), pick("unit"), pick("micro"), pick("rel")
        v = jnp.asarray(self.chunk_of)[u]
        fed = jnp.concatenate([feeding[None], c["fed"]])  # fed[h]: the batch of h calls ago was fed
        valid = (kind > 0) & fed[-rel]
        a_slot, r_slot, c_slot = pick("act_slot"), pick("residual_slot"), pick("cot_slot")
        buf = c["buffers"]
        read = lambda name, slot: buf[name][jnp.maximum(slot, 0)]  # noqa: E731
        first = u == 0
        label = labels[-rel][m]  # labels[h]: the labels of the batch fed h calls ago
        image = images[m]
        if "image" in buf:  # heads that reconstruct it read the micro-batch's image at every unit
            image = jnp.where(first, image, read("image", a_slot))
        ms_rows, hs_rows = c["model_state"], c.get("head_state")
        if self.rules.model_state == "step_mean":  # the last step's mean update lands before its first forward
            land = valid & (kind == FORWARD) & (m == 0)
            ms_rows = ms_rows.at[v].add(jnp.where(land, c["state_sums"][v], 0.0))
            c = dict(c, state_sums=c["state_sums"].at[v].set(jnp.where(land, 0.0, c["state_sums"][v])))
        rows = {name: r[v] for name, r in c["rows"].items()}
        if "previous" in c:
            rows["body"] = jnp.where(pick("version") == 1, c["previous"][v], rows["body"])
        operands = {"rows": rows, "ms": ms_rows[v], "hs": hs_rows[v] if hs_rows is not None else jnp.zeros((1,)),
                    "x": read("act", a_slot), "label": label, "image": image,
                    "cot": read("cot", c_slot) if "cot" in buf else jnp.zeros_like(read("act", a_slot)),
                    "residual": read("residual", r_slot) if "residual" in buf
                    else jnp.zeros((self.layouts.residual_width,), jnp.float32)}
        index = jnp.where(valid, jnp.where(kind == BACKWARD, 1 + self.U + u, 1 + u), 0)
        out = lax.switch(index, branches, varying(operands, self.axes))

        def keep(name, slot, value):  # a buffer written only where the op names a slot
            return buf[name].at[jnp.maximum(slot, 0)].set(jnp.where(valid & (slot >= 0), value,
                                                                    buf[name][jnp.maximum(slot, 0)]))

        forward_op = (kind == FORWARD) | (kind == LOCAL)
        new_buf = dict(buf)
        new_buf["act"] = keep("act", jnp.where(forward_op, a_slot, -1), out["stash"])
        if "image" in buf:
            new_buf["image"] = keep("image", jnp.where(forward_op, a_slot, -1), image)
        if self.rules.residuals == "carry":
            new_buf["residual"] = keep("residual", jnp.where(kind == FORWARD, r_slot, -1), out["residual"])
        grads = {name: c["grads"][name].at[v].add(g) for name, g in out["grad"].items()}
        new_ms, update = out["ms"], out["ms"] - ms_rows[v]
        if self.data:  # every data group's running averages, averaged (linear, so at every tick)
            new_ms, update = lax.pmean((new_ms, update), "data")
        c = dict(c)
        if self.rules.model_state == "step_mean":
            scale = 1.0 / self.program.microbatches
            c["state_sums"] = c["state_sums"].at[v].add(jnp.where(valid & (kind == FORWARD), update * scale, 0.0))
            c["model_state"] = ms_rows
        else:
            c["model_state"] = ms_rows.at[v].set(jnp.where(valid & forward_op, new_ms, ms_rows[v]))
        if hs_rows is not None:
            new_hs = lax.pmean(out["hs"], "data") if self.data else out["hs"]
            c["head_state"] = hs_rows.at[v].set(jnp.where(valid, new_hs, hs_rows[v]))
        c["metrics"] = c["metrics"] + jnp.stack([out["loss"], out["correct"], out["counted"]])
        c["stage_loss"] = c["stage_loss"] + out["stage_loss"]
        c["stage_valid"] = c["stage_valid"] + out["stage_valid"]
        new_buf = self._messages(new_buf, out, image, pick("recv_act"), pick("recv_cot"))
        c["buffers"] = new_buf
        c["grads"] = grads
        if apply_updates:
            c = self._updates(c, x, me, fed)
        return c, None

    def _messages(self, buf, out, image, recv_act, recv_cot):
        """The forward output (with its image, for heads that reconstruct it) to the next unit's
        device, the cotangent back."""
        prog = self.program

        def deliver(name, slot, value):
            return buf[name].at[jnp.maximum(slot, 0)].set(jnp.where(slot >= 0, value, buf[name][jnp.maximum(slot, 0)]))

        message = {"act": out["act"], **({"image": image} if "image" in buf else {})}
        arrived = lax.ppermute(message, "stage", list(prog.forward_pairs)) if prog.forward_pairs else message
        for name, value in arrived.items():
            buf = {**buf, name: deliver(name, recv_act, value)}
        if not self.rules.local:
            back = lax.ppermute(out["cot"], "stage", list(prog.backward_pairs)) if prog.backward_pairs else out["cot"]
            buf = {**buf, "cot": deliver("cot", recv_cot, back)}
        return buf

    def _updates(self, c, x, me, fed):
        """Units whose update the table gives at this tick apply it (gradients averaged over `data`)."""
        grads = c["grads"]
        if self.data:  # only at ticks where some unit updates: a loop, so that no collective sits in a branch
            zeros = jax.tree.map(lambda g: varying(jnp.zeros(g.shape, g.dtype), "stage"), c["grads"])
            grads = lax.fori_loop(0, x["any_update"], lambda _, g: lax.pmean(c["grads"], "data"), zeros)
        rows, opt, previous = dict(c["rows"]), dict(c["opt"]), c.get("previous")
        new_grads = dict(c["grads"])
        for v in range(self.V):
            apply = x["update"][me, v] & fed[-x["update_rel"][me, v]]
            for name, tx in self.optimizers.items():
                def step(row, state, grad, tx=tx):
                    return optim.apply(tx, row, state, grad)

                def keep(row, state, grad):
                    return row, state

                chunk_opt = jax.tree.map(lambda a: a[v], opt[name])
                new, new_opt = lax.cond(apply, step, keep, rows[name][v], chunk_opt, grads[name][v])
                rows[name] = rows[name].at[v].set(new)
                opt[name] = jax.tree.map(lambda a, b: a.at[v].set(b), opt[name], new_opt)
                new_grads[name] = new_grads[name].at[v].set(jnp.where(apply, 0.0, new_grads[name][v]))
            if previous is not None:
                previous = previous.at[v].set(jnp.where(apply, c["rows"]["body"][v], previous[v]))
        c = dict(c, rows=rows, opt=opt, grads=new_grads)
        if previous is not None:
            c["previous"] = previous
        return c

    # -------------------------------------------------------------------- state

    def init_state(self, rng) -> dict:
        """The train state: rows per device and chunk, optimizer states, and (layouts that keep
        work in flight between calls) the slot buffers, gradient sums and which calls fed."""
        lay, prog = self.layouts, self.program
        params, model_state = self.net.init(rng)
        per_unit = lambda tree: [[tree[j] for j in stages] for stages in self.units]  # noqa: E731
        rows = {"body": self.rows(lay.params, per_unit(params))}
        head_state = None
        if self.heads is not None:
            from cdpjax.methods.local import HEADS_KEY

            head_params, head_state = self.heads.init(jax.random.fold_in(rng, HEADS_KEY))
            rows["head"] = self.rows(lay.head, per_unit(head_params))
        state = {"rows": rows,
                 "opt": {name: jax.vmap(jax.vmap(tx.init))(rows[name]) for name, tx in self.optimizers.items()},
                 "model_state": self.rows(lay.model_state, per_unit(model_state))}
        if head_state is not None:
            state["head_state"] = self.rows(lay.head_state, per_unit(head_state))
        if prog.versions == 2:
            state["previous"] = jnp.copy(rows["body"])  # step 0 reads theta_0 from either version
        if self.rules.model_state == "step_mean":
            state["state_sums"] = jnp.zeros_like(state["model_state"])
        if self.lag:
            state["fed"] = jnp.zeros((self.lag,), bool)
            # the labels of the last `lag` batches: an op of an earlier step reads them here
            state["labels"] = jnp.zeros((self.lag, self.ctx.config.global_batch_size), jnp.int32)
            state["buffers"] = {k: jnp.zeros(self._global(k, a.shape), a.dtype) for k, a in self.buffer_shapes().items()}
        if self.grads_in_flight:
            state["grads"] = {name: jnp.zeros((self.D, self.groups, *r.shape[1:]), jnp.float32)
                              for name, r in rows.items()}
        return state

    def _global(self, name, shape):
        """A buffer's shape over all devices and data groups. The data groups' examples are rows of
        the example axis (so that ppll's in-flight batches restore onto another number of data
        groups); carried residuals are flat rows, one per group."""
        if name == "residual":
            return (self.D, shape[0], self.groups, *shape[1:])
        return (self.D, shape[0], self.groups * shape[1], *shape[2:])

    def buffer_shapes(self) -> dict:
        """One device's (one data group's) slot buffers."""
        lay, prog, mb = self.layouts, self.program, self.micro
        shapes = {"act": ((prog.act_slots, mb, lay.acts.width), jnp.float32)}
        if self.heads is not None and self.heads.needs_image:
            shapes["image"] = ((prog.act_slots, mb, *self.image_shape), jnp.float32)
        if not self.rules.local:
            shapes["cot"] = ((prog.cot_slots, mb, lay.acts.width), jnp.float32)
        if self.rules.residuals == "carry":
            shapes["residual"] = ((prog.residual_slots, lay.residual_width), jnp.float32)
        return {k: jax.ShapeDtypeStruct(s, d) for k, (s, d) in shapes.items()}

    def specs(self, state) -> dict:
        """`P('stage')` for the rows; what each data group keeps in flight split over `data`."""
        data = "data" if self.data else None
        specs = jax.tree.map(lambda _: P("stage"), state)
        if "buffers" in state:
            specs["buffers"] = jax.tree.map(lambda _: P("stage", None, data), state["buffers"])
        if "grads" in state:
            specs["grads"] = jax.tree.map(lambda _: P("stage", data), state["grads"])
        if "fed" in state:
            specs["fed"] = P()
            specs["labels"] = P(None, data)
        return specs

    # ------------------------------------------------------------------ periods

    def local_run(self, state, images, labels, feeding, apply_updates=True):
        """S periods on one device (inside `shard_map`): images [S, B_group, ...], feeding [S]."""
        branches = self.branches()
        xs = jax.tree.map(jnp.asarray, self.program.arrays())
        M, mb = self.program.microbatches, self.micro
        s = {k: v for k, v in state.items() if k not in ("buffers", "grads", "fed", "labels")}
        s = jax.tree.map(lambda a: a[0], s)
        if self.lag:
            s["buffers"] = {k: a[0][:, 0] if k == "residual" else a[0] for k, a in state["buffers"].items()}
            s["fed"], s["labels"] = state["fed"], state["labels"].reshape(self.lag, M, mb)
        if self.grads_in_flight:
            s["grads"] = jax.tree.map(lambda a: a[0, 0], state["grads"])

        def period(s, step):
            images_p, labels_p, fed_now = step
            c = dict(s)
            if not self.lag:  # nothing in flight between calls: the buffers are this call's temporaries
                c["buffers"] = varying(jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), self.buffer_shapes()),
                                       self.axes)
                c["fed"] = jnp.zeros((0,), bool)
                c["labels"] = jnp.zeros((0, M, mb), jnp.int32)
            if not self.grads_in_flight:  # every gradient of the period is applied within it
                c["grads"] = varying({n: jnp.zeros_like(r) for n, r in s["rows"].items()}, self.axes)
            c["metrics"] = varying(jnp.zeros((3,), jnp.float32), self.axes)
            c["stage_loss"] = varying(jnp.zeros((self.net.num_stages,), jnp.float32), self.axes)
            c["stage_valid"] = varying(jnp.zeros((self.net.num_stages,), jnp.float32), self.axes)
            batch_images = images_p.reshape(M, mb, *self.image_shape)
            batch_labels = labels_p.reshape(M, mb)
            labels_now = jnp.concatenate([batch_labels[None], c["labels"]])
            c, _ = lax.scan(lambda c, x: self._tick(c, x, fed_now, batch_images, labels_now, branches,
                                                    apply_updates), c, xs)
            metrics, stage_loss, stage_valid = c.pop("metrics"), c.pop("stage_loss"), c.pop("stage_valid")
            if "previous" in c:  # after a flush both versions are the newest, as at step 0
                c["previous"] = jnp.where(fed_now, c["previous"], c["rows"]["body"])
            if self.lag:
                c["fed"] = jnp.concatenate([fed_now[None], c["fed"][:-1]])
                c["labels"] = labels_now[:-1]
            loss, correct, counted = lax.psum(metrics, self.axes)
            counted = jnp.maximum(counted, 1.0)
            stage_loss, stage_valid = lax.psum((stage_loss, stage_valid), "stage")
            if self.data:
                stage_loss, stage_valid = lax.pmean((stage_loss, stage_valid), "data")
            out = {"loss": loss / counted, "accuracy": correct / counted, "stage_loss": stage_loss,
                   "stage_valid": stage_valid > 0}
            if not apply_updates:
                out["grads"] = lax.pmean(c["grads"], "data") if self.data else c["grads"]
            if not self.lag:
                c.pop("buffers"), c.pop("fed"), c.pop("labels")
            if not self.grads_in_flight:
                c.pop("grads")
            return c, out

        s, metrics = lax.scan(period, s, (images, labels, feeding))
        grads = metrics.pop("grads", None)
        new = {k: jax.tree.map(lambda a: a[None], v) for k, v in s.items()
               if k not in ("buffers", "grads", "fed", "labels")}
        if self.lag:
            new["buffers"] = {k: a[None][:, :, None] if k == "residual" else a[None] for k, a in s["buffers"].items()}
            new["fed"], new["labels"] = s["fed"], s["labels"].reshape(self.lag, M * mb)
        if self.grads_in_flight:
            new["grads"] = jax.tree.map(lambda a: a[None, None], s["grads"])
        if grads is not None:
            metrics["grads"] = jax.tree.map(lambda a: a[-1][None], grads)
        return new, metrics

    def run(self, state, images, labels, feeding, apply_updates=True):
        """S periods in one program: images [S, B, ...], labels [S, B], feeding [S] bool."""
        specs = self.specs(state)
        batch = P(None, "data") if self.data else P()
        metric_specs = {"loss": P(), "accuracy": P(), "stage_loss": P(), "stage_valid": P()}
        if not apply_updates:
            metric_specs["grads"] = jax.tree.map(lambda _: P("stage"), state["rows"])
        sharded = jax.shard_map(lambda s, x, y, f: self.local_run(s, x, y, f, apply_updates), mesh=self.mesh,
                                in_specs=(specs, batch, batch, P()), out_specs=(specs, metric_specs), check_vma=True)
        return sharded(state, images, labels, feeding)

    # ------------------------------------------------------------------- method

    def method(self, shown: TimeTable) -> Method:
        mesh, cfg = self.mesh, self.ctx.config
        shapes = jax.eval_shape(self.init_state, jax.random.key(0))
        shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), self.specs(shapes))
        init = jax.jit(self.init_state, out_shardings=shardings)
        run = jax.jit(self.run, donate_argnums=0, static_argnames="apply_updates")
        B = cfg.global_batch_size

        def summary(metrics):
            out = {"loss": metrics["loss"], "accuracy": metrics["accuracy"]}
            if self.rules.local:
                out.update(stage_loss=metrics["stage_loss"], stage_valid=metrics["stage_valid"])
            return out

        @functools.partial(jax.jit, donate_argnums=0)
        def train_step(state, batch):
            state, metrics = self.run(state, batch["image"][None], batch["label"][None], jnp.ones((1,), bool))
            return state, jax.tree.map(lambda a: a[0], summary(metrics))

        @functools.partial(jax.jit, donate_argnums=0)
        def run_steps(state, batches):
            """S steps in one program: batches {'image': [S, B, ...], 'label': [S, B]} -> (state, metrics [S])."""
            count = batches["label"].shape[0]
            state, metrics = self.run(state, batches["image"], batches["label"], jnp.ones((count,), bool))
            return state, summary(metrics)

        flush = None
        if self.lag:
            def flush(state):
                images = np.zeros((self.lag, B, *self.image_shape), np.float32)
                labels = np.zeros((self.lag, B), np.int32)
                return run(state, images, labels, np.zeros((self.lag,), bool))[0]

        def export(state):
            params = self.unrows(self.layouts.params, state["rows"]["body"])
            ms = state["model_state"] + state["state_sums"] if "state_sums" in state else state["model_state"]
            return params, self.unrows(self.layouts.model_state, ms)

        info = {"padding": self.layouts.padding_report(), "run": run, "program": self.program,
                "grads_between_steps": self.grads_in_flight,
                "slots": {"act": self.program.act_slots, "cot": self.program.cot_slots,
                          "residual": self.program.residual_slots}, "residuals": self.rules.residuals}
        if not self.lag:
            @jax.jit
            def gradients(state, batch):
                """The step's gradient per stage, no update (the equality tests)."""
                _, metrics = self.run(state, batch["image"][None], batch["label"][None], np.ones((1,), bool),
                                      apply_updates=False)
                return self.unrows(self.layouts.params, metrics["grads"]["body"])

            info["gradients"] = gradients
        if self.heads is not None:
            info["heads"] = self.heads
            info["export_heads"] = lambda state: self.unrows(self.layouts.head, state["rows"]["head"])
        print(f"{self.name}: {self.net.num_stages} stages as {self.U} units on {self.D} devices x {self.groups} data "
              f"groups, {self.program.microbatches} micro-batch(es) of {self.micro} per step, "
              f"{self.program.act_slots} activation slot(s); "
              f"{carriers.format_report(self.layouts.padding_report())}")
        return Method(self.name, self.net, init, train_step, export, flush=flush, table=shown, run_steps=run_steps,
                      carrier=self.layouts, devices=self.D * self.groups,
                      # in-flight micro-batches are rows of a data group's slice only when a step has one
                      state_depends_on_mesh=bool(self.lag) and self.program.microbatches > 1,
                      info=info)


def _grads_in_flight(program: Program) -> bool:
    """Whether a unit's gradient sum spans calls: some backward of the period comes after the
    unit's last update in it (cdp-mp), rather than every sum being applied where it is made."""
    for d in range(program.placement.devices):
        for v in range(program.placement.chunks):
            last_update = max((t for t in range(program.period) if program.update[t, d, v]), default=-1)
            for t in range(last_update + 1, program.period):
                if program.kind[t, d] in (BACKWARD, LOCAL) and program.placement.chunk[program.unit[t, d]] == v:
                    return True
    return False


__all__ = ["MODEL_STATE", "RESIDUALS", "Rules", "build", "check_mesh"]
