"""A stage-axis layout's time table as the program its devices run (pure numpy).

The tick runtime (`cdpjax.methods.pipeline`) runs every stage-axis layout (gpipe,
1f1b, interleaved-1f1b, cdp-mp, ppll) from its table; this module reads the table
once, at build time, into small integer arrays indexed [tick, device] that a
`lax.scan` over the ticks of one *period* reads with `lax.axis_index('stage')`.

- **Units.** A device runs units: a unit is one stage (backprop layouts) or the
  group of local modules a device runs one after another within a tick (ppll's
  'FB' ops of one device and tick). A device holds `chunks` units (interleaved
  layouts: V non-adjacent stages), stored as the rows of its carrier.
- **Period.** One call runs the ticks of one training step: the whole step for a
  flushed layout (gpipe, 1f1b), one steady-state period for a layout whose ops of
  a step spill into the next call (cdp-mp: a period of 2L ticks; ppll: one tick).
  `rel` is the op's step relative to the batch fed by this call (0, -1, ...);
  `lag` the most negative; a layout with lag 0 keeps nothing in flight between
  calls.
- **Slots.** A device keeps each micro-batch's input from its arrival (the end of
  the tick in which the previous unit's device ran its forward) until its last
  use (the backward, which recomputes from it; or the forward, when residuals are
  carried instead), and each incoming cotangent until its backward. Slot indices
  are assigned from these lifetimes: by interval colouring for a layout with lag 0
  (the fewest buffers the schedule allows: 1F1B needs at most K-j where GPipe needs
  M, which is 1F1B's point), and by (unit, micro-batch) for a periodic layout, so
  that the assignment repeats every period.
- **Updates.** `update[t, d, v]`: unit v of device d applies its update at the end
  of tick t (for the step `update_rel`).
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict

import numpy as np

from cdpjax.errors import ConfigError
from cdpjax.timetable import TimeTable

IDLE, FORWARD, BACKWARD, LOCAL = 0, 1, 2, 3
_KIND = {"F": FORWARD, "B": BACKWARD, "FB": LOCAL}


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the stages live: `units[u]` the stages of unit u (consecutive), `device[u]` its
    device, `chunk[u]` its index among its device's units; `chunks`: units per device."""

    units: tuple[tuple[int, ...], ...]
    device: tuple[int, ...]
    chunk: tuple[int, ...]
    devices: int
    chunks: int

    @property
    def unit_of(self) -> dict[int, int]:
        return {j: u for u, stages in enumerate(self.units) for j in stages}

    def of_device(self, d: int) -> list[int]:
        return [u for u in range(len(self.units)) if self.device[u] == d]


def placement(table: TimeTable) -> Placement:
    """Units from the table: a stage per unit, except that the stages a device runs as 'FB'
    ops in the same tick (ppll's module groups) form one unit."""
    device_of: dict[int, int] = {}
    together: dict[tuple[int, int], list[int]] = defaultdict(list)
    for op in table.ops:
        if device_of.setdefault(op.stage, op.device) != op.device:
            raise ConfigError(f"{table.method}: stage {op.stage} runs on devices {device_of[op.stage]} and "
                              f"{op.device}; the runtime keeps each stage on one device")
        if op.kind == "FB":
            together[(op.tick, op.device)].append(op.stage)
    units: list[tuple[int, ...]] = []
    seen: set[int] = set()
    for j in range(table.stages):
        if j in seen:
            continue
        group = next((sorted(g) for g in together.values() if j in g), [j])
        if group != list(range(group[0], group[-1] + 1)):
            raise ConfigError(f"{table.method}: the modules {group} one device runs in one tick are not consecutive")
        units.append(tuple(group))
        seen.update(group)
    device = tuple(device_of[g[0]] for g in units)
    chunk = tuple(sum(1 for v in range(u) if device[v] == device[u]) for u in range(len(units)))
    return Placement(tuple(units), device, chunk, max(device) + 1, max(chunk) + 1)


