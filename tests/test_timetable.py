"""The time table: CDP's staleness rules (the table's and the paper code's), busy time,
activation memory (in stage-activations and in bytes) and gradient traffic as the paper
states them; the delivery plan's deadlines and sends per tick for every size; the ring's
period replayed without JAX."""
import dataclasses
import json

import numpy as np
import pytest

from cdpjax.errors import ConfigError
from cdpjax.layouts.cdp import _laid_out, applies_of, cdp_table
from cdpjax.program.ring import ring_ticks
from cdpjax.layouts.gpipe import gpipe_table
from cdpjax.layouts.ppll import ppll_table
from cdpjax import kinds, speedup
from cdpjax.timetable import Op, TimeTable, from_orders, table
from helpers import cdp_rule


def ring_program(rule, n, l, ticks="whole"):
    """The ring's period of CDP's own table (lowered from the table alone)."""
    return ring_ticks(cdp_table(rule, n, l, ticks=ticks))


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
    assert (stale & ~hard_coded).sum() == 10  # under-delayed by the hard-coded rule
    # Derived from the ticks: worker i starts at i, stage j's update lands at 14-j.
    np.testing.assert_array_equal(stale, [[i + 2 * j < 7 for j in range(4)] for i in range(8)])


def test_split_backward_n_equal_l_rule():
    """Split backwards, N = L: worker i starts at 3i, its forward of stage j is at 3i + j and the
    update of stage j lands at the end of worker L-1's W, 3(L-1) + 3L-1-2j, one step earlier: stale
    iff 3i + j <= 3(L-1) - 1 - 2j, i.e. 3i + 3j < 3L - 3, i.e. j < L-1-i, the whole-backward rule."""
    for n in (2, 4, 8):
        stale = cdp_table("cdp-v2", n, n, ticks="split").stale
        np.testing.assert_array_equal(stale, [[j < n - 1 - i for j in range(n)] for i in range(n)])


def test_v1_all_stale_dp_none():
    for n, l in [(4, 4), (8, 4), (2, 4)]:
        assert cdp_table("cdp-v1", n, l).stale.all()
        assert not cdp_table("dp", n, l).stale.any()


@pytest.mark.parametrize("method", ["dp", "cdp-v1", "cdp-v2"])
@pytest.mark.parametrize("n,l,ticks", [(4, 4, "whole"), (8, 4, "whole"), (2, 4, "whole"), (4, 2, "whole"),
                                       (4, 4, "split"), (2, 4, "split"), (3, 4, "split"), (6, 4, "split"),
                                       (8, 8, "split"), (2, 4, "paired"), (3, 4, "paired"), (6, 4, "paired"),
                                       (5, 3, "paired"), (3, 6, "paired"), (9, 6, "paired")])
def test_versions_and_slots(method, n, l, ticks):
    """Every op (tick, worker, stage, kind, step, version, slot, stale) and every update equal the
    schedule as the paper states it, written out in `helpers.cdp_rule` without the table code, for
    whole backwards (2L ticks), split ones (F, B, W: 3L ticks) and paired forwards (L/2 + L ticks)."""
    t = cdp_table(method, n, l, steps=4, ticks=ticks)
    ops, updates, stale = cdp_rule(method, n, l, 4, ticks)
    assert {(o.tick, o.device, o.stage, o.kind, o.step, o.version, o.slot, o.stale) for o in t.ops} == ops
    assert {(u.tick, u.stage, u.step) for u in t.updates} == updates
    np.testing.assert_array_equal(t.stale, stale)
    # two stored versions suffice: every read is of the newest applied version or the one before
    applied = {(u.stage, u.step): u.tick for u in t.updates}
    for o in t.ops:
        n_applied = sum(1 for s in range(t.steps) if applied[(o.stage, s)] < o.tick)
        assert o.version in (n_applied, n_applied - 1)


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


