"""cdp-zero: the relay program feeds every op the version the table names (checked on version
numbers for every size); the SPMD run ends with the ring's parameters (cdp-v2, cdp-v1, N = L
and N != L, and training on after a flush); its compiled step has no all-gather,
reduce-scatter or model-sized all-reduce and stores a fraction of the ring's parameters and
optimizer state."""
import functools
import json
import math

import jax
import numpy as np
import pytest

from cdpjax import bench, data, methods
from cdpjax.commands import schedule
from cdpjax.config import ConfigError, default_config
from cdpjax.mesh import make_mesh
from cdpjax.methods import cdp
from cdpjax.methods.common import Context
from cdpjax.layouts.cdp import cdp_table
from cdpjax.layouts.cdp_zero import cdp_zero_table, zero_period_arrays
from helpers import assert_trees_close as assert_close, cdp_rule, max_diff, params
from cdpjax.timetable import table

BATCH, STEPS = 32, 3


def config(**kw):
    c = default_config()
    c.model_kwargs.width = 16  # mlp: 4 blocks, so up to 4 stages
    c.global_batch_size = BATCH
    c.num_steps = 20
    c.eval_every = c.checkpoint_every = 0
    c.norm = "none"  # exact equality
    for k, v in kw.items():
        c[k] = v
    return c


@functools.lru_cache(maxsize=None)
def batches():
    ds = data.build(config())
    return [ds.train_batch(k, BATCH, 0, augment=False) for k in range(STEPS + 2)]


def context(devices, **kw):
    ds = data.build(config())
    return Context(config(**kw), make_mesh({"data": devices}, jax.devices()[:devices]), ds.image_shape, ds.num_classes)


@functools.lru_cache(maxsize=None)
def build(impl, rule, workers, stages=4):
    if impl == "ring":
        return cdp.make(context(workers, method=rule, cdp_impl="ring", stages=stages), rule)
    return methods.build(context(workers, method="cdp-zero", cdp_rule=rule, stages=stages))


def train(m, steps=STEPS, state=None, start=0):
    state = m.init(jax.random.key(0)) if state is None else state
    for b in batches()[start:start + steps]:
        state, metrics = m.train_step(state, b)
        assert np.isfinite(float(metrics["loss"]))
    return state


# ------------------------------------------------------------------ the relay program

SIZES = [(n, l) for l in range(1, 7) for n in range(1, 2 * l + 1) if (2 * l) % n == 0]


def run_program(rule, N, L, periods=6):
    """Plays `zero_period_arrays` on version numbers and gradient contributions, as the SPMD
    tick does, from the initial state; checks each op against the plain CDP table."""
    a = zero_period_arrays(N, L, rule)
    T, d, C = 2 * L, 2 * L // N, a["versions"]
    want = {(o.tick, o.device): o for o in cdp_table(rule, N, L, steps=periods).ops}
    V = int(a["send_slot"].max()) + 1
    owned = [[j for j in range(L) if a["owners"][j] == w] for w in range(N)]
    master = [[[0] * V for _ in owned[w]] for w in range(N)]  # version numbers, current first
    relay = [[(0,) * C for _ in range(d)] for _ in range(N)]
    partial = [[frozenset() for _ in range(d)] for _ in range(N)]
    for w in range(N):  # the initial buffers hold the stages the seed names (all version 0)
        for k in range(d):
            assert a["seed"][w, k] == want[(k - d if k else 0) % T + 2 * T, w].stage
    checked = 0
    for p in range(periods):
        for t in range(T):
            totals = {}
            for w in range(N):
                op_code, step = a["op"][t, w], p + a["step"][t, w]
                j = (op_code - 1) % L
                if step >= 0:  # ops of steps never fed are idle
                    o = want[(p * T + t, w)]
                    assert (o.stage, o.kind) == (j, "F" if op_code <= L else "B")
                    assert relay[w][t % d][a["read"][t, w]] == o.version, (p, t, w)
                    checked += 1
                if op_code > L:
                    incoming = frozenset() if a["first"][t, w] else partial[w][t % d]
                    totals[w] = incoming | ({(w, step)} if step >= 0 else set())
            for w, total in totals.items():
                partial[(w + 1) % N][t % d] = total
            u, ustep = a["update"][t], p + a["update_step"][t]
            if u >= 0 and ustep >= 0:
                owner = a["owners"][u]
                hops = a["sum_hop"][t, owner]
                assert hops >= 0 and (a["sum_hop"][t] >= 0).sum() == 1
                assert totals[(owner - hops) % N] == {(i, ustep) for i in range(N)}  # every worker's gradient
                rows = master[owner][a["local"][u]]
                rows[:] = [rows[0] + 1] + rows[:-1]
            sent = []
            for w in range(N):
                k = a["refresh"][t, w]
                sent.append(tuple(master[w][k][s] for s in a["send_slot"][t, w]) if k >= 0 else relay[w][(t + 1) % d])
            for w in range(N):
                relay[(w + 1) % N][(t + 1) % d] = sent[w]
    return checked, a, V


