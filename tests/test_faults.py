"""Faults and hostile input, as an operator meets them (issue 19): a damaged checkpoint is named and
the run resumes from the newest intact one; --force stops the old run before its next checkpoint
and the forcing run ends whole; Ctrl-C and SIGTERM at any moment end in one line (a checkpoint
being written is finished first); a full disk is one line naming the file and the last complete
checkpoint, with nothing left half written; a peer's death in a multi-process run is one line in
every survivor; a run thawed after losing its directory writes nothing; and hostile overrides,
config files, work-directory files, time tables and output paths are each one line, exit 2, no
traceback, nothing compiled.

Runs are dp on digits, a 4-stage MLP, 12 steps of 128 (checkpoints every 4): one uninterrupted
run (the reference) and one stopped after step 10 (checkpoints 4 and 8) are shared by the tests,
each working on its own copy. Subprocesses are given no time limit where they are expected to
end (a loaded machine is slow, not wrong); where a test waits for something, the limits are
generous.
"""
import ast
import errno
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from cdpjax import data as data_lib
from cdpjax import distributed, rundir, train
from cdpjax import setup as setup_lib
from cdpjax.errors import NonFiniteError
from cdpjax.checkpoint import Checkpointer
from cdpjax.cli import main
from cdpjax.config import default_config
from metrics_lines import without_timing

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = 12
OVERRIDES = ["--config.method=dp", f"--config.num_steps={STEPS}", "--config.checkpoint_every=4",
             "--config.eval_every=4", "--config.log_every=3", "--config.global_batch_size=128",
             "--config.schedule=constant"]
WAIT_S = 3600  # the longest a test waits for something that comes within seconds on a quiet machine


def small_config(**overrides):
    c = default_config()
    c.method, c.num_steps, c.checkpoint_every, c.eval_every, c.log_every = "dp", STEPS, 4, 4, 3
    c.global_batch_size, c.schedule = 128, "constant"
    for k, v in overrides.items():
        c[k] = v
    return c


def cli_train(workdir, *extra):
    return ["train", "--no-progress", "--workdir", str(workdir), "--cpu-devices", "8", *OVERRIDES, *extra]


def subprocess_command(workdir, *extra, overrides=OVERRIDES):
    """`cdpjax train` as a user starts it, with Ctrl-C's handler set (a shell that starts the tests
    in the background makes its children ignore SIGINT)."""
    boot = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "from cdpjax.cli import main; sys.exit(main())")
    return [sys.executable, "-c", boot, "train", "--no-progress", "--workdir", str(workdir), "--cpu-devices", "8",
            *overrides, *extra]


def env_without_device_flag(**extra):
    """The environment for a `cdpjax train` subprocess: it sets its own device count."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if not f.startswith("--xla_force_host_platform_device_count"))
    env.update({k: str(v) for k, v in extra.items()})
    return env


# Lines a run says before it fails, which are not the failure.
BEFORE = ("cdpjax: took over the lock", "cdpjax: 8 simulated CPU devices", "cdpjax: 4 simulated CPU devices",
          "cdpjax: training dp", "cdpjax: resuming dp", "cdpjax: compiling ", "cdpjax: compiled ")


def the_line(err: str, start: str = "cdpjax") -> str:
    """The one line of a failure: no traceback, nothing from C++ or asyncio, exactly one line
    (besides what a run says before: a takeover notice, the devices, `training ...`), returned."""
    assert "Traceback" not in err and "Exception ignored" not in err and "Event loop is closed" not in err, err
    assert "Check failure" not in err and not re.search(r"^[FE]\d{4} ", err, re.M), err
    lines = [line for line in err.strip().splitlines() if not line.startswith(BEFORE)]
    assert len(lines) == 1 and lines[0].startswith(start), err
    return lines[0]


def fails(args, capfd, compiles=None, code=2) -> str:
    """`cdpjax ARGS` in this process: the exit status, one line, nothing compiled."""
    got = main(args)
    err = capfd.readouterr().err
    assert got == code, err
    line = the_line(err)
    if compiles is not None:
        assert not [c for c in compiles if c[0] == "backend"], compiles
    return line


def final_state(workdir):
    _, _, method = setup_lib.setup(small_config())
    ckpt = Checkpointer(str(workdir))
    state, _ = ckpt.restore(ckpt.latest_step(), method.init(jax.random.key(0)))
    ckpt.close()
    return jax.device_get(state)


def equal_trees(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(np.testing.assert_array_equal, a, b)


def steps(workdir):
    return sorted(int(p.name) for p in (pathlib.Path(workdir) / "checkpoints").iterdir() if p.name.isdigit())


def leftovers(workdir):
    """Temporary files and directories a write left behind."""
    return [str(p) for p in pathlib.Path(workdir).rglob("*")
            if re.search(r"\.tmp$|\.tmp-\d+$|orbax-checkpoint-tmp", p.name)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted run (its final state and metrics) and a run stopped after step 10, with
    checkpoints 4 and 8, as a process killed then leaves it (its lock released: no live owner)."""
    root = tmp_path_factory.mktemp("runs")
    train.train(small_config(), str(root / "full"), progress=False)
    assert train.train(small_config(), str(root / "stopped"), progress=False, stop_after=10) == {"stopped_at": 10}
    assert steps(root / "stopped") == [4, 8]
    return {"full": root / "full", "stopped": root / "stopped", "state": final_state(root / "full"),
            "metrics": without_timing((root / "full" / "metrics.jsonl").read_text())}


def copy_of(runs, tmp_path, name="stopped"):
    work = tmp_path / "run"
    shutil.copytree(runs[name], work)
    return work


# 1. A damaged checkpoint ---------------------------------------------------------------------------

def _largest_array_file(checkpoint):
    files = [p for p in (checkpoint / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    return max(files, key=lambda p: p.stat().st_size)


def _flip(path, count):
    data = bytearray(path.read_bytes())
    for k in range(count):  # as the operator did: b[n] ^= 0x40, in the middle of the largest file
        data[len(data) // 2 + 8 * k] ^= 0x40
    path.write_bytes(bytes(data))


def _edit_meta(checkpoint, **fields):
    path = checkpoint / "meta" / "metadata"
    meta = json.loads(path.read_text())
    meta.update(fields)
    path.write_text(json.dumps(meta))


DAMAGE = {
    "one-flipped-bit": lambda c: _flip(_largest_array_file(c), 1),
    "sixteen-flipped-bytes": lambda c: _flip(_largest_array_file(c), 16),
    "meta-mesh-5": lambda c: _edit_meta(c, mesh=5),
    "meta-skipped-steps-text": lambda c: _edit_meta(c, skipped_steps="x"),
    "meta-time-text": lambda c: _edit_meta(c, time="soon"),
    "meta-log-window-5": lambda c: _edit_meta(c, log_window=5),
    "meta-log-window-edited": lambda c: _edit_meta(c, log_window=[{"loss": 0.5, "accuracy": 0.9}]),
    "manifest-removed": lambda c: (c / "state" / "manifest.ocdbt").unlink(),
    # A folder copied or renamed to another step's name (`cp -a checkpoints/4 checkpoints/8`).
    "copy-of-4": lambda c: (shutil.rmtree(c), shutil.copytree(c.parent / "4", c)),
    # The fields that guard the bytes removed: what they guarded cannot be taken on trust.
    "meta-without-digest": lambda c: _drop_meta(c, "digest"),
    "meta-without-digest-checksums": lambda c: (_drop_meta(c, "digest", "checksums"), _flip(_largest_array_file(c), 1)),
    "meta-without-step": lambda c: _drop_meta(c, "step"),
}


def _drop_meta(checkpoint, *keys):
    path = checkpoint / "meta" / "metadata"
    meta = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in meta.items() if k not in keys}))


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_a_damaged_newest_checkpoint_is_named_and_the_run_resumes_from_the_intact_one(damage, runs, tmp_path,
                                                                                      capfd):
    """Checkpoint 8, the newest, damaged on disk (one bit of an array, 16 bytes, a meta field of
    the wrong type or a plausible edit, orbax's manifest gone): the same command names it in one
    line, sets it aside (renamed, kept) and resumes from checkpoint 4, saying so; the run ends
    bit for bit as the uninterrupted one, which it could not if any byte of 8 were used."""
    work = copy_of(runs, tmp_path)
    DAMAGE[damage](work / "checkpoints" / "8")
    assert main(cli_train(work)) == 0
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Event loop is closed" not in err, err
    named = [line for line in err.splitlines() if "checkpoint 8" in line]
    assert len(named) == 1 and "damaged" in named[0] and "resuming from checkpoint 4, the newest intact one" in \
        named[0], err
    assert f"resuming dp / mlp / digits in {work} from step 4" in err
    assert [p.name.split(".")[1].split("-")[0] for p in (work / "checkpoints").iterdir()
            if p.name.startswith("8.")] == ["damaged"]
    equal_trees(final_state(work), runs["state"])
    assert without_timing((work / "metrics.jsonl").read_text()) == runs["metrics"]


