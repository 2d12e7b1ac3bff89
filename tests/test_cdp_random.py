"""cdp-random trains: tau = 0 is dp; the uniform model is cdp-v1 / cdp-v2 (parameters after T
steps, simulate and ring); every random model's simulation equals a plain loop written here that
reads the versions the table names; the delay corrections' hand-computed two-step cases."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cdpjax import data, delay_corrections, methods, optim, staleness
from cdpjax.config import ConfigError, default_config
from cdpjax.mesh import make_mesh
from cdpjax.methods import cdp, cdp_random, ring
from cdpjax.methods.common import Context
from cdpjax.models import cross_entropy
from helpers import assert_trees_close as assert_close, max_diff, params

BATCH, STEPS = 16, 4


def config(**kw):
    c = default_config()
    c.model_kwargs.width = 8
    c.global_batch_size = BATCH
    c.num_steps = 20
    c.eval_every = c.checkpoint_every = 0
    c.norm = "none"
    c.learning_rate = 0.1
    for k, v in kw.items():
        if k == "delay":
            c.delay.update(v)
        else:
            c[k] = v
    return c


@functools.lru_cache(maxsize=None)
def batches():
    ds = data.build(config())
    return [ds.train_batch(k, BATCH, 0, augment=False) for k in range(2 * STEPS)]


def context(devices, **kw):
    ds = data.build(config())
    return Context(config(**kw), make_mesh({"data": devices}, jax.devices()[:devices]), ds.image_shape,
                   ds.num_classes)


def build(method, devices=2, workers=2, stages=2, impl="simulate", **kw):
    return methods.build(context(devices, method=method, workers=workers, stages=stages, cdp_impl=impl, **kw))


def train(m, steps=STEPS):
    state = m.init(jax.random.key(0))
    for b in batches()[:steps]:
        state, metrics = m.train_step(state, b)
        assert np.isfinite(float(metrics["loss"]))
    if m.flush is not None:
        state = m.flush(state)
    return params(m, state)


def test_tau_zero_is_dp():
    dp = train(build("dp"))
    for delay in (dict(model="uniform-tau", tau_max=0), dict(model="per-stage", taus=(0, 0))):
        m = build("cdp-random", delay=delay)
        assert m.stored_versions == 1
        assert_close(train(m), dp)
    assert max_diff(train(build("cdp-random", delay=dict(model="uniform-tau", tau_max=2))), dp) > 1e-5


@pytest.mark.parametrize("rule", ["cdp-v1", "cdp-v2"])
def test_uniform_model_is_cdp(rule):
    """Simulate with the version history (2 kept) equals CDP's own simulation (a select between two
    stored versions) and, for the ring, CDP's ring."""
    reference = train(cdp.make(context(2, method=rule, workers=2, stages=2, cdp_impl="simulate"), rule))
    got = train(build("cdp-random", delay=dict(model="uniform", rule=rule)))
    assert_close(got, reference)
    ring = build("cdp-random", impl="ring", delay=dict(model="uniform", rule=rule))
    assert ring.table.method == "cdp-random" and ring.program is not None
    assert_close(train(ring), reference)


def reference_loop(m, steps=STEPS, strength=0.0, weight=None, lr_scale=None, tau=None):
    """Plain SGD per stage: step k's gradient is the mean over workers of worker i's gradient of its
    micro-batch loss at (theta^j_{max(k - tau(k, i, j), 0)})_j, tau from the table's reads. With
    `strength` (PipeNAG's read) each read is theta_v + strength tau (theta_v - theta_{v-1}) instead,
    v = max(k - tau, 0), theta_{-1} = theta_0. `weight(taus)`: the workers' weights in stage j's mean
    (given its N reads' taus); `lr_scale(taus)`: the factor on stage j's optimizer update; `tau`:
    [steps, N, L] the staleness of every read (default: the table's, `staleness.per_read`)."""
    net, tx = m.net, optim.make(config())
    tau = staleness.per_read(m.table) if tau is None else tau
    theta, _ = net.init(jax.random.key(0))
    opt = [tx.init(p) for p in theta]
    loss = lambda p, x, y: cross_entropy(net.apply(p, [{}] * len(p), x, True)[0], y)  # noqa: E731
    grad = jax.jit(jax.grad(loss))
    history = [theta]
    version = lambda v: history[max(v, 0)]  # noqa: E731

    def read(k, t, j):
        v = k - t
        return jax.tree.map(lambda a, b: a + strength * t * (a - b), version(v)[j], version(v - 1)[j])

    N = m.workers
    for k, b in enumerate(batches()[:steps]):
        xs, ys = np.split(b["image"], N), np.split(b["label"], N)
        gs = [grad([read(k, int(tau[k, i, j]), j) for j in range(len(theta))], xs[i], ys[i]) for i in range(N)]
        w = [weight(tau[k, :N, j]) if weight else [1.0] * N for j in range(len(theta))]
        mean = [jax.tree.map(lambda *g: sum(w[j][i] * g[i] for i in range(N)) / N, *[g[j] for g in gs])
                for j in range(len(theta))]
        if lr_scale is None:
            theta, opt = optim.apply_per_stage(tx, theta, opt, mean)
        else:
            stepped = [tx.update(g, o, p) for g, o, p in zip(mean, opt, theta)]
            theta = [jax.tree.map(lambda p, u: p + lr_scale(tau[k, :N, j]) * u, theta[j], stepped[j][0])
                     for j in range(len(theta))]
            opt = [o for _, o in stepped]
        history.append(theta)
    return history[steps]


