"""`cdp-zero`: cyclic data parallelism with ZeRO-sharded parameters, relayed point to point.

Timing and update rule: those of `cdp-v2` (or `cdp-v1`, `config.cdp_rule`) in the `ring`
realisation of `cdpjax.methods.cdp` (read its docstring first): N workers on the N devices
of the `data` axis, one `shard_map`, `lax.scan` over the 2L ticks of a steady-state period,
one `lax.switch` per tick over [idle, forward j, backward j], backward by recomputation,
`flush`. After S steps and a flush the parameters equal the ring's (and so `simulate`'s):

    theta^j_{k+1} = opt^j(theta^j_k, mean_i g_i^j(version the table names)).

What differs is where the model lives (`timetable.zero_period_arrays` is the program):
- Each stage's parameters and its optax state are kept by ONE worker, its owner; a
  worker keeps only the stages it owns (K = the most any worker owns: ceil(L/N), one
  for N >= L), as zero-padded flat rows. cdp-v2's owners keep only the current
  version (a stale op's backward gets the previous one from the relay, which still
  carries it); cdp-v1's keep current and previous.
- Parameters come to each op by a relay. Stage j's forwards (and its backwards) run
  worker after worker, one hop along the ring every d = 2L/N ticks, so the buffer an op
  used can follow them: at the end of every tick each worker passes the next worker the
  buffer it used d-1 ticks ago, which that worker needs in the next tick. The owner's
  hop sends its own stored copy instead, so each trip round the ring ("pass") starts
  from the owner's current state. The owner is the worker whose hop comes after the
  stage's update and before the first op that needs the new version; for cdp-v2 every
  op of a pass reads the same version, so a hop carries one stage (N = L: worker
  L-2-j owns stage j, one stage each); for cdp-v1 a pass spans an update, so a hop
  carries two versions (twice the parameter traffic) and each op reads the row of
  its version. Rows, versions and owners derive from the table's ops, versions and
  updates (`timetable._zero_plan`), for every N dividing 2L.
- Gradients: the running partial sum of a stage hops one worker along the ring as
  workers finish it, as in `ring`; the completed sum then goes on only as far as the
  owner (0 to N-1 hops within the update tick), which applies the optax update to its
  rows. No 'sum' broadcast: the new parameters reach the others by the relay.
- Collectives: one `ppermute` of a parameter buffer and one of a gradient buffer per
  tick (plus the owner-bound hops in update ticks), outside the switch; the only
  all-reduce is of the three metric scalars. No all-gather, reduce-scatter or
  all-reduce of model-sized buffers (tested on the compiled HLO).
- Memory per worker: K stage rows x (stored versions + optimizer state) + d relay
  buffers (x versions per hop) + d partial-sum buffers, against the ring's L stages x
  (2 versions + optimizer state) + an L-stage partial-sum inbox (`info['storage']`).
  Rows are padded to the largest stage (`info['padding']`): the saving is about 1/N
  of the ring's parameter and optimizer storage where stages are balanced.

BatchNorm running statistics (small) stay per worker for every stage, as in `ring`.
After a flush, the owners' previous versions are set to their current ones, as the
ring does, and training on restarts the cycle from the flushed parameters.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from cdpjax import models
from cdpjax import optim
from cdpjax.carrier import FlatLayout, init_opt
from cdpjax.errors import ConfigError
from cdpjax.methods.common import Context, Method, varying
from cdpjax.layouts.cdp_zero import ZERO_RULES, cdp_zero_table, zero_period_arrays

AXIS = "data"


# ------------------------------------------------ the padded rows cdp-zero runs on
# (its stage owners need them: see the module docstring, "Why padded rows")


@dataclasses.dataclass(frozen=True)
class Carrier:
    """Flat zero-padded buffers: per-stage gradients [P_max], stage inputs [A_max].

    param_sizes[j]: stage j's parameter count; inputs[j]: stage j's input shape for
    one micro-batch (inputs[L] = the logits' shape)."""

    param_sizes: tuple[int, ...]
    inputs: tuple[tuple[int, ...], ...]

    @property
    def p_max(self) -> int:
        return max(self.param_sizes)

    @property
    def a_max(self) -> int:
        return max(math.prod(s) for s in self.inputs[:-1])

    def padding(self) -> dict:
        """Storage reserved over storage needed: gradient buffers and stage-input stash."""
        L = len(self.param_sizes)
        return {"gradients": L * self.p_max / max(sum(self.param_sizes), 1),
                "activations": L * self.a_max / sum(math.prod(s) for s in self.inputs[:-1])}


def make_carrier(net, micro_batch: int) -> Carrier:
    params, _ = jax.eval_shape(lambda: net.init(jax.random.key(0)))
    sizes = tuple(int(sum(math.prod(x.shape) for x in jax.tree.leaves(p))) for p in params)
    outputs = net.stage_output_shapes(micro_batch)
    return Carrier(sizes, ((micro_batch, *net.input_shape), *(tuple(s) for s in outputs)))


def pad(x, size: int):
    flat = x.reshape(-1)
    return jnp.pad(flat, (0, size - flat.shape[0]))


def unpad(buf, shape):
    return buf[: math.prod(shape)].reshape(shape)


def _replace(items, j, value):
    return [value if k == j else v for k, v in enumerate(items)]


def worker_branches(net, workers: int, layout, inputs, a_max: int, row_of):
    """A CDP worker's ops for the per-tick `lax.switch`: [idle, forward of stage j..., backward of stage j...].

    Each maps (params, model_state, stash, cotangent, labels, images, new_labels) to
    (stash, cotangent, labels, model_state, gradient row, loss, correct, counted).
    `row_of(j, params)` is stage j's parameters as one padded row of `layout`, from
    whatever the realisation holds (`ring`: the slot the table names; `cdp-zero`: the
    row just relayed); the gradient comes back as such a row. A backward recomputes
    its stage from the stashed input.
    """
    L, p_max = net.num_stages, layout.width

    def idle(params, ms, stash, cot, labels, images, new_labels):
        zero = jnp.zeros((), jnp.float32)
        return varying((stash, cot, labels, ms, jnp.zeros((p_max,), jnp.float32), zero, zero, zero), AXIS)

    def forward(j):
        def branch(params, ms, stash, cot, labels, images, new_labels):
            if j == 0:  # a new micro-batch: stash its input and labels for the backward
                x, labels = images, new_labels
                stash = stash.at[0].set(pad(images, a_max))
            else:
                x = unpad(stash[j], inputs[j])
            y, ms_j = net.apply_stage(j, layout.unpack_one(j, row_of(j, params)), ms[j], x, True)
            ms = _replace(ms, j, ms_j)
            zero = jnp.zeros((), jnp.float32)
            if j < L - 1:
                stash = stash.at[j + 1].set(pad(y, a_max))
                loss = correct = counted = zero
            else:
                loss, correct, counted = models.cross_entropy(y, labels), models.accuracy(y, labels), zero + 1
            return varying((stash, cot, labels, ms, jnp.zeros((p_max,), jnp.float32), loss, correct, counted), AXIS)
        return branch

    def backward(j):
        def branch(params, ms, stash, cot, labels, images, new_labels):
            x = unpad(stash[j], inputs[j])

            def stage(row, x):  # recomputed from the stashed input; BN state updates are the forward's
                y, _ = net.apply_stage(j, layout.unpack_one(j, row), ms[j], x, True)
                # the 1/N makes the ring's sum of worker gradients their mean
                return models.cross_entropy(y, labels) / workers if j == L - 1 else y

            seed = varying(jnp.ones((), jnp.float32), AXIS) if j == L - 1 else unpad(cot, inputs[j + 1])
            row = row_of(j, params)
            if j == 0:  # the input needs no gradient
                _, vjp = jax.vjp(lambda r: stage(r, x), row)
                (g,) = vjp(seed)
            else:
                _, vjp = jax.vjp(stage, row, x)
                g, gx = vjp(seed)
                cot = pad(gx, a_max)
            zero = jnp.zeros((), jnp.float32)
            return varying((stash, cot, labels, ms, g, zero, zero, zero), AXIS)
        return branch

    return [idle] + [forward(j) for j in range(L)] + [backward(j) for j in range(L)]




def build(ctx: Context) -> Method:
    cfg = ctx.config
    ctx.require_axes("cdp-zero", (AXIS,))
    rule = cfg.get("cdp_rule", "cdp-v2")
    if rule not in ZERO_RULES:
        raise ConfigError(f"cdp_rule={rule!r} is not one of {', '.join(ZERO_RULES)} (cdp-zero's staleness rule)")
    devices = ctx.axis(AXIS)
    workers = int(cfg.get("workers", 0)) or devices
    if workers != devices:
        raise ConfigError(f"cdp-zero runs one worker per device: workers={workers} must equal mesh.data={devices} "
                          f"(or be 0)")
    net = ctx.net(bn_axis_name=None)
    table = cdp_zero_table(workers, net.num_stages, rule=rule)  # refuses N, L where 2L/N is not whole
    ctx.require_divisible("global_batch_size", cfg.global_batch_size, workers, "workers")
    return _zero(ctx, net, table, rule, workers)


def _zero(ctx: Context, net, table, rule: str, N: int) -> Method:
    mesh, tx, L = ctx.mesh, ctx.optimizer(), net.num_stages
    batch = int(ctx.config.global_batch_size)
    micro = batch // N
    T, d = 2 * L, 2 * L // N
    arrays = zero_period_arrays(N, L, rule)
    owners, local = tuple(int(o) for o in arrays.pop("owners")), tuple(int(k) for k in arrays.pop("local"))
    K, C, seed = int(arrays.pop("per_worker")), int(arrays.pop("versions")), arrays.pop("seed")
    # Stored versions per owned stage: cdp-v2's owners only ever send their current one (the
    # relay itself carries the previous version to the stale backwards), cdp-v1's send both.
    V = int(arrays["send_slot"].max()) + 1
    shapes, _ = jax.eval_shape(lambda: net.init(jax.random.key(0)))
    layout = FlatLayout.from_trees(shapes)
    p_max = layout.width
    carrier = make_carrier(net, micro)  # activations: the ring's stage-input stash
    a_max, inputs = carrier.a_max, carrier.inputs
    ring = [(i, (i + 1) % N) for i in range(N)]
    per_worker = NamedSharding(mesh, P(AXIS))

    def hop(x):
        return lax.ppermute(x, AXIS, ring) if N > 1 else x

    # The worker's ops are the ring's; here the stage's row is the one just relayed.
    branches = worker_branches(net, N, layout, inputs, a_max, lambda j, flat: flat)

    def tick(carry, x, feeding, inflight, images, new_labels):
        me = lax.axis_index(AXIS)
        master, opt, ms, relay, partial, stash, cot, labels, metrics = carry
        here = x["tick"] % d  # this tick's relay and partial-sum buffers
        planned = x["op"][me]
        # Ops of a step never fed run as idle (zero gradient, the partial sums stay exact).
        valid = jnp.where(x["step"][me] == 0, feeding, inflight)
        op = jnp.where(valid, planned, 0)
        flat = relay[here][x["read"][me]]
        stash, cot, labels, ms, grad, loss, correct, counted = lax.switch(
            op, branches, flat, ms, stash, cot, labels, images, new_labels)
        metrics = metrics + jnp.stack([loss, correct, counted])

        # Gradient: the running partial sum goes one hop on; the receiver needs it in d ticks.
        total = jnp.where(x["first"][me], 0.0, partial[here]) + grad
        got = total  # the completed sum, where the owner completed it itself
        received = hop(jnp.where(planned > L, total, 0.0))
        partial = partial.at[here].set(received)
        hops = x["sum_hop"][me]
        if N > 1:
            got = jnp.where(hops == 1, received, got)

            def relay_sum(h, c):  # the completed sum goes on to the owner, within the tick
                buf, got = c
                buf = hop(buf)
                return buf, jnp.where(hops == h, buf, got)

            # The hop count is the tick's, the same on every device: a loop, not a switch.
            _, got = lax.fori_loop(2, x["relay_hops"] + 1, relay_sum, (received, got))

        # The owner updates its rows (current -> previous, where it keeps one).
        k = x["update_local"]
        apply = (hops >= 0) & (x["update"] >= 0) & jnp.where(x["update_step"] == 0, feeding, inflight)
        rows = master[k]
        new, new_opt = optim.apply(tx, rows[0], jax.tree.map(lambda a: a[k], opt), got)
        master = master.at[k].set(jnp.where(apply, jnp.concatenate([new[None], rows[:-1]]), rows))
        opt = jax.tree.map(lambda a, b: a.at[k].set(jnp.where(apply, b, a[k])), opt, new_opt)

        # Parameters: pass on the buffer used d-1 ticks ago, or, on the owner's hop, its own rows
        # (after this tick's update); the receiver runs that stage in the next tick.
        nxt = (x["tick"] + 1) % d
        refresh = x["refresh"][me]
        own = master[jnp.maximum(refresh, 0)][x["send_slot"][me]]
        relay = relay.at[nxt].set(hop(jnp.where(refresh >= 0, own, relay[nxt])))
        return (master, opt, ms, relay, partial, stash, cot, labels, metrics), None

    xs = {k: np.asarray(v) for k, v in arrays.items() if k not in ("slot",)}
    xs["tick"] = np.arange(T, dtype=np.int32)
    xs["relay_hops"] = np.maximum(xs["sum_hop"].max(axis=1), 0).astype(np.int32)
    xs["update_local"] = np.asarray(local, np.int32)[np.maximum(xs["update"], 0)]

    def local_period(state, images, new_labels, feeding):
        s = jax.tree.map(lambda a: a[0], state)
        inflight = s["inflight"]
        carry = (s["master"], s["opt_state"], s["model_state"], s["relay"], s["partial"], s["stash"],
                 s["cotangent"], s["labels"], varying(jnp.zeros((3,), jnp.float32), AXIS))
        carry, _ = lax.scan(lambda c, x: tick(c, x, feeding, inflight, images, new_labels), carry,
                            jax.tree.map(jnp.asarray, xs))
        master, opt, ms, relay, partial, stash, cot, labels, metrics = carry
        # After a flush both stored versions are the newest, as at step 0 (see cdp.py).
        master = jnp.where(feeding, master, master[:, :1])
        new = {"master": master, "opt_state": opt, "model_state": ms, "relay": relay, "partial": partial,
               "stash": stash, "cotangent": cot, "labels": labels,
               "inflight": jnp.logical_and(jnp.ones_like(inflight), feeding)}
        loss, correct, counted = lax.psum(metrics, AXIS)  # three scalars: the only all-reduce
        counted = jnp.maximum(counted, 1.0)
        return jax.tree.map(lambda a: a[None], new), {"loss": loss / counted, "accuracy": correct / counted}

    sharded = jax.shard_map(local_period, mesh=mesh, in_specs=(P(AXIS), P(AXIS), P(AXIS), P()),
                            out_specs=(P(AXIS), P()), check_vma=True)
    period = jax.jit(sharded)  # not donated: the trainer keeps the old state when it skips a non-finite step

    owned = [[j for j in range(L) if owners[j] == w] for w in range(N)]

    def init(rng):
        params, model_state = net.init(rng)
        rows = layout.pack(params)  # [L, p_max]
        zero = jnp.zeros((p_max,), jnp.float32)
        mine = jnp.stack([jnp.stack([rows[js[k]] if k < len(js) else zero for k in range(K)]) for js in owned])
        state = {
            "master": jnp.stack([mine] * V, axis=2),  # [N, K, V, p_max]: current (, previous)
            "opt_state": jax.vmap(lambda r: init_opt(tx, r))(mine),
            "model_state": jax.tree.map(lambda a: jnp.broadcast_to(a, (N, *a.shape)), model_state),
            "relay": jnp.broadcast_to(rows[jnp.asarray(seed)][:, :, None], (N, d, C, p_max)),
            "partial": jnp.zeros((N, d, p_max), jnp.float32),
            "stash": jnp.zeros((N, L, a_max), jnp.float32),
            "cotangent": jnp.zeros((N, a_max), jnp.float32),
            "labels": jnp.zeros((N, micro), jnp.int32),
            "inflight": jnp.zeros((N,), bool),
        }
        return jax.device_put(state, per_worker)

    def train_step(state, batch):
        return period(state, batch["image"], batch["label"], True)

    def flush(state):
        images = jnp.zeros((batch, *net.input_shape), jnp.float32, device=per_worker)
        labels = jnp.zeros((batch,), jnp.int32, device=per_worker)
        return period(state, images, labels, False)[0]

    def export(state):
        # Each stage from its owner's current row; running averages averaged over workers.
        params = [layout.unpack_one(j, state["master"][owners[j], local[j], 0]) for j in range(L)]
        model_state = jax.tree.map(lambda a: a.mean(0), state["model_state"])
        return params, model_state

    storage = {  # per worker, in stage rows of p_max elements
        "owned_stages": K, "stored_versions": V, "versions_per_hop": C, "relay_buffers": d * C,
        "partial_sum_buffers": d, "ring": {"stages": L, "stored_versions": 2, "partial_sum_buffers": L},
    }
    report = {"impl": "zero", "rule": rule, "owners": list(owners), "storage": storage}
    return Method("cdp-zero", net, init, train_step, export, flush, table, carrier=carrier, stale=table.stale,
                  workers=N, devices=N, state_depends_on_mesh=True, report=report,
                  padding={"params": layout.padding(), "activations": carrier.padding()["activations"]})
