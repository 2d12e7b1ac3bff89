"""The generic training loop: one for every method.

`train(config, workdir)` validates the config, builds the data, the mesh and the
method, checks a first batch against the model, resumes from the latest complete
checkpoint in WORKDIR if there is one, runs `num_steps` train steps with a
progress bar, evaluates every `eval_every` steps, appends metrics to
WORKDIR/metrics.jsonl, checkpoints every `checkpoint_every` steps, flushes
pipelines at the end, and writes WORKDIR/summary.json.

Runs are deterministic given the config and seed: the data position is the step
number (see `cdpjax.data.base`), and the in-flight state of every method lives in
its checkpointed train state, so a run killed at any point and started again
with the same WORKDIR ends as an uninterrupted one (docs/guarantees.md).

Step N is the N-th train step, as numbered in metrics.jsonl and in checkpoint
names. Every step also checks, in the same compiled program, that the loss,
every stage's parameters after the update (where a NaN or Inf gradient shows,
for every optimizer used here) and the whole train state (batches in flight)
are finite: with `nonfinite='stop'` training stops with `NonFiniteError` naming
the step and the stage, the last good checkpoint kept; with `nonfinite='skip'`
the step's update is dropped on device (the state stays as it was, so pipelines
lose only the batch fed at that step) and counted in `summary['skipped_steps']`;
the step then holds two copies of the train state.

In a multi-process run (`cdpjax.distributed`) every process runs this loop on
its slice of each batch; process 0 alone writes config.json, metrics.jsonl and
summary.json, and every process takes part in each checkpoint.
"""
from __future__ import annotations

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

from cdpjax import checks, layouts, models
from cdpjax import data as data_lib
from cdpjax import methods as methods_lib
from cdpjax.checkpoint import Checkpointer
from cdpjax.errors import ConfigError, NonFiniteError
from cdpjax.mesh import make_mesh
from cdpjax.methods.common import tree_select

# Test hook: the process SIGKILLs itself right after finishing (and checkpointing) this step.
KILL_ENV = "CDPJAX_TEST_KILL_AT_STEP"
# Methods whose train states are the same pytree with the same meaning, so that a checkpoint
# of one resumes as the other (dp on N devices -> e2e on one: the same update rule).
INTERCHANGEABLE = (frozenset({"e2e", "dp"}),)
# Config keys that a resumed run must share with the run that wrote the checkpoint: they fix
# the data stream or the layout of the train state. (num_steps, the mesh and the learning
# rate may change; the method only within INTERCHANGEABLE.)
RESUME_KEYS = ("model", "model_kwargs", "norm", "stages", "partition", "dataset", "dataset_kwargs",
               "augment", "global_batch_size", "seed", "optimizer", "workers", "cdp_impl", "cdp_rule",
               "aux_head", "aux_kwargs", "microbatches", "residuals")


def batch_sharding(mesh) -> NamedSharding:
    return NamedSharding(mesh, P("data") if "data" in mesh.axis_names else P())


def put_batch(batch: dict, mesh, sharding=None) -> dict:
    """This process's slice of the global batch as global arrays (default: sharded over `data`)."""
    sharding = sharding or batch_sharding(mesh)
    if jax.process_count() == 1:
        return jax.device_put(batch, sharding)
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


def make_eval_fn(net: models.StagedNet):
    @jax.jit
    def eval_batch(params, state, images, labels, mask):
        logits, _ = net.apply(params, state, images, train=False)
        import optax

        losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
        return {"loss_sum": (losses * mask).sum(), "correct": (correct * mask).sum(), "count": mask.sum()}

    return eval_batch


def evaluate(eval_fn, params, state, dataset, batch_size: int) -> dict:
    totals = {"loss_sum": 0.0, "correct": 0.0, "count": 0.0}
    for batch in dataset.test_batches(batch_size):
        out = jax.device_get(eval_fn(params, state, batch["image"], batch["label"], batch["mask"]))
        for k in totals:
            totals[k] += float(out[k])
    n = max(totals["count"], 1.0)
    return {"loss": totals["loss_sum"] / n, "accuracy": totals["correct"] / n}


def check_dataset_against_model(dataset, net) -> None:
    if tuple(dataset.image_shape) != tuple(net.input_shape):
        raise ConfigError(f"images of shape {dataset.image_shape} do not fit the model's input {net.input_shape}")


def check_batches(dataset, config, net, step: int = 0) -> dict:
    """Reads training batch `step` and a test batch and checks them against the model before
    anything compiles (a loader whose images are not what it declares fails here, not inside
    XLA); returns the training batch, which the loop then uses, so that it is read once."""
    pcount = jax.process_count()
    per_process = config.global_batch_size // pcount
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
        if label.shape != (n,) or not np.issubdtype(label.dtype, np.integer):
            raise ConfigError(f"dataset {dataset.name!r} gives {split} labels of shape {label.shape} and dtype "
                              f"{label.dtype}; expected integer labels of shape {(n,)}")
        if label.size and (label.min() < 0 or label.max() >= dataset.num_classes):
            raise ConfigError(f"dataset {dataset.name!r} gives {split} labels in [{label.min()}, {label.max()}], "
                              f"outside [0, {dataset.num_classes}) for its {dataset.num_classes} classes")
    return batch


