"""The run directory's life: what a run takes, checks, restores and writes in WORKDIR.

`prepare(config, workdir, ...)` is everything before the first compile: WORKDIR's lock
(`cdpjax.workdir`: one run per work directory; process 0 takes it, the others check its token),
the files the run rewrites, the checkpoints (`cdpjax.checkpoint`: a resume must be the same run,
RESUME_KEYS; a changed hyperparameter is said, CHANGEABLE_KEYS), a finished run (stops there, no
file changed), the method (`cdpjax.setup`), the first batch and the newest intact checkpoint
restored (a damaged newer one named and set aside). It returns a `Prepared`, which the loop
(`cdpjax.loop`) carries on; `save_checkpoint` / `finish_saves` write the run's checkpoints while it
holds WORKDIR (checked before and after each write). A failed start removes the directories it
created and releases the lock.

Test hooks: with CDPJAX_TEST_KILL_AT_STEP the process SIGKILLs itself right after finishing (and
checkpointing) that step; with CDPJAX_TEST_WAIT_AT_STEP, after that step, it creates
WAIT_FILE + ".waiting" and waits until WAIT_FILE (CDPJAX_TEST_WAIT_FILE) exists; with
CDPJAX_TEST_WAIT_IN_CHECKPOINT it waits so inside the write of that step's checkpoint; with
CDPJAX_TEST_STEP_DELAY_S it sleeps that long after each step (`test_hooks`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from typing import Any

import jax
import numpy as np

from cdpjax import checks, files, shutdown, tasks
from cdpjax import setup as setup_lib
from cdpjax import workdir as workdir_lib
from cdpjax.checkpoint import TMP_MARK, Checkpointer, Damaged
from cdpjax.errors import ConfigError
from cdpjax.events import event_files
from cdpjax.files import writing
from cdpjax.runlog import say

KILL_ENV = "CDPJAX_TEST_KILL_AT_STEP"
WAIT_ENV, WAIT_FILE_ENV = "CDPJAX_TEST_WAIT_AT_STEP", "CDPJAX_TEST_WAIT_FILE"
WAIT_IN_CHECKPOINT_ENV, DELAY_ENV = "CDPJAX_TEST_WAIT_IN_CHECKPOINT", "CDPJAX_TEST_STEP_DELAY_S"
# Config keys that a resumed run must share with the run that wrote the checkpoint: they fix
# the data stream or the layout of the train state. (num_steps, the mesh and the learning
# rate may change; the method only to one whose train state is the same: `Layout.state_as`.)
RESUME_KEYS = ("model", "model_kwargs", "norm", "stages", "partition", "dataset", "dataset_kwargs",
               "augment", "global_batch_size", "seed", "optimizer", "workers", "cdp_impl", "cdp_rule",
               "aux_head", "aux_kwargs", "microbatches", "residuals", "dtype", "chunks", "module_groups", "task",
               "cdp_ticks", "delay")
# Hyperparameters a resumed run may change, the train state being the same: the change is said in
# one line at start-up (and refused under checkpoint.strict_resume).
CHANGEABLE_KEYS = ("learning_rate", "momentum", "nesterov", "weight_decay", "schedule", "warmup_steps",
                   "decay_every", "decay_factor")


def prepare(config, workdir: str, devices=None, require_checkpoint: bool = False, force: bool = False) -> Prepared:
    """Everything before the first compile of the train step: the lock, the config, the
    checkpoints (a finished run stops here, with `finished` set and no file changed), the data,
    the mesh, the method, the first batch and the restored state (the newest intact checkpoint:
    a damaged one is set aside, saying so). Raises ConfigError for bad input; the lock is
    released on any failure."""
    t0 = time.perf_counter()
    checks.validate(config)
    if require_checkpoint and not os.path.isdir(os.path.join(workdir, "checkpoints")):
        raise ConfigError(f"nothing to resume: {os.path.join(workdir, 'checkpoints')} does not exist")
    created = _missing_dirs(workdir)
    cleanup = shutdown.on_exit(lambda: _remove_empty(created))
    try:
        lock, token = take_lock(workdir, force)
    except BaseException:
        _remove_empty(created)
        raise
    try:
        if jax.process_index() == 0:
            check_workdir_files(workdir)
        ckpt, latest = open_checkpoints(workdir, config, lock, require_checkpoint, token)
    except BaseException:
        if lock is not None:
            lock.release()
        _remove_empty(created)
        raise
    p = Prepared(config, workdir, lock, ckpt, latest, t0)
    try:
        p.finished = finished_summary(workdir, config, latest)
        if p.finished is None:
            _build_and_restore(p, devices)
    except BaseException:
        p.close()
        _remove_empty(created)
        raise
    finally:
        shutdown.forget(cleanup)
    return p


@dataclasses.dataclass
class Prepared:
    """A run ready to train: what `prepare` built and restored, and where the loop stands."""

    config: Any
    workdir: str
    lock: workdir_lib.Lock | None
    ckpt: Checkpointer
    latest: int | None
    t0: float  # perf_counter() when the run's set-up began
    finished: dict | None = None
    dataset: Any = None
    mesh: Any = None
    method: Any = None
    first: dict | None = None  # the first batch this call trains on, already read and checked
    state: Any = None
    start: int = 0
    done: int = 0  # steps trained so far (the resume step, then each step as it ends)
    skipped: int = 0
    flushed: bool = False
    window: list = dataclasses.field(default_factory=list)
    elapsed: float = 0.0  # run time recorded by the checkpoint resumed from
    metrics_digest: str | None = None  # of metrics.jsonl when the checkpoint resumed from was saved
    intact: int | None = None  # the newest checkpoint known whole: verified on restore, or written here
    training: bool = False  # past the "training ..." line
    input_wait: float = 0.0  # the fraction of the timed train steps spent waiting for a batch

    def clock(self) -> float:
        """`time` of a metrics line: seconds since the run started."""
        return self.elapsed + time.perf_counter() - self.t0

    def check_lock(self) -> None:
        """Before anything is written: ConfigError if another run has taken WORKDIR over."""
        if self.lock is not None:
            self.lock.check()

    def last_checkpoint(self) -> str:
        """Where the run can resume from, in words."""
        if self.intact is None:
            return "no complete checkpoint yet (the same command starts again from step 0)"
        return f"last complete checkpoint: step {self.intact} in {self.ckpt.directory}"

    def close(self) -> None:
        self.ckpt.close()
        if self.lock is not None:
            self.lock.release()


def _build_and_restore(p: Prepared, devices) -> None:
    config = p.config
    p.dataset, p.mesh, p.method = setup_lib.setup(config, devices)
    setup_lib.check_dataset_against_model(p.dataset, config, p.method.net)
    init = p.method.init(jax.random.key(config.seed))
    if p.latest is not None:
        p.latest, (p.state, meta) = restore_newest_intact(p, init)
    else:
        p.state = init
    # The first batch this call trains on, checked before anything compiles and then used.
    p.first = setup_lib.check_batches(p.dataset, config, p.method.net, min(p.latest or 0, config.num_steps - 1))
    if p.latest is not None:
        p.start = p.done = p.intact = p.latest
        p.skipped, p.flushed = int(meta.get("skipped_steps", 0)), bool(meta.get("flushed", False))
        p.window, p.elapsed = list(meta.get("log_window", [])), float(meta.get("time", 0.0))
        p.metrics_digest = meta.get("metrics")
        change = changed_hyperparameters(p.ckpt, p.latest, meta, config)
        if change:
            say(change)


def _missing_dirs(workdir: str) -> list[str]:
    """WORKDIR/checkpoints, WORKDIR and its parents that do not exist yet, deepest first: what
    a failed start removes again when still empty, so that bad input leaves no directory behind."""
    missing, d = [], os.path.abspath(os.path.join(workdir, "checkpoints"))
    while not os.path.lexists(d):
        missing, d = missing + [d], os.path.dirname(d)
    return missing


def _remove_empty(directories) -> None:
    for d in directories:
        try:
            os.rmdir(d)
        except OSError:
            pass  # not empty (or already gone): kept


def take_lock(workdir: str, force: bool) -> tuple[workdir_lib.Lock | None, int]:
    """Process 0 takes WORKDIR's lock for the job; the others check that it did (they get None);
    every process gets the lock's token. A lock taken from a live run (--force) is held only once
    that run has stopped."""
    lock, error, token = None, None, 0
    if jax.process_index() == 0:
        try:
            lock = workdir_lib.Lock.acquire(workdir, force, say)
            lock.wait_for_previous(lambda: not _being_written(workdir), say=say)
        except ConfigError as e:
            error = e
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        token = lock.owner.token if lock is not None else 0
        token = int(multihost_utils.broadcast_one_to_all(np.int32(token)))
        if jax.process_index() != 0:
            if not token:
                raise ConfigError(f"process 0 could not take the lock of WORKDIR {workdir} (its message says "
                                  f"why); this process stops too")
            workdir_lib.check_token(workdir, token)
    if error is not None:
        raise error
    return lock, (lock.owner.token if lock is not None else token)


def _being_written(workdir: str) -> bool:
    directory = os.path.join(workdir, "checkpoints")
    return os.path.isdir(directory) and any(TMP_MARK in n for n in os.listdir(directory))


def check_workdir_files(workdir: str) -> None:
    """The files a run rewrites in WORKDIR must be files (or absent): ConfigError naming one that
    is a directory or something else, before anything is written."""
    for name in ("config.json", "summary.json", "metrics.jsonl"):
        path = os.path.join(workdir, name)
        if os.path.lexists(path) and not os.path.isfile(path):
            raise ConfigError(f"{path} is not a file: the run writes it, so move it away")
    event_files(workdir)


def open_checkpoints(workdir: str, config, lock, require_checkpoint: bool,
                     token: int = 0) -> tuple[Checkpointer, int | None]:
    """WORKDIR's checkpoints and the latest complete step; refuses what cannot be resumed.
    The run writes its temporary checkpoint directories under its lock's `token`."""
    with writing(os.path.join(workdir, "checkpoints")):
        ckpt = Checkpointer(workdir, max_to_keep=int(config.get("checkpoint", {}).get("keep", 2)),
                            remove_leftovers=lock is not None and lock.may_clean,
                            owner=f"run{token}" if token else None,
                            async_save=bool(config.get("checkpoint", {}).get("async_save", False)))
    try:
        steps = ckpt.steps()
        latest = steps[-1] if steps else None
        if latest is None and require_checkpoint:
            raise ConfigError(f"nothing to resume: {ckpt.directory} holds no complete checkpoint")
        if latest is not None:
            check_resume_config(workdir, config)
            # The newest checkpoint whose meta reads (a damaged newer one is set aside when restoring).
            intact = next((s for s in reversed(steps) if s <= config.num_steps or _intact_meta(ckpt, s)), None)
            if intact is not None and intact > config.num_steps:
                raise ConfigError(f"WORKDIR {workdir} holds checkpoint {intact}, past num_steps="
                                  f"{config.num_steps}: set --config.num_steps={intact} or more, or use a "
                                  f"fresh --workdir")
    except BaseException:
        ckpt.close()
        raise
    return ckpt, latest


