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
the timing fields (`TIMING_FIELDS`); everything else on a line is deterministic.

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
"""
from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import json
import os
import signal
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from cdpjax import checks, compilation, files, layouts, models, optim, shutdown, tasks
from cdpjax import data as data_lib
from cdpjax import methods as methods_lib
from cdpjax import workdir as workdir_lib
from cdpjax.checkpoint import TMP_MARK, Checkpointer, Damaged
from cdpjax.data.prefetch import Prefetch
from cdpjax.errors import ConfigError, NonFiniteError, StorageError, storage_problem
from cdpjax.events import EventLog, event_files, read_metrics
from cdpjax.mesh import make_mesh, replicas_words
from cdpjax.methods.common import tree_select

# Test hooks: the process SIGKILLs itself right after finishing (and checkpointing) this step;
# or, after this step, it creates WAIT_FILE + ".waiting" and waits until WAIT_FILE exists.
KILL_ENV = "CDPJAX_TEST_KILL_AT_STEP"
WAIT_ENV, WAIT_FILE_ENV = "CDPJAX_TEST_WAIT_AT_STEP", "CDPJAX_TEST_WAIT_FILE"
# ... or it waits so inside the write of this step's checkpoint; or it sleeps this long after each step.
WAIT_IN_CHECKPOINT_ENV, DELAY_ENV = "CDPJAX_TEST_WAIT_IN_CHECKPOINT", "CDPJAX_TEST_STEP_DELAY_S"
# Fields of a metrics.jsonl line that differ between two runs of the same config.
TIMING_FIELDS = ("images_per_second", "tokens_per_second", "time")
# Methods whose train states are the same pytree with the same meaning, so that a checkpoint
# of one resumes as the other (dp on N devices -> e2e on one: the same update rule).
INTERCHANGEABLE = (frozenset({"e2e", "dp"}),)
# Config keys that a resumed run must share with the run that wrote the checkpoint: they fix
# the data stream or the layout of the train state. (num_steps, the mesh and the learning
# rate may change; the method only within INTERCHANGEABLE.)
RESUME_KEYS = ("model", "model_kwargs", "norm", "stages", "partition", "dataset", "dataset_kwargs",
               "augment", "global_batch_size", "seed", "optimizer", "workers", "cdp_impl", "cdp_rule",
               "aux_head", "aux_kwargs", "microbatches", "residuals", "dtype", "chunks", "module_groups", "task",
               "cdp_ticks")
# Hyperparameters a resumed run may change, the train state being the same: the change is said in
# one line at start-up (and refused under checkpoint.strict_resume).
CHANGEABLE_KEYS = ("learning_rate", "momentum", "nesterov", "weight_decay", "schedule", "warmup_steps",
                   "decay_every", "decay_factor")


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM while training; the message says where the run stands and what to do."""

    def __init__(self, message: str, exit_status: int):
        super().__init__(message)
        self.exit_status = exit_status


def say(line: str) -> None:
    """A status line on stderr, from process 0 only, on its own line above a progress bar."""
    if jax.process_index() == 0:
        from tqdm.auto import tqdm

        with shutdown.critical():  # not after the line of a signal that is ending the process
            tqdm.write(f"cdpjax: {line}", file=sys.stderr)


def batch_sharding(mesh) -> NamedSharding:
    return NamedSharding(mesh, P("data") if "data" in mesh.axis_names else P())


def put_batch(batch: dict, mesh, sharding=None) -> dict:
    """This process's slice of the global batch as global arrays (default: sharded over `data`)."""
    sharding = sharding or batch_sharding(mesh)
    if jax.process_count() == 1:
        return jax.device_put(batch, sharding)
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


def make_eval_fn(net: models.StagedNet, task: tasks.Task = tasks.CLASSIFICATION):
    """A jitted `(params, state, inputs, labels, mask) -> task.metric_sums` of one test batch."""
    @jax.jit
    def eval_batch(params, state, images, labels, mask):
        outputs, _ = net.apply(params, state, images, train=False)
        return task.metric_sums(outputs, labels, mask)

    return eval_batch


def evaluate(eval_fn, params, state, dataset, batch_size: int, task: tasks.Task = tasks.CLASSIFICATION) -> dict:
    """The task's metrics over the whole test split (its sums added in float64 on the host)."""
    totals = np.zeros(len(task.sum_names), np.float64)
    for batch in dataset.test_batches(batch_size):
        totals += np.asarray(jax.device_get(eval_fn(params, state, batch["image"], batch["label"], batch["mask"])),
                             np.float64)
    return {k: float(v) for k, v in task.finish(totals).items()}


