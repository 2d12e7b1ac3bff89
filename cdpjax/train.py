"""The generic training loop: one for every method.

`train(config, workdir)` takes WORKDIR's lock (`cdpjax.workdir`: one run per work
directory), validates the config, builds the data, the mesh and the method,
checks a first batch against the model and restores the newest intact
checkpoint in WORKDIR if there is one (`prepare`: everything that can fail, before
anything compiles; a damaged newer checkpoint is named, set aside and skipped,
`cdpjax.checkpoint`); then it says what it will do ("training ... in DIR", or
"resuming ... from step N"), runs the train steps up to `num_steps` with a
progress bar, evaluates every `eval_every` steps, appends metrics to
WORKDIR/metrics.jsonl and TensorBoard events (`cdpjax.events`), checkpoints every
`checkpoint_every` steps, flushes pipelines at the end, and writes
WORKDIR/summary.json. A finished run started again changes no file and says so.
Ctrl-C or SIGTERM stop it with a line saying the last complete checkpoint (from the
command line, `cdpjax.shutdown` says it, after a checkpoint being written is finished).
The lock is checked at every step and before every write: a run that another took
WORKDIR from (`--force`) stops, writing nothing more. A write the disk refuses (full, a
quota, read-only) is a StorageError naming the file and the last complete checkpoint.

Each metrics line holds `step`, `split` and the task's metrics (`cdpjax.tasks`:
`loss`, `accuracy` for classification; `loss` per token, `perplexity`,
`token_accuracy` for language modelling), of the line's logging window (train) or
of the whole test split (test); train lines also `lr` (the optax schedule's value
for that step's update) and the throughput in the task's unit, `images_per_second`
or `tokens_per_second` (train steps of the line's window, compilation left out;
null when the window holds only the process's first step); every line `time`,
seconds since the run started (set-up and compilation included; a resumed run
continues from the time its checkpoint recorded). The throughput and `time` are
the timing fields (`cdpjax.runlog.TIMING_FIELDS`); everything else on a line is deterministic.

Runs are deterministic given the config and seed: the data position is the step
number (see `cdpjax.data.base`), and the in-flight state of every method lives in
its checkpointed train state, so a run killed at any point and started again
with the same WORKDIR ends as an uninterrupted one, metrics.jsonl equal once the
timing fields are removed (docs/guarantees.md).

Step N is the N-th train step, as numbered in metrics.jsonl and in checkpoint
names. Every step also checks, in the same compiled program, that the loss,
every stage's parameters after the update (where a NaN or Inf gradient shows,
for every optimizer used here) and the whole train state (batches in flight)
are finite: with `nonfinite='stop'` training stops with `NonFiniteError` naming
the step and the stage, the last good checkpoint kept (the flags come to the host with
the metrics, at log, evaluation and checkpoint steps, so a run may go on a few steps past a
bad one before it stops; a checkpoint is never written past it); with `nonfinite='skip'`
the step's update is dropped on device (the state stays as it was, so pipelines
lose only the batch fed at that step) and counted in `summary['skipped_steps']`;
the step then holds two copies of the train state.

`profile_steps=[a, b]` records a `jax.profiler` trace of steps a to b (the
process's first step includes compilation) into WORKDIR/plugins/profile/, where
TensorBoard's profile tab finds it, with a Perfetto trace beside it.

In a multi-process run (`cdpjax.distributed`) every process runs this loop on
its slice of each batch; process 0 alone takes the lock, writes config.json,
metrics.jsonl, the events and summary.json, and every process takes part in each
checkpoint.

The trainer is four modules under this entry: `cdpjax.setup` (a config to its dataset, mesh and
method), `cdpjax.rundir` (the run directory's life: lock, resume, checkpoints; `prepare`),
`cdpjax.loop` (the step loop; `run`) and `cdpjax.runlog` (logging and progress); `cdpjax.guard`
is the step it compiles. `train` below adds what a stopped run says (a signal, a full disk, a
lost lock) to where it stands.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any

import jax

from cdpjax import shutdown
from cdpjax import workdir as workdir_lib
from cdpjax.errors import ConfigError, StorageError, storage_problem
from cdpjax.loop import Interrupted, run
from cdpjax.mesh import replicas_words
from cdpjax.rundir import Prepared, finish_saves, prepare
from cdpjax.runlog import result_words, say

__all__ = ["Interrupted", "train"]


def train(config, workdir: str, progress: bool = True, devices=None, stop_after: int | None = None,
          require_checkpoint: bool = False, force: bool = False,
          device_note: tuple[int, str] | None = None) -> dict[str, Any]:
    """Trains `config` in `workdir`; returns the summary (also written to summary.json).

    `stop_after` ends the process's work after that many steps of this call, as if
    killed (used by the resume tests); the run is then resumed by calling again.
    `require_checkpoint`: fail unless WORKDIR holds a complete checkpoint to resume from.
    `force`: take WORKDIR's lock over even from a live run (`cdpjax.workdir`).
    `device_note`: (simulated CPU devices asked for, why), said on CPU (the command line's).
    A finished run started again returns its summary.json, with `already_finished` added.
    A SIGTERM from the end of the first step on (main thread only) saves a checkpoint at the next
    step boundary and raises `Interrupted` naming it (exit_status 143), as `cdpjax train` does on
    a preemption; the resumed run ends as an uninterrupted one (one during the last step lets the
    run finish: its final checkpoint is its whole work). Ctrl-C, and a SIGTERM before the first
    step ends or in the final phase, raise `Interrupted` naming the last complete checkpoint
    (under the command line's `cdpjax.shutdown` the same line ends the process instead). The
    SIGTERM handler in place before the call is put back when it returns.
    A full disk (or a quota, a read-only file system) is a StorageError naming the file and
    the last complete checkpoint; a run that lost WORKDIR to another (--force) stops with a
    ConfigError saying who took it.
    """
    with workdir_lib.sigterm_as_interrupt():
        shutdown.set_message(lambda how, abandoned: stop_line(None, how, abandoned))
        try:
            p = prepare(config, workdir, devices, require_checkpoint, force)
        except Exception as e:  # noqa: BLE001 - a disk that refuses a write during set-up: one line
            reason = None if isinstance(e, ConfigError) else storage_problem(e)
            if reason is None:
                raise
            raise StorageError(f"WORKDIR {workdir}", reason, "free space (or give a --workdir this run can "
                                                            "write to) and run the same command") from None
        shutdown.set_message(lambda how, abandoned: stop_line(p, how, abandoned))
        try:
            if p.finished is not None:
                s = p.finished
                say(f"WORKDIR {workdir} holds a finished run of {s['steps']} steps ({result_words(s)}); "
                    f"nothing to train and no file changed: raise "
                    f"--config.num_steps to train on from step {s['steps']}, or use a fresh --workdir")
                return {**s, "already_finished": True}
            announce(p, device_note)
            return run(p, progress, stop_after)
        except KeyboardInterrupt as e:
            if isinstance(e, Interrupted):
                raise
            with contextlib.suppress(Exception):
                finish_saves(p)  # an asynchronous checkpoint write is let finish, so the line can name it
            raise _interrupted(p, e) from None
        except Exception as e:  # noqa: BLE001 - worded with the run's position, or passed on as it is
            worded = _with_position(p, e)
            if worded is None:
                raise
            raise worded from None
        finally:
            p.close()
            shutdown.set_message(None)


def announce(p: Prepared, device_note: tuple[int, str] | None = None) -> None:
    """What the run will do, once `prepare` has checked everything: the simulated devices (on
    CPU, with why that many), then training or resuming, where and how far."""
    c, n = p.config, int(p.mesh.devices.size)
    if device_note is not None and jax.default_backend() == "cpu":
        asked, why = device_note
        have = jax.local_device_count()
        reason = why if have == asked else f"JAX was already running with them; {why} asked for {asked}"
        say(f"{have} simulated CPU devices ({reason}); --cpu-devices sets them")
    what = f"{c.method} / {c.model} / {c.dataset} in {p.workdir}"
    replicas = replicas_words(dict(p.mesh.shape), c.global_batch_size)
    cache = jax.config.jax_compilation_cache_dir if jax.config.jax_enable_compilation_cache else None
    where = (f"mesh {dict(p.mesh.shape)}, {n} device{'s' if n > 1 else ''}"
             + (f", {jax.process_count()} processes" if jax.process_count() > 1 else "")
             + (f": {replicas}" if replicas else "")
             + f"; compilation cache {cache or 'off'}")
    p.training = True
    if p.start:
        say(f"resuming {what} from step {p.start} (checkpoint {os.path.join(p.ckpt.directory, str(p.start))}); "
            f"training to step {c.num_steps} ({where})")
    else:
        say(f"training {what}: {c.num_steps} steps ({where})")


def stop_line(p: Prepared | None, how: str, abandoned: float | None = None) -> str:
    """What a run stopped by a signal says: where it stands and how to go on."""
    if p is None or not p.training:
        return f"{how} before training began; run the same command to start it"
    if p.intact is None:
        line = f"{how} at step {p.done}; no complete checkpoint yet: the same command starts again from step 0"
    else:
        line = (f"{how} at step {p.done}; last complete checkpoint: step {p.intact} in {p.ckpt.directory}; "
                f"run the same command to resume")
    if abandoned is not None:
        line += f" (a checkpoint being written was given up after {abandoned:.1f} s)"
    return line


def _interrupted(p: Prepared, e: KeyboardInterrupt) -> Interrupted:
    how, status = ("terminated (SIGTERM)", 143) if isinstance(e, workdir_lib.Terminated) else ("interrupted", 130)
    return Interrupted(stop_line(p, how), status)


def _with_position(p: Prepared, e: Exception) -> Exception | None:
    """The error worded with where the run stands, or None to let it pass as it is."""
    if isinstance(e, StorageError):
        return StorageError(e.path, e.reason, f"{p.last_checkpoint()}; free space (or give a --workdir this run "
                                              f"can write to) and run the same command to resume")
    if p.lock is not None and p.lock.lost and isinstance(e, ConfigError):
        return ConfigError(f"{p.lock.lost} at step {p.done}, writing nothing more")
    reason = None if isinstance(e, ConfigError) else storage_problem(e)
    if reason is not None:
        return StorageError(f"WORKDIR {p.workdir}", reason, f"{p.last_checkpoint()}; free space (or give a "
                                                           f"--workdir this run can write to) and run the same "
                                                           f"command to resume")
    return None
