"""`cdp-zero`: cyclic data parallelism with every stage's parameters and optimizer state
partitioned over the workers (ZeRO-3's partition), each stage gathered point to point just before
a worker's ops on it and its gradient reduce-scattered point to point after them (ZeRO's sharding,
CDP's messages).

Timing and update rule: those of `cdp-v2` (or `cdp-v1`, `config.cdp_rule`; whole, split or
paired ticks, `config.cdp_ticks`) in the `ring` realisation of `cdpjax.methods.cdp`: N
workers on the N devices of `data`, every stage's maths `cdpjax.methods.stage_ops`'s. The period
(`config.zero_period`) is 'unrolled' (`ZeroPeriod`, the default: one `lax.cond` per op on
`axis_index == its worker` through the ring's op pieces, `cdpjax.methods.ring`; the least
memory and the fewest bytes) or 'scan' (`ZeroScan`: one `lax.scan` over its ticks, each worker's
ops and messages chosen by data, `cdpjax.program.zero.ZeroRouting`: its ops in a `lax.switch`
over the (kind, stage) pairs, its messages two `all_to_all`s a tick whose slots cross every route
padded to the widest piece: the program does not grow with N, at the price of those padded
bytes and more memory; docs/measured.md). Both run the period the program's events say
(`cdpjax.program.zero.zero_program_period`: its gathers, computes and applies). After S steps
and a flush the parameters equal the ring's (and so `simulate`'s):

    theta^j_{k+1} = opt^j(theta^j_k, mean_i g_i^j(version the table names)),

applied piece by piece (the optimizer must be elementwise, as `optim.make`'s are).

What differs is where the model lives (the plan: `cdpjax.layouts.cdp_zero`; the program:
`cdpjax.program.zero`):
- Stage j's flattened parameters are cut into N equal pieces; worker i keeps piece i of
  every stage (and of its previous version, where some op reads it), the optimizer state
  of those pieces and a running sum of those pieces of the gradient: 1/N of the model each,
  in the pieces' own shapes.
- At the start of each visit (a worker's consecutive ops on one stage) every other worker
  sends its piece of the version the visit reads (N - 1 messages of a piece's size) into
  the visitor's relay row (train state: a visit may run on into the next call), beside
  its own piece.
- Gradients: after a gradient op the worker sends piece i of its gradient to worker i,
  which adds it to its running sum (the step's first gradient op starts it); at the
  table's update tick (after the last worker's op) every worker applies the update of its
  pieces.
- Collectives (unrolled; the scan's are its two all-to-alls a tick, `ZeroScan`): `ppermute`s of
  pieces, batched per tick (`messages`): the pieces one pair
  carries in one phase (gathers, then gradients) one after the other, and the pairs of one
  route (destination - source mod N) whose payloads have one length in one `ppermute`
  (nothing padded: the bytes are the pieces'); and the psum of the three metric scalars: no
  all-gather, reduce-scatter or all-reduce of model-sized buffers.
- Codecs (`cdpjax.compress`): `compress.parameters` on the parameter pieces, `compress.gradients`
  on the gradient pieces, each piece encoded on its own before its message's `ppermute` (its
  `Send` event's bytes) and decoded where it lands; a worker's own piece is used exact. Error
  feedback is refused (each sender would keep a whole stage's remainder).

Per worker and step the messages carry (N-1)/N x (2 - the last stage's share) of the model
in parameters (two visits a stage, one of the last) and (N-1)/N of it in gradients (ZeRO-3's
all-gathers and reduce-scatter), spread over the ticks.
Per worker it stores 1/N of the model per version, of the optimizer state and of the
gradient sums, and the relay rows, each as long as the largest stage.

BatchNorm running statistics (small) stay per worker for every stage, as in `ring`. After
a flush the next fed call restarts the cycle from the flushed parameters, as the ring
does: the previous versions are set to the current ones.
"""
from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.flatten_util import ravel_pytree
from jax.sharding import NamedSharding, PartitionSpec as P

from cdpjax import kinds as op_kinds, optim
from cdpjax.carrier import FlatLayout
from cdpjax.compress import BLOCK, CODECS, Codec, Codecs, with_codecs
from cdpjax.errors import ConfigError
from cdpjax.layouts.cdp_zero import ZERO_RULES, cdp_zero_table
from cdpjax.methods import ring
from cdpjax.methods.common import Context, Method, varying
from cdpjax.program import Program, piece_size
from cdpjax.program.zero import ZeroRouting, ZeroTicks, lower_zero, zero_program_period, zero_routing
from cdpjax.train_state import typed_state
from cdpjax.xla_cpu import use_canonical_cpu_convolutions

AXIS = ring.AXIS  # every value of the period varies over the ring mesh's axes (one ring here)


