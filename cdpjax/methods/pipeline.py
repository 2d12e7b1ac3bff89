"""The tick runtime: every stage-axis layout runs its lowered program through this module.

gpipe, 1f1b, interleaved-1f1b, zb-h1, zbv, dualpipev, looped-bfs, cdp-mp and ppll
differ in their tables (and in a few declared rules); the runtime is this one. A
table is lowered once (`cdpjax.program.stage_axis`) into a `Program`: per tick and
device the ops of its cell (each op's kind, unit, micro-batch, lag, version, the
slots of its inputs; one op in most tables, an overlapped forward and backward in
dualpipev's), the messages of every boundary, the updates. Per tick each device of
the `stage` axis runs each op of its cell through the *piece* of its kind (`PIECES`,
built on the kind's declared flags, `cdpjax.kinds`), behind the stage carrier, and
the messages follow the program:

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
  copy. The receiver stores it in the slot the program names. A message crosses
  encoded by its kind's codec (`compress.activations`, `compress.cotangents`;
  `cdpjax.compress`) and is decoded on arrival: the receiver's op reads the decoded
  values ('none': the message itself, bit for bit).
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
ticks of one period inside a `lax.scan` over the steps of a call (its carry one
device's view of the train state `StageState`: fixed fields, None where the program
has no such part), one
`lax.switch` per tick over the program's cells (idle first; a cell's branch runs
its ops' pieces one after another, typed `Operands` to `Results`) on the
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
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from cdpjax import carrier as carriers
from cdpjax import compress
from cdpjax import kinds as op_kinds
from cdpjax import optim
from cdpjax.errors import ConfigError
from cdpjax.methods.common import Context, Method, varying
from cdpjax.methods.local import stage_grads
from cdpjax.train_state import typed_state
from cdpjax.methods.stage_ops import StageOps
from cdpjax.program import RESIDUALS, Program, carries
from cdpjax.program.stage_axis import LANE_FIELDS, StageTicks, kind_codes, lower_stage_axis, program_ticks
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
          heads=None, optimizers: "Rows | None" = None, program: Program | None = None) -> Method:
    """The method `method` running `table` (laid out over enough steps for a steady period).

    `heads`, `optimizers` (`Rows(body=tx, head=tx)`): local learning's auxiliary heads and
    optimizers (default: the config's optimizer for the bodies). `shown`: the table the
    method reports (a few steps), default `table`. `program`: what the engine runs (default:
    `table` lowered); the engine compiles its scan's arrays from the program's events
    (`program_ticks`), so a program whose events differ from the table's runs its events.
    """
    carry = carries(rules.residuals)
    if rules.model_state not in MODEL_STATE:
        raise ValueError(f"model_state={rules.model_state!r} is not one of {', '.join(MODEL_STATE)}")
    if carry and rules.local:
        raise ConfigError(f"{method} has no backward to carry residuals to: use residuals='recompute'")
    if program is None:
        program = lower_stage_axis(table, rules.residuals, heads=heads is not None,
                                   carry_image=heads is not None and heads.needs_image,
                                   model_state_sums=rules.model_state == "step_mean")
    op_kinds.refuse_unknown(program.kinds, PIECES, "the stage-axis engine")
    groups = check_mesh(ctx, method, program.devices)
    net = ctx.net(stages=ctx.config.stages)
    if net.num_stages != table.stages:
        raise ConfigError(f"{method}'s table has {table.stages} stages but stages={ctx.config.stages!r} cuts "
                          f"{net.name} into {net.num_stages}")
    batch = ctx.config.global_batch_size // groups
    ctx.require_divisible("global_batch_size / mesh.data", batch, program.microbatches,
                          "micro-batches per step" if not rules.local else "1")
    optimizers = optimizers or Rows(body=ctx.optimizer())
    runtime = _Runtime(ctx, method, program, rules, net, heads, optimizers, groups, batch // program.microbatches)
    return runtime.method(shown or table)


# ====================================================================== typed state
# The engine's values, each a NamedTuple with fixed fields; a part a program does not have
# is None (no key comes and goes with the program's flags).


@typed_state
class Rows(NamedTuple):
    """Per-unit rows of one kind of value, by part: the bodies' and (local learning) the
    auxiliary heads'. Used for parameters (`[V, width]` on a device, one unit's `[width]` in
    a piece), their optimizer states, gradient sums and the optimizers themselves."""

    body: Any
    head: Any = None


# checkpoints written before the buffers took the program's plural names hold them as act / cot / residual
@typed_state(renamed={"acts": "act", "cots": "cot", "residuals": "residual"})
class Buffers(NamedTuple):
    """A device's slot buffers, named as the program's buffers (`StageTicks`' slots; None where the
    program declares none): `acts` [slots, mb, width] each unit's input (and a split backward's
    recomputation input), `input` the first unit's batch input kept for a later call's backward,
    `image` the micro-batch's image beside each input (heads that reconstruct it), `cots` [slots,
    mb, width] incoming cotangents, `residuals` [slots, width] carried residuals, one raveled row
    per slot."""

    acts: jax.Array
    input: jax.Array | None = None
    image: jax.Array | None = None
    cots: jax.Array | None = None
    residuals: jax.Array | None = None


class Sums(NamedTuple):
    """What a period adds up over its ticks (summed over devices at its end): the task's metric
    sums, each local module's loss and whether it ran (ppll's per-module figures)."""

    metrics: jax.Array
    stage_loss: jax.Array
    stage_valid: jax.Array


@typed_state
class StageState(NamedTuple):
    """The stage engine's state, one type for the train state and the scan's carry (as MaxText's
    loop state, a part a program lacks is None).

    As the train state (what checkpoints hold, over all devices): each field with a leading
    device axis `[D, ...]`, `sums` None. As the carry of one device's `lax.scan` over the steps of
    a call and the ticks of a period (`loop_state` takes that view inside a call, `train_state`
    puts it back): no device axis, and `sums` the period's `Sums`, set at a period's start and
    None again at its end (None has no leaves, so the checkpoint's paths are those of the other
    fields).

    rows / opt_state / model_state / head_state: each unit's parameters (the carrier's padded rows
    `[V, width]`, not per-stage trees: `export` gives those back through `unrows`), optimizer state,
    running averages and heads' state. previous: the previous version of the body rows (cdp-mp's
    tables read it). state_sums: the step's running-average updates not yet applied ('step_mean').
    grads: the gradient sums of the units (within a period; between periods only where the program
    keeps them in flight: `[D, groups, V, width]` in the train state). buffers: the slot buffers
    (between periods only where ops of a step spill into the next call, `Program.lag` > 0: `[D, slots,
    groups * mb, ...]`, residuals `[D, slots, groups, width]`). fed / labels: whether each of the
    last `lag` calls fed a batch, and their labels (`[lag, B, ...]`). What a program keeps in flight
    between calls (`buffers`, `grads`, `fed`, `labels`) is None where it keeps none."""

    rows: Rows
    opt_state: Rows
    model_state: jax.Array
    head_state: jax.Array | None = None
    previous: jax.Array | None = None
    state_sums: jax.Array | None = None
    grads: Rows | None = None
    buffers: Buffers | None = None
    fed: jax.Array | None = None
    labels: jax.Array | None = None
    sums: Sums | None = None


class Lane(NamedTuple):
    """One lane of a device's cell at a tick (`StageTicks`, [tick, device, lane] arrays): scalars."""

    kind: jax.Array
    unit: jax.Array
    micro: jax.Array
    lag: jax.Array
    version: jax.Array
    act_slot: jax.Array
    input_slot: jax.Array
    residual_slot: jax.Array
    cot_slot: jax.Array


