"""Reliability claims (docs/guarantees.md), each method of the registry in turn.

A killed run resumes to the same end as an uninterrupted one (in-flight state
included), a checkpoint continues on another mesh or is refused as a table here
says for each method (ON_ANOTHER_MESH), non-finite values stop training naming the step and
the stage (or are skipped and counted), bad input fails before anything
compiles with a message naming it, reruns are identical, and every training
example is used exactly once per epoch.

One uninterrupted run per method (and one run killed after step 6, between
its checkpoints 4 and 8) is shared by the tests of the module; each test works
on its own copy.
"""
import dataclasses
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from cdpjax import data as data_lib
from cdpjax import checkpoint as checkpoint_lib
from cdpjax import methods, rundir, train
from cdpjax import setup as setup_lib
from cdpjax.errors import NonFiniteError
from cdpjax.checkpoint import Checkpointer
from cdpjax.cli import main
from cdpjax.config import ConfigError, default_config
from cdpjax.data.base import Dataset, stream_indices
from metrics_lines import events_of, expected_events, without_timing
# The runs share their programs through the tests' compilation cache (conftest.py); the SIGKILL
# test's subprocesses compile afresh, so the cross-process comparisons there also show that
# compiling again gives the same bits.

# Every method the project plans; those not registered yet are skipped, saying so.
PLANNED = ("e2e", "dp", "cdp-v1", "cdp-v2", "cdp-zero", "cdp-mp", "gpipe", "local", "ppll")
METHODS = sorted(set(PLANNED) | set(methods.REGISTRY))
# In CI, the resume, restore, non-finite and exactly-once claims run for one method of each engine
# and update path; these share an engine with one there and run with `make test-heavy`. A method registered
# later is in CI by default.
SAME_ENGINE = {"cdp-v1": "cdp-v2", "gpipe": "1f1b", "interleaved-1f1b": "1f1b", "zbv": "zb-h1",
               "looped-bfs": "1f1b", "local": "ppll", "cdp-random": "cdp-v2"}  # cdp-random's default: cdp-v2's ring
SOME_METHODS = [pytest.param(m, marks=pytest.mark.heavy) if m in SAME_ENGINE else m for m in METHODS]
STEPS, KILLED_AFTER, RESUMED_FROM = 12, 6, 4


def require(name):
    if name not in methods.REGISTRY:
        pytest.skip(f"method {name!r} is not registered yet (no cdpjax/methods module defines it)")


def _axis(name):
    return methods.REGISTRY[name].device_axis


def layout(name):
    """The mesh and devices each method runs on here: its layout's own mesh for the 4-stage MLP."""
    if _axis(name) == "stage":
        stage = methods.REGISTRY[name].default_mesh(small_config(name, mesh={}))["stage"]
        return {"stage": stage}, jax.devices()[:stage]
    if _axis(name) is None:
        return {"data": -1}, jax.devices()[:1]
    return {"data": -1}, jax.devices()


def other_layout(name):
    """Another device count for the same method (a different device for `local`, which has one)."""
    if _axis(name) == "stage":
        stage = layout(name)[0]["stage"]
        return {"stage": stage, "data": 2}, jax.devices()[:2 * stage]
    if name == "e2e":
        return {"data": -1}, jax.devices()
    if name == "local":
        return {"data": -1}, jax.devices()[5:6]
    return {"data": -1}, jax.devices()[:4]


def small_config(name, **overrides):
    """Digits, a 4-stage MLP, 128 images a step: 12 steps are one epoch (1,497 images) and a bit."""
    c = default_config()
    c.method = name
    c.stages = 4
    c.mesh = layout(name)[0] if "mesh" not in overrides else {}
    c.global_batch_size = 128
    c.num_steps = STEPS
    c.checkpoint_every = 4
    c.eval_every = 4
    c.log_every = 3
    c.schedule = "constant"  # so that a run with skipped steps can be compared with a shorter one
    for k, v in overrides.items():
        c[k] = v
    return c


class Recorder:
    """Wraps `cdpjax.data.build` and `cdpjax.setup.setup` to count what the trainer reads and feeds."""

    def __init__(self, monkeypatch, poison=(), insert=False, snapshot=None):
        """`snapshot=(step, workdir, copy)`: once step `step` has ended, WORKDIR is copied to `copy`:
        what a process killed after `step` steps leaves behind."""
        self.reads, self.fed, self.flushes, self.has_flush = [], 0, 0, False
        build, setup, put = data_lib.build, setup_lib.setup, setup_lib.put_batch

        def counting_build(config):
            ds = build(config)

            def read(split, idx):
                if split == "train":
                    self.reads.append(np.asarray(idx).copy())
                return ds.read(split, idx)

            wrapped = dataclasses.replace(ds, read=read)
            return PoisonedDataset(wrapped, poison, insert) if poison else wrapped

        def counting_setup(config, devices=None):
            dataset, mesh, method = setup(config, devices)
            self.has_flush = method.flush is not None
            if method.flush is not None:
                def flush(state, flush=method.flush):
                    self.flushes += 1
                    return flush(state)

                method = dataclasses.replace(method, flush=flush)
            return dataset, mesh, method

        def counting_put(batch, mesh, sharding=None):
            self.fed += 1  # batches are put on the devices ahead of their step (cdpjax.data.prefetch)
            return put(batch, mesh, sharding)

        def snapshot_after(done, hooks=rundir.test_hooks):
            if snapshot and done == snapshot[0]:  # step `done` has ended: what a kill now leaves
                shutil.copytree(snapshot[1], snapshot[2])
                as_if_dead(snapshot[2])
            hooks(done)

        monkeypatch.setattr(data_lib, "build", counting_build)
        monkeypatch.setattr(setup_lib, "setup", counting_setup)
        monkeypatch.setattr(setup_lib, "put_batch", counting_put)
        monkeypatch.setattr(rundir, "test_hooks", snapshot_after)


class PoisonedDataset:
    """Batches at the steps in `poison` have NaN images. With `insert`, they are extra batches
    slotted into the stream, the others being the plain stream's batches in order."""

    def __init__(self, base, poison, insert):
        self.base, self.poison, self.insert = base, tuple(poison), insert

    def __getattr__(self, name):
        return getattr(self.base, name)

    def train_batch(self, step, *args, **kwargs):
        under = step - sum(p < step for p in self.poison) if self.insert else step
        batch = self.base.train_batch(under, *args, **kwargs)
        if step in self.poison:
            batch = {**batch, "image": np.full_like(batch["image"], np.nan)}
        return batch


def as_if_dead(workdir):
    """WORKDIR's lock.json as a SIGKILLed run leaves it: naming a process that is gone (a
    child that has exited and been reaped), with the live run's recorded start time."""
    path = os.path.join(workdir, "lock.json")
    record = json.loads(open(path).read())
    child = subprocess.Popen(["true"])
    child.wait()
    record["pid"] = child.pid
    with open(path, "w") as f:
        json.dump(record, f)