def build(ctx: Context) -> Method:
    cfg = ctx.config
    ctx.require_axes("cdp-zero", (ring.RINGS,))
    rule = cfg.get("cdp_rule", "cdp-v2")
    if rule not in ZERO_RULES:
        raise ConfigError(f"cdp_rule={rule!r} is not one of {', '.join(ZERO_RULES)} (cdp-zero's staleness rule)")
    ticks = cfg.get("cdp_ticks", "whole")  # checked by the table (`phase_ops`), residuals by the lowering
    residuals = cfg.get("residuals", "recompute")
    devices = ctx.axis(ring.RINGS)
    workers = int(cfg.get("workers", 0)) or devices
    if workers != devices:
        raise ConfigError(f"cdp-zero runs one worker per device: workers={workers} must equal mesh.data={devices} "
                          f"(or be 0)")
    net = ctx.net(bn_axis_name=None)
    table = cdp_zero_table(workers, net.num_stages, rule=rule, ticks=ticks)  # refuses N not dividing T
    ctx.require_divisible("global_batch_size", cfg.global_batch_size, workers, "workers")
    period = cfg.get("zero_period", "unrolled")  # a listed choice (config._CHOICES)
    return _method(ctx, net, table, lower_zero(table, residuals, period), residuals, period)


@dataclasses.dataclass(frozen=True)
class Shards:
    """Each stage's flattened parameters (`FlatLayout.sizes`) cut into `parts` equal pieces of
    `piece[j]` elements (zero-padded at the end); `width`: a relay row, the longest stage padded."""

    layout: FlatLayout
    parts: int

    @property
    def piece(self) -> tuple[int, ...]:
        return tuple(piece_size(size, self.parts) for size in self.layout.sizes)

    @property
    def width(self) -> int:
        return max(p * self.parts for p in self.piece)

    def flat(self, j: int, tree) -> jax.Array:
        """Stage j's pytree -> [parts * piece[j]], the pieces one after the other."""
        flat, _ = ravel_pytree(tree)
        return jnp.pad(flat, (0, self.piece[j] * self.parts - flat.size))

    def cut(self, j: int, tree) -> jax.Array:
        """Stage j's pytree -> [parts, piece[j]]."""
        return self.flat(j, tree).reshape(self.parts, self.piece[j])

    def pieces(self, j: int, flat: jax.Array) -> list:
        p = self.piece[j]
        return [flat[u * p:(u + 1) * p] for u in range(self.parts)]

    def join(self, j: int, pieces):
        """[parts, piece[j]] (or a row starting with them) -> stage j's pytree."""
        return self.layout.unpack_one(j, jnp.reshape(pieces, (-1,)))

    @property
    def widest(self) -> int:
        """P: the longest piece, the length every piece crosses at in the scanned period."""
        return max(self.piece)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where each stage's piece starts when a worker's pieces are laid end to end."""
        return tuple(int(x) for x in np.cumsum((0,) + self.piece[:-1]))

    @property
    def laid(self) -> int:
        """Length of a worker's pieces laid end to end, with room for a window of P at every offset."""
        return max(o + self.widest for o in self.offsets)

    def lay(self, pieces: list) -> jax.Array:
        """Per stage [..., piece[j]] -> [..., laid]: end to end, zero-padded."""
        flat = jnp.concatenate(pieces, axis=-1)
        return jnp.pad(flat, [(0, 0)] * (flat.ndim - 1) + [(0, self.laid - flat.shape[-1])])

    def unlay(self, j: int, laid: jax.Array) -> jax.Array:
        """[..., laid] -> stage j's [..., piece[j]]."""
        return laid[..., self.offsets[j]:self.offsets[j] + self.piece[j]]

    def strided(self, j: int, pieces: jax.Array) -> jax.Array:
        """[parts, piece[j]] -> [parts, P]: each piece zero-padded to the widest."""
        return jnp.pad(pieces, ((0, 0), (0, self.widest - self.piece[j])))

    def join_strided(self, j: int, row: jax.Array):
        """A relay row of the scanned period (N pieces at a stride of P) -> stage j's pytree."""
        return self.join(j, row.reshape(self.parts, self.widest)[:, :self.piece[j]])

    def padding(self) -> float:
        """Stored / real parameter elements."""
        real = sum(self.layout.sizes)
        return sum(self.piece) * self.parts / real if real else 1.0


