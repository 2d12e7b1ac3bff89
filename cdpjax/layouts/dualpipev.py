"""dualpipev: DualPipeV (DeepSeek-V3's DualPipe, cut in half into a V), two stages per device.

L = 2D stages on D devices in ZB-V's V placement (device r holds stage r on the way
down and stage 2D-1-r on the way back). Its defining move is the *overlapped cell*:
in one tick a device runs the forward of one micro-batch through one of its stages
beside the whole backward of another micro-batch through its other stage, so that one
op's communication can hide behind the other's compute. A whole backward is written as
its B (input cotangent) and W (weight gradient) in one tick; a backward split in two
ticks (B now, W later, zero-bubble style) fills the bubbles of the warm-up and the
cool-down. Device r's order, as `torch.distributed.pipelining`'s `ScheduleDualPipeV`
lays it out (M >= 2D micro-batches; "down" its stage r, "up" its stage 2D-1-r; each
kind of each stage runs its micro-batches in order; a split B queues its W, and "W"
runs the oldest queued one):

1. 2(D-r-1) forwards of down;
2. r+1 times: a forward of down, then one of up;
3. D-r-1 times: B of up (split), W, a forward of up;
4. M-2D+r+1 times: a forward of down with the whole backward of up (on the last
   device, the first time, as two ticks), then a forward of up with the whole
   backward of down;
5. D-r-1 times: the whole backward of up, then a forward of up with the whole
   backward of down;
6. r+1 times: a backward of up, then one of down; whole at first, split from the
   middle pass on ((r+1) // 2: from its first op on an odd device, from its second on
   an even one);
7. D-r-1 times: W, then B of down (split);
8. r+1 times: W.

With F, B and W of equal cost an overlapped cell takes one tick here, as every op
does: the table shows the order and the pairs, and the speedup models time them.
Update rule: backprop's, flushed once per step (equal to `e2e`).
"""
from __future__ import annotations

import collections

from cdpjax import kinds
from cdpjax.errors import ConfigError
from cdpjax.layouts import Layout, Reference, register
from cdpjax.layouts.zbv import v_placement
from cdpjax.timetable import TimeTable, from_orders, positive

# The kinds an order is written in (`cdpjax.kinds`): a forward, the input-cotangent half of a
# backward, its weight-gradient half; a whole backward is the two halves in one tick.
FORWARD, INPUT_BACKWARD, WEIGHT_BACKWARD = kinds.FORWARD.name, kinds.BACKWARD.name, kinds.WEIGHT.name


def dualpipev_order(device: int, devices: int, microbatches: int) -> list[tuple]:
    """Device `device`'s entries in DualPipeV's order (module docstring): an action (kind,
    stage, micro-batch), or the tuple of actions one tick runs together."""
    D, r, M = devices, device, microbatches
    down, up = r, 2 * D - 1 - r
    runs = collections.Counter()  # (kind, stage) -> micro-batches run so far
    pending = collections.deque()  # (stage, micro-batch) of split backwards whose W is still owed
    order: list[tuple] = []

    def forward(stage):
        runs[FORWARD, stage] += 1
        return (FORWARD, stage, runs[FORWARD, stage] - 1)

    def whole_backward(stage):
        m = runs[INPUT_BACKWARD, stage]
        runs[INPUT_BACKWARD, stage] += 1
        return ((INPUT_BACKWARD, stage, m), (WEIGHT_BACKWARD, stage, m))

    def split_backward(stage):
        m = runs[INPUT_BACKWARD, stage]
        runs[INPUT_BACKWARD, stage] += 1
        pending.append((stage, m))
        return (INPUT_BACKWARD, stage, m)

    def weight():
        if pending:
            order.append((WEIGHT_BACKWARD, *pending.popleft()))

    def backward(stage, split):
        order.append(split_backward(stage) if split else whole_backward(stage))

    order += [forward(down) for _ in range(2 * (D - r - 1))]
    for _ in range(r + 1):
        order += [forward(down), forward(up)]
    for _ in range(D - r - 1):
        order.append(split_backward(up))
        weight()
        order.append(forward(up))
    for i in range(M - 2 * D + r + 1):
        if i == 0 and r == D - 1:  # not overlapped: it would wait for its own forward's turn
            order += [forward(down), whole_backward(up)]
        else:
            order.append((forward(down), *whole_backward(up)))
        order.append((forward(up), *whole_backward(down)))
    for _ in range(D - r - 1):
        order.append(whole_backward(up))
        order.append((forward(up), *whole_backward(down)))
    split = False
    for i in range(r + 1):
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        backward(up, split)
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        backward(down, split)
    for _ in range(D - r - 1):
        weight()
        backward(down, split)
    for _ in range(r + 1):
        weight()
    return order


def dualpipev_table(stages: int = 4, microbatches: int = 4, steps: int = 2) -> TimeTable:
    """`stages` = 2D stages on D devices in the V placement, M >= 2D micro-batches."""
    positive(stages=stages, microbatches=microbatches)
    if stages % 2:
        raise ConfigError(f"dualpipev places two stages on each device: stages={stages} must be even")
    if microbatches < stages:
        raise ConfigError(f"dualpipev needs at least as many micro-batches as stages: microbatches={microbatches} "
                          f"with stages={stages} (give microbatches >= {stages})")
    devices = stages // 2
    orders = [dualpipev_order(d, devices, microbatches) for d in range(devices)]
    return from_orders("dualpipev", orders, stages, microbatches, steps, device_of=v_placement(stages))


register(Layout(
    "dualpipev", "cdpjax.methods.dualpipev:build", axes=("stage", "data"), device_axis="stage",
    table=dualpipev_table, microbatches=True, colour="micro", label="{kind}{micro}s{stage}",
    diagram_label="{kind}{micro}",
    legend="F<m>s<j>/B<m>s<j>/W<m>s<j>: forward / input backward / weight gradient of micro-batch m through "
           "stage j; '+' joins the ops of one overlapped tick (B and W of one micro-batch: its whole backward)",
    title="{method}: {stages} stages on {devices} devices (V placement), M={microbatches} micro-batches",
    summary="DualPipeV: two stages per device in a V, a forward overlapped with another micro-batch's backward",
    reference=Reference("e2e")))
