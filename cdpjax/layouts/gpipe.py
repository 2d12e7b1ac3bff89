"""gpipe: the backprop pipeline baseline (micro-batches, forward fill, backward drain, flush).

M = 1 is plain model parallelism, the "conventional pipeline" of PPLL's code: a
layout of its own name would only repeat this table, so the tables and benches say
"gpipe (M=1, plain model parallelism)" where they mean it.
"""
from __future__ import annotations

from cdpjax.kinds import BACKWARD, FORWARD
from cdpjax.layouts import Layout, Reference, register
from cdpjax.timetable import TimeTable, from_orders, positive


def gpipe_table(stages: int = 4, microbatches: int = 4, steps: int = 2) -> TimeTable:
    """GPipe: every device runs the forwards of its stage for the M micro-batches, then their
    backwards. Run as early as their inputs allow, the forwards fill the pipeline (stage j,
    micro-batch m at tick j + m), the backwards drain it (the last stage starts as soon as
    its forwards are done), then every stage updates (flush): 2(M + K - 1) ticks a step, of
    which 2(K - 1) idle on each device. Stage j on device j; M=1 is plain model parallelism."""
    positive(stages=stages, microbatches=microbatches)
    K, M = int(stages), int(microbatches)
    orders = [[(FORWARD.name, j, m) for m in range(M)] + [(BACKWARD.name, j, m) for m in range(M)] for j in range(K)]
    return from_orders("gpipe", orders, K, M, steps)


register(Layout(
    "gpipe", "cdpjax.methods.gpipe:build", axes=("stage", "data"), device_axis="stage", table=gpipe_table,
    microbatches=True, colour="micro", label="{kind}{micro}", legend="F<m>/B<m>: forward/backward of micro-batch m",
    title="{method}: {stages} stages, M={microbatches} micro-batches",
    summary="backprop pipeline baseline (M micro-batches; M=1 is plain model parallelism)", reference=Reference("e2e")))
