"""Lowering for the stage-axis engine: a table whose stages live on their own devices.

The tick runtime (`cdpjax.methods.pipeline`) runs every stage-axis layout (gpipe,
1f1b, interleaved-1f1b, zb-h1, zbv, dualpipev, looped-bfs, cdp-mp, ppll) from its
program. This module reads the table once, at build time, into the typed events of
one *period* (`table_events`), then compiles those events, and nothing else, into
small integer arrays indexed [tick, device] (`StageTicks`, `stage_ticks`) that a
`lax.scan` over the ticks of the period reads with `lax.axis_index('stage')`; the
engine compiles them from the events of the program it is given (`program_ticks`).

- **Units.** A device runs units: a unit is one stage (backprop layouts) or the
  group of local modules a device runs one after another within a tick (ppll's
  'FB' ops of one device and tick). A device holds `chunks` units (interleaved and
  V-shaped layouts), stored as the rows of its carrier.
- **Period.** One call runs the ticks of one training step: the whole step for a
  flushed layout, one steady-state period for a layout whose ops of a step spill
  into the next call (cdp-mp: 2L ticks; ppll: one tick). An op's `lag` is how many
  steps before the batch this call feeds its step is (0, 1, ...); the program's `lag` the largest.
- **Slots.** A device keeps each micro-batch's input from its arrival until its last
  use (the last backward op, which recomputes from it; or the forward, when
  residuals are carried instead), its kept residuals from the forward to the last
  backward op, and each incoming cotangent until the last backward op that reads
  it (the `W` of a split backward reads it too). Slot indices come from these
  lifetimes: by interval colouring for a layout with lag 0 (the fewest buffers the
  schedule allows: 1F1B needs at most K-j where GPipe needs M), and one per (unit,
  micro-batch) for a periodic layout, so the assignment repeats every period (a
  lifetime longer than the period is refused: the next step's would need its slot).
- **Cells.** A device's ops of one tick are its cell: one op in most tables, a
  forward of one micro-batch beside a backward of another where the schedule
  overlaps them (dualpipev's pairs). Each op is a *lane* of the per-tick arrays
  (`[tick, device, lane]`); the engine runs the cell as one piece, lane after lane.
- **Sends.** Each boundary b (unit b's output to unit b+1) has its own message of
  its own size: `send_act[t, b]` says whether unit b's forward at tick t sends it
  (the receiver stores it in slot `recv_act[t, b]`), `send_cot[t, b]` whether unit
  b+1's backward sends the cotangent back (`recv_cot[t, b]`): between two devices at
  the ticks of the program's `Send` events, the slot the one of the micro-batch of
  the sender's op of that tick. A boundary inside one device (a V-shaped layout's
  turn) is a copy at each op that crosses it, not a message.
- **Updates.** `update[t, d, v]`: unit v of device d applies its update at the
  end of tick t (for the step `update_lag` steps back).
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import NamedTuple, Sequence

import numpy as np

from cdpjax import kinds as op_kinds
from cdpjax.errors import ConfigError
from cdpjax.program import Buffer, Placement, Program, Size, carries
from cdpjax.program.events import Apply, Compute, Event, Send, messages, sorted_events
from cdpjax.timetable import TimeTable

IDLE = 0


def kind_codes() -> dict[str, int]:
    """Each registered op kind's code in the arrays (0: idle), in the registry's order (read at
    lowering time, so that a kind registered later, from outside the package, has one too)."""
    return {name: i + 1 for i, name in enumerate(op_kinds.KINDS)}

LANE_FIELDS = ("kind", "unit", "micro", "lag", "version", "act_slot", "input_slot", "residual_slot", "cot_slot")


def placement(table: TimeTable) -> Placement:
    """Units from the table: a stage per unit, except that the stages a device runs as local
    ops (a kind that is forward and backward at once: ppll's 'FB') in the same tick form one unit."""
    device_of: dict[int, int] = {}
    together: dict[tuple[int, int], list[int]] = defaultdict(list)
    for op in table.ops:
        if device_of.setdefault(op.stage, op.device) != op.device:
            raise ConfigError(f"{table.method}: stage {op.stage} runs on devices {device_of[op.stage]} and "
                              f"{op.device}; the runtime keeps each stage on one device")
        kind = op_kinds.lookup(op.kind)
        if kind.forward and kind.backward:
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
class StageTicks:
    """One period as arrays (P ticks, D devices, K lanes, B boundaries).

    A device's cell of a tick holds up to K ops (*lanes*, in the table's order): one op in most
    tables; a forward of one micro-batch beside a backward of another where the schedule
    overlaps them (dualpipev). cell [P, D]: the index of the cell's ops in `cells` (0: idle),
    the engine's switch index. cells: per index, the (kind, unit) of each lane.

    Per lane, [P, D, K]: kind: `kind_codes()` of the op (0: no op in this lane). unit: the unit it runs.
    micro: its micro-batch. lag: how many steps before this call's batch its step is (>= 0).
    version: 0 current, 1 previous. act_slot: where its input is kept (-1 none). input_slot:
    where the first unit's batch input is kept for a backward in a later call (-1 none).
    residual_slot: where a forward keeps, and its backward ops read, carried residuals.
    cot_slot: where a backward op finds its output's cotangent (-1: the last unit, seeded by
    the loss). send_act / send_cot [P, B]: boundary b's message is sent at the end of the tick
    (0 / 1); recv_act / recv_cot [P, B]: the slot it lands in on the receiving device. update
    [P, D, chunks], update_lag: see the module docstring. any_update [P]: some unit updates then.
    """

    cell: np.ndarray
    kind: np.ndarray
    unit: np.ndarray
    micro: np.ndarray
    lag: np.ndarray
    version: np.ndarray
    act_slot: np.ndarray
    input_slot: np.ndarray
    residual_slot: np.ndarray
    cot_slot: np.ndarray
    send_act: np.ndarray
    recv_act: np.ndarray
    send_cot: np.ndarray
    recv_cot: np.ndarray
    update: np.ndarray
    update_lag: np.ndarray
    any_update: np.ndarray
    act_slots: int
    input_slots: int
    cot_slots: int
    residual_slots: int
    boundaries: tuple[tuple[int, int], ...]  # (source device, destination device) of each boundary
    cells: tuple[tuple[tuple[str, int], ...], ...] = ((),)

    @property
    def lanes(self) -> int:
        return self.kind.shape[2]

    @property
    def slots(self) -> dict[str, int]:
        """Buffer slots per stash, by the name of its buffer (each device's rows of the engine's buffers)."""
        return {"acts": self.act_slots, "input": self.input_slots, "cots": self.cot_slots,
                "residuals": self.residual_slots}

    def arrays(self) -> dict[str, np.ndarray]:
        """The per-tick arrays a `lax.scan` reads (leading axis: the ticks of the period)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), np.ndarray)}


def lower_stage_axis(table: TimeTable, residuals: str = "recompute", heads: bool = False,
                     carry_image: bool = False, model_state_sums: bool = False) -> Program:
    """The program of one period of `table` (laid out over enough steps, see `period_window`):
    the period's typed events first (`table_events`), then the arrays the engine's scan reads,
    compiled from those events alone (`stage_ticks`, as the engine compiles them from the program
    it is given), then the buffers those arrays need.

    residuals: 'recompute' (backward ops recompute from the kept input) or 'carry' (the
    forward's `jax.vjp` residuals are kept). heads: the units have auxiliary heads (local
    learning). carry_image: each micro-batch's input image goes along with it to every unit
    (heads that reconstruct the image read it). model_state_sums: the runtime sums each unit's
    model-state updates over a step and applies their mean at the step's end (cdp-mp's rule), in
    a buffer of the model state's size."""
    carry = carries(residuals)
    codes = kind_codes()
    present = sorted({o.kind for o in table.ops}, key=list(codes).index)
    op_kinds.refuse_unknown(present, codes, "the stage-axis engine")
    place = placement(table)
    m, lag = period_window(table)
    events = table_events(table, place, m, carry_image)
    ticks = stage_ticks(events, place, table.period, lag, carry, table.method)
    computes = [e for e in events if isinstance(e, Compute)]
    microbatches = max(e.microbatch for e in computes) + 1
    versions = 2 if any(e.version == 1 for e in computes) else 1
    in_flight = _grads_in_flight(ticks, place, table.period)
    buffers = _buffers(place, ticks, lag, versions, in_flight, heads, carry, carry_image, microbatches,
                       backprop=any(op_kinds.lookup(k).reads_cotangent for k in present),
                       model_state_sums=model_state_sums)
    return Program(table.method, "stage", table.period, lag, place.devices, microbatches, tuple(present),
                   op_kinds.split(present), residuals, versions, in_flight, place, buffers, events)