def window_entry(metrics) -> list | dict:
    """What a train step adds to the logging window (a list of numbers, JSON for the checkpoint):
    its `metric_sums`, then for local learning each module's (loss, 1 if it ran); for a method
    that reports no sums, its `loss` and `accuracy`."""
    if "metric_sums" not in metrics:
        return {k: float(metrics[k]) for k in ("loss", "accuracy") if k in metrics}
    entry = [float(v) for v in np.asarray(metrics["metric_sums"], np.float64)]
    if "stage_loss" in metrics and "stage_valid" in metrics:
        for loss, valid in zip(np.asarray(metrics["stage_loss"], np.float64), np.asarray(metrics["stage_valid"])):
            entry += [float(loss) if valid else 0.0, float(bool(valid))]
    return entry


def window_metrics(task: tasks.Task, window: list) -> dict:
    """The task's metrics of a logging window: `finish` of its steps' sums added up, and each local
    module's mean loss over the steps it ran (`loss_module_<k>`); or (methods without sums) the
    mean of each step's loss and accuracy."""
    if window and all(isinstance(entry, list) for entry in window):
        n = len(task.sum_names)
        rows = np.asarray(window, np.float64)
        out = {k: float(v) for k, v in task.finish(rows[:, :n].sum(axis=0)).items()}
        modules = rows[:, n:].reshape(len(window), -1, 2)
        for k in range(modules.shape[1]):
            ran = modules[:, k, 1].sum()
            if ran:
                out[f"loss_module_{k}"] = float(modules[:, k, 0].sum() / ran)
        return out
    return {k: float(np.mean([m[k] for m in window])) for k in window[0] if all(k in m for m in window)}


def check_dataset_against_model(dataset, config, net) -> None:
    """The dataset's inputs fit the model and the model's outputs fit the task's labels (abstract
    shapes only: called before the parameters are initialised, so nothing has compiled yet)."""
    if tuple(dataset.image_shape) != tuple(net.input_shape):
        raise ConfigError(f"images of shape {dataset.image_shape} do not fit the model's input {net.input_shape}")
    task = tasks.resolve(config, dataset)
    label_shape = task.label_shape(tuple(net.input_shape))
    task.check_outputs(net.stage_output_shapes(1)[-1][1:], label_shape, dataset.num_classes, net.name)


def check_batches(dataset, config, net, step: int = 0) -> dict:
    """Reads training batch `step` and a test batch and checks them against the model before
    the train step compiles (a loader whose images are not what it declares fails here, not
    inside XLA); returns the training batch, which the loop then uses, so that it is read once.
    The labels' shape is the task's (`config.task`, or the dataset's own); that the model's
    outputs fit it is `check_dataset_against_model`'s, before the parameters exist."""
    pcount = jax.process_count()
    per_process = config.global_batch_size // pcount
    task = tasks.resolve(config, dataset)
    label_shape = task.label_shape(tuple(net.input_shape))
    batch = dataset.train_batch(step, config.global_batch_size, config.seed, config.augment,
                                jax.process_index(), pcount)
    want = (per_process, *net.input_shape)
    for split, b, n in (("training", batch, per_process),
                        ("test", next(iter(dataset.test_batches(2, limit=2)), None), 2)):
        if b is None:
            raise ConfigError(f"dataset {dataset.name!r} has no test examples")
        image, label = np.asarray(b["image"]), np.asarray(b["label"])
        if image.shape != (n, *net.input_shape):
            raise ConfigError(
                f"dataset {dataset.name!r} gives {split} images of shape {image.shape[1:]} (a batch of "
                f"{image.shape}), but it declares {tuple(dataset.image_shape)} and the model expects "
                f"{tuple(net.input_shape)} (a batch of {(n, *want[1:])}): fix the loader or its image_shape")
        if image.dtype != np.dtype(net.input_dtype):
            raise ConfigError(f"dataset {dataset.name!r} gives {split} inputs of dtype {image.dtype}, but it declares "
                              f"input_dtype {net.input_dtype!r}: fix the loader or its input_dtype")
        if label.shape != (n, *label_shape) or label.dtype != np.dtype(task.label_dtype):
            raise ConfigError(f"dataset {dataset.name!r} gives {split} labels of shape {label.shape} and dtype "
                              f"{label.dtype}; task {task.name!r} expects {task.label_dtype} labels of shape "
                              f"{(n, *label_shape)}")
        # Class or token ids index the outputs; a regression task's float targets have no range to check.
        if np.issubdtype(label.dtype, np.integer) and label.size and (
                label.min() < 0 or label.max() >= dataset.num_classes):
            raise ConfigError(f"dataset {dataset.name!r} gives {split} labels in [{label.min()}, {label.max()}], "
                              f"outside [0, {dataset.num_classes}) for its {dataset.num_classes} classes")
    return batch


def mesh_error(config, mesh, e: ConfigError) -> ConfigError:
    """A method builder's refusal, worded with the mesh it was built on: the builder sees sizes
    (workers=3), the user chose a mesh (or got one by default)."""
    n = int(mesh.devices.size)
    note = ""
    if "data" in mesh.shape and not config.get("workers", 0) and "workers" in str(e):
        note = (f" (workers=0 takes the size of the data axis, {int(mesh.shape['data'])}: change "
                f"--config.mesh.data or set --config.workers)")
    return ConfigError(f"{config.method} on the mesh {dict(mesh.shape)} ({n} device{'s' if n > 1 else ''}): "
                       f"{e}{note}")