def test_an_empty_checkpoint_directory_past_the_run_is_set_aside_not_taken_for_its_end(runs, tmp_path, capfd,
                                                                                      caplog):
    """An empty `checkpoints/99` (a copy cut short, a hand-made folder) beside checkpoints 4 and 8
    of a 12-step run: not "holds checkpoint 99, past num_steps", but one line naming 99 damaged
    and set aside, the run resuming from 8 and ending as the uninterrupted one; orbax's notices
    about the missing metadata file do not reach the terminal."""
    work = copy_of(runs, tmp_path)
    (work / "checkpoints" / "99").mkdir()
    assert main(cli_train(work)) == 0
    err = capfd.readouterr().err
    assert "WARNING" not in err and "Metadata file" not in err and "past num_steps" not in err, err
    assert not [r for r in caplog.records if "Metadata file" in r.getMessage()]  # absl's logger, as the CLI has it
    named = [line for line in err.splitlines() if "checkpoint 99" in line]
    assert len(named) == 1 and "damaged" in named[0] and "resuming from checkpoint 8, the newest intact one" in \
        named[0], err
    assert not (work / "checkpoints" / "99").exists()
    equal_trees(final_state(work), runs["state"])
    assert without_timing((work / "metrics.jsonl").read_text()) == runs["metrics"]


@pytest.mark.parametrize("saved_config", ["removed", "empty"])
@pytest.mark.parametrize("override,diff", [("--config.seed=1", "seed=0 there, 1 here"),
                                           ("--config.global_batch_size=64", "global_batch_size=128 there, 64 here")],
                         ids=["seed", "batch"])
def test_checkpoints_of_another_run_are_refused_whatever_config_json_says(override, diff, saved_config, runs,
                                                                          tmp_path, capfd, compiles):
    """Checkpoints of a run with another seed or batch size (here: the command changes it), with
    WORKDIR/config.json removed or replaced by `{}`: each checkpoint's own record of its run
    refuses the resume in one line naming the value there and here, exit 2, nothing compiled
    and nothing changed."""
    work = copy_of(runs, tmp_path)
    if saved_config == "removed":
        (work / "config.json").unlink()
    else:
        (work / "config.json").write_text("{}")
    line = fails(cli_train(work, override), capfd, compiles)
    assert f"checkpoint 8 in {work}/checkpoints belongs to another run ({diff})" in line, line
    assert steps(work) == [4, 8]


def test_a_changed_hyperparameter_is_said_and_refused_under_strict_resume(runs, tmp_path, capfd, compiles):
    """A resume with another momentum and weight decay (which the train state allows): one line at
    start-up says each change, from what to what, and the run goes on; with
    checkpoint.strict_resume the same is refused in one line, exit 2, nothing compiled."""
    work = copy_of(runs, tmp_path)
    changes = ["--config.momentum=0.5", "--config.weight_decay=0.0"]
    fails(cli_train(work, *changes, "--config.checkpoint.strict_resume=True"), capfd, compiles)
    assert main(cli_train(work, *changes)) == 0
    err = capfd.readouterr().err
    said = [line for line in err.splitlines() if "hyperparameters changed" in line]
    assert said == ["cdpjax: resuming with hyperparameters changed since checkpoint 8: momentum 0.9 -> 0.5, "
                    "weight_decay 0.0005 -> 0.0 (--config.checkpoint.strict_resume=True refuses this)"], err


def _edit_a_digit(path):
    lines = path.read_text().splitlines(keepends=True)
    edited = re.sub(r'("loss": \d\.\d)(\d)', lambda m: m.group(1) + str((int(m.group(2)) + 1) % 10), lines[0], count=1)
    assert edited != lines[0]
    lines[0] = edited
    path.write_text("".join(lines))


HISTORY_CHANGES = {
    "a-digit": _edit_a_digit,
    "a-line-twice": lambda path: path.write_text(path.read_text().splitlines(keepends=True)[0] + path.read_text()),
    "deleted": lambda path: path.unlink(),
}


@pytest.mark.parametrize("change", [*HISTORY_CHANGES, "untouched"])
def test_a_resume_says_when_the_metrics_history_changed_since_its_checkpoint(change, runs, tmp_path, capfd):
    """metrics.jsonl changed after checkpoint 8 was saved (a digit of a line before it, a line
    twice, the file deleted): the resume says so in one line naming the file and the step, and
    goes on; untouched, it says nothing of the kind."""
    work = copy_of(runs, tmp_path)
    if change != "untouched":
        HISTORY_CHANGES[change](work / "metrics.jsonl")
    assert main(cli_train(work)) == 0
    err = capfd.readouterr().err
    said = [line for line in err.splitlines() if "is not what the run had written" in line]
    if change == "untouched":
        assert said == [], err
    else:
        assert said == [f"cdpjax: {work}/metrics.jsonl up to step 8 is not what the run had written when it saved "
                        f"checkpoint 8 (a line changed, added or removed, or the file deleted); the run goes on with "
                        f"it as it is"], err


def test_checkpoint_keep_sets_the_retention(tmp_path):
    """checkpoint.keep=3: the three newest checkpoints stay (the default, 2, keeps two: the
    `runs` fixture's 8 and 12)."""
    train.train(small_config(checkpoint={"keep": 3, "strict_resume": False}), str(tmp_path / "run"), progress=False)
    assert steps(tmp_path / "run") == [4, 8, 12]


@pytest.mark.parametrize("damaged,named", [((), 8), ((8,), 6), ((8, 6), None)])
def test_a_checkpoint_past_num_steps_is_refused_unless_damaged(damaged, named, runs, tmp_path, capfd, compiles):
    """Checkpoints 4, 6 (added: the same run's, from a run of it that checkpointed at 6, since a
    copy of 4 under 6's name is damaged: its meta says 4) and 8 and `--config.num_steps=5`: the
    newest intact one past 5 is named (8; 6 where 8 is damaged) in one line, exit 2, nothing
    compiled; with both damaged, the run sets them aside and resumes from 4."""
    work = copy_of(runs, tmp_path)
    six = tmp_path / "six"
    assert train.train(small_config(checkpoint_every=6), str(six), progress=False, stop_after=6) == {"stopped_at": 6}
    shutil.copytree(six / "checkpoints" / "6", work / "checkpoints" / "6")
    compiles.clear()  # that run's programs; the refusal below compiles none
    for step in damaged:
        shutil.rmtree(work / "checkpoints" / str(step) / "meta")
    if named is None:
        assert main(cli_train(work, "--config.num_steps=5")) == 0
        assert "resuming from checkpoint 4, the newest intact one" in capfd.readouterr().err
        return
    line = fails(cli_train(work, "--config.num_steps=5"), capfd, compiles)
    assert line == (f"cdpjax: error: WORKDIR {work} holds checkpoint {named}, past num_steps=5: set "
                    f"--config.num_steps={named} or more, or use a fresh --workdir"), line


