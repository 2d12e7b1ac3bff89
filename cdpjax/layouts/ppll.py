"""ppll: local learning pipelined over devices, K local modules grouped on D devices."""
from __future__ import annotations

from typing import Sequence

from cdpjax.errors import ConfigError
from cdpjax.kinds import LOCAL
from cdpjax.layouts import Layout, Reference, register
from cdpjax.timetable import Op, TimeTable, Update, positive


def module_devices(stages: int, module_groups: Sequence[int] | None = None) -> tuple[int, ...]:
    """The device of each of the K local modules: contiguous groups of `module_groups[d]`
    modules on device d (default: one module per device)."""
    positive(stages=stages)
    groups = [1] * int(stages) if module_groups is None else [int(g) for g in module_groups]
    if any(g < 1 for g in groups) or sum(groups) != stages:
        raise ConfigError(f"module_groups={list(groups)} must be positive and add up to the {stages} local "
                          f"modules (stages)")
    return tuple(d for d, g in enumerate(groups) for _ in range(g))


def ppll_table(stages: int = 4, steps: int | None = None, module_groups: Sequence[int] | None = None) -> TimeTable:
    """PPLL: K = `stages` local modules on D devices (`module_groups`, default one each).
    At tick t device d runs batch t-d through its modules one after another: each
    module's forward, its local backward through its auxiliary head and its own
    update. Fill and drain only at the ends of the run. `steps` batches (default 2D,
    enough for a steady state)."""
    device_of = module_devices(stages, module_groups)
    K, D = int(stages), max(device_of) + 1
    T = 2 * D if steps is None else steps
    positive(steps=T)
    ops, updates = [], []
    for t in range(T + D - 1):
        for j in range(K):
            b = t - device_of[j]
            if 0 <= b < T:
                ops.append(Op(t, device_of[j], j, LOCAL.name, b, 0, version=b))
                updates.append(Update(t, j, b))
    steady = (D - 1, T) if T >= D else (0, T + D - 1)
    meta = {"module_groups": [device_of.count(d) for d in range(D)]} if D != K else {}
    return TimeTable("ppll", 1, K, T, T + D - 1, D, 1, tuple(ops), tuple(updates), (), (), 1, steady, meta=meta)


register(Layout(
    "ppll", "cdpjax.methods.ppll:build", axes=("stage", "data"), device_axis="stage", table=ppll_table,
    colour="step", label="FB{step}",
    legend="FB<b>: forward, local backward and update of batch b (modules of one device joined by +)",
    title="{method}: {stages} local modules on {devices} devices, {steps} batches",
    summary="local learning pipelined over devices (K local modules on D devices)", reference=Reference("local")))
