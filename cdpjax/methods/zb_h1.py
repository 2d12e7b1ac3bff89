"""`zb-h1`: the zero-bubble schedule ZB-H1 on the `stage` axis.

Timing (`cdpjax.layouts.zb_h1`): stage j on device j runs 1F1B's forwards and input
backwards (B, the cotangent handed to stage j-1 at once) and each micro-batch's
weight gradient (W, from the kept residuals and cotangent) j backwards later; the Ws
fill the bubble 1F1B leaves at the end of the later stages. Every stage updates at
the flush, after its last W.

Update rule: backprop's, as `gpipe` (equal to `e2e`).
"""
from __future__ import annotations

from cdpjax.layouts import stage_devices
from cdpjax.layouts.zb_h1 import zb_h1_table
from cdpjax.methods import pipeline
from cdpjax.methods.common import Context, Method


def build(ctx: Context) -> Method:
    cfg = ctx.config
    table = zb_h1_table(stages=stage_devices(cfg), microbatches=int(cfg.microbatches), steps=3)
    return pipeline.build(ctx, "zb-h1", table, pipeline.Rules(residuals=cfg.get("residuals", "recompute")))