def table_events(table: TimeTable, place: Placement, m: int, carry_image: bool) -> tuple[Event, ...]:
    """The typed events of the period of step m (the table's ticks [mP, (m+1)P)), read straight
    from the table: each op as a `Compute` of every stage of its unit (a unit's ops are its first
    stage's), at its tick in the period, with lag m - its step; a forward whose output goes to
    another device as a `Send` of the next unit's input (and with `carry_image` the image beside
    it), a backward that sends its input's cotangent to another device as a `Send` back, each with
    its `Receive`, at the size of the receiving unit's first stage's input; each update as an
    `Apply` of every stage of its unit. A boundary inside one device (a V's turn) is a copy: no
    message."""
    unit_of, units, device = place.unit_of, place.units, place.device
    lo, hi = m * table.period, (m + 1) * table.period
    events: list[Event] = []
    sends: list[Send] = []
    for o in table.ops:
        u = unit_of[o.stage]
        if not lo <= o.tick < hi or o.stage != units[u][0]:
            continue
        t, lag, kind = o.tick - lo, m - o.step, op_kinds.lookup(o.kind)
        events += [Compute(t, o.device, o.kind, j, o.micro, int(o.slot == "previous"), lag) for j in units[u]]
        if kind.forward and u + 1 < len(units) and device[u + 1] != o.device:
            first = units[u + 1][0]
            sends.append(Send(t, "activation", Size.stage("input", first), o.device, device[u + 1], first, lag))
            if carry_image:
                sends.append(Send(t, "image", Size.stage("image", 0), o.device, device[u + 1], 0, lag))
        if kind.cotangent and u > 0 and device[u - 1] != o.device:
            first = units[u][0]
            sends.append(Send(t, "cotangent", Size.stage("input", first), o.device, device[u - 1], first, lag))
    for up in table.updates:
        u = unit_of[up.stage]
        if lo <= up.tick < hi and up.stage == units[u][0]:
            events += [Apply(up.tick - lo, device[u], j, 1, m - up.step) for j in units[u]]
    return sorted_events(events + messages(sends))


