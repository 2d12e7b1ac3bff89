"""looped-bfs: breadth-first pipeline parallelism (Lamy-Poirier 2022), LoopedBFS.

L = V x D stages on D devices, device d holding stages d, D+d, 2D+d, ... (looped, as
interleaved-1f1b). Where interleaved 1F1B goes depth first (the earliest micro-batch
through its next stage), LoopedBFS goes breadth first: a device runs the forwards
of all M micro-batches through its first stage, then all of them through its next
stage, and so on; then the backwards, its last stage first, each stage's
micro-batches last-in first-out (M-1 down to 0), as
`torch.distributed.pipelining`'s `ScheduleLoopedBFS` lays them out. Every stage
updates at the flush. A device holds all V x M of its stage-activations at the
turn, GPipe's memory; its point is fewer, larger bursts of work per stage (gradient
accumulation over the whole batch for one stage before the next).
"""
from __future__ import annotations

from cdpjax.errors import ConfigError
from cdpjax.kinds import BACKWARD, FORWARD
from cdpjax.layouts import Layout, Reference, register
from cdpjax.timetable import TimeTable, from_orders, positive


def looped_bfs_order(device: int, devices: int, chunks: int, microbatches: int) -> list[tuple[str, int, int]]:
    """Device `device`'s actions: every micro-batch's forward stage by stage, then the backwards
    from its last stage down, each stage's micro-batches in reverse."""
    own = [c * devices + device for c in range(chunks)]
    forwards = [(FORWARD.name, s, m) for s in own for m in range(microbatches)]
    return forwards + [(BACKWARD.name, s, m) for s in reversed(own) for m in reversed(range(microbatches))]


def looped_bfs_table(stages: int = 8, chunks: int = 2, microbatches: int = 4, steps: int = 2) -> TimeTable:
    """`stages` = V x D stages on D = stages / chunks devices, stage s on device s mod D."""
    positive(stages=stages, chunks=chunks, microbatches=microbatches)
    if stages % chunks:
        raise ConfigError(f"looped-bfs puts chunks stages on each device: chunks={chunks} must divide "
                          f"stages={stages}")
    devices = stages // chunks
    orders = [looped_bfs_order(d, devices, chunks, microbatches) for d in range(devices)]
    return from_orders("looped-bfs", orders, stages, microbatches, steps,
                       device_of=[s % devices for s in range(stages)])


register(Layout(
    "looped-bfs", "cdpjax.methods.looped_bfs:build", axes=("stage", "data"), device_axis="stage",
    table=looped_bfs_table, microbatches=True, colour="micro", label="{kind}{micro}s{stage}",
    diagram_label="{kind}{micro}",
    legend="F<m>s<j>/B<m>s<j>: forward/backward of micro-batch m through stage j (rows: devices)",
    title="{method}: {stages} stages on {devices} devices, M={microbatches} micro-batches",
    summary="breadth-first looped pipeline: each device all micro-batches through one of its stages, then the next",
    reference=Reference("e2e")))