def _intact_meta(ckpt: Checkpointer, step: int) -> bool:
    try:
        ckpt.read_meta(step)
    except Damaged:
        return False
    return True


def finished_summary(workdir: str, config, latest: int | None) -> dict | None:
    """The summary of a finished run in WORKDIR (final checkpoint at num_steps and summary.json
    written), or None if there is something to do."""
    path = os.path.join(workdir, "summary.json")
    if latest != config.num_steps or not os.path.exists(path):
        return None
    try:
        summary = json.loads(files.read_text(path))
    except (OSError, ValueError, RecursionError):  # a FileRefused among them
        return None  # written again at the end of the run
    if not isinstance(summary, dict) or not isinstance(summary.get("task", "classification"), str) \
            or summary.get("task", "classification") not in tasks.REGISTRY:
        return None
    # The task's headline test metric, and every other it reports, a number (as `result_words` says them).
    task = tasks.lookup(summary.get("task", "classification"))
    if not all(isinstance(summary.get(f"test_{k}"), (int, float)) for k in task.metric_names
               if k == task.headline or f"test_{k}" in summary):
        return None
    return summary if summary.get("steps") == config.num_steps else None


def check_resume_config(workdir: str, config) -> None:
    """A resumed run must be the same run: the keys of RESUME_KEYS as in WORKDIR/config.json."""
    path = os.path.join(workdir, "config.json")
    saved = read_saved_config(path)
    if saved is None:
        return
    now = json.loads(config.to_json_best_effort())
    changed = [k for k in RESUME_KEYS if k in saved and k in now and saved[k] != now[k]]
    if saved.get("method") and not (isinstance(saved["method"], str) and _interchangeable(saved["method"],
                                                                                          config.method)):
        changed.insert(0, "method")
    if changed:
        diffs = ", ".join(f"{k}={saved.get(k)!r} there, {now.get(k)!r} here" for k in changed)
        raise ConfigError(f"WORKDIR {workdir} holds a run with another config ({diffs}); a run resumes only "
                          f"with the config it started with: restore those values, or use a fresh --workdir")


