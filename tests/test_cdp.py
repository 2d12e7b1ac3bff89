"""cdp-v1 / cdp-v2: equal to dp and e2e with the delay removed; the SPMD ring equal to the
simulation for every rule (v1, v2, the paper code's), N = 2, 4, 8 and N != L, recomputing or
keeping residuals; each worker reads exactly the version the table names and holds exactly
the updates the table has it apply; v1 is the paper code's delayed gradient shifted by one
step; the compiled ring sends no model-sized all-reduce, no permute larger than a stage,
each transfer once per step, DP's bytes."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cdpjax import data, methods, optim
from cdpjax.config import ConfigError, default_config
from cdpjax.mesh import make_mesh
from cdpjax.methods import cdp
from cdpjax.methods.common import Context
from cdpjax.optim import apply_per_stage as apply_updates
from cdpjax.program.ring import SENDS_BY_TICK
from cdpjax.models import cross_entropy
from cdpjax.layouts.cdp import applies_of, cdp_table
from helpers import assert_trees_close as assert_close, assert_trees_equal, cdp_rule, max_diff, params

BATCH, STEPS = 32, 3


def config(**kw):
    c = default_config()
    c.model_kwargs.width = 16  # mlp: 4 blocks, so up to 4 stages
    c.global_batch_size = BATCH
    c.num_steps = 20
    c.eval_every = c.checkpoint_every = 0
    c.norm = "none"  # exact equality; BatchNorm has its own test
    for k, v in kw.items():
        c[k] = v
    if isinstance(c.stages, int) and c.stages > 4:  # a stage per block
        c.model_kwargs.depth = c.stages - 1
    return c


@functools.lru_cache(maxsize=None)
def dataset():
    return data.build(config())


@functools.lru_cache(maxsize=None)
def batches(n=STEPS + 1):
    return [dataset().train_batch(k, BATCH, 0, augment=False) for k in range(n)]


def context(devices, **kw):
    ds = dataset()
    return Context(config(**kw), make_mesh({"data": devices}, jax.devices()[:devices]), ds.image_shape, ds.num_classes)


@functools.lru_cache(maxsize=None)
def build(method, impl="simulate", workers=1, devices=1, stages=4, delay_free=False, norm="none", rule="cdp-v2",
          residuals="recompute", ticks="whole"):
    ctx = context(devices, method=method, cdp_impl=impl, workers=workers, stages=stages, norm=norm, cdp_rule=rule,
                  residuals=residuals, cdp_ticks=ticks)
    if method in ("dp", "e2e"):
        return methods.build(ctx)
    return cdp.make(ctx, method, cdp_table("dp", workers, stages) if delay_free else None)


def train(m, steps=STEPS, flush=True, state=None, batches_from=0):
    state = m.init(jax.random.key(0)) if state is None else state
    for b in batches()[batches_from:batches_from + steps]:
        state, metrics = m.train_step(state, b)
        assert np.isfinite(float(metrics["loss"]))
    if flush and m.flush is not None:
        state = m.flush(state)
    return state


# ------------------------------------------------------------------ equality


def test_delay_removed_equals_dp_and_e2e():
    """FIRST: with no stale pair, CDP is DP: simulate (4 workers vmapped on 2 devices) with
    the dp table, and the ring with one worker (the only delay-free ring), equal dp and e2e."""
    e2e = build("e2e")
    reference = params(e2e, train(e2e))
    assert max_diff(reference, params(e2e, e2e.init(jax.random.key(0)))) > 1e-3  # it trained
    dp = build("dp", workers=4, devices=4)
    assert_close(params(dp, train(dp)), reference)
    sim = build("cdp-v2", "simulate", workers=4, devices=2, delay_free=True)
    assert not sim.stale.any()
    assert_close(params(sim, train(sim)), reference)
    ring = build("cdp-v2", "ring", workers=1, devices=1)
    assert not ring.table.stale.any()
    assert_close(params(ring, train(ring)), reference)
    # The delay is real: with it, the same run differs from dp.
    delayed = build("cdp-v2", "simulate", workers=4, devices=2)
    assert max_diff(params(delayed, train(delayed)), reference) > 1e-4


@pytest.mark.parametrize("method,workers,stages,norm,rule,residuals,ticks", [
    ("cdp-v2", 2, 4, "none", "cdp-v2", "recompute", "whole"), ("cdp-v2", 4, 4, "none", "cdp-v2", "recompute", "whole"),
    ("cdp-v2", 8, 4, "none", "cdp-v2", "recompute", "whole"), ("cdp-v1", 4, 4, "none", "cdp-v2", "recompute", "whole"),
    # the paper code's rule (N < L: more stale than the timing; N > L: steps lengthened by idle ticks)
    ("cdp-v2", 2, 4, "none", "paper-code", "recompute", "whole"),
    ("cdp-v2", 8, 4, "none", "paper-code", "recompute", "whole"),
    # kept residuals instead of recomputation: the same parameters
    ("cdp-v2", 2, 4, "none", "cdp-v2", "carry", "whole"),
    # BatchNorm: statistics per micro-batch, running averages averaged over workers (the ring
    # averages each worker's running average at export: the same, the averages being linear).
    ("cdp-v2", 4, 2, "batch", "cdp-v2", "recompute", "whole"),
    # split backwards (F, B, W: 3L ticks of about equal cost): every rule, N = 2, 4, 8 and N != L
    ("cdp-v2", 4, 4, "none", "cdp-v2", "carry", "split"), ("cdp-v2", 2, 4, "none", "cdp-v2", "carry", "split"),
    ("cdp-v2", 8, 4, "none", "cdp-v2", "carry", "split"), ("cdp-v1", 4, 4, "none", "cdp-v2", "carry", "split"),
    ("cdp-v2", 2, 4, "none", "paper-code", "carry", "split"),
    pytest.param("cdp-v2", 4, 4, "none", "cdp-v2", "recompute", "split", marks=pytest.mark.heavy),
    pytest.param("cdp-v2", 2, 2, "batch", "cdp-v2", "carry", "split", marks=pytest.mark.heavy),
    # paired forwards (two a tick, whole backwards): offsets as uniform as whole ticks allow
    ("cdp-v2", 4, 4, "none", "cdp-v2", "carry", "paired"),
    pytest.param("cdp-v1", 4, 4, "none", "cdp-v2", "carry", "paired", marks=pytest.mark.heavy),
    ("cdp-v2", 2, 4, "none", "cdp-v2", "recompute", "paired"),
    pytest.param("cdp-v2", 8, 8, "none", "cdp-v2", "carry", "paired", marks=pytest.mark.heavy),
    ("cdp-v2", 2, 4, "none", "paper-code", "carry", "paired"),
])
def test_ring_equals_simulate(method, workers, stages, norm, rule, residuals, ticks):
    if (workers, stages, ticks) == (8, 4, "split"):  # 8 workers need 8 | 3L: L = 8 stages of a deeper mlp
        stages = 8
    sim = build(method, "simulate", workers=workers, devices=2, stages=stages, norm=norm, rule=rule, ticks=ticks)
    ring = build(method, "ring", workers=workers, devices=workers, stages=stages, norm=norm, rule=rule,
                 residuals=residuals, ticks=ticks)
    # both read the rule as written out independently: the paper's timing (helpers.cdp_rule), or
    # the paper code's "worker i reads stage j fresh iff j >= L-1-i"
    if rule == "paper-code":
        expected = np.array([[j < stages - 1 - i for j in range(stages)] for i in range(workers)])
        timing = cdp_rule("cdp-v2", workers, stages, 1, ticks)[2].sum()  # N < L: more stale; N > L: fewer
        assert expected.sum() > timing if workers < stages else expected.sum() < timing
    else:
        expected = cdp_rule(method, workers, stages, 1, ticks)[2]
    np.testing.assert_array_equal(ring.stale, expected)
    np.testing.assert_array_equal(sim.stale, expected)
    expected_params, expected_state = sim.export(train(sim))
    state = train(ring, flush=False)
    unflushed = params(ring, state)
    state = ring.flush(state)
    got_params, got_state = ring.export(state)
    assert_close(got_params, expected_params)
    if norm == "batch":
        assert jax.tree.leaves(got_state)
        assert_close(got_state, expected_state)
    # The flush finished real work (the last steps' late updates), and a second one has none left.
    assert max_diff(unflushed, expected_params) > 1e-6
    assert_trees_equal(params(ring, ring.flush(state)), params(ring, state))


def first_stage_delayed_table(steps=4):
    """A cyclic table no layout defines, written out here: N = 2 workers, L = 2 stages, whole
    backwards (a step is F0 F1 B1 B0, T = 4 ticks), worker 1 two ticks after worker 0. Stage 0 is
    read one version behind by every worker (PipeDream-2BW's one-step delay, on the first stage
    only: step k reads theta_0^(k-1), theta_0^0 at step 0), stage 1 fresh (version k). Stage j's
    running sum hops from worker 0 to worker 1 (a 'partial' after worker 0's B_j), worker 1
    completes it (the update) and sends it to worker 0 in the same tick. Each worker applies each
    update between its last read of the old version and its first of the new: stage 1 both at the
    update (tick 4k+4); stage 0, whose step-k update (tick 4k+5) the next step still does not read,
    worker 0 after its step-(k+1) B0 (4k+7), worker 1 after its own (4k+9)."""
    from cdpjax.timetable import Apply, Message, Op, TimeTable, Update

    phases = [("F", 0), ("F", 1), ("B", 1), ("B", 0)]
    ops, updates, messages, applies = [], [], [], []
    for k in range(steps):
        for w, offset in ((0, 0), (1, 2)):
            for p, (kind, j) in enumerate(phases):
                version = max(k - 1, 0) if j == 0 else k
                ops.append(Op(4 * k + offset + p, w, j, kind, k, micro=w, version=version, stale=j == 0))
        updates += [Update(4 * k + 4, 1, k), Update(4 * k + 5, 0, k)]
        messages += [Message(4 * k + 2, 0, 1, 1, "partial", k), Message(4 * k + 3, 0, 1, 0, "partial", k),
                     Message(4 * k + 4, 1, 0, 1, "sum", k), Message(4 * k + 5, 1, 0, 0, "sum", k)]
        applies += [Apply(4 * k + 4, 0, 1, k), Apply(4 * k + 4, 1, 1, k), Apply(4 * k + 7, 0, 0, k),
                    Apply(4 * k + 9, 1, 0, k)]
    num_ticks = max(o.tick for o in ops) + 1
    keep = lambda rows: tuple(r for r in rows if r.tick < num_ticks)  # noqa: E731
    ops.sort(key=lambda o: (o.tick, o.device))
    return TimeTable("first-stage-delayed", 2, 2, steps, num_ticks, 2, 4, tuple(ops), tuple(updates),
                     keep(messages), (0, 2), 1, (4, 8), applies=keep(applies), axis="data")


def test_ring_runs_a_table_no_layout_defines():
    """The ring lowers the table it is given: the table above, with its explicit version reads, runs
    on it (no engine change) and equals a plain loop applying the same delayed gradients: step k's
    gradient, of the whole batch's mean loss, taken at (theta_0^(k-1), theta_1^k), updates both
    stages (the optimizer per stage)."""
    t = first_stage_delayed_table(steps=STEPS + 3)
    np.testing.assert_array_equal(t.stale, [[True, False], [True, False]])
    ring = cdp.make(context(2, method="cdp-v2", cdp_impl="ring", workers=2, stages=2), "cdp-v2", t)
    got = params(ring, train(ring))
    net, tx = ring.net, optim.make(config())
    theta, _ = net.init(jax.random.key(0))
    opt = [tx.init(p) for p in theta]
    grad = jax.jit(jax.grad(lambda p, x, y: cross_entropy(net.apply(p, [{}] * 2, x, True)[0], y)))
    history = [theta]
    for k, b in enumerate(batches()[:STEPS]):
        read = [history[max(k - 1, 0)][0], history[k][1]]
        theta, opt = apply_updates(tx, theta, opt, grad(read, b["image"], b["label"]))
        history.append(theta)
    assert_close(got, history[STEPS])
    theta, opt = history[0], [tx.init(p) for p in history[0]]  # the delay is real: with none, it differs
    for b in batches()[:STEPS]:
        theta, opt = apply_updates(tx, theta, opt, grad(theta, b["image"], b["label"]))
    assert max_diff(got, theta) > 1e-5


def test_ring_run_steps_is_train_steps():
    """`run_steps` scans the period over S batches in one program: the same state and metrics as S
    `train_step` calls (the in-flight buffers handed on between periods as between calls)."""
    ring = build("cdp-v2", "ring", workers=2, devices=2, stages=4)
    stepped, metrics = ring.init(jax.random.key(0)), []
    for b in batches()[:STEPS]:
        stepped, m = ring.train_step(stepped, b)
        metrics.append(float(m["loss"]))
    stacked = {k: np.stack([b[k] for b in batches()[:STEPS]]) for k in ("image", "label")}
    scanned, m = ring.run_steps(ring.init(jax.random.key(0)), stacked)
    assert_close(scanned, stepped)
    np.testing.assert_allclose(np.asarray(m["loss"]), metrics, rtol=1e-5)


# ------------------------------------------------------------------ poisoning


def poisoned(tree, stage):
    out = list(tree)
    out[stage] = jax.tree.map(lambda a: jnp.full_like(a, jnp.nan), tree[stage])
    return out


@pytest.mark.parametrize("workers", [4, 8])
def test_simulate_reads_the_named_version(workers):
    """Poison one stage's unread version: worker i's loss is NaN iff the table says it reads it."""
    m = build("cdp-v2", "simulate", workers=workers, devices=2, stages=4)
    # the rule, written out: N = L = 4 stale iff j < 3 - i; N = 8 (offsets i) iff i + 2j < 7
    stale = np.array([[(j < 3 - i) if workers == 4 else (i + 2 * j < 7) for j in range(4)] for i in range(workers)])
    state = m.init(jax.random.key(0))
    for j in range(4):
        for which, reads in (("previous", stale[:, j]), ("params", ~stale[:, j])):
            s = state._replace(**{which: poisoned(getattr(state, which), j)})
            losses = np.asarray(m.worker_losses(s, batches()[0]))
            np.testing.assert_array_equal(np.isnan(losses), reads, err_msg=f"{which}[{j}]")
    # A whole step with the never-read version poisoned is the clean step.
    if workers == 4:
        clean, _ = m.train_step(state, batches()[0])
        dirty, _ = m.train_step(state._replace(previous=poisoned(state.previous, 3)), batches()[0])
        assert_trees_equal(params(m, dirty), params(m, clean))


@pytest.mark.parametrize("method", ["cdp-v2", "cdp-v1"])
def test_each_worker_holds_the_updates_the_table_applies(method):
    """Between calls, worker r's copy of stage j is simulate's after v steps, v the updates of
    stage j the table has r apply before the boundary: each worker applies each update in its
    own window (one stored version), so copies differ mid-run, exactly as the table says."""
    n = l = 4
    sim = build(method, "simulate", workers=n, devices=2, stages=l)
    ring = build(method, "ring", workers=n, devices=n, stages=l)
    history, state = [params(sim, sim.init(jax.random.key(0)))], sim.init(jax.random.key(0))
    for b in batches()[:STEPS]:
        state, _ = sim.train_step(state, b)
        history.append(params(sim, state))
    ring_state = train(ring, flush=False)
    boundary = STEPS * 2 * l  # the ring's call c runs the table's ticks [2L c, 2L (c+1))
    applied = applies_of(cdp_table(method, n, l, steps=STEPS + 3))
    counts = set()
    for r in range(n):
        for j in range(l):
            v = sum(1 for (w, jj, _), t in applied.items() if w == r and jj == j and t < boundary)
            counts.add(v)
            mine = jax.tree.map(lambda a: np.asarray(a[r]), ring_state.params[j])
            assert_close(mine, history[v][j])
    assert len(counts) > 1  # the workers' copies do differ mid-run


# ------------------------------------------------------------------ cdp-v1


def test_v1_is_the_paper_delayed_gradient_shifted_by_one_step():
    """Paper code: g_k = grad at theta_k on batch k, applied at step k+1, no update at step 0.
    Ours after S steps = the paper's after S+1 (its first step only computes a gradient)."""
    m = build("cdp-v1", "simulate", workers=4, devices=2, stages=4)
    ours = params(m, train(m))
    net, tx = m.net, optim.make(config())
    theta, _ = net.init(jax.random.key(0))
    opt = [tx.init(p) for p in theta]
    grad = jax.jit(jax.grad(lambda p, x, y: cross_entropy(net.apply(p, [{}] * 4, x, True)[0], y)))
    pending, history = None, []
    for b in batches()[:STEPS + 1]:
        g = grad(theta, b["image"], b["label"])
        if pending is not None:
            theta, opt = apply_updates(tx, theta, opt, pending)
        pending = g
        history.append(theta)
    assert_close(ours, history[STEPS])
    assert max_diff(ours, history[STEPS - 1]) > 1e-4  # not the unshifted count


# ------------------------------------------------------------------ collectives


def collective_sizes(hlo: str, name: str) -> list[int]:
    """Elements per `name` op in compiled HLO text (a tuple's shapes summed)."""
    sizes = []
    for line in hlo.splitlines():
        m = re.search(r"=\s*(.*?)\s" + re.escape(name) + r"(-start)?\(", line)
        if m:
            dims = re.findall(r"[a-z]+\d*\[([\d,]*)\]", m.group(1))
            sizes.append(sum(int(np.prod([int(d) for d in s.split(",") if d] or [1])) for s in dims))
    return sizes


def test_ring_hlo_sends_stage_sized_messages_once_per_step():
    """The compiled step: no model-sized all-reduce (the metric scalars only), no permute larger
    than the largest stage's gradient, every permute in the branch of its tick of the period's
    loop (each transfer runs once a step, whatever N), and the bytes it really sends are the
    table's, DP's within 5%."""
    from cdpjax import bench

    m = build("cdp-v2", "ring", workers=8, devices=8, stages=4)
    state, b = m.init(jax.random.key(0)), batches()[0]
    hlo = m.train_step.lower(state, b).compile().as_text()
    stage_bytes = [sum(x.size * 4 for x in jax.tree.leaves(p)) for p in m.export(state)[0]]
    reduces = collective_sizes(hlo, "all-reduce")
    assert max(reduces, default=0) <= 8, reduces  # the loss/accuracy scalars only
    permutes = collective_sizes(hlo, "collective-permute")
    assert permutes and 4 * max(permutes) <= max(stage_bytes)
    for other in ("all-gather", "reduce-scatter", "all-to-all"):
        assert not collective_sizes(hlo, other)
    comps, entry = bench._computations(hlo)
    # The period is one loop over its ticks; every permute is in a branch of a switch over ticks (one
    # switch a stage, branch t at tick t: once a period, whatever N), as many branches as the loop's passes.
    loops = [line for line in comps[entry] if " while(" in line]
    assert len(loops) == 1 and f'"n":"{m.program.period}"' in loops[0]
    by_tick = [line for lines in comps.values() for line in lines if SENDS_BY_TICK in line and "conditional(" in line]
    assert 1 <= len(by_tick) <= 4  # at most one a stage
    branches = []
    for line in by_tick:
        names = [b.strip().lstrip("%") for b in re.search(r"branch_computations=\{([^}]*)\}", line).group(1).split(",")]
        assert len(names) == m.program.period
        branches += names
    permuting = {name for name, lines in comps.items() if any("collective-permute" in x for x in lines)}
    assert permuting and permuting <= set(branches)
    sent = bench.traffic(hlo, 8)
    table = bench.table_figures(m.table, {"param_bytes": stage_bytes, "activation_bytes": [4] * 4})
    permuted = sent["by_kind"]["collective-permute"] / 8  # per worker; the rest: the metric scalars' psum
    assert permuted == pytest.approx(table["table_bytes_per_device_per_step"], rel=1e-6)
    # and what the lowered program declares it sends (bench's figure) is what the HLO sends
    assert m.program.sent_bytes({"param": stage_bytes}).mean() == pytest.approx(permuted, rel=1e-6)
    assert permuted == pytest.approx(2 * 7 / 8 * sum(stage_bytes))  # a ring all-reduce's bytes, 2(N-1)/N
    # The parser does see dp's model-sized all-reduce, and the ring sends what it sends.
    dp = build("dp", workers=8, devices=8)
    dp_hlo = dp.train_step.lower(dp.init(jax.random.key(0)), b).compile().as_text()
    assert sum(collective_sizes(dp_hlo, "all-reduce")) * 4 >= sum(stage_bytes)
    assert sent["per_device_bytes"] <= 1.05 * bench.traffic(dp_hlo, 8)["per_device_bytes"]


@pytest.mark.parametrize("workers,stages,ticks", [(4, 4, "whole"), (8, 4, "whole"), (2, 4, "split"), (4, 4, "paired")])
def test_ring_routing_reads_back_as_the_period(workers, stages, ticks):
    """The scanned ring's routing arrays, read back cell by cell, give the period's events: each
    worker's ops of a tick (kind, stage, lag, the slot of the partial it adds to or none, the slot
    of its partial or completed sum) and its applies (stage, lag, before or after the sends)."""
    from cdpjax.program.ring import accesses, op_order, ring_routing, ring_ticks

    period = ring_ticks(cdp_table("cdp-v2", workers, stages, 3, ticks=ticks))
    r = ring_routing(period)
    for t, tk in enumerate(period.ticks):
        done = {(c.worker, c.stage, c.lag) for c in tk.completes}
        for w in range(workers):
            expected = []
            for o in (o for o in op_order(tk) if o.worker == w):
                grad = o.kind in tk.gradient_kinds
                start = grad and (w, o.stage) in tk.chain_start
                read = ("partial", o.stage, o.lag) if grad and not start else None
                write = ("sum" if (w, o.stage, o.lag) in done else "partial", o.stage, o.lag) if grad else None
                expected.append((o.kind, o.stage, o.lag, read and r.slot(read), write and r.slot(write)))
            got = []
            for k, kinds in enumerate(r.op_kinds):
                if r.op_branch[t, w, k] < len(kinds):
                    kind, j = kinds[r.op_branch[t, w, k]]
                    grad = kind in tk.gradient_kinds
                    read = int(r.op_read[t, w, k]) if grad and not r.op_start[t, w, k] else None
                    write = int(r.op_write[t, w, k]) if grad else None
                    got.append((kind, j, int(r.op_lag[t, w, k]), read, write))
            assert got == expected, (t, w)
            applies = sorted((j, lag, after) for j, lag, ws, after in tk.applies if w in ws)
            read_back = sorted((int(r.apply_stage[p, t, w, a]), int(r.apply_lag[p, t, w, a]), bool(p))
                               for p in range(2) for a in range(r.apply_stage.shape[-1])
                               if r.apply_stage[p, t, w, a] < stages)
            assert read_back == applies
            for p, a in ((p, a) for p in range(2) for a in range(r.apply_stage.shape[-1])):
                j = r.apply_stage[p, t, w, a]
                if j < stages:
                    assert r.apply_slot[p, t, w, a] == r.slot(("sum", j, r.apply_lag[p, t, w, a]))
    # Names sharing a slot never live at once: every tick a name is touched (or, handed on from
    # or to another period, the period's start or end) lies outside every other's first..last.
    touched = {}
    for t, tk in enumerate(period.ticks):
        for name, _, _ in accesses(tk):
            touched.setdefault(name, set()).add(t)
    for kind, j, lag in period.live:
        touched.setdefault((kind, j, lag), set()).add(0)
        touched.setdefault((kind, j, lag - 1), set()).add(len(period.ticks) - 1)
    for j in range(stages):
        for a in r.names[j]:
            for b in r.names[j]:
                if a != b and r.slot(a) == r.slot(b):
                    assert max(touched[a]) < min(touched[b]) or max(touched[b]) < min(touched[a]), (a, b)
    assert max(r.slot_count) <= 2  # CDP: a stage's running sum and its completed sum


def hlo_instructions(hlo: str) -> int:
    """Instructions of compiled HLO text (every `name = op(...)` line of every computation)."""
    return sum(1 for line in hlo.splitlines() if re.match(r"^\s+(ROOT )?%?\S+ = ", line))


def test_ring_program_size_does_not_grow_with_the_workers():
    """At fixed L the compiled ring holds each stage op once per position of a tick, whatever N:
    from N = 2 to 8 only the sends grow (one static permute per message group of a tick, at most
    L x lags of them a tick). A period unrolled in Python holds one conditional per op, N x 2L of
    them, and grew 4x from N = 2 to 8 (digits MLP, L = 16: 6,868 to 27,269 instructions)."""
    counts = {}
    for n in (2, 8):
        m = build("cdp-v2", "ring", workers=n, devices=n, stages=4)
        counts[n] = hlo_instructions(m.train_step.lower(m.init(jax.random.key(0)), batches()[0]).compile().as_text())
    assert counts[8] <= 1.5 * counts[2], counts


# ------------------------------------------------------------------ set-up


def test_registered_and_config_errors():
    assert {"cdp-v1", "cdp-v2"} <= set(methods.REGISTRY)
    assert methods.build(context(2, method="cdp-v1", cdp_impl="simulate", stages=2)).name == "cdp-v1"
    bad = [
        (dict(workers=3, stages=4), 1, "choose workers in"),
        (dict(workers=8, cdp_impl="ring"), 4, "workers must divide mesh.data=4"),
        (dict(workers=2, cdp_impl="simulate"), 4, "not a multiple of mesh.data=4"),
        (dict(workers=4, global_batch_size=30), 1, "global_batch_size=30"),
        (dict(cdp_impl="pipelined"), 1, "cdp_impl"),
        (dict(workers=4, cdp_rule="cdp-v1"), 4, "for cdp-v1's rule set method=cdp-v1"),
    ]
    for kw, devices, match in bad:
        with pytest.raises(ConfigError, match=match):
            cdp.make(context(devices, **kw), "cdp-v2")