class ZeroPeriod:
    """One worker's period (`ring.Period`'s shape, `cdp-zero`'s storage): per tick the gathers,
    the ops (a gradient op's pieces sent to their keepers), the updates; then the tick is fenced."""

    def __init__(self, stages: ring.Stages, program: Program, tx, shards: Shards, codecs: Codecs = Codecs()):
        carry = program.carries
        self.stages, self.program, self.tx, self.carry, self.shards = stages, program, tx, carry, shards
        self.codecs = codecs
        self.z: ZeroTicks = zero_program_period(program)  # the period the program's events say
        L = self.z.stages
        split = program.split_backward
        self.fwd = [ring.forward_piece(stages, j, carry) for j in range(L)]
        self.bwd = [ring.backward_piece(stages, j, carry, split, start=True) for j in range(L)]
        self.wgt = [ring.weight_piece(stages, j, carry, start=True) for j in range(L)]
        self.split = split

    def __call__(self, state, images, new_labels, feeding):
        z, me = self.z, lax.axis_index(ring.WORKERS)
        b = ring.Buffers(_named(state, z, self.carry), tie_ticks=True)  # each gather after the previous tick
        b[("metrics",)] = varying(self.stages.ops.no_metrics(), AXIS)
        if z.versions == 2:  # a call after an unfed one restarts the cycle: both versions the newest
            for j in range(z.stages):
                b[("master", j, 1)] = jnp.where(state.fed[0], b[("master", j, 1)], b[("master", j, 0)])
        valid = [feeding] + [state.fed[lag - 1] for lag in range(1, z.max_lag + 1)]
        for tk in z.ticks:
            self.gather(b, tk, me)
            # Every op of the tick before any piece is sent, as the ring sends: a collective waits for
            # every device, so a send between two workers' ops could make one wait for the other's.
            gradients = [self.op(b, op, (me == op.worker), valid[op.lag], images, new_labels) for op in tk.ops]
            self.scatter(b, tk.ops, gradients, me)
            self.apply(b, tk, valid)
            b.barrier()
        new = _unnamed(b, state, z, self.carry, fed=jnp.concatenate([jnp.reshape(feeding, (1,)), state.fed[:-1]]))
        return new, b[("metrics",)]

    def gather(self, b, tk, me):
        """Each visit's stage from every worker's piece (its own beside them) into the visitor's relay
        row; the pieces of the tick travel batched (`exchange`: one message per route and size)."""
        N, piece = self.z.workers, self.shards.piece
        mine = [b[("master", j, row)] + b.after_previous_tick() for j, _, row, _ in tk.gathers]
        sent = [Piece(u, g.worker, (i,), piece[g.stage]) for i, g in enumerate(tk.gathers) for u in range(N)
                if u != g.worker]
        got = exchange(sent, lambda p: mine[p.what[0]], me, N, self.codecs.parameters)
        for i, (j, worker, _, r) in enumerate(tk.gathers):
            pieces = [mine[i] if u == worker else got[(u, worker, (i,))] for u in range(N)]
            _land(b, me == worker, ("relay", r), pieces)

    def op(self, b, op, mine, valid, images, new_labels):
        """Runs `op` where mine & valid; returns a gradient op's flat gradient (zeros where it did
        not run), else None."""
        j, L = op.stage, self.z.stages
        source = ("relay", op.relay)
        pred = mine & valid
        kind = op_kinds.lookup(op.kind)
        if not kind.reads_cotangent:  # a forward (the lowering refuses kinds with no piece here)
            ring.forward_op(b, j, pred, images, new_labels, self._on_row(j, *self.fwd[j]), source, L, self.carry)
            return
        zero = varying(jnp.zeros((), jnp.float32), AXIS)
        operands, reads = ring.backward_operands(b, j, source, L, self.carry)  # params: the relay row
        with_cot = kind.cotangent and j > 0
        cot = b[("cots", j - 1)] if j > 0 else zero
        if not kind.completes_gradient(self.split):  # the input's cotangent only: nothing to scatter
            out = b.cond(pred, *self._on_row(j, *self.bwd[j]), (operands._replace(partial=zero, cot=cot),), reads,
                         [("cots", j - 1)] if j > 0 else [])
            if j > 0:
                b[("cots", j - 1)] = out.cot
            return
        if kind.cotangent:
            operands, piece = operands._replace(partial=zero, cot=cot), self.bwd[j][0]
        else:
            operands, piece = operands._replace(partial=zero), self.wgt[j][0]
        gradient, *rest = b.cond(pred, *self._gradient_on_row(j, piece, kind.cotangent), (operands,), reads,
                               [("cots", j - 1)] if with_cot else [])
        if with_cot:
            b[("cots", j - 1)] = rest[0]
        return self.shards.flat(j, gradient)

    def _on_row(self, j, run, skip):
        """A piece's branches taking the stage's parameters as a row (the operand's `params`),
        unpacked in the branch that computes: no unpacked copy of them outlives the op."""
        return (lambda i: run(i._replace(params=self.shards.join(j, i.params))),
                lambda i: skip(i._replace(params=None)))

    def _gradient_on_row(self, j, piece, with_cot: bool):
        """Branches of a gradient op over `ring.BackwardIn` (params: the relay row) -> (its gradient[,
        the input's cotangent]);
        the worker that does not compute gives zeros (and the cotangent as it is), so that what it
        adds to its sums is nothing. The gradient leaves the branch as its leaves and is raveled
        outside (`op`): raveled in the branch, XLA:CPU fused the layout transposes of the
        convolutions' weight gradients into the raveling concatenate as a strided elementwise loop
        (measured at N = 2: 384 ms for the last stage, 2.4 s a step against 1.6 s; XLA's
        temporaries at N = 4 also fell, 70.2 -> 62.4 MiB)."""
        shards = self.shards

        def compute(i: ring.BackwardIn):
            out = piece(i._replace(params=shards.join(j, i.params)))
            return varying((out.partial, out.cot) if with_cot else (out.partial,), AXIS)

        def idle(i: ring.BackwardIn):
            zeros = shards.join(j, jnp.zeros((shards.layout.sizes[j],), jnp.float32))
            return varying((zeros, i.cot) if with_cot else (zeros,), AXIS)

        return compute, idle

    def scatter(self, b, ops, gradients, me):
        """Piece u of each gradient op's gradient to worker u, added to its running sum (the worker's
        own piece too), or the sum's start for the step's first gradient op; the tick's pieces travel
        batched (`exchange`), and a device adds only what was sent to it (zeros elsewhere: exact).
        Starting the sum at the first op, rather than emptying it at the update, writes no zeros."""
        N = self.z.workers
        flat = {i: g for i, g in enumerate(gradients) if g is not None}
        pieces = {i: self.shards.pieces(ops[i].stage, g) for i, g in flat.items()}
        sent = [Piece(ops[i].worker, u, (i,), self.shards.piece[ops[i].stage]) for i in flat for u in range(N)
                if u != ops[i].worker]
        got = exchange(sent, lambda p: pieces[p.what[0]][p.dst], me, N, self.codecs.gradients)
        for i in flat:
            op = ops[i]
            terms = [pieces[i][u] if u == op.worker
                     else jnp.where(me == u, got[(op.worker, u, (i,))], 0.0) for u in range(N)]
            total = None if op.starts else b[("sums", op.stage)]
            for term in terms:
                total = term if total is None else total + term
            b[("sums", op.stage)] = total

    def apply(self, b, tk, valid):
        """Every worker applies the update of its pieces of the stages whose sum is complete (the
        previous version kept)."""
        tx, z = self.tx, self.z
        for j, lag in tk.applies:
            pred = valid[lag]
            old = b[("master", j, 0)]
            p, o = b.cond(pred, lambda p, o, g: varying(optim.apply(tx, p, o, g), AXIS),
                          lambda p, o, g: varying((p, o), AXIS), (old, b[("opt_state", j)], b[("sums", j)]),
                          reads=[("sums", j)], writes=[("master", j, 0), ("opt_state", j)])
            if z.versions == 2:
                ring._pick(b, pred, ("master", j, 1), old)
            b[("master", j, 0)], b[("opt_state", j)] = p, o