class _Op(NamedTuple):
    """One op of a period as `stage_ticks` reads it from the `Compute` events of its unit's stages."""

    tick: int
    device: int
    kind: str
    unit: int
    micro: int
    lag: int
    version: int


def stage_ticks(events: Sequence[Event], place: Placement, period: int, lag: int, carry: bool,
                method: str = "the program") -> StageTicks:
    """The arrays the engine's scan reads, compiled from a program's events and nothing else (the
    engine compiles them from the program it runs; the lowering from the events it emits).

    - Ops: the `Compute` events of one tick, device, kind, unit, micro-batch and lag are one op
      (a unit's stages run together). A device's ops of a tick are its cell, its lanes in the
      kinds' registered order (a forward before a backward), then by unit.
    - Slots: from each op's lifetimes (module docstring), counted in ticks from the start of its
      own step's period (an op `lag` calls back ran `lag` periods earlier): a unit's input arrives
      the tick after the previous unit's forward of its micro-batch, a cotangent the tick after
      the next unit's backward that sends it. A periodic program (lag > 0) keeps each
      (unit, micro-batch) in a slot of its own, each step's in turn.
    - Messages: a boundary between two devices sends at the ticks of its `Send` events (the
      activation forward, the cotangent back), into the receiver's slot for the micro-batch of the
      sender's op of that tick; a boundary inside one device copies at each forward (backward)
      that crosses it.
    - Updates: at the ticks of the `Apply` events, for the step of their lag.

    A ConfigError names an event the engine cannot run (a stage off its device, a message with no
    op to send it or none to read it, a cell it cannot run as one piece)."""
    unit_of, D, U = place.unit_of, place.devices, len(place.units)
    codes = kind_codes()
    found: dict[tuple, int] = {}
    for e in events:
        if isinstance(e, (Compute, Apply)) and place.device[unit_of[e.stage]] != e.device:
            raise ConfigError(f"{method}: {e} is on device {e.device}, but stage {e.stage} lives on device "
                              f"{place.device[unit_of[e.stage]]}")
        if isinstance(e, Compute):
            found.setdefault((e.tick, e.device, e.kind, unit_of[e.stage], e.microbatch, e.lag), e.version)
    ops = sorted((_Op(*key, version) for key, version in found.items()),
                 key=lambda o: (o.tick, o.device, codes[o.kind], o.unit))
    cells: dict[tuple[int, int], list[_Op]] = defaultdict(list)
    for o in ops:
        cells[(o.tick, o.device)].append(o)
    for cell in cells.values():
        _check_cell(cell, method)
    at = {name: {} for name in ("forward", "cotangent")}  # (unit, micro) -> the op's tick from its step's start
    done: dict[tuple[int, int], int] = {}  # (unit, micro) -> the last tick that reads its output's cotangent
    for o in ops:
        kind, key, tick = op_kinds.lookup(o.kind), (o.unit, o.micro), o.tick + o.lag * period
        for flag in at:
            if getattr(kind, flag) and at[flag].setdefault(key, tick) != tick:
                raise ConfigError(f"{method}: unit {o.unit} runs two {flag} ops of micro-batch {o.micro} in a step "
                                  f"(ticks {at[flag][key]} and {tick} from the step's start)")
        if kind.reads_cotangent:
            done[key] = max(done.get(key, -1), tick)
    lives = _lifetimes(ops, at, done, U, carry, lag > 0, period, method)
    slots = {name: _slots(life, lag > 0, period, method) for name, life in lives.items()}

    def slot(name, device, unit, micro):
        return slots[name][0].get((device, (unit, micro)), -1)

    K = max((len(c) for c in cells.values()), default=1)
    arrays = {k: np.full((period, D, K), -1, np.int32) for k in ("act_slot", "input_slot", "residual_slot",
                                                                 "cot_slot")}
    arrays.update({k: np.zeros((period, D, K), np.int32) for k in ("kind", "unit", "micro", "lag", "version")})
    arrays["cell"] = np.zeros((period, D), np.int32)
    index: dict[tuple, int] = {(): IDLE}
    for (t, d), cell in sorted(cells.items()):
        arrays["cell"][t, d] = index.setdefault(tuple((o.kind, o.unit) for o in cell), len(index))
        for k, o in enumerate(cell):
            for name, value in (("kind", codes[o.kind]), ("unit", o.unit), ("micro", o.micro), ("lag", o.lag),
                                ("version", o.version)):
                arrays[name][t, d, k] = value
            for name in ("act", "input", "residual"):
                arrays[f"{name}_slot"][t, d, k] = slot(name, d, o.unit, o.micro)
            if op_kinds.lookup(o.kind).reads_cotangent:
                arrays["cot_slot"][t, d, k] = slot("cot", d, o.unit, o.micro)
    arrays.update(_message_arrays(events, cells, place, period, slot, method))
    update = np.zeros((period, D, place.chunks), bool)
    update_lag = np.zeros((period, D, place.chunks), np.int32)
    for e in events:
        if isinstance(e, Apply):
            u = unit_of[e.stage]
            update[e.tick, e.device, place.chunk[u]] = True
            update_lag[e.tick, e.device, place.chunk[u]] = e.lag
    return StageTicks(update=update, update_lag=update_lag, any_update=update.any(axis=(1, 2)).astype(np.int32),
                      act_slots=max(slots["act"][1], 1), input_slots=max(slots["input"][1], 1),
                      cot_slots=max(slots["cot"][1], 1), residual_slots=max(slots["residual"][1], 1),
                      boundaries=tuple((place.device[u], place.device[u + 1]) for u in range(U - 1)),
                      cells=tuple(sorted(index, key=index.get)), **arrays)