def final_state(config, workdir, devices):
    """The whole train state of the last checkpoint (in-flight buffers, optimizer states...)."""
    _, _, method = setup_lib.setup(config, devices)
    ckpt = Checkpointer(str(workdir))
    state, meta = ckpt.restore(ckpt.latest_step(), method.init(jax.random.key(config.seed)))
    ckpt.close()
    return jax.device_get(state), jax.device_get(method.export(state)[0]), meta


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Per method: an uninterrupted run (with what it read and fed), and its WORKDIR as it was
    after step 6 (checkpoint 4, metrics up to step 6): what a run killed then leaves."""
    cache = {}

    def get(name):
        if name not in cache:
            mesh, devices = layout(name)
            c = small_config(name)
            root = tmp_path_factory.mktemp(name)
            with pytest.MonkeyPatch.context() as mp:
                rec = Recorder(mp, snapshot=(KILLED_AFTER, root / "full", root / "killed"))
                summary = train.train(c, str(root / "full"), progress=False, devices=devices)
            assert [r["step"] for r in map(json.loads, (root / "killed" / "metrics.jsonl").read_text().splitlines())
                    ] == [3, 4, 6]
            state, params, _ = final_state(c, root / "full", devices)
            cache[name] = {"full": root / "full", "killed": root / "killed", "summary": summary,
                           "state": state, "params": params, "reads": rec.reads, "fed": rec.fed,
                           "flushes": rec.flushes, "has_flush": rec.has_flush}
        return cache[name]

    return get


@pytest.fixture(scope="module")
def dp_reference(reference):
    """dp's reference runs, made before a test that watches compilation starts watching (a test
    that calls `reference('dp')` itself would compile inside its window when run alone)."""
    return reference("dp")


def steps(workdir):
    """The complete checkpoints in WORKDIR, read off the directory names."""
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def _equal_trees(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(np.testing.assert_array_equal, a, b)


def _damage(directory):
    for root, _, files in os.walk(directory):
        for f in files:
            with open(os.path.join(root, f), "r+b") as fh:
                fh.truncate(max(os.path.getsize(os.path.join(root, f)) // 2, 1))
                fh.seek(0)
                fh.write(b"\xff" * 8)


# 1. Resume everything -------------------------------------------------------------------------

@pytest.mark.parametrize("name", SOME_METHODS)
def test_killed_run_resumes_to_the_same_end(name, reference, tmp_path):
    """Killed after step 6 (checkpoints every 4), with a checkpoint of step 8 half written
    (orbax's temporary directory): the restart takes checkpoint 4 and ends with the whole train
    state (parameters, previous versions, partial sums, pipeline buffers, every stage's
    optimizer state) and metrics.jsonl identical to the uninterrupted run's (timing fields cut
    out), and TensorBoard events that equal its metrics.jsonl: the killed run's event files are
    continued (TensorBoard's restart mark voids their steps past the checkpoint), no step twice."""
    require(name)
    ref = reference(name)
    part = tmp_path / "part"
    shutil.copytree(ref["killed"], part)
    ckpts = part / "checkpoints"
    assert steps(part) == [RESUMED_FROM]
    partial = ckpts / "8.orbax-checkpoint-tmp-1700000000000"
    shutil.copytree(ckpts / str(RESUMED_FROM), partial)
    _damage(partial)
    c = small_config(name)
    resumed = train.train(c, str(part), progress=False, devices=layout(name)[1])
    assert resumed["resumed_from"] == RESUMED_FROM
    assert not partial.exists()  # the leftover of the dead writer is cleaned up
    state, _, _ = final_state(c, part, layout(name)[1])
    _equal_trees(state, ref["state"])
    assert without_timing((part / "metrics.jsonl").read_text()) == without_timing(
        (ref["full"] / "metrics.jsonl").read_text())
    assert events_of(part) == expected_events((part / "metrics.jsonl").read_text())  # no step twice
    assert resumed["test_accuracy"] == ref["summary"]["test_accuracy"]


def _has_flush(name):
    return setup_lib.setup(small_config(name), layout(name)[1])[2].flush is not None


# Methods whose flush the extension test runs in CI (one per engine with a flush); the others with `make test-heavy`.
FLUSH_IN_CI = ("ppll", "cdp-v2")
EXTENDED_TO, EXTENSION_KILLED_AFTER = 20, 5


@pytest.mark.parametrize("name", [m if m in FLUSH_IN_CI else pytest.param(m, marks=pytest.mark.heavy)
                                  for m in METHODS])
def test_an_extended_run_flushes_at_its_new_end_and_equals_itself_killed_and_resumed(name, reference, tmp_path,
                                                                                      monkeypatch):
    """A finished run of 12 steps (its final checkpoint flushed) extended to 20 (the same command,
    a larger num_steps) trains the batches in flight again and so flushes once at step 20; the
    same extension killed after step 17 (checkpoint 16 written before any flush) and resumed
    ends with the same train state and metrics.jsonl (timing fields cut out)."""
    require(name)
    if not _has_flush(name):
        pytest.skip(f"{name} has no flush")
    ref = reference(name)
    c = small_config(name, num_steps=EXTENDED_TO)
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    shutil.copytree(ref["full"], whole)
    shutil.copytree(ref["full"], killed)
    with pytest.MonkeyPatch.context() as mp:
        rec = Recorder(mp)
        extended = train.train(c, str(whole), progress=False, devices=layout(name)[1])
    assert extended["resumed_from"] == STEPS and rec.flushes == 1  # the new end flushes
    stopped = train.train(c, str(killed), progress=False, devices=layout(name)[1], stop_after=EXTENSION_KILLED_AFTER)
    assert stopped == {"stopped_at": STEPS + EXTENSION_KILLED_AFTER} and steps(killed)[-1] == 16
    resumed = train.train(c, str(killed), progress=False, devices=layout(name)[1])
    assert resumed["resumed_from"] == 16
    _equal_trees(final_state(c, killed, layout(name)[1])[0], final_state(c, whole, layout(name)[1])[0])
    assert without_timing((killed / "metrics.jsonl").read_text()) == without_timing(
        (whole / "metrics.jsonl").read_text())


def _overrides(name):
    """`small_config(name)` as command-line overrides."""
    return [f"--config.method={name}", f"--config.num_steps={STEPS}", "--config.checkpoint_every=4",
            "--config.eval_every=4", "--config.log_every=3", "--config.global_batch_size=128",
            "--config.schedule=constant", "--config.stages=4"]


def _cli_args(name, workdir):
    return ["-m", "cdpjax.cli", "train", "--no-progress", "--workdir", str(workdir), "--cpu-devices", "8",
            *_overrides(name)]


def test_sigkill_between_checkpoints_then_restart(reference, tmp_path):
    """`cdpjax train` SIGKILLed right after step 10 (checkpoint 8 written, 12 not), then the same
    command again: the dead run's lock is recognised as stale (its process is gone from this
    host) and taken over, saying so in one line; the run ends as the uninterrupted one, to the
    bit, metrics.jsonl byte for byte once the timing fields are cut out; the killed process's
    metrics lines past step 8 are replaced and the lock is released at the end."""
    ref = reference("dp")
    work = tmp_path / "run"
    env = {**os.environ, rundir.KILL_ENV: "10"}
    killed = subprocess.run([sys.executable, *_cli_args("dp", work)], env=env, capture_output=True,
                            text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not (work / "summary.json").exists()
    assert steps(work) == [4, 8]
    assert json.loads((work / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 9  # logged past 8
    stale = json.loads((work / "lock.json").read_text())
    again = subprocess.run([sys.executable, *_cli_args("dp", work)], capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-2000:]
    takeover = [line for line in again.stderr.splitlines() if "took over the lock" in line]
    assert len(takeover) == 1 and f"process {stale['pid']} " in takeover[0] and "is gone" in takeover[0], again.stderr
    assert "resuming dp / mlp / digits" in again.stderr and "from step 8" in again.stderr
    assert not (work / "lock.json").exists()
    assert json.loads((work / "summary.json").read_text())["resumed_from"] == 8
    assert without_timing((work / "metrics.jsonl").read_text()) == without_timing(
        (ref["full"] / "metrics.jsonl").read_text())
    state, _, _ = final_state(small_config("dp"), work, layout("dp")[1])
    _equal_trees(state, ref["state"])


def _files(workdir):
    """Every file under WORKDIR: its bytes and modification time."""
    return {str(p.relative_to(workdir)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(workdir.rglob("*")) if p.is_file()}


def test_finished_run_started_again_changes_nothing(reference, tmp_path, capsys):
    """Starting a finished run again (a job scheduler's retry) trains nothing and changes no file
    (every file's bytes and modification time), summary.json included, and says so in one line."""
    ref = reference("dp")
    work = tmp_path / "run"
    shutil.copytree(ref["full"], work)  # copy2: modification times kept
    before = _files(work)
    code = main(["train", "--no-progress", "--workdir", str(work), "--cpu-devices", "8", *_overrides("dp")])
    err = capsys.readouterr().err
    assert code == 0, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "holds a finished run of 12 steps" in lines[0] and "no file changed" in lines[0], err
    after = _files(work)
    assert sorted(after) == sorted(before)
    for name in before:
        assert after[name][0] == before[name][0], f"{name} was rewritten"
        assert after[name][1] == before[name][1], f"{name} was touched"
    again = train.train(small_config("dp"), str(work), progress=False)
    assert again["already_finished"] and again["test_accuracy"] == ref["summary"]["test_accuracy"]
    assert again["images_per_second"] == ref["summary"]["images_per_second"] > 0


def _cli(name, workdir, *extra, progress=False):
    """`cdpjax train` as a user runs it, with Ctrl-C's handler set (a shell that starts the tests
    in the background makes its children ignore SIGINT)."""
    boot = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "from cdpjax.cli import main; sys.exit(main())")
    args = [a for a in _cli_args(name, workdir)[2:] if progress is False or a != "--no-progress"]
    return [sys.executable, "-c", boot, *args, *extra]


def _wait_env(tmp_path, step):
    """The test hook that holds a run after `step` until the test lets it go."""
    release = tmp_path / "release"
    return {**os.environ, rundir.WAIT_ENV: str(step), rundir.WAIT_FILE_ENV: str(release)}, release


def _wait_for(path, proc, timeout=3600):
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.1)


def test_a_second_run_on_a_live_workdir_is_refused(reference, tmp_path):
    """Two `cdpjax train` on one WORKDIR: the second, started while the first is between its
    checkpoints (one of them half written: orbax's temporary directory), exits 2 with one line
    naming the directory and the first run (host, process id, start time) and touches nothing;
    the first ends as a run alone does (metrics.jsonl without its timing fields, the whole final
    train state) and releases the lock."""
    ref = reference("dp")
    work = tmp_path / "run"
    env, release = _wait_env(tmp_path, 6)
    first = subprocess.Popen(_cli("dp", work), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(pathlib.Path(f"{release}.waiting"), first)
        writing = work / "checkpoints" / "8.orbax-checkpoint-tmp-1700000000000"  # as if being written
        shutil.copytree(work / "checkpoints" / "4", writing)
        second = subprocess.run(_cli("dp", work), capture_output=True, text=True)
        assert second.returncode == 2, second.stderr[-3000:]
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in second.stderr, second.stderr
        assert f"WORKDIR {work} is in use" in lines[0] and f"process {first.pid} on host {socket.gethostname()}, " \
            f"started 20" in lines[0] and "--force" in lines[0], lines[0]
        assert writing.exists()  # the live run's checkpoint in progress is left alone
        shutil.rmtree(writing)
    finally:
        release.touch()
    _, err = first.communicate()
    assert first.returncode == 0, err[-3000:]
    assert without_timing((work / "metrics.jsonl").read_text()) == without_timing(
        (ref["full"] / "metrics.jsonl").read_text())
    state, _, _ = final_state(small_config("dp"), work, layout("dp")[1])
    _equal_trees(state, ref["state"])
    assert not (work / "lock.json").exists()


def test_ctrl_c_says_where_the_run_stands_and_the_same_command_resumes(reference, tmp_path):
    """A user's session: `cdpjax train` with mesh {'data': 8} and no --cpu-devices says it simulates
    8 CPU devices and why, then what it trains; Ctrl-C after step 5 (checkpoints every 4) prints,
    on its own line below the progress bar, the step, the last complete checkpoint and what to
    do, exits 130 and releases the lock; the same command then says it resumes from step 4 and
    ends as the uninterrupted run."""
    ref = reference("dp")
    work = tmp_path / "run"
    command = [a for a in _cli("dp", work, "--config.mesh.data=8", progress=True) if a != "--cpu-devices"]
    command.remove("8")  # --cpu-devices' value
    env, release = _wait_env(tmp_path, 5)
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(pathlib.Path(f"{release}.waiting"), proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate()
    assert proc.returncode == 130, err[-3000:]
    lines = err.split("\n")
    devices = lines.index("cdpjax: 8 simulated CPU devices (what the mesh {'data': 8} needs); "
                          "--cpu-devices sets them")
    assert lines[devices + 1] == (f"cdpjax: training dp / mlp / digits in {work}: 12 steps "
                                  f"(mesh {{'data': 8}}, 8 devices; compilation cache off)")
    assert (f"cdpjax: interrupted at step 5; last complete checkpoint: step 4 in {work}/checkpoints; "
            f"run the same command to resume") in lines, err
    assert "Traceback" not in err and not (work / "lock.json").exists()
    again = subprocess.run(command, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (f"cdpjax: resuming dp / mlp / digits in {work} from step 4 (checkpoint {work}/checkpoints/4); "
            f"training to step 12") in again.stderr
    assert without_timing((work / "metrics.jsonl").read_text()) == without_timing(
        (ref["full"] / "metrics.jsonl").read_text())


# SIGTERM for every method: in CI one of each engine (dp the data axis, cdp-v2 the ring, ppll the stage
# axis) and every method registered later; the others registered when this was written share an engine
# with those, with `make test-heavy` (cdp-mp's resume onto its mesh spelled without a size-1 axis is in
# CI: test_a_mesh_axis_of_size_one_is_no_other_mesh). The other signals on dp.
PREEMPTED_HEAVY = {"e2e", "cdp-v1", "cdp-zero", "cdp-random", "cdp-mp", "gpipe", "1f1b", "interleaved-1f1b", "zb-h1",
                   "zbv", "dualpipev", "looped-bfs", "local"}
PREEMPTED = [*[pytest.param(m, signal.SIGTERM, marks=pytest.mark.heavy if m in PREEMPTED_HEAVY else ())
               for m in METHODS], ("dp", signal.SIGHUP),
             *[pytest.param("dp", s, marks=pytest.mark.heavy) for s in (signal.SIGQUIT, signal.SIGUSR1)]]
PREEMPTED_ASYNC = ("dp", "async")  # the same with checkpoint.async_save: checkpoint 4 and 6 written in orbax's threads


@pytest.mark.parametrize("name,sig", [*PREEMPTED, PREEMPTED_ASYNC],
                         ids=lambda x: x if isinstance(x, str) else signal.Signals(x).name)
def test_a_preemption_saves_at_the_next_step_boundary_and_resumes_to_the_same_end(name, sig, reference, tmp_path):
    """SIGTERM (or SIGHUP, SIGQUIT, SIGUSR1, taken as it) after step 5, between checkpoints 4 and 8,
    every method (`PREEMPTED`): the
    run writes checkpoint 6 at the next step boundary and exits 128 + the signal's number (143,
    129...) with one line naming it; resumed from it, it ends as the uninterrupted run (the
    whole train state, metrics.jsonl without the timing fields)."""
    require(name)
    ref = reference(name)
    work = tmp_path / "run"
    env, release = _wait_env(tmp_path, 5)
    command = _cli(name, work, *([ASYNC] if sig == "async" else []))
    sig = signal.SIGTERM if sig == "async" else sig
    command[command.index("--cpu-devices") + 1] = str(len(layout(name)[1]))  # the method's own mesh, as the reference
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(pathlib.Path(f"{release}.waiting"), proc)
    proc.send_signal(sig)
    release.touch()
    _, err = proc.communicate()
    assert proc.returncode == 128 + int(sig), err[-3000:]
    said_before = r"cdpjax: (training|\d+ simulated|compil)"  # the start-up and compile lines
    lines = [line for line in err.strip().splitlines() if not re.match(said_before, line)]
    assert lines == [f"cdpjax: terminated ({signal.Signals(sig).name}) at step 6; checkpoint 6 saved in "
                     f"{work}/checkpoints; run the same command to resume from it"], err
    assert steps(work) == [4, 6] and not (work / "lock.json").exists()
    c = small_config(name)
    resumed = train.train(c, str(work), progress=False, devices=layout(name)[1])
    assert resumed["resumed_from"] == 6
    _equal_trees(final_state(c, work, layout(name)[1])[0], ref["state"])
    assert without_timing((work / "metrics.jsonl").read_text()) == without_timing(
        (ref["full"] / "metrics.jsonl").read_text())


def test_jax_preemption_notice_saves_at_the_next_step_boundary_and_resumes_to_the_same_end(reference, tmp_path,
                                                                                         monkeypatch):
    """JAX's preemption notice (`multihost_utils.reached_preemption_sync_point`, stood in for here:
    one process has no preemption service) answers yes at step 6, between checkpoints 4 and 8:
    the run saves checkpoint 6 there and stops as a SIGTERM stops it (exit status 143, the same
    line); the notice was asked at every step boundary with the step (what JAX's protocol needs);
    resumed, the run ends as the uninterrupted one."""
    from jax.experimental import multihost_utils

    from cdpjax import loop

    ref, work, devices = reference("dp"), tmp_path / "run", layout("dp")[1]
    asked = []

    def notice(step):  # JAX's answer: yes at the safe step its protocol agreed on (every process alike)
        asked.append(step)
        return step == 6

    monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point", notice)
    c = small_config("dp")
    with pytest.raises(loop.Interrupted) as stopped:
        train.train(c, str(work), progress=False, devices=devices)
    assert stopped.value.exit_status == 143
    assert str(stopped.value) == (f"terminated (SIGTERM) at step 6; checkpoint 6 saved in {work}/checkpoints; run "
                                  f"the same command to resume from it")
    assert steps(work) == [4, 6] and not (work / "lock.json").exists()
    # asked at every step boundary 1..6 in order (again after a sync step's checkpoint; orbax asks too
    # at each save, with the step), and at none after 6
    assert sorted(set(asked)) == [1, 2, 3, 4, 5, 6] and asked == sorted(asked)
    monkeypatch.undo()
    resumed = train.train(c, str(work), progress=False, devices=devices)
    assert resumed["resumed_from"] == 6
    _equal_trees(final_state(c, work, devices)[0], ref["state"])
    assert without_timing((work / "metrics.jsonl").read_text()) == without_timing(
        (ref["full"] / "metrics.jsonl").read_text())


# `train.train` as a user's script calls it (no command line, hence no cdpjax.shutdown watcher): the
# config from `_overrides`, the reference's mesh and device count (every device); what the call raised, and whether the
# SIGTERM handler the script had before the call is back after it, on stderr; the exit status the
# Interrupted carries.
TRAIN_API_SCRIPT = """
import signal, sys
from cdpjax.mesh import setup_devices
setup_devices(int(sys.argv[2]))
import jax
from cdpjax import train
from cdpjax.config import apply_overrides, default_config
c = default_config()
apply_overrides(c, sys.argv[3:])
mine = lambda signum, frame: None
signal.signal(signal.SIGTERM, mine)
try:
    train.train(c, sys.argv[1], progress=False, devices=jax.devices())
except train.Interrupted as e:
    print(f"raised: {e}", file=sys.stderr)
    print(f"handler restored: {signal.getsignal(signal.SIGTERM) is mine}", file=sys.stderr)
    sys.exit(e.exit_status)
"""


def test_a_preemption_of_train_train_saves_at_the_next_step_boundary_and_resumes_to_the_same_end(reference,
                                                                                               tmp_path):
    """`train.train` from Python (a notebook, a user's script) gets SIGTERM after step 5, between
    checkpoints 4 and 8: it writes checkpoint 6 at the next step boundary and raises Interrupted
    naming it (exit_status 143), the caller's own SIGTERM handler put back; resumed from it, the
    run ends as the uninterrupted one (the whole train state, metrics.jsonl without the timing
    fields)."""
    ref = reference("dp")
    work = tmp_path / "run"
    env, release = _wait_env(tmp_path, 5)
    overrides = [o.removeprefix("--config.") for o in _overrides("dp")] + ["mesh.data=-1"]
    assert layout("dp")[1] == jax.devices()  # the script's devices (all there are) are the reference's
    proc = subprocess.Popen([sys.executable, "-c", TRAIN_API_SCRIPT, str(work), str(len(jax.devices())), *overrides],
                            env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(pathlib.Path(f"{release}.waiting"), proc)
    proc.send_signal(signal.SIGTERM)
    release.touch()
    _, err = proc.communicate()
    assert proc.returncode == 143, err[-3000:]
    said = [line for line in err.splitlines() if line.startswith(("raised:", "handler restored:"))]
    assert said == [f"raised: terminated (SIGTERM) at step 6; checkpoint 6 saved in {work}/checkpoints; run the "
                    f"same command to resume from it", "handler restored: True"], err[-3000:]
    assert steps(work) == [4, 6] and not (work / "lock.json").exists()
    c = small_config("dp")
    resumed = train.train(c, str(work), progress=False, devices=layout("dp")[1])
    assert resumed["resumed_from"] == 6
    _equal_trees(final_state(c, work, layout("dp")[1])[0], ref["state"])
    assert without_timing((work / "metrics.jsonl").read_text()) == without_timing(
        (ref["full"] / "metrics.jsonl").read_text())


def test_multi_process_preemption_is_agreed_on_only_at_sync_steps(monkeypatch):
    """Two processes (stood in for): the loop's preemption question all-gathers its flag only at
    sync steps (here 4 and 8 of 1..8), never at the steps between, where nothing else comes to
    the host; a signal to this process after step 5 stops the run at 8, the next sync step, and
    not at 6 or 7; JAX's notice, a host call, stops it at once, with no all-gather."""
    from jax.experimental import multihost_utils

    from cdpjax import loop, shutdown

    gathered, noticed_at = [], [None]
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: gathered.append(int(x)) or np.array([x, 0]))
    monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point", lambda step: step == noticed_at[0])
    boundary = shutdown.Boundary()
    answers = []
    for done in range(1, 9):
        if done == 6:
            boundary.signum = signal.SIGTERM  # what the watcher records when a signal asks
        answers.append(loop._preempted(boundary, done, sync=done % 4 == 0))
    assert answers == [False] * 7 + [True]  # asked from 6; agreed on at 8
    assert gathered == [0, 1]  # steps 4 and 8 only
    noticed_at[0], gathered[:] = 3, []
    assert loop._preempted(shutdown.Boundary(), 3, sync=False) and gathered == []


# CI runs tests/test_faults.py::test_force_during_checkpoints_stops_the_old_run_and_the_forcing_run_ends_whole
@pytest.mark.heavy
def test_force_takes_a_live_runs_directory_and_keeps_its_checkpoint_in_progress(reference, tmp_path, capsys):
    """`--force` on a directory whose lock names a live process (this one, as another run would
    be): the run takes the lock over, says so, resumes and finishes; the temporary checkpoint
    directory, which the forced-out run may still be writing, is left alone (a dead owner's
    is removed: test_killed_run_resumes_to_the_same_end)."""
    ref = reference("dp")
    work = tmp_path / "run"
    shutil.copytree(ref["killed"], work)
    record = json.loads((work / "lock.json").read_text())
    record["pid"] = os.getpid()  # alive, with this process's start time: a live owner
    with open(f"/proc/{os.getpid()}/stat") as f:
        record["pid_start"] = f.read().rsplit(")", 1)[1].split()[19]
    (work / "lock.json").write_text(json.dumps(record))
    writing = work / "checkpoints" / "8.orbax-checkpoint-tmp-1700000000000"
    shutil.copytree(work / "checkpoints" / str(RESUMED_FROM), writing)
    assert main(["train", "--no-progress", "--workdir", str(work), "--cpu-devices", "8", *_overrides("dp")]) == 2
    assert "is in use by another run" in capsys.readouterr().err
    code = main(["train", "--no-progress", "--workdir", str(work), "--cpu-devices", "8", "--force", *_overrides("dp")])
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"took over the lock of {work} from process {os.getpid()} " in err and "forced (--force)" in err
    assert writing.exists() and not (work / "lock.json").exists()
    assert json.loads((work / "summary.json").read_text())["resumed_from"] == RESUMED_FROM


ASYNC = "--config.checkpoint.async_save=True"


def test_an_async_save_returns_before_its_checkpoint_is_committed(tmp_path, monkeypatch):
    """Checkpointer(async_save=True): `save` returns while orbax's thread is held before the rename
    (the test hook), the step not yet listed and `committed` not naming it; `wait` then finishes it,
    and the checkpoint reads back with its checksums verified."""
    release = tmp_path / "release"
    monkeypatch.setenv(checkpoint_lib.WAIT_IN_COMMIT_ENV, "3")
    monkeypatch.setenv(rundir.WAIT_FILE_ENV, str(release))
    state = {"w": np.arange(12, dtype=np.float32).reshape(3, 4)}
    ckpt = Checkpointer(str(tmp_path), owner="run7", async_save=True)
    try:
        ckpt.save(3, state, {})
        deadline = time.time() + 60
        while not pathlib.Path(f"{release}.waiting").exists():
            assert time.time() < deadline
            time.sleep(0.05)
        assert ckpt.steps() == [] and ckpt.committed is None and ckpt.in_flight == 3
        release.touch()
        assert ckpt.wait() == 3 and ckpt.steps() == [3]
        restored, meta = ckpt.restore(3, state)
        np.testing.assert_array_equal(restored["w"], state["w"])
        assert meta["step"] == 3
    finally:
        release.touch()
        ckpt.close()


def test_an_async_saved_run_resumes_to_the_same_end(reference, tmp_path):
    """checkpoint.async_save: dp stopped after step 6 (checkpoint 4 written in orbax's threads,
    waited for when the run ends) and resumed ends as the uninterrupted synchronous run: the
    whole train state (restored with every array checked against the meta's checksums) and
    metrics.jsonl without its timing fields."""
    ref = reference("dp")
    c = small_config("dp")
    c.checkpoint.async_save = True
    work, devices = tmp_path / "run", layout("dp")[1]
    assert train.train(c, str(work), progress=False, devices=devices, stop_after=KILLED_AFTER) == {
        "stopped_at": KILLED_AFTER}
    assert steps(work) == [4]
    resumed = train.train(c, str(work), progress=False, devices=devices)
    assert resumed["resumed_from"] == 4 and steps(work) == [8, 12]
    _equal_trees(final_state(c, work, devices)[0], ref["state"])
    assert without_timing((work / "metrics.jsonl").read_text()) == without_timing(
        (ref["full"] / "metrics.jsonl").read_text())


def test_a_run_killed_while_an_async_save_is_in_flight_resumes_from_the_previous_checkpoint(reference, tmp_path):
    """`cdpjax train` with checkpoint.async_save SIGKILLed while orbax's thread holds checkpoint 8
    written but not yet renamed into place (the test hook holds the commit): checkpoint 4 is the
    newest complete one, the half-committed write is never listed, and the same command resumes
    from 4 (removing the dead writer's temporary directory) and ends as the uninterrupted run."""
    ref = reference("dp")
    work, release = tmp_path / "run", tmp_path / "release"
    env = {**os.environ, checkpoint_lib.WAIT_IN_COMMIT_ENV: "8", rundir.WAIT_FILE_ENV: str(release)}
    proc = subprocess.Popen(_cli("dp", work, ASYNC), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    _wait_for(pathlib.Path(f"{release}.waiting"), proc)
    proc.kill()
    proc.communicate()
    assert steps(work) == [4]
    assert [p.name for p in (work / "checkpoints").iterdir() if p.name.startswith("8.orbax-checkpoint-tmp")]
    again = subprocess.run(_cli("dp", work, ASYNC), capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((work / "summary.json").read_text())["resumed_from"] == 4
    assert not [p.name for p in (work / "checkpoints").iterdir() if "orbax-checkpoint-tmp" in p.name]
    _equal_trees(final_state(small_config("dp"), work, layout("dp")[1])[0], ref["state"])
    assert without_timing((work / "metrics.jsonl").read_text()) == without_timing(
        (ref["full"] / "metrics.jsonl").read_text())


# 2. Other device counts ------------------------------------------------------------------------

RESUMES = "resumes"
# What a registered method does with a checkpoint written on its own mesh (`layout`) when the run
# goes on on `other_layout`'s: resume and end where the uninterrupted run ends, or refuse with a
# ConfigError holding these phrases (both meshes or both worker counts, and what to do). A method
# not listed follows the rule (`on_another_mesh`), so a layout added later needs no edit here.
ON_ANOTHER_MESH = {
    # the worker count sets which (worker, stage) reads a stale version: 8 workers -> 4
    "cdp-v1": ("written with 8 CDP workers; this run has 4", "--config.workers=8", "fresh --workdir"),
    "cdp-v2": ("written with 8 CDP workers; this run has 4", "--config.workers=8", "fresh --workdir"),
    "cdp-zero": ("written with 8 CDP workers; this run has 4", "--config.workers=8", "fresh --workdir"),
    "cdp-random": ("written with 8 CDP workers; this run has 4", "--config.workers=8", "fresh --workdir"),
}


def on_another_mesh(name):
    """The rule for a method not listed: a state that is the model and its optimizer state (e2e,
    dp, local), or a stage-axis layout's that holds no data group's micro-batch between steps
    (`Method.state_depends_on_mesh` False), resumes ({stage: D} -> {stage: D, data: 2}); one that
    depends on the mesh (cdp-mp's N = L micro-batches in flight on every stage) is refused, naming
    both meshes."""
    if name in ON_ANOTHER_MESH:
        return ON_ANOTHER_MESH[name]
    c = small_config(name)
    mesh, devices = layout(name)
    if not setup_lib.setup(c, devices)[2].state_depends_on_mesh:
        return RESUMES
    other, other_devices = other_layout(name)
    return (f"on mesh {mesh} ({len(devices)} devices); this run has mesh {other} ({len(other_devices)} devices)",
            "train state depends on the mesh", "fresh --workdir")


def test_the_rule_places_every_registered_method():
    """The rule gives what was measured for the methods it covers: the one-device methods and the
    flushed pipelines resume, cdp-mp is refused."""
    for name in ("e2e", "dp", "local", "gpipe", "1f1b", "ppll", "zb-h1"):
        assert on_another_mesh(name) == RESUMES, name
    assert "train state depends on the mesh" in on_another_mesh("cdp-mp")
    for name in methods.REGISTRY:
        assert on_another_mesh(name)


@pytest.mark.parametrize("name", SOME_METHODS)
def test_restore_on_another_device_count(name, reference, tmp_path):
    """Checkpoint 4 written on the method's mesh, the run continued on another (`other_layout`):
    each method does what `on_another_mesh` says, resuming to where the uninterrupted run ends (to
    float tolerance: reductions change order) or refusing with a ConfigError that names both
    meshes (or worker counts) and what to do, before anything is trained."""
    require(name)
    ref = reference(name)
    work = tmp_path / "moved"
    shutil.copytree(ref["killed"], work)
    mesh, devices = other_layout(name)
    c = small_config(name, mesh=mesh)
    expected = on_another_mesh(name)
    if expected != RESUMES:
        with pytest.raises(ConfigError) as err:
            train.train(c, str(work), progress=False, devices=devices)
        for phrase in expected:
            assert phrase in str(err.value), str(err.value)
        assert steps(work) == [RESUMED_FROM] and not (work / "summary.json").exists()
        return
    out = train.train(c, str(work), progress=False, devices=devices)
    assert out["resumed_from"] == RESUMED_FROM and out["devices"] == len(devices)
    _, params, _ = final_state(c, work, devices)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4), params, ref["params"])


@pytest.mark.parametrize("declared,shape,message", [
    (False, (4, 3), "has a leading worker or stage axis whose size follows the mesh"),
    (True, (8, 3), "train state depends on the mesh"),
    (False, (8, 3), None),
], ids=["shape-changes", "declared", "fits"])
def test_restore_onto_another_mesh_checks_the_state(declared, shape, message, tmp_path):
    """The rule for any method: a state written on mesh {data: 8} restores onto {data: 4} when its
    arrays keep their shapes and the method does not declare `state_depends_on_mesh`; otherwise
    a ConfigError names both meshes and what to do."""
    from types import SimpleNamespace

    config = default_config()
    config.method = "x"
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(5, {"w": np.arange(24.0).reshape(8, 3)}, {"method": "x", "mesh": {"data": 8}, "devices": 8,
                                                        "run": rundir.run_identity(config)})
    method = SimpleNamespace(state_depends_on_mesh=declared, stale=None, workers=None, info={})
    mesh = SimpleNamespace(shape={"data": 4}, devices=np.zeros(4))
    like = {"w": jax.device_put(np.zeros(shape))}
    if message is None:
        state, _ = rundir.restore_state(ckpt, 5, like, method, mesh, config)
        np.testing.assert_array_equal(state["w"], np.arange(24.0).reshape(8, 3))
    else:
        with pytest.raises(ConfigError, match=message) as err:
            rundir.restore_state(ckpt, 5, like, method, mesh, config)
        assert "{'data': 8} (8 devices); this run has mesh {'data': 4} (4 devices)" in str(err.value)
        assert "start a fresh --workdir" in str(err.value)
    ckpt.close()


def test_a_mesh_axis_of_size_one_is_no_other_mesh(tmp_path):
    """A state that depends on the mesh, written on {'stage': 4, 'data': 1} (what `cdpjax train`
    names a stage-axis method's mesh on 4 devices), restores where the run's mesh is {'stage': 4}
    (what a config may give): an axis of size 1 splits nothing, the devices hold the same pieces.
    {'stage': 2, 'data': 2} is another mesh and is refused."""
    from types import SimpleNamespace

    config = default_config()
    config.method = "x"
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(5, {"w": np.arange(12.0).reshape(4, 3)}, {"method": "x", "mesh": {"stage": 4, "data": 1},
                                                        "devices": 4, "run": rundir.run_identity(config)})
    method = SimpleNamespace(state_depends_on_mesh=True, stale=None, workers=None, info={})
    like = {"w": jax.device_put(np.zeros((4, 3)))}
    state, _ = rundir.restore_state(ckpt, 5, like, method, SimpleNamespace(shape={"stage": 4}, devices=np.zeros(4)),
                                    config)
    np.testing.assert_array_equal(state["w"], np.arange(12.0).reshape(4, 3))
    with pytest.raises(ConfigError, match="train state depends on the mesh"):
        rundir.restore_state(ckpt, 5, like, method, SimpleNamespace(shape={"stage": 2, "data": 2},
                                                                    devices=np.zeros(4)), config)
    ckpt.close()


@pytest.mark.parametrize("src,dst", [("dp", "e2e"), ("e2e", "dp")])
def test_dp_and_e2e_checkpoints_are_interchangeable(src, dst, reference, tmp_path):
    """A dp run on 8 devices continues as e2e on one device (and back): same update rule, same
    state; the end equals the uninterrupted run to float tolerance."""
    ref = reference(src)
    work = tmp_path / "moved"
    shutil.copytree(ref["killed"], work)
    mesh, devices = layout(dst)
    c = small_config(dst, mesh=mesh)
    assert train.train(c, str(work), progress=False, devices=devices)["resumed_from"] == RESUMED_FROM
    _, params, _ = final_state(c, work, devices)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4), params, ref["params"])


# 3. Non-finite values --------------------------------------------------------------------------

@pytest.mark.parametrize("name", SOME_METHODS)
def test_nonfinite_stops_naming_step_and_stage(name, tmp_path, monkeypatch):
    """A batch of NaN images at step 3 (checkpoints every 2): training stops with NonFiniteError
    naming step 3 and the stage (or the in-flight state) where it showed; checkpoint 2 is kept,
    finite, and metrics.jsonl holds no NaN."""
    require(name)
    Recorder(monkeypatch, poison=(2,))
    c = small_config(name, checkpoint_every=2, eval_every=0)
    mesh, devices = layout(name)
    with pytest.raises(NonFiniteError) as err:
        train.train(c, str(tmp_path), progress=False, devices=devices)
    message = str(err.value)
    assert re.search(r"non-finite values at step 3 in (stage \d+|the in-flight state|the loss)", message), message
    assert "the last good checkpoint (step 2)" in message and "nonfinite=skip" in message
    monkeypatch.undo()
    state, params, _ = final_state(c, tmp_path, devices)
    assert steps(tmp_path) == [2]
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state) if np.asarray(x).dtype.kind == "f")
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        assert all(np.isfinite(v) for v in json.loads(line).values() if isinstance(v, float))


def test_nonfinite_names_the_first_stage_that_broke(tmp_path, monkeypatch):
    """e2e with NaN images: every stage's gradient is NaN, stage 0 is named first."""
    Recorder(monkeypatch, poison=(2,))
    with pytest.raises(NonFiniteError, match=r"at step 3 in stage 0: its parameters after the update"):
        train.train(small_config("e2e", checkpoint_every=2, eval_every=0), str(tmp_path), progress=False,
                    devices=layout("e2e")[1])


@pytest.mark.parametrize("name", SOME_METHODS)
def test_nonfinite_skip_drops_the_step_and_counts_it(name, reference, tmp_path, monkeypatch):
    """With nonfinite='skip', two NaN batches slotted into the stream are skipped and counted; the
    whole state is left as it was at those steps, so the run ends exactly where the run without
    them ends (pipelines and CDP included: nothing of the bad batch stays in flight)."""
    require(name)
    ref = reference(name)
    Recorder(monkeypatch, poison=(3, 7), insert=True)
    c = small_config(name, nonfinite="skip", num_steps=STEPS + 2, checkpoint_every=0, eval_every=0)
    out = train.train(c, str(tmp_path), progress=False, devices=layout(name)[1])
    assert out["skipped_steps"] == 2
    monkeypatch.undo()
    _, params, meta = final_state(c, tmp_path, layout(name)[1])
    assert meta["skipped_steps"] == 2
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), params, ref["params"])


