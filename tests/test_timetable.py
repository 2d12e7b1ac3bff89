"""The time table: CDP's staleness rules, busy time, activation memory and gradient traffic
as the paper states them, and the ring's per-tick arrays replayed without JAX."""
import json

import numpy as np
import pytest

from cdpjax.errors import ConfigError
from cdpjax.layouts.cdp import cdp_table, period_arrays
from cdpjax.layouts.gpipe import gpipe_table
from cdpjax.layouts.ppll import ppll_table
from cdpjax.timetable import Op, table


# ------------------------------------------------------------------ staleness


@pytest.mark.parametrize("n", [2, 4, 8])
def test_v2_rule_for_n_equal_l(n):
    stale = cdp_table("cdp-v2", n, n).stale
    expected = np.array([[j < n - 1 - i for j in range(n)] for i in range(n)])
    np.testing.assert_array_equal(stale, expected)


def test_v2_eight_workers_four_stages_half_stale():
    stale = cdp_table("cdp-v2", 8, 4).stale
    assert stale.shape == (8, 4)
    assert stale.sum() == 16  # exactly half
    # The paper's code hard-codes the N = L rule (j < L-1-i): 6 of 32 pairs, about 19%.
    hard_coded = np.array([[j < 4 - 1 - i for j in range(4)] for i in range(8)])
    assert hard_coded.sum() == 6
    assert (stale & ~hard_coded).sum() == 10  # under-delayed by the hard-coded rule
    # Derived from the ticks: worker i starts at i, stage j's update lands at 14-j.
    np.testing.assert_array_equal(stale, [[i + 2 * j < 7 for j in range(4)] for i in range(8)])


def test_v1_all_stale_dp_none():
    for n, l in [(4, 4), (8, 4), (2, 4)]:
        assert cdp_table("cdp-v1", n, l).stale.all()
        assert not cdp_table("dp", n, l).stale.any()


@pytest.mark.parametrize("method", ["dp", "cdp-v1", "cdp-v2"])
@pytest.mark.parametrize("n,l", [(4, 4), (8, 4), (2, 4), (4, 2)])
def test_versions_and_slots(method, n, l):
    t = cdp_table(method, n, l, steps=4)
    fwd = {(o.device, o.stage, o.step): o for o in t.ops if o.kind == "F"}
    upd = {(u.stage, u.step): u.tick for u in t.updates}
    for o in t.ops:
        f = fwd[(o.device, o.stage, o.step)]
        assert o.version == f.version  # a backward reads its forward's version
        k = o.step
        expect = k if method == "dp" else max(k - int(method == "cdp-v1" or t.stale[o.device, o.stage]), 0)
        assert o.version == expect
        applied = sum(1 for s in range(t.steps) if upd[(o.stage, s)] < o.tick)
        assert o.slot == ("current" if o.version == applied else "previous")
        assert o.version in (applied, applied - 1)
    # v2: a fresh read comes after the update it reads, a stale one not.
    if method == "cdp-v2":
        for (i, j, k), f in fwd.items():
            if k >= 1:
                assert (f.tick > upd[(j, k - 1)]) == (not t.stale[i, j])


def test_timing_layout():
    t = cdp_table("cdp-v2", 4, 4, steps=2)
    assert t.offsets == (0, 2, 4, 6)
    g = t.grid()
    assert g.shape == (t.num_ticks, 4)
    assert list(g[:8, 0]) == ["F0", "F1", "F2", "F3", "B3", "B2", "B1", "B0"]
    assert list(g[:2, 1]) == [".", "."] and g[2, 1] == "F0"
    # Stage j's update for step k: the last worker's backward of stage j.
    assert [(u.tick, u.stage) for u in t.updates if u.step == 0] == [(10, 3), (11, 2), (12, 1), (13, 0)]
    dp = cdp_table("dp", 4, 4, steps=2)
    assert {(u.tick, u.stage) for u in dp.updates if u.step == 0} == {(7, j) for j in range(4)}
    text = t.format_grid()
    assert "cdp-v2" in text and "F0*" in text and "stale (worker, stage) pairs: 6 of 16" in text


def test_invalid_sizes_refused():
    with pytest.raises(ConfigError, match=r"workers=3 .*choose workers in \[1, 2, 4, 8\]"):
        cdp_table("cdp-v2", 3, 4)
    with pytest.raises(ConfigError, match=r"\[1, 2, 3, 6\]"):
        cdp_table("cdp-v1", 4, 3)
    with pytest.raises(ValueError):  # ConfigError is a ValueError
        cdp_table("cdp-v2", 16, 4)
    for bad in [dict(workers=0, stages=4), dict(workers=2, stages=0), dict(workers=2.5, stages=4)]:
        with pytest.raises(ConfigError):
            cdp_table("cdp-v2", **bad)
    with pytest.raises(ConfigError, match="not one of"):
        cdp_table("cdp-v3", 4, 4)
    with pytest.raises(ConfigError):
        gpipe_table(4, 0)
    with pytest.raises(ConfigError):
        ppll_table(0, 4)