def test_nonfinite_after_a_fall_back_names_the_intact_checkpoint(runs, tmp_path, monkeypatch):
    """Checkpoint 8 damaged, the run resumes from 4, and step 6 meets a batch of NaN images: the
    error names checkpoint 4, the last good one, not the damaged 8."""
    work = copy_of(runs, tmp_path)
    _flip(_largest_array_file(work / "checkpoints" / "8"), 1)
    build = data_lib.build

    class Poisoned:
        """The dataset, with NaN images in the batch of step 6 (index 5)."""

        def __init__(self, base):
            self.base = base

        def __getattr__(self, name):
            return getattr(self.base, name)

        def train_batch(self, step, *args, **kwargs):
            b = self.base.train_batch(step, *args, **kwargs)
            return {**b, "image": np.full_like(b["image"], np.nan)} if step == 5 else b

    monkeypatch.setattr(data_lib, "build", lambda config: Poisoned(build(config)))
    with pytest.raises(NonFiniteError, match=r"at step 6 .* the last good checkpoint \(step 4\)"):
        train.train(small_config(), str(work), progress=False)


# 2. --force ---------------------------------------------------------------------------------------

FORCE_STEPS = 300
FORCE_OVERRIDES = ["--config.method=dp", f"--config.num_steps={FORCE_STEPS}", "--config.checkpoint_every=5",
                   "--config.eval_every=0", "--config.log_every=5", "--config.global_batch_size=128",
                   "--config.schedule=constant"]


def test_force_during_checkpoints_stops_the_old_run_and_the_forcing_run_ends_whole(tmp_path):
    """A run checkpointing every 5 steps, then the same command with --force: the old run stops at
    its next step with one line saying who took over (exit 2) and writes nothing more; the
    forcing run takes the lock, waits for the old one to be gone, resumes from a complete
    checkpoint and ends as an uninterrupted run does: final state and metrics.jsonl (timing
    fields cut out) equal, no leftover, no lock."""
    reference = tmp_path / "reference"
    c = small_config(num_steps=FORCE_STEPS, checkpoint_every=5, eval_every=0, log_every=5)
    train.train(c, str(reference), progress=False)
    work = tmp_path / "run"
    old = subprocess.Popen(subprocess_command(work, overrides=FORCE_OVERRIDES),
                           env=env_without_device_flag(**{rundir.DELAY_ENV: 0.1}),
                           stderr=subprocess.PIPE, text=True)
    deadline = time.time() + WAIT_S
    while not (work / "checkpoints").is_dir() or len(steps(work)) < 2:
        assert old.poll() is None, old.communicate()[1][-3000:]
        assert time.time() < deadline
        time.sleep(0.1)
    forcing = subprocess.Popen(subprocess_command(work, "--force", overrides=FORCE_OVERRIDES),
                               env=env_without_device_flag(), stderr=subprocess.PIPE, text=True)
    _, forcing_err = forcing.communicate()
    _, old_err = old.communicate()
    assert old.returncode == 2, old_err[-3000:]
    line = the_line(old_err)
    assert f"was taken over by process {forcing.pid} on host {socket.gethostname()}" in line, line
    assert "this run stops" in line and "writing nothing more" in line, line
    assert forcing.returncode == 0, forcing_err[-3000:]
    assert "forced (--force)" in forcing_err and f"process {old.pid} " in forcing_err, forcing_err
    summary = json.loads((work / "summary.json").read_text())
    assert 0 < summary["resumed_from"] < FORCE_STEPS
    assert without_timing((work / "metrics.jsonl").read_text()) == without_timing(
        (reference / "metrics.jsonl").read_text())
    _, _, method = setup_lib.setup(c)
    states = []
    for d in (work, reference):
        ckpt = Checkpointer(str(d))
        states.append(jax.device_get(ckpt.restore(FORCE_STEPS, method.init(jax.random.key(0)))[0]))
        ckpt.close()
    equal_trees(*states)
    assert leftovers(work) == [] and not (work / "lock.json").exists()


@pytest.mark.heavy  # over 2 minutes: the forcing run waits 120 s for the frozen one
def test_a_thawed_owner_frozen_inside_a_checkpoint_write_cannot_break_a_force_takeover(tmp_path):
    """A run frozen (SIGSTOP) while orbax writes one of its checkpoints (its temporary directory
    there), the same command with --force (it waits for the frozen run, at most 120 s, then goes
    on), and the frozen run thawed (SIGCONT) once the forcing run resumes: the thawed writer
    finishes in its own temporary directory and stops with one line, and the forcing run
    completes its whole run, equal to an uninterrupted one, no leftover, no lock."""
    reference = tmp_path / "reference"
    c = small_config(num_steps=FORCE_STEPS, checkpoint_every=5, eval_every=0, log_every=5)
    train.train(c, str(reference), progress=False)
    work = tmp_path / "run"
    old = subprocess.Popen(subprocess_command(work, overrides=FORCE_OVERRIDES),
                           env=env_without_device_flag(**{rundir.DELAY_ENV: 0.05}), stderr=subprocess.PIPE, text=True)
    deadline = time.time() + WAIT_S
    while True:  # frozen inside a write: its temporary directory is there once it is stopped
        assert old.poll() is None and time.time() < deadline, old.communicate()[1][-3000:]
        if [p for p in (work / "checkpoints").glob("*orbax-checkpoint-tmp*")] if (work / "checkpoints").is_dir() \
                else []:
            os.kill(old.pid, signal.SIGSTOP)
            if list((work / "checkpoints").glob("*orbax-checkpoint-tmp*")):
                break
            os.kill(old.pid, signal.SIGCONT)
        time.sleep(0.002)
    forcing = subprocess.Popen(subprocess_command(work, "--force", overrides=FORCE_OVERRIDES),
                               env=env_without_device_flag(), stderr=subprocess.PIPE, text=True)
    said = []
    for line in forcing.stderr:
        said.append(line)
        if line.startswith("cdpjax: resuming"):
            break
    os.kill(old.pid, signal.SIGCONT)
    forcing_err = "".join(said) + forcing.communicate()[1]
    _, old_err = old.communicate()
    assert forcing.returncode == 0, forcing_err[-3000:]
    # The thawed run ends in one line; seen: exit 2 (taken over) or 130 ("interrupted", cause not
    # found yet: the same was seen once in test_a_thawed_run_that_lost_its_directory_writes_nothing
    # on a loaded machine).
    assert old.returncode in (2, 130), old_err[-3000:]
    the_line(old_err)
    assert json.loads((work / "summary.json").read_text())["steps"] == FORCE_STEPS
    assert without_timing((work / "metrics.jsonl").read_text()) == without_timing(
        (reference / "metrics.jsonl").read_text())
    _, _, method = setup_lib.setup(c)
    ckpt = Checkpointer(str(work))
    equal_trees(jax.device_get(ckpt.restore(FORCE_STEPS, method.init(jax.random.key(0)))[0]),
                jax.device_get(Checkpointer(str(reference)).restore(FORCE_STEPS, method.init(jax.random.key(0)))[0]))
    ckpt.close()
    assert leftovers(work) == [] and not (work / "lock.json").exists()