def setup(config, devices=None):
    """Validated config -> (dataset, mesh, method); everything that can fail before compiling."""
    checks.validate(config)
    dataset = data_lib.build(config)
    if config.global_batch_size % jax.process_count():
        raise ConfigError(f"global_batch_size={config.global_batch_size} is not divisible by the "
                          f"{jax.process_count()} processes")
    mesh = make_mesh(layouts.mesh_for(config), devices)
    ctx = methods_lib.Context(config, mesh, tuple(dataset.image_shape), dataset.num_classes)
    method = methods_lib.build(ctx)
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


class MetricsLog:
    """metrics.jsonl: one JSON object per line; on resume, lines past the resumed step are dropped
    (and, when a finished run is started again, its final test line, which is written again) so
    that a resumed run's log equals an uninterrupted run's. Written by process 0 only."""

    def __init__(self, path: str, resume_step: int, final_step: int, write: bool = True):
        self.path, self.enabled = path, write
        if not write:
            return
        lines = []
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # a line cut short by a crash
                    step = rec.get("step", 0)
                    final_test = step == final_step and rec.get("split") == "test"
                    if step <= resume_step and not final_test:
                        lines.append(json.dumps(rec))
        _write_atomic(path, "".join(line + "\n" for line in lines))

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


def _jsonable(x):
    """numpy values in a method's info (summary.json) as plain JSON; anything else as text."""
    return x.tolist() if isinstance(x, (np.ndarray, np.generic)) else str(x)


