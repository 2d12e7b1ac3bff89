"""`looped-bfs`: breadth-first pipeline parallelism (LoopedBFS) on the `stage` axis.

Timing (`cdpjax.layouts.looped_bfs`): L = V x D stages on D devices, device d holding
stages d, D+d, ... (V = `config.chunks`); each device runs all micro-batches'
forwards through one of its stages before the next, then the backwards from its last
stage down, each stage's micro-batches last-in first-out. Every stage updates at the
flush.

Update rule: backprop's, as `gpipe` (equal to `e2e`).
"""
from __future__ import annotations

from cdpjax.layouts import stage_count
from cdpjax.layouts.looped_bfs import looped_bfs_table
from cdpjax.methods import pipeline
from cdpjax.methods.common import Context, Method


def build(ctx: Context) -> Method:
    cfg = ctx.config
    table = looped_bfs_table(stages=stage_count(cfg), chunks=int(cfg.chunks), microbatches=int(cfg.microbatches),
                             steps=3)
    return pipeline.build(ctx, "looped-bfs", table, pipeline.Rules(residuals=cfg.get("residuals", "recompute")))