# 3. Signals ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("signals", [
    [(0.0, signal.SIGTERM)], [(0.3, signal.SIGINT)], [(1.0, signal.SIGTERM)], [(2.0, signal.SIGINT)],
    [(3.0, signal.SIGINT), (3.1, signal.SIGINT)], [(5.0, signal.SIGTERM)], [(8.0, signal.SIGTERM)],
    [(12.0, signal.SIGINT)], [(1.0, signal.SIGHUP)],
], ids=lambda s: "+".join(f"{signal.Signals(n).name}@{t}s" for t, n in s))
def test_a_signal_at_any_moment_ends_in_one_line(signals, tmp_path):
    """SIGTERM or Ctrl-C (once or twice) at moments from the first line of `main` (the process
    says when that line has run: before it, a signal has no handler but Python's, as in any
    program) through the imports, JAX's start, the checks and compilation into training: exit
    status 143 or 130, one line (no traceback, no crash, nothing swallowed: the run does not go
    on), no lock left."""
    work = tmp_path / "run"
    command = subprocess_command(work, overrides=[*OVERRIDES[:1], "--config.num_steps=100000",
                                                  "--config.checkpoint_every=50"])
    said = ("from cdpjax import shutdown; first = shutdown.install; "
            "shutdown.install = lambda: (first(), print('main', flush=True))[0]; ")
    command[2] = command[2].replace("sys.exit(main())", said + "sys.exit(main())")
    proc = subprocess.Popen(command, env=env_without_device_flag(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline() == "main\n"
    start = time.time()
    for at, sig in signals:
        time.sleep(max(at - (time.time() - start), 0))
        if proc.poll() is None:
            proc.send_signal(sig)
    _, err = proc.communicate()
    first = signals[0][1]
    assert proc.returncode == (130 if first == signal.SIGINT else 128 + int(first)), err[-3000:]
    lines = [line for line in err.strip().splitlines() if line.startswith("cdpjax: ")
             and not line.startswith(("cdpjax: training", "cdpjax: 8 simulated", "cdpjax: compil"))]
    assert "Traceback" not in err and "Exception ignored" not in err, err
    how = "interrupted" if first == signal.SIGINT else f"terminated ({signal.Signals(first).name})"
    assert len(lines) == 1 and lines[0].startswith(f"cdpjax: {how}"), err
    assert "the same command" in lines[0]
    assert not (work / "lock.json").exists()


def held_in_checkpoint_write(work, step, release):
    """`cdpjax train` in WORKDIR `work`, once it is held inside the write of checkpoint `step`
    (the trainer's test hook: it waits there until `release` exists)."""
    env = env_without_device_flag(**{rundir.WAIT_IN_CHECKPOINT_ENV: step, rundir.WAIT_FILE_ENV: release})
    proc = subprocess.Popen(subprocess_command(work), env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + WAIT_S
    while not pathlib.Path(f"{release}.waiting").exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    return proc


def test_sigterm_during_a_checkpoint_write_keeps_the_checkpoint(runs, tmp_path):
    """SIGTERM while checkpoint 8 is being written (the write held open by a test hook): the
    process waits for the write to end (it is still alive while the write is held), then exits
    143 naming checkpoint 8 as the last complete one; the checkpoint restores (every checksum
    holds) and the run resumed from it ends as the uninterrupted one."""
    work, release = tmp_path / "run", tmp_path / "release"
    proc = held_in_checkpoint_write(work, 8, release)
    proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    assert proc.poll() is None  # the write in progress is waited for
    release.touch()
    _, err = proc.communicate()
    assert proc.returncode == 143, err[-3000:]
    line = the_line(err)
    assert line == (f"cdpjax: terminated (SIGTERM) at step 8; checkpoint 8 saved in {work}/checkpoints; "
                    f"run the same command to resume from it"), line
    assert steps(work) == [4, 8] and leftovers(work) == [] and not (work / "lock.json").exists()
    resumed = train.train(small_config(), str(work), progress=False)
    assert resumed["resumed_from"] == 8
    equal_trees(final_state(work), runs["state"])


@pytest.mark.parametrize("completed", [True, False])
def test_a_completed_run_exits_0_whatever_signal_arrives_after(completed):
    """Once the command has said the last line of a completed run (`shutdown.completed()`), a
    Ctrl-C or a SIGTERM ends the process with status 0 and no line; before it, the same signal
    ends it with 130 or 143 (the control)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        code = ("import os, signal, sys, time; signal.signal(signal.SIGINT, signal.default_int_handler); "
                "from cdpjax import shutdown; shutdown.install(); "
                + ("shutdown.completed(); " if completed else "")
                + f"os.kill(os.getpid(), {int(sig)}); time.sleep(60); sys.exit(5)")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ,
                              "PYTHONPATH": str(ROOT)})
        if completed:
            assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
        else:
            assert proc.returncode == (130 if sig == signal.SIGINT else 143), proc.stderr
            assert proc.stderr.count("\n") == 1, proc.stderr


def test_a_second_ctrl_c_says_how_long_the_checkpoint_write_was_waited_for(tmp_path):
    """Ctrl-C while checkpoint 8 is being written (held open by the test hook), then a second
    Ctrl-C about a second later: the write is given up and the line says after how long (about
    a second, not GRACE_S's 120), exit 130."""
    work, release = tmp_path / "run", tmp_path / "release"
    proc = held_in_checkpoint_write(work, 8, release)
    proc.send_signal(signal.SIGINT)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate()
    release.touch()
    assert proc.returncode == 130, err[-3000:]
    line = the_line(err)
    waited = float(re.search(r"given up after ([0-9.]+) s\)$", line).group(1))
    assert 0.5 <= waited < 60, line


# 4. Full disks, quotas, read-only file systems ------------------------------------------------------

def _can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                           capture_output=True)
    return probe.returncode == 0


@pytest.mark.parametrize("size,async_save", [("64k", False), ("680k", False), ("1200k", False), ("680k", True),
                                             ("1200k", True)], ids=lambda x: {True: "async", False: "sync"}.get(x, x))
def test_a_tmpfs_too_small_ends_in_one_line(size, async_save, tmp_path):
    """The work directory on a tmpfs of 64 kB (full at the first checkpoint), 680 kB (full inside
    the second checkpoint's arrays, where orbax's threads log tracebacks, some after the save has
    failed) or 1.2 MB (full at the third, after two complete ones), with synchronous and
    asynchronous saves: `cdpjax train` exits 2 with one line naming the file it could not write
    and the last complete checkpoint, no traceback, and leaves no temporary file behind."""
    if not _can_mount_tmpfs():
        pytest.skip("no tmpfs can be mounted here (unshare -rm); test_disk_errors_are_one_line covers it")
    mount = tmp_path / "small"
    mount.mkdir()
    work = mount / "run"
    command = shlex.join(subprocess_command(work, overrides=[*OVERRIDES[:1], "--config.num_steps=40",
                                                             "--config.checkpoint_every=4", "--config.eval_every=0",
                                                             "--config.global_batch_size=128",
                                                             f"--config.checkpoint.async_save={async_save}"]))
    script = (f"mount -t tmpfs -o size={size} tmpfs {mount} && "
              f"{{ {command}; echo \"rc=$?\"; find {mount} -print; du -s {mount}; }}")
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], env=env_without_device_flag(),
                          capture_output=True, text=True)
    out, err = proc.stdout, proc.stderr
    assert "rc=2" in out, out + err[-3000:]
    line = the_line(err)
    assert re.search(rf"cannot write {mount}/\S+: no space left on the device", line), line
    expected = "no complete checkpoint yet" if size == "64k" else "last complete checkpoint: step "
    # a checkpoint of this run is ~400 kB in 16-20 files, orbax's split of its arrays varying from run to
    # run (one CI run under heavy load filled a 560 kB tmpfs inside the first): 680 kB holds one with room
    assert expected in line, line + "\n" + out[-3000:]
    listed = out.splitlines()
    assert not [p for p in listed if re.search(r"\.tmp$|\.tmp-\d+$|orbax-checkpoint-tmp", p)], out
    assert not any(p.endswith("lock.json") for p in listed), out


@pytest.mark.parametrize("where,error", [
    ("checkpoint", errno.ENOSPC), ("checkpoint", errno.EDQUOT), ("metrics", errno.ENOSPC),
    ("metrics", errno.EROFS), ("lock", errno.ENOSPC), ("config", errno.EDQUOT),
])
def test_disk_errors_are_one_line(where, error, runs, tmp_path, capfd, monkeypatch):
    """The same without a small file system: the write that fails raises the OSError a full disk
    (ENOSPC), a quota (EDQUOT) or a read-only file system (EROFS) gives. One line, exit 2,
    naming the file and the last complete checkpoint; no temporary file left."""
    import builtins

    work = copy_of(runs, tmp_path)
    words = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is exceeded",
             errno.EROFS: "the file system is read-only"}[error]
    target = {"checkpoint": None, "metrics": "metrics.jsonl", "lock": "lock.json.", "config": "config.json.tmp"}[where]
    if where == "checkpoint":
        import orbax.checkpoint as ocp

        save = ocp.CheckpointManager.save

        def failing_save(self, step, *args, **kwargs):
            if step == 12:
                token = json.loads((work / "lock.json").read_text())["token"]  # the writer's own temporary name
                (pathlib.Path(self.directory) / f"{step}.orbax-checkpoint-tmp-run{token}").mkdir()  # half written
                raise OSError(error, os.strerror(error))
            return save(self, step, *args, **kwargs)

        monkeypatch.setattr(ocp.CheckpointManager, "save", failing_save)
    else:
        real_open = builtins.open

        def failing_open(path, mode="r", *args, **kwargs):
            handle = real_open(path, mode, *args, **kwargs)
            if "w" in mode or "a" in mode:
                if target in os.path.basename(str(path)):
                    handle.close()
                    raise OSError(error, os.strerror(error), str(path))
            return handle

        monkeypatch.setattr(builtins, "open", failing_open)
    line = fails(cli_train(work), capfd)
    assert "cannot write" in line and words in line, line
    if where == "checkpoint":
        assert f"{work}/checkpoints/12" in line and "last complete checkpoint: step 8" in line, line
    elif where != "lock":
        assert str(work / target.split(".tmp")[0]) in line and "last complete checkpoint: step 8" in line, line
    assert leftovers(work) == [], leftovers(work)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_disk_full_at_orbaxs_commit_is_one_line(async_save, runs, tmp_path, capfd, monkeypatch):
    """The disk fills as orbax commits checkpoint 12 (its `commit_success.txt`, written just before
    the rename; with checkpoint.async_save in orbax's own thread, while training goes on): one
    line, exit 2, naming checkpoint 12 and the last complete one (8), no traceback from orbax's
    logs, no temporary directory left; checkpoint 8 stays the newest."""
    from orbax.checkpoint._src.path import async_path

    work = copy_of(runs, tmp_path)
    write_text, threads = async_path.write_text, []

    async def full_disk_write_text(path, text):
        if "12.orbax-checkpoint-tmp" in str(path) and str(path).endswith("commit_success.txt"):
            threads.append(threading.current_thread() is not threading.main_thread())
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return await write_text(path, text)

    monkeypatch.setattr(async_path, "write_text", full_disk_write_text)
    line = fails(cli_train(work, f"--config.checkpoint.async_save={async_save}"), capfd)
    assert threads and (all(threads) or not async_save), threads  # async: it failed in orbax's own thread
    assert f"cannot write {work}/checkpoints/12: no space left on the device" in line, line
    assert "last complete checkpoint: step 8" in line, line
    assert leftovers(work) == [] and steps(work) == [4, 8], (leftovers(work), steps(work))


