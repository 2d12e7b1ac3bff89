"""`gpipe`: the backprop pipeline baseline (GPipe) on the `stage` axis.

Timing (`cdpjax.layouts.gpipe.gpipe_table`): K stages, one per device; the global
batch is cut into M = `microbatches` micro-batches. Forward fill: stage j runs
the forward of micro-batch m at tick j + m and keeps its input; backward drain:
the backwards run back down as soon as their cotangents arrive, recomputing each
stage's forward from its kept input (or, with `residuals='carry'`, running the
pullback of the kept `jax.vjp` residuals). Then every stage updates (the
flush): every step pays 2(K-1) idle ticks per device out of 2(M+K-1), the bubble
that PPLL and CDP avoid. M=1 is plain model parallelism without micro-batches,
the "conventional pipeline" of PPLL's code.

Update rule: exactly backprop's. The gradient is the sum over micro-batches of
the gradients of (micro-batch mean loss) / M, i.e. the gradient of the mean loss
over the batch; one update per step with one optax state per stage, the same as
`e2e` (BatchNorm statistics are per micro-batch, as in GPipe; running averages
updated micro-batch by micro-batch). With a `data` axis each data group runs its
own pipeline on its slice of the batch and gradients are averaged over `data`.

SPMD realisation: the tick runtime (`cdpjax.methods.pipeline`) running the table.
"""
from __future__ import annotations

import dataclasses

from cdpjax.layouts import stage_devices
from cdpjax.layouts.gpipe import gpipe_table
from cdpjax.methods import pipeline
from cdpjax.methods.common import Context, Method


def build(ctx: Context) -> Method:
    cfg = ctx.config
    table = gpipe_table(stages=stage_devices(cfg), microbatches=int(cfg.microbatches), steps=3)
    rules = pipeline.Rules(residuals=cfg.get("residuals", "recompute"))
    method = pipeline.build(ctx, "gpipe", table, rules)
    report = {**method.report, "bubble": (table.stages - 1) / (table.microbatches + table.stages - 1),
              "ticks": table.period}
    return dataclasses.replace(method, report=report)
