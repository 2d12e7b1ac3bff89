"""Delay models as tables (cdp-random): the uniform model's staleness is CDP-v1's / v2's, written
out here; each read model's realised histogram matches its distribution (chi-square, or an exact
count); the event simulation reduces to cdp-v2 with unit durations and keeps its bound; every
model's table goes to JSON and back."""
import numpy as np
import pytest
from scipy import stats

from cdpjax import staleness
from cdpjax.errors import ConfigError
from cdpjax.layouts import LAYOUTS
from cdpjax.layouts.delays import Delay, delay_table
from cdpjax.timetable import TimeTable


def table(workers=4, stages=4, steps=12, **delay):
    return LAYOUTS["cdp-random"].make_table(workers=workers, stages=stages, steps=steps, delay=delay)


def v2_matrix(workers, stages):
    """cdp-v2's stale pairs, derived by hand from the ticks (whole backwards, T = 2L, worker i
    starting at T i / N): worker i's forward of stage j at step k is at tick T k + T i / N + j;
    stage j's update of step k-1 is complete at the end of the last worker's backward of it,
    tick T (k-1) + T (N-1) / N + 2L-1-j. Stale iff the forward comes at or before that tick:
    T i / N + j <= T (N-1) / N - 1 - j, i.e. 2j + 1 <= T (N-1-i) / N."""
    T = 2 * stages
    return np.array([[2 * j + 1 <= T * (workers - 1 - i) // workers for j in range(stages)]
                     for i in range(workers)], int)


def test_v2_matrix_as_written_in_the_cdp_tests():
    # N = L = 4: stale iff j < 3 - i; N = 8, L = 4: iff i + 2j < 7 (tests/test_cdp.py)
    np.testing.assert_array_equal(v2_matrix(4, 4), [[j < 3 - i for j in range(4)] for i in range(4)])
    np.testing.assert_array_equal(v2_matrix(8, 4), [[i + 2 * j < 7 for j in range(4)] for i in range(8)])


@pytest.mark.parametrize("workers,stages", [(4, 4), (8, 4), (2, 4), (4, 2)])
def test_uniform_model_has_cdp_staleness(workers, stages):
    """The uniform model is CDP's table: cdp-v1 reads one update behind everywhere (from step 1;
    step 0 reads theta_0), cdp-v2 one behind on the pairs of the timing, fresh elsewhere."""
    v1 = staleness.per_read(table(workers, stages, model="uniform", rule="cdp-v1"))
    np.testing.assert_array_equal(v1[0], 0)
    np.testing.assert_array_equal(v1[1:], np.ones((11, workers, stages), int))
    v2 = staleness.per_read(table(workers, stages, model="uniform", rule="cdp-v2"))
    np.testing.assert_array_equal(v2[1:], np.broadcast_to(v2_matrix(workers, stages), (11, workers, stages)))
    hist = staleness.histogram(table(workers, stages, model="uniform", rule="cdp-v2"), first_step=1)
    np.testing.assert_array_equal(hist[..., 1], 11 * v2_matrix(workers, stages))


@pytest.mark.parametrize("model,params,pmf", [
    ("uniform-tau", dict(tau_max=3), np.full(4, 0.25)),
    # P(t) proportional to p (1-p)^t on 0..4, p = 0.4, written out: 0.4, 0.24, 0.144, 0.0864, 0.05184
    ("geometric", dict(p=0.4, tau_max=4), np.array([0.4, 0.24, 0.144, 0.0864, 0.05184]) / 0.92224),
])
@pytest.mark.parametrize("seed", [0, 1])
def test_read_model_histogram_matches_its_distribution(model, params, pmf, seed):
    """Over 200 steps x 16 pairs (from step tau_max on, where no read is clipped at theta_0), the
    realised histogram passes a chi-square test against the distribution; and reproducibly."""
    t = table(4, 4, steps=200, model=model, seed=seed, **params)
    first = len(pmf) - 1
    counts = staleness.pooled(t, first_step=first)
    assert len(counts) == len(pmf) and counts.sum() == (200 - first) * 16
    assert stats.chisquare(counts, pmf * counts.sum()).pvalue > 1e-3
    assert t == table(4, 4, steps=200, model=model, seed=seed, **params)
    assert t != table(4, 4, steps=200, model=model, seed=seed + 2, **params)
    # a wrong distribution fails the same test: the test can fail
    wrong = pmf * np.linspace(0.7, 1.3, len(pmf))
    wrong /= wrong.sum()
    assert stats.chisquare(counts, wrong * counts.sum()).pvalue < 1e-3


def test_per_stage_and_bounds_exact():
    """per-stage: every read of stage j exactly tau_j behind (from step max tau); tau_max = 0 and
    per-stage zeros: dp (every read fresh); per-stage ones: cdp-v1."""
    t = table(3, 3, steps=20, model="per-stage", taus=(2, 0, 1))
    h = staleness.histogram(t, first_step=2)
    for j, tau in enumerate((2, 0, 1)):
        np.testing.assert_array_equal(h[:, j, tau], 18)
        assert h[:, j].sum() == 18 * 3
    np.testing.assert_array_equal(t.stale, [[True, False, True]] * 3)
    for zero in (dict(model="uniform-tau", tau_max=0), dict(model="geometric", tau_max=0),
                 dict(model="per-stage", taus=(0, 0, 0))):
        assert not staleness.per_read(table(3, 3, **zero)).any()
    ones = staleness.per_read(table(3, 3, model="per-stage", taus=(1, 1, 1)))
    np.testing.assert_array_equal(ones, staleness.per_read(table(3, 3, model="uniform", rule="cdp-v1")))


@pytest.mark.parametrize("delay", [dict(model="async", durations=1, tau_max=2),
                                   dict(model="straggler", slowdown=1, tau_max=3),
                                   dict(model="jitter", jitter=0)])
def test_timed_models_reduce_to_cdp_v2(delay):
    """Unit durations (async), no slowdown (straggler), no jitter: cdp-v2's staleness."""
    s = staleness.per_read(table(4, 4, **delay))
    np.testing.assert_array_equal(s[1:], np.broadcast_to(v2_matrix(4, 4), s[1:].shape))


@pytest.mark.parametrize("tau_max", [1, 2, 4])
def test_async_keeps_its_bound_and_its_time(tau_max):
    """The event simulation: no read more than tau_max behind; ticks and dp's ticks from the same
    durations; a straggler makes the fast workers read older versions than it does."""
    t = table(4, 4, steps=30, model="async", durations=4, tau_max=tau_max, seed=3)
    s = staleness.per_read(t)
    assert s.min() >= 0 and s.max() <= tau_max
    assert t.meta["time"]["ticks"] > 0 and t.meta["time"]["dp_ticks"] >= 30 * 8
    slow = staleness.mean(table(4, 4, steps=30, model="straggler", worker=1, slowdown=3, tau_max=tau_max), 5)
    assert slow[1].mean() < np.delete(slow, 1, axis=0).mean()


@pytest.mark.parametrize("worker, ticks", [(0, 18), (1, 19)])
def test_straggler_time_by_hand(worker, ticks):
    """N = 2, L = 1 (ops F, B), 3 steps, the straggler's ops 3 ticks, the other's 1, bound 1 (cdp-v2's
    offsets 0 and 1). dp: every step waits for the straggler's F + B = 6 ticks: 3 x 6 = 18. CDP, worked
    out op by op: the straggler runs its six ops back to back, never waiting (the versions it needs
    are its own last updates), 3 x 6 = 18 ticks from its offset; the fast worker runs ahead to the
    bound (its step-2 forward waits for update 0, complete at the straggler's first backward's end)
    and finishes first. So the table ends at the straggler's offset + 18: 18 as worker 0 (dp's
    ticks exactly, ratio 1: both are paced by the straggler's own work), 19 as worker 1 (CDP's
    start-up offset). The fast worker's reads are older than the straggler's."""
    t = table(2, 1, steps=3, model="straggler", worker=worker, slowdown=3, tau_max=1)
    assert t.meta["time"] == {"ticks": ticks, "dp_ticks": 18}
    if worker == 0:
        starts = sorted((o.tick, o.device, o.kind, o.step) for o in t.ops if o.device == 0)
        assert [s[0] for s in starts] == [0, 3, 6, 9, 12, 15]
        fast = {(o.step, o.kind): (o.tick, o.version) for o in t.ops if o.device == 1}
        assert fast[(2, "F")] == (6, 1)  # waited for update 0 (complete at tick 5), reads version 1 of 2
        assert staleness.per_read(t)[2].tolist() == [[0], [1]]


@pytest.mark.parametrize("delay", [dict(model="uniform", rule="cdp-v1"), dict(model="jitter", jitter=2),
                                   dict(model="uniform-tau", tau_max=3), dict(model="geometric", p=0.3),
                                   dict(model="per-stage", taus=(1, 2, 0, 3)), dict(model="async", durations=3),
                                   dict(model="straggler", worker=2, slowdown=4)])
def test_json_round_trip(delay):
    t = table(4, 4, steps=8, **delay)
    assert TimeTable.from_json(t.dumps()) == t
    assert t.meta["delay"]["model"] == delay["model"]


def test_bad_delays_fail_early():
    with pytest.raises(ConfigError, match="delay.model='poisson' is not one of"):
        Delay.of({"model": "poisson"})
    with pytest.raises(ConfigError, match="delay has no tau; it takes model"):
        Delay.of("model=geometric,tau=2")
    with pytest.raises(ConfigError, match=r"delay.taus=\[1, 2\] has 2 entries; give one per stage \(4\)"):
        delay_table(4, 4, 4, "model=per-stage,taus=1:2")
    with pytest.raises(ConfigError, match="delay.worker=5 is not a worker"):
        delay_table(4, 4, 4, dict(model="straggler", worker=5))
    assert Delay.of("model=geometric,p=0.25,tau_max=3,taus=1:2") == Delay("geometric", p=0.25, tau_max=3, taus=(1, 2))


def test_schedule_prints_and_draws_the_staleness(capsys, tmp_path):
    """`cdpjax schedule --method cdp-random --delay ... --staleness` prints the per-read histogram
    (its counts those of the table laid out with the same sizes) and draws it with --out."""
    from cdpjax.commands import schedule

    argv = ["--method", "cdp-random", "--workers", "4", "--stages", "2", "--steps", "40", "--delay",
            "model=per-stage,taus=3:1", "--staleness"]
    assert schedule.main(argv) == 0
    out = capsys.readouterr().out
    # by hand: a read at step k is min(tau, k) behind (theta_0 before step 0). Stage 0 (tau 3): 0, 1, 2 behind at
    # steps 0, 1, 2, then 3 behind at 37 steps; stage 1 (tau 1): 0 at step 0, then 1 at 39 steps; 4 workers each.
    ones = 4 * (1 + 39)
    assert f"tau=0: {4 * 2}" in out and f"tau=1: {ones}" in out and f"tau=3: {4 * 37}" in out
    assert "w3          3.00" not in out and "mean per worker" in out
    path = tmp_path / "s.png"
    assert schedule.main(argv + ["--out", str(path)]) == 0 and path.stat().st_size > 1000
    assert schedule.main(["--method", "cdp-v2", "--delay", "model=async"]) == 2
    assert "takes no delay" in capsys.readouterr().err


def test_a_resumed_run_keeps_its_delay_model(tmp_path):
    """The delay model fixes the table, so the train state and its versions: a run resumed with
    another delay is refused in one line naming it, as a changed update rule is."""
    import json

    from cdpjax.config import default_config
    from cdpjax.rundir import check_resume_config

    before = default_config()
    before.method = "cdp-random"
    before.delay.tau_max = 2
    (tmp_path / "config.json").write_text(json.dumps(json.loads(before.to_json_best_effort())))
    check_resume_config(str(tmp_path), before)  # the same run resumes
    after = default_config()
    after.method = "cdp-random"
    after.delay.tau_max = 4
    with pytest.raises(ConfigError, match="delay="):
        check_resume_config(str(tmp_path), after)
