"""The generic training loop: one for every method.

`train(config, workdir)` validates the config, builds the data, the mesh and the
method, resumes from the latest complete checkpoint in WORKDIR if there is one,
runs `num_steps` train steps with a progress bar, evaluates every `eval_every`
steps, appends metrics to WORKDIR/metrics.jsonl, checkpoints every
`checkpoint_every` steps, flushes pipelines at the end, and writes
WORKDIR/summary.json. Runs are deterministic given the config and seed: the data
position is the step number (see `cdpjax.data.base`), and the in-flight state of
every method lives in its checkpointed train state.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from cdpjax import config as cfg_lib
from cdpjax import data as data_lib
from cdpjax import methods as methods_lib
from cdpjax import models
from cdpjax.checkpoint import Checkpointer
from cdpjax.config import ConfigError
from cdpjax.mesh import make_mesh


class NonFiniteError(RuntimeError):
    """A NaN or Inf in a loss or gradient; training stopped, the last good checkpoint kept."""


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


def setup(config, devices=None):
    """Validated config -> (dataset, mesh, method); everything that can fail before compiling."""
    cfg_lib.validate(config)
    dataset = data_lib.build(config)
    if config.global_batch_size % jax.process_count():
        raise ConfigError(f"global_batch_size={config.global_batch_size} is not divisible by the "
                          f"{jax.process_count()} processes")
    mesh = make_mesh(config.mesh, devices)
    ctx = methods_lib.Context(config, mesh, tuple(dataset.image_shape), dataset.num_classes)
    method = methods_lib.build(ctx)
    return dataset, mesh, method


def _all_finite(tree) -> bool:
    return all(bool(np.all(np.isfinite(np.asarray(x)))) for x in jax.tree.leaves(tree)
               if np.issubdtype(np.asarray(x).dtype, np.floating))


class MetricsLog:
    """metrics.jsonl: one JSON object per line; on resume, lines past the resumed step are dropped
    so that a resumed run's log equals an uninterrupted run's."""

    def __init__(self, path: str, resume_step: int):
        self.path = path
        lines = []
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # a line cut short by a crash
                    if rec.get("step", 0) <= resume_step:
                        lines.append(json.dumps(rec))
        with open(path, "w") as f:
            f.writelines(line + "\n" for line in lines)

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def default_workdir(config) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = os.path.join("workdirs", f"{config.method}-{config.model}-{config.dataset}-{stamp}")
    path, k = base, 1
    while os.path.exists(path):
        path, k = f"{base}-{k}", k + 1
    return path


def train(config, workdir: str, progress: bool = True, devices=None, stop_after: int | None = None) -> dict[str, Any]:
    """Trains `config` in `workdir`; returns the summary (also written to summary.json).

    `stop_after` ends the process's work after that many steps of this call, as if
    killed (used by the resume tests); the run is then resumed by calling again.
    """
    dataset, mesh, method = setup(config, devices)
    check_dataset_against_model(dataset, method.net)
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config.to_json_best_effort(indent=2))

    ckpt = Checkpointer(workdir)
    state = method.init(jax.random.key(config.seed))
    start, skipped, flushed, window = 0, 0, False, []
    latest = ckpt.latest_step()
    if latest is not None:
        state, meta = ckpt.restore(latest, state)
        start, skipped = latest, int(meta.get("skipped_steps", 0))
        flushed = bool(meta.get("flushed", False))
        window = list(meta.get("log_window", []))
        if meta.get("method") not in (None, config.method):
            raise ConfigError(f"WORKDIR {workdir} holds a {meta.get('method')!r} run, not {config.method!r}")
    log = MetricsLog(os.path.join(workdir, "metrics.jsonl"), start)
    eval_fn = make_eval_fn(method.net)
    eval_batch = min(config.global_batch_size, 512)

    from tqdm.auto import tqdm

    bar = tqdm(total=config.num_steps, initial=start, disable=not progress, dynamic_ncols=True,
               desc=f"{config.method} {config.model}/{config.dataset}")
    timed_images, timed_seconds = 0, 0.0
    t_begin = time.perf_counter()
    pid, pcount = jax.process_index(), jax.process_count()
    step = start
    for step in range(start, config.num_steps):
        if stop_after is not None and step - start >= stop_after:
            bar.close()
            ckpt.close()
            return {"stopped_at": step}
        batch = dataset.train_batch(step, config.global_batch_size, config.seed, config.augment, pid, pcount)
        t0 = time.perf_counter()
        new_state, metrics = method.train_step(state, put_batch(batch, mesh, method.input_sharding))
        metrics = jax.device_get(metrics)
        if step > start:  # the first step of a process compiles
            timed_seconds += time.perf_counter() - t0
            timed_images += config.global_batch_size
        if not np.isfinite(metrics["loss"]):
            if config.get("nonfinite", "stop") == "skip":
                skipped += 1
                bar.update(1)
                continue
            bar.close()
            raise NonFiniteError(
                f"non-finite loss {metrics['loss']} at step {step}"
                f"{(' (stage ' + str(metrics['stage']) + ')') if 'stage' in metrics else ''}; "
                f"the last good checkpoint in {ckpt.directory} is kept "
                f"(--config.nonfinite=skip skips such steps instead)"
            )
        state = new_state
        window.append({k: float(metrics[k]) for k in ("loss", "accuracy")})
        done = step + 1
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
            ckpt.save(done, state, {"method": config.method, "skipped_steps": skipped, "log_window": window})
        bar.update(1)
    bar.close()

    if method.flush is not None and not flushed:
        state = method.flush(state)
    params, mstate = method.export(state)
    final = evaluate(eval_fn, params, mstate, dataset, eval_batch)
    log.write({"step": config.num_steps, "split": "test", **final})
    if latest != config.num_steps:
        ckpt.save(config.num_steps, state, {"method": config.method, "skipped_steps": skipped, "flushed": True})
    ckpt.close()
    wall = time.perf_counter() - t_begin
    summary = {
        "method": config.method,
        "model": config.model,
        "dataset": config.dataset,
        "devices": int(mesh.devices.size),
        "mesh": {k: int(v) for k, v in mesh.shape.items()},
        "stages": method.net.num_stages,
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
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary
