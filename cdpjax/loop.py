"""The step loop: `run(prepared)` trains from the resumed step to num_steps, then finishes.

Each step: the lock checked, the batch (read and placed ahead of it by `cdpjax.data.prefetch`),
the guarded step (`cdpjax.guard`), at most `IN_FLIGHT` steps ahead of the newest one waited for;
at a sync step (log, evaluation, checkpoint, the last, a profiled one, a process's first) the
metrics and finite flags of every step since come to the host, in order, and the step logs,
evaluates, checkpoints (`cdpjax.rundir.save_checkpoint`) and answers a preemption, in that
order. At the end: a pipeline flushed, the final evaluation, the final checkpoint and
summary.json (`_finish`). What it says and writes is `cdpjax.runlog`'s; the run directory's life
is `cdpjax.rundir`'s.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import jax
import numpy as np

from cdpjax import guard, models, shutdown, tasks
from cdpjax import rundir
from cdpjax import setup as setup_lib
from cdpjax.data.prefetch import Prefetch
from cdpjax.errors import NonFiniteError
from cdpjax.files import write_atomic
from cdpjax.rundir import Prepared, checkpoint_meta, finish_saves, save_checkpoint
from cdpjax.runlog import (MetricsLog, Profile, Progress, Throughput, Timed, first_step_compiles, jsonable,
                           learning_rates, method_report, shortest, window_entry, window_metrics)

# Steps dispatched ahead of the newest one the host has waited for. Two keep an accelerator fed
# (the next step is queued while one runs); an unbounded queue between sync steps let simulated
# CPU devices on busy cores hold several steps' collectives at once, and XLA:CPU's rendezvous
# timed out.
IN_FLIGHT = 2


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
        write_atomic(os.path.join(p.workdir, "config.json"), config.to_json_best_effort(indent=2))
    task = tasks.resolve(config, p.dataset)
    eval_fn, eval_batch = make_eval_fn(method.net, task), min(config.global_batch_size, 512)
    items = config.global_batch_size * task.items_per_example(method.net.input_shape)  # images, tokens
    rate_key = f"{task.unit}_per_second"
    skip = config.get("nonfinite", "stop") == "skip"
    step_fn, here, lrs = guard.guarded_step(method, skip), checkpoint_meta(p, method), learning_rates(config)
    bar = Progress(progress and primary, config.num_steps, f"{config.method} {config.model}/{config.dataset}")
    profile = Profile(config.get("profile_steps", ()), p.workdir)
    window_speed, total_speed = Throughput(), Throughput()
    boundary = shutdown.Boundary()
    feed = Prefetch(lambda s: p.dataset.train_batch(s, config.global_batch_size, config.seed, config.augment,
                                                    pid, pcount),
                    lambda b: setup_lib.put_batch(b, p.mesh, method.input_sharding),
                    range(p.start + 1, config.num_steps))
    pending, timed = [], Timed()  # steps whose metrics are still on the devices; their clock
    try:
        for step in range(p.start, config.num_steps):
            if stop_after is not None and step - p.start >= stop_after:
                return {"stopped_at": step}
            p.check_lock()
            profile.before(step + 1)
            first = step == p.start
            batch = setup_lib.put_batch(p.first, p.mesh, method.input_sharding) if first else feed.get(step)
            with first_step_compiles(config.method, first):
                p.state, metrics, flags = step_fn(p.state, batch)
                if first:  # the first step of a process compiles: timed apart, left out of the rates
                    jax.block_until_ready((metrics, flags))
            pending.append((step + 1, metrics, flags))
            if len(pending) > IN_FLIGHT:
                jax.block_until_ready(pending[-IN_FLIGHT - 1][1:])
            if not first:
                timed.steps += 1
            done = step + 1
            # The flush of a finished run's final checkpoint belongs to its step: once a step trains
            # past it (the run extended), batches are in flight again and the new end flushes them.
            p.flushed = False
            boundary.open()  # from the end of the first step (compiled): a SIGTERM saves at a boundary
            sync = _sync_step(config, done, profile, first)
            preempted = done < config.num_steps and _preempted(boundary, done, sync)
            if not (preempted or sync):
                p.done = done
                bar.step(done)
                rundir.test_hooks(done)
                continue
            # Metrics come to the host here only: at log, evaluation and checkpoint steps (and the end).
            finite = True
            for d, m, f in _to_host(pending):
                p.done, finite = d, guard.all_finite(m, f)
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
                rundir.test_hooks(done)
                continue
            if done % config.log_every == 0 or done == config.num_steps:
                mean = window_metrics(task, p.window)
                ips = window_speed.rate()
                p.check_lock()
                log.write({"step": done, "split": "train", **mean, "lr": shortest(lrs[done - 1]),
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
            if preempted or done < config.num_steps and _preempted(boundary, done, sync=True):
                raise _save_and_stop(p, boundary, done, {**here, "metrics": log.digest()})
            bar.leave_out(time.perf_counter() - t_aside)
            timed.restart()  # evaluation and checkpoints are not train steps
            bar.step(done)
            rundir.test_hooks(done)
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


def _to_host(pending: list) -> list:
    """The metrics and finite flags of the steps in `pending` ([(step, metrics, flags)]), on the host:
    the step loop's one transfer from the devices (the steps' values, waited for)."""
    return jax.device_get(pending)


def _sync_step(config, done: int, profile: Profile, first: bool) -> bool:
    """Whether step `done`'s metrics (and those of the steps before it) come to the host now: at
    a log, evaluation or checkpoint step, the last step, a profiled step and a process's first."""
    return (first or profile.active or done == config.num_steps or done % config.log_every == 0
            or bool(config.eval_every) and done % config.eval_every == 0
            or bool(config.checkpoint_every) and done % config.checkpoint_every == 0)


def _nonfinite(p: Prepared, metrics, flags, skip: bool, progress: Progress) -> None:
    """A step with non-finite values: counted and skipped, or NonFiniteError."""
    where = guard.describe_nonfinite(metrics, flags)
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


def _preempted(boundary: shutdown.Boundary, done: int, sync: bool) -> bool:
    """Whether the run saves and stops at step boundary `done` (asked at every boundary, and again
    after a sync step's evaluation and checkpoint); every process of the run answers the same.

    JAX's preemption notice (`multihost_utils.reached_preemption_sync_point`) is asked at every
    boundary with the step, as JAX's protocol wants (and as orbax asks it at each save): a host
    call, no device sync; it answers yes at the same step on every process. A SIGTERM-like signal
    to one process stops a single-process run at the next boundary; in a multi-process run the
    processes agree on it only at sync steps (log, evaluation, checkpoint, first, profiled: the
    loop's `_sync_step`), where the metrics come to the host anyway, by an all-gather of one flag:
    so at the next sync step, at most `log_every` steps after the signal."""
    from jax.experimental import multihost_utils

    try:
        noticed = multihost_utils.reached_preemption_sync_point(done)
    except RuntimeError:  # no preemption service (jax.distributed started without one)
        noticed = False
    if noticed or jax.process_count() == 1:
        return noticed or boundary.asked()
    return sync and bool(np.any(multihost_utils.process_allgather(np.int32(boundary.asked()))))


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


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM while training; the message says where the run stands and what to do."""

    def __init__(self, message: str, exit_status: int):
        super().__init__(message)
        self.exit_status = exit_status


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
        write_atomic(os.path.join(p.workdir, "summary.json"), json.dumps(summary, indent=2, default=jsonable))
    return summary


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