@dataclasses.dataclass(frozen=True)
class Program:
    """One period of a table as arrays; see the module docstring. [P, D] unless noted.

    kind: IDLE / FORWARD / BACKWARD / LOCAL. unit: the unit the op runs. micro: its
    micro-batch. rel: its step relative to this call's batch. version: 0 current, 1 previous.
    act_slot: where its input is kept (-1 none). residual_slot: where a forward keeps, and
    its backward reads, carried residuals (-1 none). cot_slot: where a backward finds its
    output's cotangent (-1: the last stage, seeded by the loss). recv_act / recv_cot: the
    slot a message arriving at the end of the tick goes to (-1 none). update [P, D, chunks],
    update_rel: see the module docstring. any_update [P]: some unit updates then (0 / 1).
    """

    placement: Placement
    period: int
    lag: int
    microbatches: int
    versions: int
    act_slots: int
    cot_slots: int
    residual_slots: int
    kind: np.ndarray
    unit: np.ndarray
    micro: np.ndarray
    rel: np.ndarray
    version: np.ndarray
    act_slot: np.ndarray
    residual_slot: np.ndarray
    cot_slot: np.ndarray
    recv_act: np.ndarray
    recv_cot: np.ndarray
    update: np.ndarray
    update_rel: np.ndarray
    any_update: np.ndarray
    forward_pairs: tuple[tuple[int, int], ...]
    backward_pairs: tuple[tuple[int, int], ...]

    def arrays(self) -> dict[str, np.ndarray]:
        """The per-tick arrays a `lax.scan` reads (leading axis: the ticks of the period)."""
        names = ("kind", "unit", "micro", "rel", "version", "act_slot", "residual_slot", "cot_slot", "recv_act",
                 "recv_cot", "update", "update_rel", "any_update")
        return {k: getattr(self, k) for k in names}


def compile_table(table: TimeTable, carry_residuals: bool = False) -> Program:
    """The program of one period of `table`, laid out over enough steps (see `period_window`)."""
    place = placement(table)
    unit_of = place.unit_of
    P, D = table.period, place.devices
    m, lag = period_window(table)
    lo, hi = m * P, (m + 1) * P
    ops = [o for o in table.ops if o.stage == place.units[unit_of[o.stage]][0]]  # one op per unit
    tick_of = {(o.kind, unit_of[o.stage], o.micro, o.step): o.tick for o in ops}
    # Lifetimes of each device's buffers, as (first tick, last tick, key): keys (unit, micro, step).
    act_life, res_life, cot_life = defaultdict(list), defaultdict(list), defaultdict(list)
    for o in ops:
        u = unit_of[o.stage]
        key = (u, o.micro, o.step)
        if o.kind in ("F", "FB"):
            arrival = o.tick if u == 0 else tick_of[(o.kind, u - 1, o.micro, o.step)] + 1
            last_use = o.tick
            if o.kind == "F" and not carry_residuals:
                last_use = tick_of[("B", u, o.micro, o.step)]
            if u > 0 or last_use > o.tick:  # the first unit reads the batch itself; kept only to recompute
                act_life[o.device].append((arrival, last_use, key))
            if o.kind == "F" and carry_residuals:
                res_life[o.device].append((o.tick, tick_of[("B", u, o.micro, o.step)], key))
        elif u + 1 < len(place.units):  # a backward, not the last unit's: its cotangent arrives
            cot_life[o.device].append((tick_of[("B", u + 1, o.micro, o.step)] + 1, o.tick, key))
    periodic = lag > 0
    act_slot_of, n_act = _slots(act_life, periodic, P)
    res_slot_of, n_res = _slots(res_life, periodic, P)
    cot_slot_of, n_cot = _slots(cot_life, periodic, P)

    shape = (P, D)
    arrays = {k: np.full(shape, -1 if k in ("act_slot", "residual_slot", "cot_slot", "recv_act", "recv_cot") else 0,
                         np.int32)
              for k in ("kind", "unit", "micro", "rel", "version", "act_slot", "residual_slot", "cot_slot",
                        "recv_act", "recv_cot")}
    for o in ops:
        if not lo <= o.tick < hi:
            continue
        t, d, u = o.tick - lo, o.device, unit_of[o.stage]
        if arrays["kind"][t, d] != IDLE:
            raise ConfigError(f"{table.method}: device {d} runs two units in tick {o.tick}")
        key = (u, o.micro, o.step)
        arrays["kind"][t, d] = _KIND[o.kind]
        arrays["unit"][t, d] = u
        arrays["micro"][t, d] = o.micro
        arrays["rel"][t, d] = o.step - m
        arrays["version"][t, d] = int(o.slot == "previous")
        arrays["act_slot"][t, d] = act_slot_of.get((d, key), -1)
        arrays["residual_slot"][t, d] = res_slot_of.get((d, key), -1)
        if o.kind == "B":
            arrays["cot_slot"][t, d] = cot_slot_of.get((d, key), -1)
        if o.kind in ("F", "FB") and u == 0 and o.step != m:
            raise ConfigError(f"{table.method}: a period must feed its own batch into the first stage "
                              f"(tick {o.tick} feeds step {o.step} in the period of step {m})")
        if o.kind in ("F", "FB") and u + 1 < len(place.units):  # its output goes to the next unit's device
            arrays["recv_act"][t, place.device[u + 1]] = act_slot_of[(place.device[u + 1], (u + 1, o.micro, o.step))]
        if o.kind == "B" and u > 0:
            arrays["recv_cot"][t, place.device[u - 1]] = cot_slot_of[(place.device[u - 1], (u - 1, o.micro, o.step))]
    _check_one_message(arrays, ops, place, lo, hi, table.method)
    update = np.zeros((P, D, place.chunks), bool)
    update_rel = np.zeros((P, D, place.chunks), np.int32)
    for up in table.updates:
        if lo <= up.tick < hi and up.stage == place.units[unit_of[up.stage]][0]:
            u = unit_of[up.stage]
            update[up.tick - lo, place.device[u], place.chunk[u]] = True
            update_rel[up.tick - lo, place.device[u], place.chunk[u]] = up.step - m
    forward_pairs = sorted({(place.device[u], place.device[u + 1]) for u in range(len(place.units) - 1)})
    has_backward = any(o.kind == "B" for o in ops)
    backward_pairs = sorted({(b, a) for a, b in forward_pairs}) if has_backward else []
    micro_count = max(o.micro for o in ops) + 1
    versions = 2 if any(o.slot == "previous" for o in ops) else 1
    return Program(place, P, lag, micro_count, versions, max(n_act, 1), max(n_cot, 1), max(n_res, 1),
                   update_rel=update_rel, update=update, any_update=update.any(axis=(1, 2)).astype(np.int32),
                   forward_pairs=tuple(p for p in forward_pairs if p[0] != p[1]),
                   backward_pairs=tuple(p for p in backward_pairs if p[0] != p[1]), **arrays)