class Work(NamedTuple):
    """What a worker's ops read and write (the operands of their `lax.switch`: nothing else goes
    through it): per stage the model state, input (`acts`), output cotangent (`cots`), kept
    residuals (`residuals`, empty unless 'carry'); the labels of its micro-batch; per gradient slot of a
    tick, the gradient its gradient op made in this tick as N pieces of the widest piece's length
    ([S, N, P], zero-padded; `ZeroRouting.op_slot`); the metric sums of the period."""

    model_state: tuple
    acts: tuple
    cots: tuple
    residuals: tuple
    labels: jax.Array
    grads: jax.Array
    metrics: jax.Array


class ZeroState(NamedTuple):
    """One worker's buffers while a period runs (the scan's carry): its pieces of every stage laid
    end to end (`Shards.offsets`) per version row (`master` [V, F]), their optimizer state per stage,
    its running gradient sums laid out as `master` ([F]); the relay rows [R, N * P] (each stage's N
    pieces at a stride of the widest piece P); what its ops work on (`Work`)."""

    master: jax.Array
    opt_state: tuple
    sums: jax.Array
    relay: jax.Array
    work: Work


@typed_state(renamed={"residuals": "kept"})
class PiecesState(NamedTuple):
    """cdp-zero's train state between calls (what checkpoints hold), a leading worker axis on each
    array: worker i's piece i of every stage.

    master: the pieces per stage and version (current, and previous where the table reads it; not
      `params`: a worker holds 1/N of each stage's parameters, flat, never a stage's tree): with
      `zero_period='scan'` laid end to end `[N, V, F]`, else `[stage][version]` lists. opt_state: per
      stage, the optax state of the worker's piece, stepped at the stage's update tick. sums: the
      running gradient sums of its pieces, laid out as `master` (one row, or per stage). relay: the
      rows a visitor gathers stages into (a visit may run into the next call). fed: whether each of
      the last calls fed a batch. model_state, acts, cots, labels, residuals: the ring's `Stash`.
    """

    master: jax.Array | list
    opt_state: list
    sums: jax.Array | list
    relay: jax.Array | list
    fed: jax.Array
    model_state: list
    acts: list
    cots: list
    labels: jax.Array
    residuals: list | None = None