@pytest.mark.parametrize("delay,devices", [
    (dict(model="geometric", p=0.4, tau_max=3, seed=1), 2), (dict(model="uniform-tau", tau_max=2), 1),
    (dict(model="per-stage", taus=(2, 1)), 2), (dict(model="async", durations=3, tau_max=2), 2),
    (dict(model="straggler", slowdown=3, tau_max=2), 2), (dict(model="jitter", jitter=3), 1)])
def test_simulate_reads_the_tables_versions(delay, devices):
    m = build("cdp-random", devices=devices, delay=delay)
    tau = staleness.per_read(m.table)[:STEPS]
    assert m.stored_versions == staleness.per_read(m.table).max() + 1
    if delay["model"] != "jitter":
        assert tau[1:].max() >= 1  # the run reads stale versions
    assert_close(train(m), reference_loop(m))


@pytest.mark.parametrize("taus", [(2, 1), pytest.param((1, 3), marks=pytest.mark.heavy)])
def test_fixed_tau_per_stage_runs_on_the_ring(taus):
    """A fixed tau >= 1 per stage keeps one stored version per worker (each applies update k between
    its reads of versions k and k + 1): the ring runs the table and equals the simulation."""
    delay = dict(model="per-stage", taus=taus)
    ring = build("cdp-random", impl="ring", delay=delay)
    assert ring.table.applies and ring.program is not None
    sim = build("cdp-random", delay=delay)
    assert_close(train(ring), train(sim))
    assert_close(train(sim), reference_loop(sim))


@pytest.mark.parametrize("delay, rule", [
    (dict(model="uniform", rule="cdp-v2"), "cdp-v2"), (dict(model="per-stage", taus=(1, 1)), "cdp-v1"),
    pytest.param(dict(model="straggler", slowdown=1, tau_max=2), "cdp-v2", marks=pytest.mark.heavy)])
def test_zero_runs_the_tables_with_cdps_reads(delay, rule):
    """cdp-zero (every stage partitioned over the workers) runs a delay table whose reads are all
    cdp-v1's or cdp-v2's, as that rule, and equals the version-history simulation of the table."""
    zero = build("cdp-random", impl="zero", delay=delay)
    assert zero.report["impl"] == "zero" and zero.report["rule"] == rule
    assert_close(train(zero), train(build("cdp-random", delay=delay)))


@pytest.mark.parametrize("delay", [dict(model="geometric"), dict(model="per-stage", taus=(2, 1)),
                                   dict(model="uniform-tau", tau_max=0)])
def test_zero_refuses_other_reads_in_one_line(delay):
    with pytest.raises(ConfigError, match=f"delay.model='{delay['model']}' reads other versions than cdp-v1's or "
                                          f"cdp-v2's and cdp-zero's plan keeps each piece's current and previous"):
        build("cdp-random", impl="zero", delay=delay)


def test_steps_past_the_table_repeat_its_second_half():
    # 64 rows: steps 0..63 read themselves, 64..95 rows 32..63, 96 row 32 again
    rows = [int(cdp_random.table_row(k, 64)) for k in (0, 63, 64, 95, 96, 130)]
    assert rows == [0, 63, 32, 63, 32, 34]


