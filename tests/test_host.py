"""Every device of the host: a stage-axis method given no mesh fills a (stage, data) mesh, pipeline
replicas over `data`, and still computes its reference's function.

Claims: on 8 devices a 4-stage pipeline runs as {'stage': 4, 'data': 2}, each replica fed half of
every global batch and their gradients averaged, so a backprop pipeline ends where `e2e` on one
device ends (train losses and final test metrics), and `ppll` where `local` ends (PPLL = local
learning with the same modules); sizes that cannot fill the devices are refused naming a mesh
that fits.
"""
import json
import os
import re

import jax
import numpy as np
import pytest

from cdpjax import layouts, train
from cdpjax.config import default_config
from cdpjax.errors import ConfigError
from cdpjax.mesh import resolve_axes

STAGES = 4


def reference_of(name: str) -> str | None:
    """The method a stage-axis layout must equal, by what it trains: a layout whose ops carry
    auxiliary heads trains the modules locally (`local`); one that reads micro-batches is
    backprop through a pipeline (`e2e`); cdp-mp's delayed updates have no one-device twin here
    (tests/test_cdp_mp.py compares it with CDP's simulation)."""
    layout = layouts.LAYOUTS[name]
    if "module_groups" in layout.table_sizes():
        return "local"
    if layout.microbatches:
        return "e2e"
    return None


STAGE_AXIS = sorted(n for n, lay in layouts.LAYOUTS.items() if lay.device_axis == "stage")
# One method of each kind in CI (backprop pipelines: gpipe and 1f1b, local learning: ppll); the
# other backprop pipelines share their engine and run with `make test-heavy`.
IN_CI = ("gpipe", "1f1b", "ppll")
CASES = [pytest.param(n, marks=() if n in IN_CI else pytest.mark.heavy) for n in STAGE_AXIS if reference_of(n)]


def _config(method: str):
    c = default_config()
    c.method, c.model, c.stages = method, "mlp", STAGES
    c.global_batch_size, c.num_steps, c.log_every = 64, 6, 2
    c.eval_every = c.checkpoint_every = 0
    c.microbatches, c.schedule = STAGES, "constant"  # dualpipev needs a micro-batch per stage
    return c


def _lines(workdir, split):
    return [r for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines()) if r["split"] == split]