# ----------------------------------------------------------------- busy time


def test_busy_fraction():
    for n, l in [(2, 2), (4, 4), (8, 4)]:
        bf = cdp_table("cdp-v2", n, l).busy_fraction()
        assert bf["overall"] == 1.0 and bf["per_stage"] == [1.0] * l  # every stage used every tick
    assert cdp_table("cdp-v2", 2, 4).busy_fraction()["overall"] == 0.5
    bf = cdp_table("dp", 4, 4).busy_fraction()
    assert bf["overall"] == 0.25 and bf["per_device"] == [1.0] * 4  # workers busy, stages 1/L
    assert gpipe_table(4, 4).busy_fraction()["overall"] == pytest.approx(4 / 7)  # M / (M+K-1)
    assert gpipe_table(4, 1).busy_fraction()["overall"] == pytest.approx(1 / 4)  # plain model parallelism
    p = ppll_table(4, 12)
    assert p.busy_fraction()["overall"] == 1.0  # no bubble once filled
    assert p.busy_fraction()["whole"] == pytest.approx(12 / 15)  # fill and drain at the ends only


def test_pipeline_tables():
    p = ppll_table(3, 5)
    cells = {(o.tick, o.device): o for o in p.ops}
    assert len(cells) == len(p.ops) == 15
    for (t, j), o in cells.items():
        assert o.stage == j and o.step == t - j and o.kind == "FB"
    g = gpipe_table(3, 2, steps=2)
    assert g.num_ticks == 2 * 2 * (2 + 3 - 1)
    assert len({(o.tick, o.device) for o in g.ops}) == len(g.ops) == 2 * 2 * 3 * 2
    last_forward = max(o.tick for o in g.ops if o.kind == "F" and o.step == 0)
    assert min(o.tick for o in g.ops if o.kind == "B" and o.step == 0) == last_forward + 1
    assert {u.tick for u in g.updates if u.step == 0} == {g.period - 1}  # flush, then update
    assert table("gpipe", stages=3, microbatches=2, steps=2) == g


# --------------------------------------------------------- activation memory


