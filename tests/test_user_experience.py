"""What a researcher meets at the command line: one line for each bad path, the set-up before the
"training" line, a progress bar whose ETA leaves compilation out, curves (metrics.jsonl's `lr`,
`images_per_second`, `time`; TensorBoard events; `cdpjax plot`) and profiler traces.

The interrupt, resume and simulated-devices lines of a real `cdpjax train` session, and the
finished run that changes no file, are in test_reliability.py (they share its reference runs).
"""
import json
import math
import re
import time
import warnings

import numpy as np
import pytest

from cdpjax import guard, train
from cdpjax.cli import main
from cdpjax.commands import plot as plot_cmd
from cdpjax.config import default_config
from metrics_lines import events_of, expected_events

STEPS = 12


def small_config(**overrides):
    c = default_config()
    c.method, c.num_steps, c.global_batch_size = "dp", STEPS, 128
    c.log_every, c.eval_every, c.checkpoint_every = 3, 4, 0
    for k, v in overrides.items():
        c[k] = v
    return c


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """One short dp run on digits (cosine schedule from 0.05 over 12 steps), with a profile of
    steps 2 to 3; what it printed on stderr."""
    import contextlib
    import io

    work = tmp_path_factory.mktemp("digits") / "run"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        summary = train.train(small_config(profile_steps=[2, 3]), str(work), progress=False)
    return work, summary, err.getvalue()


# Item 2: curves and traces ---------------------------------------------------------------------

def test_metrics_lines_carry_lr_throughput_and_time(digits_run):
    """Train lines: `lr` is the cosine schedule's value for the step's update (update k = step k+1:
    0.05 * (1 + cos(pi * k / 12)) / 2, written out here), `images_per_second` a positive rate;
    every line's `time` grows with the file."""
    work, _, _ = digits_run
    records = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    train_lines = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in train_lines] == [3, 6, 9, 12]
    for r in train_lines:
        k = r["step"] - 1
        assert r["lr"] == pytest.approx(0.05 * (1 + math.cos(math.pi * k / STEPS)) / 2, rel=1e-6, abs=1e-7)  # float32
        assert r["images_per_second"] > 0
        assert list(r) == ["step", "split", "loss", "accuracy", "lr", "images_per_second", "time"]
    tests = [r for r in records if r["split"] == "test"]
    assert [r["step"] for r in tests] == [4, 8, 12] and all(list(r) == ["step", "split", "loss", "accuracy", "time"]
                                                             for r in tests)
    times = [r["time"] for r in records]
    assert times == sorted(times) and times[0] > 0


def test_tensorboard_events_equal_the_metrics(digits_run):
    """The events in WORKDIR, read with TensorBoard's own reader, hold every metrics.jsonl value at
    its step (as float32), and nothing else."""
    work, _, _ = digits_run
    events = events_of(work)
    assert set(events) == {"train/loss", "train/accuracy", "train/lr", "train/images_per_second", "test/loss",
                           "test/accuracy"}
    assert events == expected_events((work / "metrics.jsonl").read_text())


def test_profile_trace_of_the_asked_steps(digits_run):
    work, _, err = digits_run
    (run_dir,) = (work / "plugins" / "profile").iterdir()
    assert list(run_dir.glob("*.xplane.pb")) and (run_dir / "perfetto_trace.json.gz").stat().st_size > 0
    lines = [line for line in err.splitlines() if "profile of steps" in line]
    assert lines == [f"cdpjax: profile of steps 2-3 in {run_dir} (TensorBoard: tensorboard --logdir {work}, "
                     f"Profile tab; Perfetto: open perfetto_trace.json.gz there at ui.perfetto.dev)"]