def read_saved_config(path: str) -> dict | None:
    """WORKDIR/config.json as the run wrote it (None if absent); ConfigError if it is something
    else (it is rewritten by every run: a damaged one would hide a changed config)."""
    if not os.path.lexists(path):
        return None
    fix = "move it away (the run writes it again) and run the same command again"
    if not os.path.isfile(path):
        raise ConfigError(f"{path} is not a file: {fix}")
    try:
        saved = json.loads(files.read_text(path))
    except files.FileRefused:
        raise
    except (OSError, ValueError, RecursionError) as e:
        raise ConfigError(f"{path} is not the JSON config a run writes ({type(e).__name__}): {fix}") from None
    if not isinstance(saved, dict):
        raise ConfigError(f"{path} holds a JSON {type(saved).__name__}, not the config a run writes: {fix}")
    return saved


def _interchangeable(a: str, b: str) -> bool:
    """Whether a checkpoint of method `a` resumes as method `b`: the same method, or two whose
    registrations say their train states are one (`Layout.state_as`)."""
    from cdpjax.layouts import LAYOUTS  # pure Python; late: the layouts import the registry

    def state_of(name: str) -> str:
        return (LAYOUTS[name].state_as or name) if name in LAYOUTS else name

    return a == b or state_of(a) == state_of(b)