class ZeroScan:
    """One worker's period as one `lax.scan` over its T ticks (`ZeroState` the carry), its ops and
    its messages data (`ZeroRouting`, indexed by the scan's counter and `axis_index`). Per tick:
    the gathers: one `all_to_all` in which every worker sends every other one, per gather slot,
    its piece of the stage and version row the receiver's gather names (a window of the widest
    piece's length P read at the stage's offset of its laid-out pieces), landed in the visitor's
    relay row; each worker's ops (per position a `lax.switch` over the (kind, stage) pairs; an op
    of a step not fed idles); one `all_to_all` of the gradient slots, piece u of each to worker u,
    added to its running sum in the tick's op order (or starting it; a step not fed adds zeros);
    then per stage a cond that applies its update at its update tick. The program holds each op's
    maths once per position and two collectives per tick, whatever N; the price is padding: every
    slot crosses every route every tick, as long as the widest piece (`zero_events`)."""

    def __init__(self, stages: ring.Stages, program: Program, tx, shards: Shards, codecs: Codecs = Codecs()):
        self.stages, self.program, self.tx, self.shards, self.codecs = stages, program, tx, shards, codecs
        self.carry, self.split = program.carries, program.split_backward
        self.z: ZeroTicks = zero_program_period(program)  # the period the program's events say
        self.routing: ZeroRouting = zero_routing(self.z)
        self.grad_slots = self.routing.grad_stage.shape[-1]
        self.op_branches = [[self._op(kind, j) for kind, j in kinds] + [_idle]
                            for kinds in self.routing.op_kinds]
        self.apply_at = {a.stage: (t, a.lag) for t, tk in enumerate(self.z.ticks) for a in tk.applies}  # one a stage

    def _apply(self, j: int, master, opt, sums, pred):
        """Every worker's update of its piece of stage j where pred (the previous version kept): a
        cond on stage j's window of the laid-out pieces."""
        tx, two, sh = self.tx, self.z.versions == 2, self.shards
        lo, n = sh.offsets[j], sh.piece[j]

        def run(rows, o, g):
            p, o = optim.apply(tx, rows[0], o, g)
            return varying((jnp.stack([p, rows[0]]) if two else p[None], o), AXIS)

        rows, o = lax.cond(pred, run, lambda rows, o, g: varying((rows, o), AXIS), master[:, lo:lo + n], opt,
                           sums[lo:lo + n])
        return master.at[:, lo:lo + n].set(rows), o

    # -- one op of the device, its stage joined from the relay row it reads
    def _op(self, kind: str, j: int):
        if op_kinds.lookup(kind).reads_cotangent:  # backward work (the lowering refuses kinds with no piece)
            return self._gradient_op(kind, j)
        return self._forward(j)

    def _forward(self, j: int):
        stages, carry, L, shards = self.stages, self.carry, self.z.stages, self.shards
        ops = stages.ops

        def run(c: Work, rows, images, new_labels, relay, slot):
            p = shards.join_strided(j, rows[relay])
            x = images if j == 0 else c.acts[j]
            labels = new_labels if j == 0 else c.labels
            residuals = c.residuals
            if carry:
                out, k, (ms, metrics) = ops.forward_residuals(j, p, c.model_state[j], x, labels)
                residuals = ring._set(residuals, j, k)
            else:
                out, (ms, metrics) = ops.run(j, p, c.model_state[j], x, labels)
            acts = ring._set(c.acts, j + 1, out) if j < L - 1 else c.acts
            if j == 0:  # a new micro-batch: its image (stage 0's input) and labels stay until its backward
                acts = ring._set(acts, 0, images)
            return varying(c._replace(acts=acts, residuals=residuals, model_state=ring._set(c.model_state, j, ms),
                                      metrics=c.metrics + metrics, labels=new_labels if j == 0 else c.labels), AXIS)
        return run

    def _gradient_op(self, kind: str, j: int):
        """Backward work: the input's cotangent to cots[j-1] where the kind computes it; where it
        completes the gradient, the stage's gradient as its N pieces into gradient slot `slot`."""
        L, carry, shards = self.z.stages, self.carry, self.shards
        flags = op_kinds.lookup(kind)
        cotangent = flags.cotangent
        gradient = flags.completes_gradient(self.split)
        want = tuple(name for name, on in (("params", gradient), ("input", cotangent)) if on)

        def run(c: Work, rows, images, new_labels, relay, slot):
            p = shards.join_strided(j, rows[relay])
            seed = c.cots[j] if j < L - 1 else varying(jnp.zeros((), jnp.float32), AXIS)
            keep = c.residuals[j] if carry else None
            d_params, d_input, _ = self.stages.ops.backward(j, p, c.model_state[j], c.acts[j], c.labels, seed, keep,
                                                            want)
            if cotangent and j > 0:
                c = c._replace(cots=ring._set(c.cots, j - 1, d_input))
            if gradient:
                c = c._replace(grads=c.grads.at[slot].set(shards.strided(j, shards.cut(j, d_params))))
            return varying(c, AXIS)
        return run

    # -- the tick's messages, chosen by the routing arrays
    def _send(self, chunks, codec: Codec, me):
        """chunks [N, slots, P] (row u for worker u) through one all-to-all: [N, slots, P], row u what
        worker u sent this one, encoded piece by piece by `codec` (its own row exact)."""
        N = self.z.workers
        if codec.lossless:
            return lax.all_to_all(chunks, ring.WORKERS, 0, 0)
        flat = chunks.reshape(-1, chunks.shape[-1])
        wire = jax.vmap(codec.encode)(flat)
        wire = jax.tree.map(lambda x: lax.all_to_all(x.reshape(N, -1, *x.shape[1:]), ring.WORKERS, 0, 0), wire)
        like = jax.ShapeDtypeStruct((chunks.shape[-1],), jnp.float32)
        got = jax.vmap(lambda e: codec.decode(e, like))(jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), wire))
        got = got.reshape(chunks.shape)
        return jnp.where((jnp.arange(N) == me)[:, None, None], chunks[me][None], got)

    def _gather(self, c: ZeroState, t, me, table) -> jax.Array:
        """Every worker's piece of each gather's stage (version row the gather names) into the
        visitor's relay row, one all-to-all for the tick's gather slots."""
        sh, L = self.shards, self.z.stages
        stage = table["gather_stage"][t]  # [N, G]: the receiver's gathers
        start = jnp.asarray(sh.offsets + (0,), jnp.int32)[stage]
        lane = jnp.arange(sh.widest, dtype=jnp.int32)
        chunks = c.master[table["gather_row"][t][..., None], start[..., None] + lane]  # [N, G, P]
        # past the stage's piece the window reads the next stage's: zeros instead, so that a block
        # codec's scales see the piece alone, as the unrolled period encodes it
        length = jnp.asarray(sh.piece + (0,), jnp.int32)[stage]
        chunks = jnp.where(lane < length[..., None], chunks, 0.0)
        got = self._send(chunks, self.codecs.parameters, me)
        relay = c.relay
        for g in range(stage.shape[-1]):
            row, lands = table["gather_relay"][t, me, g], stage[me, g] < L
            relay = relay.at[row].set(jnp.where(lands, got[:, g].reshape(-1), relay[row]))
        return relay

    def _scatter(self, c: ZeroState, t, me, table, valid) -> jax.Array:
        """Piece u of each gradient slot to worker u (one all-to-all), each added to the receiver's
        running sum of its stage, in the tick's op order (sender, then slot), or starting it; a step
        not fed adds zeros. A window of P is read and written at the stage's offset: past the stage's
        piece the gradient's padding adds zeros, and a start clears the piece only."""
        sh, L = self.shards, self.z.stages
        got = self._send(jnp.swapaxes(c.work.grads, 0, 1), self.codecs.gradients, me)  # [N senders, S, P]
        offsets = jnp.asarray(sh.offsets + (0,), jnp.int32)
        lengths = jnp.asarray(sh.piece + (0,), jnp.int32)
        lane = jnp.arange(sh.widest, dtype=jnp.int32)

        def add(src, sums):
            for s in range(self.grad_slots):
                j, lag, starts = (table[name][t, src, s] for name in ("grad_stage", "grad_lag", "grad_starts"))
                piece = jnp.where((j < L) & valid[lag], got[src, s], 0.0)
                old = lax.dynamic_slice(sums, (offsets[j],), (sh.widest,))
                new = jnp.where(starts & (lane < lengths[j]), 0.0, old) + piece
                sums = lax.dynamic_update_slice(sums, new, (offsets[j],))
            return varying(sums, AXIS)

        return lax.fori_loop(0, self.z.workers, add, c.sums)

    def __call__(self, state, images, new_labels, feeding):
        z, r, sh = self.z, self.routing, self.shards
        me = lax.axis_index(ring.WORKERS)
        valid = jnp.concatenate([jnp.reshape(feeding, (1,)), state.fed])
        master = state.master
        if z.versions == 2:  # a call after an unfed one restarts the cycle: both versions the newest
            master = master.at[1].set(jnp.where(state.fed[0], master[1], master[0]))
        table = {name: jnp.asarray(getattr(r, name)) for name in r._fields if name != "op_kinds"}
        work = Work(tuple(state.model_state), tuple(state.acts), tuple(state.cots),
                    tuple(state.residuals) if self.carry else (), state.labels,
                    jnp.zeros((self.grad_slots, z.workers, sh.widest), jnp.float32), self.stages.ops.no_metrics())
        c = varying(ZeroState(master, tuple(state.opt_state), state.sums, state.relay, work), AXIS)

        def tick(c: ZeroState, t):
            c = c._replace(relay=self._gather(c, t, me, table))
            for k, branches in enumerate(self.op_branches):
                at = (t, me, k)
                branch = jnp.where(valid[table["op_lag"][at]], table["op_branch"][at], len(branches) - 1)
                c = c._replace(work=lax.switch(branch, branches, c.work, c.relay, images, new_labels,
                                               table["op_relay"][at], table["op_slot"][at]))
            c = c._replace(sums=self._scatter(c, t, me, table, valid))
            master, opt = c.master, c.opt_state
            for j, (at_t, lag) in sorted(self.apply_at.items()):  # at its update tick, its step fed
                master, o = self._apply(j, master, opt[j], c.sums, (t == at_t) & valid[lag])
                opt = ring._set(opt, j, o)
            return varying(c._replace(master=master, opt_state=opt), AXIS), None

        c, _ = lax.scan(tick, c, jnp.arange(len(z.ticks), dtype=jnp.int32))
        w = c.work
        new = PiecesState(master=c.master, opt_state=list(c.opt_state), sums=c.sums, relay=c.relay,
                          fed=jnp.concatenate([jnp.reshape(feeding, (1,)), state.fed[:-1]]),
                          model_state=list(w.model_state), acts=list(w.acts), cots=list(w.cots), labels=w.labels,
                          residuals=list(w.residuals) if self.carry else None)
        return new, w.metrics


