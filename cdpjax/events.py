"""TensorBoard event files of a run's metrics, written with tensorboardX into WORKDIR; and
metrics.jsonl read back (`read_metrics`: the lines that are metrics records, and why the
others are not), by the trainer on resume and by `cdpjax plot`.

`tensorboard --logdir WORKDIR` (or a folder of work directories) shows them: one
scalar per numeric field of each metrics.jsonl line, tagged `<split>/<field>`
(`train/loss`, `train/accuracy`, `train/lr`, `train/images_per_second`,
`test/loss`, `test/accuracy`) at the line's step; `time` is TensorBoard's own wall
time. A new run writes its configuration first, as hyperparameters (TensorBoard's HPARAMS
tab: every key, nested ones dotted, `model_kwargs.width`; lists and dicts as their text).
TensorBoard stores the values as float32.

A resumed run continues: the event files already there stay as they are, and a new one is
added (named after them, so that readers take it last). It opens with TensorBoard's restart
mark (a `SessionLog.START` event) at the first step the old files hold and metrics.jsonl
no longer keeps; TensorBoard's reader then forgets every value of the old files from that
step on, and the new file writes again the lines kept from that step (so a resumed run
shows one value per step, as an uninterrupted run does).

The events are written and flushed in the caller's thread, one metrics line at a time
(tensorboardX's `EventsWriter`, not its `SummaryWriter`, whose writer thread would meet a
full disk where no one can answer it): a failure to write reaches the trainer, which says
which file in one line.
"""
from __future__ import annotations

import json
import os
import time

from cdpjax import files
from cdpjax.errors import ConfigError

EVENTS_PREFIX = "events.out.tfevents."
# Fields of a metrics line that are not curves: its position, and wall time (TensorBoard's own).
NOT_SCALARS = ("step", "split", "time")


def scalars(record: dict) -> list[tuple[str, float]]:
    """(tag, value) for each numeric field of a metrics line (None, e.g. a throughput not
    measured yet, is left out)."""
    split = record.get("split", "train")
    return [(f"{split}/{k}", float(v)) for k, v in record.items()
            if k not in NOT_SCALARS and isinstance(v, (int, float)) and not isinstance(v, bool)]


def event_files(workdir: str) -> list[str]:
    """The event files in WORKDIR; ConfigError for an entry of that name that is not a file."""
    paths = [os.path.join(workdir, n) for n in sorted(os.listdir(workdir)) if n.startswith(EVENTS_PREFIX)]
    for path in paths:
        if os.path.isdir(path) and not os.path.islink(path):
            raise ConfigError(f"{path} is named like a TensorBoard event file but is not a file: the run reads "
                              f"the names of its event files, so move it away")
    return paths


def metrics_record(line: bytes):
    """A metrics.jsonl line as its record, or why it is not one (a str)."""
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        return "not UTF-8 text"
    except (json.JSONDecodeError, RecursionError):
        return "not JSON (cut short by a crash?)"
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return f"its step is {json.dumps(step)[:40]}, not a count of steps"
    if record.get("split") not in ("train", "test"):
        return f"its split is {json.dumps(record.get('split'))[:40]}, not 'train' or 'test'"
    return record


def read_metrics(path: str) -> tuple[list[dict], list[str]]:
    """The records of a metrics.jsonl and, for each line that is not one, where and why; a path
    that is not a file is a ConfigError."""
    if not os.path.exists(path):
        return [], []
    if not os.path.isfile(path):
        raise ConfigError(f"{path} is not a file: the run appends its metrics there, so move it away")
    records, dropped = [], []
    with files.open_bounded(path, files.METRICS_LIMIT) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = metrics_record(line)
            if isinstance(record, str):
                dropped.append(f"line {number}: {record}")
            else:
                records.append(record)
    return records, dropped


class EventLog:
    """The run's TensorBoard events; written by process 0 only (`MetricsLog` owns it).

    `records` are the metrics lines the run keeps; `restart`, on resume, the first step from
    which the old event files hold lines that it does not keep (the step after the resumed one,
    or a finished run's last step, whose test line is written again); `config`, written as
    hyperparameters when WORKDIR has no event files yet."""

    def __init__(self, workdir: str, records=(), restart: int = 0, config=None):
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        old = event_files(workdir)
        self.writer = EventsWriter(os.path.join(workdir, "events"), filename_suffix=f".{len(old):04d}" if old else "")
        if not old:
            if config is not None:
                self._write_hparams(config)
            rewrite = list(records)
        else:  # TensorBoard's reader voids the old files' values from `restart` on
            self._write_event(Event(step=restart, session_log=SessionLog(status=SessionLog.START)))
            rewrite = [r for r in records if r["step"] >= restart]
        for record in rewrite:
            self._add(record)
        self.writer.flush()

    def _write_event(self, event) -> None:
        event.wall_time = time.time()
        self.writer.write_event(event)

    def _write_hparams(self, config) -> None:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.summary import hparams

        experiment, start, _ = hparams(hyperparameters(config), {"test/accuracy": None, "test/loss": None})
        for summary in (experiment, start):
            self._write_event(Event(summary=summary))

    def _add(self, record: dict) -> None:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.summary import scalar

        for tag, value in scalars(record):
            self._write_event(Event(summary=scalar(tag, value), step=int(record["step"])))

    def write(self, record: dict) -> None:
        self._add(record)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def hyperparameters(config) -> dict:
    """The config as TensorBoard's hyperparameters: {dotted key: bool, number or text}, nested
    ConfigDicts flattened (`mesh.data`), lists, tuples and None as their text; `*_kwargs`
    and `distributed` options dotted too."""
    out = {}

    def visit(prefix: str, node) -> None:
        for key in sorted(node.keys()):
            value, name = node[key], f"{prefix}{key}"
            if hasattr(value, "keys"):
                visit(f"{name}.", value)
            elif isinstance(value, (bool, int, float, str)):
                out[name] = value
            else:
                out[name] = json.dumps(value) if isinstance(value, (list, tuple)) else str(value)
    visit("", config)
    return out


__all__ = ["EVENTS_PREFIX", "EventLog", "event_files", "hyperparameters", "metrics_record", "read_metrics",
           "scalars"]