# 5. A peer's death in a multi-process run -------------------------------------------------------------

PEER_TIMEOUT_S = 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _process(pid, port, work, count=2, timeout_s=PEER_TIMEOUT_S):
    env = env_without_device_flag(**{distributed.ENV_COORDINATOR: f"127.0.0.1:{port}",
                                     distributed.ENV_NUM_PROCESSES: count, distributed.ENV_PROCESS_ID: pid})
    return subprocess.Popen(
        [sys.executable, "-m", "cdpjax.cli", "train", "--no-progress", "--cpu-devices", "4", "--workdir", str(work),
         "--config.method=dp", "--config.num_steps=100000", "--config.checkpoint_every=20", "--config.eval_every=0",
         "--config.global_batch_size=64", f"--config.distributed.timeout_s={timeout_s}"],
        env=env, stderr=subprocess.PIPE, text=True)


def _wait_for_a_checkpoint(procs, work) -> None:
    """Until the processes of a run have written their first checkpoint in `work` (all alive)."""
    deadline = time.time() + WAIT_S
    while not (work / "checkpoints").is_dir() or not steps(work):
        assert all(p.poll() is None for p in procs), [p.communicate()[1][-2000:] for p in procs]
        assert time.time() < deadline
        time.sleep(0.2)


@pytest.mark.parametrize("killed", [1, pytest.param(0, marks=pytest.mark.heavy)],
                         ids=["process-1-killed", "coordinator-killed"])
def test_a_killed_peer_ends_the_survivor_in_one_line(killed, tmp_path):
    """Two processes x 4 CPU devices training dp; once both train and a checkpoint exists, one is
    killed with SIGKILL. The survivor ends within distributed.timeout_s (plus the time to say so)
    with one line naming the process that vanished, the last complete checkpoint and the command
    that resumes, exit status 4: no SIGABRT, no C++ log or stack."""
    port, work = _free_port(), tmp_path / "two"
    procs = [_process(pid, port, work) for pid in range(2)]
    try:
        _wait_for_a_checkpoint(procs, work)
        procs[killed].kill()
        t0 = time.time()
        survivor = procs[1 - killed]
        _, err = survivor.communicate(timeout=WAIT_S)
        elapsed = time.time() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert survivor.returncode == 4, err[-3000:]
    line = the_line(err)
    who = "process 1 of the run vanished" if killed == 1 else "process 0 (the coordinator, 127.0.0.1:"
    assert who in line and f"process {1 - killed} of 2 stopped too" in line, line
    assert "last complete checkpoint: step" in line and "run the same command on every process" in line, line
    assert elapsed < PEER_TIMEOUT_S + 60, elapsed  # within timeout_s; the slack is for a loaded machine


