"""The ring engine: one CDP worker per device, the table's steady-state period as one scan.

Timing and update rule are the table's (CDP's, `cdpjax.layouts.cdp`, or any other cyclic
table): the engine runs the lowered `Program` of the table it is given
(`cdpjax.program.ring`: T ticks from worker 0's start of a step, T = 2L with whole
backwards, 3L with split ones, more where a table's steps end idle) in ONE `shard_map`
over the `data` axis, the period one `lax.scan` over its ticks (a `train_step` is one
period, `run_steps` scans over periods). The per-tick routing is data
(`cdpjax.program.ring.RingRouting`, integer arrays indexed by tick and `axis_index`,
compiled from the program's events alone: `program_period`), so
the compiled program holds each stage's op once per position of a tick whatever the
worker count N (its sends grow with the messages of a tick: at most L x lags groups);
at tick t each device reads its op and runs it by a `lax.switch` over the (kind, stage)
pairs, each branch the maths of one op in natural shapes (nothing padded); a stage's
maths is `cdpjax.methods.stage_ops`'s:

- F, forward of stage j: reads the stage's parameters at the version its event
  names (`Compute.version`, a depth below the newest the worker stores: CDP's plans
  apply each update between the worker's last read of the old version and its
  first of the new, so one stored version serves them; a table whose reads reach
  further back makes each worker keep that many, `RingState.older`, each apply
  shifting the stack), its input (the image for stage 0, else the
  previous stage's output), writes the next stage's input; with `residuals='carry'`
  it also keeps the stage's `jax.vjp` residuals; the last stage's forward computes
  the loss.
- B, backward of stage j: recomputes the stage from its stashed input
  (`residuals='recompute'`) or rebuilds the pullback from the kept residuals
  ('carry', whose FLOPs are then DP's) and writes the input's cotangent for the
  next tick; with whole backwards it also adds its gradient to the partial sum it
  received (pool offset `op_read`, or starts one) and writes it at offset `op_write`.
- W (split backwards): the weight gradient of stage j from the same input or
  residuals and the cotangent its B read, added to the partial sum it received. A
  split backward makes every tick about one forward's cost, so the lockstep of
  the SPMD program (a tick lasts as long as its slowest op) no longer waits for a
  whole backward at every tick.
- messages: a `lax.switch` over the period's ticks indexed by the scan's counter
  (the same branch on every device; `SENDS_BY_TICK`, branch t at tick t), each
  branch that tick's static `lax.ppermute`s, one per (stage, lag) sent, whose
  `perm` holds exactly the (src, dst) pairs that send it then, of that stage's real
  size (a stage's gradient raveled to one vector: one permute per message, the same
  bytes); a device in no pair sends nothing. No other collective but the psum of
  the three metric scalars, and with rings side by side over `data` (`ring_mesh`)
  one psum over `data` of each completed sum (`Period._combine`).
- codecs: each message crosses encoded by `compress.gradients` (`cdpjax.compress`) and is
  decoded where it arrives; with a lossy codec the worker that completes a sum holds it as
  its receivers get it (`Period._settle`) before it applies it, so every copy of the
  parameters takes the same update ('none': nothing added, bit for bit). With
  `compress.feedback`, a worker adds to each partial sum it sends, and to each sum it
  completes, what the codec dropped from its last one of that stage (kept in the train
  state: the next step's message on the route carries it).
- applies: per device, per stage, a `lax.cond` (that stage's update or nothing) before
  the sends and after them, from the sum at its pool offset; every worker applies the
  same optax update (`cdpjax.optim.apply`) to its own copy.

Gradient buffers are keyed (kind, stage, lag), lag = how many calls ago the step was
fed; each worker keeps its own in one flat pool (`cdpjax.program.ring.RingPool`: a
buffer at an offset chosen for that worker over the ticks it lives, so a worker holds
what it needs at once, not every sum any worker has in flight). The pool is the
in-flight part of the train state, passed from call to call as it is (a buffer living a
period or more is moved on at the period's end). `flush` runs `max_lag` periods with
nothing fed (their ops idle, their updates masked), so that the parameters account for
every batch fed; training on after a flush restarts the cycle from the flushed parameters.

Memory: a switch's result is a new buffer in XLA (a branch writing into an operand copies
it first), so no switch returns the pool or the parameters: the ops run as one switch a
stage returning that stage's buffers and its gradient row, the sends as one switch a
stage returning the rows received, and the rows are written into the pool outside them
(in place); each in-place write depends on the applies that read the pool before it.
With rings side by side (`_combine`) or a lossy codec (`_settle`) the pool passes
through a switch (one copy more). docs/measured.md gives the compile time, program size
and held bytes against N.
`Buffers`, `forward_op` and the pieces are the unrolled form's, which cdp-zero's
period (`cdpjax.methods.cdp_zero`) still runs.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cdpjax import optim
from cdpjax.compress import CODECS, Codec, Codecs, with_codecs
from cdpjax.errors import ConfigError
from cdpjax.kinds import completes_gradient, lookup
from cdpjax.methods.common import Method, varying
from cdpjax.methods.stage_ops import StageOps
from cdpjax.train_state import typed_state
from cdpjax.program import Program
from cdpjax.program.ring import (SENDS_BY_TICK, RingPool, RingRouting, RingTicks, lower_ring, program_period, ring_pool,
                                 ring_routing, with_pool)
from cdpjax.xla_cpu import use_canonical_cpu_convolutions

WORKERS = "worker"  # a ring's N workers, one per device: every message of the period runs on this axis
RINGS = "data"  # rings side by side, each fed its share of the batch: their completed sums combined over it
AXIS = (RINGS, WORKERS)  # what every value of a worker's period varies over (its specs: P(AXIS))


@dataclasses.dataclass(frozen=True)
class Stages:
    """A staged net's ops and shapes for micro-batches of `micro` examples, one worker each.

    ops: the stage maths (`StageOps`, the last stage's loss divided by the worker count, so
    that the ring's sum of worker gradients is their mean). inputs[j]: stage j's input shape
    (inputs[0] the images'); outputs[j]: its output. residuals: per stage, the
    ShapeDtypeStructs of the leaves a forward keeps for its backward ops ('carry').
    """

    ops: StageOps
    micro: int
    inputs: tuple
    outputs: tuple
    residuals: tuple | None = None
    input_dtype: Any = jnp.float32
    label_shape: tuple = ()
    label_dtype: Any = jnp.int32  # the task's (`Task.label_dtype`)

    @property
    def L(self) -> int:
        return self.ops.net.num_stages


def make_stages(net, workers: int, micro: int, mesh, residuals: str, task) -> Stages:
    """`Stages` of micro-batches of `micro` examples, the loss divided by `workers` (every worker of
    every ring: their summed gradients are the mean); `mesh` the period's (`ring_mesh`)."""
    outputs = tuple(tuple(s) for s in net.stage_output_shapes(micro))
    inputs = ((micro, *net.input_shape), *outputs[:-1])
    stages = Stages(StageOps(net, 1.0 / workers, lambda x: varying(x, AXIS), task), micro, inputs, outputs,
                    input_dtype=jnp.dtype(net.input_dtype), label_shape=tuple(task.label_shape(tuple(net.input_shape))),
                    label_dtype=jnp.dtype(task.label_dtype))
    if residuals == "recompute":
        return stages
    params, state = jax.eval_shape(lambda: net.init(jax.random.key(0)))

    def trace_inside(probe):  # inside shard_map, with device-varying inputs as in the tick
        def fn():
            probe(lambda tree: varying(tree, AXIS))
            return varying(jnp.zeros((1,)), AXIS)
        jax.eval_shape(jax.shard_map(fn, mesh=mesh, in_specs=(), out_specs=P(AXIS), check_vma=True))

    shapes = [jax.ShapeDtypeStruct(s, stages.input_dtype if j == 0 else jnp.float32) for j, s in enumerate(inputs)]
    labels = jax.ShapeDtypeStruct((micro, *stages.label_shape), stages.label_dtype)
    found = stages.ops.residual_shapes(params, state, shapes, labels, trace_inside)
    return dataclasses.replace(stages, residuals=found)


# ------------------------------------------------------------------- the pieces
# One piece per op kind: `piece(stages, j, carry, ...)` gives the (run, skip) branches of
# the op's `lax.cond`, each over one typed operand (`ForwardIn`, `BackwardIn`); `skip` returns
# the buffers the op writes as they are.


class ForwardWrites(NamedTuple):
    """The buffers a forward writes besides its model state: the next stage's input (None at the
    last stage) and the kept residuals (None without 'carry')."""

    next: Any = None
    residuals: Any = None


class ForwardIn(NamedTuple):
    """A forward piece's operand: the stage's parameters (cdp-zero: its relay row, joined in the
    branch that computes), model state, input, labels, and the buffers it writes as they are."""

    params: Any
    model_state: Any
    x: Any
    labels: Any
    old: ForwardWrites


class ForwardOut(NamedTuple):
    """A forward piece's result: what it wrote, the stage's model state, the metric sums it adds."""

    writes: ForwardWrites
    model_state: Any
    metrics: Any


class BackwardIn(NamedTuple):
    """A gradient piece's operand (`backward_operands`): the stage's parameters, model state, input,
    kept residuals (() without 'carry'), the output's cotangent (`seed`; a zero at the last stage),
    labels; the running sum it adds to (`partial`) and, for B, the input's cotangent buffer as it is
    (`cot`, passed through at stage 0 and where it does not run)."""

    params: Any
    model_state: Any
    x: Any
    residuals: Any
    seed: Any
    labels: Any
    partial: Any = None
    cot: Any = None


class BackwardOut(NamedTuple):
    """A gradient piece's result: the running sum with its gradient added (as it was where it adds
    none), the input's cotangent (None for W)."""

    partial: Any
    cot: Any = None


def forward_piece(stages: Stages, j: int, carry: bool):
    """F: `ForwardIn` -> `ForwardOut` (the next stage's input, kept residuals, model state, metrics)."""
    last, ops = j == stages.L - 1, stages.ops

    def run(i: ForwardIn) -> ForwardOut:
        residuals = i.old.residuals
        if carry:
            out, residuals, (ms, metrics) = ops.forward_residuals(j, i.params, i.model_state, i.x, i.labels)
        else:
            out, (ms, metrics) = ops.run(j, i.params, i.model_state, i.x, i.labels)
        return varying(ForwardOut(ForwardWrites(i.old.next if last else out, residuals), ms, metrics), AXIS)

    def skip(i: ForwardIn) -> ForwardOut:
        return varying(ForwardOut(i.old, i.model_state, ops.no_metrics()), AXIS)

    return run, skip


def _backward(stages: Stages, j: int, carry: bool, want: tuple[str, ...]):
    def gradients(p, ms, x, residuals, seed, labels):
        d_params, d_input, _ = stages.ops.backward(j, p, ms, x, labels, seed, residuals if carry else None, want)
        return d_params, d_input
    return gradients


def backward_piece(stages: Stages, j: int, carry: bool, split: bool, start: bool):
    """B: `BackwardIn` -> `BackwardOut` (partial + its gradient (the gradient alone where `start`),
    the input's cotangent); with split backwards only the cotangent (the partial passes through)."""
    gradients = _backward(stages, j, carry, ("input",) if split else ("params", "input"))

    def run(i: BackwardIn) -> BackwardOut:
        d_params, d_input = gradients(i.params, i.model_state, i.x, i.residuals, i.seed, i.labels)
        partial = i.partial
        if not split:
            partial = d_params if start else jax.tree.map(jnp.add, partial, d_params)
        return varying(BackwardOut(partial, d_input if j > 0 else i.cot), AXIS)

    def skip(i: BackwardIn) -> BackwardOut:
        return varying(BackwardOut(jax.tree.map(jnp.zeros_like, i.params) if start and not split else i.partial,
                                   i.cot), AXIS)

    return run, skip


def weight_piece(stages: Stages, j: int, carry: bool, start: bool):
    """W: `BackwardIn` -> `BackwardOut` (partial + its gradient (the gradient alone where `start`), no
    cotangent)."""
    gradients = _backward(stages, j, carry, ("params",))

    def run(i: BackwardIn) -> BackwardOut:
        d_params, _ = gradients(i.params, i.model_state, i.x, i.residuals, i.seed, i.labels)
        return varying(BackwardOut(d_params if start else jax.tree.map(jnp.add, i.partial, d_params)), AXIS)

    def skip(i: BackwardIn) -> BackwardOut:
        return varying(BackwardOut(jax.tree.map(jnp.zeros_like, i.params) if start else i.partial), AXIS)

    return run, skip


# ------------------------------------------------------------------ the period


def _member(me, workers, n):
    mask = np.zeros((n,), bool)
    mask[list(workers)] = True
    return jnp.asarray(mask)[me]


def _tie(out, dep):
    """`out` with `dep` (a zero) added to its first leaf: a data dependency."""
    leaves, tree = jax.tree.flatten(out)
    leaves[0] = leaves[0] + dep.astype(leaves[0].dtype)
    return jax.tree.unflatten(tree, leaves)


class Buffers:
    """One worker's buffers by name, each cond that reads them noted, so that a cond writing a
    buffer in place runs after every cond that read its old value.

    Why: XLA's copy insertion orders a conditional that updates a buffer in place only after
    the instructions it depends on; a read of the old value by another conditional with no
    data path to the writer makes it copy the whole buffer (measured: 2x a stage's parameters
    and momentum per update, and fragmentation). The writer therefore takes a zero made from
    each reader's output (`where(isfinite(x), x, 0) * 0`, which no simplifier folds) and adds
    it to its first output in the branch that computes: exact, and NaN-safe.
    """

    def __init__(self, values: dict, tie_ticks: bool = False):
        self.values = dict(values)
        self.readers: dict = {}
        self.written: set = set()
        self.tie_ticks = tie_ticks
        self._after = None

    def __getitem__(self, name):
        return self.values[name]

    def __setitem__(self, name, value):
        self.values[name] = value
        self.readers.pop(name, None)
        self.written.add(name)

    def after_previous_tick(self):
        """A float32 zero that depends on every buffer the previous tick wrote (`tie_ticks=True`;
        a zero of no dependency in the first tick): added to an operand, it keeps XLA from moving
        that op before the previous tick. Why: a value no tick has changed yet is the call's
        input, and the fences alone let XLA hoist every op on such values to the first tick
        (measured on cdp-zero: every gather sent at the first tick, its messages held)."""
        if not self.tie_ticks:
            raise ValueError("Buffers(tie_ticks=False) keeps no zero of the previous tick")
        return self._after if self._after is not None else jnp.zeros((), jnp.float32)

    def cond(self, pred, run, skip, operands, reads=(), writes=()):
        """`lax.cond(pred, run, skip, *operands)`, ordered after the readers of `writes`; its
        outputs are noted as readers of `reads`."""
        deps = [d for name in writes for d in self.readers.pop(name, [])]
        if deps:
            dep = sum(deps[1:], deps[0])
            out = lax.cond(pred, lambda d, *ops: _tie(run(*ops), d), lambda d, *ops: skip(*ops), dep, *operands)
        else:
            out = lax.cond(pred, run, skip, *operands)
        self.note(reads, out)
        return out

    def barrier(self):
        """Ends a tick: nothing of the next tick is scheduled before everything of this one
        (XLA would otherwise interleave ticks and stretch the in-flight buffers' lives)."""
        names = list(self.values)
        fenced = [self.values[n] for n in names]
        if self.tie_ticks:  # made before the fence and passed through it, or XLA loses the order
            fenced.append(sum((zero_of(self.values[n]) for n in names if n in self.written),
                              self.after_previous_tick()))
        fenced = lax.optimization_barrier(fenced)
        if self.tie_ticks:
            self._after = fenced.pop()
        self.values = dict(zip(names, fenced))
        self.readers = {}
        self.written = set()

    def note(self, names, out):
        if not names:
            return
        zero = zero_of(out)
        for name in names:
            self.readers.setdefault(name, []).append(zero)


def zero_of(value):
    """A float32 zero computed from `value`'s first element (`where(isfinite(x), x, 0) * 0`, which no
    simplifier folds and no NaN gets through): a data dependency on `value` that costs one element."""
    leaves = [leaf for leaf in jax.tree.leaves(value) if leaf.size]
    if not leaves:  # nothing computed to wait for
        return jnp.zeros((), jnp.float32)
    x = leaves[0].reshape(-1)[0].astype(jnp.float32)
    return jnp.where(jnp.isfinite(x), x, 0.0) * 0.0


def _pick(bufs: Buffers, pred, name, new):
    """Buffer `name` becomes `new` where pred; elsewhere it stays, in place."""
    bufs[name] = bufs.cond(pred, lambda a, b: varying(a, AXIS), lambda a, b: varying(b, AXIS), (new, bufs[name]),
                           writes=(name,))


def forward_op(b: Buffers, j: int, pred, images, new_labels, piece, params, L: int, carry: bool):
    """F of stage j where pred: `piece` (run, skip) over the parameters in buffer `params` (the
    ring's own stored version, cdp-zero's relay row), the stage's input, its labels; writes the
    next stage's input, the kept residuals (carry) and the model state, adds the metrics."""
    x = images if j == 0 else b[("acts", j)]
    labels = new_labels if j == 0 else b[("labels",)]
    writes = ([("acts", j + 1)] if j < L - 1 else []) + ([("residuals", j)] if carry else []) + [("model_state", j)]
    old = ForwardWrites(b[("acts", j + 1)] if j < L - 1 else None, b[("residuals", j)] if carry else None)
    reads = [params, ("model_state", j)] + ([("acts", j), ("labels",)] if j > 0 else [])
    forward_in = ForwardIn(b[params], b[("model_state", j)], x, labels, old)
    out: ForwardOut = b.cond(pred, *piece, (forward_in,), reads, writes)
    if j < L - 1:
        b[("acts", j + 1)] = out.writes.next
    if carry:
        b[("residuals", j)] = out.writes.residuals
    b[("model_state", j)] = out.model_state
    b[("metrics",)] = b[("metrics",)] + out.metrics
    if j == 0:  # a new micro-batch: its image (stage 0's input) and labels stay until its backward
        _pick(b, pred, ("acts", 0), images)
        _pick(b, pred, ("labels",), new_labels)


def backward_operands(b: Buffers, j: int, params, L: int, carry: bool) -> tuple[BackwardIn, list]:
    """What a backward op of stage j reads (`BackwardIn`, the parameters from buffer `params`; its
    partial and cot for the caller to set) and their buffer names."""
    zero = varying(jnp.zeros((), jnp.float32), AXIS)
    residuals = b[("residuals", j)] if carry else ()
    seed = b[("cots", j)] if j < L - 1 else zero
    reads = [params, ("model_state", j), ("acts", j), ("labels",)] + ([("residuals", j)] if carry else []) \
        + ([("cots", j)] if j < L - 1 else [])
    return BackwardIn(b[params], b[("model_state", j)], b[("acts", j)], residuals, seed, b[("labels",)]), reads


class RingState(NamedTuple):
    """One worker's buffers while a period runs (the scan's carry): per stage its parameters,
    optimizer state, model state, input (`acts`), output cotangent (`cots`, stages 0..L-2),
    kept residuals (`residuals`, empty unless 'carry'); the labels of its micro-batch; its gradient
    pool (`grads`, `RingPool`: one vector); the metric sums of the period; per
    stage, with error feedback, what the codec dropped from the worker's last partial sum and
    last completed sum of that stage ([2, ...]: row 0 the partial, row 1 the sum; else empty);
    per stage, where the program's ops read versions before the newest, the older versions it
    stores (`older`, [V - 1, ...] each leaf, row 0 the one before `params`; else empty)."""

    params: tuple
    opt_state: tuple
    model_state: tuple
    acts: tuple
    cots: tuple
    residuals: tuple
    labels: Any
    grads: tuple
    metrics: Any
    feedback: tuple = ()
    older: tuple = ()


class Flat:
    """A stage's gradient as one vector where its leaves share a dtype (a message is then one
    `ppermute`, whatever the stage's leaf count; the same bytes), else as its tree."""

    def __init__(self, like):
        leaves, self.tree = jax.tree.flatten(like)
        self.shapes = [leaf.shape for leaf in leaves]
        self.dtypes = [leaf.dtype for leaf in leaves]
        self.flat = len({leaf.dtype for leaf in leaves}) == 1 and len(leaves) > 1

    def pack(self, tree):
        if not self.flat:
            return tree
        return jnp.concatenate([leaf.reshape(-1) for leaf in jax.tree.leaves(tree)])

    def unpack(self, value):
        if not self.flat:
            return value
        sizes = np.cumsum([int(np.prod(s)) for s in self.shapes])[:-1]
        parts = jnp.split(value, sizes)
        return jax.tree.unflatten(self.tree, [x.reshape(s) for x, s in zip(parts, self.shapes)])

    @property
    def size(self) -> int:
        return int(sum(np.prod(s, dtype=np.int64) for s in self.shapes))

    def read(self, pool, offset):
        """The stage's gradient (as `pack` gives it) from its `size` elements of `pool` at `offset`."""
        row = lax.dynamic_slice(pool, (offset,), (self.size,))
        if self.flat:
            return row.astype(self.dtypes[0])
        leaves, at = [], 0
        for shape, dtype in zip(self.shapes, self.dtypes):
            n = int(np.prod(shape, dtype=np.int64))
            leaves.append(row[at:at + n].reshape(shape).astype(dtype))
            at += n
        return jax.tree.unflatten(self.tree, leaves)

    def row(self, value, dtype):
        """The stage's gradient `value` (as `pack` gives it) as the pool holds it: one vector of `dtype`."""
        return jnp.concatenate([leaf.reshape(-1).astype(dtype) for leaf in jax.tree.leaves(value)])

    def write(self, pool, offset, value):
        """`pool` with the stage's gradient `value` (as `pack` gives it) at `offset`."""
        return lax.dynamic_update_slice(pool, self.row(value, pool.dtype), (offset,))


def _at(tree, slot):
    return jax.tree.map(lambda a: a[slot], tree)


def _put(tree, slot, value):
    return jax.tree.map(lambda a, v: a.at[slot].set(v), tree, value)


def _set(items: tuple, j: int, value) -> tuple:
    return items[:j] + (value,) + items[j + 1:]


class OpInputs(NamedTuple):
    """What an op of the period reads besides the worker's buffers: the call's images and labels
    (a forward of stage 0 takes them), the pool offset of the partial sum a gradient op adds to
    (`read`) or whether it starts one (`start`), and the depth below the newest stored version of
    the parameters it reads (`depth`: the program's, plus the step's `ReadDepths`)."""

    images: Any
    labels: Any
    read: Any
    start: Any
    depth: Any


class StageWrites(NamedTuple):
    """What an op of one stage may write (`Period._written`), None where the stage has no such
    buffer: its model state, the metric sums; stage 0's input (the images) and labels; the next
    stage's input (`next`); the previous stage's output cotangent (`cot`); the kept residuals
    ('carry'); where the stage has a gradient op at that position, the gradient row it computed
    (zeros where none) and whether it computed one (`wrote`)."""

    model_state: Any
    metrics: Any
    images: Any = None
    labels: Any = None
    next: Any = None
    cot: Any = None
    residuals: Any = None
    wrote: Any = None
    row: Any = None


class ReadDepths(NamedTuple):
    """Per-step read depths added to the period's own (`Period`): worker w's op of stage j for step
    k reads `depths[row(k), w, j]` versions deeper than the program says, row(k) = k for k < R
    (R = len(depths)), then `repeat_from` + (k - repeat_from) mod (R - repeat_from): the rows from
    `repeat_from` on cycle. A forward and its backward share the step's depth."""

    depths: np.ndarray  # [R, workers, stages] ints >= 0
    repeat_from: int


def depth_row(step, rows: int, repeat_from: int):
    """`ReadDepths`' row of `step` (a traced int)."""
    cycle = max(rows - repeat_from, 1)
    return jnp.where(step < rows, step, repeat_from + (step - repeat_from) % cycle)


class Period:
    """The per-device program of one period: `Period(...)(state, images, labels, feeding) ->
    (state, [3] metric sums)`. `state` is one worker's: params, opt_state, model_state (per
    stage), acts (each stage's input), cots (each stage's output cotangent), residuals (carry),
    labels, grads (the worker's gradient pool, `RingPool`), fed (per lag >= 1).

    The period is one `lax.scan` over its T ticks (`RingState` the carry), the routing data
    (`cdpjax.program.ring.RingRouting`, indexed by tick and `axis_index`): per tick each worker
    runs its ops (a `lax.switch` over the (kind, stage) pairs of that position, an op of a step
    not fed idle), its applies from the sums held before the sends (a switch over stages), the
    tick's sends (a switch over ticks, indexed by the scan's counter, the same on every
    device: each branch the tick's static `ppermute`s of real stage sizes), its applies from the
    sums received. The program holds each op's piece once per position, whatever N.
    """

    def __init__(self, stages: Stages, program: Program, tx, rings: int = 1, codec: Codec = CODECS["none"],
                 feedback: bool = False, ticks: RingTicks | None = None, read_depths: ReadDepths | None = None):
        carry = program.carries
        self.read_depths = read_depths
        self.stages, self.program, self.tx, self.carry = stages, program, tx, carry
        self.rings, self.codec, self.feedback = rings, codec, feedback and not codec.lossless
        # the period its events say, not the lowering's own (`ticks`: already compiled from them)
        self.ticks: RingTicks = program_period(program) if ticks is None else ticks
        self.split = program.split_backward
        self.routing: RingRouting = ring_routing(self.ticks)
        self.versions = self.ticks.stored_versions
        params = jax.eval_shape(lambda: stages.ops.net.init(jax.random.key(0)))[0]
        self.flat = [Flat(p) for p in params]
        self.pool: RingPool = ring_pool(self.ticks, self.routing, [f.size for f in self.flat])
        self.pool_dtype = jnp.result_type(*jax.tree.leaves(params)) if jax.tree.leaves(params) else jnp.float32
        self._stage_ops()
        self.apply_branches = [self._apply(j) for j in range(self.ticks.stages)] + [
            lambda params, opt, grads, offset: varying((params, opt), AXIS)]
        self._stage_sends()
        self.combine_branches = [self._combine(t, tk) for t, tk in enumerate(self.ticks.ticks)]
        self.settle_branches = [self._settle(t, tk) for t, tk in enumerate(self.ticks.ticks)]

    def _stage_ops(self):
        """Per position k of a tick's ops and stage j, the switch over the op kinds stage j runs at k
        (`stage_branches[k][j]`, its last branch idle; None where none) and its branch per (tick,
        worker) (`stage_branch[k][j]`: the idle one where the worker's k-th op is another stage's).
        Why one switch per stage: a switch's result is a new buffer in XLA (a branch that writes
        into an operand copies it first), so each returns only its stage's buffers and the gradient
        row it computed, which is written into the pool outside it."""
        r, L = self.routing, self.ticks.stages
        self.stage_branches, self.stage_branch = [], []
        for k, kinds in enumerate(r.op_kinds):
            at_k = [[kind for kind, s in kinds if s == j] for j in range(L)]
            self.stage_branches.append([[self._stage_op(kind, j, k) for kind in at_k[j]] + [self._stage_op(None, j, k)]
                                        if at_k[j] else None for j in range(L)])
            index = np.full((L, *r.op_branch.shape[:2]), 0, np.int32)
            for j in range(L):
                index[j] = len(at_k[j])
            for t, w in zip(*np.nonzero(r.op_branch[:, :, k] < len(kinds))):
                kind, j = kinds[r.op_branch[t, w, k]]
                index[j, t, w] = at_k[j].index(kind)
            self.stage_branch.append(index)

    def _stage_op(self, kind, j: int, k: int):
        """The branch running op `kind` of stage j (None: idle), returning what it writes of stage j's
        buffers (`_written`) and, where stage j has a gradient op at position k, its gradient row
        (zeros where this branch computes none) and whether it computed one."""
        op = self._op(kind, j) if kind is not None else (lambda c, i: (c, None))
        size = self.flat[j].size
        has_row = any(completes_gradient(kd, self.split) for kd, s in self.routing.op_kinds[k] if s == j)

        def run(c: RingState, i: OpInputs) -> StageWrites:
            new, row = op(c, i)
            out = self._written(j, new)
            if has_row:
                out = out._replace(wrote=jnp.asarray(row is not None),
                                   row=row if row is not None else jnp.zeros((size,), self.pool_dtype))
            return varying(out, AXIS)
        return run

    def _written(self, j: int, c: RingState) -> StageWrites:
        """What an op of stage j may write (`StageWrites`, None where stage j has no such buffer)."""
        L = self.ticks.stages
        return StageWrites(c.model_state[j], c.metrics, images=c.acts[0] if j == 0 else None,
                           labels=c.labels if j == 0 else None, next=c.acts[j + 1] if j < L - 1 else None,
                           cot=c.cots[j - 1] if j > 0 else None, residuals=c.residuals[j] if self.carry else None)

    def _take(self, c: RingState, j: int, out: StageWrites, write) -> RingState:
        """`c` with stage j's op's writes (`_stage_op`'s result); its gradient row at pool offset `write`
        where it computed one (the pool updated in place, outside any switch)."""
        acts = c.acts
        if out.images is not None:
            acts = _set(acts, 0, out.images)
        if out.next is not None:
            acts = _set(acts, j + 1, out.next)
        c = c._replace(acts=acts, model_state=_set(c.model_state, j, out.model_state), metrics=out.metrics,
                       labels=out.labels if out.labels is not None else c.labels)
        if out.cot is not None:
            c = c._replace(cots=_set(c.cots, j - 1, out.cot))
        if out.residuals is not None:
            c = c._replace(residuals=_set(c.residuals, j, out.residuals))
        if out.row is not None:
            c = c._replace(grads=_put_row(c.grads, write, out.row, out.wrote))
        return c

    def _stage_sends(self):
        """Per stage with messages, the switch over ticks that sends them (`send_branches[j]`, branch t
        at tick t: that tick's static `ppermute`s of stage j) and where each received row goes:
        `send_to[j][t, m, w]` the offset of the m-th message's buffer on worker w (its sender reads it
        there, its receivers write it there), `send_got[j][t, m, w]`
        whether w receives it. One switch a stage, returning the received rows, for `_stage_ops`'s
        reason: the pool is written outside it."""
        T, N, L = self.ticks.period_ticks, self.ticks.workers, self.ticks.stages
        by_stage = [[[] for _ in range(T)] for _ in range(L)]
        for t, tk in enumerate(self.ticks.ticks):
            for j, lag, pairs in tk.partials:
                by_stage[j][t].append((("partial", j, lag), [pairs]))
            for j, lag, pairs, _ in tk.sums:  # a worker may send one sum to two others in a tick: two permutes
                by_stage[j][t].append((("sum", j, lag), _rounds(pairs)))
        self.send_branches, self.send_to, self.send_got = {}, {}, {}
        for j in range(L):
            rows = max(len(m) for m in by_stage[j])
            if not rows:
                continue
            at, got = np.zeros((T, rows, N), np.int32), np.zeros((T, rows, N), bool)
            for t, messages in enumerate(by_stage[j]):
                for m, (name, rounds) in enumerate(messages):
                    at[t, m] = self.pool.at.get((t, name), 0)  # where its sender reads it and its receivers put it
                    got[t, m, [d for r in rounds for _, d in r]] = True
            self.send_branches[j] = [self._sends(j, by_stage[j][t], rows) for t in range(T)]
            self.send_to[j], self.send_got[j] = at, got

    # -- one op of the device, in its natural shapes
    def _op(self, kind: str, j: int):
        if lookup(kind).forward:
            return self._forward(j)
        return self._gradient_op(kind, j)

    def _forward(self, j: int):
        stages, carry, L = self.stages, self.carry, self.ticks.stages
        ops = stages.ops

        def run(c: RingState, i: OpInputs):
            images, new_labels = i.images, i.labels
            x = images if j == 0 else c.acts[j]
            labels = new_labels if j == 0 else c.labels
            residuals, params = c.residuals, self._version(c, j, i.depth)
            if carry:
                out, mine, (ms, metrics) = ops.forward_residuals(j, params, c.model_state[j], x, labels)
                residuals = _set(residuals, j, mine)
            else:
                out, (ms, metrics) = ops.run(j, params, c.model_state[j], x, labels)
            acts = _set(c.acts, j + 1, out) if j < L - 1 else c.acts
            if j == 0:  # a new micro-batch: its image (stage 0's input) and labels stay until its backward
                acts = _set(acts, 0, images)
            c = c._replace(acts=acts, residuals=residuals, model_state=_set(c.model_state, j, ms),
                           metrics=c.metrics + metrics, labels=new_labels if j == 0 else c.labels)
            return c, None
        return run

    def _gradient_op(self, kind: str, j: int):
        """B (the input's cotangent to cots[j-1]; with whole backwards also the gradient) or W (the
        gradient only): (c, the gradient added to the partial sum at pool offset `read` (or a new sum
        where `start`), as a pool row; None without a gradient)."""
        L, carry = self.ticks.stages, self.carry
        cotangent = lookup(kind).cotangent
        gradient = completes_gradient(kind, self.split)
        want = (("params",) if gradient else ()) + (("input",) if cotangent else ())

        def run(c: RingState, i: OpInputs):
            seed = c.cots[j] if j < L - 1 else varying(jnp.zeros((), jnp.float32), AXIS)
            residuals = c.residuals[j] if carry else None
            d_params, d_input, _ = self.stages.ops.backward(j, self._version(c, j, i.depth), c.model_state[j],
                                                            c.acts[j], c.labels, seed, residuals, want)
            if cotangent and j > 0:
                c = c._replace(cots=_set(c.cots, j - 1, d_input))
            if not gradient:
                return c, None
            flat = self.flat[j]
            partial = flat.unpack(flat.read(c.grads, i.read))
            total = jax.tree.map(lambda s, d: jnp.where(i.start, d, s + d), partial, d_params)
            return c, flat.row(flat.pack(total), self.pool_dtype)
        return run

    def _apply(self, j: int):
        tx = self.tx

        def run(params, opt, grads, offset):  # only what an apply touches: the switch copies no other buffer
            p, o = optim.apply(tx, params[j], opt[j], self.flat[j].unpack(self.flat[j].read(grads, offset)))
            return varying((_set(params, j, p), _set(opt, j, o)), AXIS)
        return run

    def _offset(self, t: int, name, me):
        """Where worker `me` keeps gradient buffer `name` at tick t (`RingPool.at`)."""
        return jnp.asarray(self.pool.at.get((t, name), np.zeros((self.ticks.workers,), np.int64)))[me]

    def _sends(self, j: int, messages: list, rows: int):
        """Stage j's messages of one tick, each a static `ppermute` of the sender's buffer read from its
        pool at `offsets[m]`: (`rows` rows, the m-th what message m brings its receivers (anything
        elsewhere: `send_got` masks its write; zeros past the tick's messages), the stage's
        error-feedback rows)."""
        N, flat = self.ticks.workers, self.flat[j]

        def run(grads, feedback, offsets, me):
            out = []
            for m, (name, rounds) in enumerate(messages):
                held = flat.read(grads, offsets[m])
                if self.feedback and name[0] == "partial":  # the sender adds what its last partial dropped
                    senders = _member(me, [src for r in rounds for src, _ in r], N)
                    held, kept = self._with_feedback(held, _at(feedback, 0))
                    feedback = _put(feedback, 0, jax.tree.map(functools.partial(jnp.where, senders), kept,
                                                              _at(feedback, 0)))
                wire = self.codec.encode_tree(held)
                sent = [self.codec.decode_tree(lax.ppermute(wire, WORKERS, list(r)), held) for r in rounds]
                value = sent[0]
                for r, got in zip(rounds[1:], sent[1:]):  # each receiver takes the round that reaches it
                    value = jax.tree.map(functools.partial(jnp.where, _member(me, [d for _, d in r], N)), got, value)
                out.append(flat.row(value, self.pool_dtype))
            out += [jnp.zeros((flat.size,), self.pool_dtype)] * (rows - len(out))
            return varying((tuple(out), feedback), AXIS)
        return run

    def _with_feedback(self, held, kept):
        """(held + kept, what the codec drops of it): the message with what the last one on its
        route dropped added, and what this one drops (`compress.feedback_encode`)."""
        total = jax.tree.map(jnp.add, held, kept)
        return total, jax.tree.map(jnp.subtract, total, self.codec.decode_tree(self.codec.encode_tree(total), total))

    def _combine(self, t: int, tk):
        """Each sum completed at this tick made the sum over the rings (one `psum` over `RINGS`
        per stage and step) before any worker applies it or passes it on: the same worker of every
        ring completes it at the same tick, so every ring then applies the gradient of the whole
        batch. The other workers keep what their slot holds."""
        def run(grads, me):
            for c in sorted(tk.completes):
                flat, offset = self.flat[c.stage], self._offset(t, ("sum", c.stage, c.lag), me)
                held = flat.read(grads, offset)
                summed = lax.psum(held, RINGS)
                grads = flat.write(grads, offset, jax.tree.map(functools.partial(jnp.where, me == c.worker),
                                                               summed, held))
            return varying(grads, AXIS)
        return run

    def _settle(self, t: int, tk):
        """Each sum completed at this tick held as its receivers will get it, decode(encode(sum))
        (a lossy gradient codec): the worker that completes a sum applies what it sends, so every
        copy of the parameters takes the same update."""
        def run(grads, feedback: tuple, me):
            for c in sorted(tk.completes):
                flat, offset = self.flat[c.stage], self._offset(t, ("sum", c.stage, c.lag), me)
                held = flat.read(grads, offset)
                mine = me == c.worker
                if self.feedback:  # the completing worker adds what its last sum of the stage dropped
                    held_now = held
                    held, kept = self._with_feedback(held, _at(feedback[c.stage], 1))
                    feedback = _set(feedback, c.stage, _put(feedback[c.stage], 1, jax.tree.map(
                        functools.partial(jnp.where, mine), kept, _at(feedback[c.stage], 1))))
                    held = jax.tree.map(functools.partial(jnp.where, mine), held, held_now)
                sent = self.codec.decode_tree(self.codec.encode_tree(held), held)
                grads = flat.write(grads, offset, jax.tree.map(functools.partial(jnp.where, mine), sent, held))
            return varying((grads, feedback), AXIS)
        return run

    def feedback_zeros(self, params) -> list:
        """Per stage, the error-feedback rows a worker starts from ([2, ...] zeros; none without)."""
        if not self.feedback:
            return []
        return [jax.tree.map(lambda a: jnp.zeros((2, *a.shape), a.dtype), self.flat[j].pack(p))
                for j, p in enumerate(params)]

    def __call__(self, state, images, new_labels, feeding):
        ticks, r = self.ticks, self.routing
        me = lax.axis_index(WORKERS)
        valid = jnp.concatenate([jnp.reshape(feeding, (1,)), state.fed])
        table = {name: jnp.asarray(getattr(r, name)) for name in
                 ("op_branch", "op_lag", "op_start", "op_depth", "apply_stage", "apply_lag")}
        table.update(op_read=jnp.asarray(self.pool.op_read), op_write=jnp.asarray(self.pool.op_write),
                     apply_at=jnp.asarray(self.pool.apply_at))
        deeper = self._deeper(state, me)
        c = varying(RingState(tuple(state.params), tuple(state.opt_state), tuple(state.model_state),
                              tuple(state.acts), tuple(state.cots),
                              tuple(state.residuals) if self.carry else (), state.labels,
                              state.grads, self.stages.ops.no_metrics(),
                              tuple(state.feedback) if self.feedback else (),
                              tuple(state.older) if self.versions > 1 else ()), AXIS)

        def tick(c: RingState, t):
            for k, per_stage in enumerate(self.stage_branches):
                at = (t, me, k)
                fed = valid[table["op_lag"][at]]
                for j, branches in enumerate(per_stage):
                    if branches is None:
                        continue
                    branch = jnp.where(fed, jnp.asarray(self.stage_branch[k][j])[t, me], len(branches) - 1)
                    depth = table["op_depth"][at] + (deeper[table["op_lag"][at], j] if deeper is not None else 0)
                    out = lax.switch(branch, branches, c, OpInputs(images, new_labels, table["op_read"][at],
                                                                   table["op_start"][at], depth))
                    c = self._take(c, j, out, table["op_write"][at])
            if self.rings > 1:
                with jax.named_scope(SENDS_BY_TICK):
                    c = c._replace(grads=lax.switch(t, self.combine_branches, c.grads, me))
            if not self.codec.lossless:
                grads, feedback = lax.switch(t, self.settle_branches, c.grads, c.feedback, me)
                c = c._replace(grads=grads, feedback=feedback)
            c = self._applies(c, table, valid, t, me, 0)
            # the applies read the pool: a write into it in place must depend on each (else XLA copies it)
            applied = sum((zero_of(p) for p in c.params), jnp.zeros((), jnp.float32)).astype(self.pool_dtype)
            for j, branches in self.send_branches.items():
                with jax.named_scope(SENDS_BY_TICK):  # bench counts each branch once a period
                    rows, kept = lax.switch(t, branches, c.grads, c.feedback[j] if self.feedback else (),
                                            jnp.asarray(self.send_to[j])[t, :, me], me)
                pool = c.grads
                for m, row in enumerate(rows):
                    pool = _put_row(pool, jnp.asarray(self.send_to[j])[t, m, me], row + applied,
                                    jnp.asarray(self.send_got[j])[t, m, me])
                c = c._replace(grads=pool, feedback=_set(c.feedback, j, kept) if self.feedback else c.feedback)
            c = self._applies(c, table, valid, t, me, 1)
            return c, None

        c, _ = lax.scan(tick, c, jnp.arange(ticks.period_ticks, dtype=jnp.int32))
        # The in-flight buffers go on, their step one call older.
        new = WorkerState(
            params=list(c.params), opt_state=list(c.opt_state), model_state=list(c.model_state), acts=list(c.acts),
            cots=list(c.cots), labels=c.labels,
            grads=self._moved(c.grads, me),  # offsets repeat every period but those `RingPool.moves` moves
            fed=jnp.concatenate([jnp.reshape(feeding, (1,)), state.fed[:-1]]),
            residuals=list(c.residuals) if self.carry else None, feedback=list(c.feedback) if self.feedback else None,
            older=list(c.older) if self.versions > 1 else None,
            step=state.step + 1 if self.read_depths is not None else None)
        return new, c.metrics

    def _deeper(self, state, me):
        """[lag, stage] the per-step depths (`ReadDepths`) of worker `me`'s reads for the step fed
        `lag` calls ago (state.step counts the calls: that step is state.step - lag), or None."""
        if self.read_depths is None:
            return None
        d = self.read_depths
        steps = state.step - jnp.arange(self.ticks.max_lag + 1, dtype=jnp.int32)
        rows = depth_row(jnp.maximum(steps, 0), len(d.depths), d.repeat_from)
        return jnp.asarray(d.depths, jnp.int32)[rows, me]

    def _moved(self, pool, me):
        """`pool` with each buffer held into the next period moved to its place there (`PoolMove`), one
        move after another in an order where no move overwrites a source a later one reads
        (`_move_order`); where none exists, every source read before any target is written."""
        order = _move_order(self.pool.moves)
        if order is None:
            got = [lax.dynamic_slice(pool, (jnp.asarray(m.source)[me],), (m.size,)) for m in self.pool.moves]
        else:
            # Why one at a time: sources all read first are fused by XLA into the writes after the first,
            # which then read the pool as it was, and XLA keeps a whole copy of it (measured: cdp-v1's held
            # memory 2.28x dp's at N = L = 4, its pool held twice; cdp-v2, which moves nothing, 1.19x).
            got = [None] * len(self.pool.moves)
        for i in range(len(self.pool.moves)) if order is None else order:
            m = self.pool.moves[i]
            row = got[i] if got[i] is not None else lax.dynamic_slice(pool, (jnp.asarray(m.source)[me],), (m.size,))
            target = jnp.asarray(m.target)[me]
            row = jnp.where(jnp.asarray(m.held)[me], row, lax.dynamic_slice(pool, (target,), (m.size,)))
            pool = lax.dynamic_update_slice(pool, row, (target,))
        return pool

    def _applies(self, c, table, valid, t, me, phase):
        for a in range(table["apply_stage"].shape[-1]):
            at = (phase, t, me, a)
            stage = jnp.where(valid[table["apply_lag"][at]], table["apply_stage"][at], self.ticks.stages)
            params, opt, older = list(c.params), list(c.opt_state), list(c.older)
            for j in range(self.ticks.stages):
                params[j], opt[j], old = lax.cond(stage == j, self._apply_stage(j), lambda p, o, g, at, v: (p, o, v),
                                                  params[j], opt[j], c.grads, table["apply_at"][at],
                                                  older[j] if older else ())
                if older:
                    older[j] = old
            c = c._replace(params=tuple(params), opt_state=tuple(opt), older=tuple(older))
        return c

    def _apply_stage(self, j: int):
        tx, flat = self.tx, self.flat[j]

        def run(p, o, grads, offset, older):
            new, o = optim.apply(tx, p, o, flat.unpack(flat.read(grads, offset)))
            if self.versions > 1:  # the stack shifts: the version before the newest is the one just replaced
                older = jax.tree.map(lambda a, s: jnp.concatenate([a[None], s[:-1]]), p, older)
            return varying((new, o, older), AXIS)
        return run

    def _version(self, c: RingState, j: int, depth):
        """Stage j's parameters `depth` versions before the newest the worker stores (0: `params`)."""
        if self.versions == 1:
            return c.params[j]
        return jax.tree.map(lambda p, s: jnp.where(depth == 0, p, s[jnp.maximum(depth - 1, 0)]), c.params[j],
                            c.older[j])


def _move_order(moves) -> list[int] | None:
    """An order of the pool's moves in which no move writes over bytes a later move reads (on a worker
    where both move a buffer), or None where they form a cycle."""
    def overlap(a, b, w):  # a's target meets b's source on worker w
        return a.held[w] and b.held[w] and a.target[w] < b.source[w] + b.size and b.source[w] < a.target[w] + a.size

    before = {i: {j for j, b in enumerate(moves) if j != i and any(overlap(a, b, w) for w in range(len(a.held)))}
              for i, a in enumerate(moves)}  # i writes what each j reads: j goes first
    order, done = [], set()
    while len(order) < len(moves):
        ready = [i for i in range(len(moves)) if i not in done and before[i] <= done]
        if not ready:
            return None
        order.append(ready[0])
        done.add(ready[0])
    return order


def _rounds(pairs) -> list[list]:
    """`pairs` cut into rounds with each source and each destination at most once (one
    `ppermute` each), in order."""
    rounds: list[list] = []
    for src, dst in pairs:
        for r in rounds:
            if all(src != s and dst != d for s, d in r):
                r.append((src, dst))
                break
        else:
            rounds.append([(src, dst)])
    return rounds


def _idle(c: RingState, *_):
    return varying(c, AXIS)


def _put_row(pool, offset, row, where):
    """`pool` with `row` at `offset` where `where`, else as it was (a dynamic update in place)."""
    old = lax.dynamic_slice(pool, (offset,), row.shape)
    return lax.dynamic_update_slice(pool, jnp.where(where, row, old), (offset,))


# ------------------------------------------------------------------ the method


class Stash(NamedTuple):
    """A worker's per-stage buffers in natural shapes (the ring's and cdp-zero's): model state, each
    stage's input (`acts`), each stage's output cotangent (`cots`, stages 0..L-2), the labels of its
    micro-batch, and (residuals='carry') the residuals kept from each forward for its backward."""

    model_state: list
    acts: list
    cots: list
    labels: jax.Array
    residuals: list | None = None


def stash_buffers(stages: Stages, model_state, carry: bool) -> Stash:
    """A worker's `Stash` at the start: `model_state` and zeros."""
    zeros = lambda shape, dtype=jnp.float32: jnp.zeros(shape, dtype)  # noqa: E731
    return Stash(
        model_state=model_state,
        acts=[zeros(s, stages.input_dtype if j == 0 else jnp.float32) for j, s in enumerate(stages.inputs)],
        cots=[zeros(s) for s in stages.outputs[:-1]],
        labels=zeros((stages.micro, *stages.label_shape), stages.label_dtype),
        residuals=[[zeros(a.shape, a.dtype) for a in r] for r in stages.residuals] if carry else None)


@typed_state(renamed={"residuals": "kept"})
class WorkerState(NamedTuple):
    """One ring worker's train state between calls (what checkpoints hold, with a leading worker axis).

    params, opt_state: per stage, the newest version the worker holds and its optax state, stepped at
      the ticks the program applies the stage's update. older: per stage, the versions before it that
      the program's ops read (`[V - 1, ...]` each leaf, row 0 the one before `params`; None with one
      version). grads: the worker's gradient pool (`RingPool`, one vector): the sums in flight.
    fed: whether each of the last calls fed a batch (an op of an earlier step runs only if its step
      was fed). model_state, acts, cots, labels, residuals: the `Stash` of per-stage buffers (residuals
      None unless 'carry'). feedback: per stage, what the codec dropped from the worker's last partial
      and completed sums (`[2, ...]`; None without error feedback). step: the calls made, the row
      of the per-step read depths (`ReadDepths`; None when the reads' depths are the program's own).
    """

    params: list
    opt_state: list
    grads: jax.Array
    fed: jax.Array
    model_state: list
    acts: list
    cots: list
    labels: jax.Array
    residuals: list | None = None
    older: list | None = None
    feedback: list | None = None
    step: jax.Array | None = None


def init_state(net, stages: Stages, ticks: RingTicks, tx, rng, carry: bool, pool: int = 0,
               pool_dtype=jnp.float32) -> WorkerState:
    """One worker's state: every worker starts from the same parameters; its gradient pool
    (`RingPool`, `pool` elements) zeros."""
    params, model_state = net.init(rng)
    older = None
    if ticks.stored_versions > 1:  # every older version the initial parameters: a read before version 0 is of 0
        older = [jax.tree.map(lambda a: jnp.broadcast_to(a, (ticks.stored_versions - 1, *a.shape)), p)
                 for p in params]
    return WorkerState(params=params, opt_state=[tx.init(p) for p in params], grads=jnp.zeros((pool,), pool_dtype),
                       fed=jnp.zeros((max(ticks.max_lag, 1),), bool), older=older,
                       **stash_buffers(stages, model_state, carry)._asdict())


def spmd_period(period, stages, mesh):
    """A worker's period (state without its worker axis -> state, metric sums) as the SPMD
    program over `data`: the shard_mapped period, it jitted (one call), and a jitted scan of
    periods over stacked batches (`run_steps`). The ring's and cdp-zero's."""
    def squeeze(tree):
        return jax.tree.map(lambda a: a[0], tree)

    def local_step(state, images, labels, feeding):
        s, sums = period(squeeze(state), images, labels, feeding)
        return jax.tree.map(lambda a: a[None], s), reported(stages, sums)

    def local_run(state, images, labels, feeding):
        s, sums = lax.scan(lambda s, xs: period(s, *xs), squeeze(state), (images, labels, feeding))
        return jax.tree.map(lambda a: a[None], s), jax.vmap(lambda x: reported(stages, x))(sums)

    one_period = jax.shard_map(local_step, mesh=mesh, in_specs=(P(AXIS), P(AXIS), P(AXIS), P()),
                               out_specs=(P(AXIS), P()), check_vma=True)
    run = jax.jit(jax.shard_map(local_run, mesh=mesh, in_specs=(P(AXIS), P(None, AXIS), P(None, AXIS), P()),
                                out_specs=(P(AXIS), P()), check_vma=True))
    return one_period, jax.jit(one_period), run


def ring_mesh(mesh, workers: int):
    """The devices of `mesh` (one `data` axis) as rings of `workers` side by side: the mesh
    (`RINGS`: devices / workers, `WORKERS`: workers), a ring's workers on consecutive devices,
    so that device d * workers + w is worker w of ring d and is fed the batch's rows of
    device d * workers + w under the trainer's `data` sharding."""
    devices = np.asarray(mesh.devices).reshape(-1)
    if devices.size % workers:
        raise ConfigError(f"workers={workers} does not divide the {devices.size} devices: rings of workers={workers} "
                          f"side by side need a multiple of {workers} devices")
    return Mesh(devices.reshape(devices.size // workers, workers), (RINGS, WORKERS))


def build(ctx, name: str, net, table, residuals: str, program: Program | None = None,
          read_depths: ReadDepths | None = None) -> Method:
    """The ring `Method` running `table`'s lowered program (or `program`, a ring program of that
    table, its events as given): rings of `table.workers` workers (one per device) side by side
    over the mesh's `data` devices, each ring fed its share of every global batch; each sum a ring
    completes is summed over the rings before it is applied or passed on (`Period._combine`), so
    every ring applies the update of the whole batch. What runs is the program's events
    (`program_period`). With `read_depths`, each read goes that step's depth deeper than the
    program's (`ReadDepths`): the program keeps as many more versions, the state counts steps."""
    # Long on purpose: the method's closures (init, steps, flush, export) share what is built here.
    use_canonical_cpu_convolutions()  # stages inside cond branches: XLA:CPU's slow path otherwise
    if program is None:
        # refuses a table the ring cannot serve, naming the op
        program = lower_ring(table, residuals, int(np.max(read_depths.depths)) if read_depths is not None else 0)
    ticks: RingTicks = program_period(program)
    tx, N = ctx.optimizer(), ticks.workers
    mesh = ring_mesh(ctx.mesh, N)
    rings = int(mesh.shape[RINGS])
    batch = int(ctx.config.global_batch_size)
    ctx.require_divisible("global_batch_size", batch, N * rings, f"{rings} rings x {N} workers")
    micro = batch // (N * rings)
    carry = program.carries
    stages = make_stages(net, N * rings, micro, mesh, residuals, ctx.task)
    codecs = Codecs.from_config(ctx.config)
    program = with_codecs(program, codecs)
    period = Period(stages, program, tx, rings, codecs.gradients, codecs.feedback, ticks, read_depths)
    program = with_pool(program, period.pool)  # what it holds: each worker's gradient sums in its own pool
    per_worker = NamedSharding(mesh, P(AXIS))
    one_period, step, run = spmd_period(period, stages, mesh)

    def init(rng):
        state = init_state(net, stages, ticks, tx, rng, carry, period.pool.size, period.pool_dtype)
        if period.feedback:
            state = state._replace(feedback=period.feedback_zeros(state.params))
        if read_depths is not None:
            state = state._replace(step=jnp.zeros((), jnp.int32))  # the calls made: `ReadDepths`' row
        # Every worker holds its own copy of everything: a leading axis over (data, worker).
        return jax.device_put(jax.tree.map(lambda a: jnp.broadcast_to(a, (N * rings, *a.shape)), state), per_worker)

    @jax.jit
    def train_step(state, batch):
        return one_period(state, batch["image"], batch["label"], jnp.ones((), bool))

    def run_steps(state, batches):
        """S steps in one program: {'image': [S, B, ...], 'label': [S, B]} -> (state, metrics [S])."""
        feeding = jnp.ones((batches["label"].shape[0],), bool)
        return run(state, batches["image"], batches["label"], feeding)

    def flush(state):
        images = jnp.zeros((batch, *net.input_shape), stages.input_dtype, device=per_worker)
        labels = jnp.zeros((batch, *stages.label_shape), stages.label_dtype, device=per_worker)
        for _ in range(ticks.max_lag):
            state = step(state, images, labels, False)[0]
        return state

    newest = ticks.newest

    def export(state):
        # Stage j from a worker that has applied all its complete updates; running averages
        # (EMA, linear) averaged over workers = averaging them every step.
        params = [jax.tree.map(lambda a, w=newest[j]: a[w], state.params[j]) for j in range(net.num_stages)]
        model_state = jax.tree.map(lambda a: a.mean(0), state.model_state)
        return params, model_state

    return Method(name, net, init, train_step, export, flush, table, program=program, run_steps=run_steps,
                  periods=run, carrier=stages, stale=table.stale, workers=N, devices=N * rings,
                  state_depends_on_mesh=True,
                  report={"impl": "ring", "residuals": residuals, "backward": table.meta.get("ticks", "whole"),
                          "rings": rings})


def reported(stages: Stages, sums) -> dict:
    """The step's metrics from each worker's metric sums (a few scalars: the only all-reduce)."""
    return stages.ops.finish(lax.psum(sums, AXIS))
