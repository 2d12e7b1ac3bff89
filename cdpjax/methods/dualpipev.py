"""`dualpipev`: DualPipeV on the `stage` axis.

Timing (`cdpjax.layouts.dualpipev`): L = 2D stages on D devices in the V placement,
in `torch.distributed.pipelining`'s DualPipeV order; a tick may hold an overlapped
cell (a forward of one micro-batch beside the whole backward of another, or a whole
backward as its B and W), which the engine runs as one piece, lane after lane. Every
stage updates at the flush.

Update rule: backprop's, as `gpipe` (equal to `e2e`).
"""
from __future__ import annotations

from cdpjax.layouts import stage_count
from cdpjax.layouts.dualpipev import dualpipev_table
from cdpjax.methods import pipeline
from cdpjax.methods.common import Context, Method


def build(ctx: Context) -> Method:
    cfg = ctx.config
    table = dualpipev_table(stages=stage_count(cfg), microbatches=int(cfg.microbatches), steps=3)
    return pipeline.build(ctx, "dualpipev", table, pipeline.Rules(residuals=cfg.get("residuals", "recompute")))