def setup(config, devices=None):
    """Validated config -> (dataset, mesh, method); everything that can fail before compiling."""
    checks.validate(config)
    dataset = data_lib.build(config)
    if config.global_batch_size > dataset.num_train:
        raise ConfigError(f"global_batch_size={config.global_batch_size} is larger than the training set of "
                          f"{dataset.name!r} ({dataset.num_train} examples): each example is used once per "
                          f"epoch, so a batch must fit in it")
    if config.global_batch_size % jax.process_count():
        raise ConfigError(f"global_batch_size={config.global_batch_size} is not divisible by the "
                          f"{jax.process_count()} processes")
    checks.try_model(config, tuple(dataset.image_shape), dataset.num_classes, dataset.input_dtype)
    mesh = make_mesh(layouts.mesh_for(config), devices)
    ctx = methods_lib.Context(config, mesh, tuple(dataset.image_shape), dataset.num_classes, dataset.input_dtype,
                              tasks.resolve(config, dataset))
    try:
        method = methods_lib.build(ctx)
    except ConfigError as e:
        raise mesh_error(config, mesh, e) from None
    if jax.process_count() > 1 and isinstance(method.input_sharding, jax.sharding.SingleDeviceSharding):
        raise ConfigError(f"method {config.method!r} runs on one device, but this run has "
                          f"{jax.process_count()} processes: run it as a single process")
    return dataset, mesh, method


def _finite(tree) -> jax.Array:
    flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack(flags)) if flags else jnp.array(True)


def stage_finite(params) -> jax.Array:
    """[num_stages] bool: whether every floating value of each stage's parameters is finite."""
    return jnp.stack([_finite(p) for p in params])


def guarded_step(method, skip: bool):
    """The method's step and, in the same program, where non-finite values appeared.

    Returns a jitted `(state, batch) -> (state, metrics, flags)`; `flags['stages']` says per
    stage whether its parameters after the update are finite (a NaN or Inf gradient makes
    them non-finite for every optimizer used here), whether its `stage_loss` (methods that
    report one) is finite, and what the method's own optional per-stage `metrics['finite']`
    says; `flags['state']` covers the whole train state, in-flight buffers included (a
    poisoned batch still inside a pipeline or a CDP partial sum). With `skip`, a step with
    any flag down or a non-finite loss leaves the whole train state as it was: a select on
    device, with no host copy, which the method's own buffer donation does not defeat.
    """
    num_stages = method.net.num_stages

    def guarded_train_step(state, batch):
        new, metrics = method.train_step(state, batch)
        stages = stage_finite(method.export(new)[0])
        for key in ("finite", "stage_loss"):
            value = metrics.get(key)
            if value is not None and jnp.shape(value) == (num_stages,):
                stages = stages & (value.astype(bool) if key == "finite" else jnp.isfinite(value))
        whole = _finite(new)
        if skip:
            ok = jnp.all(stages) & whole & jnp.all(jnp.isfinite(metrics["loss"]))
            new = tree_select(ok, new, state)
        return new, metrics, {"stages": stages, "state": whole}

    return jax.jit(guarded_train_step, donate_argnums=0)


def all_finite(metrics, flags) -> bool:
    return bool(np.all(flags["stages"]) and flags["state"] and np.all(np.isfinite(metrics["loss"])))


def describe_nonfinite(metrics, flags) -> str:
    """Where a step went non-finite, in words: the first stage, or the in-flight state, or the loss."""
    finite = np.asarray(flags["stages"])
    loss = float(np.asarray(metrics["loss"]))
    bad = [j for j, f in enumerate(finite) if not f]
    stage_loss = metrics.get("stage_loss")
    if bad:
        j = bad[0]
        lossy = stage_loss is not None and np.shape(stage_loss) == finite.shape and not np.isfinite(stage_loss[j])
        what = "its loss" if lossy else "its parameters after the update (a NaN or Inf gradient)"
        others = f"; also stage(s) {', '.join(map(str, bad[1:]))}" if len(bad) > 1 else ""
        return f"stage {j}: {what}{others}; loss {loss:.4g}"
    if not flags["state"]:
        return (f"the in-flight state (activations, gradients or partial sums of a batch still in "
                f"flight), every stage's parameters still finite; loss {loss:.4g}")
    return f"the loss ({loss}), every stage's parameters still finite"


def _lines_digest(records) -> "hashlib._Hash":
    """SHA-256 of the metrics lines of `records`, as the run writes them."""
    digest = hashlib.sha256()
    for record in records:
        digest.update((json.dumps(record) + "\n").encode())
    return digest


