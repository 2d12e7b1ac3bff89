"""`cdp-zero`: cyclic data parallelism with each stage's parameters and optimizer state on one
owner, brought point to point to each op just before it runs (ZeRO's sharding, CDP's messages).

Timing and update rule: those of `cdp-v2` (or `cdp-v1`, `config.cdp_rule`; whole or split
backwards, `config.cdp_ticks`) in the `ring` realisation of `cdpjax.methods.cdp`: N
workers on the N devices of the `data` axis, the period unrolled, one `lax.cond` per op on
`axis_index == its worker`, every stage's maths `cdpjax.methods.stage_ops`'s through the
ring's op pieces (`cdpjax.methods.ring`). After S steps and a flush the parameters equal
the ring's (and so `simulate`'s):

    theta^j_{k+1} = opt^j(theta^j_k, mean_i g_i^j(version the table names)).

What differs is where the model lives (the plan: `cdpjax.layouts.cdp_zero`; the program:
`cdpjax.program.zero`):
- Stage j's parameters (and its previous version, where some op reads it) and its optax
  state are kept by ONE worker, its owner, as rows as long as the largest stage; a worker
  keeps only the stages it owns (ceil(L/N), one for N >= L).
- At the start of each visit (a worker's consecutive ops on one stage) the owner sends the
  version the visit reads, a message of the stage's real size, into the worker's one relay
  row (train state: a visit may run on into the next call); the owner's own visits read
  its rows. A stale read after the update reads the
  owner's previous version, which the table's slots name.
- Gradients: a running partial sum hops from worker to worker as the others finish the
  stage's gradient op, then to the owner, who adds its own contribution and applies the
  update at the end of the table's update tick; no sum goes back to the readers: the new
  parameters reach them with the next visit.
- Collectives: `ppermute`s of single (source, destination) pairs, each of its stage's size,
  and the psum of the three metric scalars: no all-gather, reduce-scatter or all-reduce
  of model-sized buffers.

Per worker and step the messages carry about 2(N-1)/N of the model in parameters and
(N-1)/N in gradients (ZeRO-3's all-gathers and reduce-scatter), spread over the ticks.
Per worker it stores K (x versions) parameter rows, K optimizer-state rows, one relay row
and the gradient rows a partial sum spans the end of a call in (the others are temporaries
of the call, `cdpjax.program.zero.temporary_grad_rows`), each as large as the largest
stage: a fraction 1/N of the ring's parameters where stages are balanced by parameters,
and more where one stage dominates (`Method.padding`, `cdpjax bench`).

BatchNorm running statistics (small) stay per worker for every stage, as in `ring`. After
a flush the next fed call restarts the cycle from the flushed parameters, as the ring
does: the owners' previous versions are set to their current ones.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from cdpjax import optim
from cdpjax.carrier import FlatLayout
from cdpjax.errors import ConfigError
from cdpjax.layouts.cdp import TICKS
from cdpjax.layouts.cdp_zero import ZERO_RULES, cdp_zero_table
from cdpjax.methods import ring
from cdpjax.methods.common import Context, Method, varying
from cdpjax.program import Program
from cdpjax.program.zero import ZeroTicks, lower_zero, temporary_grad_rows
from cdpjax.xla_cpu import use_canonical_cpu_convolutions

AXIS = ring.AXIS


def build(ctx: Context) -> Method:
    cfg = ctx.config
    ctx.require_axes("cdp-zero", (AXIS,))
    rule = cfg.get("cdp_rule", "cdp-v2")
    if rule not in ZERO_RULES:
        raise ConfigError(f"cdp_rule={rule!r} is not one of {', '.join(ZERO_RULES)} (cdp-zero's staleness rule)")
    ticks = cfg.get("cdp_ticks", "whole")
    if ticks not in TICKS:
        raise ConfigError(f"cdp_ticks={ticks!r} is not one of {', '.join(TICKS)}")
    residuals = cfg.get("residuals", "recompute")
    if residuals not in ring.RESIDUALS:
        raise ConfigError(f"residuals={residuals!r} is not one of {', '.join(ring.RESIDUALS)}")
    devices = ctx.axis(AXIS)
    workers = int(cfg.get("workers", 0)) or devices
    if workers != devices:
        raise ConfigError(f"cdp-zero runs one worker per device: workers={workers} must equal mesh.data={devices} "
                          f"(or be 0)")
    net = ctx.net(bn_axis_name=None)
    table = cdp_zero_table(workers, net.num_stages, rule=rule, ticks=ticks)  # refuses N not dividing T
    ctx.require_divisible("global_batch_size", cfg.global_batch_size, workers, "workers")
    return _method(ctx, net, table, lower_zero(table, residuals), residuals)


class ZeroPeriod:
    """One worker's period (`ring.Period`'s shape, `cdp-zero`'s storage): per tick the refreshes,
    the ops, the partial sums sent, the owners' updates; then the tick is fenced."""

    def __init__(self, stages: ring.Stages, program: Program, tx, carry: bool, layout: FlatLayout):
        self.stages, self.program, self.tx, self.carry, self.layout = stages, program, tx, carry, layout
        self.z: ZeroTicks = program.ticks
        L = self.z.stages
        split = program.split_backward
        self.fwd = [ring.forward_piece(stages, j, carry) for j in range(L)]
        self.bwd = [ring.backward_piece(stages, j, carry, split, start=True) for j in range(L)]
        self.wgt = [ring.weight_piece(stages, j, carry, start=True) for j in range(L)]
        self.split = split

    def __call__(self, state, images, new_labels, feeding):
        z, me = self.z, lax.axis_index(AXIS)
        b = ring.Buffers(_named(state, z, self.carry))
        b[("metrics",)] = varying(self.stages.ops.no_metrics(), AXIS)
        if z.versions == 2:  # a call after an unfed one restarts the cycle: both versions the newest
            for k in range(z.owned):
                b[("master", k, 1)] = jnp.where(state["fed"][0], b[("master", k, 1)], b[("master", k, 0)])
        valid = [feeding] + [state["fed"][lag - 1] for lag in range(1, z.max_lag + 1)]
        b[("after",)] = varying(jnp.zeros((), jnp.float32), AXIS)
        for tk in z.ticks:
            before = dict(b.values)
            self.refresh(b, tk, me)
            for op in tk.ops:
                self.op(b, op, (me == op.worker), valid[op.lag], images, new_labels)
            self.send(b, tk, me)
            self.apply(b, tk, me, valid)
            # The next tick's refreshes wait for this tick: an owner's row that no tick before has
            # changed is the same value from the call's start, and XLA would send every such
            # refresh at the first tick and hold the messages (measured: three row-sized ones).
            written = [v for name, v in b.values.items() if v is not before.get(name) and name != ("after",)]
            b[("after",)] = sum((ring.zero_of(v) for v in written), b[("after",)])
            b.barrier()
        new = _unnamed(b, state, z, self.carry)
        new["fed"] = jnp.concatenate([jnp.reshape(feeding, (1,)), state["fed"][:-1]])
        return new, b[("metrics",)]

    def refresh(self, b, tk, me):
        """Each visit's stage from its owner's row, at the stage's size, into the visitor's relay."""
        for j, owner, worker, k, row, r in tk.refreshes:
            size = self.layout.sizes[j]
            arrived = lax.ppermute(b[("master", k, row)][:size] + b[("after",)], AXIS, [(owner, worker)])
            _land(b, me == worker, ("relay", r), arrived)

    def op(self, b, op, mine, valid, images, new_labels):
        j, L = op.stage, self.z.stages
        source = op.params
        row = b[source]
        pred = mine & valid
        if op.kind == "F":
            x = images if j == 0 else b[("acts", j)]
            labels = new_labels if j == 0 else b[("labels",)]
            old = {"next": b[("acts", j + 1)]} if j < L - 1 else {}
            if self.carry:
                old["kept"] = b[("kept", j)]
            writes = ([("acts", j + 1)] if j < L - 1 else []) + ([("kept", j)] if self.carry else []) + [("ms", j)]
            reads = [source, ("ms", j)] + ([("acts", j), ("labels",)] if j > 0 else [])
            new, ms, metrics = b.cond(pred, *self._on_row(j, *self.fwd[j]), (row, b[("ms", j)], x, labels, old),
                                      reads, writes)
            if j < L - 1:
                b[("acts", j + 1)] = new["next"]
            if self.carry:
                b[("kept", j)] = new["kept"]
            b[("ms", j)] = ms
            b[("metrics",)] = b[("metrics",)] + metrics
            if j == 0:  # a new micro-batch: its image and labels stay until its backward ops
                ring._pick(b, pred, ("acts", 0), images)
                ring._pick(b, pred, ("labels",), new_labels)
            return
        zero = varying(jnp.zeros((), jnp.float32), AXIS)
        keep = b[("kept", j)] if self.carry else ()
        seed = b[("cots", j)] if j < L - 1 else zero
        reads = [source, ("ms", j), ("acts", j), ("labels",)] + ([("kept", j)] if self.carry else []) \
            + ([("cots", j)] if j < L - 1 else [])
        operands = (b[("ms", j)], b[("acts", j)], keep, seed, b[("labels",)])
        if op.kind == "B" and self.split:  # the input's cotangent only: no gradient row
            cot = b[("cots", j - 1)] if j > 0 else zero
            _, cot = b.cond(pred, *self._on_row(j, *self.bwd[j]), (row, *operands, zero, cot), reads,
                            [("cots", j - 1)] if j > 0 else [])
            if j > 0:
                b[("cots", j - 1)] = cot
            return
        if op.kind == "B":
            cot = b[("cots", j - 1)] if j > 0 else zero
            operands, piece = (*operands, zero, cot), self.bwd[j][0]
        else:
            operands, piece = (*operands, zero), self.wgt[j][0]
        out = ("grad", op.grad_out)
        partial = b[("grad", op.grad_in)] if op.grad_in >= 0 else None
        writes = [out] + ([("cots", j - 1)] if op.kind == "B" and j > 0 else [])
        total, *rest = b.cond(mine, *self._gradient_on_rows(j, piece, op.kind == "B", valid),
                              (row, b[out], partial, *operands), reads + ([("grad", op.grad_in)] if
                                                                          op.grad_in >= 0 else []), writes)
        b[out] = total
        if op.kind == "B" and j > 0:
            b[("cots", j - 1)] = rest[0]

    def _on_row(self, j, run, skip):
        """A piece's branches taking the stage's parameters as a row, unpacked in the branch that
        computes: no unpacked copy of them outlives the op."""
        return (lambda row, *operands: run(self.layout.unpack_one(j, row), *operands),
                lambda row, *operands: skip(None, *operands))

    def _gradient_on_rows(self, j, piece, with_cot: bool, valid):
        """Branches (on `mine`) of a gradient op over (row, its gradient row's old value, the partial
        sum received or None, operands) -> (the gradient row's new value[, the input's cotangent]):
        its gradient packed, plus the partial sum, in the branch that computes; a worker with nothing
        fed passes the partial sum on (or starts from zeros), another keeps the row as it is."""
        layout = self.layout

        def compute(row, partial, *operands):
            out = piece(layout.unpack_one(j, row), *operands)
            g, rest = (out[0], out[1:]) if with_cot else (out, ())
            total = layout.pack_one(j, g)
            return varying((total if partial is None else total + partial, *rest), AXIS)

        def idle(row, partial, *operands):
            total = jnp.zeros((layout.width,), jnp.float32) if partial is None else partial
            return varying((total, *operands[-1:]) if with_cot else (total,), AXIS)

        def run(row, old, partial, *operands):
            return lax.cond(valid, compute, idle, row, partial, *operands)

        def keep(row, old, partial, *operands):
            return varying((old, *operands[-1:]) if with_cot else (old,), AXIS)

        return run, keep

    def send(self, b, tk, me):
        """The partial sums of the tick, each at its stage's size; all read before any lands."""
        arrived = []
        for j, src, dst, src_row, dst_row in tk.sends:
            size = self.layout.sizes[j]
            arrived.append((dst, dst_row, size, lax.ppermute(b[("grad", src_row)][:size], AXIS, [(src, dst)])))
        for dst, dst_row, size, value in arrived:
            _land(b, me == dst, ("grad", dst_row), value)

    def apply(self, b, tk, me, valid):
        """Owners whose stage's sum is complete apply its update (the previous version kept)."""
        tx, z = self.tx, self.z
        for j, owner, lag, k, rows in tk.applies:
            g = b[("grad", rows[0])]
            for r in rows[1:]:  # the others' sum and the owner's own contribution
                g = g + b[("grad", r)]
            pred = (me == owner) & valid[lag]
            old = b[("master", k, 0)]
            p, o = b.cond(pred, lambda p, o, g: varying(optim.apply(tx, p, o, g), AXIS),
                          lambda p, o, g: varying((p, o), AXIS), (old, b[("opt", k)], g),
                          reads=[("grad", r) for r in rows], writes=[("master", k, 0), ("opt", k)])
            if z.versions == 2:
                ring._pick(b, pred, ("master", k, 1), old)
            b[("master", k, 0)], b[("opt", k)] = p, o


