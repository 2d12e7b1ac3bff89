"""The tick runtime: every stage-axis layout runs its lowered program through this module.

gpipe, 1f1b, interleaved-1f1b, zb-h1, zbv, looped-bfs, cdp-mp and ppll differ in
their tables (and in a few declared rules); the runtime is this one. A table is
lowered once (`cdpjax.program.stage_axis`) into a `Program`: per tick and device
the op (its kind, unit, micro-batch, step, version, the slots of its inputs), the
messages of every boundary, the updates. Per tick each device of the `stage` axis
runs its op through the *piece* of its kind (`PIECES`: F, B, W, FB), behind the
stage carrier, and the messages follow the program:

- **F**: a unit's forward of one micro-batch; its input was kept where it arrived
  (to recompute the backward ops), or its `jax.vjp` residuals are kept with
  `residuals='carry'`: raveled into the op's slot row, which goes through the switch
  as an operand and back where it was read (a zero row from every branch and a select
  kept row-sized copies alive: docs/measured.md, cdp-mp).
- **B**: the backward, seeded by the loss (last stage) or by the cotangent the next
  unit sent; its parameter gradient accumulates until the unit's update. In a
  table with W ops it computes the input cotangent only.
- **W**: the weight gradient of a split backward, from the kept input or residuals
  and the cotangent its B read (zero-bubble schedules).
- **FB** (local learning): each module of the unit runs forward and its local
  backward through its auxiliary head; no gradient leaves the unit.
- **Messages.** At the end of a tick every boundary whose sender ran sends its own
  message of its own size (a stage output forward, a cotangent back) with one
  `ppermute` of that boundary's shape, run only at the ticks the program names (a
  while loop of trip count 0 or 1: nothing is sent when the table sends nothing;
  the trip count is the same on every device); a boundary within one device is a
  copy. The receiver stores it in the slot the program names.
- **Updates.** At the ticks the table gives, a unit applies its optax update to its
  accumulated gradient (averaged over `data` groups first), keeping the previous
  version where the table reads it (cdp-mp).

Update rule: that of the table. A flushed layout (gpipe, 1f1b, interleaved-1f1b,
zb-h1, zbv, looped-bfs) updates every stage once per step with the gradient of the
batch's mean loss: backprop's, so it equals `e2e`. cdp-mp updates stage j when its
last worker's gradient op ends, reading the versions of CDP's table: it equals CDP
`simulate` with N = L workers. ppll updates every module at every tick from its
local loss: it equals sequential `local`.

SPMD realisation: one `shard_map` over (`stage`, `data`), a `lax.scan` over the
ticks of one period inside a `lax.scan` over the steps of a call, one
`lax.switch` per tick over [idle, the pieces of each kind for each unit] on the
uniform carrier (`cdpjax.carrier`: parameters, optimizer and model state as
padded rows, a device's units as its rows), collectives outside the switch. A
period's ops that belong to the previous steps (cdp-mp, ppll) find their inputs
in the train state, so one `train_step` feeds one batch and in-flight work resumes
from checkpoints; `flush` runs the periods that finish it with nothing fed.

BatchNorm running averages (`model_state`): 'sequential' applies each forward's
update in tick order (gpipe: micro-batch by micro-batch); 'step_mean' (cdp-mp)
averages the step's updates taken from the same starting value and applies the
mean before the stage's first forward of the next step, as CDP `simulate` does.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from cdpjax import carrier as carriers
from cdpjax import optim
from cdpjax.errors import ConfigError
from cdpjax.methods.common import Context, Method, varying
from cdpjax.methods.local import stage_grads
from cdpjax.methods.stage_ops import StageOps
from cdpjax.program import RESIDUALS, Program, carries
from cdpjax.program.stage_axis import CODE, lower_stage_axis
from cdpjax.timetable import TimeTable

MODEL_STATE = ("sequential", "step_mean")


@dataclasses.dataclass(frozen=True)
class Rules:
    """What a layout declares beyond its table.

    local: 'FB' ops with auxiliary heads (ppll) instead of F/B/W ops with backprop.
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
                          f"data group), norm='group', or --config.mesh.data=1 (one pipeline, on {devices} "
                          f"devices)")
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
    """The method `method` running `table` (laid out over enough steps for a steady period).

    `heads`, `optimizers` ({'body': tx, 'head': tx}): local learning's auxiliary heads and
    optimizers (default: the config's optimizer for the bodies). `shown`: the table the
    method reports (a few steps), default `table`.
    """
    carry = carries(rules.residuals)
    if rules.model_state not in MODEL_STATE:
        raise ValueError(f"model_state={rules.model_state!r} is not one of {', '.join(MODEL_STATE)}")
    if carry and rules.local:
        raise ConfigError(f"{method} has no backward to carry residuals to: use residuals='recompute'")
    program = lower_stage_axis(table, rules.residuals, heads=heads is not None,
                               carry_image=heads is not None and heads.needs_image,
                               model_state_sums=rules.model_state == "step_mean")
    groups = check_mesh(ctx, method, program.devices)
    net = ctx.net(stages=ctx.config.stages)
    if net.num_stages != table.stages:
        raise ConfigError(f"{method}'s table has {table.stages} stages but stages={ctx.config.stages!r} cuts "
                          f"{net.name} into {net.num_stages}")
    batch = ctx.config.global_batch_size // groups
    ctx.require_divisible("global_batch_size / mesh.data", batch, program.microbatches,
                          "micro-batches per step" if not rules.local else "1")
    optimizers = optimizers or {"body": ctx.optimizer()}
    runtime = _Runtime(ctx, method, program, rules, net, heads, optimizers, groups, batch // program.microbatches)
    return runtime.method(shown or table)


# ====================================================================== the pieces
# One piece per op kind: `piece(rt, u)` is the switch branch of that kind for unit u,
# mapping the tick's operands (`_Runtime._operands`) to results (`_Runtime.results`).
# No collectives inside.


def forward_piece(rt: "_Runtime", u: int):
    (j,) = rt.units[u]
    lay, last = rt.layouts, u == rt.U - 1

    def branch(ops):
        out = rt.results(ops)
        p = lay.params.unpack_one(u, ops["rows"]["body"])[0]
        s = lay.model_state.unpack_one(u, ops["ms"])[0]
        x = rt.stage_input(u, ops)
        if rt.carry:
            y, kept, (new_state, metrics) = rt.ops.forward_kept(j, p, s, x, ops["label"])
            out["residual"] = _write_leaves(ops["residual"], kept)
        elif last and lay.model_state.sizes[u] == 0:  # the backward computes the loss; nothing to run
            return out
        else:
            y, (new_state, metrics) = rt.ops.run(j, p, s, x, ops["label"])
        if last and rt.carry:  # recomputing backwards count the loss where they compute it
            out["metrics"] = metrics
        out["ms"] = lay.model_state.pack_one(u, [new_state])
        if not last:
            out["act"] = lay.acts.pack_one(u + 1, y)
        return out
    return branch


def _backward_piece(rt: "_Runtime", u: int, want: tuple[str, ...]):
    """A backward op of unit u computing the gradients in `want` ('params', 'input')."""
    (j,) = rt.units[u]
    lay = rt.layouts

    def branch(ops):
        out = rt.results(ops)
        p = lay.params.unpack_one(u, ops["rows"]["body"])[0]
        s = lay.model_state.unpack_one(u, ops["ms"])[0]
        x = rt.stage_input(u, ops)
        cotangent = lay.acts.unpack_one(u + 1, ops["cot"]) if u < rt.U - 1 else None
        kept = None
        if rt.carry:
            kept = lambda template: _read_leaves(ops["residual"], template)  # noqa: E731
        d_params, d_input, metrics = rt.ops.backward(j, p, s, x, ops["label"], cotangent, kept, want)
        if d_params is not None:
            out["grad"] = {**out["grad"], "body": lay.params.pack_one(u, [d_params])}
        if d_input is not None:
            out["cot"] = lay.acts.pack_one(u, d_input)
        if metrics is not None and "input" in want:  # B counts the loss it recomputes; W does not
            out["metrics"] = metrics
        return out
    return branch


def backward_piece(rt: "_Runtime", u: int):
    """B: the whole backward, or the input cotangent only where the table has W ops."""
    return _backward_piece(rt, u, ("input",) if rt.program.split_backward else ("params", "input"))


def weight_piece(rt: "_Runtime", u: int):
    """W: the weight gradient of a split backward."""
    return _backward_piece(rt, u, ("params",))


def local_piece(rt: "_Runtime", u: int):
    """FB: unit u's modules one after another, each on its own local loss (`local`'s stage step)."""
    lay, stages, last = rt.layouts, rt.units[u], u == rt.U - 1

    def branch(ops):
        out = rt.results(ops)
        bodies = lay.params.unpack_one(u, ops["rows"]["body"])
        heads = lay.head.unpack_one(u, ops["rows"]["head"])
        states = lay.model_state.unpack_one(u, ops["ms"])
        head_states = lay.head_state.unpack_one(u, ops["hs"])
        x = ops["first_input"] if u == 0 else lay.acts.unpack_one(u, ops["x"])
        grads_body, grads_head, new_states, new_head_states = [], [], [], []
        stage_loss = out["stage_loss"]
        for k, j in enumerate(stages):
            g_body, g_head, x, s, hs, loss, acc = stage_grads(
                rt.net, rt.heads, j, bodies[k], heads[k], states[k], head_states[k], x, ops["label"],
                ops["image"])
            if k + 1 < len(stages):  # the next module runs here: its head may follow it (pre-update)
                hs = rt.heads.follow(j, heads[k], hs, bodies[k + 1])
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
        if last:  # x: the network's outputs
            out["metrics"] = rt.ops.metrics(x, ops["label"])
        else:
            out["act"] = lay.acts.pack_one(u + 1, x)
        return out
    return branch


PIECES = {"F": forward_piece, "B": backward_piece, "W": weight_piece, "FB": local_piece}


# ===================================================================== the runtime


class _Runtime:
    """The pieces of one built layout (a class only to share the set-up; every piece is a pure function)."""

    def __init__(self, ctx, method, program: Program, rules: Rules, net, heads, optimizers, groups, micro):
        self.ctx, self.name, self.program, self.rules = ctx, method, program, rules
        self.net, self.heads, self.optimizers, self.groups, self.micro = net, heads, optimizers, groups, micro
        self.ticks = program.ticks
        self.mesh = ctx.mesh
        self.data = "data" in self.mesh.axis_names
        self.axes = ("stage", "data") if self.data else ("stage",)
        self.carry = program.carries
        self.ops = StageOps(net, 1.0 / program.microbatches, lambda x: varying(x, self.axes), ctx.task)
        self.label_shape = tuple(ctx.task.label_shape(tuple(net.input_shape)))
        self.label_dtype = jnp.dtype(ctx.task.label_dtype)
        place = program.placement
        self.units, self.U, self.V, self.D = place.units, len(place.units), place.chunks, place.devices
        # unit at (device, chunk), -1 where a device holds fewer units
        self.unit_at = np.full((self.D, self.V), -1, np.int32)
        for u in range(self.U):
            self.unit_at[place.device[u], place.chunk[u]] = u
        self.chunk_of = np.asarray(place.chunk, np.int32)
        self.input_spec = jax.ShapeDtypeStruct((micro, *net.input_shape), jnp.dtype(net.input_dtype))
        self.layouts = self._layouts()
        self.lag = program.lag
        if self.carry:  # the F branch writes its residuals unconditionally: every F must have a slot
            arrays = self.ticks.arrays()
            if np.any(arrays["residual_slot"][arrays["kind"] == CODE["F"]] < 0):
                raise AssertionError(f"{method}: a forward with no residual slot (residuals='carry')")

    # ------------------------------------------------------------------ layouts

    def _layouts(self) -> _Layouts:
        params, state = jax.eval_shape(lambda: self.net.init(jax.random.key(0)))
        per_unit = lambda tree: [[tree[j] for j in stages] for stages in self.units]  # noqa: E731
        acts = carriers.ActLayout.from_shapes([self._inputs()[stages[0]].shape[1:] for stages in self.units])
        layouts = dict(params=carriers.FlatLayout.from_trees(per_unit(params)),
                       model_state=carriers.FlatLayout.from_trees(per_unit(state)), acts=acts)
        if self.heads is not None:
            head_params, head_state = jax.eval_shape(self.heads.init, jax.random.key(0))
            layouts.update(head=carriers.FlatLayout.from_trees(per_unit(head_params)),
                           head_state=carriers.FlatLayout.from_trees(per_unit(head_state)))
        if self.carry:
            layouts["residual_width"] = max(1, *self.residual_sizes())
        return _Layouts(**layouts)

    def _inputs(self) -> list:
        """Each stage's input for one micro-batch (stage 0's: the batch)."""
        outputs = self.net.stage_output_shapes(self.micro)
        return [self.input_spec] + [jax.ShapeDtypeStruct(s, jnp.float32) for s in outputs[:-1]]

    def residual_sizes(self) -> list[int]:
        """Per unit, the elements of one micro-batch's kept residuals."""
        params, state = jax.eval_shape(lambda: self.net.init(jax.random.key(0)))
        labels = jax.ShapeDtypeStruct((self.micro, *self.label_shape), self.label_dtype)

        def trace_inside(probe):
            def fn():
                probe(lambda tree: varying(tree, self.axes))
                return varying(jnp.zeros((1,)), self.axes)
            jax.eval_shape(jax.shard_map(fn, mesh=self.mesh, in_specs=(), out_specs=P(self.axes), check_vma=True))

        shapes = self.ops.residual_shapes(params, state, self._inputs(), labels, trace_inside)
        return [int(sum(math.prod(a.shape) for a in shapes[j])) for (j,) in self.units]

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

    # ------------------------------------------------------------------ branches

    def results(self, ops) -> dict:
        """What every piece returns: zeros, and the model states and the residual row it leaves as they are."""
        lay, mb, L = self.layouts, self.micro, self.net.num_stages
        out = {"act": jnp.zeros((mb, lay.acts.width), jnp.float32), "cot": jnp.zeros((mb, lay.acts.width), jnp.float32),
               "residual": ops["residual"],
               "grad": {"body": jnp.zeros((lay.params.width,), jnp.float32)},
               "metrics": self.ops.no_metrics(), "stage_loss": jnp.zeros((L,), jnp.float32),
               "stage_valid": jnp.zeros((L,), jnp.float32), "ms": ops["ms"], "hs": ops["hs"]}
        if lay.head is not None:
            out["grad"]["head"] = jnp.zeros((lay.head.width,), jnp.float32)
        return out

    def stage_input(self, u, ops):
        return ops["first_input"] if u == 0 else self.layouts.acts.unpack_one(u, ops["x"])

    def branches(self) -> list:
        """[idle, then for each kind of the program its piece for each unit]."""
        pieces = [PIECES[kind](self, u) for kind in self.program.kinds for u in range(self.U)]
        return [lambda ops, f=f: varying(f(ops), self.axes) for f in [self.results, *pieces]]

    def branch_index(self, code, u):
        """The switch index of an op of kind `code` of unit u (0 idle)."""
        position = np.zeros((max(CODE.values()) + 1,), np.int32)
        for i, kind in enumerate(self.program.kinds):
            position[CODE[kind]] = i
        return 1 + jnp.asarray(position)[code] * self.U + u

    # ------------------------------------------------------------------ the tick

    def _operands(self, c, x, me, images, labels):
        """The op of this device at this tick and what its piece reads."""
        pick = lambda name: x[name][me]  # noqa: E731
        code, u, m, rel = pick("kind"), pick("unit"), pick("micro"), pick("rel")
        v = jnp.asarray(self.chunk_of)[u]
        buf = c["buffers"]
        read = lambda name, slot: buf[name][jnp.maximum(slot, 0)]  # noqa: E731
        batch_image = images[m]
        first_input = batch_image
        if "input" in buf:  # a backward op's first-unit input of an earlier call, kept where its forward ran
            kept = (pick("input_slot") >= 0) & (code != CODE["F"]) & (code != CODE["FB"])
            first_input = jnp.where(kept, read("input", pick("input_slot")), batch_image)
        image = batch_image
        if "image" in buf:  # heads that reconstruct it read the micro-batch's image at every unit
            image = jnp.where(u == 0, batch_image, read("image", pick("act_slot")))
        rows = {name: r[v] for name, r in c["rows"].items()}
        if "previous" in c:
            rows["body"] = jnp.where(pick("version") == 1, c["previous"][v], rows["body"])
        ms_rows, hs_rows = c["model_state"], c.get("head_state")
        ops = {"rows": rows, "ms": ms_rows[v], "hs": hs_rows[v] if hs_rows is not None else jnp.zeros((1,)),
               "x": read("act", pick("act_slot")), "label": labels[-rel][m], "image": image,
               "first_input": first_input,
               "cot": read("cot", pick("cot_slot")) if "cot" in buf else jnp.zeros_like(read("act", 0)),
               # the op's slot row: F writes it, B and W read it, the others give it back unchanged
               "residual": read("residual", pick("residual_slot"))[None] if "residual" in buf
               else jnp.zeros((1, 1), jnp.float32)}
        return ops, (code, u, m, rel, v)

    def _tick(self, c, x, feeding, images, labels, branches, apply_updates):
        """One tick on one device: its op, the messages, the updates the table gives."""
        me = lax.axis_index("stage")
        pick = lambda name: x[name][me]  # noqa: E731
        fed = jnp.concatenate([feeding[None], c["fed"]])  # fed[h]: the batch of h calls ago was fed
        c = dict(c)
        if self.rules.model_state == "step_mean":  # the last step's mean update lands before its first forward
            code, u, m = pick("kind"), pick("unit"), pick("micro")
            v = jnp.asarray(self.chunk_of)[u]
            land = (code == CODE["F"]) & fed[-pick("rel")] & (m == 0)
            c["model_state"] = c["model_state"].at[v].add(jnp.where(land, c["state_sums"][v], 0.0))
            c["state_sums"] = c["state_sums"].at[v].set(jnp.where(land, 0.0, c["state_sums"][v]))
        operands, (code, u, m, rel, v) = self._operands(c, x, me, images, labels)
        valid = (code > 0) & fed[-rel]
        index = jnp.where(valid, self.branch_index(code, u), 0)
        out = lax.switch(index, branches, varying(operands, self.axes))
        buf = dict(c["buffers"])

        def keep(name, slot, value):  # a buffer written only where the op names a slot
            at = jnp.maximum(slot, 0)
            return buf[name].at[at].set(jnp.where(valid & (slot >= 0), value, buf[name][at]))

        forward = (code == CODE["F"]) | (code == CODE["FB"])
        if "input" in buf:
            buf["input"] = keep("input", jnp.where(forward & (u == 0), pick("input_slot"), -1),
                                operands["first_input"])
        if self.carry:  # the row read above, as the op left it, back where it was read (no select)
            buf["residual"] = lax.dynamic_update_slice(buf["residual"], out["residual"],
                                                       (jnp.maximum(pick("residual_slot"), 0), 0))
        c["grads"] = {name: c["grads"][name].at[v].add(g) for name, g in out["grad"].items()}
        ms_rows = c["model_state"]
        new_ms, update = out["ms"], out["ms"] - ms_rows[v]
        if self.data:  # every data group's running averages, averaged (linear, so at every tick)
            new_ms, update = lax.pmean((new_ms, update), "data")
        if self.rules.model_state == "step_mean":
            scale = 1.0 / self.program.microbatches
            c["state_sums"] = c["state_sums"].at[v].add(jnp.where(valid & (code == CODE["F"]), update * scale, 0.0))
        else:
            c["model_state"] = ms_rows.at[v].set(jnp.where(valid & forward, new_ms, ms_rows[v]))
        if "head_state" in c:
            new_hs = lax.pmean(out["hs"], "data") if self.data else out["hs"]
            c["head_state"] = c["head_state"].at[v].set(jnp.where(valid, new_hs, c["head_state"][v]))
        c["metrics"] = c["metrics"] + out["metrics"]
        c["stage_loss"] = c["stage_loss"] + out["stage_loss"]
        c["stage_valid"] = c["stage_valid"] + out["stage_valid"]
        c["buffers"] = self._messages(buf, out, operands["image"], x, me)
        if apply_updates:
            c = self._updates(c, x, me, fed)
        return c, None

    def _messages(self, buf, out, image, x, me):
        """Each boundary's message of this tick, at its own size: a unit's output (with its image,
        for heads that reconstruct it) to the next unit's device, a cotangent back."""
        lay = self.layouts
        for b, (src, dst) in enumerate(self.ticks.boundaries):
            width = math.prod(lay.acts.shapes[b + 1])
            message = {"act": out["act"][:, :width]}
            if "image" in buf:
                message["image"] = image
            arrived = _gated_permute(message, x["send_act"][b], src, dst, self.axes)
            buf = _deliver(buf, arrived, x["recv_act"][b], (me == dst) & (x["send_act"][b] > 0), lay.acts.width)
            if "cot" in buf:
                back = _gated_permute({"cot": out["cot"][:, :width]}, x["send_cot"][b], dst, src, self.axes)
                buf = _deliver(buf, back, x["recv_cot"][b], (me == src) & (x["send_cot"][b] > 0), lay.acts.width)
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
            state["labels"] = jnp.zeros((self.lag, self.ctx.config.global_batch_size, *self.label_shape),
                                        self.label_dtype)
            state["buffers"] = {k: jnp.zeros(self._global(k, a.shape), a.dtype)
                                for k, a in self.buffer_shapes().items()}
        if prog.grads_in_flight:
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
        """One device's (one data group's) slot buffers, as the program declares them."""
        lay, tk, mb = self.layouts, self.ticks, self.micro
        declared = {b.name for b in self.program.buffers}
        image = tuple(self.net.input_shape)
        shapes = {"act": ((tk.act_slots, mb, lay.acts.width), jnp.float32),
                  "input": ((tk.input_slots, mb, *image), self.input_spec.dtype),
                  "image": ((tk.act_slots, mb, *image), jnp.float32),
                  "cot": ((tk.cot_slots, mb, lay.acts.width), jnp.float32),
                  "residual": ((tk.residual_slots, lay.residual_width), jnp.float32)}
        return {k: jax.ShapeDtypeStruct(s, d) for k, (s, d) in shapes.items() if k in declared}

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

    def _period(self, s, step, branches, apply_updates):
        """One period (one call's ticks) on one device."""
        images_p, labels_p, fed_now = step
        M, mb = self.program.microbatches, self.micro
        c = dict(s)
        if not self.lag:  # nothing in flight between calls: the buffers are this call's temporaries
            c["buffers"] = varying(jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), self.buffer_shapes()),
                                   self.axes)
            c["fed"] = jnp.zeros((0,), bool)
            c["labels"] = jnp.zeros((0, M, mb, *self.label_shape), self.label_dtype)
        if not self.program.grads_in_flight:  # every gradient of the period is applied within it
            c["grads"] = varying({n: jnp.zeros_like(r) for n, r in s["rows"].items()}, self.axes)
        L = self.net.num_stages
        c["metrics"] = varying(self.ops.no_metrics(), self.axes)
        c["stage_loss"] = varying(jnp.zeros((L,), jnp.float32), self.axes)
        c["stage_valid"] = varying(jnp.zeros((L,), jnp.float32), self.axes)
        batch_images = images_p.reshape(M, mb, *images_p.shape[1:])
        labels_now = jnp.concatenate([labels_p.reshape(M, mb, *self.label_shape)[None], c["labels"]])
        xs = jax.tree.map(jnp.asarray, self.ticks.arrays())
        c, _ = lax.scan(lambda c, x: self._tick(c, x, fed_now, batch_images, labels_now, branches, apply_updates),
                        c, xs)
        metrics, stage_loss, stage_valid = c.pop("metrics"), c.pop("stage_loss"), c.pop("stage_valid")
        if "previous" in c:  # after a flush both versions are the newest, as at step 0
            c["previous"] = jnp.where(fed_now, c["previous"], c["rows"]["body"])
        if self.lag:
            c["fed"] = jnp.concatenate([fed_now[None], c["fed"][:-1]])
            c["labels"] = labels_now[:-1]
        sums = lax.psum(metrics, self.axes)
        stage_loss, stage_valid = lax.psum((stage_loss, stage_valid), "stage")
        if self.data:
            stage_loss, stage_valid = lax.pmean((stage_loss, stage_valid), "data")
        out = {**self.ops.finish(sums), "stage_loss": stage_loss, "stage_valid": stage_valid > 0}
        if not apply_updates:
            out["grads"] = lax.pmean(c["grads"], "data") if self.data else c["grads"]
        if not self.lag:
            c.pop("buffers"), c.pop("fed"), c.pop("labels")
        if not self.program.grads_in_flight:
            c.pop("grads")
        return c, out

    def local_run(self, state, images, labels, feeding, apply_updates=True):
        """S periods on one device (inside `shard_map`): images [S, B_group, ...], feeding [S]."""
        branches = self.branches()
        M, mb = self.program.microbatches, self.micro
        s = {k: v for k, v in state.items() if k not in ("buffers", "grads", "fed", "labels")}
        s = jax.tree.map(lambda a: a[0], s)
        if self.lag:
            s["buffers"] = {k: a[0][:, 0] if k == "residual" else a[0] for k, a in state["buffers"].items()}
            s["fed"], s["labels"] = state["fed"], state["labels"].reshape(self.lag, M, mb, *self.label_shape)
        if self.program.grads_in_flight:
            s["grads"] = jax.tree.map(lambda a: a[0, 0], state["grads"])
        s, metrics = lax.scan(lambda s, step: self._period(s, step, branches, apply_updates), s,
                              (images, labels, feeding))
        grads = metrics.pop("grads", None)
        new = {k: jax.tree.map(lambda a: a[None], v) for k, v in s.items()
               if k not in ("buffers", "grads", "fed", "labels")}
        if self.lag:
            new["buffers"] = {k: a[None][:, :, None] if k == "residual" else a[None] for k, a in s["buffers"].items()}
            new["fed"], new["labels"] = s["fed"], s["labels"].reshape(self.lag, M * mb, *self.label_shape)
        if self.program.grads_in_flight:
            new["grads"] = jax.tree.map(lambda a: a[None, None], s["grads"])
        if grads is not None:
            metrics["grads"] = jax.tree.map(lambda a: a[-1][None], grads)
        return new, metrics

    def run(self, state, images, labels, feeding, apply_updates=True):
        """S periods in one program: images [S, B, ...], labels [S, B], feeding [S] bool."""
        specs = self.specs(state)
        batch = P(None, "data") if self.data else P()
        metric_specs = {name: P() for name in (*self.ctx.task.metric_names, "metric_sums", "stage_loss", "stage_valid")}
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
            drop = ("grads",) if self.rules.local else ("grads", "stage_loss", "stage_valid")
            return {k: v for k, v in metrics.items() if k not in drop}

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
                images = np.zeros((self.lag, B, *self.net.input_shape), self.input_spec.dtype)
                labels = np.zeros((self.lag, B, *self.label_shape), self.label_dtype)
                return run(state, images, labels, np.zeros((self.lag,), bool))[0]

        def export(state):
            params = self.unrows(self.layouts.params, state["rows"]["body"])
            ms = state["model_state"] + state["state_sums"] if "state_sums" in state else state["model_state"]
            return params, self.unrows(self.layouts.model_state, ms)

        gradients = None
        if not self.lag:
            @jax.jit
            def gradients(state, batch):
                """The step's gradient per stage, no update (the equality tests)."""
                _, metrics = self.run(state, batch["image"][None], batch["label"][None], np.ones((1,), bool),
                                      apply_updates=False)
                return self.unrows(self.layouts.params, metrics["grads"]["body"])

        export_heads = None
        if self.heads is not None:
            export_heads = lambda state: self.unrows(self.layouts.head, state["rows"]["head"])  # noqa: E731
        padding = self.layouts.padding_report()
        print(f"cdpjax: {self.name}: {self.net.num_stages} stages as {self.U} units on {self.D} devices x "
              f"{self.groups} data groups, {self.program.microbatches} micro-batch(es) of {self.micro} per step, "
              f"{self.ticks.act_slots} activation slot(s); {carriers.format_report(padding)}")
        return Method(self.name, self.net, init, train_step, export, flush=flush, table=shown, run_steps=run_steps,
                      carrier=self.layouts, devices=self.D * self.groups,
                      # in-flight micro-batches are rows of a data group's slice only when a step has one
                      state_depends_on_mesh=bool(self.lag) and self.program.microbatches > 1,
                      program=self.program, periods=run, gradients=gradients, heads=self.heads,
                      export_heads=export_heads, padding=padding)