def _config_values(config, keys) -> dict:
    now = json.loads(config.to_json_best_effort())
    return {k: now.get(k) for k in keys}


def run_identity(config) -> dict:
    """What makes a train state this run's and no other's (its model and sizes, seed, batch, data
    order, update rule: RESUME_KEYS), as recorded in every checkpoint's meta (`run`); the method,
    the mesh and the CDP rule are the meta's own fields, checked by `restore_state`."""
    return _config_values(config, RESUME_KEYS)


def check_identity(ckpt: Checkpointer, step: int, meta: dict, config) -> None:
    """Checkpoint `step` was written by this run (its `run` against the command's config, whatever
    WORKDIR/config.json says): ConfigError naming what differs; a meta without it is Damaged."""
    there = meta.get("run")
    if not isinstance(there, dict):
        raise Damaged(step, ckpt.directory, "is damaged: its meta does not say which run wrote it (no 'run' field)")
    here = run_identity(config)
    changed = [k for k in RESUME_KEYS if there.get(k) != here[k]]
    if changed:
        diffs = ", ".join(f"{k}={there.get(k)!r} there, {here[k]!r} here" for k in changed)
        raise ConfigError(f"checkpoint {step} in {ckpt.directory} belongs to another run ({diffs}); a run resumes "
                          f"only with the config it started with: restore those values, or use a fresh --workdir")