class MetricsLog:
    """metrics.jsonl and its TensorBoard copy: one JSON object per line; on resume, lines past the
    resumed step are dropped (and, when a finished run is completed again, its final test line,
    which is written again) so that a resumed run's log equals an uninterrupted run's, timing
    fields aside, and so are lines that are not metrics records (said in one line). Written by
    process 0 only; each line whole (a signal waits for it). `digest()`: a SHA-256 of the lines
    written so far, which each checkpoint records (`metrics`), so that a resume from it finds a
    history changed since (`resumed_digest`: a line edited, added or removed, the file deleted)
    and says so in one line."""

    def __init__(self, workdir: str, resume_step: int, final_step: int, write: bool = True,
                 resumed_digest: str | None = None, config=None):
        self.path, self.enabled, self.events, self.lines = os.path.join(workdir, "metrics.jsonl"), write, None, None
        if not write:
            return
        records, dropped = read_metrics(self.path)
        if dropped:
            say(f"{self.path}: dropped {len(dropped)} line{'s' if len(dropped) > 1 else ''} that "
                f"{'are' if len(dropped) > 1 else 'is'} not a metrics record ({dropped[0]}"
                f"{'; ...' if len(dropped) > 1 else ''})")
        kept = [r for r in records if r["step"] <= resume_step]
        if resumed_digest is not None and _lines_digest(kept).hexdigest() != resumed_digest:
            say(f"{self.path} up to step {resume_step} is not what the run had written when it saved checkpoint "
                f"{resume_step} (a line changed, added or removed, or the file deleted); the run goes on with it "
                f"as it is")
        kept = [r for r in kept if not (r["step"] == final_step and r["split"] == "test")]
        restart = min([r["step"] for r in records if r not in kept] + [resume_step + 1])
        _write_atomic(self.path, "".join(json.dumps(rec) + "\n" for rec in kept))
        self.lines = _lines_digest(kept)
        with writing(workdir):
            self.events = EventLog(workdir, kept, restart, config)

    def write(self, record: dict) -> None:
        if self.enabled:
            with shutdown.critical(), writing(self.path):
                with open(self.path, "a") as f:
                    f.write(json.dumps(record) + "\n")
                self.lines.update((json.dumps(record) + "\n").encode())
                self.events.write(record)

    def digest(self) -> str | None:
        """SHA-256 of the lines the file holds now (None in a process that does not write it)."""
        return self.lines.hexdigest() if self.lines is not None else None

    def close(self) -> None:
        if self.events is not None:
            self.events.close()


def method_report(method) -> dict:
    """What a record says of the built method: its own figures, its carrier's padding, its program's shape."""
    out = {k: v for k, v in method.report.items() if isinstance(v, (int, float, str, dict, list))}
    if method.padding is not None:
        out["padding"] = method.padding
    if method.program is not None:
        out["program"] = method.program.summary()
    return out


def _jsonable(x):
    """numpy values in a method's info (summary.json) as plain JSON; anything else as text."""
    return x.tolist() if isinstance(x, (np.ndarray, np.generic)) else str(x)


class writing:
    """Around a write: a failure of the disk (full, quota, read-only, permission) becomes a
    StorageError naming `path`, to which the trainer adds the last complete checkpoint."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if e is None or isinstance(e, ConfigError) or not isinstance(e, Exception):
            return False
        reason = storage_problem(e)
        if reason is None:
            return False
        raise StorageError(getattr(e, "filename", None) or self.path, reason) from None


def _write_atomic(path: str, text: str) -> None:
    """Readers (other processes, a resumed run) see the old file or the new one, never half; a
    failure leaves neither a temporary file nor half a file."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with shutdown.critical(), writing(path):
        try:
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            if os.path.isfile(tmp):
                os.unlink(tmp)
            raise


def default_workdir(config) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = os.path.join("workdirs", f"{config.method}-{config.model}-{config.dataset}-{stamp}")
    path, k = base, 1
    while os.path.exists(path):
        path, k = f"{base}-{k}", k + 1
    return path


def _interchangeable(a: str, b: str) -> bool:
    return a == b or any({a, b} <= group for group in INTERCHANGEABLE)


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


def _stale(method) -> list:
    return np.asarray(method.stale).astype(int).tolist()


