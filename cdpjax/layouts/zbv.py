"""zbv: the zero-bubble V schedule ZB-V (Qi et al. 2023, section 6), two stages per device.

L = 2D stages on D devices in the V placement: device r holds stage r (chunk 0, on
the way down) and stage 2D-1-r (chunk 1, on the way back), so the last stage lives
on device 0 beside the first and the loss's cotangent starts back where the
input came in. Backwards are split into B (input cotangent) and W (weight
gradient). Device r's order, as `torch.distributed.pipelining`'s
`ScheduleZBVZeroBubble` lays it out over n = max(2D-1, M) micro-batches:

- warm-up: 2(D-r)-1 forwards of chunk 0; r times a forward of chunk 1 then one of
  chunk 0; D-r times F, B, W of chunk 1;
- steady state, until chunk 1 has run n forwards: a forward of chunk 0 (while it has
  some left), B and W of chunk 0, then F, B and W of chunk 1;
- cool-down: r times B of chunk 0 then B of chunk 1; D-r times B and W of chunk 0;
  then the Ws chunk 1 still owes, then chunk 0's.

Each kind of each chunk runs its micro-batches in order; ops of micro-batches M..n-1
(where M < 2D-1) are left out. With F, B and W of equal cost and M >= 2D-1 the
bubble nearly vanishes, at the activation memory of 1F1B's first device.
"""
from __future__ import annotations

import collections

from cdpjax.errors import ConfigError
from cdpjax.kinds import BACKWARD, FORWARD, WEIGHT
from cdpjax.layouts import Layout, Reference, register
from cdpjax.timetable import TimeTable, from_orders, positive


def v_placement(stages: int) -> list[int]:
    """Stage s's device: s on the way down, 2D-1-s on the way back (D = stages / 2)."""
    return [s if s < stages // 2 else stages - 1 - s for s in range(stages)]


def zbv_order(device: int, devices: int, microbatches: int) -> list[tuple[str, int, int]]:
    """Device `device`'s actions (kind, stage, micro-batch) in ZB-V's order (module docstring)."""
    D, r = devices, device
    n = max(2 * D - 1, microbatches)
    down, up = r, 2 * D - 1 - r
    runs = collections.Counter()  # (kind, stage) -> micro-batches run so far
    order = []

    def run(*actions):
        for kind, stage in actions:
            order.append((kind, stage, runs[kind, stage]))
            runs[kind, stage] += 1

    F, B, W = FORWARD.name, BACKWARD.name, WEIGHT.name
    run(*[(F, down)] * (2 * (D - r) - 1))
    run(*[(F, up), (F, down)] * r)
    run(*[(F, up), (B, up), (W, up)] * (D - r))
    while runs[F, up] < n:
        run(*[(F, down)] * (runs[F, down] < n), (B, down), (W, down), (F, up), (B, up), (W, up))
    run(*[(B, down), (B, up)] * r)
    run(*[(B, down), (W, down)] * (D - r))
    run(*[(W, up)] * (n - runs[W, up]), *[(W, down)] * (n - runs[W, down]))
    return [a for a in order if a[2] < microbatches]


def zbv_table(stages: int = 4, microbatches: int = 4, steps: int = 2) -> TimeTable:
    """`stages` = 2D stages on D devices in the V placement."""
    positive(stages=stages, microbatches=microbatches)
    if stages % 2:
        raise ConfigError(f"zbv places two stages on each device: stages={stages} must be even")
    devices = stages // 2
    orders = [zbv_order(d, devices, microbatches) for d in range(devices)]
    return from_orders("zbv", orders, stages, microbatches, steps, device_of=v_placement(stages))


register(Layout(
    "zbv", "cdpjax.methods.zbv:build", axes=("stage", "data"), device_axis="stage",
    table=zbv_table, microbatches=True, colour="micro", label="{kind}{micro}s{stage}", diagram_label="{kind}{micro}",
    legend="F<m>s<j>/B<m>s<j>/W<m>s<j>: forward / input backward / weight gradient of micro-batch m through "
           "stage j (rows: devices, each holding stages r and 2D-1-r)",
    title="{method}: {stages} stages on {devices} devices (V placement), M={microbatches} micro-batches",
    summary="zero bubble ZB-V: two stages per device in a V, backward split into B and W", reference=Reference("e2e")))
