"""TensorBoard event files of a run's metrics, written with tensorboardX into WORKDIR.

`tensorboard --logdir WORKDIR` (or a folder of work directories) shows them: one
scalar per numeric field of each metrics.jsonl line, tagged `<split>/<field>`
(`train/loss`, `train/accuracy`, `train/lr`, `train/images_per_second`,
`test/loss`, `test/accuracy`) at the line's step; `time` is TensorBoard's own wall
time. The events are a copy of metrics.jsonl: when a run resumes, the old event
files are removed and the lines metrics.jsonl keeps are written again first, so a
resumed run shows no step twice. TensorBoard stores the values as float32.
"""
from __future__ import annotations

import os

EVENTS_PREFIX = "events.out.tfevents."
# Fields of a metrics line that are not curves: its position, and wall time (TensorBoard's own).
NOT_SCALARS = ("step", "split", "time")


def scalars(record: dict) -> list[tuple[str, float]]:
    """(tag, value) for each numeric field of a metrics line (None, e.g. a throughput not
    measured yet, is left out)."""
    split = record.get("split", "train")
    return [(f"{split}/{k}", float(v)) for k, v in record.items()
            if k not in NOT_SCALARS and isinstance(v, (int, float)) and not isinstance(v, bool)]


class EventLog:
    """The run's TensorBoard events; written by process 0 only (`MetricsLog` owns it)."""

    def __init__(self, workdir: str, records=()):
        from tensorboardX import SummaryWriter

        for name in os.listdir(workdir):
            if name.startswith(EVENTS_PREFIX):
                os.unlink(os.path.join(workdir, name))
        self.writer = SummaryWriter(workdir, flush_secs=10)
        for record in records:
            self.write(record)

    def write(self, record: dict) -> None:
        for tag, value in scalars(record):
            self.writer.add_scalar(tag, value, int(record["step"]))

    def close(self) -> None:
        self.writer.close()


__all__ = ["EVENTS_PREFIX", "EventLog", "scalars"]
