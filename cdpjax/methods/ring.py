"""The ring engine: one CDP worker per device, the table's steady-state period unrolled.

Timing and update rule are the table's (`cdpjax.layouts.cdp`): the engine runs the
`RingProgram` of a rule, 2L ticks from worker 0's start of a step, in ONE
`shard_map` over the `data` axis, every tick unrolled in Python (compile time grows
with N and L, never with the number of steps: a `train_step` is one period,
`run_steps` scans over periods). At tick t each device knows its own op; every op
present at t is one `lax.cond` on `axis_index == its worker`, whose branches touch
only that op's buffers, all in their natural shapes (nothing padded, nothing raveled):

- forward of stage j: reads the stage's parameters (the worker's one stored version:
  the plan applies each update between the worker's last read of the old version and
  its first of the new), its input (the image for stage 0, else the previous stage's
  output), writes the next stage's input; with `residuals='carry'` it also keeps the
  stage's `jax.vjp` residuals; the last stage's forward computes the loss.
- backward of stage j: recomputes the stage from its stashed input under `jax.vjp`
  (`residuals='recompute'`) or rebuilds the pullback from the kept residuals on the
  structure of a template vjp traced in the same branch ('carry', whose FLOPs are
  then DP's); adds its gradient to the partial sum it received and writes the
  input's cotangent for the next tick.
- messages: each 'partial' and 'sum' of the tick is one static `lax.ppermute` whose
  `perm` holds exactly the (src, dst) pairs that send that stage at that tick, of
  that stage's real size; a device in no pair sends nothing. No other collective
  but the psum of the three metric scalars.
- applies: `lax.cond` per (stage, tick) with an apply; every worker applies the
  same optax update (`cdpjax.optim.apply`) to its own copy.

Gradient buffers are keyed (kind, stage, lag), lag = how many calls ago the step
was fed; those a period reads before writing (`RingProgram.live`) are the in-flight
part of the train state, renamed lag -> lag + 1 at the end of each period. `flush`
runs `max_lag` periods with nothing fed (their ops idle, their updates masked), so
that the parameters account for every batch fed; training on after a flush
restarts the cycle from the flushed parameters.

Memory, as XLA lays it out: a conditional that updates a buffer in place is tied by
a data dependency to the conditionals that read its old value (`Buffers`: without,
XLA copies whole stages), each tick is fenced by an `optimization_barrier` (without,
XLA interleaves ticks and stretches the in-flight sums' lives), the ops of a tick run
the largest backward workspaces first and new partial sums last (`_op_order`), and a
gradient buffer is dropped after the last tick that reads it. On the README's
ResNet-18 bench this takes the temporaries from 94 to 80 MiB; what remains is the
gradient sums in flight (one model's worth at every tick) plus the largest op's
own temporaries (README, "Measured figures").
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from cdpjax import models, optim
from cdpjax.layouts.cdp import RingProgram, accesses
from cdpjax.methods.common import Method, varying
from cdpjax.xla_cpu import use_canonical_cpu_convolutions

AXIS = "data"
RESIDUALS = ("recompute", "carry")


@dataclasses.dataclass(frozen=True)
class Stages:
    """A staged net's ops in natural shapes, for micro-batches of `micro` examples.

    inputs[j]: stage j's input shape (inputs[0] the images'); outputs[j]: its output.
    residuals: per stage, the ShapeDtypeStructs of the leaves a forward keeps for its
    backward ('carry'; traced inside the shard_map, where they are device-varying).
    """

    net: Any
    workers: int
    micro: int
    inputs: tuple
    outputs: tuple
    residuals: tuple | None = None

    @property
    def L(self) -> int:
        return self.net.num_stages

    def run(self, j, p, ms, x, labels):
        """Stage j on x: (output or the last stage's loss share, (new model state, loss, accuracy))."""
        y, new_ms = self.net.apply_stage(j, p, ms, x, True)
        zero = jnp.zeros((), jnp.float32)
        if j < self.L - 1:
            return y, (new_ms, zero, zero)
        loss = models.cross_entropy(y, labels)
        return loss / self.workers, (new_ms, loss, models.accuracy(y, labels))  # the ring's sum is then the mean

    def vjp(self, j, p, ms, x, labels):
        """(out, pullback, aux) of stage j; the image (stage 0's input) gets no cotangent."""
        if j == 0:
            return jax.vjp(lambda p_: self.run(j, p_, ms, x, labels), p, has_aux=True)
        return jax.vjp(lambda p_, x_: self.run(j, p_, ms, x_, labels), p, x, has_aux=True)


def kept(pullback, p):
    """A pullback's leaves, its structure, and the indices of the leaves a forward keeps: all
    but the stage's own parameters (the backward reads those from its worker's copy)."""
    own = {id(q) for q in jax.tree.leaves(p)}
    leaves, structure = jax.tree.flatten(pullback)
    return leaves, structure, [i for i, leaf in enumerate(leaves) if id(leaf) not in own]


def make_stages(net, workers: int, micro: int, mesh, residuals: str) -> Stages:
    outputs = tuple(tuple(s) for s in net.stage_output_shapes(micro))
    inputs = ((micro, *net.input_shape), *outputs[:-1])
    stages = Stages(net, workers, micro, inputs, outputs)
    if residuals == "recompute":
        return stages
    params, state = jax.eval_shape(lambda: net.init(jax.random.key(0)))
    found = []

    def probe():  # traced inside shard_map, with device-varying inputs as in the tick
        for j in range(net.num_stages):
            p, s = jax.tree.map(lambda a: varying(jnp.zeros(a.shape, a.dtype), AXIS), (params[j], state[j]))
            x = varying(jnp.zeros(inputs[j], jnp.float32), AXIS)
            labels = varying(jnp.zeros((micro,), jnp.int32), AXIS)
            leaves, _, keep = kept(stages.vjp(j, p, s, x, labels)[1], p)
            found.append(tuple(jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype) for i in keep))
        return varying(jnp.zeros((1,)), AXIS)

    jax.eval_shape(jax.shard_map(probe, mesh=mesh, in_specs=(), out_specs=P(AXIS), check_vma=True))
    return dataclasses.replace(stages, residuals=tuple(found))


