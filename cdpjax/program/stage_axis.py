"""Lowering for the stage-axis engine: a table whose stages live on their own devices.

The tick runtime (`cdpjax.methods.pipeline`) runs every stage-axis layout (gpipe,
1f1b, interleaved-1f1b, zb-h1, zbv, looped-bfs, cdp-mp, ppll) from its program;
this module reads the table once, at build time, into small integer arrays indexed
[tick, device] (`StageTicks`) that a `lax.scan` over the ticks of one *period*
reads with `lax.axis_index('stage')`.

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
  schedule allows: 1F1B needs at most K-j where GPipe needs M), and by (unit,
  micro-batch, step) for a periodic layout, so the assignment repeats every period.
- **Cells.** A device's ops of one tick are its cell: one op in most tables, a
  forward of one micro-batch beside a backward of another where the schedule
  overlaps them (dualpipev's pairs). Each op is a *lane* of the per-tick arrays
  (`[tick, device, lane]`); the engine runs the cell as one piece, lane after lane.
- **Sends.** Each boundary b (unit b's output to unit b+1) has its own message of
  its own size: `send_act[t, b]` says whether unit b's forward at tick t sends it
  (the receiver stores it in slot `recv_act[t, b]`), `send_cot[t, b]` whether unit
  b+1's backward sends the cotangent back (`recv_cot[t, b]`). A boundary inside
  one device (a V-shaped layout's turn) is a copy, not a message.
- **Updates.** `update[t, d, v]`: unit v of device d applies its update at the
  end of tick t (for the step `update_lag` steps back).
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict

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
        """Buffer slots per kind of stash (each device's rows of the engine's buffers)."""
        return {"act": self.act_slots, "input": self.input_slots, "cot": self.cot_slots,
                "residual": self.residual_slots}

    def arrays(self) -> dict[str, np.ndarray]:
        """The per-tick arrays a `lax.scan` reads (leading axis: the ticks of the period)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), np.ndarray)}