def _every_process(ok: bool) -> bool:
    """Whether `ok` holds in every process of the run (itself alone in a one-process run)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


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
    if there is None or dict(there) == here:
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


class LearningRates:
    """The optax schedule's value for each update 0 .. num_steps-1 (float32, as the optimizer
    reads it); step N's update is update N-1. Computed a block of `BLOCK` updates at a time, the
    blocks always starting at multiples of BLOCK (a resumed run logs the same values), so that
    memory does not grow with num_steps."""

    BLOCK = 4096

    def __init__(self, config):
        self.schedule, self.num_steps = optim.schedule(config), int(config.num_steps)
        self.start, self.values = None, None

    def __getitem__(self, update: int) -> np.float32:
        start = update - update % self.BLOCK
        if start != self.start:
            stop = min(start + self.BLOCK, self.num_steps)
            self.values = np.asarray(jax.vmap(self.schedule)(jnp.arange(start, stop)), np.float32)
            self.start = start
        return self.values[update - start]


def learning_rates(config) -> LearningRates:
    return LearningRates(config)


def _shortest(x) -> float:
    """A float32 as the shortest decimal that reads back as it (0.05, not 0.05000000074505806)."""
    return float(str(np.float32(x)))


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


def _build_and_restore(p: Prepared, devices) -> None:
    config = p.config
    p.dataset, p.mesh, p.method = setup(config, devices)
    check_dataset_against_model(p.dataset, config, p.method.net)
    init = p.method.init(jax.random.key(config.seed))
    if p.latest is not None:
        p.latest, (p.state, meta) = restore_newest_intact(p, init)
    else:
        p.state = init
    # The first batch this call trains on, checked before anything compiles and then used.
    p.first = check_batches(p.dataset, config, p.method.net, min(p.latest or 0, config.num_steps - 1))
    if p.latest is not None:
        p.start = p.done = p.intact = p.latest
        p.skipped, p.flushed = int(meta.get("skipped_steps", 0)), bool(meta.get("flushed", False))
        p.window, p.elapsed = list(meta.get("log_window", [])), float(meta.get("time", 0.0))
        p.metrics_digest = meta.get("metrics")
        change = changed_hyperparameters(p.ckpt, p.latest, meta, config)
        if change:
            say(change)


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


class Progress:
    """The progress bar of the train steps: started after the process's first step, and with the
    time of evaluations and checkpoints taken out (`leave_out`), so that its rate and its ETA
    leave compilation (of the step and of the evaluation) out."""

    def __init__(self, enabled: bool, total: int, desc: str):
        self.enabled, self.total, self.desc, self.bar, self.postfix = enabled, total, desc, None, {}

    def step(self, done: int) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total, initial=done, dynamic_ncols=True, desc=self.desc)
            self.bar.set_postfix(self.postfix, refresh=False)
            shutdown.on_exit(self.close)  # a signal's line goes below the bar, not into it
        else:
            self.bar.update(1)

    def leave_out(self, seconds: float) -> None:
        """Takes `seconds` (spent outside the train steps) out of the bar's clock."""
        if self.bar is not None:
            self.bar.start_t += seconds
            self.bar.last_print_t += seconds

    def set_postfix(self, **values) -> None:
        self.postfix = values
        if self.bar is not None:
            self.bar.set_postfix(values, refresh=False)

    def close(self) -> None:
        shutdown.forget(self.close)
        if self.bar is not None:
            bar, self.bar = self.bar, None
            bar.close()


class Profile:
    """`profile_steps=[a, b]`: a jax.profiler trace of steps a to b in WORKDIR/plugins/profile/."""

    def __init__(self, steps, workdir: str):
        self.first, self.last = (int(steps[0]), int(steps[1])) if steps else (0, -1)
        self.workdir, self.active, self.started = workdir, False, 0

    def before(self, step: int) -> None:
        """Before step `step` (numbered from 1) runs."""
        if not self.active and self.first <= step <= self.last:
            jax.profiler.start_trace(self.workdir, create_perfetto_trace=True)
            self.active, self.started = True, step

    def after(self, step: int) -> None:
        """After step `step` has run (its outputs read back, so the device work is in)."""
        if self.active and step >= self.last:
            self.stop(step)

    def stop(self, step: int) -> None:
        if not self.active:
            return
        jax.profiler.stop_trace()
        self.active = False
        runs = sorted(glob.glob(os.path.join(self.workdir, "plugins", "profile", "*")), key=os.path.getmtime)
        where = runs[-1] if runs else os.path.join(self.workdir, "plugins", "profile")
        say(f"profile of steps {self.started}-{step} in {where} (TensorBoard: tensorboard --logdir "
            f"{self.workdir}, Profile tab; Perfetto: open perfetto_trace.json.gz there at ui.perfetto.dev)")


@dataclasses.dataclass
class Throughput:
    """Items (the task's unit: images, tokens) and seconds of timed train steps (not a process's
    first, which compiles)."""

    items: int = 0
    seconds: float = 0.0

    def add(self, items: int, seconds: float) -> None:
        self.items, self.seconds = self.items + items, self.seconds + seconds

    def rate(self) -> float | None:
        return self.items / self.seconds if self.seconds else None


def _checkpoint_meta(p: Prepared, method) -> dict:
    here = {"method": p.config.method, "mesh": {k: int(v) for k, v in p.mesh.shape.items()},
            "devices": int(p.mesh.devices.size), "processes": jax.process_count(),
            "run": run_identity(p.config), "hyper": _config_values(p.config, CHANGEABLE_KEYS)}
    if method.workers is not None:
        here["workers"] = method.workers
    if method.stale is not None:  # CDP: the update rule itself, which the worker count decides
        here["stale"] = _stale(method)
    return here


