"""`1f1b`: PipeDream-flush (one forward, one backward) on the `stage` axis.

Timing (`cdpjax.layouts.one_f_one_b`): stage j on device j runs K-1-j warm-up
forwards, then alternates one forward and one backward, then cools down with
the remaining backwards; every stage updates at the flush. The bubble is
GPipe's; a device keeps at most K-j micro-batches' inputs instead of M (the
program's slots), which is the point of the schedule.

Update rule: backprop's, as `gpipe` (equal to `e2e`).
"""
from __future__ import annotations

from cdpjax.layouts import stage_devices
from cdpjax.layouts.one_f_one_b import one_f_one_b_table
from cdpjax.methods import pipeline
from cdpjax.methods.common import Context, Method


def build(ctx: Context) -> Method:
    cfg = ctx.config
    table = one_f_one_b_table(stages=stage_devices(cfg), microbatches=int(cfg.microbatches), steps=3)
    return pipeline.build(ctx, "1f1b", table, pipeline.Rules(residuals=cfg.get("residuals", "recompute")))