def lower_stage_axis(table: TimeTable, residuals: str = "recompute", heads: bool = False,
                     carry_image: bool = False, model_state_sums: bool = False) -> Program:
    """The program of one period of `table` (laid out over enough steps, see `period_window`).

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
    split = op_kinds.split(present)
    place = placement(table)
    unit_of = place.unit_of
    P, D, U = table.period, place.devices, len(place.units)
    m, lag = period_window(table)
    lo, hi = m * P, (m + 1) * P
    ops = [o for o in table.ops if o.stage == place.units[unit_of[o.stage]][0]]  # one op per unit
    # (unit, micro, step) -> the tick whose end sends the unit's output on (a forward kind), its input's cotangent back
    sends = {flag: {(unit_of[o.stage], o.micro, o.step): o.tick for o in ops if getattr(op_kinds.lookup(o.kind), flag)}
             for flag in ("forward", "cotangent")}
    last_backward = {}  # (unit, micro, step) -> the tick of the last op that reads its cotangent (B, or its W)
    for o in ops:
        if op_kinds.lookup(o.kind).reads_cotangent:
            key = (unit_of[o.stage], o.micro, o.step)
            last_backward[key] = max(last_backward.get(key, -1), o.tick)
    periodic = lag > 0
    lives = _lifetimes(ops, unit_of, sends, last_backward, U, carry, periodic)
    slots = {name: _slots(life, periodic) for name, life in lives.items()}
    slot_of = {name: s[0] for name, s in slots.items()}
    count = {name: max(s[1], 1) for name, s in slots.items()}
    arrays, cells = _tick_arrays(table, ops, place, slot_of, m)
    update = np.zeros((P, D, place.chunks), bool)
    update_lag = np.zeros((P, D, place.chunks), np.int32)
    for up in table.updates:
        if lo <= up.tick < hi and up.stage == place.units[unit_of[up.stage]][0]:
            u = unit_of[up.stage]
            update[up.tick - lo, place.device[u], place.chunk[u]] = True
            update_lag[up.tick - lo, place.device[u], place.chunk[u]] = m - up.step
    ticks = StageTicks(update=update, update_lag=update_lag, any_update=update.any(axis=(1, 2)).astype(np.int32),
                       act_slots=count["act"], input_slots=count["input"], cot_slots=count["cot"],
                       residual_slots=count["residual"],
                       boundaries=tuple((place.device[u], place.device[u + 1]) for u in range(U - 1)),
                       cells=cells, **arrays)
    microbatches = max(o.micro for o in ops) + 1
    versions = 2 if any(o.slot == "previous" for o in ops) else 1
    in_flight = _grads_in_flight(ticks, place, P)
    buffers = _buffers(place, ticks, lag, versions, in_flight, heads, carry, carry_image, microbatches,
                       backprop=any(op_kinds.lookup(o.kind).reads_cotangent for o in ops),
                       model_state_sums=model_state_sums)
    return Program(table.method, "stage", P, lag, D, microbatches, tuple(present), split, residuals, versions,
                   in_flight, place, buffers, stage_events(ticks, place, carry_image), ticks)


def _cells(table, ops, place, lo, hi) -> dict[tuple[int, int], list]:
    """The ops of each (tick of the period, device), in the table's order; refuses a cell the
    engine cannot run as one piece (naming it): ops of different steps, two ops of one unit and
    kind, two that send to the next unit or two that send a cotangent back."""
    unit_of = place.unit_of
    cells = defaultdict(list)
    for o in ops:
        if lo <= o.tick < hi:
            cells[(o.tick - lo, o.device)].append(o)
    for (t, d), cell in cells.items():
        what = " + ".join(f"{o.kind} of stage {o.stage} (micro-batch {o.micro}, step {o.step})" for o in cell)
        flags = [op_kinds.lookup(o.kind) for o in cell]
        if len({o.step for o in cell}) > 1:
            raise ConfigError(f"{table.method}: device {d} runs ops of different steps in tick {lo + t} ({what}); "
                              f"the stage-axis engine runs a cell's ops for one step")
        if len({(o.kind, unit_of[o.stage]) for o in cell}) < len(cell):
            raise ConfigError(f"{table.method}: device {d} runs two {cell[0].kind} ops of one unit in tick {lo + t} "
                              f"({what})")
        if sum(k.forward for k in flags) > 1 or sum(k.cotangent for k in flags) > 1:
            raise ConfigError(f"{table.method}: device {d} in tick {lo + t} runs {what}: the stage-axis engine "
                              f"overlaps at most one forward and one backward that sends a cotangent per cell")
    return cells


def _tick_arrays(table, ops, place, slot_of, m) -> tuple[dict, tuple]:
    """The [tick, device, lane] op arrays and the [tick, boundary] send arrays of the period of
    step m, with the cells' (kind, unit) lanes."""
    unit_of, P, D, U = place.unit_of, table.period, place.devices, len(place.units)
    lo, hi = m * P, (m + 1) * P
    codes = kind_codes()
    cells = _cells(table, ops, place, lo, hi)
    K = max((len(c) for c in cells.values()), default=1)
    arrays = {k: np.full((P, D, K), -1, np.int32) for k in ("act_slot", "input_slot", "residual_slot", "cot_slot")}
    arrays.update({k: np.zeros((P, D, K), np.int32) for k in ("kind", "unit", "micro", "lag", "version")})
    arrays["cell"] = np.zeros((P, D), np.int32)
    arrays.update({k: np.zeros((P, U - 1), np.int32) for k in ("send_act", "send_cot")})
    arrays.update({k: np.full((P, U - 1), -1, np.int32) for k in ("recv_act", "recv_cot")})
    index: dict[tuple, int] = {(): IDLE}
    for (t, d), cell in sorted(cells.items()):
        lanes = tuple((o.kind, unit_of[o.stage]) for o in cell)
        arrays["cell"][t, d] = index.setdefault(lanes, len(index))
        for k, o in enumerate(cell):
            u = unit_of[o.stage]
            kind = op_kinds.lookup(o.kind)
            key = (d, (u, o.micro, o.step))
            for name, value in (("kind", codes[o.kind]), ("unit", u), ("micro", o.micro), ("lag", m - o.step),
                                ("version", int(o.slot == "previous"))):
                arrays[name][t, d, k] = value
            for name in ("act", "input", "residual"):
                arrays[f"{name}_slot"][t, d, k] = slot_of[name].get(key, -1)
            if kind.reads_cotangent:
                arrays["cot_slot"][t, d, k] = slot_of["cot"].get(key, -1)
            if kind.forward and u == 0 and o.step != m:
                raise ConfigError(f"{table.method}: a period must feed its own batch into the first stage "
                                  f"(tick {o.tick} feeds step {o.step} in the period of step {m})")
            if kind.forward and u + 1 < U:  # its output goes to the next unit's device
                arrays["send_act"][t, u] = 1
                arrays["recv_act"][t, u] = slot_of["act"][(place.device[u + 1], (u + 1, o.micro, o.step))]
            if kind.cotangent and u > 0:  # the cotangent of its input goes back
                arrays["send_cot"][t, u - 1] = 1
                arrays["recv_cot"][t, u - 1] = slot_of["cot"][(place.device[u - 1], (u - 1, o.micro, o.step))]
    return arrays, tuple(sorted(index, key=index.get))