def test_nonfinite_from_the_command_line(tmp_path, capsys):
    """A learning rate of 1e30 diverges: `cdpjax train` exits with status 3 and one line naming
    the step and the stage, no traceback."""
    code = main(["train", "--no-progress", "--workdir", str(tmp_path), "--config.method=dp",
                 "--config.learning_rate=1e30", "--config.num_steps=20", "--config.checkpoint_every=1",
                 "--config.eval_every=0", "--config.global_batch_size=64"])
    err = capsys.readouterr().err
    assert code == 3, err
    assert re.search(r"non-finite values at step \d+ in (stage \d+|the loss)", err) and "Traceback" not in err
    step = int(re.search(r"at step (\d+)", err).group(1))
    assert steps(tmp_path) == list(range(1, step))[-2:]  # the good ones (two are kept), none after


# 4. Bad input ----------------------------------------------------------------------------------

def _fails(args, message, capsys, workdir, compiles, train_step_only=False):
    code = main(["train", "--no-progress", "--workdir", str(workdir), *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err, err
    assert "Traceback" not in err
    # One line; before it, at most the notice that a dead run's lock was taken over.
    lines = [line for line in err.strip().splitlines() if not line.startswith("cdpjax: took over the lock")]
    assert len(lines) == 1, err
    assert not any("guarded_train_step" in name for _, name in compiles), compiles
    if not train_step_only:  # nothing at all compiled (checkpoint errors come after the state's init)
        assert not [c for c in compiles if c[0] == "backend"], compiles
    assert not (workdir / "summary.json").exists()
    return err


BAD_CONFIG = [
    (["--config.augment='yes'"], "augment must be True or False, got 'yes'"),
    (["--config.method=[1]"], "method must be a string"),
    (["--config.model_kwargs.widht=64"],
     "model_kwargs.widht is not an option of model 'mlp'; its options: depth, width"),
    (["--config.model_kwargs.norm='batch'"], "model_kwargs.norm is set by the config key 'norm'"),
    (["--config.dataset_kwargs.split='x'"], "dataset_kwargs.split is not an option of dataset 'digits'"),
    (["--config.data_dir='/no/such/dir'"], "data_dir='/no/such/dir' is not a directory"),
    (["--config.stages=[3, 1]"], "split points must be strictly increasing"),
    (["--config.stages=[1, 'x']"], "split points must be integers"),
    (["--config.momentum=1.5"], "momentum=1.5 is out of range: must be in [0.0, 1.0]"),
    (["--config.seed=-1"], "seed=-1 is out of range: must be >= 0"),
    (["--config.log_every=0"], "log_every=0 is out of range: must be >= 1"),
    (["--config.num_steps=2.5"], "num_steps must be an integer, got 2.5"),
    (["--config.optimizer=adam", "--config.nesterov=True"], "nesterov=True needs optimizer='sgd'"),
    (["--config.num_steps=10", "--config.warmup_steps=10"], "warmup_steps=10 must be < num_steps=10"),
    (["--config.schedule=step", "--config.decay_every=700"], "decay_every=700 > num_steps=600 never decays"),
    (["--config.nonfinite=ignore"], "nonfinite='ignore' is not one of stop, skip"),
    (["--config.mesh.pipe=2"], "unknown mesh axis 'pipe'"),
    (["--config.mesh.data=-1", "--config.mesh.stage=-1"], "more than one axis of size -1"),
    (["--config.distributed.num_processes=2"], "without a coordinator address"),
    (["--config.distributed.coordinator_address='host'"], "must be HOST:PORT"),
    (["--config.distributed.coordinator_address='h:1'"], "needs the process count"),
    (["--config.distributed.coordinator_address='h:1'", "--config.distributed.num_processes=2",
      "--config.distributed.process_id=2"], "distributed.process_id=2 must be in [0, 2)"),
    (["--config.distributed.timeout_s=0"], "distributed.timeout_s=0 is out of range"),
    (["--config.method=gpipe", "--config.mesh.stage=2", "--config.mesh.data=4"],
     "table runs on 4 stage devices but mesh.stage=2"),
    (["--config.method=ppll", "--config.mesh.stage=8"], "4 local modules (stages) on one device at most: mesh.stage=8"),
]


@pytest.mark.parametrize("args,message", BAD_CONFIG, ids=[m for _, m in BAD_CONFIG])
def test_bad_config_fails_before_compiling(args, message, capsys, tmp_path, compiles):
    _fails(["--config.method=dp", *args], message, capsys, tmp_path, compiles)


def test_config_file_with_a_misspelt_key(tmp_path, capsys, compiles):
    path = tmp_path / "c.py"
    path.write_text("from cdpjax.config import default_config\n\ndef get_config():\n"
                    "    c = default_config()\n    c.learnig_rate = 0.05\n    return c\n")
    _fails(["--config", str(path)], "unknown config key 'learnig_rate'", capsys, tmp_path / "w", compiles)


def test_dataset_not_prepared(tmp_path, capsys, compiles):
    if "cifar10" not in data_lib.REGISTRY:
        pytest.skip("the tensorflow-datasets loaders are not importable here")
    _fails(["--config.method=dp", "--config.dataset=cifar10", f"--config.data_dir={tmp_path}",
            "--config.model=mlp"], "is not prepared", capsys, tmp_path / "w", compiles)


def _fake_dataset(image_shape, read_shape, labels=lambda idx: np.asarray(idx) % 10):
    def make(**_):
        def read(split, idx):
            return np.zeros((len(idx), *read_shape), np.float32), labels(idx).astype(np.int32)

        return Dataset("fake", image_shape, 10, 256, 32, read)

    return make


@pytest.mark.parametrize("read_shape,labels,message", [
    ((7, 7, 1), lambda idx: np.asarray(idx) % 10, "gives training images of shape (7, 7, 1)"),
    ((8, 8, 1), lambda idx: np.asarray(idx) % 10 + 5, "labels in [5, 14], outside [0, 10)"),
], ids=["image-shape", "label-range"])
def test_dataset_that_does_not_give_what_it_declares(read_shape, labels, message, tmp_path, capsys, compiles):
    with data_lib.REGISTRY.temporarily("fake", _fake_dataset((8, 8, 1), read_shape, labels)):
        _fails(["--config.method=dp", "--config.dataset=fake"], message, capsys, tmp_path, compiles)


def test_resume_without_a_checkpoint(tmp_path, capsys, compiles):
    _fails(["--config.method=dp", "--resume"], "nothing to resume", capsys, tmp_path / "never-ran", compiles)
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    _fails(["--config.method=dp", "--resume"], "holds no complete checkpoint", capsys, tmp_path / "empty",
           compiles)


def test_checkpoint_path_that_is_a_file(tmp_path, capsys, compiles):
    (tmp_path / "checkpoints").write_text("not a directory")
    _fails(["--config.method=dp"], "exists and is not a directory", capsys, tmp_path, compiles)


def test_corrupt_checkpoint(dp_reference, tmp_path, capsys):
    """The latest checkpoint damaged on disk (every file cut in half): named in one line, set
    aside (renamed, kept), and the run resumes from the previous complete checkpoint (step 8),
    saying so, to the uninterrupted run's end. (Single flipped bits and damaged meta fields:
    test_faults.py.)"""
    work = tmp_path / "run"
    shutil.copytree(dp_reference["full"], work)
    (work / "summary.json").unlink()
    _damage(work / "checkpoints" / str(STEPS) / "state")
    code = main(["train", "--no-progress", "--workdir", str(work), *_overrides("dp")])
    err = capsys.readouterr().err
    assert code == 0 and "Traceback" not in err, err
    named = [line for line in err.splitlines() if f"checkpoint {STEPS} in" in line]
    assert len(named) == 1 and "damaged" in named[0] and "resuming from checkpoint 8" in named[0], err
    assert [p.name.startswith(f"{STEPS}.damaged-") for p in (work / "checkpoints").iterdir()].count(True) == 1
    state, _, _ = final_state(small_config("dp"), work, layout("dp")[1])
    _equal_trees(state, dp_reference["state"])


@pytest.mark.parametrize("change,message", [
    (["--config.seed=1"], "seed=0 there, 1 here"),
    (["--config.global_batch_size=64"], "global_batch_size=128 there, 64 here"),
    (["--config.method=cdp-v2"], "method='dp' there, 'cdp-v2' here"),
])
def test_resume_with_another_config(change, message, dp_reference, tmp_path, capsys, compiles):
    """Resuming a WORKDIR with a config that changes the data stream or the state is refused."""
    if "cdp-v2" in change[0]:
        require("cdp-v2")
    work = tmp_path / "run"
    shutil.copytree(dp_reference["killed"], work)
    err = _fails([*_overrides("dp"), *change], message, capsys, work, compiles, train_step_only=True)
    assert "fresh --workdir" in err


# 5. Determinism --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["dp", "cdp-v2"])
def test_rerun_gives_identical_metrics(name, reference, tmp_path):
    """The same config and seed, run again: metrics.jsonl identical byte for byte once the timing
    fields are cut out of each line."""
    require(name)
    again = train.train(small_config(name), str(tmp_path), progress=False, devices=layout(name)[1])
    assert without_timing((tmp_path / "metrics.jsonl").read_text()) == without_timing(
        (reference(name)["full"] / "metrics.jsonl").read_text())
    assert again["test_accuracy"] == reference(name)["summary"]["test_accuracy"]


# 6. Exactly once -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", SOME_METHODS)  # the trainer feeds and flushes every engine alike
def test_every_example_once_per_epoch(name, reference):
    """Over 12 steps of 128 (one epoch of 1,497 images and 39 of the next), the trainer reads each
    batch once, feeds each once to the method, in stream order, and flushes a pipeline once at
    the end, so that in-flight batches are trained on too: every example of epoch 0 exactly once,
    none of epoch 1 twice."""
    require(name)
    ref = reference(name)
    n = data_lib.build(small_config(name)).num_train
    reads = np.concatenate(ref["reads"])
    assert len(ref["reads"]) == STEPS and ref["fed"] == STEPS
    assert ref["flushes"] == (1 if ref["has_flush"] else 0)
    expected = np.concatenate([stream_indices(k, 128, n, 0) for k in range(STEPS)])
    np.testing.assert_array_equal(reads, expected)
    np.testing.assert_array_equal(np.sort(reads[:n]), np.arange(n))
    assert len(np.unique(reads[n:])) == len(reads) - n


@pytest.mark.parametrize("batch,processes", [(128, 1), (100, 4), (64, 2)])
def test_stream_is_exactly_once_for_any_batch_and_process_count(batch, processes):
    """Three epochs of the stream with batches straddling epochs, each process reading its own
    slice: the slices tile every global batch, and every example appears once per epoch."""
    ds = data_lib.build(default_config())
    n, steps = ds.num_train, -(-3 * ds.num_train // batch)
    seen = []
    for step in range(steps):
        parts = [ds.train_batch(step, batch, 0, False, p, processes)["label"] for p in range(processes)]
        whole = ds.train_batch(step, batch, 0, False)["label"]
        np.testing.assert_array_equal(np.concatenate(parts), whole)
        seen.append(stream_indices(step, batch, n, 0))
    seen = np.concatenate(seen)
    for epoch in range(3):
        np.testing.assert_array_equal(np.sort(seen[epoch * n:(epoch + 1) * n]), np.arange(n))