def test_lockstep_busy_fraction_weighs_each_tick_by_its_slowest_op():
    """1F1B at L = 8, M = 32 in lockstep, F = 1 and B = 2: its first L ticks run forwards only (micro-batch
    0 reaches the last stage), and from then on some device runs a backward in every tick of the 2(M+L-1)
    until stage 0's last backward ends the step, so the step lasts L*1 + (2(M+L-1) - L)*2 time units, in
    which each device works M*(1 + 2): 96 / 148 = 0.65, where the unit-tick figure is 2M / 2(M+L-1) = 0.82."""
    L, M = 8, 32
    t = table("1f1b", stages=L, microbatches=M)
    ticks = 2 * (M + L - 1)
    assert t.busy_fraction()["devices"] == pytest.approx(2 * M / ticks)
    assert t.lockstep_busy_fraction() == pytest.approx(M * 3 / (L * 1 + (ticks - L) * 2))
    assert round(t.lockstep_busy_fraction(), 2) == 0.65
    # every tick of dp's table runs one op per worker: a backward tick is 2 long for every worker alike
    assert cdp_table("dp", 4, 4).lockstep_busy_fraction() == pytest.approx(1.0)
    # a stage's B twice as slow as the others': ticks where it runs last 4, so the others wait
    slow = speedup.uniform_costs({"F": 1, "B": 2}, 2)
    slow = dataclasses.replace(slow, backward=(2.0, 4.0))
    g = gpipe_table(2, 1)  # F0 F1 B1 B0: ticks of 1, 1, 4, 2 on two devices, each working 1 + 2 or 1 + 4
    assert g.lockstep_busy_fraction(slow) == pytest.approx((3 + 5) / (2 * (1 + 1 + 4 + 2)))
    assert "in lockstep (each tick as long as its slowest device's op, a backward = 2 forwards): 0.649" in \
        t.format_grid()


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
                assert [(m.src, m.dst) for m in partial] == [(i, i + 1) for i in range(n - 1)]
                # A partial sum leaves a worker the tick it finishes the stage's backward.
                for m in partial:
                    assert any(o.tick == m.tick and o.device == m.src and o.kind == "B" and o.stage == j
                               and o.step == k for o in t.ops)
    assert cdp_table("cdp-v2", 1, 4).messages == ()
    with pytest.raises(ConfigError):
        dp.bytes_per_tick([1.0, 2.0])


# ---------------------------------------------------- the delivery plan, the ring

PLAN_SIZES = sorted({(n, l) for l in range(2, 9) for n in (2, 4, 8) if (2 * l) % n == 0} | {(6, 3), (3, 6)})


def _completer(t, j, k):
    return max((o for o in t.ops if o.kind == "B" and o.stage == j and o.step == k), key=lambda o: o.tick).device


@pytest.mark.parametrize("rule", ["cdp-v2", "cdp-v1"])
def test_delivery_plan_meets_every_deadline(rule):
    """For every size: each completed sum reaches every other worker once, from a worker that
    holds it, at most one 'sum' send and one receive plus one 'partial' send per worker per
    tick (whatever N); each worker applies each update once, after it has the sum, and every
    op reads exactly the updates its worker applied before the op's tick (one stored version)."""
    for n, l in PLAN_SIZES:
        t = cdp_table(rule, n, l, steps=4)
        sends, recvs = {}, {}
        for m in t.messages:
            sends[(m.tick, m.src, m.kind)] = sends.get((m.tick, m.src, m.kind), 0) + 1
            if m.kind == "sum":
                recvs[(m.tick, m.dst)] = recvs.get((m.tick, m.dst), 0) + 1
        assert max(sends.values()) == 1 and max(recvs.values()) == 1, (rule, n, l)
        assert t.sends_per_tick().max() <= 2
        applies = applies_of(t)
        u_tick = {(u.stage, u.step): u.tick for u in t.updates}
        for (j, k), u in u_tick.items():
            c = _completer(t, j, k)
            have = {c: u}  # who holds the sum, from the end of which tick
            for m in sorted((m for m in t.messages if m.kind == "sum" and (m.stage, m.step) == (j, k)),
                            key=lambda m: m.tick):
                assert m.src in have and (have[m.src] < m.tick or (m.src == c and m.tick >= u)), (rule, n, l, m)
                assert m.dst not in have
                have[m.dst] = m.tick
            if max(have.values()) < t.num_ticks - 2 * l:  # every delivery of this update laid out
                assert set(have) == set(range(n)), (rule, n, l, j, k)
            for w, got in have.items():
                if (w, j, k) in applies:
                    assert applies[(w, j, k)] >= got
        for o in t.ops:
            held = sum(1 for (w, j, k), a in applies.items() if w == o.device and j == o.stage and a < o.tick)
            assert held == o.version, (rule, n, l, o)