def test_a_sigterm_to_one_process_saves_the_same_step_on_every_process(tmp_path):
    """Two processes x 4 CPU devices training dp, checkpoints every 20 steps; once checkpoint 20
    exists, SIGTERM to process 1 alone: both processes agree on the next step boundary, write
    checkpoint N there together (N = 20 itself when the signal came during 20's write: both ask
    again after it), and exit 143 with the same line naming it."""
    port, work = _free_port(), tmp_path / "two"
    procs = [_process(pid, port, work, timeout_s=120) for pid in range(2)]
    try:
        _wait_for_a_checkpoint(procs, work)
        procs[1].send_signal(signal.SIGTERM)
        errs = [p.communicate(timeout=WAIT_S)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [143, 143], [e[-2000:] for e in errs]
    last = [[line for line in e.splitlines() if line.startswith("cdpjax: ")][-1] for e in errs]
    saved = steps(work)[-1]
    assert saved >= 20 and last == [f"cdpjax: terminated (SIGTERM) at step {saved}; checkpoint {saved} saved in "
                                   f"{work}/checkpoints; run the same command to resume from it"] * 2, last


def test_an_unreachable_coordinator_is_one_line(tmp_path):
    """Process 1 of 2 started with no process 0: after distributed.timeout_s, one line saying the
    coordinator could not be reached and what to do (no C++ abort)."""
    proc = _process(1, _free_port(), tmp_path / "alone", timeout_s=3)
    _, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 4, err[-3000:]
    line = the_line(err)
    assert "the coordinator 127.0.0.1:" in line and "could not be reached within distributed.timeout_s=3 s" in line


@pytest.mark.parametrize("address,message", [
    ("127.0.0.1:99999", "port 99999 is not in 1..65535"),
    ("127.0.0.1:0", "port 0 is not in 1..65535"),
    ("not an address", "must be HOST:PORT"),
    ("host:", "must be HOST:PORT"),
    (":1234", "must be HOST:PORT"),
    ("host:12:34", "must be HOST:PORT"),
    ("[::1]:80:x", "must be HOST:PORT"),
])
def test_bad_coordinator_addresses_are_config_errors(address, message, tmp_path, capfd):
    line = fails(["train", "--workdir", str(tmp_path), f"--config.distributed.coordinator_address='{address}'",
                  "--config.distributed.num_processes=2", "--config.distributed.process_id=0"], capfd)
    assert message in line and repr(address) in line, line


def test_a_coordinator_host_that_does_not_resolve_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setattr(distributed, "_started", None)
    c = default_config()
    c.distributed.coordinator_address, c.distributed.num_processes, c.distributed.process_id = \
        "no-such-host.invalid:1234", 2, 1
    with pytest.raises(distributed.ConfigError, match="host 'no-such-host.invalid' cannot be resolved"):
        distributed.initialize(c, {})


# 6. A frozen run, taken over, then thawed --------------------------------------------------------------

def test_a_thawed_run_that_lost_its_directory_writes_nothing(runs, tmp_path):
    """A run frozen (SIGSTOP) in the middle of writing checkpoint 8, its lock then as a lost
    host's (heartbeat 200 s old), is taken over by the same command, which runs to the end. The
    thawed run finishes its write, finds the directory taken, removes what it wrote and stops
    with one line (exit 2); the directory holds the new run's checkpoints only, nothing of the
    old one's, and the new run's end equals the uninterrupted run's."""
    work, release = tmp_path / "run", tmp_path / "release"
    old = held_in_checkpoint_write(work, 8, release)
    old.send_signal(signal.SIGSTOP)
    try:
        record = json.loads((work / "lock.json").read_text())
        record.update(host="node-that-froze", boot_id="elsewhere", heartbeat=time.time() - 200)
        (work / "lock.json").write_text(json.dumps(record))
        new = train.train(small_config(), str(work), progress=False)
        assert new["resumed_from"] == 4
    finally:
        release.touch()
        old.send_signal(signal.SIGCONT)
    _, err = old.communicate()
    # Known open defect: on a loaded machine the thawed process sometimes receives a SIGINT whose
    # siginfo names no real sender (si_pid garbage, si_code 1; seen 2 of 3 runs beside 3 busy
    # loops, never alone) and ends as interrupted at step 8 (130). What this test guards holds
    # either way: the thawed run writes nothing into the directory it lost (checked below).
    assert old.returncode in (2, 130), err[-3000:]
    line = the_line(err)  # (the new run has ended and released the lock: who it was is gone with it)
    if old.returncode == 2:
        assert "was taken over by" in line and "this run stops at step 8, writing nothing more" in line, line
    else:
        assert line.startswith("cdpjax: interrupted at step 8;"), line
    assert steps(work) == [8, 12] and leftovers(work) == []
    equal_trees(final_state(work), runs["state"])
    assert without_timing((work / "metrics.jsonl").read_text()) == runs["metrics"]


# 7. Hostile overrides -------------------------------------------------------------------------------

HOSTILE_OVERRIDES = [
    ("--config.method.dp=1", "method.dp: method is 'dp', not a dict of options"),
    ("--config.num_steps.x=1", "num_steps.x: num_steps is 12, not a dict of options"),
    ("--config.num_steps=1e999", "num_steps must be an integer, got inf"),
    ("--config.seed=1e999", "seed must be an integer, got inf"),
    ("--config.distributed.timeout_s=1e999", "distributed.timeout_s must be an integer, got inf"),
    (f"--config.seed={2**64}", f"seed={2**64} is out of range: must be <= {2**32 - 1}"),
    ("--config.num_steps=6.0", "num_steps must be an integer, got 6.0"),
    ("--config.num_steps=1000000000000", f"num_steps=1000000000000 is out of range: must be <= {2**31 - 1}"),
    ("--config.model_kwargs.width=-5", "model 'mlp' with model_kwargs {'width': -5} cannot be built"),
    ("--config.model_kwargs.width=0", "model 'mlp' with model_kwargs {'width': 0} cannot be built"),
    ("--config.model_kwargs.width='abc'", "model_kwargs.width='abc': model 'mlp' takes an integer there"),
    ("--config.model_kwargs.width=1e999", "model_kwargs.width=inf: model 'mlp' takes an integer there"),
    ("--config.global_batch_size=4000000", "global_batch_size=4000000 is larger than the training set of 'digits' "
                                           "(1497 examples)"),
    ("--config.learning_rate=1e999", "learning_rate=inf must be a finite number"),
    ("--config.learning_rate=-1e999", "learning_rate=-inf must be a finite number"),
    ("--config.stages=100000", "stages: 100000 stages, more than the 4096"),
    ("--config.method=gpipe --config.stages=100000", "stages: 100000 stages, more than the 4096"),
    ("--config.microbatches=100000", "microbatches=100000 is out of range"),
    ("--config.mesh.data=1000000000", "needs 1000000000 devices but only 8 exist"),
]


@pytest.mark.parametrize("override,message", HOSTILE_OVERRIDES, ids=[o for o, _ in HOSTILE_OVERRIDES])
def test_hostile_overrides_are_one_line(override, message, tmp_path, capfd, compiles):
    line = fails(cli_train(tmp_path / "w", *override.split()), capfd, compiles)
    assert message in line, line
    assert not (tmp_path / "w").exists()  # nothing left behind


@pytest.mark.parametrize("args,message", [
    (["--config.mesh.data=1000000000"], "1000000000 simulated CPU devices (what the mesh {'data': 1000000000} "
                                        "needs): cdpjax simulates 1 to 1024"),
    (["--cpu-devices", "100000"], "100000 simulated CPU devices (--cpu-devices 100000)"),
    (["--cpu-devices", "0"], "0 simulated CPU devices"),
])
def test_simulated_devices_are_bounded(args, message, tmp_path, capfd, compiles):
    """Without --cpu-devices the mesh says how many CPU devices to simulate: a billion is refused
    before JAX is asked for them (here JAX already runs, which is why it must be refused first)."""
    line = fails(["train", "--no-progress", "--workdir", str(tmp_path / "w"), "--config.method=dp", *args], capfd,
                 compiles)
    assert message in line, line


def test_a_workdir_that_is_not_utf8_is_one_line(tmp_path, capfd, compiles):
    """A --workdir with a byte that is no UTF-8 character (as a shell passes it): tensorstore cannot
    open it, which was a traceback per array at the first checkpoint, after training; now one line
    first, nothing compiled, no directory created."""
    work = tmp_path / os.fsdecode(b"run-\xff")
    line = fails(cli_train(work), capfd, compiles)
    assert "is not UTF-8 text" in line and "give another --workdir" in line, line
    assert not os.path.lexists(work)


@pytest.mark.parametrize("key", ["learning_rate", "momentum", "weight_decay"])
def test_nan_from_a_config_file_is_refused(key, tmp_path, capfd, compiles):
    path = tmp_path / "nan.py"
    path.write_text("from cdpjax.config import default_config\n\ndef get_config():\n"
                    f"    c = default_config()\n    c.method = 'dp'\n    c.{key} = float('nan')\n    return c\n")
    line = fails(["train", "--workdir", str(tmp_path / "w"), "--config", str(path)], capfd, compiles)
    assert f"{key}=nan must be a finite number" in line, line


# 8. Config files ------------------------------------------------------------------------------------

CONFIG_FILES = {
    "syntax-error": ("def get_config(:\n    pass\n", "line 1: SyntaxError"),
    "get_config-raises": ("def get_config():\n    x = 1\n    raise RuntimeError('no GPU here')\n",
                          "line 3: RuntimeError: no GPU here"),
    "returns-dict": ("def get_config():\n    return {'method': 'dp'}\n", "get_config() returned dict"),
    "returns-None": ("def get_config():\n    pass\n", "get_config() returned None"),
    "returns-int": ("def get_config():\n    return 3\n", "get_config() returned int"),
    "returns-frozen": ("import ml_collections\nfrom cdpjax.config import default_config\n\ndef get_config():\n"
                       "    return ml_collections.FrozenConfigDict(default_config())\n",
                       "get_config() returned FrozenConfigDict"),
    "missing-import": ("import no_such_module_here\n\ndef get_config():\n    pass\n",
                       "line 1: ModuleNotFoundError: No module named 'no_such_module_here'"),
    "recursion": ("def get_config():\n    return get_config()\n", "line 2: RecursionError"),
    "binary": (b"\x7fELF\x02\x01\x01\x00\x00\xff\xfe", "SyntaxError"),
    "no-get_config": ("x = 1\n", "defines no get_config()"),
    "exits": ("import sys\nsys.exit(3)\n", "line 2: SystemExit"),
}


@pytest.mark.parametrize("name", CONFIG_FILES, ids=list(CONFIG_FILES))
def test_hostile_config_files_are_one_line(name, tmp_path, capfd, compiles):
    text, message = CONFIG_FILES[name]
    path = tmp_path / f"{name}.py"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    line = fails(["train", "--workdir", str(tmp_path / "w"), "--config", str(path)], capfd, compiles)
    assert f"config file {str(path)!r}" in line and message in line, line


@pytest.mark.parametrize("spec,message", [
    ("noarg.py:foo", "its get_config() takes no argument, but"),
    ("digits.py:steps=abc", "config argument steps='abc' must be an integer (its default is 600)"),
    ("digits.py:stages=1.5", "config argument stages='1.5' must be an integer"),
    ("digits.py:nosuch=1", "config argument 'nosuch' is not one of"),
    ("folder.py", "folder.py' is a directory: give the Python file in it"),
    ("folder.py:x=1", "folder.py' is a directory: give the Python file in it"),
])
def test_config_file_arguments_are_checked(spec, message, tmp_path, capfd, compiles):
    (tmp_path / "folder.py").mkdir()
    (tmp_path / "noarg.py").write_text("from cdpjax.config import default_config\n\ndef get_config():\n"
                                       "    return default_config()\n")
    shutil.copy(ROOT / "cdpjax" / "configs" / "digits.py", tmp_path / "digits.py")
    line = fails(["train", "--workdir", str(tmp_path / "w"), "--config", str(tmp_path / spec)], capfd, compiles)
    assert message in line, line


# 9. Damaged work-directory files on resume -----------------------------------------------------------

GARBLED_METRICS = {
    "a-number": b"5\n",
    "step-text": b'{"step": "x", "split": "train"}\n',
    "step-null": b'{"step": null, "split": "train"}\n',
    "not-utf-8": b'{"step": 7, "split": "tr\xff\xfein"}\n',
    "cut-short": b'{"step": 7, "split": "tr',
}


@pytest.mark.parametrize("name", GARBLED_METRICS, ids=list(GARBLED_METRICS))
def test_a_garbled_metrics_line_is_dropped_saying_so(name, runs, tmp_path, capfd):
    """A line of metrics.jsonl that is not a metrics record (after the resumed step): the run
    resumes, says in one line which line it dropped and why, and ends as the uninterrupted run."""
    work = copy_of(runs, tmp_path)
    with open(work / "metrics.jsonl", "ab") as f:
        f.write(GARBLED_METRICS[name])
    assert main(cli_train(work)) == 0
    err = capfd.readouterr().err
    assert "Traceback" not in err
    dropped = [line for line in err.splitlines() if "metrics.jsonl: dropped 1 line" in line]
    assert len(dropped) == 1 and "line 6:" in dropped[0], err
    assert without_timing((work / "metrics.jsonl").read_text()) == runs["metrics"]


def _edit_json(path, **fields):
    record = json.loads(path.read_text())
    record.update(fields)
    path.write_text(json.dumps(record))


def _lock(work, **fields):
    record = {"host": socket.gethostname(), "boot_id": "b", "pid": 1, "pid_start": None, "started": 1.0,
              "heartbeat": time.time(), "token": 7}
    record.update(fields)
    (work / "lock.json").write_text(json.dumps(record))


DAMAGED_FILES = {
    "metrics-a-directory": (lambda w: ((w / "metrics.jsonl").unlink(), (w / "metrics.jsonl").mkdir()),
                            "metrics.jsonl is not a file"),
    "config-a-list": (lambda w: (w / "config.json").write_text("[1, 2]"), "config.json holds a JSON list"),
    "config-not-json": (lambda w: (w / "config.json").write_bytes(b"\xff{"), "config.json is not the JSON config"),
    "config-a-directory": (lambda w: ((w / "config.json").unlink(), (w / "config.json").mkdir()),
                           "config.json is not a file"),
    "config-method-a-list": (lambda w: _edit_json(w / "config.json", method=["dp"]),
                             "another config (method=['dp'] there, 'dp' here)"),
    "events-a-directory": (lambda w: (w / "events.out.tfevents.1.host").mkdir(),
                           "events.out.tfevents.1.host is named like a TensorBoard event file but is not a file"),
    "checkpoints-a-symlink-loop": (lambda w: (shutil.rmtree(w / "checkpoints"),
                                              (w / "checkpoints").symlink_to(w / "checkpoints")),
                                   "is a symbolic link that leads nowhere"),
    "lock-pid-text": (lambda w: _lock(w, pid="abc"), "an unreadable lock file"),
    "lock-pid-2**70": (lambda w: _lock(w, pid=2**70), "an unreadable lock file"),
    "lock-pid-0": (lambda w: _lock(w, pid=0), "an unreadable lock file"),
    "lock-heartbeat-text": (lambda w: _lock(w, host="elsewhere", heartbeat="now"), "an unreadable lock file"),
    "lock-not-utf-8": (lambda w: (w / "lock.json").write_bytes(b"\xff\xfe"), "an unreadable lock file"),
}


@pytest.mark.parametrize("name", DAMAGED_FILES, ids=list(DAMAGED_FILES))
def test_damaged_workdir_files_are_one_line(name, runs, tmp_path, capfd, compiles):
    """A file the resumed run reads or rewrites, damaged: one line naming it and what to do, exit 2,
    nothing compiled. (A fresh unreadable lock is refused for a while, as a lock being written
    is; an old one is taken over: test_workdir.py.)"""
    work = copy_of(runs, tmp_path)
    damage, message = DAMAGED_FILES[name]
    damage(work)
    line = fails(cli_train(work), capfd, compiles)
    assert message in line, line


SUMMARY_EDITS = {
    "task-a-list": {"task": ["classification"]},
    "task-unknown": {"task": "regression"},
    "loss-text": {"task": "language_modelling", "test_loss": "low"},
    "perplexity-text": {"task": "language_modelling", "test_loss": 2.0, "test_perplexity": "high"},
    "accuracy-null": {"test_accuracy": None},
}


@pytest.mark.parametrize("name", SUMMARY_EDITS, ids=list(SUMMARY_EDITS))
def test_a_finished_run_with_an_edited_summary_writes_it_again(name, runs, tmp_path, capfd):
    """summary.json of a finished run edited by hand (a task that is not one, a metric that is not a
    number): the same command does not take it for the run's summary; it ends the run again
    (exit 0, no traceback) and writes the summary anew."""
    work = copy_of(runs, tmp_path, "full")
    _edit_json(work / "summary.json", **SUMMARY_EDITS[name])
    assert main(cli_train(work)) == 0
    err = capfd.readouterr().err
    assert "Traceback" not in err and "holds a finished run" not in err, err
    summary = json.loads((work / "summary.json").read_text())
    assert summary["task"] == "classification" and summary["steps"] == STEPS
    assert isinstance(summary["test_accuracy"], float)


def test_a_finished_language_model_run_started_again_changes_nothing(tmp_path, capfd):
    """A finished run of the language-modelling task (its summary has test_loss, test_perplexity,
    test_token_accuracy, no test_accuracy) started again: nothing trained, summary.json (its
    tokens_per_second) not written over with a re-evaluation's."""
    from cdpjax.config import load_file

    c = load_file(str(ROOT / "cdpjax" / "configs" / "charlm.py:method=dp,steps=2,stages=1,window=8"))
    c.eval_every, c.checkpoint_every, c.log_every = 0, 0, 1
    c.model_kwargs = {"width": 16, "depth": 1, "heads": 2, "mlp_dim": 32}
    work = tmp_path / "lm"
    first = train.train(c, str(work), progress=False)
    assert first["task"] == "language_modelling" and first["tokens_per_second"] > 0
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in work.iterdir() if p.is_file()}
    capfd.readouterr()
    again = train.train(c, str(work), progress=False)
    err = capfd.readouterr().err
    assert again.get("already_finished") and "holds a finished run of 2 steps" in err, err
    assert again["tokens_per_second"] == first["tokens_per_second"]
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in work.iterdir() if p.is_file()} == before