def _test_hooks(done: int) -> None:
    if os.environ.get(KILL_ENV) == str(done):
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get(WAIT_ENV) == str(done):
        _wait_for_release(os.environ[WAIT_FILE_ENV])
    if os.environ.get(DELAY_ENV):
        time.sleep(float(os.environ[DELAY_ENV]))


def _wait_for_release(release: str) -> None:
    open(release + ".waiting", "w").close()
    while not os.path.exists(release):
        time.sleep(0.05)


def _nonfinite(p: Prepared, metrics, flags, skip: bool, progress: Progress) -> None:
    """A step with non-finite values: counted and skipped, or NonFiniteError."""
    where = describe_nonfinite(metrics, flags)
    if skip:
        p.skipped += 1
        if jax.process_index() == 0:
            from tqdm.auto import tqdm

            tqdm.write(f"cdpjax: skipped step {p.done} (non-finite, {where}); {p.skipped} skipped so far",
                       file=sys.stderr)
        return
    progress.close()
    kept = (f"the last good checkpoint (step {p.intact}) in {p.ckpt.directory} is kept" if p.intact is not None
            else "no checkpoint had been written yet")
    raise NonFiniteError(f"non-finite values at step {p.done} in {where}; training stopped, {kept} "
                         f"(--config.nonfinite=skip skips such steps instead)")


def save_checkpoint(p: Prepared, step: int, meta: dict) -> None:
    """Checkpoint `step`, written only while this run holds WORKDIR (checked before and after:
    a run that lost the directory while writing removes what it wrote and stops). A signal
    waits for the write, and for `p.intact` to name it; an asynchronous write
    (checkpoint.async_save) is named there once `finish_saves` (or the next save) has waited for it."""
    p.check_lock()
    try:
        with shutdown.critical():
            if os.environ.get(WAIT_IN_CHECKPOINT_ENV) == str(step):
                _wait_for_release(os.environ[WAIT_FILE_ENV])
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


@contextlib.contextmanager
def first_step_compiles(method: str, first: bool):
    """Around a process's first step (which compiles): 'compiling METHOD ...' before it, and after
    it how long it took and how many programs XLA compiled or read from the compilation cache."""
    if not first:
        yield
        return
    say(f"compiling {method} ...")
    with compilation.CompileWatch() as watch:
        yield
    say(f"compiled {method} and ran its first step in {watch.words()}")