def program_ticks(program: Program) -> StageTicks:
    """The arrays the engine's scan reads for `program`: `stage_ticks` of its events."""
    return stage_ticks(program.events, program.placement, program.period, program.lag, program.carries,
                       program.method)


def _check_cell(cell: list[_Op], method: str) -> None:
    """Refuses a cell the engine cannot run as one piece (naming it): two ops of one unit and kind,
    two that send to the next unit or two that send a cotangent back. Its ops may be of different
    steps (a forward beside the previous step's backward): the engine gates each by its own."""
    t, d = cell[0].tick, cell[0].device
    what = " + ".join(f"{o.kind} of unit {o.unit} (micro-batch {o.micro}, lag {o.lag})" for o in cell)
    flags = [op_kinds.lookup(o.kind) for o in cell]
    if len({(o.kind, o.unit) for o in cell}) < len(cell):
        raise ConfigError(f"{method}: device {d} runs two {cell[0].kind} ops of one unit in tick {t} ({what})")
    if sum(k.forward for k in flags) > 1 or sum(k.cotangent for k in flags) > 1:
        raise ConfigError(f"{method}: device {d} in tick {t} runs {what}: the stage-axis engine "
                          f"overlaps at most one forward and one backward that sends a cotangent per cell")
    if any(k.forward and o.unit == 0 and o.lag for k, o in zip(flags, cell)):
        raise ConfigError(f"{method}: a period must feed its own batch into the first stage (tick {t} feeds "
                          f"the step {max(o.lag for o in cell)} back)")