def _land(b: ring.Buffers, pred, name, message):
    """A stage-sized message written into the head of row `name` where pred, its tail zeroed, in
    place (a padded copy of the message would be a row-sized temporary per message)."""
    size = message.shape[0]

    def write(row, message):
        return varying(row.at[:size].set(message).at[size:].set(0.0), AXIS)

    b[name] = b.cond(pred, write, lambda row, message: varying(row, AXIS), (b[name], message), writes=(name,))


def _named(state, z: ZeroTicks, carry: bool) -> dict:
    named = {("master", k, r): state["master"][k][r] for k in range(z.owned) for r in range(z.versions)}
    named.update({("opt", k): state["opt_state"][k] for k in range(z.owned)})
    named.update({("grad", g): state["grad"][i] for i, g in enumerate(z.kept_grad_rows)})
    width = state["relay"][0].shape[-1]
    # a row no sum spans the period's end in starts every call empty (a temporary, not state)
    named.update({("grad", g): varying(jnp.zeros((width,), jnp.float32), AXIS) for g in temporary_grad_rows(z)})
    named.update({("relay", r): state["relay"][r] for r in range(z.relay_rows)})  # a visit may run into the next call
    for key, plural in (("ms", "model_state"), ("acts", "acts"), ("cots", "cots")) + \
            ((("kept", "kept"),) if carry else ()):
        named.update({(key, j): v for j, v in enumerate(state[plural])})
    named[("labels",)] = state["labels"]
    return named