def run(p: Prepared, progress: bool = True, stop_after: int | None = None) -> dict[str, Any]:
    """The train steps from `p.start` to num_steps, then the final evaluation and summary.

    Feeding: each step's batch is read, augmented and put on the devices ahead of it by a
    background thread (`cdpjax.data.prefetch`, two batches ahead); the step's metrics and
    finite flags stay on the devices until the next log, evaluation or checkpoint step (or the
    last), when those of every step since come to the host together, in order.
    Step timing: the steps between two such moments are timed together, from the end of the
    last one to their metrics being on the host (batch waits included, a process's first step,
    which compiles, left out); logging, evaluation and checkpoints are outside it.
    `stop_after` ends this call after that many steps, as if killed (returns {'stopped_at': step}).
    The lock is checked at every step and before every write (a run forced out of WORKDIR writes
    nothing more).

    One function over 60 lines on purpose: a step's order (check, step, log, evaluate,
    checkpoint) reads top to bottom here, and each piece it calls is small."""
    config, method = p.config, p.method
    primary, pid, pcount = jax.process_index() == 0, jax.process_index(), jax.process_count()
    p.check_lock()
    log = MetricsLog(p.workdir, p.start, config.num_steps, write=primary, resumed_digest=p.metrics_digest,
                     config=config)
    if primary:
        _write_atomic(os.path.join(p.workdir, "config.json"), config.to_json_best_effort(indent=2))
    task = tasks.resolve(config, p.dataset)
    eval_fn, eval_batch = make_eval_fn(method.net, task), min(config.global_batch_size, 512)
    items = config.global_batch_size * task.items_per_example(method.net.input_shape)  # images, tokens
    rate_key = f"{task.unit}_per_second"
    skip = config.get("nonfinite", "stop") == "skip"
    step_fn, here, lrs = guarded_step(method, skip), _checkpoint_meta(p, method), learning_rates(config)
    bar = Progress(progress and primary, config.num_steps, f"{config.method} {config.model}/{config.dataset}")
    profile = Profile(config.get("profile_steps", ()), p.workdir)
    window_speed, total_speed = Throughput(), Throughput()
    boundary = shutdown.Boundary()
    feed = Prefetch(lambda s: p.dataset.train_batch(s, config.global_batch_size, config.seed, config.augment,
                                                    pid, pcount),
                    lambda b: put_batch(b, p.mesh, method.input_sharding), range(p.start + 1, config.num_steps))
    pending, timed = [], Timed()  # steps whose metrics are still on the devices; their clock
    try:
        for step in range(p.start, config.num_steps):
            if stop_after is not None and step - p.start >= stop_after:
                return {"stopped_at": step}
            p.check_lock()
            profile.before(step + 1)
            first = step == p.start
            batch = put_batch(p.first, p.mesh, method.input_sharding) if first else feed.get(step)
            with first_step_compiles(config.method, first):
                p.state, metrics, flags = step_fn(p.state, batch)
                if first:  # the first step of a process compiles: timed apart, left out of the rates
                    pending.append((step + 1, *jax.device_get((metrics, flags))))
            if not first:
                pending.append((step + 1, metrics, flags))
                timed.steps += 1
            done = step + 1
            # The flush of a finished run's final checkpoint belongs to its step: once a step trains
            # past it (the run extended), batches are in flight again and the new end flushes them.
            p.flushed = False
            boundary.open()  # from the end of the first step (compiled): a SIGTERM saves at a boundary
            preempted = done < config.num_steps and _preempted(boundary, done)
            if not (preempted or _sync_step(config, done, profile, first)):
                p.done = done
                bar.step(done)
                _test_hooks(done)
                continue
            # Metrics come to the host here only: at log, evaluation and checkpoint steps (and the end).
            finite = True
            for d, m, f in jax.device_get(pending):
                p.done, finite = d, all_finite(m, f)
                if not finite:
                    _nonfinite(p, m, f, skip, bar)  # stop: raises; skip: counted
                else:
                    p.window.append(window_entry(m))
            pending = []
            for speed in (window_speed, total_speed):
                timed.add_to(speed, items)
            profile.after(done)
            if not finite:  # a skipped step is not logged, evaluated or checkpointed at
                timed.restart()
                bar.step(done)
                _test_hooks(done)
                continue
            if done % config.log_every == 0 or done == config.num_steps:
                mean = window_metrics(task, p.window)
                ips = window_speed.rate()
                p.check_lock()
                log.write({"step": done, "split": "train", **mean, "lr": _shortest(lrs[done - 1]),
                           rate_key: None if ips is None else round(ips, 1),
                           "time": round(p.clock(), 3)})
                bar.set_postfix(**{task.short_names.get(k, k): f"{v:.3f}" for k, v in mean.items()},
                                **{task.rate_label: f"{ips or 0:.0f}"})
                p.window, window_speed = [], Throughput()
            t_aside = time.perf_counter()
            if config.eval_every and done % config.eval_every == 0 and done < config.num_steps:
                params, mstate = method.export(p.state)
                line = {"step": done, "split": "test", **evaluate(eval_fn, params, mstate, p.dataset, eval_batch,
                                                                  task), "time": round(p.clock(), 3)}
                p.check_lock()
                log.write(line)
            if config.checkpoint_every and done % config.checkpoint_every == 0 and done < config.num_steps:
                # The partial logging window travels with the checkpoint so that a resumed run logs
                # exactly what an uninterrupted one does.
                save_checkpoint(p, done, {**here, "skipped_steps": p.skipped, "log_window": p.window,
                                          "time": p.clock(), "metrics": log.digest()})
            # A signal that came during this step's evaluation or checkpoint write stops the run here
            # (every process asks again at the same sync step, so they still agree).
            if preempted or done < config.num_steps and _preempted(boundary, done):
                raise _save_and_stop(p, boundary, done, {**here, "metrics": log.digest()})
            bar.leave_out(time.perf_counter() - t_aside)
            timed.restart()  # evaluation and checkpoints are not train steps
            bar.step(done)
            _test_hooks(done)
        boundary.close()  # the final phase (flush, evaluation, final checkpoint) ends on a signal as before
        bar.close()
        profile.stop(p.done)
        p.input_wait = feed.waited / total_speed.seconds if total_speed.seconds else 0.0
        return _finish(p, log, eval_fn, eval_batch, here, total_speed, task)
    finally:
        boundary.close()
        feed.close()
        bar.close()
        profile.stop(p.done)
        log.close()


def _preempted(boundary: shutdown.Boundary, done: int) -> bool:
    """Whether the run saves and stops at this step boundary: a SIGTERM-like signal reached this
    process, or (multi-process) any process, or JAX's preemption notice came; every process of
    the run agrees, at the same step."""
    asked = boundary.asked()
    if jax.process_count() == 1:
        return asked
    from jax.experimental import multihost_utils

    try:
        asked = multihost_utils.reached_preemption_sync_point(done) or asked
    except RuntimeError:  # no preemption service (jax.distributed started without one)
        pass
    return bool(np.any(multihost_utils.process_allgather(np.int32(asked))))