@pytest.mark.parametrize("rule", ["cdp-v2", "cdp-v1"])
def test_relay_program_feeds_every_op_its_version(rule):
    for N, L in SIZES:
        checked, a, stored = run_program(rule, N, L)
        assert checked > 0
        counts = np.bincount(np.asarray(a["owners"]), minlength=N)
        assert counts.max() == a["per_worker"] == math.ceil(L / N), (N, L, a["owners"])  # balanced
        if rule == "cdp-v2":  # one version per hop, and only the current one stored
            assert a["versions"] == 1 and stored == 1
        elif N > 1:  # a pass spans an update: both versions stored, two per hop (L = 1: one)
            assert stored == 2 and a["versions"] == (2 if L > 1 else 1)
    assert zero_period_arrays(4, 4, rule)["owners"].tolist() == [2, 1, 0, 3]  # N = L: worker L-2-j


def test_relay_program_check_can_fail(monkeypatch):
    """A wrong row, stored slot or chain start is caught by the same player."""
    good = zero_period_arrays(4, 4, "cdp-v1")
    for key, where in (("read", (5, 1)), ("first", (4, 0)), ("send_slot", (1, 1))):
        bad = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in good.items()}
        bad[key][where] = 1 - bad[key][where]
        monkeypatch.setitem(globals(), "zero_period_arrays", lambda *args, bad=bad: bad)
        with pytest.raises(AssertionError):
            run_program("cdp-v1", 4, 4)


# ------------------------------------------------------------------ equal to the ring


@pytest.mark.parametrize("rule,workers", [("cdp-v2", 4), ("cdp-v1", 4), ("cdp-v2", 8)])
def test_equals_ring(rule, workers):
    zero, ring = build("zero", rule, workers), build("ring", rule, workers)
    # owners by the rule: N = L = 4, worker L-2-j owns stage j (mod N); N = 8: 2(L-1-j)
    assert zero.info["owners"] == ([2, 1, 0, 3] if workers == 4 else [6, 4, 2, 0])
    state = train(zero)
    unflushed = params(zero, state)
    state = zero.flush(state)
    got = params(zero, state)
    assert_close(got, params(ring, ring.flush(train(ring))))
    assert max_diff(got, params(zero, zero.init(jax.random.key(0)))) > 1e-3  # it trained
    assert max_diff(unflushed, got) > 1e-6  # the flush finished the last step's updates
    if workers == 4 and rule == "cdp-v2":  # training on after a flush, as the ring does
        assert_close(params(zero, zero.flush(train(zero, 2, state, STEPS))),
                     params(ring, ring.flush(train(ring, 2, ring.flush(train(ring)), STEPS))))


@pytest.mark.heavy
def test_two_stages_per_worker_v1():
    """N < L: each worker owns two stages, hops carry both versions (cdp-v1)."""
    zero, ring = build("zero", "cdp-v1", 2), build("ring", "cdp-v1", 2)
    assert zero.info["storage"]["owned_stages"] == 2 and zero.info["storage"]["versions_per_hop"] == 2
    assert_close(params(zero, zero.flush(train(zero))), params(ring, ring.flush(train(ring))))


# ------------------------------------------------------------------ collectives and memory