class Operands(NamedTuple):
    """What one op's piece reads: its unit's rows (the body at the version its op reads), model
    and heads' state; its input row `x` from the activation slot (units after the first), the
    batch's `first_input` (the first unit), the micro-batch's `image` and `label`; the cotangent
    of its output (`cot`, backward ops); its residual row (`residual` [1, width], 'carry')."""

    rows: Rows
    model_state: jax.Array
    head_state: jax.Array | None
    x: jax.Array
    first_input: jax.Array
    image: jax.Array
    label: jax.Array
    cot: jax.Array | None
    residual: jax.Array | None


class Results(NamedTuple):
    """What one op's piece gives back: the output row sent to the next unit (`act`) and the
    input's cotangent sent back (`cot`) (zeros where it sends none), its residual row (written
    back where it was read), its gradients, its unit's new model and heads' state, its `Sums`."""

    act: jax.Array
    cot: jax.Array
    residual: jax.Array | None
    grads: Rows
    model_state: jax.Array
    head_state: jax.Array | None
    sums: Sums


# ====================================================================== the pieces
# One piece per op kind: `piece(rt, u, kind)` is the branch of an op of that kind of unit u,
# `Operands` -> `Results`, built on the kind's declared flags (`cdpjax.kinds.OpKind`). No
# collectives inside. A cell of several ops runs their pieces one after another in one branch.


def forward_piece(rt: "_Runtime", u: int, kind: op_kinds.OpKind):
    """A unit's forward of one micro-batch ('carry': keeping its `jax.vjp` residuals)."""
    (j,) = rt.place.units[u]
    lay, last = rt.layouts, u == rt.place.U - 1

    def branch(ops: Operands) -> Results:
        out = rt.results(ops)
        p = lay.params.unpack_one(u, ops.rows.body)[0]
        s = lay.model_state.unpack_one(u, ops.model_state)[0]
        x = rt.stage_input(u, ops)
        if rt.carry:
            y, residuals, (new_state, metrics) = rt.ops.forward_residuals(j, p, s, x, ops.label)
            out = out._replace(residual=_write_leaves(ops.residual, residuals))
        elif last and lay.model_state.sizes[u] == 0:  # the backward computes the loss; nothing to run
            return out
        else:
            y, (new_state, metrics) = rt.ops.run(j, p, s, x, ops.label)
        if last and rt.carry:  # recomputing backwards count the loss where they compute it
            out = out._replace(sums=out.sums._replace(metrics=metrics))
        out = out._replace(model_state=lay.model_state.pack_one(u, [new_state]))
        if not last:
            out = out._replace(act=lay.acts.pack_one(u + 1, y))
        return out
    return branch


def backward_piece(rt: "_Runtime", u: int, kind: op_kinds.OpKind):
    """A backward op of unit u: the parameter gradient where the kind completes it in this
    program (B of a whole backward, W of a split one), the input cotangent where the kind sends
    it (B). The op that sends the cotangent counts the loss it recomputes."""
    (j,) = rt.place.units[u]
    lay = rt.layouts
    want = (("params",) if kind.completes_gradient(rt.program.split_backward) else ()) + \
        (("input",) if kind.cotangent else ())

    def branch(ops: Operands) -> Results:
        out = rt.results(ops)
        p = lay.params.unpack_one(u, ops.rows.body)[0]
        s = lay.model_state.unpack_one(u, ops.model_state)[0]
        x = rt.stage_input(u, ops)
        cotangent = lay.acts.unpack_one(u + 1, ops.cot) if u < rt.place.U - 1 else None
        residuals = None
        if rt.carry:
            residuals = lambda template: _read_leaves(ops.residual, template)  # noqa: E731
        d_params, d_input, metrics = rt.ops.backward(j, p, s, x, ops.label, cotangent, residuals, want)
        if d_params is not None:
            out = out._replace(grads=out.grads._replace(body=lay.params.pack_one(u, [d_params])))
        if d_input is not None:
            out = out._replace(cot=lay.acts.pack_one(u, d_input))
        if metrics is not None and kind.cotangent:
            out = out._replace(sums=out.sums._replace(metrics=metrics))
        return out
    return branch