# ------------------------------------------------------------------- the ops


def forward_op(stages: Stages, j: int, carry: bool):
    """Stage j's forward as cond branches over (p, ms, x, labels, old) -> (new, ms, metrics[3]);
    `old` holds the buffers it writes (the next stage's input 'next', the kept residuals
    'kept'), which the branch not taken returns as they are."""
    last = j == stages.L - 1

    def run(p, ms, x, labels, old):
        new = dict(old)
        if carry:
            out, pullback, (ms, loss, acc) = stages.vjp(j, p, ms, x, labels)
            leaves, _, idx = kept(pullback, p)
            new["kept"] = [leaves[i] for i in idx]
        else:
            out, (ms, loss, acc) = stages.run(j, p, ms, x, labels)
        if not last:
            new["next"] = out
        counted = jnp.ones((), jnp.float32) if last else jnp.zeros((), jnp.float32)
        metrics = jnp.stack([loss, acc, counted]) if last else jnp.zeros((3,), jnp.float32)
        return varying((new, ms, metrics), AXIS)

    def skip(p, ms, x, labels, old):
        return varying((old, ms, jnp.zeros((3,), jnp.float32)), AXIS)

    return run, skip


def backward_op(stages: Stages, j: int, carry: bool, start: bool):
    """Stage j's backward as cond branches over (p, ms, x, kept, seed, labels, partial, cot) ->
    (partial + its gradient, the input's cotangent); `start`: it begins the partial sum."""
    last = j == stages.L - 1

    def pullback_of(p, ms, x, keep, labels):
        if not carry:  # recomputed; BatchNorm's running averages are the forward's to update
            return stages.vjp(j, p, ms, x, labels)[1]
        # A template pullback traced here (x a stand-in) gives the structure; its kept leaves
        # are replaced by the forward's, so the rest of the template is dead code.
        leaves, structure, idx = kept(stages.vjp(j, p, ms, x, labels)[1], p)
        for i, leaf in zip(idx, keep):
            leaves[i] = leaf
        return jax.tree.unflatten(structure, leaves)

    def run(p, ms, x, keep, seed, labels, partial, cot):
        seed = varying(jnp.ones((), jnp.float32), AXIS) if last else seed
        out = pullback_of(p, ms, x, keep, labels)(seed)
        total = out[0] if start else jax.tree.map(jnp.add, partial, out[0])
        return varying((total, out[1] if j > 0 else cot), AXIS)

    def skip(p, ms, x, keep, seed, labels, partial, cot):
        return varying((jax.tree.map(jnp.zeros_like, p) if start else partial, cot), AXIS)

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

    def __init__(self, values: dict):
        self.values = dict(values)
        self.readers: dict = {}

    def __getitem__(self, name):
        return self.values[name]

    def __setitem__(self, name, value):
        self.values[name] = value
        self.readers.pop(name, None)

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
        values = lax.optimization_barrier([self.values[n] for n in names])
        self.values = dict(zip(names, values))
        self.readers = {}

    def note(self, names, out):
        if not names:
            return
        x = jax.tree.leaves(out)[0].reshape(-1)[0].astype(jnp.float32)
        zero = jnp.where(jnp.isfinite(x), x, 0.0) * 0.0
        for name in names:
            self.readers.setdefault(name, []).append(zero)


