"""`zbv`: the zero-bubble V schedule ZB-V on the `stage` axis.

Timing (`cdpjax.layouts.zbv`): L = 2D stages on D devices, device r holding stages r
and 2D-1-r (the V placement); each backward is split into B (input cotangent, sent
at once) and W (weight gradient, run later from the kept residuals), in
`torch.distributed.pipelining`'s ZBV order. Every stage updates at the flush.

Update rule: backprop's, as `gpipe` (equal to `e2e`).
"""
from __future__ import annotations

from cdpjax.layouts import stage_count
from cdpjax.layouts.zbv import zbv_table
from cdpjax.methods import pipeline
from cdpjax.methods.common import Context, Method


def build(ctx: Context) -> Method:
    cfg = ctx.config
    table = zbv_table(stages=stage_count(cfg), microbatches=int(cfg.microbatches), steps=3)
    return pipeline.build(ctx, "zbv", table, pipeline.Rules(residuals=cfg.get("residuals", "recompute")))
