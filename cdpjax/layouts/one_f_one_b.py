"""1f1b: PipeDream-flush, the one-forward-one-backward pipeline.

Device j (stage j of K) runs K-1-j warm-up forwards, then alternates one forward
and one backward until its forwards are done, then the remaining backwards
(cool-down), and every stage updates at the flush. The same gradients, bubble
and flush as GPipe (2(K-1) idle ticks of 2(M+K-1) per device and step), but a
device holds at most K-j micro-batches' activations instead of M: its point is
memory.
"""
from __future__ import annotations

from cdpjax.kinds import BACKWARD, FORWARD
from cdpjax.layouts import Layout, Reference, register
from cdpjax.timetable import TimeTable, from_orders, positive


def one_f_one_b_order(stage: int, stages: int, microbatches: int) -> list[tuple[str, int, int]]:
    """Device `stage`'s actions: warm-up forwards, then forward/backward pairs, then cool-down."""
    warmup = min(stages - 1 - stage, microbatches)
    order = [(FORWARD.name, stage, m) for m in range(warmup)]
    for i in range(microbatches - warmup):
        order += [(FORWARD.name, stage, warmup + i), (BACKWARD.name, stage, i)]
    return order + [(BACKWARD.name, stage, m) for m in range(microbatches - warmup, microbatches)]


def one_f_one_b_table(stages: int = 4, microbatches: int = 4, steps: int = 2) -> TimeTable:
    positive(stages=stages, microbatches=microbatches)
    orders = [one_f_one_b_order(j, stages, microbatches) for j in range(stages)]
    return from_orders("1f1b", orders, stages, microbatches, steps)


register(Layout(
    "1f1b", "cdpjax.methods.one_f_one_b:build", axes=("stage", "data"), device_axis="stage",
    table=one_f_one_b_table, microbatches=True, colour="micro", label="{kind}{micro}",
    legend="F<m>/B<m>: forward/backward of micro-batch m",
    title="{method}: {stages} stages, M={microbatches} micro-batches",
    summary="PipeDream-flush: warm-up forwards, one forward one backward, cool-down, flush each step",
    reference=Reference("e2e")))