def _pick(bufs: Buffers, pred, name, new):
    """Buffer `name` becomes `new` where pred; elsewhere it stays, in place."""
    bufs[name] = bufs.cond(pred, lambda a, b: varying(a, AXIS), lambda a, b: varying(b, AXIS), (new, bufs[name]),
                           writes=(name,))


class Period:
    """The per-device program of one period: `Period(...)(state, images, labels, feeding) ->
    (state, [3] metric sums)`. `state` is one worker's: params, opt_state, model_state (per
    stage), acts (each stage's input), cots (each stage's output cotangent), kept (carry),
    labels, grads (the in-flight gradient buffers, in `program.live` order), fed (per lag >= 1).

    Each tick runs its ops (`_op_order`), the applies from the sums held before the sends,
    the sends, the applies from the sums received; then the gradient buffers no later tick
    reads are dropped and the tick is fenced (`Buffers.barrier`).
    """

    def __init__(self, stages: Stages, program: RingProgram, tx, carry: bool):
        self.stages, self.program, self.tx, self.carry = stages, program, tx, carry
        L = program.stages
        self.fwd = [forward_op(stages, j, carry) for j in range(L)]
        self.bwd = {(j, start): backward_op(stages, j, carry, start) for j in range(L) for start in (False, True)}
        self.dead = _dead_after(program)

    def __call__(self, state, images, new_labels, feeding):
        program = self.program
        me = lax.axis_index(AXIS)
        b = Buffers(_named(state, program, self.carry))
        b[("metrics",)] = varying(jnp.zeros((3,), jnp.float32), AXIS)
        valid = [feeding] + [state["fed"][lag - 1] for lag in range(1, program.max_lag + 1)]
        for t, tk in enumerate(program.ticks):
            self.tick(b, tk, valid, me, images, new_labels)
            for name in self.dead[t]:  # a gradient buffer no later tick reads: not carried on
                b.values.pop(name, None)
            b.barrier()
        new = _unnamed(b, state, program, self.carry)
        new["fed"] = jnp.concatenate([jnp.reshape(feeding, (1,)), state["fed"][:-1]])
        return new, b[("metrics",)]

    def tick(self, b, tk, valid, me, images, new_labels):
        N = self.program.workers
        for w, kind, j, lag in _op_order(tk):
            pred = (me == w) & valid[lag]
            if kind == "F":
                self.forward(b, j, pred, images, new_labels)
                continue
            total = self.backward(b, j, pred, (w, j) in tk.chain_start, lag)
            done = (w, j, lag) in tk.completes
            b[("sum" if done else "partial", j, lag)] = total  # a partial is sent below
        self.applies(b, tk, valid, me, after=False)
        for j, lag, pairs in tk.partials:
            b[("partial", j, lag)] = lax.ppermute(b[("partial", j, lag)], AXIS, list(pairs))
        for j, lag, pairs, merge in tk.sums:
            key = ("sum", j, lag)
            sent = lax.ppermute(b[key], AXIS, list(pairs))
            if merge:  # another worker still holds its copy: only the receivers take the new one
                _pick(b, _member(me, [d for _, d in pairs], N), key, sent)
            else:
                b[key] = sent
        self.applies(b, tk, valid, me, after=True)

    def forward(self, b, j, pred, images, new_labels):
        L, carry = self.program.stages, self.carry
        x = images if j == 0 else b[("acts", j)]
        labels = new_labels if j == 0 else b[("labels",)]
        writes = ([("acts", j + 1)] if j < L - 1 else []) + ([("kept", j)] if carry else []) + [("ms", j)]
        old = {"next": b[("acts", j + 1)]} if j < L - 1 else {}
        if carry:
            old["kept"] = b[("kept", j)]
        reads = [("params", j), ("ms", j)] + ([("acts", j), ("labels",)] if j > 0 else [])
        new, ms, metrics = b.cond(pred, *self.fwd[j], (b[("params", j)], b[("ms", j)], x, labels, old), reads, writes)
        if j < L - 1:
            b[("acts", j + 1)] = new["next"]
        if carry:
            b[("kept", j)] = new["kept"]
        b[("ms", j)] = ms
        b[("metrics",)] = b[("metrics",)] + metrics
        if j == 0:  # a new micro-batch: its image (stage 0's input) and labels stay until its backward
            _pick(b, pred, ("acts", 0), images)
            _pick(b, pred, ("labels",), new_labels)

    def backward(self, b, j, pred, start, lag):
        L, carry = self.program.stages, self.carry
        zero = varying(jnp.zeros((), jnp.float32), AXIS)
        name = ("partial", j, lag)
        partial = zero if start else b[name]
        keep = b[("kept", j)] if carry else ()
        seed = b[("cots", j)] if j < L - 1 else zero
        cot = b[("cots", j - 1)] if j > 0 else zero
        reads = [("params", j), ("ms", j), ("acts", j), ("labels",)] + ([("kept", j)] if carry else []) \
            + ([("cots", j)] if j < L - 1 else [])
        writes = ([("cots", j - 1)] if j > 0 else []) + ([] if start else [name])
        total, cot = b.cond(pred, *self.bwd[(j, start)],
                            (b[("params", j)], b[("ms", j)], b[("acts", j)], keep, seed, b[("labels",)], partial, cot),
                            reads, writes)
        if j > 0:
            b[("cots", j - 1)] = cot
        return total

    def applies(self, b, tk, valid, me, after):
        tx = self.tx
        for j, lag, workers, when in tk.applies:
            if when == after:
                pred = _member(me, workers, self.program.workers) & valid[lag]
                p, o = b.cond(pred, lambda p, o, g: varying(optim.apply(tx, p, o, g), AXIS),
                              lambda p, o, g: varying((p, o), AXIS),
                              (b[("params", j)], b[("opt", j)], b[("sum", j, lag)]),
                              reads=[("sum", j, lag)], writes=[("params", j), ("opt", j)])
                b[("params", j)], b[("opt", j)] = p, o