# 10. schedule --from-json -----------------------------------------------------------------------------

def _table_json(**changes):
    from cdpjax.layouts import LAYOUTS

    d = LAYOUTS.lookup("gpipe").make_table().to_json()
    for k, v in changes.items():
        if k == "op0":
            d["ops"][0].update(v)
        else:
            d[k] = v
    return json.dumps(d)


HOSTILE_TABLES = {
    "empty": (b"", "not JSON"),
    "truncated": (_table_json()[:500].encode(), "not JSON"),
    "binary": (b"\x00\xff\xfe\x80garbage", "not JSON"),
    "a-list": (b"[1, 2, 3]", "a JSON list, not an object"),
    "null": (b"null", "a JSON NoneType, not an object"),
    "a-number": (b"5", "a JSON int, not an object"),
    "nan": (_table_json().replace('"workers": 1', '"workers": NaN').encode(), "NaN is not a number"),
    "workers-text": (_table_json(workers="abc").encode(), "workers='abc' must be an integer"),
    "workers-negative": (_table_json(workers=-5).encode(), "workers=-5 must be an integer in [1, 4096]"),
    "stages-0": (_table_json(stages=0).encode(), "stages=0 must be an integer in [1, 4096]"),
    "device-1e9": (_table_json(op0={"device": 10**9}).encode(), "ops[0]"),
    "tick-negative": (_table_json(op0={"tick": -1}).encode(), "ops[0]"),
    "kind-unknown": (_table_json(op0={"kind": "X"}).encode(), "has kind 'X'"),
    "op-a-list": (_table_json(op0={"extra": 1}).encode(), "ops[0]"),
    "ops-missing": (json.dumps({k: v for k, v in json.loads(_table_json()).items() if k != "ops"}).encode(),
                    "ops must be a list"),
    "num-ticks-1e9": (_table_json(num_ticks=10**9).encode(), "num_ticks=1000000000 must be an integer"),
    "devices-1e9": (_table_json(devices=10**9).encode(), "devices=1000000000 must be an integer"),
    "meta-keys-absent": (_table_json(meta_keys=["nowhere"]).encode(), "meta_keys must list keys present"),
}