def _lifetimes(ops, at, done, U, carry, periodic, period, method) -> dict[str, dict]:
    """Per buffer kind, each device's (first tick, last tick, (unit, micro)) lifetimes, in ticks from
    the start of the op's own step's period."""
    lives = {name: defaultdict(list) for name in ("act", "input", "residual", "cot")}
    for o in ops:
        key, tick, kind = (o.unit, o.micro), o.tick + o.lag * period, op_kinds.lookup(o.kind)
        end = done.get(key)
        if kind.forward:
            if o.unit > 0:
                arrival = _after(at["forward"], (o.unit - 1, o.micro), o, "the previous unit's forward", method)
                lives["act"][o.device].append((arrival, tick if (carry or end is None) else end, key))
            elif end is not None and not carry and periodic:
                # the first unit reads the call's batch; only a backward in a later call needs it kept
                lives["input"][o.device].append((tick, end, key))
            if carry and end is not None:
                lives["residual"][o.device].append((tick, end, key))
        elif kind.cotangent and o.unit + 1 < U:  # not the last unit's: its cotangent arrives from the next one
            arrival = _after(at["cotangent"], (o.unit + 1, o.micro), o, "the next unit's backward", method)
            lives["cot"][o.device].append((arrival, end, key))
    return lives


def _after(ticks: dict, key, op: _Op, what: str, method: str) -> int:
    """The tick after the op `key` names (where what it sends arrives); refuses an op with no such op."""
    if key not in ticks:
        raise ConfigError(f"{method}: {op.kind} of unit {op.unit}, micro-batch {op.micro} in tick {op.tick} has no "
                          f"input: {what} of micro-batch {op.micro} runs nowhere in the program")
    return ticks[key] + 1