def _dead_after(program: RingProgram) -> list[list]:
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
    """The tick's ops in the order the device program runs them: forwards, then backwards by
    stage (earlier stages first: the larger activations), those that start a new partial sum
    last (their new gradient buffer then never meets another op's workspace)."""
    return sorted(tk.ops, key=lambda o: (o[1] == "B", (o[0], o[2]) in tk.chain_start, o[2]))


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


def init_state(net, stages: Stages, program: RingProgram, tx, rng, carry: bool):
    """One worker's state: every worker starts from the same parameters."""
    params, model_state = net.init(rng)
    zeros = lambda shape, dtype=jnp.float32: jnp.zeros(shape, dtype)  # noqa: E731
    grads = [jax.tree.map(jnp.zeros_like, params[j]) for _, j, _ in program.live]
    state = {
        "params": params,
        "opt_state": [tx.init(p) for p in params],
        "model_state": model_state,
        "acts": [zeros(s) for s in stages.inputs],
        "cots": [zeros(s) for s in stages.outputs[:-1]],
        "labels": zeros((stages.micro,), jnp.int32),
        "grads": grads,
        "fed": jnp.zeros((max(program.max_lag, 1),), bool),
    }
    if carry:
        state["kept"] = [[zeros(a.shape, a.dtype) for a in r] for r in stages.residuals]
    return state


