"""zb-h1: the zero-bubble schedule ZB-H1 (Qi et al. 2023), one stage per device.

The backward of a stage is split into B, the input cotangent, which the previous
stage waits for, and W, the weight gradient, which nothing waits for. Device j
(stage j of K) runs 1F1B's order of forwards and input backwards (K-1-j warm-up
forwards, then one F and one B, then the cool-down Bs) and runs the W of
micro-batch m right after the B of micro-batch m + j; the Ws it still owes after
its last B close its list. The last stage, whose Bs come first, defers its Ws
longest: they fill the tail bubble 1F1B leaves there, while stage 0, the last to
finish, runs each W at once. This is `torch.distributed.pipelining`'s
`ScheduleInterleavedZeroBubble` (ZB1P) with one stage per device. A device holds
at most K micro-batches' activations (stage 0's, as in 1F1B); with F, B and W of
equal cost the bubble is a third of 1F1B's.
"""
from __future__ import annotations

from cdpjax.kinds import BACKWARD, FORWARD, WEIGHT
from cdpjax.layouts import Layout, Reference, register
from cdpjax.timetable import TimeTable, from_orders, positive


def zb_h1_order(stage: int, stages: int, microbatches: int) -> list[tuple[str, int, int]]:
    """Device `stage`'s actions: warm-up forwards, then F/B pairs with each W `stage` Bs late, then
    the cool-down Bs and the Ws still owed."""
    warmup = min(stages - 1 - stage, microbatches)
    order = [(FORWARD.name, stage, m) for m in range(warmup)]
    owed = iter(range(microbatches))  # the Ws, in micro-batch order
    for m in range(microbatches):
        if warmup + m < microbatches:
            order.append((FORWARD.name, stage, warmup + m))
        order.append((BACKWARD.name, stage, m))
        if m >= stage:
            order.append((WEIGHT.name, stage, next(owed)))
    return order + [(WEIGHT.name, stage, m) for m in owed]


def zb_h1_table(stages: int = 4, microbatches: int = 4, steps: int = 2) -> TimeTable:
    positive(stages=stages, microbatches=microbatches)
    orders = [zb_h1_order(j, stages, microbatches) for j in range(stages)]
    return from_orders("zb-h1", orders, stages, microbatches, steps)


register(Layout(
    "zb-h1", "cdpjax.methods.zb_h1:build", axes=("stage", "data"), device_axis="stage",
    table=zb_h1_table, microbatches=True, colour="micro", label="{kind}{micro}",
    legend="F<m>/B<m>/W<m>: forward / input backward / weight gradient of micro-batch m",
    title="{method}: {stages} stages, M={microbatches} micro-batches", reference=Reference("e2e"),
    summary="zero bubble ZB-H1: the backward split into B (input) and W (weights), Ws deferred into the bubble"))