def test_activation_model():
    n = l = 4
    cdp, dp = cdp_table("cdp-v2", n, l), cdp_table("dp", n, l)
    per = cdp.activation_per_worker()
    for o in cdp.ops:  # p+1 at forward phase p, 2L-1-p at backward phase p
        p = (o.tick - cdp.offsets[o.device]) % (2 * l)
        assert per[o.tick, o.device] == (p + 1 if p < l else 2 * l - 1 - p)
    a, b = cdp.activation_stats(), dp.activation_stats()
    assert b["total_peak"] == n * l  # every worker at its peak together
    assert a["total_peak"] <= 0.55 * b["total_peak"]
    assert a["total_peak"] == a["total_mean"] == n * l / 2  # flat over the step
    assert a["total_mean"] == b["total_mean"]  # same work, spread out
    lo, hi = cdp.steady
    np.testing.assert_array_equal(cdp.activation_total()[lo:hi], n * l // 2)


# ------------------------------------------------------------- communication


def test_comm_balance_and_messages():
    l = 4
    sizes = [3.0, 1.0, 2.0, 5.0]
    dp, cdp = cdp_table("dp", 4, l), cdp_table("cdp-v2", 4, l)
    assert dp.comm_balance([1.0] * l) == pytest.approx(2 * l)  # one burst per step
    assert dp.comm_balance(sizes) == pytest.approx(2 * l)
    assert cdp.comm_balance([1.0] * l) <= 2
    # Same total traffic per step: 2(N-1) x the model, spread over the step.
    lo, hi = cdp.steady
    np.testing.assert_allclose(dp.bytes_per_tick(sizes)[lo:hi].sum(), 2 * 3 * sum(sizes))
    np.testing.assert_allclose(cdp.bytes_per_tick(sizes)[lo:hi].sum(), 2 * 3 * sum(sizes))
    for n in (2, 4, 8):
        t = cdp_table("cdp-v2", n, l)
        for k in range(t.steps):
            for j in range(l):
                msgs = [m for m in t.messages if m.stage == j and m.step == k]
                partial = [m for m in msgs if m.kind == "partial"]
                relay = [m for m in msgs if m.kind == "sum"]
                assert [(m.src, m.dst) for m in partial] == [(i, i + 1) for i in range(n - 1)]
                assert [(m.src, m.dst) for m in relay] == [((n - 1 + h) % n, h % n) for h in range(n - 1)]
                u = next(u.tick for u in t.updates if u.stage == j and u.step == k)
                assert all(m.tick == u for m in relay)
                # A partial sum leaves a worker the tick it finishes the stage's backward.
                for m in partial:
                    assert any(o.tick == m.tick and o.device == m.src and o.kind == "B" and o.stage == j
                               and o.step == k for o in t.ops)
    assert cdp_table("cdp-v2", 1, 4).messages == ()
    with pytest.raises(ConfigError):
        dp.bytes_per_tick([1.0, 2.0])


# --------------------------------------------------------- the ring's arrays


@pytest.mark.parametrize("method", ["cdp-v1", "cdp-v2"])
@pytest.mark.parametrize("n,l", [(1, 2), (2, 4), (4, 2), (4, 4), (8, 4), (6, 3)])
def test_period_arrays_replayed(method, n, l):
    """Runs the period arrays for a few calls with version numbers instead of tensors and
    sets of contributions instead of gradient sums, exactly as the ring does: every op
    reads the version the table names, and every update sums each worker's gradient once."""
    a = period_arrays(method, n, l)
    ref = cdp_table(method, n, l, steps=6)
    want = {(o.device, o.stage, o.step, o.kind): o.version for o in ref.ops}
    T = 2 * l
    current, previous = [0] * l, [0] * l
    inbox = [[frozenset() for _ in range(l)] for _ in range(n)]
    applied = {}
    calls = 5
    for call in range(calls + 1):  # the last call is a flush
        feeding = call < calls
        for tau in range(T):
            outgoing = [frozenset()] * n
            completed = [None] * n
            for i in range(n):
                op, step = int(a["op"][tau, i]), call + int(a["step"][tau, i])
                valid = 0 <= step < calls
                if op == 0 or not valid:
                    grad = frozenset()
                else:
                    j, kind = (op - 1, "F") if op <= l else (op - 1 - l, "B")
                    version = previous[j] if a["slot"][tau, i] else current[j]
                    assert version == want[(i, j, step, kind)], (tau, i, op, step)
                    grad = frozenset({(i, step)}) if kind == "B" else frozenset()
                if op > l:
                    j = op - 1 - l
                    total = inbox[i][j] | grad
                    inbox[i][j] = frozenset()
                    if a["send"][tau, i] >= 0:
                        assert a["send"][tau, i] == j
                        outgoing[i] = total
                    if a["sum_hop"][tau, i] == 0:
                        completed[i] = total
            received = [outgoing[(i - 1) % n] for i in range(n)]
            for i in range(n):
                if a["recv"][tau, i] >= 0:
                    inbox[i][a["recv"][tau, i]] = received[i]
            u = int(a["update"][tau])
            if u >= 0:
                source = [i for i in range(n) if a["sum_hop"][tau, i] == 0]
                assert len(source) == 1 and sorted(a["sum_hop"][tau]) == list(range(n))
                step = call + int(a["update_step"][tau])
                if 0 <= step < calls:
                    assert completed[source[0]] == {(i, step) for i in range(n)}
                    previous[u], current[u] = current[u], current[u] + 1
                    applied[(u, step)] = current[u]
    assert applied == {(j, k): k + 1 for j in range(l) for k in range(calls)}


def test_period_arrays_are_periodic():
    """The steady-state period does not depend on which period of the table it is taken from."""
    for method, n, l in [("cdp-v2", 8, 4), ("cdp-v1", 4, 4), ("cdp-v2", 2, 4)]:
        t = cdp_table(method, n, l, steps=6)
        rows = []
        for m in (2, 3, 4):
            grid = np.zeros((2 * l, n), int)
            for o in t.ops:
                if 2 * l * m <= o.tick < 2 * l * (m + 1):
                    grid[o.tick - 2 * l * m, o.device] = (1 + o.stage + l * (o.kind == "B")) * (
                        1 if o.slot == "current" else -1)
            rows.append(grid)
        np.testing.assert_array_equal(rows[0], rows[1])
        np.testing.assert_array_equal(rows[1], rows[2])
        a = period_arrays(method, n, l)
        np.testing.assert_array_equal(a["op"] * np.where(a["slot"] == 1, -1, 1), rows[0])
    with pytest.raises(ConfigError):
        period_arrays("dp", 4, 4)


def test_json():
    t = cdp_table("cdp-v2", 4, 4)
    d = json.loads(json.dumps(t.to_json([1.0] * 4)))
    for key in ("method", "workers", "stages", "stale", "busy_fraction", "ticks", "comm_balance"):
        assert key in d
    assert d["stale"] == [[j < 3 - i for j in range(4)] for i in range(4)]
    assert len(d["ticks"]) == t.num_ticks and d["ticks"][0][0] == "F0"
    assert isinstance(t.ops[0], Op) and t.ops[0].worker == t.ops[0].device
    for m in ("ppll", "gpipe"):
        json.dumps(table(m, stages=3, steps=2).to_json())
