"""`interleaved-1f1b`: Megatron's interleaved schedule on the `stage` axis.

Timing (`cdpjax.layouts.interleaved`): L = V x D stages on D devices, device d
holding stages d, D+d, ... (V = `config.chunks`), run in Megatron's interleaved
1F1B order; every stage updates at the flush. The bubble is GPipe's divided by V;
every micro-batch crosses D-1 device boundaries V times (the last device hands
stage D-1's output to device 0 for stage D).

Update rule: backprop's, as `gpipe` (equal to `e2e`).
"""
from __future__ import annotations

from cdpjax.layouts import stage_count
from cdpjax.layouts.interleaved import interleaved_table
from cdpjax.methods import pipeline
from cdpjax.methods.common import Context, Method


def build(ctx: Context) -> Method:
    cfg = ctx.config
    table = interleaved_table(stages=stage_count(cfg), chunks=int(cfg.chunks), microbatches=int(cfg.microbatches),
                              steps=3)
    return pipeline.build(ctx, "interleaved-1f1b", table,
                          pipeline.Rules(residuals=cfg.get("residuals", "recompute")))
