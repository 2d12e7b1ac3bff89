"""Logging and progress of a training run: what it says and writes as it goes.

`say` (a status line on stderr above the bar, process 0 only), `MetricsLog` (metrics.jsonl and its
TensorBoard copy, trimmed on resume to the resumed step and digested for each checkpoint),
`window_entry` / `window_metrics` (a logging window's metrics from the steps' sums),
`LearningRates` (the optax schedule's value logged with each train line), `Throughput` / `Timed`
(the timed train steps, compilation left out), `Progress` (the bar, with evaluation and
checkpoint time left out), `Profile` (`profile_steps`), `first_step_compiles` (the compile
line), and the words of a summary (`result_words`, `throughput_words`, `method_report`).
The loop (`cdpjax.loop`) calls these at its steps; none of them decides when.
"""
from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from cdpjax import compilation, optim, shutdown, tasks
from cdpjax.events import EventLog, read_metrics
from cdpjax.files import write_atomic, writing

# Fields of a metrics.jsonl line that differ between two runs of the same config.
TIMING_FIELDS = ("images_per_second", "tokens_per_second", "time")


def say(line: str) -> None:
    """A status line on stderr, from process 0 only, on its own line above a progress bar."""
    if jax.process_index() == 0:
        from tqdm.auto import tqdm

        with shutdown.critical():  # not after the line of a signal that is ending the process
            tqdm.write(f"cdpjax: {line}", file=sys.stderr)


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
        write_atomic(self.path, "".join(json.dumps(rec) + "\n" for rec in kept))
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


def _lines_digest(records) -> "hashlib._Hash":
    """SHA-256 of the metrics lines of `records`, as the run writes them."""
    digest = hashlib.sha256()
    for record in records:
        digest.update((json.dumps(record) + "\n").encode())
    return digest


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


def shortest(x) -> float:
    """A float32 as the shortest decimal that reads back as it (0.05, not 0.05000000074505806)."""
    return float(str(np.float32(x)))


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


def method_report(method) -> dict:
    """What a record says of the built method: its own figures, its carrier's padding, its program's shape."""
    out = {k: v for k, v in method.report.items() if isinstance(v, (int, float, str, dict, list))}
    if method.padding is not None:
        out["padding"] = method.padding
    if method.program is not None:
        out["program"] = method.program.summary()
    return out


def jsonable(x):
    """numpy values in a method's info (summary.json) as plain JSON; anything else as text."""
    return x.tolist() if isinstance(x, (np.ndarray, np.generic)) else str(x)


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