def period_window(table: TimeTable) -> tuple[int, int]:
    """(m, lag): the period [mP, (m+1)P) of step m that the program reads, and how many steps
    back its ops reach. m is the middle step laid out, so that the period is in steady state;
    the periods m and m+1 must be the same ops one step apart (checked)."""
    P = table.period
    m = (table.steps - 1) // 2
    window = [o for o in table.ops if m * P <= o.tick < (m + 1) * P]
    after = {(o.tick - P, o.device, o.stage, o.kind, o.step - 1, o.micro, o.slot)
             for o in table.ops if (m + 1) * P <= o.tick < (m + 2) * P}
    if table.steps < 2 or {(o.tick, o.device, o.stage, o.kind, o.step, o.micro, o.slot) for o in window} != after:
        raise ConfigError(f"{table.method}: the table's periods m={m} and {m + 1} are not the same ops one step "
                          f"apart: lay it out over more steps (it has {table.steps})")
    lag = max((m - o.step for o in window), default=0)
    return m, lag


def _slots(lives: dict, periodic: bool, period: int) -> tuple[dict, int]:
    """Slot index per (device, key) and the slots a device needs at most.

    Lag 0: interval colouring (greedy by first tick: optimal for intervals). Periodic: one
    slot per (unit, micro-batch, step mod H), H the fewest steps after which a key's lifetimes
    no longer overlap, so that the same op finds the same slot every period."""
    out, most = {}, 0
    for d, items in lives.items():
        if not periodic:
            ends: list[int] = []  # last tick of each slot's current tenant
            for first, last, key in sorted(items):
                free = [s for s, end in enumerate(ends) if end < first]
                s = free[0] if free else len(ends)
                if s == len(ends):
                    ends.append(last)
                ends[s] = last
                out[(d, key)] = s
            most = max(most, len(ends))
            continue
        by_key = defaultdict(list)
        for first, last, (u, micro, step) in items:
            by_key[(u, micro)].append((step, first, last))
        H = 1
        for spans in by_key.values():
            spans.sort()
            for i, (_, first, last) in enumerate(spans):
                H = max(H, 1 + sum(1 for _, f2, _ in spans[i + 1:] if f2 <= last))
        keys = sorted({(u, micro, step % H) for (u, micro) in by_key for step, _, _ in by_key[(u, micro)]})
        index = {k: i for i, k in enumerate(keys)}
        for first, last, (u, micro, step) in items:
            out[(d, (u, micro, step))] = index[(u, micro, step % H)]
        most = max(most, len(keys))
    return out, most


def _check_one_message(arrays, ops, place, lo, hi, method) -> None:
    """Each device receives at most one activation and one cotangent at the end of a tick (one
    buffer each per transfer), which the schedules here satisfy; a table that does not is refused."""
    counts = defaultdict(int)
    for o in ops:
        if not lo <= o.tick < hi:
            continue
        u = place.unit_of[o.stage]
        if o.kind in ("F", "FB") and u + 1 < len(place.units):
            counts[("act", o.tick, place.device[u + 1])] += 1
        if o.kind == "B" and u > 0:
            counts[("cot", o.tick, place.device[u - 1])] += 1
    worst = max(counts.items(), key=lambda kv: kv[1], default=(None, 0))
    if worst[1] > 1:
        (what, tick, d), n = worst
        raise ConfigError(f"{method}: device {d} receives {n} {what} messages at the end of tick {tick}; the "
                          f"runtime takes one of each per tick")


__all__ = ["BACKWARD", "FORWARD", "IDLE", "LOCAL", "Placement", "Program", "compile_table", "period_window",
           "placement"]