def changed_hyperparameters(ckpt: Checkpointer, step: int, meta: dict, config) -> str | None:
    """The hyperparameters this run changes from those checkpoint `step` was written with, in words
    ('momentum 0.9 -> 0.5'), or None; ConfigError under checkpoint.strict_resume."""
    there, here = meta.get("hyper") or {}, _config_values(config, CHANGEABLE_KEYS)
    changed = [f"{k} {there[k]!r} -> {here[k]!r}" for k in CHANGEABLE_KEYS if k in there and there[k] != here[k]]
    if not changed:
        return None
    words = ", ".join(changed)
    if config.get("checkpoint", {}).get("strict_resume", False):
        raise ConfigError(f"checkpoint {step} in {ckpt.directory} was written with other hyperparameters ({words}) "
                          f"and checkpoint.strict_resume is set: restore them, or unset it to resume with the change")
    return (f"resuming with hyperparameters changed since checkpoint {step}: {words} "
            f"(--config.checkpoint.strict_resume=True refuses this)")


def restore_newest_intact(p: Prepared, init) -> tuple[int | None, tuple]:
    """(step, (state, meta)) of the newest checkpoint whose bytes are what was written. Each
    damaged one newer than it is named in one line and set aside (renamed `<step>.damaged-*`,
    never read again); a checkpoint that vanished while it was read (a run forced out of the
    directory rotating its own) is skipped. With no intact one left: ConfigError (nothing is
    set aside), or a fresh start if every checkpoint simply vanished."""
    damaged = []
    for step in reversed(p.ckpt.steps()):
        try:
            restored, error = restore_state(p.ckpt, step, init, p.method, p.mesh, p.config), None
        except Damaged as e:
            restored, error = None, e
        if not _every_process(error is None):  # all agree, or they would part ways in the next collective
            error = error or Damaged(step, p.ckpt.directory, "is damaged: another process could not read it")
        if error is not None:
            if "removed while it was read" in error.why:
                say(f"{error} (by the run forced out of this directory?); trying the one before it")
            else:
                damaged.append(error)
            continue
        for e in damaged:
            where = p.ckpt.set_aside(e.step)
            say(f"{e}" + (f"; set aside as {where}" if where else "")
                + f"; resuming from checkpoint {step}, the newest intact one")
        return step, restored
    if damaged:
        listed = "; ".join(f"{e.step} {e.why}" for e in damaged)
        raise ConfigError(f"every checkpoint in {p.ckpt.directory} is damaged ({listed}): move them away to "
                          f"start again from step 0, or use a fresh --workdir")
    return None, (init, {})


def _placed(mesh_shape: dict) -> dict:
    """A mesh's axes that place anything: an axis of size 1 splits nothing (`cdpjax train` names
    a stage-axis method's mesh {'stage': 4, 'data': 1} where a config may give {'stage': 4})."""
    return {k: int(v) for k, v in mesh_shape.items() if int(v) != 1}


def restore_state(ckpt: Checkpointer, step: int, state, method, mesh, config):
    """Restores checkpoint `step` into `state` -> (state, meta), or a ConfigError saying why not.

    Onto another mesh (another device count) the state is restored and resharded when its
    arrays keep their shapes, as for e2e, dp and local, whose state is the model itself;
    a state with a leading worker or stage axis changes shape, and the error says so.
    """
    meta = ckpt.read_meta(step)
    check_identity(ckpt, step, meta, config)
    saved = meta.get("method")
    if saved not in (None, config.method) and not _interchangeable(saved, config.method):
        raise ConfigError(f"checkpoint {step} in {ckpt.directory} holds a {saved!r} run, not {config.method!r}: "
                          f"use a fresh --workdir")
    if "stale" in meta and method.stale is not None and meta["stale"] != _stale(method):
        workers, saved_workers = method.workers or "?", meta.get("workers", "?")
        raise ConfigError(f"checkpoint {step} in {ckpt.directory} was written with {saved_workers} CDP workers; this "
                          f"run has {workers}, which changes the update rule (which worker reads which stage's "
                          f"previous version); workers=0 follows the data axis, so the device count changed it: "
                          f"set --config.workers={saved_workers} or start a fresh --workdir")
    here = {k: int(v) for k, v in mesh.shape.items()}
    there = meta.get("mesh")
    if there is None or _placed(dict(there)) == _placed(here):
        return ckpt.restore(step, state)
    moved = (f"checkpoint {step} in {ckpt.directory} was written by {saved or config.method} on mesh "
             f"{dict(there)} ({meta.get('devices', '?')} devices); this run has mesh {here} "
             f"({int(mesh.devices.size)} devices)")
    what_to_do = (f"resume on the mesh it was written on (the same --config.mesh, with "
                  f"{meta.get('devices', '?')} devices: --cpu-devices on CPU, CUDA_VISIBLE_DEVICES on GPUs), "
                  f"or start a fresh --workdir")
    if method.state_depends_on_mesh:
        raise ConfigError(f"{moved}, and {config.method}'s train state depends on the mesh: {what_to_do}")

    def explain(e):
        return ConfigError(f"{moved}, and {config.method}'s train state does not fit it: it has a leading "
                           f"worker or stage axis whose size follows the mesh ({type(e).__name__}: "
                           f"{str(e).splitlines()[0][:200] if str(e) else ''}); {what_to_do}")

    return ckpt.restore(step, state, explain)


