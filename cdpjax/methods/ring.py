"""The ring engine: one CDP worker per device, the table's steady-state period unrolled.

Timing and update rule are the table's (CDP's, `cdpjax.layouts.cdp`, or any other cyclic
table): the engine runs the lowered `Program` of the table it is given
(`cdpjax.program.ring`: T ticks from worker 0's start of a step, T = 2L with whole
backwards, 3L with split ones, more where a table's steps end idle) in ONE `shard_map`
over the `data` axis, every tick unrolled in Python (compile time grows with N and
L, never with the number of steps: a `train_step` is one period, `run_steps` scans
over periods). At tick t each device knows its own op; every op present at t is one
`lax.cond` on `axis_index == its worker`, run by the piece of its kind
(`forward_piece`, `backward_piece`, `weight_piece`), whose branches touch only that
op's buffers, all in their natural shapes (nothing padded, nothing raveled); a
stage's maths is `cdpjax.methods.stage_ops`'s:

- F, forward of stage j: reads the stage's parameters (the worker's one stored
  version: the plan applies each update between the worker's last read of the old
  version and its first of the new), its input (the image for stage 0, else the
  previous stage's output), writes the next stage's input; with `residuals='carry'`
  it also keeps the stage's `jax.vjp` residuals; the last stage's forward computes
  the loss.
- B, backward of stage j: recomputes the stage from its stashed input
  (`residuals='recompute'`) or rebuilds the pullback from the kept residuals
  ('carry', whose FLOPs are then DP's) and writes the input's cotangent for the
  next tick; with whole backwards it also adds its gradient to the partial sum it
  received.
- W (split backwards): the weight gradient of stage j from the same input or
  residuals and the cotangent its B read, added to the partial sum it received. A
  split backward makes every tick about one forward's cost, so the lockstep of
  the SPMD program (a tick lasts as long as its slowest op) no longer waits for a
  whole backward at every tick.
- messages: each 'partial' and 'sum' of the tick is one static `lax.ppermute` whose
  `perm` holds exactly the (src, dst) pairs that send that stage at that tick, of
  that stage's real size; a device in no pair sends nothing. No other collective
  but the psum of the three metric scalars, and with rings side by side over `data`
  (`ring_mesh`) one psum over `data` of each completed sum (`combine_rings`).
- applies: `lax.cond` per (stage, tick) with an apply; every worker applies the
  same optax update (`cdpjax.optim.apply`) to its own copy.

Gradient buffers are keyed (kind, stage, lag), lag = how many calls ago the step
was fed; those a period reads before writing (`RingTicks.live`) are the in-flight
part of the train state, renamed lag -> lag + 1 at the end of each period. `flush`
runs `max_lag` periods with nothing fed (their ops idle, their updates masked), so
that the parameters account for every batch fed; training on after a flush
restarts the cycle from the flushed parameters.

Memory, as XLA lays it out: a conditional that updates a buffer in place is tied by
a data dependency to the conditionals that read its old value (`Buffers`: without,
XLA copies whole stages), each tick is fenced by an `optimization_barrier` (without,
XLA interleaves ticks and stretches the in-flight sums' lives), the ops of a tick run
the largest backward workspaces first and new partial sums last (`_op_order`), and a
gradient buffer is dropped after the last tick that reads it. On the
ResNet-18 bench this takes the temporaries from 94 to 80 MiB; what remains is the
gradient sums in flight (one model's worth at every tick) plus the largest op's
own temporaries (docs/measured.md).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cdpjax import optim
from cdpjax.errors import ConfigError
from cdpjax.methods.common import Method, varying
from cdpjax.methods.stage_ops import StageOps
from cdpjax.program import Program
from cdpjax.program.ring import RingTicks, accesses, lower_ring
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
# the op's `lax.cond`; `skip` returns the buffers the op writes as they are.


def forward_piece(stages: Stages, j: int, carry: bool):
    """F over (p, ms, x, labels, old) -> (new, ms, metrics); `old` holds the buffers it writes
    (the next stage's input 'next', the kept residuals 'kept')."""
    last, ops = j == stages.L - 1, stages.ops

    def run(p, ms, x, labels, old):
        new = dict(old)
        if carry:
            out, new["kept"], (ms, metrics) = ops.forward_kept(j, p, ms, x, labels)
        else:
            out, (ms, metrics) = ops.run(j, p, ms, x, labels)
        if not last:
            new["next"] = out
        return varying((new, ms, metrics), AXIS)

    def skip(p, ms, x, labels, old):
        return varying((old, ms, ops.no_metrics()), AXIS)

    return run, skip


def _backward(stages: Stages, j: int, carry: bool, want: tuple[str, ...]):
    def gradients(p, ms, x, keep, seed, labels):
        d_params, d_input, _ = stages.ops.backward(j, p, ms, x, labels, seed, keep if carry else None, want)
        return d_params, d_input
    return gradients


def backward_piece(stages: Stages, j: int, carry: bool, split: bool, start: bool):
    """B over (p, ms, x, kept, seed, labels, partial, cot) -> (partial + its gradient, the input's
    cotangent); with split backwards only the cotangent (the partial passes through)."""
    gradients = _backward(stages, j, carry, ("input",) if split else ("params", "input"))

    def run(p, ms, x, keep, seed, labels, partial, cot):
        d_params, d_input = gradients(p, ms, x, keep, seed, labels)
        if not split:
            partial = d_params if start else jax.tree.map(jnp.add, partial, d_params)
        return varying((partial, d_input if j > 0 else cot), AXIS)

    def skip(p, ms, x, keep, seed, labels, partial, cot):
        return varying((jax.tree.map(jnp.zeros_like, p) if start and not split else partial, cot), AXIS)

    return run, skip


def weight_piece(stages: Stages, j: int, carry: bool, start: bool):
    """W over (p, ms, x, kept, seed, labels, partial) -> partial + its gradient."""
    gradients = _backward(stages, j, carry, ("params",))

    def run(p, ms, x, keep, seed, labels, partial):
        d_params, _ = gradients(p, ms, x, keep, seed, labels)
        return varying(d_params if start else jax.tree.map(jnp.add, partial, d_params), AXIS)

    def skip(p, ms, x, keep, seed, labels, partial):
        return varying(jax.tree.map(jnp.zeros_like, p) if start else partial, AXIS)

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
    writes = ([("acts", j + 1)] if j < L - 1 else []) + ([("kept", j)] if carry else []) + [("ms", j)]
    old = {"next": b[("acts", j + 1)]} if j < L - 1 else {}
    if carry:
        old["kept"] = b[("kept", j)]
    reads = [params, ("ms", j)] + ([("acts", j), ("labels",)] if j > 0 else [])
    new, ms, metrics = b.cond(pred, *piece, (b[params], b[("ms", j)], x, labels, old), reads, writes)
    if j < L - 1:
        b[("acts", j + 1)] = new["next"]
    if carry:
        b[("kept", j)] = new["kept"]
    b[("ms", j)] = ms
    b[("metrics",)] = b[("metrics",)] + metrics
    if j == 0:  # a new micro-batch: its image (stage 0's input) and labels stay until its backward
        _pick(b, pred, ("acts", 0), images)
        _pick(b, pred, ("labels",), new_labels)


def backward_operands(b: Buffers, j: int, params, L: int, carry: bool):
    """What a backward op of stage j reads: (parameters from buffer `params`, model state, input,
    kept residuals, seed, labels) and their buffer names."""
    zero = varying(jnp.zeros((), jnp.float32), AXIS)
    keep = b[("kept", j)] if carry else ()
    seed = b[("cots", j)] if j < L - 1 else zero
    reads = [params, ("ms", j), ("acts", j), ("labels",)] + ([("kept", j)] if carry else []) \
        + ([("cots", j)] if j < L - 1 else [])
    return (b[params], b[("ms", j)], b[("acts", j)], keep, seed, b[("labels",)]), reads


class Period:
    """The per-device program of one period: `Period(...)(state, images, labels, feeding) ->
    (state, [3] metric sums)`. `state` is one worker's: params, opt_state, model_state (per
    stage), acts (each stage's input), cots (each stage's output cotangent), kept (carry),
    labels, grads (the in-flight gradient buffers, in `ticks.live` order), fed (per lag >= 1).

    Each tick runs its ops (`_op_order`), the applies from the sums held before the sends,
    the sends, the applies from the sums received; then the gradient buffers no later tick
    reads are dropped and the tick is fenced (`Buffers.barrier`).
    """

    def __init__(self, stages: Stages, program: Program, tx, rings: int = 1):
        carry = program.carries
        self.stages, self.program, self.tx, self.carry = stages, program, tx, carry
        self.rings = rings
        self.ticks: RingTicks = program.ticks
        self.split = program.split_backward
        L = self.ticks.stages
        self.fwd = [forward_piece(stages, j, carry) for j in range(L)]
        self.bwd = {(j, start): backward_piece(stages, j, carry, self.split, start) for j in range(L)
                    for start in (False, True)}
        self.wgt = {(j, start): weight_piece(stages, j, carry, start) for j in range(L) for start in (False, True)}
        self.dead = _dead_after(self.ticks)

    def __call__(self, state, images, new_labels, feeding):
        ticks = self.ticks
        me = lax.axis_index(WORKERS)
        b = Buffers(_named(state, ticks, self.carry), tie_ticks=self.rings > 1)  # `combine_rings` in tick order
        b[("metrics",)] = varying(self.stages.ops.no_metrics(), AXIS)
        valid = [feeding] + [state["fed"][lag - 1] for lag in range(1, ticks.max_lag + 1)]
        for t, tk in enumerate(ticks.ticks):
            self.tick(b, tk, valid, me, images, new_labels)
            for name in self.dead[t]:  # a gradient buffer no later tick reads: not carried on
                b.values.pop(name, None)
            b.barrier()
        new = _unnamed(b, state, ticks, self.carry)
        new["fed"] = jnp.concatenate([jnp.reshape(feeding, (1,)), state["fed"][:-1]])
        return new, b[("metrics",)]

    def tick(self, b, tk, valid, me, images, new_labels):
        N = self.ticks.workers
        for w, kind, j, lag in _op_order(tk):
            pred = (me == w) & valid[lag]
            if kind == "F":
                forward_op(b, j, pred, images, new_labels, self.fwd[j], ("params", j), self.ticks.stages, self.carry)
                continue
            start = (w, j) in tk.chain_start
            if kind == "B":
                total = self.backward(b, j, pred, start, lag)
            else:
                total = self.weight(b, j, pred, start, lag)
            if kind in tk.gradient_kinds:
                done = (w, j, lag) in tk.completes
                b[("sum" if done else "partial", j, lag)] = total  # a partial is sent below
        combine_rings(b, tk, self.rings)
        self.applies(b, tk, valid, me, after=False)
        for j, lag, pairs in tk.partials:
            b[("partial", j, lag)] = lax.ppermute(b[("partial", j, lag)], WORKERS, list(pairs))
        for j, lag, pairs, merge in tk.sums:
            key = ("sum", j, lag)
            rounds = _rounds(pairs)  # a worker may send one sum to two others in a tick: two permutes
            sent = [lax.ppermute(b[key], WORKERS, list(r)) for r in rounds]
            if merge or len(rounds) > 1:  # another worker still holds its copy: only the receivers take it
                for r, value in zip(rounds, sent):
                    _pick(b, _member(me, [d for _, d in r], N), key, value)
            else:
                b[key] = sent[0]
        self.applies(b, tk, valid, me, after=True)

    def backward(self, b, j, pred, start, lag):
        """B: the input's cotangent to cots[j-1]; with whole backwards, the partial sum plus its
        gradient (returned)."""
        operands, reads = backward_operands(b, j, ("params", j), self.ticks.stages, self.carry)
        zero = varying(jnp.zeros((), jnp.float32), AXIS)
        name = ("partial", j, lag)
        gradient = not self.split
        partial = b[name] if gradient and not start else zero
        cot = b[("cots", j - 1)] if j > 0 else zero
        writes = ([("cots", j - 1)] if j > 0 else []) + ([name] if gradient and not start else [])
        total, cot = b.cond(pred, *self.bwd[(j, start)], (*operands, partial, cot), reads, writes)
        if j > 0:
            b[("cots", j - 1)] = cot
        return total if gradient else None

    def weight(self, b, j, pred, start, lag):
        """W: the partial sum plus stage j's weight gradient."""
        operands, reads = backward_operands(b, j, ("params", j), self.ticks.stages, self.carry)
        name = ("partial", j, lag)
        partial = varying(jnp.zeros((), jnp.float32), AXIS) if start else b[name]
        return b.cond(pred, *self.wgt[(j, start)], (*operands, partial), reads, [] if start else [name])

    def applies(self, b, tk, valid, me, after):
        tx = self.tx
        for j, lag, workers, when in tk.applies:
            if when == after:
                pred = _member(me, workers, self.ticks.workers) & valid[lag]
                p, o = b.cond(pred, lambda p, o, g: varying(optim.apply(tx, p, o, g), AXIS),
                              lambda p, o, g: varying((p, o), AXIS),
                              (b[("params", j)], b[("opt", j)], b[("sum", j, lag)]),
                              reads=[("sum", j, lag)], writes=[("params", j), ("opt", j)])
                b[("params", j)], b[("opt", j)] = p, o


def combine_rings(b: Buffers, tk, rings: int):
    """Each sum completed at this tick made the sum over the rings (one `psum` over `RINGS` per
    stage and step), before any worker applies it or passes it on: the same worker of every ring
    completes it at the same tick, so each ring then applies the gradient of the whole batch."""
    if rings == 1:
        return
    for _, j, lag in sorted(tk.completes):
        # tied to the previous tick: else XLA merges every tick's psum into one and holds the sums until it
        b[("sum", j, lag)] = lax.psum(_tie(b[("sum", j, lag)], b.after_previous_tick()), RINGS)


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


def _dead_after(program: RingTicks) -> list[list]:
    """Per tick, the gradient buffers whose last read in the period is in that tick (and that
    the next period does not take)."""
    carried = {(kind, j, lag - 1) for kind, j, lag in program.live}
    last = {}
    for t, tk in enumerate(program.ticks):
        for name, _, _ in accesses(tk):
            last[name] = t
    dead = [[] for _ in program.ticks]
    for name, t in last.items():
        if name not in carried:
            dead[t].append(name)
    return dead


def _op_order(tk):
    """The tick's ops in the order the device program runs them: forwards, then backward ops by
    stage (earlier stages first: the larger activations), those that start a new partial sum
    last (their new gradient buffer then never meets another op's workspace)."""
    return sorted(tk.ops, key=lambda o: (o.kind != "F", (o.worker, o.stage) in tk.chain_start, o.stage, o.kind == "W"))


def _named(state, program, carry):
    named = {}
    for key, plural in (("params", "params"), ("opt", "opt_state"), ("ms", "model_state"), ("acts", "acts"),
                        ("cots", "cots")) + ((("kept", "kept"),) if carry else ()):
        named.update({(key, j): v for j, v in enumerate(state[plural])})
    named[("labels",)] = state["labels"]
    named.update(zip(program.live, state["grads"]))
    return named


def _unnamed(b, state, program, carry):
    new = {}
    for key, plural in (("params", "params"), ("opt", "opt_state"), ("ms", "model_state"), ("acts", "acts"),
                        ("cots", "cots")) + ((("kept", "kept"),) if carry else ()):
        new[plural] = [b[(key, j)] for j in range(len(state[plural]))]
    new["labels"] = b[("labels",)]
    # The in-flight buffers go on, their step one call older.
    new["grads"] = [b[(kind, j, lag - 1)] for kind, j, lag in program.live]
    return new


# ------------------------------------------------------------------ the method


def stash_buffers(stages: Stages, model_state, carry: bool) -> dict:
    """A worker's per-stage buffers in natural shapes: model state, each stage's input, each
    stage's output cotangent, the labels of its micro-batch, and (carry) kept residuals."""
    zeros = lambda shape, dtype=jnp.float32: jnp.zeros(shape, dtype)  # noqa: E731
    out = {"model_state": model_state,
           "acts": [zeros(s, stages.input_dtype if j == 0 else jnp.float32) for j, s in enumerate(stages.inputs)],
           "cots": [zeros(s) for s in stages.outputs[:-1]],
           "labels": zeros((stages.micro, *stages.label_shape), stages.label_dtype)}
    if carry:
        out["kept"] = [[zeros(a.shape, a.dtype) for a in r] for r in stages.residuals]
    return out


def init_state(net, stages: Stages, ticks: RingTicks, tx, rng, carry: bool):
    """One worker's state: every worker starts from the same parameters."""
    params, model_state = net.init(rng)
    return {"params": params, "opt_state": [tx.init(p) for p in params],
            "grads": [jax.tree.map(jnp.zeros_like, params[j]) for _, j, _ in ticks.live],
            "fed": jnp.zeros((max(ticks.max_lag, 1),), bool), **stash_buffers(stages, model_state, carry)}


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


def build(ctx, name: str, net, table, residuals: str) -> Method:
    """The ring `Method` running `table`'s lowered program: rings of `table.workers` workers (one
    per device) side by side over the mesh's `data` devices, each ring fed its share of every
    global batch; each sum a ring completes is summed over the rings before it is applied or
    passed on (`combine_rings`), so every ring applies the update of the whole batch."""
    # Long on purpose: the method's closures (init, steps, flush, export) share what is built here.
    use_canonical_cpu_convolutions()  # stages inside cond branches: XLA:CPU's slow path otherwise
    program = lower_ring(table, residuals)  # refuses a table the ring cannot serve, naming the op
    ticks: RingTicks = program.ticks
    tx, N = ctx.optimizer(), ticks.workers
    mesh = ring_mesh(ctx.mesh, N)
    rings = int(mesh.shape[RINGS])
    batch = int(ctx.config.global_batch_size)
    ctx.require_divisible("global_batch_size", batch, N * rings, f"{rings} rings x {N} workers")
    micro = batch // (N * rings)
    carry = program.carries
    stages = make_stages(net, N * rings, micro, mesh, residuals, ctx.task)
    period = Period(stages, program, tx, rings)
    per_worker = NamedSharding(mesh, P(AXIS))
    one_period, step, run = spmd_period(period, stages, mesh)

    def init(rng):
        state = init_state(net, stages, ticks, tx, rng, carry)
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
        params = [jax.tree.map(lambda a, w=newest[j]: a[w], state["params"][j]) for j in range(net.num_stages)]
        model_state = jax.tree.map(lambda a: a.mean(0), state["model_state"])
        return params, model_state

    return Method(name, net, init, train_step, export, flush, table, program=program, run_steps=run_steps,
                  periods=run, carrier=stages, stale=table.stale, workers=N, devices=N * rings,
                  state_depends_on_mesh=True,
                  report={"impl": "ring", "residuals": residuals, "backward": table.meta.get("ticks", "whole"),
                          "rings": rings})


def reported(stages: Stages, sums) -> dict:
    """The step's metrics from each worker's metric sums (a few scalars: the only all-reduce)."""
    return stages.ops.finish(lax.psum(sums, AXIS))