def _write_atomic(path: str, text: str) -> None:
    """Readers (other processes, a resumed run) see the old file or the new one, never half."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


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
    if not os.path.exists(path):
        return
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, json.JSONDecodeError):
        return  # the checkpoint's own meta still guards the method and the mesh
    now = json.loads(config.to_json_best_effort())
    changed = [k for k in RESUME_KEYS if k in saved and k in now and saved[k] != now[k]]
    if saved.get("method") and not _interchangeable(saved["method"], config.method):
        changed.insert(0, "method")
    if changed:
        diffs = ", ".join(f"{k}={saved.get(k)!r} there, {now.get(k)!r} here" for k in changed)
        raise ConfigError(f"WORKDIR {workdir} holds a run with another config ({diffs}); a run resumes only "
                          f"with the config it started with: restore those values, or use a fresh --workdir")


def _stale(method) -> list:
    return np.asarray(method.stale).astype(int).tolist()


def restore_state(ckpt: Checkpointer, step: int, state, method, mesh, config):
    """Restores checkpoint `step` into `state` -> (state, meta), or a ConfigError saying why not.

    Onto another mesh (another device count) the state is restored and resharded when its
    arrays keep their shapes, as for e2e, dp and local, whose state is the model itself;
    a state with a leading worker or stage axis changes shape, and the error says so.
    """
    meta = ckpt.read_meta(step)
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


def train(config, workdir: str, progress: bool = True, devices=None, stop_after: int | None = None,
          require_checkpoint: bool = False) -> dict[str, Any]:
    """Trains `config` in `workdir`; returns the summary (also written to summary.json).

    `stop_after` ends the process's work after that many steps of this call, as if
    killed (used by the resume tests); the run is then resumed by calling again.
    `require_checkpoint`: fail unless WORKDIR holds a complete checkpoint to resume from.
    """
    dataset, mesh, method = setup(config, devices)
    check_dataset_against_model(dataset, method.net)
    primary = jax.process_index() == 0
    if require_checkpoint and not os.path.isdir(os.path.join(workdir, "checkpoints")):
        raise ConfigError(f"nothing to resume: {os.path.join(workdir, 'checkpoints')} does not exist")
    os.makedirs(workdir, exist_ok=True)
    ckpt = Checkpointer(workdir)
    start, skipped, flushed, window = 0, 0, False, []
    try:
        latest = ckpt.latest_step()
        if latest is None and require_checkpoint:
            raise ConfigError(f"nothing to resume: {ckpt.directory} holds no complete checkpoint")
        # The first batch this call trains on, checked before anything compiles and then used.
        first_step = min(latest or 0, config.num_steps - 1)
        first = check_batches(dataset, config, method.net, first_step)
        if latest is not None:
            check_resume_config(workdir, config)
        state = method.init(jax.random.key(config.seed))
        if latest is not None:
            state, meta = restore_state(ckpt, latest, state, method, mesh, config)
            start, skipped = latest, int(meta.get("skipped_steps", 0))
            flushed = bool(meta.get("flushed", False))
            window = list(meta.get("log_window", []))
    except BaseException:
        ckpt.close()
        raise
    if primary:
        _write_atomic(os.path.join(workdir, "config.json"), config.to_json_best_effort(indent=2))
    log = MetricsLog(os.path.join(workdir, "metrics.jsonl"), start, config.num_steps, write=primary)
    eval_fn = make_eval_fn(method.net)
    eval_batch = min(config.global_batch_size, 512)
    skip = config.get("nonfinite", "stop") == "skip"
    step_fn = guarded_step(method, skip)
    here = {"method": config.method, "mesh": {k: int(v) for k, v in mesh.shape.items()},
            "devices": int(mesh.devices.size), "processes": jax.process_count()}
    if method.workers is not None:
        here["workers"] = method.workers
    if method.stale is not None:  # CDP: the update rule itself, which the worker count decides
        here["stale"] = _stale(method)
    kill_at = os.environ.get(KILL_ENV)

    from tqdm.auto import tqdm

    bar = tqdm(total=config.num_steps, initial=start, disable=not (progress and primary), dynamic_ncols=True,
               desc=f"{config.method} {config.model}/{config.dataset}")
    timed_images, timed_seconds = 0, 0.0
    t_begin = time.perf_counter()
    pid, pcount = jax.process_index(), jax.process_count()
    for step in range(start, config.num_steps):
        if stop_after is not None and step - start >= stop_after:
            bar.close()
            ckpt.close()
            return {"stopped_at": step}
        batch = first if step == first_step else dataset.train_batch(
            step, config.global_batch_size, config.seed, config.augment, pid, pcount)
        t0 = time.perf_counter()
        state, metrics, flags = step_fn(state, put_batch(batch, mesh, method.input_sharding))
        metrics, flags = jax.device_get((metrics, flags))
        if step > start:  # the first step of a process compiles
            timed_seconds += time.perf_counter() - t0
            timed_images += config.global_batch_size
        done = step + 1
        if not all_finite(metrics, flags):
            where = describe_nonfinite(metrics, flags)
            if skip:
                skipped += 1
                if primary:
                    bar.write(f"cdpjax: skipped step {done} (non-finite, {where}); {skipped} skipped so far",
                              file=sys.stderr)
                bar.update(1)
                continue
            bar.close()
            last = ckpt.latest_step()
            ckpt.close()
            kept = (f"the last good checkpoint (step {last}) in {ckpt.directory} is kept" if last is not None
                    else "no checkpoint had been written yet")
            raise NonFiniteError(f"non-finite values at step {done} in {where}; training stopped, {kept} "
                                 f"(--config.nonfinite=skip skips such steps instead)")
        window.append({k: float(metrics[k]) for k in ("loss", "accuracy")})
        if done % config.log_every == 0 or done == config.num_steps:
            mean = {k: float(np.mean([m[k] for m in window])) for k in ("loss", "accuracy")}
            ips = timed_images / timed_seconds if timed_seconds else 0.0
            log.write({"step": done, "split": "train", **mean})
            bar.set_postfix(loss=f"{mean['loss']:.3f}", acc=f"{mean['accuracy']:.3f}", img_s=f"{ips:.0f}")
            window = []
        if config.eval_every and done % config.eval_every == 0 and done < config.num_steps:
            params, mstate = method.export(state)
            log.write({"step": done, "split": "test", **evaluate(eval_fn, params, mstate, dataset, eval_batch)})
        if config.checkpoint_every and done % config.checkpoint_every == 0 and done < config.num_steps:
            # The partial logging window travels with the checkpoint so that a resumed run logs
            # exactly what an uninterrupted one does.
            ckpt.save(done, state, {**here, "skipped_steps": skipped, "log_window": window})
        bar.update(1)
        if kill_at == str(done):
            os.kill(os.getpid(), signal.SIGKILL)
    bar.close()

    if method.flush is not None and not flushed:
        state = method.flush(state)
    params, mstate = method.export(state)
    final = evaluate(eval_fn, params, mstate, dataset, eval_batch)
    log.write({"step": config.num_steps, "split": "test", **final})
    if latest != config.num_steps:
        ckpt.save(config.num_steps, state, {**here, "skipped_steps": skipped, "flushed": True})
    ckpt.close()
    wall = time.perf_counter() - t_begin
    summary = {
        "method": config.method,
        "model": config.model,
        "dataset": config.dataset,
        "devices": int(mesh.devices.size),
        "processes": jax.process_count(),
        "mesh": {k: int(v) for k, v in mesh.shape.items()},
        "stages": method.net.num_stages,
        "workers": method.workers,
        "steps": config.num_steps,
        "global_batch_size": config.global_batch_size,
        "test_accuracy": final["accuracy"],
        "test_loss": final["loss"],
        "images_per_second": timed_images / timed_seconds if timed_seconds else 0.0,
        "wall_seconds": wall,
        "skipped_steps": skipped,
        "resumed_from": start,
        "info": {k: v for k, v in method.info.items() if isinstance(v, (int, float, str, dict, list))},
    }
    if primary:
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2, default=_jsonable)
    return summary