def _stale(method) -> list:
    return np.asarray(method.stale).astype(int).tolist()


def _every_process(ok: bool) -> bool:
    """Whether `ok` holds in every process of the run (itself alone in a one-process run)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


def checkpoint_meta(p: Prepared, method) -> dict:
    here = {"method": p.config.method, "mesh": {k: int(v) for k, v in p.mesh.shape.items()},
            "devices": int(p.mesh.devices.size), "processes": jax.process_count(),
            "run": run_identity(p.config), "hyper": _config_values(p.config, CHANGEABLE_KEYS)}
    if method.workers is not None:
        here["workers"] = method.workers
    if method.stale is not None:  # CDP: the update rule itself, which the worker count decides
        here["stale"] = _stale(method)
    return here


def save_checkpoint(p: Prepared, step: int, meta: dict) -> None:
    """Checkpoint `step`, written only while this run holds WORKDIR (checked before and after:
    a run that lost the directory while writing removes what it wrote and stops). A signal
    waits for the write, and for `p.intact` to name it; an asynchronous write
    (checkpoint.async_save) is named there once `finish_saves` (or the next save) has waited for it."""
    p.check_lock()
    try:
        with shutdown.critical():
            if os.environ.get(WAIT_IN_CHECKPOINT_ENV) == str(step):
                wait_for_release(os.environ[WAIT_FILE_ENV])
            p.check_lock()  # again: a process frozen until now may have lost the directory meanwhile
            p.ckpt.save(step, p.state, meta)
            # (the step itself once committed: at once for a synchronous save, at the next wait for an async one)
            p.intact = p.ckpt.committed if p.ckpt.committed is not None else p.intact
    except Exception:
        p.check_lock()  # another run wrote this step too: losing the directory is the news
        raise
    try:
        p.check_lock()
    except ConfigError:
        p.ckpt.discard(step)
        p.intact = None
        raise


def finish_saves(p: Prepared) -> None:
    """Waits for an asynchronous checkpoint write in flight; `p.intact` then names it."""
    committed = p.ckpt.wait()
    p.intact = committed if committed is not None else p.intact


def default_workdir(config) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = os.path.join("workdirs", f"{config.method}-{config.model}-{config.dataset}-{stamp}")
    path, k = base, 1
    while os.path.exists(path):
        path, k = f"{base}-{k}", k + 1
    return path


def test_hooks(done: int) -> None:
    if os.environ.get(KILL_ENV) == str(done):
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get(WAIT_ENV) == str(done):
        wait_for_release(os.environ[WAIT_FILE_ENV])
    if os.environ.get(DELAY_ENV):
        time.sleep(float(os.environ[DELAY_ENV]))


def wait_for_release(release: str) -> None:
    open(release + ".waiting", "w").close()
    while not os.path.exists(release):
        time.sleep(0.05)