def _idle(c: Work, *_):  # an op not fed, or no op at this position
    return varying(c, AXIS)


def _landed(row, *pieces):
    """A stage's pieces written into the head of `row`, its tail zeroed."""
    at = 0
    for p in pieces:
        row = row.at[at:at + p.shape[0]].set(p)
        at += p.shape[0]
    return varying(row.at[at:].set(0.0), AXIS)


class Piece(NamedTuple):
    """One piece a tick sends from worker `src` to worker `dst`, `size` elements; `what` names it
    for the code that makes it (the sender) and takes it (the receiver)."""

    src: int
    dst: int
    what: tuple
    size: int


def messages(pieces, workers: int, length=lambda p: p.size) -> list[list[tuple[int, int, tuple[Piece, ...]]]]:
    """The tick's pieces as messages: a pair's pieces one after the other, and the pairs of one
    route (offset dst - src mod N) whose payloads have one length in one `ppermute` (a permute's
    pairs send buffers of one shape: pieces of other lengths go in messages of their own, so that
    nothing is padded and the bytes are the pieces'). `length(piece)`: its rows on the wire (its
    elements; a block codec's blocks). Sorted by (route, length)."""
    by_pair: dict = defaultdict(list)
    for p in pieces:
        by_pair[(p.src, p.dst)].append(p)
    routes: dict = defaultdict(list)
    for (src, dst), ps in sorted(by_pair.items()):
        routes[((dst - src) % workers, sum(length(p) for p in ps))].append((src, dst, tuple(ps)))
    return [routes[k] for k in sorted(routes)]


