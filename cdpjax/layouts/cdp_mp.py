"""cdp-mp: cyclic data parallelism with model parallelism (the cyclic pipeline)."""
from __future__ import annotations

import dataclasses

import numpy as np

from cdpjax.errors import ConfigError
from cdpjax.layouts import Layout, Reference, register
from cdpjax.layouts.cdp import cdp_table
from cdpjax.timetable import TimeTable

RULES = ("cdp-v2", "cdp-v1")


def cdp_mp_table(stages: int = 4, steps: int = 3, rule: str = "cdp-v2", ticks: str = "whole") -> TimeTable:
    """cdp-mp: CDP with model parallelism. The `rule` table of N = L workers and L stages,
    with each op moved from its worker to the device of its stage (device j = stage j);
    `micro` keeps the worker. With N = L every stage is used by exactly one worker at
    every tick, so every device runs exactly one op per tick in steady state: checked
    here. With whole backwards (2L ticks) device j runs a forward when tick - j is even
    and a backward when odd; with split ones (3L ticks, offsets 3i) the three ops of
    stage j fall at phases j, 3L-2-2j and 3L-1-2j, which are j, j+1 and j+2 modulo 3, so
    the device runs F, B and W in turn. Updates, versions and slots are the CDP table's;
    no gradient crosses devices (each stage's gradient is summed where the stage lives),
    so there are no messages."""
    if rule not in RULES:
        raise ConfigError(f"cdp-mp rule={rule!r} is not one of {', '.join(RULES)}")
    base = cdp_table(rule, stages, stages, steps, ticks)
    ops = tuple(sorted((dataclasses.replace(op, device=op.stage) for op in base.ops),
                       key=lambda o: (o.tick, o.device)))
    per_cell = np.zeros((base.num_ticks, base.stages), np.int64)
    for op in ops:
        per_cell[op.tick, op.device] += 1
    lo, hi = base.steady
    if per_cell.max() > 1 or (steps >= 2 and not np.all(per_cell[lo:hi] == 1)):
        raise AssertionError(f"cdp-mp L={stages}: a device does not run exactly one op per steady-state tick")
    return dataclasses.replace(base, method="cdp-mp", ops=ops, messages=(), devices=base.stages)


register(Layout(
    "cdp-mp", "cdpjax.methods.cdp_mp:build", axes=("stage", "data"), device_axis="stage", table=cdp_mp_table,
    colour="worker", label="{kind}w{micro}",
    legend="Fw<i>/Bw<i>: forward/backward of worker i's micro-batch",
    title="{method}: {workers} workers' micro-batches through {stages} stage devices",
    summary="cyclic pipeline: stages on devices, every device busy every tick, no gradient communication",
    reference=Reference("{cdp_rule}", (("cdp_impl", "simulate"),))))
