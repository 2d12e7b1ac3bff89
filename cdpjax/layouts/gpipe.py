"""gpipe: the backprop pipeline baseline (micro-batches, forward fill, backward drain, flush).

M = 1 is plain model parallelism, the "conventional pipeline" of PPLL's code: a
layout of its own name would only repeat this table, so the tables and benches say
"gpipe (M=1, plain model parallelism)" where they mean it.
"""
from __future__ import annotations

from cdpjax.layouts import Layout, register
from cdpjax.timetable import Op, TimeTable, Update, positive


def gpipe_table(stages: int = 4, microbatches: int = 4, steps: int = 2) -> TimeTable:
    """GPipe: every step, forwards of M micro-batches fill the pipeline, backwards drain
    it (the last stage starts as soon as all forwards are done), then every stage
    updates (flush). Stage j on device j; M=1 is plain model parallelism."""
    positive(stages=stages, microbatches=microbatches, steps=steps)
    K, M, S = int(stages), int(microbatches), int(steps)
    span = 2 * (M + K - 1)
    ops, updates = [], []
    for k in range(S):
        base = span * k
        for j in range(K):
            for m in range(M):
                ops.append(Op(base + j + m, j, j, "F", k, m, version=k))
                ops.append(Op(base + (M + K - 1) + (K - 1 - j) + m, j, j, "B", k, m, version=k))
            updates.append(Update(base + span - 1, j, k))
    ops.sort(key=lambda o: (o.tick, o.device))
    return TimeTable("gpipe", 1, K, S, span * S, K, span, tuple(ops), tuple(updates), (), (), M, (0, span))


register(Layout(
    "gpipe", "cdpjax.methods.gpipe:build", axes=("stage", "data"), device_axis="stage", table=gpipe_table,
    microbatches=True, colour="micro", label="{kind}{micro}", legend="F<m>/B<m>: forward/backward of micro-batch m",
    title="{method}: {stages} stages, M={microbatches} micro-batches",
    summary="backprop pipeline baseline (M micro-batches; M=1 is plain model parallelism)"))