def _wire_rows(codec: Codec, size: int) -> int:
    """Rows of a piece of `size` float32 elements on the wire: its blocks (a block codec), else its elements."""
    return -(-size // BLOCK) if codec.blocked else size


def exchange(pieces, value, me, workers: int, codec: Codec = CODECS["none"]) -> dict:
    """Sends `pieces` (`Piece`s; `value(piece)` its float32 array on the sender) batched by `messages`,
    one `ppermute` each, every piece encoded by `codec` on its own (the bytes of its `Send` event:
    a block codec's blocks never span two pieces) and decoded where it lands; returns {(src, dst,
    what): the piece as its receiver holds it} (on other devices whatever their own message brought:
    a receiver reads only its own)."""
    rows = functools.partial(_wire_rows, codec)
    got = {}
    for message in messages(pieces, workers, lambda p: rows(p.size)):
        payloads = [_joined([codec.encode(value(p)) for p in ps]) for _, _, ps in message]
        if len(message) == 1:
            payload = payloads[0]
        else:  # each sender builds its own payload only
            which = np.zeros((workers,), np.int32)
            for k, (src, _, _) in enumerate(message):
                which[src] = k
            payload = lax.switch(jnp.asarray(which)[me], [lambda *xs, k=k: varying(xs[k], AXIS)
                                                          for k in range(len(payloads))], *payloads)
        received = jax.tree.map(lambda x: lax.ppermute(x, ring.WORKERS, [(src, dst) for src, dst, _ in message]),
                                payload)
        for src, dst, ps in message:
            at = 0
            for p in ps:
                n = rows(p.size)
                part = jax.tree.map(lambda x: x[at:at + n], received)
                got[(src, dst, p.what)] = codec.decode(part, jax.ShapeDtypeStruct((p.size,), jnp.float32))
                at += n
    return got


def _joined(encoded: list):
    """Encoded pieces as one payload (and one scale row), in order; one piece as it is."""
    if len(encoded) == 1:
        return encoded[0]
    return jax.tree.map(lambda *xs: jnp.concatenate(xs), *encoded)


def _land(b: ring.Buffers, pred, name, pieces):
    """A stage's pieces written into the head of row `name` where pred, its tail zeroed, in place
    (a joined copy of the pieces would be a row-sized temporary per gather)."""
    b[name] = b.cond(pred, _landed, lambda row, *pieces: varying(row, AXIS), (b[name], *pieces), writes=(name,))


_STASHED = ("model_state", "acts", "cots")  # per-stage buffers named by field, as the ring's pieces read them


def _named(state: PiecesState, z: ZeroTicks, carry: bool) -> dict:
    named = {("master", j, r): state.master[j][r] for j in range(z.stages) for r in range(z.versions)}
    named.update({("opt_state", j): state.opt_state[j] for j in range(z.stages)})
    named.update({("sums", j): state.sums[j] for j in range(z.stages)})
    named.update({("relay", r): state.relay[r] for r in range(z.relay_rows)})  # a visit may run into the next call
    for field in _STASHED + (("residuals",) if carry else ()):
        named.update({(field, j): v for j, v in enumerate(getattr(state, field))})
    named[("labels",)] = state.labels
    return named


def _unnamed(b, state: PiecesState, z: ZeroTicks, carry: bool, fed) -> PiecesState:
    per_stage = {field: [b[(field, j)] for j in range(len(getattr(state, field)))]
                 for field in _STASHED + (("residuals",) if carry else ())}
    return PiecesState(master=[[b[("master", j, r)] for r in range(z.versions)] for j in range(z.stages)],
                       opt_state=[b[("opt_state", j)] for j in range(z.stages)],
                       sums=[b[("sums", j)] for j in range(z.stages)],
                       relay=[b[("relay", r)] for r in range(z.relay_rows)], fed=fed, labels=b[("labels",)],
                       **per_stage)


def _method(ctx: Context, net, table, program: Program, residuals: str, period: str) -> Method:
    # Long on purpose: the method's closures (init, steps, flush, export) share what is built here.
    use_canonical_cpu_convolutions()  # stages inside cond branches: XLA:CPU's slow path otherwise
    tx, N, L = ctx.optimizer(), program.devices, len(program.placement.units)
    mesh = ring.ring_mesh(ctx.mesh, N)  # one ring: cdp-zero runs one worker per device
    batch = int(ctx.config.global_batch_size)
    micro = batch // N
    carry = program.carries
    stages = ring.make_stages(net, N, micro, mesh, residuals, ctx.task)
    shapes, _ = jax.eval_shape(lambda: net.init(jax.random.key(0)))
    shards = Shards(FlatLayout.from_trees(shapes), N)
    codecs = Codecs.from_config(ctx.config)
    if codecs.feedback:
        raise ConfigError("compress.feedback=True: cdp-zero's gradient pieces keep no error feedback (each sender "
                          "would hold a whole stage's remainder, against its 1/N share); set compress.feedback=False")
    program = with_codecs(program, codecs)
    scanned = period == "scan"  # the form `lower_zero` was given
    period = (ZeroScan if scanned else ZeroPeriod)(stages, program, tx, shards, codecs)
    z: ZeroTicks = period.z
    per_worker = NamedSharding(mesh, P(AXIS))

    one_period, step, run = ring.spmd_period(period, stages, mesh)

    def init(rng):
        params, model_state = net.init(rng)
        pieces = [shards.cut(j, p) for j, p in enumerate(params)]  # [N, piece[j]] each: worker i keeps row i
        stash = ring.stash_buffers(stages, model_state, carry)  # the natural per-stage buffers, as the ring's
        laid = shards.lay(pieces)  # [N, laid]: the scan reads a worker's pieces as one array
        state = PiecesState(
            # current (, previous)
            master=jnp.stack([laid] * z.versions, 1) if scanned else [[p] * z.versions for p in pieces],
            opt_state=[jax.vmap(tx.init)(p) for p in pieces],
            sums=jnp.zeros_like(laid) if scanned else [jnp.zeros_like(p) for p in pieces],
            # the scan carries one array in place; the unrolled period names each row
            relay=(jnp.zeros((N, z.relay_rows, shards.width), jnp.float32) if scanned else
                   [jnp.zeros((N, shards.width), jnp.float32) for _ in range(z.relay_rows)]),
            fed=jnp.zeros((N, max(z.max_lag, 1)), bool),
            **jax.tree.map(lambda a: jnp.broadcast_to(a, (N, *a.shape)), stash)._asdict(),
        )
        return jax.device_put(state, per_worker)

    @jax.jit
    def train_step(state, batch_):
        return one_period(state, batch_["image"], batch_["label"], jnp.ones((), bool))

    def run_steps(state, batches):
        return run(state, batches["image"], batches["label"], jnp.ones((batches["label"].shape[0],), bool))

    def flush(state):
        images = jnp.zeros((batch, *net.input_shape), stages.input_dtype, device=per_worker)
        labels = jnp.zeros((batch, *stages.label_shape), stages.label_dtype, device=per_worker)
        for _ in range(z.max_lag):
            state = step(state, images, labels, False)[0]
        return state

    def export(state):
        # Each stage joined from every worker's current piece; running averages averaged over workers.
        current = [shards.unlay(j, state.master[:, 0]) if scanned else state.master[j][0] for j in range(L)]
        params = [shards.join(j, current[j]) for j in range(L)]
        return params, jax.tree.map(lambda a: a.mean(0), state.model_state)

    return Method("cdp-zero", net, init, train_step, export, flush, table, program=program, run_steps=run_steps,
                  periods=run, carrier=stages, stale=table.stale, workers=N, devices=N, state_depends_on_mesh=True,
                  padding={"params": shards.padding()},
                  report={"impl": "zero", "rule": table.meta["rule"], "shards": N,
                          "period": "scan" if scanned else "unrolled"})


__all__ = ["Shards", "Work", "ZeroPeriod", "ZeroScan", "ZeroState", "build"]