def collective_sizes(hlo: str) -> dict:
    from cdpjax.bench import COLLECTIVES

    out = {k: [] for k in COLLECTIVES}
    for line in hlo.splitlines():
        if "=" not in line:
            continue
        rhs = line.split("=", 1)[1]
        for kind in COLLECTIVES:
            if f" {kind}(" in rhs or f" {kind}-start(" in rhs:
                out[kind].append(bench._shape_bytes(rhs.split(kind)[0]) // 4)  # f32 elements
    return out


def compiled(m):
    state, b = m.init(jax.random.key(0)), batches()[0]
    return state, m.info["period"].lower(state, b["image"], b["label"], True).compile()


@pytest.mark.parametrize("rule", ["cdp-v2", "cdp-v1"])
def test_no_model_sized_collectives_and_less_memory(rule):
    zero, ring = build("zero", rule, 4), build("ring", rule, 4)
    state, exe = compiled(zero)
    model = sum(x.size for x in jax.tree.leaves(zero.export(state)[0]))
    sizes = collective_sizes(exe.as_text())
    assert not sizes["all-gather"] and not sizes["reduce-scatter"] and not sizes["all-to-all"]
    assert sizes["all-reduce"] and max(sizes["all-reduce"]) < 0.01 * model  # the metric scalars
    p_max = max(sum(x.size for x in jax.tree.leaves(p)) for p in zero.export(state)[0])  # the largest stage
    versions = 1 if rule == "cdp-v2" else 2  # a v1 pass spans an update: both versions travel
    assert max(sizes["collective-permute"]) == versions * p_max  # one stage (two versions for v1) per hop
    # The bench's parser agrees.
    found = bench.collectives(exe.as_text())
    assert found["all-gather"]["count"] == found["reduce-scatter"]["count"] == 0

    ring_state, ring_exe = compiled(ring)
    # Its stored parameters and optimizer state are a fraction of the ring's; its arguments as a
    # whole (padded relay and partial-sum rows) are not less than the one-version ring's any more.
    assert bench.memory(exe)["argument_bytes"] > 0 and bench.memory(ring_exe)["argument_bytes"] > 0

    # Persistent parameter + optimizer storage per device: K rows x (stored versions + momentum).
    def per_device(tree):
        return sum(x.nbytes for x in jax.tree.leaves(tree)) / 4  # the leading axis is the 4 workers

    mine = per_device([state["master"], state["opt_state"]])
    theirs = per_device([ring_state["params"], ring_state["opt_state"]])  # the ring: one stored version
    stored = 1 if rule == "cdp-v2" else 2  # v2's owners keep the current version only
    assert abs(mine - (stored + 1) * p_max * 4) < 64  # + the optimizer's step counts
    model = sum(x.size for x in jax.tree.leaves(zero.export(state)[0]))
    assert abs(theirs - 2 * model * 4) < 64 and mine < theirs  # the ring: one version + momentum of everything


# ------------------------------------------------------------------ table, schedule, errors


def test_table_and_schedule(capsys):
    t = cdp_zero_table(4, 4, steps=3)
    base = cdp_table("cdp-v2", 4, 4, steps=3)
    ops, updates, stale = cdp_rule("cdp-v2", 4, 4, 3)  # CDP's timing as the paper states it
    assert t.method == "cdp-zero"
    assert {(o.tick, o.device, o.stage, o.kind, o.step, o.version, o.slot, o.stale) for o in t.ops} == ops
    assert {(u.tick, u.stage, u.step) for u in t.updates} == updates
    np.testing.assert_array_equal(t.stale, stale)
    lo, hi = t.steady
    for tick in range(lo, hi):  # steady state: every worker sends one parameter hop per tick
        assert sum(m.kind == "param" and m.tick == tick for m in t.messages) == 4
    # Counted by rule. Sums go from the last worker (3) only as far as the owner: (owner - 3) mod 4
    # hops for owners [2, 1, 0, 3], 6 a step; the ring brings each of the 4 stages' sums to the 3
    # other workers, 12 a step (steps 0 and 1: the last step's deliveries run past the laid-out ticks).
    assert sum(m.kind == "sum" and m.step < 2 for m in t.messages) == 12
    assert sum(m.kind == "sum" and m.step < 2 for m in base.messages) == 24
    # One steady step at unit stage sizes: 12 partial hops (3 a stage) + 6 sum hops + 32 parameter
    # hops (4 workers x 8 ticks) against the ring's 12 partial + 12 sum.
    assert t.bytes_per_tick([1.0] * 4)[lo:hi].sum() == 12 + 6 + 32
    assert base.bytes_per_tick([1.0] * 4)[lo:hi].sum() == 12 + 12
    assert table("cdp-zero", workers=4, stages=4, rule="cdp-v1").meta["versions_per_hop"] == 2
    assert schedule.main(["--method", "cdp-zero", "--workers", "4", "--stages", "4", "--rule", "cdp-v1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("cdp-zero: N=4 workers") and "stage 0: w2" in out and "2 version(s)" in out
    assert schedule.main(["--method", "cdp-zero", "--workers", "8", "--stages", "4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["owners"] == [6, 4, 2, 0] and d["versions_per_hop"] == 1
    assert schedule.main(["--method", "cdp-zero", "--workers", "3", "--stages", "4"]) == 2
    assert "choose workers in" in capsys.readouterr().err


def test_config_errors():
    assert "cdp-zero" in methods.REGISTRY
    bad = [
        (dict(workers=3), 3, "choose workers in"),
        (dict(workers=2), 4, "must equal mesh.data=4"),
        (dict(global_batch_size=30), 4, "global_batch_size=30"),
        (dict(cdp_rule="dp"), 4, "cdp_rule"),
    ]
    for kw, devices, match in bad:
        with pytest.raises(ConfigError, match=match):
            methods.build(context(devices, method="cdp-zero", **kw))
    ds = data.build(config())
    mesh = make_mesh({"stage": 2, "data": 2}, jax.devices()[:4])
    with pytest.raises(ConfigError, match="mesh"):
        methods.build(Context(config(method="cdp-zero"), mesh, ds.image_shape, ds.num_classes))