@pytest.mark.parametrize("delay,workers,stages", [
    (dict(model="uniform-tau", tau_max=2), 2, 2), (dict(model="geometric", p=0.4, tau_max=3, seed=1), 4, 2),
    (dict(model="jitter", jitter=3, seed=1), 2, 2), (dict(model="per-stage", taus=(0, 2)), 2, 2),
    pytest.param(dict(model="async", durations=3, tau_max=2), 4, 2, marks=pytest.mark.heavy),
    (dict(model="straggler", slowdown=3, tau_max=2), 2, 2),
    pytest.param(dict(model="uniform-tau", tau_max=3), 8, 4, marks=pytest.mark.heavy)])
def test_a_staleness_that_changes_every_step_runs_on_the_ring(delay, workers, stages, monkeypatch):
    """The ring reads each step's staleness as a depth below the newest stored version (its carrier:
    CDP's traffic, every read fresh, `ring_carrier`) and equals the simulation over 7 steps, the
    table laid out for 4 (steps 4..6 read its rows 2, 3, 2 again: past one draw cycle)."""
    monkeypatch.setattr(cdp_random, "LAID_OUT", 4)
    kw = dict(devices=workers, workers=workers, stages=stages, delay=delay)
    ring = build("cdp-random", impl="ring", **kw)
    tau = staleness.per_read(ring.table)
    assert len(tau) == 4 and len({tuple(row.ravel()) for row in tau}) > 1  # the staleness changes from step to step
    assert ring.program.versions == tau.max() + 1 and ring.report["impl"] == "ring"
    assert_close(train(ring, 7), train(build("cdp-random", **kw), 7))


def test_the_ring_reads_a_hand_written_depth_table():
    """Per-step depths written out here, 3 rows then rows 1, 2 again: worker 0 reads stage 0 two
    versions back at step 1, worker 1 stage 1 one back at steps 0 (version 0 anyway), 2, 4 and 6...
    The ring on the carrier equals the plain loop reading version k - tau (clamped at 0)."""
    depths = np.asarray([[[0, 0], [0, 1]], [[2, 0], [1, 0]], [[1, 1], [0, 1]]], np.int32)  # [row, worker, stage]
    rows = [0, 1, 2, 1, 2, 1, 2]
    ctx = context(2, method="cdp-random", workers=2, stages=2, cdp_impl="ring")
    carrier = cdp_random.ring_carrier(2, 2)
    assert staleness.per_read(carrier).max() == 0  # every read fresh: a depth is the read's staleness
    m = ring.build(ctx, "cdp-random", ctx.net(bn_axis_name=None), carrier, "recompute",
                   read_depths=ring.ReadDepths(depths, 1))
    assert m.program.versions == 3
    want = reference_loop(m, steps=7, tau=depths[rows])
    assert_close(train(m, 7), want)
    assert max_diff(want, reference_loop(m, steps=7, tau=np.zeros((7, 2, 2), int))) > 1e-5


def test_the_ring_refuses_a_carrier_it_cannot_lay_out():
    # N = 8 > 2L: cdp-v1's offsets put two workers' starts on one tick, and no spacing chains the sums in time
    with pytest.raises(ConfigError, match="no spacing of CDP's steps up to .* idle ticks lets the ring serve every "
                                          "fresh read at N=8, L=2"):
        build("cdp-random", impl="ring", devices=8, workers=8, delay=dict(model="geometric"))


@pytest.mark.parametrize("name", ["staleness-lr", "nesterov", "dc-asgd", "pipenag", "staleness-sqrt",
                                  "pipenag+staleness-lr", "fresh-weighted", "pipenag+staleness-lr+fresh-weighted"])
def test_corrections_train(name):
    m = build("cdp-random", delay=dict(model="uniform-tau", tau_max=2, correction=name, strength=0.5))
    plain = train(build("cdp-random", delay=dict(model="uniform-tau", tau_max=2)))
    assert max_diff(train(m), plain) > 1e-6


# ------------------------------------------------------------------ corrections, by hand


def two_steps(tx, grads, params, taus):
    state = tx.init(params[0])
    out = []
    for g, p, tau in zip(grads, params, taus):
        u, state = tx.update(jnp.float32(g), state, jnp.float32(p), staleness=jnp.asarray(tau))
        out.append(float(u))
    return out