def _unnamed(b, state, z: ZeroTicks, carry: bool) -> dict:
    new = {"master": [[b[("master", k, r)] for r in range(z.versions)] for k in range(z.owned)],
           "opt_state": [b[("opt", k)] for k in range(z.owned)],
           "grad": [b[("grad", g)] for g in z.kept_grad_rows], "labels": b[("labels",)],
           "relay": [b[("relay", r)] for r in range(z.relay_rows)]}
    for key, plural in (("ms", "model_state"), ("acts", "acts"), ("cots", "cots")) + \
            ((("kept", "kept"),) if carry else ()):
        new[plural] = [b[(key, j)] for j in range(len(state[plural]))]
    return new


def _method(ctx: Context, net, table, program: Program, residuals: str) -> Method:
    # Long on purpose: the method's closures (init, steps, flush, export) share what is built here.
    use_canonical_cpu_convolutions()  # stages inside cond branches: XLA:CPU's slow path otherwise
    z: ZeroTicks = program.ticks
    mesh, tx, N, L = ctx.mesh, ctx.optimizer(), z.workers, z.stages
    batch = int(ctx.config.global_batch_size)
    micro = batch // N
    carry = residuals == "carry"
    stages = ring.make_stages(net, N, micro, mesh, residuals, ctx.task)
    shapes, _ = jax.eval_shape(lambda: net.init(jax.random.key(0)))
    layout = FlatLayout.from_trees(shapes)
    period = ZeroPeriod(stages, program, tx, carry, layout)
    per_worker = NamedSharding(mesh, P(AXIS))
    owned = [[j for j in range(L) if z.owners[j] == w] for w in range(N)]

    one_period, step, run = ring.spmd_period(period, stages, mesh)

    def init(rng):
        params, model_state = net.init(rng)
        rows = layout.pack(params)  # [L, width]
        zero = jnp.zeros((layout.width,), jnp.float32)
        mine = [jnp.stack([rows[js[k]] if k < len(js) else zero for js in owned]) for k in range(z.owned)]
        stash = ring.stash_buffers(stages, model_state, carry)  # the natural per-stage buffers, as the ring's
        state = {
            "master": [[m] * z.versions for m in mine],  # [N, width] each: current (, previous)
            "opt_state": [jax.vmap(tx.init)(m) for m in mine],
            "grad": [jnp.zeros((N, layout.width), jnp.float32) for _ in z.kept_grad_rows],
            "relay": [jnp.zeros((N, layout.width), jnp.float32) for _ in range(z.relay_rows)],
            "fed": jnp.zeros((N, max(z.max_lag, 1)), bool),
            **jax.tree.map(lambda a: jnp.broadcast_to(a, (N, *a.shape)), stash),
        }
        return jax.device_put(state, per_worker)

    @jax.jit
    def train_step(state, batch_):
        return one_period(state, batch_["image"], batch_["label"], jnp.ones((), bool))

    def run_steps(state, batches):
        return run(state, batches["image"], batches["label"], jnp.ones((batches["label"].shape[0],), bool))

    def flush(state):
        images = jnp.zeros((batch, *net.input_shape), stages.input_dtype, device=per_worker)
        labels = jnp.zeros((batch, *stages.label_shape), jnp.int32, device=per_worker)
        for _ in range(z.max_lag):
            state = step(state, images, labels, False)[0]
        return state

    def export(state):
        # Each stage from its owner's current row; running averages averaged over workers.
        params = [layout.unpack_one(j, state["master"][z.local[j]][0][z.owners[j]]) for j in range(L)]
        return params, jax.tree.map(lambda a: a.mean(0), state["model_state"])

    return Method("cdp-zero", net, init, train_step, export, flush, table, program=program, run_steps=run_steps,
                  periods=run, carrier=stages, stale=table.stale, workers=N, devices=N, state_depends_on_mesh=True,
                  padding={"params": layout.padding()},
                  report={"impl": "zero", "rule": table.meta["rule"], "owners": list(z.owners)})


__all__ = ["ZeroPeriod", "build"]
