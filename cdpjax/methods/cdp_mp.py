"""`cdp-mp`: cyclic data parallelism with model parallelism (the cyclic pipeline).

Timing (`cdpjax.timetable.cdp_mp_table`: the CDP table of N = L workers with every
op moved to the device of its stage). Stage j lives on device j of the `stage`
axis. Worker i's micro-batch of step k enters stage 0 at tick 2i + 2Lk, runs the
forwards of stages 0..L-1 on devices 0..L-1 at consecutive ticks, then the
backwards of stages L-1..0 back down. With N = L every stage is used by exactly
one worker at every tick, so in steady state every device runs exactly ONE op per
tick, a forward when tick - j is even and a backward when it is odd (one forward
and one backward per tick would take N = 2L): busy fraction 1.0, and no fill,
drain or flush between steps. At the end of every tick the forward output goes to
stage j+1 and the input cotangent to stage j-1: two `ppermute`s (shifts +1 and -1
on `stage`) after the switch, of one micro-batch's padded activation each.
With `cdp_ticks='paired'` (a worker's forwards of two stages in one tick) each tick
is cut in two, the pair's second forward a half-tick after the first (it needs the
first's output from the device before), and a device runs a forward beside another
worker's backward of the previous step in one half (an overlapped cell); with
'split' the ticks are F, B, W (3L a step).

Update rule: CDP's, with the staleness of `config.cdp_rule` ('cdp-v2', default, or
'cdp-v1'), one optax state per stage, two stored versions per stage (current,
previous). Each op reads the version the table's `slot` names (a backward reads
its forward's version). Stage j sums the gradients of the N micro-batches that
pass through it where it lives, and applies

    theta^j_{k+1} = opt^j(theta^j_k, sum_i g_i^j / N),  previous^j <- current^j

at the end of the tick the table gives (the last worker's backward of stage j).
No gradient crosses a device: there is no gradient communication at all, only
activations and cotangents move, one hop per tick. After S steps and a flush the
parameters equal `cdp_impl='simulate'` of the same rule with workers = L after S
steps. BatchNorm (norm='batch'): statistics per micro-batch; running averages as in
simulate, the mean over the step's micro-batches of each one's update from the same
starting value (every forward of step k on stage j starts from the averages of step
k; their mean update lands just before the stage's first forward of step k+1).

Residuals (`config.residuals`): 'recompute' stashes each micro-batch's stage input
at its forward and reruns the stage under `jax.vjp` at its backward; 'carry'
stashes the residuals of the forward's `jax.vjp` but the stage's own parameters
(raveled, zero-padded to the largest stage's; the backward takes the parameters
from the slot its forward read) and the backward only runs the pullback, rebuilt
on the structure of a template vjp traced in the same branch. Both give the same
parameters; `Method.padding` and `cdpjax bench` give their memory (measured: on
CPU, carry stores 4 to 14 times more per device and is faster for a ResNet, slower
for a ViT; recompute is the default).

SPMD realisation: the tick runtime (`cdpjax.methods.pipeline`) running one
steady-state period (2L ticks) of the table per `train_step`: it feeds the N
micro-batches of one global batch and finishes the previous step's, so the
in-flight state (kept inputs or residuals, labels, cotangents, gradient sums,
both versions) lives in the train state. `flush(state)` runs one period with
nothing fed (its ops of the unfed step are idle, updates masked), so that the
parameters account for every batch fed; training on after a flush restarts the
cycle from the flushed parameters. `Method.run_steps(state, batches)` scans over
S periods in one program (compile time does not grow with S). A call's metrics
are those of the micro-batches whose loss was computed in it.

With a `data` axis, each data group runs its own cyclic pipeline on its slice of
the batch, and at every tick where some stage updates every device all-reduces its
stage's gradient sum over `data` (zeros where its stage does not update): data
parallelism over pipelines, the only case with gradient traffic.
"""
from __future__ import annotations

import dataclasses

from cdpjax.errors import ConfigError
from cdpjax.layouts import stage_count
from cdpjax.layouts.cdp_mp import RULES, cdp_mp_table
from cdpjax.methods import pipeline
from cdpjax.methods.common import Context, Method


def build(ctx: Context) -> Method:
    cfg = ctx.config
    rule = cfg.get("cdp_rule", "cdp-v2")
    if rule not in RULES:
        raise ConfigError(f"cdp_rule={rule!r} is not one of {', '.join(RULES)}")
    L = N = stage_count(cfg)
    if int(cfg.get("workers", 0)) not in (0, N):
        raise ConfigError(f"cdp-mp runs N = L workers, one per stage device: workers={cfg.workers} must be "
                          f"0 or the {N} stages")
    ticks = cfg.get("cdp_ticks", "whole")
    table = cdp_mp_table(stages=L, steps=5, rule=rule, ticks=ticks)
    rules = pipeline.Rules(model_state="step_mean", residuals=cfg.get("residuals", "recompute"))
    method = pipeline.build(ctx, "cdp-mp", table, rules,
                            shown=cdp_mp_table(stages=L, steps=3, rule=rule, ticks=ticks))
    groups = ctx.axis("data")
    return dataclasses.replace(method, stale=table.stale, workers=N, state_depends_on_mesh=True,
                               dp_mp_devices=N * L * groups, report={**method.report, "rule": rule})