def test_staleness_scaled_by_hand():
    # step 0: taus (0, 1): mean(1/1, 1/2) = 0.75, 2 * 0.75 = 1.5; step 1: taus (3, 3): 1/4, -4 / 4 = -1
    got = two_steps(delay_corrections.staleness_scaled(), [2.0, -4.0], [0.0, 0.0], [(0, 1), (3, 3)])
    np.testing.assert_allclose(got, [1.5, -1.0])


def test_staleness_sqrt_by_hand():
    # step 0: taus (0, 3): mean(1, 1/2) = 0.75, 2 * 0.75 = 1.5; step 1: taus (8, 8): 1/3, -3 / 3 = -1
    got = two_steps(delay_corrections.staleness_scaled(0.5), [2.0, -3.0], [0.0, 0.0], [(0, 3), (8, 8)])
    np.testing.assert_allclose(got, [1.5, -1.0], rtol=1e-6)


def test_fresh_weights_by_hand():
    # taus (0, 1): (1, 1/4) / mean 5/8 = (8/5, 2/5); taus (3, 3): equal, 1 each; weights per stage (axis 0)
    np.testing.assert_allclose(delay_corrections.fresh_weights(jnp.asarray([[0, 3], [1, 3]])),
                               [[1.6, 1.0], [0.4, 1.0]], rtol=1e-6)


def test_staleness_square_by_hand():
    # step 0: taus (0, 1): mean(1/1, 1/4) = 5/8, 8 * 5/8 = 5; step 1: taus (2, 2): 1/9, -9 / 9 = -1
    got = two_steps(delay_corrections.staleness_scaled(2.0), [8.0, -9.0], [0.0, 0.0], [(0, 1), (2, 2)])
    np.testing.assert_allclose(got, [5.0, -1.0], rtol=1e-6)
    assert delay_corrections.on_updates("pipenag+staleness-square")


def test_fresh_sharp_weights_by_hand():
    # taus (0, 1): (1, 1/16) / mean 17/32 = (32/17, 2/17); taus (3, 3): equal, 1 each; weights per stage (axis 0)
    np.testing.assert_allclose(delay_corrections.read_weights("fresh-sharp", jnp.asarray([[0, 3], [1, 3]])),
                               [[32 / 17, 1.0], [2 / 17, 1.0]], rtol=1e-6)


def test_freshest_weights_by_hand():
    # stage 0 reads taus (0, 1, 0): the two 0s kept, (1, 0, 1) / mean 2/3 = (1.5, 0, 1.5);
    # stage 1 reads (3, 3, 5): (1.5, 1.5, 0); a stage whose reads share one tau: 1 each
    np.testing.assert_allclose(delay_corrections.read_weights("pipenag+freshest", jnp.asarray([[0, 3, 2], [1, 3, 2],
                                                                                               [0, 5, 2]])),
                               [[1.5, 1.5, 1.0], [0.0, 1.5, 1.0], [1.5, 0.0, 1.0]], rtol=1e-6)
    np.testing.assert_allclose(delay_corrections.read_weights("staleness-lr", jnp.asarray([[0], [4]])), [[1.0], [1.0]])


def hand_freshest_weights(taus):
    keep = [float(int(t) == min(int(u) for u in taus)) for t in taus]
    return [x * len(keep) / sum(keep) for x in keep]


def test_freshest_with_staleness_square_simulation_drops_the_stale_reads():
    m = build("cdp-random", delay=dict(model="uniform-tau", tau_max=2, correction="freshest+staleness-square"))
    lr_scale = lambda taus: float(np.mean([1.0 / (1 + int(t)) ** 2 for t in taus]))  # noqa: E731
    assert_close(train(m), reference_loop(m, lr_scale=lr_scale, weight=hand_freshest_weights))
    assert max_diff(reference_loop(m, lr_scale=lr_scale, weight=hand_freshest_weights),
                    reference_loop(m, lr_scale=lr_scale)) > 1e-6


def hand_fresh_weights(taus):
    w = [1.0 / (1 + int(t)) ** 2 for t in taus]
    return [x * len(w) / sum(w) for x in w]


def test_fresh_weighted_simulation_weighs_the_reads():
    m = build("cdp-random", delay=dict(model="uniform-tau", tau_max=2, correction="fresh-weighted"))
    tau = staleness.per_read(m.table)[:STEPS]
    assert (tau.min(1) != tau.max(1)).any()  # some stage's reads differ in staleness: the weights are not all 1
    assert_close(train(m), reference_loop(m, weight=hand_fresh_weights))
    assert max_diff(reference_loop(m, weight=hand_fresh_weights), reference_loop(m)) > 1e-6