@pytest.mark.parametrize("name", HOSTILE_TABLES, ids=list(HOSTILE_TABLES))
def test_hostile_time_tables_are_one_line(name, tmp_path, capfd):
    data, message = HOSTILE_TABLES[name]
    path = tmp_path / "table.json"
    path.write_bytes(data)
    t0 = time.time()
    line = fails(["schedule", "--from-json", str(path), "--out", str(tmp_path / "t.png")], capfd)
    assert time.time() - t0 < 120 and "not a cdpjax time table" in line and message in line, line
    assert not (tmp_path / "t.png").exists()


def test_a_time_table_too_large_to_lay_out_is_refused_at_once(capfd):
    t0 = time.time()
    line = fails(["schedule", "--method", "cdp-v2", "--workers", "1024", "--stages", "512", "--steps", "100000"],
                 capfd)
    assert time.time() - t0 < 60 and "ops, more than" in line, line


@pytest.mark.parametrize("costs,message", [
    ("F=inf,B=1", "the forward time is inf"),
    ("F=1e308,B=1e308", "the forward time is 1e+308"),
    ("F=0,B=0,W=0", "the forward time is 0"),
    ("F=1,B=0", "the backward time is 0"),
    ("F=-1,B=1", "the forward time is -1"),
    ("F=1,B=1,W=5", "the backward_input time is -4"),
])
def test_schedule_costs_are_positive_and_finite(costs, message, capfd):
    """`schedule --costs` times that are not a finite number > 0 (or a weight half W not less than
    the whole backward B): one line, not a traceback from the replay nor a table of negative time."""
    line = fails(["schedule", "--method", "1f1b", "--stages", "2", "--costs", costs], capfd)
    assert message in line and "must be a finite number > 0" in line, line


# 11. plot, bench, schedule --out ---------------------------------------------------------------------

def test_plot_of_damaged_run_files(runs, tmp_path, capfd):
    """config.json a list, metrics.jsonl with a non-UTF-8 line and a line that is not an object:
    the figure is drawn, the dropped lines said in one line, the label falls back to the name."""
    work = copy_of(runs, tmp_path)
    (work / "config.json").write_text("[1]")
    with open(work / "metrics.jsonl", "ab") as f:
        f.write(b"\xff\xfe\n[1, 2]\n")
    out = tmp_path / "curves.png"
    assert main(["plot", str(work), "--out", str(out)]) == 0
    err = capfd.readouterr().err
    assert "Traceback" not in err and out.stat().st_size > 0
    assert "left out 2 lines that are not a metrics record (line 6: not UTF-8 text)" in err, err


@pytest.mark.parametrize("args,message", [
    (["plot", "{work}", "--out", "{tmp}/no/such/folder/curves.png"], "the folder {tmp}/no/such/folder does not exist"),
    (["plot", "{work}", "--out", "{tmp}/folder.png"], "--out {tmp}/folder.png is a directory"),
    (["plot", "{work}", "--out", "{tmp}/curves.pdf"], "must end in .png or .svg"),
    (["schedule", "--method", "gpipe", "--out", "{tmp}/no/such/folder/t.svg"], "the folder {tmp}/no/such/folder"),
    (["bench", "--methods", "dp", "--json", "{tmp}/no/such/folder/b.json"], "the folder {tmp}/no/such/folder"),
    (["bench", "--methods", "dp", "--repeats", "0"], "--repeats 0 must be >= 1"),
    (["bench", "--methods", "dp", "--bandwidth", "0"], "--bandwidth 0.0 must be a finite number"),
    (["bench", "--methods", "dp", "--bandwidth", "nan"], "--bandwidth nan must be a finite number"),
    (["bench", "--methods", "dp", "--predict", "-1"], "--predict -1 must be >= 0"),
    (["bench", "--methods", " , "], "names no method"),
], ids=lambda a: " ".join(a) if isinstance(a, list) else None)
def test_command_arguments_and_output_paths_are_checked_first(args, message, runs, tmp_path, capfd, compiles):
    """Before any work (nothing compiled, no folder created): the output path's folder must exist,
    the path be a file of the right kind; bench's repeats, bandwidth and predict in range."""
    work = copy_of(runs, tmp_path)
    (tmp_path / "folder.png").mkdir()
    fill = {"work": str(work), "tmp": str(tmp_path)}
    line = fails([a.format(**fill) for a in args], capfd, compiles)
    assert message.format(**fill) in line, line
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("methods,message", [
    ("dp,cdp-v2@cdp_ticks=split", "cdp-v2 on the mesh {'data': 8} (8 devices): workers=8 does not divide the 9 "
                                  "ticks"),
    ("dp,dp@global_batch_size=4000", "global_batch_size=4000 is larger than the training set"),
    ("dp,dp@model_kwargs.width=0", "model 'mlp' with model_kwargs {'width': 0} cannot be built"),
    ("dp,dp@", "--methods 'dp@': each @ is followed by KEY=VALUE (e.g. dp@residuals=carry), not ''"),
    ("dp,dp@=3", "--methods 'dp@=3': each @ is followed by KEY=VALUE"),
    ("dp,dp@method=gpipe", "--methods 'dp@method=gpipe': a variant keeps its method ('dp'); list 'gpipe' as a "
                           "method of its own"),
])
def test_bench_checks_every_method_before_compiling_any(methods, message, capfd, compiles):
    """A method (or variant) of `bench --methods` that refuses its config, after one that accepts
    it: one line, before bench's `compiled first` line, and the first method is not compiled."""
    line = fails(["bench", "--methods", methods, "--repeats", "1", "--config.stages=3"], capfd, compiles)
    assert message in line, line


def test_a_figure_that_cannot_be_written_is_one_line(runs, tmp_path, capfd, monkeypatch):
    """The write itself refused (a read-only file system, which a test cannot make here):
    one line naming the file, exit 2."""
    from matplotlib.figure import Figure

    def refuse(self, path, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(Figure, "savefig", refuse)
    out = tmp_path / "curves.png"
    line = fails(["plot", str(runs["full"]), "--out", str(out)], capfd)
    assert line == f"cdpjax: error: cannot write {out}: the file system is read-only", line


# 13. Tests on a loaded machine ----------------------------------------------------------------------

OWN_TESTS = ("test_faults.py", "test_reliability.py", "test_workdir.py", "test_foundation.py",
             "test_user_experience.py", "test_multihost.py", "test_reproduce.py", "test_configs.py")


def test_subprocess_timeouts_are_generous_or_none():
    """A test must not fail because the machine is slow: in these test files no call is given a
    time limit under WAIT_S (runs of a minute alone took over 600 s on a loaded 2-core
    machine), the limits that test helpers default to included."""
    short = []
    for name in OWN_TESTS:
        tree = ast.parse((ROOT / "tests" / name).read_text())
        for node in ast.walk(tree):
            pairs = []
            if isinstance(node, ast.Call):
                pairs = [(k.arg, k.value) for k in node.keywords]
            elif isinstance(node, ast.FunctionDef):
                args = node.args.args[len(node.args.args) - len(node.args.defaults):]
                pairs = [(a.arg, d) for a, d in zip(args, node.args.defaults)]
            for key, value in pairs:
                if key == "timeout" and isinstance(value, ast.Constant) and isinstance(value.value, (int, float)):
                    if value.value < WAIT_S:
                        short.append(f"{name}:{node.lineno} timeout={value.value}")
    assert not short, short
