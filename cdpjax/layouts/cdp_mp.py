"""cdp-mp: cyclic data parallelism with model parallelism (the cyclic pipeline)."""
from __future__ import annotations

import dataclasses

import numpy as np

from cdpjax import kinds
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
    the device runs F, B and W in turn. With paired forwards (T = ceil(L/2) + L) a worker's
    forwards of stages 2a and 2a+1 share a tick on two devices: each tick is cut in two
    (`_paired_in_two_ticks`), and a device may run a forward beside another worker's backward
    of the previous step in one tick (an overlapped cell). Updates, versions and slots are the CDP table's;
    no gradient crosses devices (each stage's gradient is summed where the stage lives),
    so there are no messages."""
    if rule not in RULES:
        raise ConfigError(f"cdp-mp rule={rule!r} is not one of {', '.join(RULES)}")
    base = cdp_table(rule, stages, stages, steps, ticks)
    if ticks == "paired":
        base = _paired_in_two_ticks(base)
    ops = tuple(sorted((dataclasses.replace(op, device=op.stage) for op in base.ops),
                       key=lambda o: (o.tick, o.device)))
    per_cell = np.zeros((base.num_ticks, base.stages), np.int64)
    for op in ops:
        per_cell[op.tick, op.device] += 1
    lo, hi = base.steady
    if ticks == "paired":  # a forward beside another worker's backward: at most two ops a cell
        if per_cell.max() > 2:
            raise AssertionError(f"cdp-mp L={stages}: a device runs more than two ops in one tick")
    elif per_cell.max() > 1 or (steps >= 2 and not np.all(per_cell[lo:hi] == 1)):
        raise AssertionError(f"cdp-mp L={stages}: a device does not run exactly one op per steady-state tick")
    return dataclasses.replace(base, method="cdp-mp", ops=ops, messages=(), applies=(), devices=base.stages)


def _paired_in_two_ticks(base: TimeTable) -> TimeTable:
    """A paired CDP table (a worker's forwards of stages 2a and 2a+1 in one tick) with each tick
    cut in two: the first holds the tick's backwards and each pair's first forward, the second
    each pair's second forward, whose input is the first's output on another device (the
    stage-axis engine sends a message at the end of a tick). An update lands at the end of its
    tick's second half, so every read is of the version it was in the paired table. What
    remains overlapped is a device's forward of one worker beside its backward of another."""
    def half(tick, second):
        return 2 * tick + second

    ops = tuple(dataclasses.replace(op, tick=half(op.tick, kinds.lookup(op.kind).forward and op.stage % 2 == 1))
                for op in base.ops)
    updates = tuple(dataclasses.replace(u, tick=half(u.tick, 1)) for u in base.updates)
    return dataclasses.replace(base, ops=ops, updates=updates, num_ticks=2 * base.num_ticks, period=2 * base.period,
                               offsets=tuple(2 * o for o in base.offsets),
                               steady=tuple(2 * t for t in base.steady))


register(Layout(
    "cdp-mp", "cdpjax.methods.cdp_mp:build", axes=("stage", "data"), device_axis="stage", table=cdp_mp_table,
    colour="worker", label="{kind}w{micro}",
    legend="Fw<i>/Bw<i>: forward/backward of worker i's micro-batch",
    title="{method}: {workers} workers' micro-batches through {stages} stage devices",
    summary="cyclic pipeline: stages on devices, every device busy every tick, no gradient communication",
    reference=Reference("{cdp_rule}", (("cdp_impl", "simulate"),))))