def test_pipenag_with_staleness_lr_reads_ahead_and_scales_the_update():
    m = build("cdp-random", delay=dict(model="uniform-tau", tau_max=2, correction="pipenag+staleness-lr", strength=0.5))
    lr_scale = lambda taus: float(np.mean([1.0 / (1 + int(t)) for t in taus]))  # noqa: E731
    assert_close(train(m), reference_loop(m, strength=0.5, lr_scale=lr_scale))
    assert max_diff(reference_loop(m, strength=0.5, lr_scale=lr_scale), reference_loop(m, strength=0.5)) > 1e-6
    every = build("cdp-random", delay=dict(model="uniform-tau", tau_max=2, strength=0.5,
                                           correction="pipenag+staleness-lr+fresh-weighted"))
    assert_close(train(every), reference_loop(every, strength=0.5, lr_scale=lr_scale, weight=hand_fresh_weights))


def test_delayed_nesterov_by_hand():
    # beta = 0.5. step 0: m = 2, tau 1: 2 + 0.5 * 2 * 2 = 4. step 1: m = 0.5 * 2 + 1 = 2, tau 0: 1 + 0.5 * 1 * 2 = 2
    got = two_steps(delay_corrections.delayed_nesterov(0.5), [2.0, 1.0], [0.0, 0.0], [(1,), (0,)])
    np.testing.assert_allclose(got, [4.0, 2.0])
    # tau = 0 is optax's nesterov trace
    ref = optax.trace(0.5, nesterov=True)
    s = ref.init(jnp.float32(0))
    u0, s = ref.update(jnp.float32(2.0), s)
    u1, _ = ref.update(jnp.float32(1.0), s)
    np.testing.assert_allclose(two_steps(delay_corrections.delayed_nesterov(0.5), [2.0, 1.0], [0.0, 0.0],
                                         [(0,), (0,)]), [float(u0), float(u1)])


def test_delay_compensated_by_hand():
    # lambda = 0.5, versions kept 2. theta_0 = 1, the update at step 0 with params 1, tau (1,): the read is
    # theta_{-1} = theta_0 = 1: g = 2 + 0.5 * 4 * 0 = 2. Step 1 with params 3 (theta_1), taus (1, 2): reads
    # theta_0 = 1 and theta_{-1} = 1, mean 1: g = 1 + 0.5 * 1 * (3 - 1) = 2.
    got = two_steps(delay_corrections.delay_compensated(0.5, 2), [2.0, 1.0], [1.0, 3.0], [(1,), (1, 2)])
    np.testing.assert_allclose(got, [2.0, 2.0])
    # step 2 with params 7, taus (0, 1): theta_2 = 7, theta_1 = 3: mean 5; g = 2 + 0.5 * 4 * (7 - 5) = 6
    tx = delay_corrections.delay_compensated(0.5, 2)
    s = tx.init(jnp.float32(1.0))
    for g, p, tau in ((2.0, 1.0, (1,)), (1.0, 3.0, (1, 2)), (2.0, 7.0, (0, 1))):
        u, s = tx.update(jnp.float32(g), s, jnp.float32(p), staleness=jnp.asarray(tau))
    np.testing.assert_allclose(float(u), 6.0)


def test_pipenag_look_ahead_by_hand():
    """f(theta) = theta^2 / 2 (gradient theta), SGD at lr 0.5, theta_0 = 4, every read tau = 1 behind
    (version max(k - 1, 0), theta_{-1} = theta_0), read at theta_v + 1 * (theta_v - theta_{v-1}).
    Step 0 reads v = 0: 4 + (4 - 4) = 4, theta_1 = 4 - 0.5 * 4 = 2. Step 1 reads v = 0 again: 4,
    theta_2 = 2 - 2 = 0. Step 2 reads v = 1: 2 + (2 - 4) = 0 (the extrapolation lands on theta_2),
    theta_3 = 0. Without the look-ahead step 2 reads 2 and overshoots: theta_3 = -1."""
    def run(strength):
        versions = [4.0, 4.0]  # versions[t] = theta_{k-t}; before step 0 every one is theta_0
        for _ in range(3):
            read = float(delay_corrections.look_ahead(jnp.asarray(versions + [versions[-1]]), 1, strength))
            versions = [versions[0] - 0.5 * read] + versions[:2]
        return versions[0]

    assert run(1.0) == 0.0 and run(0.0) == -1.0
    # the engine's read: (1 + s tau) theta_{k-tau} - s tau theta_{k-tau-1}, per leaf of a stacked history
    h = jnp.asarray([[7.0], [5.0], [2.0], [1.0]])
    np.testing.assert_allclose(delay_corrections.look_ahead(h, 2, 0.5), [2.0 + 0.5 * 2 * (2.0 - 1.0)])
    np.testing.assert_allclose(delay_corrections.look_ahead(h, 0, 0.5), [7.0])


