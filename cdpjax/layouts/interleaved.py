"""interleaved-1f1b: Megatron-LM's interleaved schedule (Narayanan et al., 2021).

L = V x D stages on D devices: device d holds the V non-adjacent stages d, D+d,
2D+d, ... (its model chunks), so a micro-batch passes every device V times. Each
device runs 1F1B over (chunk, micro-batch) pairs in Megatron's order: forwards go
through the micro-batches in groups of D, chunk by chunk; backwards the same with
the chunks reversed; warm-up (D-1-d)*2 + (V-1)*D forwards. The bubble shrinks
V-fold against GPipe's at the price of V times the point-to-point messages.
"""
from __future__ import annotations

from cdpjax.errors import ConfigError
from cdpjax.kinds import BACKWARD, FORWARD
from cdpjax.layouts import Layout, Reference, register
from cdpjax.timetable import TimeTable, from_orders, positive


def interleaved_order(device: int, devices: int, chunks: int, microbatches: int) -> list[tuple[str, int, int]]:
    """Device `device`'s actions (kind, stage, micro-batch) in Megatron's interleaved order."""
    D, V, M = devices, chunks, microbatches
    total = M * V

    def action(kind, k):
        group, within = divmod(k % (D * V), D)
        chunk = group if kind.forward else V - 1 - group
        return kind.name, chunk * D + device, (k // (D * V)) * D + within

    warmup = min((D - 1 - device) * 2 + (V - 1) * D, total)
    order = [action(FORWARD, k) for k in range(warmup)]
    for i in range(total - warmup):
        order += [action(FORWARD, warmup + i), action(BACKWARD, i)]
    return order + [action(BACKWARD, k) for k in range(total - warmup, total)]


def interleaved_table(stages: int = 8, chunks: int = 2, microbatches: int = 4, steps: int = 2) -> TimeTable:
    """`stages` = V x D stages on D = stages / chunks devices, stage s on device s mod D."""
    positive(stages=stages, chunks=chunks, microbatches=microbatches)
    if chunks < 2 or stages % chunks:
        raise ConfigError(f"interleaved-1f1b needs chunks >= 2 dividing stages: stages={stages}, chunks={chunks}")
    devices = stages // chunks
    if microbatches % devices:
        raise ConfigError(f"interleaved-1f1b runs micro-batches in groups of the {devices} devices: "
                          f"microbatches={microbatches} must be a multiple of {devices}")
    orders = [interleaved_order(d, devices, chunks, microbatches) for d in range(devices)]
    return from_orders("interleaved-1f1b", orders, stages, microbatches, steps,
                       device_of=[s % devices for s in range(stages)])


register(Layout(
    "interleaved-1f1b", "cdpjax.methods.interleaved:build", axes=("stage", "data"), device_axis="stage",
    table=interleaved_table, microbatches=True, colour="micro", label="{kind}{micro}",
    diagram_label="{kind}{micro}", legend="F<m>/B<m>: forward/backward of micro-batch m (rows: devices)",
    title="{method}: {stages} stages on {devices} devices, M={microbatches} micro-batches",
    summary="Megatron's interleaved 1F1B: each device holds V non-adjacent stages", reference=Reference("e2e")))