def build(ctx, name: str, net, table, program: RingProgram, residuals: str, info: dict | None = None) -> Method:
    """The ring `Method` for `program` (one worker per device of the `data` axis)."""
    use_canonical_cpu_convolutions()  # stages inside cond branches: XLA:CPU's slow path otherwise
    mesh, tx, N = ctx.mesh, ctx.optimizer(), program.workers
    batch = int(ctx.config.global_batch_size)
    micro = batch // N
    carry = residuals == "carry"
    stages = make_stages(net, N, micro, mesh, residuals)
    period = Period(stages, program, tx, carry)
    per_worker = NamedSharding(mesh, P(AXIS))

    def squeeze(tree):
        return jax.tree.map(lambda a: a[0], tree)

    def local_step(state, images, labels, feeding):
        s, sums = period(squeeze(state), images, labels, feeding)
        return jax.tree.map(lambda a: a[None], s), _metrics(sums)

    def local_run(state, images, labels, feeding):
        def one(s, xs):
            return period(s, *xs)

        s, sums = lax.scan(one, squeeze(state), (images, labels, feeding))
        return jax.tree.map(lambda a: a[None], s), jax.vmap(_metrics)(sums)

    step = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(P(AXIS), P(AXIS), P(AXIS), P()),
                                 out_specs=(P(AXIS), P()), check_vma=True))
    run = jax.jit(jax.shard_map(local_run, mesh=mesh, in_specs=(P(AXIS), P(None, AXIS), P(None, AXIS), P()),
                                out_specs=(P(AXIS), P()), check_vma=True))

    def init(rng):
        state = init_state(net, stages, program, tx, rng, carry)
        # Every worker holds its own copy of everything: a leading worker axis on `data`.
        return jax.device_put(jax.tree.map(lambda a: jnp.broadcast_to(a, (N, *a.shape)), state), per_worker)

    def train_step(state, batch):
        return step(state, batch["image"], batch["label"], True)

    def run_steps(state, batches):
        """S steps in one program: {'image': [S, B, ...], 'label': [S, B]} -> (state, metrics [S])."""
        feeding = jnp.ones((batches["label"].shape[0],), bool)
        return run(state, batches["image"], batches["label"], feeding)

    def flush(state):
        images = jnp.zeros((batch, *net.input_shape), jnp.float32, device=per_worker)
        labels = jnp.zeros((batch,), jnp.int32, device=per_worker)
        for _ in range(program.max_lag):
            state = step(state, images, labels, False)[0]
        return state

    newest = program.newest

    def export(state):
        # Stage j from a worker that has applied all its complete updates; running averages
        # (EMA, linear) averaged over workers = averaging them every step.
        params = [jax.tree.map(lambda a, w=newest[j]: a[w], state["params"][j]) for j in range(net.num_stages)]
        model_state = jax.tree.map(lambda a: a.mean(0), state["model_state"])
        return params, model_state

    report = dict(info or {}, impl="ring", residuals=residuals)
    return Method(name, net, init, train_step, export, flush, table, run_steps=run_steps, carrier=stages,
                  stale=table.stale, workers=N, devices=N, state_depends_on_mesh=True, periods=run, report=report)


def _metrics(sums):
    loss, correct, counted = lax.psum(sums, AXIS)  # three scalars: the only all-reduce
    counted = jnp.maximum(counted, 1.0)
    return {"loss": loss / counted, "accuracy": correct / counted}