def local_piece(rt: "_Runtime", u: int, kind: op_kinds.OpKind):
    """Local learning: unit u's modules one after another, each on its own local loss (`local`'s
    stage step)."""
    lay, stages, last = rt.layouts, rt.place.units[u], u == rt.place.U - 1

    def branch(ops: Operands) -> Results:
        out = rt.results(ops)
        bodies = lay.params.unpack_one(u, ops.rows.body)
        heads = lay.head.unpack_one(u, ops.rows.head)
        states = lay.model_state.unpack_one(u, ops.model_state)
        head_states = lay.head_state.unpack_one(u, ops.head_state)
        x = rt.stage_input(u, ops)
        grads_body, grads_head, new_states, new_head_states = [], [], [], []
        stage_loss = out.sums.stage_loss
        for k, j in enumerate(stages):
            g_body, g_head, x, s, hs, loss, acc = stage_grads(
                rt.net, rt.heads, j, bodies[k], heads[k], states[k], head_states[k], x, ops.label, ops.image)
            if k + 1 < len(stages):  # the next module runs here: its head may follow it (pre-update)
                hs = rt.heads.follow(j, heads[k], hs, bodies[k + 1])
            grads_body.append(g_body)
            grads_head.append(g_head)
            new_states.append(s)
            new_head_states.append(hs)
            stage_loss = stage_loss.at[j].set(loss)
        sums = out.sums._replace(stage_loss=stage_loss,
                                 stage_valid=out.sums.stage_valid.at[jnp.asarray(stages)].set(1.0))
        if last:  # x: the network's outputs
            sums = sums._replace(metrics=rt.ops.metrics(x, ops.label))
        else:
            out = out._replace(act=lay.acts.pack_one(u + 1, x))
        return out._replace(grads=Rows(lay.params.pack_one(u, grads_body), lay.head.pack_one(u, grads_head)),
                            model_state=lay.model_state.pack_one(u, new_states),
                            head_state=lay.head_state.pack_one(u, new_head_states), sums=sums)
    return branch


# An op kind's piece, by the kind's name: a new kind adds its registration (`cdpjax.kinds`) and its piece here.
PIECES = {op_kinds.FORWARD.name: forward_piece, op_kinds.BACKWARD.name: backward_piece,
          op_kinds.WEIGHT.name: backward_piece, op_kinds.LOCAL.name: local_piece}


def _flags(flag: str) -> np.ndarray:
    """[codes] bool: the op kinds (by `kind_codes()`, 0 idle) whose `OpKind` has `flag` set."""
    codes = kind_codes()
    out = np.zeros((max(codes.values()) + 1,), bool)
    for name, code in codes.items():
        out[code] = bool(getattr(op_kinds.lookup(name), flag))
    return out


# ===================================================================== the runtime


@dataclasses.dataclass(frozen=True)
class _Place:
    """Where the units live: `units[u]` its stages; U units on D devices, V per device;
    `unit_at[d, v]` the unit at (device, chunk) (-1 where a device holds fewer); `chunk_of[u]`."""

    units: tuple[tuple[int, ...], ...]
    U: int
    V: int
    D: int
    unit_at: np.ndarray
    chunk_of: np.ndarray

    @classmethod
    def of(cls, place) -> "_Place":
        U = len(place.units)
        unit_at = np.full((place.devices, place.chunks), -1, np.int32)
        for u in range(U):
            unit_at[place.device[u], place.chunk[u]] = u
        return cls(place.units, U, place.chunks, place.devices, unit_at, np.asarray(place.chunk, np.int32))


@dataclasses.dataclass(frozen=True)
class _Shapes:
    """One data group's shapes: `groups` data groups, micro-batches of `micro` examples, the
    batch input's and the labels' `ShapeDtypeStruct` of one micro-batch."""

    groups: int
    micro: int
    input: jax.ShapeDtypeStruct
    label: jax.ShapeDtypeStruct


@dataclasses.dataclass(frozen=True)
class _Axes:
    """The mesh and the axes a device's values vary over (`stage`, and `data` where the mesh has it)."""

    mesh: Any
    names: tuple[str, ...]
    data: bool