def test_plot_overlays_the_runs_curves(digits_run, tmp_path, capsys, monkeypatch):
    """`cdpjax plot` of the digits run and a hand-written one: four panels (train loss, test loss,
    train accuracy, test accuracy), each with one line per run whose points are the metrics'."""
    from PIL import Image

    work, _, _ = digits_run
    other = tmp_path / "other"
    other.mkdir()
    hand = [{"step": 5, "split": "train", "loss": 2.0, "accuracy": 0.25}, {"step": 5, "split": "test", "loss": 1.5,
            "accuracy": 0.5}, {"step": 10, "split": "train", "loss": 1.0, "accuracy": 0.75},
            {"step": 10, "split": "test", "loss": 0.5, "accuracy": 0.875}]
    (other / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in hand))
    out = tmp_path / "curves.png"
    drawn_figures, draw = [], plot_cmd.plot_curves
    monkeypatch.setattr(plot_cmd, "plot_curves", lambda *a: drawn_figures.append(draw(*a)) or drawn_figures[-1])
    assert main(["plot", str(work), str(other), "--out", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().err
    mine = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    (fig,) = drawn_figures  # the figure the command wrote to curves.png
    panels = [("train", "loss"), ("test", "loss"), ("train", "accuracy"), ("test", "accuracy")]
    for ax, (split, key) in zip(fig.axes, panels):
        assert ax.get_ylabel() == f"{split} {key}"
        drawn = [line.get_xydata().tolist() for line in ax.get_lines()]
        want = [[[r["step"], r[key]] for r in records if r["split"] == split] for records in (mine, hand)]
        assert drawn == want
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["run (dp)", "other"]
    image = Image.open(out)
    assert image.format == "PNG" and 900 < image.size[0] < 1500 and 600 < image.size[1] < 1000
    rgb = np.asarray(image.convert("RGB")).reshape(-1, 3).astype(np.int64)
    assert len(np.unique(rgb @ np.array([1 << 16, 1 << 8, 1]))) > 10  # lines and text, not a blank page


def test_plot_of_a_directory_without_metrics(tmp_path, capsys):
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "c.png")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "holds no metrics.jsonl" in err


@pytest.mark.parametrize("lines", [
    [{"step": 1, "split": "train", "loss": 709.7, "perplexity": 1.6e308}],  # a diverged run's exp(loss)
    [{"step": 1, "split": "train", "loss": 1e308}, {"step": 2, "split": "train", "loss": -1e308}],
    [],  # a run that has not logged yet
    [{"step": 4, "split": "test", "loss": 1.0}],  # no train line: nothing in the first panel
], ids=["perplexity-1.6e308", "loss-1e308", "empty", "test-only"])
def test_plot_of_values_it_cannot_draw_is_one_line(lines, tmp_path, capsys):
    """Values near the float64 maximum (matplotlib's axes overflow on them) are left out; a figure
    with no line in its first panel (or none at all) is drawn without matplotlib's legend warning:
    exit 0, the one line saying what was written."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = tmp_path / "curves.png"
    with warnings.catch_warnings(record=True) as caught:  # what a user's terminal would show
        warnings.simplefilter("always")
        assert main(["plot", str(tmp_path / "run"), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"cdpjax: wrote {out} (1 run)"], err
    assert not caught, [str(w.message) for w in caught]
    assert out.stat().st_size > 0


# Item 1: bad paths, set-up before the training line ----------------------------------------------

def test_workdir_that_is_a_file(tmp_path, capsys, compiles):
    (tmp_path / "w").write_text("a file")
    code = main(["train", "--no-progress", "--workdir", str(tmp_path / "w"), "--config.method=dp"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines() == [f"cdpjax: error: --workdir {tmp_path / 'w'} is a file, not a directory: "
                                        f"give a directory (it is created if missing), or move the file away"]
    assert not compiles


def test_a_method_refusing_its_mesh_names_the_mesh(tmp_path, capsys, compiles):
    """CDP's builder sees workers=8 for 3 stages with split backwards; the user chose (or got) the
    mesh {'data': 8}: the one line names the mesh and what to change, before the training line and
    before compiling, and the work directory it would have created is not left behind."""
    code = main(["train", "--no-progress", "--workdir", str(tmp_path / "new" / "run"), "--config.method=cdp-v2",
                 "--config.stages=3", "--config.cdp_ticks=split"])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    # Split ticks: a micro-batch is 3 x 3 = 9 ticks, and worker i starts 9i/N ticks in; no ring of
    # 2 or more workers divides both the 9 ticks and the 8 devices (whole ticks: 4 rings of 2).
    assert lines[0].startswith("cdpjax: error: cdp-v2 on the mesh {'data': 8} (8 devices): workers=8 does not "
                               "divide the 9 ticks of a step")
    assert "choose workers in [1, 3, 9]" in lines[0]
    assert "no ring of 2 or more workers the table takes divides mesh.data=8" in lines[0]
    assert "change --config.mesh.data or set --config.workers" in lines[0]
    assert not [c for c in compiles if c[0] == "backend"]
    assert not (tmp_path / "new").exists()


def test_train_help_names_the_config_overrides(capsys):
    with pytest.raises(SystemExit) as done:
        main(["train", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "--config.KEY=VALUE" in out and "FILE:ARG" in out and "--force" in out


@pytest.mark.parametrize("command", ["bench", "describe", "plan"])
def test_bench_and_describe_help_say_what_they_do_and_take_overrides(command, capsys):
    """Each command's --help has a description, and the commands that read a config say that any
    key is overridden with --config.KEY=VALUE, as `train --help` does."""
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    usage, _, rest = out.partition("\n\n")
    assert "--config.KEY=VALUE" in usage and "--config.KEY=VALUE" in rest.split("options:")[-1]
    description = rest.split("options:")[0].strip()
    assert len(description.split()) >= 10, out  # a sentence or more, not just the usage


def test_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    first = out.split("\n\n")[1]  # the description under the usage
    for command in ("train", "schedule", "bench", "plot", "describe", "plan"):
        assert command in first and f"    {command}" in out, out


# Item 3: the progress bar ----------------------------------------------------------------------

def test_first_eta_leaves_compilation_out(tmp_path, capsys, monkeypatch):
    """A first step that takes 4 s (as compiling does) and fast steps after it: no state of the
    bar shows 3 s or more elapsed, nor an ETA of 3 s or more."""
    real = guard.guarded_step

    def slow_first(method, skip):
        step, calls = real(method, skip), []

        def wrapped(state, batch):
            if not calls:
                calls.append(time.sleep(4.0))
            return step(state, batch)

        return wrapped

    monkeypatch.setattr(guard, "guarded_step", slow_first)
    train.train(small_config(eval_every=0), str(tmp_path), progress=True)
    err = capsys.readouterr().err
    shown = re.findall(r"\[(\d\d):(\d\d)<(?:(\d\d):(\d\d)|\?)", err)
    assert shown, err
    for minutes, seconds, eta_min, eta_sec in shown:
        assert int(minutes) * 60 + int(seconds) < 3, err
        assert not eta_min or int(eta_min) * 60 + int(eta_sec) < 3, err


def test_pyproject_license_is_an_spdx_string():
    """PEP 639: `license` an SPDX string, which setuptools reads from 77.0 on (a table makes it print
    a deprecation banner on every install)."""
    tomllib = pytest.importorskip("tomllib")
    import pathlib

    project = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
    (requirement,) = [r for r in project["build-system"]["requires"] if r.startswith("setuptools")]
    assert int(re.fullmatch(r"setuptools>=(\d+).*", requirement).group(1)) >= 77


@pytest.mark.heavy
def test_editable_install_prints_no_deprecation_warning(tmp_path):
    """`pip install -e .` (verbose, so the build backend's warnings show) in a fresh virtual
    environment: no deprecation warning. Needs PyPI for the build requirements."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).parents[1]
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "venv")], check=True)
    proc = subprocess.run([str(tmp_path / "venv" / "bin" / "pip"), "install", "-v", "--no-deps", "-e", str(root)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "deprecat" not in (proc.stdout + proc.stderr).lower()


def test_a_reader_that_leaves_the_pipe_ends_it_quietly():
    """`cdpjax schedule ... | head -1`: the reader closes the pipe after one line and the command
    ends as a command the pipe's signal stops (exit 128 + SIGPIPE = 141), writing nothing to
    stderr: no BrokenPipeError traceback. The table (380 KB) is larger than a pipe's buffer."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-m", "cdpjax.cli", "schedule", "--method", "gpipe", "--stages", "64",
                             "--microbatches", "128", "--steps", "3"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=root)
    assert proc.stdout.readline().startswith(b"gpipe: 64 stages")
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait() == 141 and err == ""


@pytest.mark.parametrize("argv,message", [
    (["train", "--cpu-devices", "abc"], "cdpjax train: error: argument --cpu-devices: invalid int value: 'abc'"),
    (["bench", "--repeats", "x", "--methods", "dp"], "cdpjax bench: error: argument --repeats: invalid int value: 'x'"),
    (["schedule", "--costs"], "cdpjax schedule: error: argument --costs: expected one argument"),
    (["plot"], "cdpjax plot: error: the following arguments are required: WORKDIR"),
    (["nope"], "cdpjax: error: argument command: invalid choice: 'nope'"),
])
def test_a_usage_error_is_one_line(argv, message, capsys):
    """argparse's refusals (a flag's value of the wrong type, a missing argument, an unknown
    command) are one line on stderr, exit 2, like every other refusal: no usage block above it."""
    with pytest.raises(SystemExit) as done:
        main(argv)
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.count("\n") == 1 and err.startswith(message), err
    assert err.rstrip().endswith("--help` lists the arguments)")


# The conventions researchers already type ------------------------------------------------------

def test_config_key_space_value_is_key_equals_value():
    """`--config.KEY VALUE` (ml_collections' config_flags, big_vision's docstrings) is split as
    `--config.KEY=VALUE`; a value that is itself a flag, or none at all, is left for the refusal."""
    from cdpjax.cli import _split_config_overrides

    argv = ["train", "--config.num_steps", "3", "--config.mesh.data", "-1", "--config.method=dp", "--workdir", "w",
            "--config.stages", "[2, 5]", "--config.learning_rate", "--no-progress", "--config.seed"]
    assert _split_config_overrides(argv) == (
        ["num_steps=3", "mesh.data=-1", "method=dp", "stages=[2, 5]", "learning_rate", "seed"],
        ["train", "--workdir", "w", "--no-progress"])


def test_train_takes_config_key_space_value(tmp_path, capsys):
    """`cdpjax train --config.num_steps 3` trains 3 steps (summary.json says so)."""
    code = main(["train", "--config.method", "dp", "--config.num_steps", "3", "--config.eval_every", "0",
                 "--workdir", str(tmp_path / "run"), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 3


def test_config_key_without_value_is_one_line(tmp_path, capsys):
    code = main(["train", "--config.num_steps", "--workdir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and err == ("cdpjax: error: override 'num_steps' has no value: give --config.num_steps=VALUE or "
                                 "--config.num_steps VALUE\n")
    assert not (tmp_path / "run").exists()


def _pyproject_version() -> str:
    import pathlib

    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["version"]


def test_version_and_python_dash_m(capsys):
    """`cdpjax --version` and `python -m cdpjax --version` print pyproject.toml's version."""
    import os
    import pathlib
    import subprocess
    import sys

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"cdpjax {_pyproject_version()}\n"
    root = pathlib.Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-m", "cdpjax", "--version"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and proc.stdout == f"cdpjax {_pyproject_version()}\n", proc.stderr


# TensorBoard: hyperparameters, and a resumed run's events continued -----------------------------

def _flat(tree: dict, prefix: str = "") -> dict:
    """config.json's keys dotted, as TensorBoard's hyperparameters name them (a second walk)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _hparams_of(workdir) -> dict:
    """{name: value} of the run's hyperparameters, read with TensorBoard's reader and its protos."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = EventAccumulator(str(workdir))
    acc.Reload()
    content = acc.PluginTagToContent("hparams")
    data = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert {m.name.tag for m in experiment.metric_infos} == {"test/accuracy", "test/loss"}
    return {k: getattr(v, v.WhichOneof("kind")) for k, v in data.session_start_info.hparams.items()}


def test_tensorboard_hyperparameters_are_the_config(digits_run):
    """Every key of config.json is a hyperparameter (nested ones dotted): numbers as numbers,
    booleans and names as themselves, lists as their JSON text."""
    work, _, _ = digits_run
    config = _flat(json.loads((work / "config.json").read_text()))
    hparams = _hparams_of(work)
    assert set(hparams) == set(config)
    assert hparams["method"] == "dp" and hparams["num_steps"] == 12.0 and hparams["global_batch_size"] == 128.0
    assert hparams["profile_steps"] == "[2, 3]" and isinstance(hparams["augment"], bool)
    for key, value in config.items():
        if isinstance(value, (bool, str)):
            assert hparams[key] == value, key
        elif isinstance(value, (int, float)):
            assert hparams[key] == float(value), key


def test_resumed_run_continues_its_event_files(tmp_path):
    """A 12-step run (checkpoints every 4, the last two kept) whose last is lost resumes from 8:
    its old event files stay byte for byte, a new one is added, and TensorBoard's reader sees one
    value per step, the metrics.jsonl of the resumed run (which equals the uninterrupted run's)."""
    import hashlib
    import shutil

    from metrics_lines import without_timing

    full, part = tmp_path / "full", tmp_path / "part"
    train.train(small_config(checkpoint_every=4), str(full), progress=False)
    shutil.copytree(full, part)
    shutil.rmtree(part / "checkpoints" / "12")
    (part / "summary.json").unlink()
    old = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in part.glob("events.out.tfevents.*")}
    assert len(old) == 1
    resumed = train.train(small_config(checkpoint_every=4), str(part), progress=False)
    assert resumed["resumed_from"] == 8
    now = sorted(part.glob("events.out.tfevents.*"))
    assert len(now) == 2 and {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in now[:1]} == old
    text = (part / "metrics.jsonl").read_text()
    assert without_timing(text) == without_timing((full / "metrics.jsonl").read_text())
    events = events_of(part)
    assert events == expected_events(text)
    for tag, values in events.items():
        steps = [s for s, _ in values]
        assert steps == sorted(set(steps)), tag  # one value per step
    assert _hparams_of(part)["num_steps"] == 12.0