def test_paper_code_rule_from_the_command_line(capsys, tmp_path):
    """`cdpjax schedule --method cdp-v2 --rule paper-code`: the text grid with its notes, --json
    with the same `stale` field as the rule written out, --out draws it; --stage-bytes adds bytes."""
    from cdpjax.commands import schedule

    args = ["--method", "cdp-v2", "--workers", "8", "--stages", "4", "--rule", "paper-code"]
    assert schedule.main(args) == 0
    text = capsys.readouterr().out
    assert "stale (worker, stage) pairs: 6 of 32" in text and "8 idle tick(s)" in text
    assert schedule.main(args + ["--json", "--stage-bytes", "4,3,2,1"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["stale"] == [[not (j >= 3 - i) for j in range(4)] for i in range(8)] and d["rule"] == "paper-code"
    assert d["activation"]["total_peak_bytes"] > 0 and len(d["bytes_per_tick"]) == d["num_ticks"]
    assert schedule.main(args + ["--out", str(tmp_path / "paper.png")]) == 0 and (tmp_path / "paper.png").exists()
    assert schedule.main(["--method", "cdp-v2", "--rule", "cdp-v1"]) == 2
    assert "cdp-v2 rule" in capsys.readouterr().err


def test_paper_code_rule():
    """The authors' released rule, written out here: worker i reads the current version of stage
    j iff j >= L-1-i. N = L: the table's own rule; N < L: more stale than the timing needs, and
    realisable. N = 8, L = 4: 6 of 32 pairs stale; at 8 ticks a step (workers 1 tick apart) some
    reads would come before their update (worker 4's forward of stage 0, two ticks before stage
    0's update), which the ring refuses naming the op; the table lengthens the step to 16 ticks
    (workers 2 ticks apart, as at N = L), which the ring runs."""
    def paper(n, l):
        return np.array([[not (j >= l - 1 - i) for j in range(l)] for i in range(n)])

    for n, l in [(8, 4), (4, 4), (2, 4)]:
        t = table("cdp-v2", workers=n, stages=l, rule="paper-code")
        assert t.method == "cdp-v2" and t.meta["rule"] == "paper-code"
        np.testing.assert_array_equal(t.stale, paper(n, l))
    assert paper(8, 4).sum() == 6
    np.testing.assert_array_equal(table("cdp-v2", workers=4, stages=4, rule="paper-code").stale,
                                  cdp_table("cdp-v2", 4, 4).stale)
    v2 = cdp_table("cdp-v2", 2, 4).stale
    assert (paper(2, 4) >= v2).all() and paper(2, 4).sum() > v2.sum()
    ring_program("paper-code", 2, 4)  # realisable: every read served from one stored version
    assert cdp_table("paper-code", 2, 4).period == 8  # N <= L: the paper's T = 2L

    eight = _laid_out("paper-code", 8, 4, 4, "whole", 8)  # the paper's timing: offsets i, 8 ticks a step
    f = next(o for o in eight.ops if o.device == 4 and o.stage == 0 and o.kind == "F" and o.step == 2)
    u = next(u.tick for u in eight.updates if u.stage == 0 and u.step == 1)
    assert u - f.tick == 2 and f.slot == "future" and f.version == 2
    with pytest.raises(ConfigError, match=r"^the ring engine cannot run this cdp-v2 table: worker \d+'s F\d of "
                                          r"step \d+ at tick \d+ reads version \d+, and the newest version the "
                                          r"worker stores then is \d+"):
        ring_ticks(eight)
    t = cdp_table("paper-code", 8, 4, steps=4)
    assert t.period == 16 and t.offsets == tuple(2 * i for i in range(8))
    assert not any(o.slot == "future" for o in t.ops) and any("8 idle tick(s)" in note for note in t.notes)
    np.testing.assert_array_equal(t.stale, paper(8, 4))
    assert len(ring_program("paper-code", 8, 4).ticks) == 16
    with pytest.raises(ConfigError, match="cdp-v2 rule"):
        table("cdp-v2", workers=4, stages=4, rule="cdp-v1")


def test_activation_bytes_of_a_two_stage_example():
    """N = 2 workers, L = 2 stages, stage outputs a = 3 and b = 1 bytes per micro-batch. A worker
    holds stage 0's output from its forward (phase 0) until before its backward (phase 3), stage
    1's at phase 1 only: a, a + b, a, 0 over its four phases. DP: both workers in phase: totals
    2a, 2a+2b, 2a, 0. CDP (worker 1 two ticks later): a+a, (a+b)+0, a+a, 0+(a+b)."""
    a, b = 3.0, 1.0
    cdp = cdp_table("cdp-v2", 2, 2).activation_stats([a, b])
    dp = cdp_table("dp", 2, 2).activation_stats([a, b])
    assert cdp["total_peak_bytes"] == 2 * a and cdp["total_mean_bytes"] == (4 * a + 2 * (a + b)) / 4
    assert cdp["device_peak_bytes"] == a + b and cdp["device_mean_bytes"] == (3 * a + b) / 4
    assert dp["total_peak_bytes"] == 2 * a + 2 * b and dp["total_mean_bytes"] == (6 * a + 2 * b) / 4
    # the real-byte ratio (0.75) is not the unit model's (0.5)
    assert cdp["total_peak_bytes"] / dp["total_peak_bytes"] == 0.75
    assert cdp["total_peak"] / dp["total_peak"] == 0.5


def _replay(rule, n, l, calls=4, ticks="whole"):
    """Plays the ring's period (`ring_ticks`) as the SPMD period does, on version numbers and sets of
    gradient contributions: a device's buffer a send does not reach is clobbered (None) unless the
    send merges; in-flight buffers go on, one lag older, only where the program says they are live."""
    p = ring_program(rule, n, l, ticks)
    gradient = "W" if ticks == "split" else "B"
    if rule in ("cdp-v1", "cdp-v2"):  # the versions the paper's rule reads (helpers.cdp_rule), not the table's
        want = {(w, j, k, kind): v for _, w, j, kind, k, v, _, _ in cdp_rule(rule, n, l, calls + 3, ticks)[0]}
    else:  # the paper code's rule: its own reads (test_paper_code_rule checks its staleness by rule)
        want = {(o.device, o.stage, o.step, o.kind): o.version
                for o in cdp_table(rule, n, l, steps=calls + 3, ticks=ticks).ops}
    version = [[0] * l for _ in range(n)]
    bufs = [{key: frozenset() for key in p.live} for _ in range(n)]  # the zeros of `init`
    for call in range(calls + p.max_lag):
        def valid(lag):
            return 0 <= call - lag < calls

        for tk in p.ticks:
            out = [{} for _ in range(n)]
            for w, kind, j, lag in tk.ops:
                step = call - lag
                if valid(lag):
                    assert version[w][j] == want[(w, j, step, kind)], (rule, n, l, call, w, kind, j)
                if kind == gradient:
                    mine = frozenset({(w, step)}) if valid(lag) else frozenset()
                    total = mine if (w, j) in tk.chain_start else bufs[w].pop(("partial", j, lag)) | mine
                    if any(c == (w, j, lag) for c in tk.completes):
                        bufs[w][("sum", j, lag)] = total
                    else:
                        out[w][("partial", j, lag)] = total

            def apply(after):
                for j, lag, ws, when in tk.applies:
                    if when == after and valid(lag):
                        for w in ws:
                            assert bufs[w][("sum", j, lag)] == {(i, call - lag) for i in range(n)}
                            version[w][j] += 1

            apply(False)
            for j, lag, pairs in tk.partials:
                got = {dst: out[src][("partial", j, lag)] for src, dst in pairs}
                for w in range(n):
                    bufs[w][("partial", j, lag)] = got.get(w)
            for j, lag, pairs, merge in tk.sums:
                got = {dst: bufs[src][("sum", j, lag)] for src, dst in pairs}
                for w in range(n):
                    if w in got or not merge:
                        bufs[w][("sum", j, lag)] = got.get(w)
            apply(True)
        for w in range(n):
            bufs[w] = {(kind, j, lag): bufs[w].get((kind, j, lag - 1)) for kind, j, lag in p.live}
    assert version == [[calls] * l for _ in range(n)]  # every update applied once everywhere
    return p


@pytest.mark.parametrize("rule,n,l,ticks", [
    ("cdp-v2", 4, 4, "whole"), ("cdp-v2", 8, 4, "whole"), ("cdp-v2", 2, 4, "whole"), ("cdp-v2", 4, 2, "whole"),
    ("cdp-v1", 4, 4, "whole"), ("cdp-v1", 2, 3, "whole"), ("paper-code", 2, 4, "whole"), ("cdp-v2", 1, 3, "whole"),
    ("cdp-v2", 6, 3, "whole"), ("paper-code", 8, 4, "whole"),
    ("cdp-v2", 4, 4, "split"), ("cdp-v2", 2, 4, "split"), ("cdp-v2", 3, 4, "split"), ("cdp-v2", 6, 4, "split"),
    ("cdp-v2", 8, 8, "split"), ("cdp-v1", 4, 4, "split"), ("cdp-v1", 3, 2, "split"), ("paper-code", 2, 4, "split"),
    ("paper-code", 4, 4, "split"), ("cdp-v2", 3, 4, "paired"), ("cdp-v2", 3, 6, "paired"), ("cdp-v2", 2, 4, "paired"),
    ("cdp-v1", 3, 4, "paired"), ("cdp-v2", 5, 3, "paired"), ("paper-code", 2, 4, "paired"), ("cdp-v2", 4, 4, "paired"),
    ("cdp-v1", 4, 4, "paired"), ("cdp-v2", 8, 8, "paired")])
def test_ring_program_replayed(rule, n, l, ticks):
    p = _replay(rule, n, l, ticks=ticks)
    # one partial and one sum at most, whatever N (paired ticks: two sums where one cannot meet every deadline)
    assert p.sends_per_tick().max() <= (3 if ticks == "paired" else 2)


def test_ring_program_replay_can_fail(monkeypatch):
    """A program whose sum send does not merge where a worker still holds its copy, or that
    drops a live buffer, is caught by the same replay."""
    import dataclasses
    import cdpjax.layouts.cdp as layout

    good = ring_program("cdp-v2", 4, 4)
    ticks = list(good.ticks)
    t = next(i for i, tk in enumerate(ticks) if any(merge for *_, merge in tk.sums))
    ticks[t] = dataclasses.replace(ticks[t], sums=tuple((j, lag, pairs, False) for j, lag, pairs, _ in ticks[t].sums))
    for bad in (dataclasses.replace(good, ticks=tuple(ticks)), dataclasses.replace(good, live=good.live[1:])):
        monkeypatch.setitem(globals(), "ring_program", lambda *a, bad=bad, **k: bad)
        with pytest.raises((AssertionError, KeyError, TypeError)):
            _replay("cdp-v2", 4, 4)
    del layout

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
    # what the ring reads (applies, axis, versions, messages) survives the file: the same period
    back = TimeTable.from_json(t.dumps())
    assert back == t and back.applies == t.applies and back.axis == "data" and len(back.applies) > 0
    assert ring_ticks(back) == ring_ticks(t)


# --------------------------------------------------------------- W: the split backward


def test_from_orders_lays_out_w_after_its_b():
    """One stage, two micro-batches, F0 B0 F1 W0 B1 W1 on its device: each action one tick, in
    order (nothing waits: each W's B is earlier on the same device); a stage-activation is held
    from its F until before its W (micro-batch 0: ticks 0-2, 1: ticks 2-4), where without the Ws
    it is held until before its B (ticks 0 and 2)."""
    orders = [[("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("W", 0, 0), ("B", 0, 1), ("W", 0, 1)]]
    t = from_orders("toy", orders, 1, 2)
    assert [(o.tick, o.kind, o.micro) for o in t.ops] == [(0, "F", 0), (1, "B", 0), (2, "F", 1), (3, "W", 0),
                                                            (4, "B", 1), (5, "W", 1)]
    assert t.split_backward and t.num_ticks == 6 and [u.tick for u in t.updates] == [5]
    assert t.activation_per_worker()[:, 0].tolist() == [1, 1, 2, 1, 1, 0]
    plain = from_orders("toy", [[a for a in orders[0] if a[0] != "W"]], 1, 2)
    assert not plain.split_backward and plain.activation_per_worker()[:, 0].tolist() == [1, 0, 1, 0]
    assert t.busy_fraction()["devices"] == 1.0  # an unregistered layout's cells name the stage:
    assert t.grid()[:, 0].tolist() == ["F0", "B0", "F0", "W0", "B0", "W0"]


def test_from_orders_waits_across_devices_by_each_kinds_rule():
    """Two stages on two devices: stage 0's B of a micro-batch waits for stage 1's B (the input
    cotangent), not for stage 1's W, which device 1 runs later: device 1 F0 B0 W0 at ticks 1-3,
    device 0's B0 at tick 3, right after stage 1's B0 at tick 2."""
    orders = [[("F", 0, 0), ("B", 0, 0), ("W", 0, 0)], [("F", 1, 0), ("B", 1, 0), ("W", 1, 0)]]
    t = from_orders("toy", orders, 2, 1)
    ticks = {(o.kind, o.stage): o.tick for o in t.ops}
    assert ticks == {("F", 0): 0, ("F", 1): 1, ("B", 1): 2, ("W", 1): 3, ("B", 0): 3, ("W", 0): 4}


@pytest.mark.parametrize("orders,microbatches,match", [
    ([[("F", 0, 0), ("B", 0, 0), ("W", 0, 0), ("F", 0, 1), ("B", 0, 1)]], 2, r"missing e.g. \[\('W', 0, 1\)\]"),
    ([[("F", 0, 0), ("W", 0, 0)]], 1, r"F, B, W .*missing e.g. \[\('B', 0, 0\)\]"),
    ([[("F", 0, 0)]], 1, r"F, B of .*missing e.g. \[\('B', 0, 0\)\]"),
    ([[("F", 0, 0), ("B", 0, 0), ("W", 0, 0), ("W", 0, 0)]], 1, r"twice e.g. \[\('W', 0, 0\)\]"),
    ([[("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("B", 0, 1)]], 1, r"outside stages 0..0 and micro-batches 0..0"),
    ([[("F", 0, 0), ("X", 0, 0)]], 1, "unknown op kind 'X' in the device orders; registered: F, B, W, FB"),
    ([[("F", 0, 0), ("W", 0, 0), ("B", 0, 0)]], 1, r"deadlock \(device 0's \('W', 0, 0\) waits for \('B', 0, 0\)\)"),
])
def test_from_orders_names_what_is_wrong(orders, microbatches, match):
    with pytest.raises(ConfigError, match=match):
        from_orders("toy", orders, 1, microbatches)


def test_gradient_kind_and_requirements():
    """The kinds' data: B completes the weight gradient unless a W follows; a list of Ws needs
    their Bs and the Fs those need."""
    assert (kinds.gradient_kind(False), kinds.gradient_kind(True)) == ("B", "W")
    assert kinds.completes_gradient("B", False) and not kinds.completes_gradient("B", True)
    assert kinds.completes_gradient("W", True) and kinds.completes_gradient("FB", False)
    assert kinds.requires({"W"}, 3) == {"F", "B", "W"} and kinds.requires({"FB"}, 3) == {"FB"}
    assert (kinds.cost_field("B", False), kinds.cost_field("B", True), kinds.cost_field("W", True)) == (
        "backward", "backward_input", "backward_weight")


def test_json_round_trip_with_w():
    t = table("zb-h1", stages=3, microbatches=4, steps=2)
    d = json.loads(t.dumps())
    assert sum(o["kind"] == "W" for o in d["ops"]) == 3 * 4 * 2
    assert any("W" in cell for row in d["ticks"] for cell in row)
    back = TimeTable.from_json(json.dumps(d))
    assert back == t and back.split_backward
    assert back.activation_stats() == t.activation_stats() and back.format_grid() == t.format_grid()


@pytest.mark.parametrize("lower,engine", [("ring", "the ring engine"), ("zero", "the cdp-zero engine")])
def test_the_ring_engines_refuse_what_they_cannot_serve(lower, engine):
    """The ring engines lower the table they are given, whatever its layout: a table they cannot
    run is refused in one line naming what it lacks (an op kind they have no piece for, a step
    that does not repeat the others, a read of a version the worker does not hold, a gradient op
    with no running sum to add to)."""
    import dataclasses

    from cdpjax.program.ring import lower_ring
    from cdpjax.program.zero import lower_zero

    run = {"ring": lower_ring, "zero": lower_zero}[lower]
    method = "cdp-v2" if lower == "ring" else "cdp-zero"
    own = table(method, workers=2, stages=2)
    run(own)  # CDP's own: lowered
    first = own.ops[0]  # worker 0's forward of stage 0, step 0, at tick 0
    assert (first.tick, first.device, first.stage, first.kind, first.step) == (0, 0, 0, "F", 0)
    fb = dataclasses.replace(own, ops=(dataclasses.replace(first, kind="FB"),) + own.ops[1:])
    with pytest.raises(ConfigError, match=rf"^{engine}.* 'FB'.*F, B, W\)?$"):
        run(fb)
    later = dataclasses.replace(own, ops=(dataclasses.replace(first, tick=1),) + own.ops[1:])
    with pytest.raises(ConfigError, match=rf"^{engine} runs a table that repeats every 4 ticks, and .*step"):
        run(later)
    if lower == "ring":
        stale = next(o for o in own.ops if o.step == 1 and o.stale)  # reads version 0 at step 1
        fresh = dataclasses.replace(own, ops=tuple(dataclasses.replace(o, version=1) if o == stale else o
                                                   for o in own.ops))
        with pytest.raises(ConfigError, match=rf"^{engine} cannot run this cdp-v2 table: worker {stale.device}'s "
                                              rf"F{stale.stage} of step 1 at tick {stale.tick} reads version 1, "
                                              r"and the newest version the worker stores then is 0"):
            run(fresh)
        lost = next(m for m in own.messages if m.kind == "partial")
        alone = dataclasses.replace(own, messages=tuple(m for m in own.messages if m != lost))
        with pytest.raises(ConfigError, match=rf"^{engine} cannot run this cdp-v2 table: worker {lost.dst}'s "
                                              rf"B{lost.stage} of step {lost.step} at tick \d+ adds to stage "
                                              rf"{lost.stage}'s running sum, and no 'partial' message"):
            run(alone)
    else:
        far = max((o for o in own.ops if o.step == 2 and o.kind == "F" and o.stage == 0), key=lambda o: o.tick)
        old = dataclasses.replace(own, ops=tuple(dataclasses.replace(o, version=0) if o == far else o
                                                 for o in own.ops))
        with pytest.raises(ConfigError, match=rf"^{engine} cannot run this cdp-zero table: worker {far.device}'s "
                                              r"F0 of step 2 at tick \d+ reads version 0, with 2 update\(s\)"):
            run(old)