class _Runtime:
    """The pieces of one built layout (a class only to share the set-up; every piece is a pure function).

    Its parts: `program` (the lowered table), `rules`, `net` / `heads` / `optimizers` (`Rows`),
    `place` (`_Place`), `shapes` (`_Shapes`), `axes` (`_Axes`), `layouts` (the carrier's rows),
    `ops` (the stage maths)."""

    def __init__(self, ctx, method, program: Program, rules: Rules, net, heads, optimizers: Rows, groups, micro):
        self.ctx, self.name, self.program, self.rules = ctx, method, program, rules
        self.net, self.heads, self.optimizers = net, heads, optimizers
        names = ("stage", "data") if "data" in ctx.mesh.axis_names else ("stage",)
        self.axes = _Axes(ctx.mesh, names, "data" in names)
        label_shape = tuple(ctx.task.label_shape(tuple(net.input_shape)))
        self.shapes = _Shapes(groups, micro,
                              jax.ShapeDtypeStruct((micro, *net.input_shape), jnp.dtype(net.input_dtype)),
                              jax.ShapeDtypeStruct((micro, *label_shape), jnp.dtype(ctx.task.label_dtype)))
        self.place = _Place.of(program.placement)
        self.ops = StageOps(net, 1.0 / program.microbatches, lambda x: varying(x, self.axes.names), ctx.task)
        self.carry = program.carries
        codecs = compress.Codecs.from_config(ctx.config)
        program = self.program = compress.with_codecs(program, codecs)
        # each entry of a boundary's message by its codec (the image beside an activation goes as it is)
        self.codecs = {"acts": codecs.activations, "cots": codecs.cotangents, "image": codecs.of("image")}
        # what the scan reads: compiled from the program's events, the only description of what it runs
        self.ticks: StageTicks = program_ticks(program)
        # some cell runs ops of different steps (cdp-mp's paired forwards: a forward beside the
        # previous step's backward), which the runtime then gates lane by lane
        lags = np.where(self.ticks.kind > 0, self.ticks.lag, -1).reshape(-1, self.ticks.lanes)
        self.mixed_steps = any(len(set(row[row >= 0].tolist())) > 1 for row in lags)
        self.layouts = self._layouts()
        if self.carry:  # a forward's branch writes its residuals unconditionally: every forward must have a slot
            ticks = self.ticks
            backprop_forward = _flags("forward")[ticks.kind] & ~_flags("backward")[ticks.kind]
            if np.any(ticks.residual_slot[backprop_forward] < 0):
                raise AssertionError(f"{method}: a forward with no residual slot (residuals='carry')")

    @property
    def lag(self) -> int:
        return self.program.lag

    # ------------------------------------------------------------------ layouts

    def _layouts(self) -> _Layouts:
        params, state = jax.eval_shape(lambda: self.net.init(jax.random.key(0)))
        per_unit = lambda tree: [[tree[j] for j in stages] for stages in self.place.units]  # noqa: E731
        acts = carriers.ActLayout.from_shapes([self._inputs()[stages[0]].shape[1:] for stages in self.place.units])
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
        outputs = self.net.stage_output_shapes(self.shapes.micro)
        return [self.shapes.input] + [jax.ShapeDtypeStruct(s, jnp.float32) for s in outputs[:-1]]

    def residual_sizes(self) -> list[int]:
        """Per unit, the elements of one micro-batch's kept residuals."""
        params, state = jax.eval_shape(lambda: self.net.init(jax.random.key(0)))

        def trace_inside(probe):
            def fn():
                probe(lambda tree: varying(tree, self.axes.names))
                return varying(jnp.zeros((1,)), self.axes.names)
            jax.eval_shape(jax.shard_map(fn, mesh=self.axes.mesh, in_specs=(), out_specs=P(self.axes.names),
                                         check_vma=True))

        shapes = self.ops.residual_shapes(params, state, self._inputs(), self.shapes.label, trace_inside)
        return [int(sum(math.prod(a.shape) for a in shapes[j])) for (j,) in self.place.units]

    def rows(self, layout: carriers.FlatLayout, trees_per_unit) -> jax.Array:
        """[D, V, width]: each device's units as its rows (zeros where it holds fewer)."""
        zero = jnp.zeros((layout.width,), jnp.float32)
        return jnp.stack([jnp.stack([layout.pack_one(u, trees_per_unit[u]) if u >= 0 else zero for u in row])
                          for row in self.place.unit_at.tolist()])

    def unrows(self, layout: carriers.FlatLayout, rows) -> list:
        """Per stage, from [D, V, width] rows."""
        out = [None] * self.net.num_stages
        place = self.program.placement
        for u, stages in enumerate(self.place.units):
            for j, tree in zip(stages, layout.unpack_one(u, rows[place.device[u], place.chunk[u]])):
                out[j] = tree
        return out

    # ------------------------------------------------------------------ branches

    def no_sums(self) -> Sums:
        L = self.net.num_stages
        return Sums(self.ops.no_metrics(), jnp.zeros((L,), jnp.float32), jnp.zeros((L,), jnp.float32))

    def results(self, ops: Operands) -> Results:
        """What every piece starts from (and an idle lane gives): zeros, and the model states and
        the residual row as they were read."""
        lay, mb = self.layouts, self.shapes.micro
        zeros = lambda layout: None if layout is None else jnp.zeros((layout.width,), jnp.float32)  # noqa: E731
        return Results(act=jnp.zeros((mb, lay.acts.width), jnp.float32),
                       cot=jnp.zeros((mb, lay.acts.width), jnp.float32), residual=ops.residual,
                       grads=Rows(zeros(lay.params), zeros(lay.head)), model_state=ops.model_state,
                       head_state=ops.head_state, sums=self.no_sums())

    def stage_input(self, u, ops: Operands):
        return ops.first_input if u == 0 else self.layouts.acts.unpack_one(u, ops.x)

    def branches(self) -> list:
        """Per cell of the program (`StageTicks.cells`; the first idle), the branch that runs its
        lanes' pieces one after another, an idle lane giving back what it read."""
        lanes = self.ticks.lanes

        def cell_branch(cell):
            pieces = [PIECES[name](self, u, op_kinds.lookup(name)) for name, u in cell]
            pieces += [self.results] * (lanes - len(cell))
            return lambda ops: varying(tuple(piece(o) for piece, o in zip(pieces, ops)), self.axes.names)

        return [cell_branch(cell) for cell in self.ticks.cells]

    # ------------------------------------------------------------------ the tick

    def _operands(self, c: StageState, lane: Lane, images, labels) -> Operands:
        """What the op of one lane reads."""
        v = jnp.asarray(self.place.chunk_of)[lane.unit]
        buf = c.buffers
        read = lambda a, slot: a[jnp.maximum(slot, 0)]  # noqa: E731
        batch_image = images[lane.micro]
        first_input = batch_image
        if buf.input is not None:  # a backward op's first-unit input of an earlier call, kept where its forward ran
            kept = (lane.input_slot >= 0) & ~jnp.asarray(_flags("forward"))[lane.kind]
            first_input = jnp.where(kept, read(buf.input, lane.input_slot), batch_image)
        image = batch_image
        if buf.image is not None:  # heads that reconstruct it read the micro-batch's image at every unit
            image = jnp.where(lane.unit == 0, batch_image, read(buf.image, lane.act_slot))
        body = c.rows.body[v]
        if c.previous is not None:
            body = jnp.where(lane.version == 1, c.previous[v], body)
        return Operands(
            rows=Rows(body, None if c.rows.head is None else c.rows.head[v]), model_state=c.model_state[v],
            head_state=None if c.head_state is None else c.head_state[v], x=read(buf.acts, lane.act_slot),
            first_input=first_input, image=image, label=labels[lane.lag][lane.micro],
            cot=None if buf.cots is None else read(buf.cots, lane.cot_slot),
            # the op's slot row: a forward writes it, backward ops read it, the others give it back unchanged
            residual=None if buf.residuals is None else read(buf.residuals, lane.residual_slot)[None])

    def _tick(self, c: StageState, x, fed, images, labels, branches, apply_updates):
        """One tick on one device: its cell's ops, the messages, the updates the table gives.
        `fed[h]`: the batch of h calls ago was fed; `labels[h]`: its labels."""
        me = lax.axis_index("stage")
        lanes = [Lane(*(x[name][me, k] for name in LANE_FIELDS)) for k in range(self.ticks.lanes)]
        forward = jnp.asarray(_flags("forward"))
        if self.rules.model_state == "step_mean":  # the last step's mean update lands before its first forward
            for lane in lanes:
                v = jnp.asarray(self.place.chunk_of)[lane.unit]
                land = forward[lane.kind] & fed[lane.lag] & (lane.micro == 0)
                c = c._replace(model_state=c.model_state.at[v].add(jnp.where(land, c.state_sums[v], 0.0)),
                               state_sums=c.state_sums.at[v].set(jnp.where(land, 0.0, c.state_sums[v])))
        operands = tuple(self._operands(c, lane, images, labels) for lane in lanes)
        cell = x["cell"][me]
        if self.mixed_steps:  # a cell's lanes of different steps: each runs where its own step was fed
            fed_lanes = [(lane.kind > 0) & fed[lane.lag] for lane in lanes]
            valid = (cell > 0) & functools.reduce(jnp.logical_or, fed_lanes)
        else:  # a cell's lanes are ops of one step: the whole cell runs or none of it
            valid = (cell > 0) & fed[lanes[0].lag]
            fed_lanes = [valid & (lane.kind > 0) for lane in lanes]
        outs = lax.switch(jnp.where(valid, cell, 0), branches, varying(operands, self.axes.names))
        if self.mixed_steps:  # a lane whose step was not fed gives what an idle lane gives
            outs = tuple(jax.tree.map(lambda a, b, keep=keep: jnp.where(keep, a, b), out, self.results(ops))
                         for out, ops, keep in zip(outs, operands, fed_lanes))
        buf = c.buffers
        # lanes in reverse: a lane with no op (trailing) writes back the residual row it read before
        # an op's lane writes its own, so an empty lane's slot 0 never undoes a real write
        for lane, ops, out, here in reversed(list(zip(lanes, operands, outs, fed_lanes))):
            v = jnp.asarray(self.place.chunk_of)[lane.unit]
            if buf.input is not None:
                slot = jnp.where(forward[lane.kind] & (lane.unit == 0), lane.input_slot, -1)
                at = jnp.maximum(slot, 0)
                buf = buf._replace(input=buf.input.at[at].set(
                    jnp.where(here & (slot >= 0), ops.first_input, buf.input[at])))
            if self.carry:  # the row read above, as the op left it, back where it was read (no select)
                buf = buf._replace(residuals=lax.dynamic_update_slice(
                    buf.residuals, out.residual, (jnp.maximum(lane.residual_slot, 0), 0)))
            c = c._replace(grads=jax.tree.map(lambda g, d: g.at[v].add(d), c.grads, out.grads))
            c = self._model_state(c, v, out, here & forward[lane.kind])
            if c.head_state is not None:
                new_hs = lax.pmean(out.head_state, "data") if self.axes.data else out.head_state
                c = c._replace(head_state=c.head_state.at[v].set(jnp.where(here, new_hs, c.head_state[v])))
            c = c._replace(sums=jax.tree.map(jnp.add, c.sums, out.sums))
        # a cell sends at most one output and one cotangent (the lowering checks): the lanes' sum is it
        act = functools.reduce(jnp.add, [out.act for out in outs])
        cot = functools.reduce(jnp.add, [out.cot for out in outs])
        c = c._replace(buffers=self._messages(buf, act, cot, operands[0].image, x, me))
        if apply_updates:
            c = self._updates(c, x, me, fed)
        return c, None

    def _model_state(self, c: StageState, v, out: Results, forward) -> StageState:
        """The running averages after a lane's op: a forward's update applied ('sequential'), or added
        to the step's mean ('step_mean'); data groups' averaged (linear, so at every tick)."""
        rows = c.model_state
        new, update = out.model_state, out.model_state - rows[v]
        if self.axes.data:
            new, update = lax.pmean((new, update), "data")
        if self.rules.model_state == "step_mean":
            scale = 1.0 / self.program.microbatches
            return c._replace(state_sums=c.state_sums.at[v].add(jnp.where(forward, update * scale, 0.0)))
        return c._replace(model_state=rows.at[v].set(jnp.where(forward, new, rows[v])))

    def _messages(self, buf: Buffers, act, cot, image, x, me) -> Buffers:
        """Each boundary's message of this tick, at its own size: a unit's output (with its image,
        for heads that reconstruct it) to the next unit's device, a cotangent back."""
        lay = self.layouts
        for b, (src, dst) in enumerate(self.ticks.boundaries):
            width = math.prod(lay.acts.shapes[b + 1])
            message = {"acts": act[:, :width]}
            if buf.image is not None:
                message["image"] = image
            arrived = _gated_permute(message, x["send_act"][b], src, dst, self.axes.names, self.codecs)
            buf = _deliver(buf, arrived, x["recv_act"][b], (me == dst) & (x["send_act"][b] > 0), lay.acts.width)
            if buf.cots is not None:
                back = _gated_permute({"cots": cot[:, :width]}, x["send_cot"][b], dst, src, self.axes.names,
                                      self.codecs)
                buf = _deliver(buf, back, x["recv_cot"][b], (me == src) & (x["send_cot"][b] > 0), lay.acts.width)
        return buf

    def _updates(self, c: StageState, x, me, fed) -> StageState:
        """Units whose update the table gives at this tick apply it (gradients averaged over `data`)."""
        grads = c.grads
        if self.axes.data:  # only at ticks where some unit updates: a loop, so that no collective sits in a branch
            zeros = jax.tree.map(lambda g: varying(jnp.zeros(g.shape, g.dtype), "stage"), c.grads)
            grads = lax.fori_loop(0, x["any_update"], lambda _, g: lax.pmean(c.grads, "data"), zeros)
        rows, opt_state, new_grads, previous = c.rows, c.opt_state, c.grads, c.previous
        for v in range(self.place.V):
            apply = x["update"][me, v] & fed[x["update_lag"][me, v]]
            for part, tx in self.optimizers._asdict().items():
                if tx is None:
                    continue

                def step(row, state, grad, tx=tx):
                    return optim.apply(tx, row, state, grad)

                def keep(row, state, grad):
                    return row, state

                row, part_opt, part_grads = getattr(rows, part), getattr(opt_state, part), getattr(new_grads, part)
                new, new_opt = lax.cond(apply, step, keep, row[v], jax.tree.map(lambda a: a[v], part_opt),
                                        getattr(grads, part)[v])
                rows = rows._replace(**{part: row.at[v].set(new)})
                opt_state = opt_state._replace(**{part: jax.tree.map(lambda a, b: a.at[v].set(b), part_opt, new_opt)})
                new_grads = new_grads._replace(**{part: part_grads.at[v].set(jnp.where(apply, 0.0, part_grads[v]))})
            if previous is not None:
                previous = previous.at[v].set(jnp.where(apply, c.rows.body[v], previous[v]))
        return c._replace(rows=rows, opt_state=opt_state, grads=new_grads, previous=previous)

    # -------------------------------------------------------------------- state

    def init_state(self, rng) -> StageState:
        """The train state (what checkpoints hold; `loop_state` gives its per-device view inside a
        call): rows per device and chunk, optimizer states, and (layouts that keep work in flight between
        calls) the slot buffers, gradient sums and which calls fed."""
        lay, prog = self.layouts, self.program
        params, model_state = self.net.init(rng)
        per_unit = lambda tree: [[tree[j] for j in stages] for stages in self.place.units]  # noqa: E731
        rows = Rows(body=self.rows(lay.params, per_unit(params)))
        head_state = None
        if self.heads is not None:
            from cdpjax.methods.local import HEADS_KEY

            head_params, head_state = self.heads.init(jax.random.fold_in(rng, HEADS_KEY))
            rows = rows._replace(head=self.rows(lay.head, per_unit(head_params)))
            head_state = self.rows(lay.head_state, per_unit(head_state))
        model_state = self.rows(lay.model_state, per_unit(model_state))
        state = StageState(
            rows=rows,
            opt_state=Rows(*(None if r is None else jax.vmap(jax.vmap(tx.init))(r)
                             for r, tx in zip(rows, self.optimizers))),
            model_state=model_state, head_state=head_state,
            previous=jnp.copy(rows.body) if prog.versions == 2 else None,  # step 0 reads theta_0 from either
            state_sums=jnp.zeros_like(model_state) if self.rules.model_state == "step_mean" else None)
        if self.lag:
            # the labels of the last `lag` batches: an op of an earlier step reads them here
            state = state._replace(
                fed=jnp.zeros((self.lag,), bool),
                labels=jnp.zeros((self.lag, self.ctx.config.global_batch_size, *self.shapes.label.shape[1:]),
                                 self.shapes.label.dtype),
                buffers=Buffers(**{k: jnp.zeros(self._global(k, a.shape), a.dtype)
                                   for k, a in self.buffer_shapes().items()}))
        if prog.grads_in_flight:
            state = state._replace(grads=Rows(*(
                None if r is None else jnp.zeros((self.place.D, self.shapes.groups, *r.shape[1:]), jnp.float32)
                for r in rows)))
        return state

    def _global(self, name, shape):
        """A buffer's shape over all devices and data groups. The data groups' examples are rows of
        the example axis (so that ppll's in-flight batches restore onto another number of data
        groups); carried residuals are flat rows, one per group."""
        if name == "residuals":
            return (self.place.D, shape[0], self.shapes.groups, *shape[1:])
        return (self.place.D, shape[0], self.shapes.groups * shape[1], *shape[2:])

    def buffer_shapes(self) -> dict:
        """One device's (one data group's) slot buffers, as the program declares them."""
        lay, tk, mb = self.layouts, self.ticks, self.shapes.micro
        declared = {b.name for b in self.program.buffers}
        image = tuple(self.net.input_shape)
        shapes = {"acts": ((tk.act_slots, mb, lay.acts.width), jnp.float32),
                  "input": ((tk.input_slots, mb, *image), self.shapes.input.dtype),
                  "image": ((tk.act_slots, mb, *image), jnp.float32),
                  "cots": ((tk.cot_slots, mb, lay.acts.width), jnp.float32),
                  "residuals": ((tk.residual_slots, lay.residual_width), jnp.float32)}
        return {k: jax.ShapeDtypeStruct(s, d) for k, (s, d) in shapes.items() if k in declared}

    def specs(self, state: StageState) -> StageState:
        """`P('stage')` for the rows; what each data group keeps in flight split over `data`."""
        data = "data" if self.axes.data else None
        specs = jax.tree.map(lambda _: P("stage"), state)
        if state.buffers is not None:
            specs = specs._replace(buffers=jax.tree.map(lambda _: P("stage", None, data), state.buffers))
        if state.grads is not None:
            specs = specs._replace(grads=jax.tree.map(lambda _: P("stage", data), state.grads))
        if state.fed is not None:
            specs = specs._replace(fed=P(), labels=P(None, data))
        return specs

    def loop_state(self, state: StageState) -> StageState:
        """One device's view of the train state, the scan's carry (inside `shard_map`: leading axes of size 1)."""
        M, mb = self.program.microbatches, self.shapes.micro
        one = lambda tree: jax.tree.map(lambda a: a[0], tree)  # noqa: E731
        c = StageState(rows=one(state.rows), opt_state=one(state.opt_state), model_state=one(state.model_state),
                       head_state=one(state.head_state), previous=one(state.previous),
                       state_sums=one(state.state_sums))
        if self.lag:
            b = state.buffers
            c = c._replace(buffers=one(b._replace(residuals=None if b.residuals is None else b.residuals[:, :, 0])),
                           fed=state.fed,
                           labels=state.labels.reshape(self.lag, M, mb, *self.shapes.label.shape[1:]))
        if self.program.grads_in_flight:
            c = c._replace(grads=jax.tree.map(lambda a: a[0, 0], state.grads))
        return c

    def train_state(self, c: StageState) -> StageState:
        """`loop_state`'s inverse: the train state of one device."""
        M, mb = self.program.microbatches, self.shapes.micro
        one = lambda tree: jax.tree.map(lambda a: a[None], tree)  # noqa: E731
        state = StageState(rows=one(c.rows), opt_state=one(c.opt_state), model_state=one(c.model_state),
                           head_state=one(c.head_state), previous=one(c.previous), state_sums=one(c.state_sums))
        if self.lag:
            b = one(c.buffers)
            state = state._replace(
                buffers=b._replace(residuals=None if b.residuals is None else b.residuals[:, :, None]),
                fed=c.fed, labels=c.labels.reshape(self.lag, M * mb, *self.shapes.label.shape[1:]))
        if self.program.grads_in_flight:
            state = state._replace(grads=jax.tree.map(lambda a: a[None, None], c.grads))
        return state

    # ------------------------------------------------------------------ periods

    def _period(self, c: StageState, step, branches, apply_updates):
        """One period (one call's ticks) on one device."""
        images_p, labels_p, fed_now = step
        M, mb, names = self.program.microbatches, self.shapes.micro, self.axes.names
        label_shape = self.shapes.label.shape[1:]
        if not self.lag:  # nothing in flight between calls: the buffers are this call's temporaries
            c = c._replace(buffers=Buffers(**varying(jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),
                                                                  self.buffer_shapes()), names)))
        if not self.program.grads_in_flight:  # every gradient of the period is applied within it
            c = c._replace(grads=varying(jax.tree.map(jnp.zeros_like, c.rows), names))
        c = c._replace(sums=varying(self.no_sums(), names))
        batch_images = images_p.reshape(M, mb, *images_p.shape[1:])
        batch_labels = labels_p.reshape(M, mb, *label_shape)[None]
        fed = fed_now[None] if c.fed is None else jnp.concatenate([fed_now[None], c.fed])
        labels = batch_labels if c.labels is None else jnp.concatenate([batch_labels, c.labels])
        xs = jax.tree.map(jnp.asarray, self.ticks.arrays())
        c, _ = lax.scan(lambda c, x: self._tick(c, x, fed, batch_images, labels, branches, apply_updates), c, xs)
        if c.previous is not None:  # after a flush both versions are the newest, as at step 0
            c = c._replace(previous=jnp.where(fed_now, c.previous, c.rows.body))
        if self.lag:
            c = c._replace(fed=fed[:-1], labels=labels[:-1])
        sums = lax.psum(c.sums.metrics, names)
        stage_loss, stage_valid = lax.psum((c.sums.stage_loss, c.sums.stage_valid), "stage")
        if self.axes.data:
            stage_loss, stage_valid = lax.pmean((stage_loss, stage_valid), "data")
        out = {**self.ops.finish(sums), "stage_loss": stage_loss, "stage_valid": stage_valid > 0}
        if not apply_updates:
            out["grads"] = lax.pmean(c.grads, "data") if self.axes.data else c.grads
        c = c._replace(sums=None)
        if not self.lag:
            c = c._replace(buffers=None)
        if not self.program.grads_in_flight:
            c = c._replace(grads=None)
        return c, out

    def local_run(self, state, images, labels, feeding, apply_updates=True):
        """S periods on one device (inside `shard_map`): images [S, B_group, ...], feeding [S]."""
        branches = self.branches()
        c, metrics = lax.scan(lambda c, step: self._period(c, step, branches, apply_updates),
                              self.loop_state(state), (images, labels, feeding))
        grads = metrics.pop("grads", None)
        if grads is not None:
            metrics["grads"] = jax.tree.map(lambda a: a[-1][None], grads)
        return self.train_state(c), metrics

    def run(self, state, images, labels, feeding, apply_updates=True):
        """S periods in one program: images [S, B, ...], labels [S, B], feeding [S] bool."""
        specs = self.specs(state)
        batch = P(None, "data") if self.axes.data else P()
        metric_specs = {name: P() for name in (*self.ctx.task.metric_names, "metric_sums", "stage_loss", "stage_valid")}
        if not apply_updates:
            metric_specs["grads"] = jax.tree.map(lambda _: P("stage"), state.rows)
        sharded = jax.shard_map(lambda s, x, y, f: self.local_run(s, x, y, f, apply_updates), mesh=self.axes.mesh,
                                in_specs=(specs, batch, batch, P()), out_specs=(specs, metric_specs), check_vma=True)
        return sharded(state, images, labels, feeding)

    # ------------------------------------------------------------------- method

    def method(self, shown: TimeTable) -> Method:
        mesh, cfg = self.axes.mesh, self.ctx.config
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
                images = np.zeros((self.lag, B, *self.net.input_shape), self.shapes.input.dtype)
                labels = np.zeros((self.lag, B, *self.shapes.label.shape[1:]), self.shapes.label.dtype)
                return run(state, images, labels, np.zeros((self.lag,), bool))[0]

        def export(state):
            params = self.unrows(self.layouts.params, state.rows.body)
            ms = state.model_state if state.state_sums is None else state.model_state + state.state_sums
            return params, self.unrows(self.layouts.model_state, ms)

        gradients = None
        if not self.lag:
            @jax.jit
            def gradients(state, batch):
                """The step's gradient per stage, no update (the equality tests)."""
                _, metrics = self.run(state, batch["image"][None], batch["label"][None], np.ones((1,), bool),
                                      apply_updates=False)
                return self.unrows(self.layouts.params, metrics["grads"].body)

        export_heads = None
        if self.heads is not None:
            export_heads = lambda state: self.unrows(self.layouts.head, state.rows.head)  # noqa: E731
        padding = self.layouts.padding_report()
        print(f"cdpjax: {self.name}: {self.net.num_stages} stages as {self.place.U} units on {self.place.D} devices x "
              f"{self.shapes.groups} data groups, {self.program.microbatches} micro-batch(es) of {self.shapes.micro} "
              f"per step, {self.ticks.act_slots} activation slot(s); {carriers.format_report(padding)}")
        return Method(self.name, self.net, init, train_step, export, flush=flush, table=shown, run_steps=run_steps,
                      carrier=self.layouts, devices=self.place.D * self.shapes.groups,
                      # in-flight micro-batches are rows of a data group's slice only when a step has one
                      state_depends_on_mesh=bool(self.lag) and self.program.microbatches > 1,
                      program=self.program, periods=run, gradients=gradients, heads=self.heads,
                      export_heads=export_heads, padding=padding)