def _message_arrays(events, cells, place, period, slot, method) -> dict[str, np.ndarray]:
    """[P, B] send_act / recv_act / send_cot / recv_cot: boundary b sends at the end of the tick, into
    the slot of the receiving device (module docstring). A message between devices is its `Send`
    event; a boundary inside one device is a copy at each op that crosses it."""
    U = len(place.units)
    out = {k: np.zeros((period, U - 1), np.int32) for k in ("send_act", "send_cot")}
    out.update({k: np.full((period, U - 1), -1, np.int32) for k in ("recv_act", "recv_cot")})
    unit_of, device = place.unit_of, place.device
    crossings = []  # (tick, boundary, the op that sends, 'act' | 'cot')
    for e in events:
        if isinstance(e, Send) and e.what in ("activation", "cotangent"):
            forward = e.what == "activation"
            b = unit_of[e.stage] - 1  # the boundary into the unit whose input it is
            u = b if forward else b + 1  # the unit that sends it
            if b < 0 or e.stage != place.units[b + 1][0] or \
                    (e.src, e.dst) != ((device[b], device[b + 1]) if forward else (device[b + 1], device[b])):
                raise ConfigError(f"{method}: {e} crosses no boundary between two units' devices (stage "
                                  f"{e.stage}'s input comes from device {device[max(b, 0)]})")
            flag = "forward" if forward else "cotangent"
            sender = next((o for o in cells.get((e.tick, e.src), ()) if o.unit == u and o.lag == e.lag
                           and getattr(op_kinds.lookup(o.kind), flag)), None)
            if sender is None:
                raise ConfigError(f"{method}: {e} has no {flag} op of unit {u} on device {e.src} in tick "
                                  f"{e.tick} to send it")
            crossings.append((e.tick, b, sender, "act" if forward else "cot"))
    for (t, d), cell in cells.items():  # a boundary inside one device: a copy
        for o in cell:
            kind = op_kinds.lookup(o.kind)
            if kind.forward and o.unit + 1 < U and device[o.unit + 1] == d:
                crossings.append((t, o.unit, o, "act"))
            if kind.cotangent and o.unit > 0 and device[o.unit - 1] == d:
                crossings.append((t, o.unit - 1, o, "cot"))
    for t, b, o, what in crossings:
        receiver = b + 1 if what == "act" else b
        into = slot(what, device[receiver], receiver, o.micro)
        if into < 0:
            raise ConfigError(f"{method}: {o.kind} of unit {o.unit}, micro-batch {o.micro} in tick {t} sends to "
                              f"unit {receiver}, which has no op to read it")
        out[f"send_{what}"][t, b] = 1
        out[f"recv_{what}"][t, b] = into
    return out


def _slots(lives: dict, periodic: bool, period: int, method: str) -> tuple[dict, int]:
    """Slot index per (device, (unit, micro)) and the slots a device needs at most.

    Lag 0: interval colouring (greedy by first tick: optimal for intervals). Periodic: one slot
    per (unit, micro-batch), so that the same op finds the same slot every period; a lifetime
    longer than a period is refused (the next step's would need the slot while it is held, and
    the arrays are the same every call)."""
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
        long = next(((first, last, key) for first, last, key in items if last - first >= period), None)
        if long is not None:
            raise ConfigError(f"{method}: device {d} keeps unit {long[2][0]}'s micro-batch {long[2][1]} from tick "
                              f"{long[0]} to {long[1]} of its step, longer than the period of {period} ticks")
        keys = sorted({key for _, _, key in items})
        out.update({(d, k): i for i, k in enumerate(keys)})
        most = max(most, len(keys))
    return out, most