def _gated_permute(message: dict, go, src: int, dst: int, axes):
    """`message` from device `src` to `dst` of the stage axis when `go` (0 or 1, the same on every
    device) is 1; nothing is sent when it is 0. A boundary within one device is the message itself."""
    if src == dst:
        return message
    zeros = varying(jax.tree.map(jnp.zeros_like, message), axes)
    return lax.fori_loop(0, go, lambda _, m: lax.ppermute(message, "stage", [(src, dst)]), zeros)


def _write_leaves(row, leaves):
    """`leaves` raveled one after another into `row` ([1, width] float32), in one update of its
    head; the row's tail is left as it was (the backward reads only its own unit's length). One
    update, not one per leaf: XLA:CPU copies the whole row for each update inside a branch, which
    at ResNet-18's width (a row of tens of MiB, dozens of leaves) made cdp-mp's step 13x dp's."""
    flat = jnp.concatenate([jnp.reshape(leaf, (1, -1)).astype(row.dtype) for leaf in leaves], axis=1)
    return lax.dynamic_update_slice(row, flat, (0, 0))


def _read_leaves(row, template):
    """The leaves `_write_leaves` wrote into `row`, in `template`'s shapes and dtypes."""
    out, at = [], 0
    for leaf in template:
        n = math.prod(leaf.shape)
        out.append(row[0, at:at + n].reshape(leaf.shape).astype(leaf.dtype))
        at += n
    return out


def _deliver(buf: dict, arrived: dict, slot, write, width: int) -> dict:
    """The arrived message stored in `slot` of its buffers where `write`; activations and
    cotangents padded back to the carrier's rows of `width`."""
    buf = dict(buf)
    at = jnp.maximum(slot, 0)
    for name, value in arrived.items():
        if name in ("act", "cot"):
            value = jnp.pad(value, ((0, 0), (0, width - value.shape[1])))
        buf[name] = buf[name].at[at].set(jnp.where(write, value, buf[name][at]))
    return buf


__all__ = ["MODEL_STATE", "PIECES", "RESIDUALS", "Rules", "build", "check_mesh"]