@pytest.fixture(scope="module")
def reference_runs(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            work = tmp_path_factory.mktemp(name)
            cache[name] = (train.train(_config(name), str(work), progress=False), work)
        return cache[name]

    return get


@pytest.mark.parametrize("name", CASES)
def test_stage_axis_method_fills_the_host_and_equals_its_reference(name, reference_runs, tmp_path, capsys):
    assert jax.device_count() == 8
    summary = train.train(_config(name), str(tmp_path), progress=False)  # no mesh, no devices: the host's
    stage = layouts.LAYOUTS[name].default_mesh(_config(name))["stage"]
    assert summary["mesh"] == {"stage": stage, "data": 8 // stage} and summary["devices"] == 8
    line = [x for x in capsys.readouterr().err.splitlines() if "training " in x][0]
    assert f"{8 // stage} pipeline replicas of {stage} stage devices, each fed {64 * stage // 8} of the 64" in line
    ref_name = reference_of(name)
    ref, ref_work = reference_runs(ref_name)
    for key in ("test_loss", "test_accuracy"):
        np.testing.assert_allclose(summary[key], ref[key], rtol=2e-5, atol=1e-6)
    if ref_name == "e2e":  # ppll's train losses are local's delayed by the pipeline: its end is compared
        ours, theirs = _lines(tmp_path, "train"), _lines(ref_work, "train")
        assert [r["step"] for r in ours] == [r["step"] for r in theirs] == [2, 4, 6]
        np.testing.assert_allclose([r["loss"] for r in ours], [r["loss"] for r in theirs], rtol=2e-5)
    assert summary["test_loss"] < _first_loss(ref_work)  # it trained


def _first_loss(work):
    return _lines(work, "train")[0]["loss"]


@pytest.mark.parametrize("mesh,devices,match", [
    ({"stage": 3, "data": -1}, 8, r"8 devices cannot be split by 3; the mesh \{'stage': 3, 'data': 2\} fits 6 of "
                                  r"them \(run with --cpu-devices 6"),
    ({"stage": 4}, 8, r"covers 4 of the 8 devices; .*--config.mesh.data=2 fills them \(the mesh \{'stage': 4, "
                      r"'data': 2\}"),
    ({"stage": 3}, 8, r"covers 3 of the 8 devices; .*use -1 for one axis, or run with --cpu-devices 3"),
])
def test_a_mesh_that_cannot_fill_the_devices_names_one_that_fits(mesh, devices, match):
    with pytest.raises(ConfigError, match=match):
        resolve_axes(mesh, devices)


# Compiles cached and announced ------------------------------------------------------------------

def test_the_compilation_cache_directory_follows_its_rule():
    """The rule of cdpjax.compilation, case by case: off > JAX's own > flag > environment > default."""
    from cdpjax.compilation import choose

    env = {"XDG_CACHE_HOME": "/c", "CDPJAX_COMPILATION_CACHE": "/e"}
    assert choose(None, True, "/j", env) == (None, "off")
    assert choose("/f", False, "/j", env) == ("/j", "JAX")
    assert choose("/f", False, None, env) == ("/f", "flag")
    assert choose(None, False, None, env) == ("/e", "environment")
    assert choose(None, False, None, {**env, "CDPJAX_COMPILATION_CACHE": "OFF"}) == (None, "off")
    assert choose(None, False, None, {"XDG_CACHE_HOME": "/c"}) == ("/c/cdpjax/xla", "default")
    assert choose(None, False, None, {"HOME": "/h"})[0].endswith("/.cache/cdpjax/xla")


def _train_cli(workdir, *flags):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    proc = subprocess.run([sys.executable, "-m", "cdpjax.cli", "train", "--config.method=dp", "--config.num_steps=2",
                           "--config.eval_every=0", "--config.checkpoint_every=0", "--cpu-devices", "2",
                           "--workdir", str(workdir), "--no-progress", *flags],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr.splitlines()


def test_a_second_identical_run_reads_its_programs_from_the_compilation_cache(tmp_path):
    """The first run compiles the step and writes it to the cache it names; the second, another
    work directory with the same config, compiles nothing and reads it back. With the flag off:
    no cache, said so."""
    cache = tmp_path / "xla"
    first = _train_cli(tmp_path / "a", "--compilation-cache", str(cache))
    second = _train_cli(tmp_path / "b", "--compilation-cache", str(cache))
    for lines in (first, second):
        assert [x for x in lines if x.startswith("cdpjax: training ")][0].endswith(f"; compilation cache {cache})")
        assert lines.index("cdpjax: compiling dp ...") + 1 == lines.index(_compiled(lines))
    assert "(1 program compiled)" in _compiled(first)
    assert "(0 programs compiled, 1 read from the compilation cache)" in _compiled(second)
    off = _train_cli(tmp_path / "c", "--compilation-cache", str(cache), "--no-compilation-cache")
    assert [x for x in off if x.startswith("cdpjax: training ")][0].endswith("; compilation cache off)")
    assert "(1 program compiled)" in _compiled(off)


def _bench_cli(cache, *flags):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "cdpjax.cli", "bench", "--methods", "dp", "--repeats", "1",
                           "--cpu-devices", "2", "--compilation-cache", str(cache), *flags],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": root}, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return [x for x in proc.stderr.splitlines() if x.startswith("cdpjax bench: compil")]


def test_bench_announces_each_compile_and_says_where_its_program_came_from(tmp_path):
    """`bench` (tiny digits, 1 repeat): 'compiling dp ...' then 'compiled dp in X s (...)', the step
    being the one program compiled in between; run again on the same cache, it is read back."""
    first, second = _bench_cli(tmp_path / "xla"), _bench_cli(tmp_path / "xla")
    pattern = r"cdpjax bench: compiled dp in \d+\.\d s \({}\)"
    for lines, programs in ((first, "1 program compiled"),
                            (second, "0 programs compiled, 1 read from the compilation cache")):
        assert len(lines) == 2 and lines[0] == "cdpjax bench: compiling dp ...", lines
        assert re.fullmatch(pattern.format(re.escape(programs)), lines[1]), lines


def _compiled(lines):
    return [x for x in lines if x.startswith("cdpjax: compiled dp and ran its first step in ")][0]


# The input pipeline ------------------------------------------------------------------------------

def test_metrics_come_to_the_host_only_at_log_evaluation_and_checkpoint_steps(tmp_path, monkeypatch):
    """A dp run of 10 steps, logging every 3, evaluating every 4 and checkpointing every 5: the loop
    brings metrics to the host (`loop._to_host`, its one transfer) at the first step (which
    compiles), at each multiple of 3, 4 or 5 and at the last step, each time with every step since
    the one before, in order; summary.json's input wait is a fraction of the timed steps."""
    from cdpjax import loop

    brought = []

    def to_host(pending):
        brought.append([step for step, _, _ in pending])
        return jax.device_get(pending)

    monkeypatch.setattr(loop, "_to_host", to_host)
    c = default_config()
    c.method, c.model, c.global_batch_size, c.num_steps = "dp", "mlp", 64, 10
    c.log_every, c.eval_every, c.checkpoint_every = 3, 4, 5
    summary = train.train(c, str(tmp_path), progress=False, devices=jax.devices()[:2])
    # syncs by the rule: {1} + multiples of 3, 4 or 5 up to 10 + {10} = 1, 3, 4, 5, 6, 8, 9, 10
    assert brought == [[1], [2, 3], [4], [5], [6], [7, 8], [9], [10]]
    wait = json.loads((tmp_path / "summary.json").read_text())["input_wait_fraction"]
    assert wait == summary["input_wait_fraction"] and 0.0 <= wait <= 1.0


def test_the_loop_runs_at_most_two_steps_ahead_of_the_host(tmp_path, monkeypatch):
    """Between sync steps (here only the first and the last of 12), the host waits for step s - 2
    once step s is dispatched, so no more than two steps are ever queued past the newest one
    waited for: the rule written out here against the order of dispatches and waits."""
    from cdpjax import guard, loop

    events, metrics_step = [], {}
    real_step, real_wait, real_to_host = guard.guarded_step, jax.block_until_ready, loop._to_host

    def guarded_step(method, skip):
        step_fn = real_step(method, skip)

        def counted(state, batch):
            state, metrics, flags = step_fn(state, batch)
            metrics_step[id(metrics)] = len(metrics_step) + 1
            events.append(("dispatch", len(metrics_step)))
            return state, metrics, flags
        return counted

    def wait(x):
        if isinstance(x, tuple) and id(x[0]) in metrics_step:
            events.append(("wait", metrics_step[id(x[0])]))
        return real_wait(x)

    def to_host(pending):
        events.extend(("wait", step) for step, _, _ in pending)
        return real_to_host(pending)

    monkeypatch.setattr(guard, "guarded_step", guarded_step)
    monkeypatch.setattr(jax, "block_until_ready", wait)
    monkeypatch.setattr(loop, "_to_host", to_host)
    c = default_config()
    c.method, c.model, c.global_batch_size, c.num_steps = "dp", "mlp", 64, 12
    c.log_every, c.eval_every, c.checkpoint_every = 12, 0, 0
    train.train(c, str(tmp_path), progress=False, devices=jax.devices()[:2])
    waited = set()
    for kind, step in events:
        if kind == "wait":
            waited.add(step)
        else:  # dispatched `step`: every step up to step - 3 already waited for
            assert set(range(1, step - 2)) <= waited, (step, sorted(waited))
    assert waited == set(range(1, 13))
    assert [s for k, s in events if k == "wait"][:3] == [1, 1, 2]  # the first step, then s - 2 once s = 4


def test_prefetch_prepares_batches_in_order_off_the_training_thread_and_at_most_depth_ahead():
    import threading
    import time

    from cdpjax.data.prefetch import Prefetch

    made, threads = [], set()

    def make(step):
        made.append(step)
        threads.add(threading.current_thread().name)
        return {"step": step}

    feed = Prefetch(make, lambda b: {**b, "put": True}, range(3, 40), depth=2)
    try:
        for step in range(3, 20):
            assert feed.get(step) == {"step": step, "put": True}
            time.sleep(0.002)
            # taken up to `step`; 2 waiting in the queue; 1 made and waiting for room
            assert len(made) <= (step - 3 + 1) + 2 + 1, (step, made)
    finally:
        feed.close()
    assert made == list(range(3, 3 + len(made))) and threading.current_thread().name not in threads
    assert len(made) < 37  # closed early: the rest never read


def test_prefetch_raises_a_read_error_at_its_step_and_without_prefetch_reads_in_get():
    from cdpjax.data.prefetch import Prefetch

    def make(step):
        if step == 2:
            raise OSError("disk gone")
        return step

    feed = Prefetch(make, lambda b: b, range(0, 5), depth=2)
    try:
        assert [feed.get(0), feed.get(1)] == [0, 1]
        with pytest.raises(OSError, match="disk gone"):
            feed.get(2)
    finally:
        feed.close()
    calls = []
    sync = Prefetch(lambda s: calls.append(s) or s, lambda b: b, range(0, 5), depth=0)
    assert calls == [] and sync.get(0) == 0 and calls == [0]
    sync.close()


# Predictions that say what they assume ------------------------------------------------------------

def test_a_prediction_states_the_op_times_it_replayed_and_where_they_came_from():
    from cdpjax.speedup import format_predictions

    prediction = {"method": "zb-h1", "model": "lockstep", "step_seconds": 0.01, "devices": 2, "speedup": 1.5,
                  "imbalance": 1.1, "calibrate": "together", "micro_batch": 16, "repeats": 5,
                  "stage_forward": (0.001, 0.002), "stage_backward": (0.003, 0.004),
                  "stage_backward_input": (0.0015, 0.0025), "stage_backward_weight": (0.0015, 0.0015),
                  "split_backward": True, "heads_timed": False, "stage_head": (), "backward_from": "carry"}
    text = format_predictions([{"method": "zb-h1", "step_seconds": 0.02, "prediction": prediction}])
    line = text.splitlines()[-1].strip()
    assert line == ("op times used (ms per micro-batch of 16, per stage; measured here by "
                    "cdpjax.speedup.measure_stage_costs, median of 5 runs on 2 devices at once, backwards from "
                    "kept residuals): F [1, 2]; B [3, 4]; B input [1.5, 2.5]; W [1.5, 1.5]")
    assert "0.50x the measured step" in text.splitlines()[1]


@pytest.mark.parametrize("predicted,says_why", [(0.02, False), (0.024, False), (0.017, False), (0.026, True),
                                                (0.015, True), (0.18, True)])
def test_a_prediction_off_the_measured_step_by_more_than_25_percent_says_why(predicted, says_why):
    """Measured step 20 ms: a prediction within 25% either way (16 ms to 25 ms, 20/1.25 and 20*1.25)
    is printed as it is; one outside it gains one line saying what the model assumes that the
    measured step does not (lockstep ticks, ops timed alone, transfers as bytes / bandwidth)."""
    from cdpjax.speedup import format_predictions

    prediction = {"method": "dp", "model": "lockstep", "step_seconds": predicted, "devices": 2, "speedup": 2.0,
                  "imbalance": 1.1, "calibrate": "alone", "micro_batch": 64, "repeats": 5,
                  "stage_forward": (0.001,), "stage_backward": (0.002,), "split_backward": False,
                  "heads_timed": False, "stage_head": (), "backward_from": "recompute"}
    lines = format_predictions([{"method": "dp", "step_seconds": 0.02, "prediction": prediction}]).splitlines()
    why = [line.strip() for line in lines if line.strip().startswith("why ")]
    assert len(lines) == 3 + says_why and len(why) == says_why, lines
    if says_why:
        assert why[0].startswith(f"why {predicted / 0.02:.2f}x, not within 25%: ") and "lockstep ticks" in why[0]
        assert "timed alone" in why[0] and "bandwidth" in why[0], why[0]


# The measurements' scripts, in seconds (their figures are in docs/measured.md) ----------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_prefetch_figure_runs_and_says_its_ratio_and_input_waits(monkeypatch, capsys):
    from cdpjax import data
    from cdpjax.data import prefetch
    from helpers import load_script

    monkeypatch.setattr(data.REGISTRY, "_entries", dict(data.REGISTRY._entries))  # its dataset, for this test only
    monkeypatch.setattr(prefetch, "DEPTH", prefetch.DEPTH)  # it sets the depth of each run
    load_script(f"{ROOT}/experiments/prefetch_figure.py", "prefetch_figure").main(["--repeats", "1", "--steps", "3"])
    line = capsys.readouterr().out.strip()
    found = re.fullmatch(r"prefetch 2 / none: images/s (\d+\.\d\d)x; input wait (\d+\.\d)% of the step with "
                         r"prefetch, (\d+\.\d)% without \(medians of 1 runs each\)", line)
    assert found, line
    assert float(found[1]) > 0 and all(0 <= float(x) <= 100 for x in found.groups()[1:])


def test_the_compile_cache_figure_runs_a_cold_and_a_warm_command(monkeypatch, capsys):
    from helpers import load_script

    monkeypatch.setenv("PYTHONPATH", ROOT)  # its commands import this checkout
    load_script(f"{ROOT}/experiments/compile_cache.py", "compile_cache").main(
        ["--methods", "dp", "--repeats", "1", "--steps", "2"])
    line = capsys.readouterr().out.strip()
    found = re.fullmatch(r"dp: first step cold/warm (\d+\.\d\d)x, whole command cold/warm (\d+\.\d\d)x "
                         r"\(medians of 1 pairs\)", line)
    assert found and float(found[1]) > 0 and float(found[2]) > 0, line