def _buffers(place, ticks: StageTicks, lag, versions, in_flight, heads, carry, carry_image, microbatches,
             backprop, model_state_sums) -> tuple[Buffer, ...]:
    """What every device of the stage engine allocates (the runtime's state and slot buffers)."""
    units = place.units
    V = place.chunks
    rows = lambda of, between=True: Size(of, units, True, V)  # noqa: E731 - a carrier row per unit
    inputs = tuple((u[0],) for u in units)
    out = [Buffer("rows.body", "parameters", rows("param"), True),
           Buffer("opt_state.body", "optimizer_state", rows("param"), True),
           Buffer("model_state", "model_state", rows("model_state"), True),
           Buffer("grads", "gradients", rows("param"), in_flight)]
    if versions == 2:
        out.append(Buffer("previous", "previous_parameters", rows("param"), True))
    if model_state_sums:
        out.append(Buffer("state_sums", "model_state", rows("model_state"), True))
    if heads:
        out += [Buffer("rows.head", "parameters", rows("head_param"), True),
                Buffer("opt_state.head", "optimizer_state", rows("head_param"), True),
                Buffer("head_state", "model_state", rows("head_state"), True),
                Buffer("grads.head", "gradients", rows("head_param"), in_flight)]
    between = lag > 0
    out.append(Buffer("acts", "activations", Size("input", inputs, True, ticks.act_slots), between))
    if ticks.input_slots and (ticks.input_slot >= 0).any():
        out.append(Buffer("input", "images", Size("image", ((0,),), False, ticks.input_slots), between))
    if carry_image:
        out.append(Buffer("image", "images", Size("image", ((0,),), False, ticks.act_slots), between))
    if backprop:  # a cotangent row is an activation row (one carrier layout): as wide as the widest input
        out.append(Buffer("cots", "cotangents", Size("input", inputs, True, ticks.cot_slots), between))
    if carry:
        out.append(Buffer("residuals", "residuals", Size("residual", units, True, ticks.residual_slots),
                          between))
    if lag:
        out.append(Buffer("labels", "labels", Size("label", ((0,),), False, lag * microbatches), True))
        out.append(Buffer("fed", "flags", Size("flag", ((0,),), False, lag), True))  # which calls fed a batch
    # ppll (local learning, no cotangents) leaves them out: with them its prediction overshoots
    # XLA's (1.8x on the digits MLP); which of them XLA folds there is not yet read from its assignment
    return tuple(out) + (_step_temporaries(place, microbatches, heads) if backprop else ())


def _step_temporaries(place, microbatches, heads) -> tuple[Buffer, ...]:
    """What one call allocates beside the state: every device runs every boundary's gated message
    (one SPMD program), so it holds each boundary's received activation (and cotangent) at its own
    size; the batch slice split into the call's micro-batches; the gradient sums averaged over
    `data` (a loop's zero start and its result, two rows) and the update's new row."""
    units = place.units
    rows = lambda of, count: Size(of, units, True, place.chunks * count)  # noqa: E731 - carrier rows
    crossing = tuple((units[u + 1][0],) for u in range(len(units) - 1) if place.device[u] != place.device[u + 1])
    out = [Buffer("batch.micro", "images", Size("image", ((0,),), False, microbatches), False),
           Buffer("grads.reduced", "reduced_gradients", rows("param", 2), False),
           Buffer("rows.updated", "parameters", rows("param", 1), False)]
    if heads:
        out += [Buffer("grads.head.reduced", "reduced_gradients", rows("head_param", 2), False),
                Buffer("rows.head.updated", "parameters", rows("head_param", 1), False)]
    if crossing:
        out += [Buffer("messages.act", "activations", Size("input", crossing), False),
                Buffer("messages.cot", "cotangents", Size("input", crossing), False)]
    return tuple(out)


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


def _grads_in_flight(ticks: StageTicks, place: Placement, P: int) -> bool:
    """Whether a unit's gradient sum spans calls: some gradient op of the period comes after the
    unit's last update in it (cdp-mp), rather than every sum being applied where it is made."""
    gradient = {code for name, code in kind_codes().items() if op_kinds.lookup(name).backward}
    for d in range(place.devices):
        for v in range(place.chunks):
            last_update = max((t for t in range(P) if ticks.update[t, d, v]), default=-1)
            for t in range(last_update + 1, P):
                for k in range(ticks.lanes):
                    if ticks.kind[t, d, k] in gradient and place.chunk[ticks.unit[t, d, k]] == v:
                        return True
    return False


__all__ = ["IDLE", "LANE_FIELDS", "StageTicks", "kind_codes", "lower_stage_axis", "period_window", "placement",
           "program_ticks", "stage_ticks", "table_events"]