def test_pipenag_simulation_reads_the_predicted_weights():
    m = build("cdp-random", delay=dict(model="uniform-tau", tau_max=2, correction="pipenag", strength=0.5))
    assert m.stored_versions == staleness.per_read(m.table).max() + 2
    assert_close(train(m), reference_loop(m, strength=0.5))
    assert max_diff(reference_loop(m, strength=0.5), reference_loop(m)) > 1e-5


def test_bad_correction_fails_early():
    with pytest.raises(ConfigError, match="delay.correction='adam' is not one of none, staleness-lr"):
        build("cdp-random", delay=dict(model="uniform-tau", correction="adam"))
    with pytest.raises(ConfigError, match="delay.correction='staleness-lr\\+dc-asgd' combines staleness-lr and "
                                          "dc-asgd: join at most one"):
        build("cdp-random", delay=dict(model="uniform-tau", correction="staleness-lr+dc-asgd"))
    with pytest.raises(ConfigError, match="delay.correction='fresh-weighted\\+freshest' combines fresh-weighted and "
                                          "freshest: join at most one of fresh-weighted, fresh-sharp, freshest"):
        build("cdp-random", delay=dict(model="uniform-tau", correction="fresh-weighted+freshest"))
    with pytest.raises(ConfigError, match="runs in cdp_impl='simulate' only"):
        build("cdp-random", impl="ring", delay=dict(model="uniform", correction="nesterov"))
    assert cdp_random.LAID_OUT >= STEPS


def test_simulate_with_a_correction_lowers_for_cuda():
    """The version-history simulation (dynamic reads of the kept versions) and a correction's state
    lower for CUDA as the registry's default (the ring) does in tests/test_cuda_lowering.py."""
    from cdpjax import lowering

    c = default_config()
    c.method, c.model, c.stages, c.global_batch_size, c.cdp_impl = "cdp-random", "mlp", 4, 32, "simulate"
    c.delay.update(dict(model="geometric", correction="dc-asgd"))
    assert lowering.cuda_problems(c, jax.devices()[:8], jax.random.key(0, impl="rbg")) == []


def test_a_resumed_run_ends_where_the_uninterrupted_one_does(tmp_path):
    """The simulation's state (the kept versions, the step that picks the table's row, the
    correction's own versions) is checkpointed whole: stopped after step 5 and resumed from
    checkpoint 4, a run with random delays and dc-asgd ends bit for bit where one run does."""
    from cdpjax import setup as setup_lib, train as train_lib
    from cdpjax.checkpoint import Checkpointer

    def cfg():
        c = config(method="cdp-random", cdp_impl="simulate", workers=4, stages=4, num_steps=8)
        c.checkpoint_every, c.eval_every, c.mesh = 4, 0, {"data": 2}
        c.delay.update(dict(model="geometric", tau_max=3, correction="dc-asgd", strength=0.5))
        return c

    devices = jax.devices()[:2]
    whole, part = tmp_path / "whole", tmp_path / "part"
    train_lib.train(cfg(), str(whole), progress=False, devices=devices)
    train_lib.train(cfg(), str(part), progress=False, devices=devices, stop_after=5)
    assert train_lib.train(cfg(), str(part), progress=False, devices=devices)["resumed_from"] == 4

    def state(workdir):
        m = setup_lib.setup(cfg(), devices)[2]
        ckpt = Checkpointer(str(workdir))
        s, _ = ckpt.restore(ckpt.latest_step(), m.init(jax.random.key(0)))
        ckpt.close()
        return jax.device_get(s)

    a, b = state(whole), state(part)
    assert int(a.step) == 8
    jax.tree.map(np.testing.assert_array_equal, a, b)