def _save_and_stop(p: Prepared, boundary: shutdown.Boundary, done: int, here: dict) -> Interrupted:
    """A preemption at step boundary `done`: checkpoint `done` written (unless it just was), and the
    Interrupted that ends the run naming it (exit status 128 + the signal's number)."""
    signum = boundary.take() or signal.SIGTERM  # (a process that another's signal or JAX's notice stopped)
    finish_saves(p)  # a checkpoint of this step still in flight (async_save) is then whole
    if p.intact != done:
        save_checkpoint(p, done, {**here, "skipped_steps": p.skipped, "log_window": p.window, "time": p.clock()})
    finish_saves(p)
    how = shutdown.HOW.get(signum, f"stopped by signal {signum}")
    return Interrupted(f"{how} at step {done}; checkpoint {done} saved in {p.ckpt.directory}; run the same "
                       f"command to resume from it", shutdown.EXIT_STATUS.get(signum, 128 + signum))


@dataclasses.dataclass
class Timed:
    """The clock of the train steps since the last time their metrics came to the host."""

    steps: int = 0
    t0: float = dataclasses.field(default_factory=time.perf_counter)

    def add_to(self, speed: Throughput, items: int) -> None:
        if self.steps:
            speed.add(items * self.steps, time.perf_counter() - self.t0)

    def restart(self) -> None:
        self.steps, self.t0 = 0, time.perf_counter()


def _sync_step(config, done: int, profile: Profile, first: bool) -> bool:
    """Whether step `done`'s metrics (and those of the steps before it) come to the host now: at
    a log, evaluation or checkpoint step, the last step, a profiled step and a process's first."""
    return (first or profile.active or done == config.num_steps or done % config.log_every == 0
            or bool(config.eval_every) and done % config.eval_every == 0
            or bool(config.checkpoint_every) and done % config.checkpoint_every == 0)


def _finish(p: Prepared, log: MetricsLog, eval_fn, eval_batch: int, here: dict, speed: Throughput,
            task: tasks.Task) -> dict:
    """Flushes a pipeline, evaluates, saves the final checkpoint and writes summary.json (the
    task's test metrics as `test_<name>`, its throughput as `<unit>_per_second`)."""
    config, method = p.config, p.method
    if method.flush is not None and not p.flushed:
        p.state = method.flush(p.state)
    params, mstate = method.export(p.state)
    final = evaluate(eval_fn, params, mstate, p.dataset, eval_batch, task)
    p.check_lock()
    log.write({"step": config.num_steps, "split": "test", **final, "time": round(p.clock(), 3)})
    if p.latest != config.num_steps:
        save_checkpoint(p, config.num_steps, {**here, "skipped_steps": p.skipped, "flushed": True,
                                              "time": p.clock(), "metrics": log.digest()})
    finish_saves(p)  # the run ends with its checkpoints whole (an asynchronous save waited for)
    summary = {
        "method": config.method,
        "model": config.model,
        "dataset": config.dataset,
        "task": task.name,
        "devices": int(p.mesh.devices.size),
        "processes": jax.process_count(),
        "mesh": {k: int(v) for k, v in p.mesh.shape.items()},
        "stages": method.net.num_stages,
        "workers": method.workers,
        "steps": config.num_steps,
        "global_batch_size": config.global_batch_size,
        **{f"test_{k}": v for k, v in final.items()},
        f"{task.unit}_per_second": speed.rate() or 0.0,
        "wall_seconds": time.perf_counter() - p.t0,
        "skipped_steps": p.skipped,
        "resumed_from": p.start,
        "input_wait_fraction": round(p.input_wait, 4),
        "report": method_report(method),
    }
    if jax.process_index() == 0:
        p.check_lock()
        _write_atomic(os.path.join(p.workdir, "summary.json"), json.dumps(summary, indent=2, default=_jsonable))
    return summary


def result_words(summary: dict) -> str:
    """A run's result in words from its summary: the task's headline test metric, then its others
    but the loss ('test accuracy 0.9800'; 'test loss 1.4210 (perplexity 4.14, token accuracy 0.5712)')."""
    task = tasks.lookup(summary.get("task", "classification"))
    value = summary.get(f"test_{task.headline}", float("nan"))
    others = [f"{k.replace('_', ' ')} {summary[f'test_{k}']:.4g}" for k in task.metric_names
              if k not in (task.headline, "loss") and f"test_{k}" in summary]
    return f"test {task.headline.replace('_', ' ')} {value:.4f}" + (f" ({', '.join(others)})" if others else "")


def throughput_words(summary: dict) -> str:
    """'5120 images/s' or '81920 tokens/s', from a summary."""
    unit = tasks.lookup(summary.get("task", "classification")).unit
    return f"{summary.get(f'{unit}_per_second', 0.0):.0f} {unit}/s"
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
    Ctrl-C and SIGTERM raise `Interrupted`, whose message names the last complete checkpoint
    (under the command line's `cdpjax.shutdown` the same line ends the process instead).
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