def _gated_permute(message: dict, go, src: int, dst: int, axes, codecs: dict):
    """`message` from device `src` to `dst` of the stage axis when `go` (0 or 1, the same on every
    device) is 1; nothing is sent when it is 0. Each entry crosses encoded by its codec
    (`codecs[name]`, `cdpjax.compress`) and is decoded where it arrives, so the permute carries the
    codec's wire dtype. A boundary within one device is the message itself (a copy, not encoded)."""
    if src == dst:
        return message
    wire = {name: codecs[name].encode(value) for name, value in message.items()}
    zeros = varying(jax.tree.map(jnp.zeros_like, wire), axes)
    arrived = lax.fori_loop(0, go, lambda _, m: lax.ppermute(wire, "stage", [(src, dst)]), zeros)
    return {name: codecs[name].decode(arrived[name], value) for name, value in message.items()}


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


def _deliver(buf: Buffers, arrived: dict, slot, write, width: int) -> Buffers:
    """The arrived message stored in `slot` of its buffers where `write`; activations and
    cotangents padded back to the carrier's rows of `width`."""
    at = jnp.maximum(slot, 0)
    for name, value in arrived.items():
        if name in ("acts", "cots"):
            value = jnp.pad(value, ((0, 0), (0, width - value.shape[1])))
        held = getattr(buf, name)
        buf = buf._replace(**{name: held.at[at].set(jnp.where(write, value, held[at]))})
    return buf


__all__ = ["MODEL_STATE", "PIECES", "RESIDUALS", "Buffers", "Operands", "Results", "Rows", "Rules", "StageState",
           "Sums", "build", "check_mesh"]