def _lifetimes(ops, unit_of, sends, last_backward, U, carry, periodic) -> dict[str, dict]:
    """Per buffer kind, each device's (first tick, last tick, (unit, micro, step)) lifetimes."""
    lives = {name: defaultdict(list) for name in ("act", "input", "residual", "cot")}
    for o in ops:
        u = unit_of[o.stage]
        key = (u, o.micro, o.step)
        done = last_backward.get(key)
        kind = op_kinds.lookup(o.kind)
        if kind.forward:
            arrival = o.tick if u == 0 else sends["forward"][(u - 1, o.micro, o.step)] + 1
            if u > 0:
                lives["act"][o.device].append((arrival, o.tick if (carry or done is None) else done, key))
            elif done is not None and not carry and periodic:
                # the first unit reads the call's batch; only a backward in a later call needs it kept
                lives["input"][o.device].append((arrival, done, key))
            if carry and done is not None:
                lives["residual"][o.device].append((o.tick, done, key))
        elif kind.cotangent and u + 1 < U:  # not the last unit's: its cotangent arrives from the next one
            lives["cot"][o.device].append((sends["cotangent"][(u + 1, o.micro, o.step)] + 1, done, key))
    return lives


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
    out.append(Buffer("act", "activations", Size("input", inputs, True, ticks.act_slots), between))
    if ticks.input_slots and (ticks.input_slot >= 0).any():
        out.append(Buffer("input", "images", Size("image", ((0,),), False, ticks.input_slots), between))
    if carry_image:
        out.append(Buffer("image", "images", Size("image", ((0,),), False, ticks.act_slots), between))
    if backprop:  # a cotangent row is an activation row (one carrier layout): as wide as the widest input
        out.append(Buffer("cot", "cotangents", Size("input", inputs, True, ticks.cot_slots), between))
    if carry:
        out.append(Buffer("residual", "residuals", Size("residual", units, True, ticks.residual_slots), between))
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


def _slots(lives: dict, periodic: bool) -> tuple[dict, int]:
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


def stage_events(ticks: StageTicks, place: Placement, carry_image: bool) -> tuple[Event, ...]:
    """The period's typed events, from its arrays: each op (each lane of a cell) as a `Compute` of
    every stage of its unit; each boundary's message between two devices (a unit's output, the
    cotangent of a unit's input, and with `carry_image` the image beside the output) as a `Send`
    and its `Receive`, at the size of the receiving unit's first stage's input; each unit's update
    as an `Apply` of each of its stages. A boundary inside one device (a V's turn) is a copy: no
    message. A cell's ops are of one step (`_cells`), so its lanes share one lag."""
    kind_of = {code: kind for kind, code in kind_codes().items()}
    events: list[Event] = []
    sends: list[Send] = []
    P, D, K = ticks.kind.shape

    def cell_lag(t, d):
        return next(int(ticks.lag[t, d, k]) for k in range(K) if ticks.kind[t, d, k] != IDLE)

    for t in range(P):
        for d in range(D):
            for k in range(K):
                code = int(ticks.kind[t, d, k])
                if code != IDLE:
                    events += [Compute(t, d, kind_of[code], j, int(ticks.micro[t, d, k]),
                                       int(ticks.version[t, d, k]), int(ticks.lag[t, d, k]))
                               for j in place.units[int(ticks.unit[t, d, k])]]
            for u in place.of_device(d):
                if ticks.update[t, d, place.chunk[u]]:
                    events += [Apply(t, d, j, 1, int(ticks.update_lag[t, d, place.chunk[u]])) for j in place.units[u]]
        for b, (src, dst) in enumerate(ticks.boundaries):
            first = place.units[b + 1][0]
            if src == dst:
                continue
            if ticks.send_act[t, b]:
                lag = cell_lag(t, src)
                sends.append(Send(t, "activation", Size.stage("input", first), src, dst, first, lag))
                if carry_image:
                    sends.append(Send(t, "image", Size.stage("image", 0), src, dst, 0, lag))
            if ticks.send_cot[t, b]:
                sends.append(Send(t, "cotangent", Size.stage("input", first), dst, src, first, cell_lag(t, dst)))
    return sorted_events(events + messages(sends))


__all__ = ["IDLE", "LANE_FIELDS", "StageTicks", "kind_codes", "lower_stage_axis", "period_window", "placement",
           "stage_events"]
