"""Time tables: for every tick and every device, which stage of which micro-batch runs,
which op kind (`cdpjax.kinds`: forward, backward, weight gradient, local), and which
parameter version it reads.

The single source of truth for timing (docs/design.md, "The time table is data").
The SPMD programs read their per-tick work from a table, and the staleness
matrix, the schedule pictures, busy fractions, the activation-memory model (in
stage-activations and in bytes) and the communication profile all derive from
it. Pure Python and numpy: no JAX here, so `cdpjax schedule` is instant.

This module is the table itself, the same for every layout. The table functions
live with their layouts (`cdpjax.layouts`: `cdp` for dp / cdp-v1 / cdp-v2,
`cdp_mp`, `cdp_zero`, `gpipe`, `ppll`, ...), which also say how a table is drawn.
A table can be written to JSON and read back (`to_json` / `from_json`), so a
schedule can be drawn, checked and run from a file.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import json
from typing import Sequence

import numpy as np

from cdpjax import kinds
from cdpjax.errors import ConfigError
from cdpjax.kinds import KINDS  # the op kinds, one registry

AXES = ("stage", "data")  # what a table's column is (`TimeTable.axis`)


@dataclasses.dataclass(frozen=True, slots=True)
class Op:
    """One op of one device in one tick.

    device: the worker (CDP) or the device holding the stage (pipelines).
    kind: a registered op kind (`cdpjax.kinds`): 'F' forward, 'B' backward (input cotangent only
    where a 'W' follows), 'W' weight gradient, 'FB' forward + local backward + update (ppll).
    step: the training step (ppll: the batch). micro: the micro-batch within the
    step (CDP and cdp-mp: the worker's). version: the absolute parameter version
    read. slot: 'current' or 'previous', which stored version holds it at this tick.
    stale: the op follows the delayed rule (reads theta_{k-1} at step k; at step 0
    theta_0, which is both stored versions then).
    """

    tick: int
    device: int
    stage: int
    kind: str
    step: int
    micro: int = 0
    version: int = 0
    slot: str = "current"
    stale: bool = False

    @property
    def worker(self) -> int:
        return self.device


@dataclasses.dataclass(frozen=True, slots=True)
class Update:
    """Stage `stage`'s update for `step` is applied at the end of `tick`."""

    tick: int
    stage: int
    step: int


@dataclasses.dataclass(frozen=True, slots=True)
class Apply:
    """Worker `worker` applies stage `stage`'s update for `step` to its own copy at the end of
    `tick`. A table whose workers each keep one copy and apply each completed sum in their own
    window (CDP's ring) lists every apply; a table with none has every worker apply each update
    at its `Update`'s tick."""

    tick: int
    worker: int
    stage: int
    step: int


@dataclasses.dataclass(frozen=True, slots=True)
class Message:
    """Gradient or parameter traffic sent at the end of `tick` (src = dst = -1: an all-reduce).

    kind: 'partial' (a running gradient sum, or a worker's piece of its gradient on its way
    to the piece's keeper), 'sum' (a completed sum on its way to a worker that applies it),
    'allreduce' (dp), 'param' (parameters, or a piece of them, sent to a reader).
    parts: the message carries 1/parts of the stage (cdp-zero's pieces: N).
    """

    tick: int
    src: int
    dst: int
    stage: int
    kind: str
    step: int = 0
    parts: int = 1


@dataclasses.dataclass(frozen=True)
class TimeTable:
    """The laid-out schedule of `steps` training steps of the layout `method`.

    workers: CDP workers N (pipelines: 1). devices: columns of the grid (CDP: N,
    pipelines: the stage devices). period: ticks per training step in steady state.
    offsets: each worker's starting tick (CDP). microbatches: per step. steady: a
    [start, stop) tick window of steady state, over which the busy, activation and
    comm figures are taken. meta: layout-specific facts for the grid and records (JSON-able:
    the rule's name, owners, cdp-zero's shards...; no engine reads them). notes: lines the text
    grid prints under the table. applies: where each update reaches each worker's copy (`Apply`;
    empty: at the update's tick, everywhere). What a read takes is each op's `version`. axis: what
    a column is, 'stage' (a device the stages placed on it run on) or 'data' (a worker holding
    every stage, its own copy: the ring's tables).
    """

    method: str
    workers: int
    stages: int
    steps: int
    num_ticks: int
    devices: int
    period: int
    ops: tuple[Op, ...]
    updates: tuple[Update, ...]
    messages: tuple[Message, ...] = ()
    offsets: tuple[int, ...] = ()
    microbatches: int = 1
    steady: tuple[int, int] = (0, 0)
    meta: dict = dataclasses.field(default_factory=dict, compare=False)
    notes: tuple[str, ...] = ()
    applies: tuple[Apply, ...] = ()
    axis: str = "stage"

    def __post_init__(self):
        if self.axis not in AXES:
            raise ConfigError(f"TimeTable.axis={self.axis!r} is not one of {', '.join(AXES)}")

    @functools.cached_property
    def split_backward(self) -> bool:
        """Whether the table splits its backwards into B (input cotangent) and W (weight gradient)."""
        return kinds.split(op.kind for op in self.ops)

    @property
    def layout(self):
        """The registered `Layout` of `method`, or a plain one for a table of an unknown layout."""
        from cdpjax.layouts import LAYOUTS, Layout  # late: the layouts import this module

        return LAYOUTS[self.method] if self.method in LAYOUTS else Layout(self.method, builder="")

    # ----------------------------------------------------------------- staleness

    @functools.cached_property
    def stale(self) -> np.ndarray:
        """[workers, stages] bool: worker i's forward of stage j reads the previous version.
        The worker of an op is its `micro` (CDP tables: the device; cdp-mp: the worker whose
        micro-batch it is); a layout whose ops are never stale gives all False."""
        out = np.zeros((self.workers, self.stages), bool)
        if not any(op.stale for op in self.ops):
            return out
        seen = {}
        for op in self.ops:
            if KINDS[op.kind].forward:
                key = (op.micro, op.stage)
                if seen.setdefault(key, op.stale) != op.stale:
                    raise AssertionError(f"{self.method}: worker/stage {key} changes rule between steps")
                out[key] = op.stale
        return out

    # ---------------------------------------------------------------------- grid

    def label(self, op: Op) -> str:
        """Cell text, as the layout words it (CDP 'F<stage>'; gpipe 'F<micro-batch>'...)."""
        return self.layout.cell(op)

    def grid(self) -> np.ndarray:
        """[ticks, devices] array of cell strings ('.' when idle; several ops of one device in
        one tick, as ppll's modules grouped on a device, joined by '+')."""
        g = np.full((self.num_ticks, self.devices), ".", dtype=object)
        for op in self.ops:
            cell = g[op.tick, op.device]
            g[op.tick, op.device] = self.label(op) if cell == "." else f"{cell}+{self.label(op)}"
        return g

    def format_grid(self) -> str:
        return format_grid(self)

    # ----------------------------------------------------------------- busy time

    def busy_fraction(self, window: tuple[int, int] | None = None) -> dict:
        """Busy (stage, tick) slots over all slots ('overall'), busy (device, tick) slots over
        all ('devices': the utilization of the hardware, the figure for layouts that put
        several stages on a device), and per stage and per device.

        Over the steady-state window by default (CDP: one period; gpipe: one step,
        bubble included; ppll: all stages busy); 'whole' is over every tick laid out.
        """
        lo, hi = self.steady if window is None else window
        stage_busy = np.zeros((self.num_ticks, self.stages), bool)
        device_busy = np.zeros((self.num_ticks, self.devices), bool)
        for op in self.ops:
            stage_busy[op.tick, op.stage] = True
            device_busy[op.tick, op.device] = True
        s, d = stage_busy[lo:hi], device_busy[lo:hi]
        return {
            "overall": float(s.mean()) if s.size else 0.0,
            "devices": float(d.mean()) if d.size else 0.0,
            "per_stage": [float(x) for x in s.mean(0)] if s.size else [],
            "per_device": [float(x) for x in d.mean(0)] if d.size else [],
            "whole": float(stage_busy.mean()),
        }

    def lockstep_busy_fraction(self, costs=None) -> float:
        """The devices' busy share of the steady state run in lockstep, each tick as long as its
        slowest device's ops (`cdpjax.speedup.lockstep_busy_fraction`; costs: a backward = two
        forwards unless measured ones are given)."""
        from cdpjax.speedup import lockstep_busy_fraction

        return lockstep_busy_fraction(self, costs)

    # -------------------------------------------------------- activation memory

    def activation_per_worker(self) -> np.ndarray:
        """[ticks, devices] stage-activations held (CDP: p+1 at forward phase p, 2L-1-p
        at backward phase p, 0 idle). A stage-activation is held from its forward's
        tick until before the tick of the last backward op of that stage and micro-batch
        (its B, or its W where the backward is split: the residuals and the cotangent wait
        for it); a ppll op, forward and backward at once, holds one during its tick."""
        return _held(self, np.ones(self.stages)).astype(np.int64)

    def activation_total(self) -> np.ndarray:
        """[ticks] stage-activations held over all devices."""
        return self.activation_per_worker().sum(1)

    def activation_bytes(self, stage_bytes: Sequence[float]) -> np.ndarray:
        """[ticks, devices] bytes held: each held stage-activation counted at its stage's
        real output bytes (`stage_bytes[j]`, one micro-batch of stage j's output)."""
        return _held(self, _check_stage_bytes(stage_bytes, self.stages))

    def activation_stats(self, stage_bytes: Sequence[float] | None = None) -> dict:
        """Peak and mean over the steady-state window: in stage-activations (`total_*`, over
        all devices; `worker_*`, of one device), and with `stage_bytes` in bytes: `*_bytes`
        over all devices, and per device the largest peak (`device_peak_bytes`), the mean of
        the devices' peaks (`device_peak_bytes_mean`) and the mean held (`device_mean_bytes`)."""
        lo, hi = self.steady
        per = self.activation_per_worker()[lo:hi]
        total = per.sum(1)
        out = {
            "total_peak": int(total.max()) if total.size else 0,
            "total_mean": float(total.mean()) if total.size else 0.0,
            "worker_peak": int(per.max()) if per.size else 0,
            "worker_mean": float(per.mean()) if per.size else 0.0,
        }
        if stage_bytes is not None:
            held = self.activation_bytes(stage_bytes)[lo:hi]
            tot = held.sum(1)
            out.update({
                "total_peak_bytes": float(tot.max()) if tot.size else 0.0,
                "total_mean_bytes": float(tot.mean()) if tot.size else 0.0,
                "device_peak_bytes": float(held.max()) if held.size else 0.0,
                "device_peak_bytes_mean": float(held.max(0).mean()) if held.size else 0.0,
                "device_mean_bytes": float(held.mean()) if held.size else 0.0,
            })
        return out

    # ------------------------------------------------------------ communication

    def bytes_per_tick(self, stage_bytes: Sequence[float]) -> np.ndarray:
        """[ticks] bytes sent: one stage's bytes (or its `parts`-th) per point-to-point message;
        2(N-1) x the stage's bytes for an 'allreduce' (a ring all-reduce's traffic over all workers)."""
        stage_bytes = _check_stage_bytes(stage_bytes, self.stages)
        out = np.zeros(self.num_ticks)
        for m in self.messages:
            scale = 2 * (self.workers - 1) if m.kind == "allreduce" else 1
            out[m.tick] += scale * stage_bytes[m.stage] / m.parts
        return out

    def comm_balance(self, stage_bytes: Sequence[float]) -> float:
        """Busiest tick's bytes over the mean bytes per tick, in steady state (1 = flat;
        dp = 2L, one burst per step); 0 when nothing is sent."""
        lo, hi = self.steady
        b = self.bytes_per_tick(stage_bytes)[lo:hi]
        return float(b.max() / b.mean()) if b.size and b.mean() > 0 else 0.0

    def sends_per_tick(self) -> np.ndarray:
        """[ticks, devices] point-to-point messages each device sends at the end of each tick."""
        out = np.zeros((self.num_ticks, max(self.devices, 1)), np.int64)
        for m in self.messages:
            if m.src >= 0:
                out[m.tick, m.src] += 1
        return out

    # --------------------------------------------------------------------- json

    def to_json(self, stage_bytes: Sequence[float] | None = None) -> dict:
        """The whole table as JSON-able data (`from_json` reads it back), with its derived
        figures (stale, busy fraction, activation, the text grid; with `stage_bytes`, the
        bytes per tick and the comm balance)."""
        d = {
            "method": self.method,
            "workers": self.workers,
            "stages": self.stages,
            "steps": self.steps,
            "num_ticks": self.num_ticks,
            "devices": self.devices,
            "period": self.period,
            "offsets": list(self.offsets),
            "microbatches": self.microbatches,
            "axis": self.axis,
            "steady": list(self.steady),
            "meta": self.meta,
            "notes": list(self.notes),
            "stale": [[bool(x) for x in row] for row in self.stale],
            "busy_fraction": self.busy_fraction(),
            "busy_fraction_lockstep": self.lockstep_busy_fraction(),
            "activation": self.activation_stats(stage_bytes),
            "ticks": [list(row) for row in self.grid().tolist()],
            "ops": [dataclasses.asdict(op) for op in self.ops],
            "updates": [dataclasses.asdict(u) for u in self.updates],
            "messages": [dataclasses.asdict(m) for m in self.messages],
            "applies": [dataclasses.asdict(a) for a in self.applies],
        }
        d.update(d.pop("meta"))  # layout facts at the top level, as `cdpjax schedule --json` shows them
        d["meta_keys"] = sorted(self.meta)
        if stage_bytes is not None:
            d["bytes_per_tick"] = [float(x) for x in self.bytes_per_tick(stage_bytes)]
            d["comm_balance"] = self.comm_balance(stage_bytes)
        return d

    def dumps(self, stage_bytes: Sequence[float] | None = None) -> str:
        return json.dumps(self.to_json(stage_bytes))

    @classmethod
    def from_json(cls, data: dict | str | bytes) -> "TimeTable":
        """The table `to_json` wrote (a dict, or its JSON text); derived figures are recomputed.

        The data is checked against what `to_json` writes, field by field, with the sizes
        bounded (`cdpjax.table_json`): anything else is a ConfigError naming the first field
        that is wrong, before any table is built."""
        from cdpjax.table_json import table_fields  # late: it reads this module's record types

        return cls(**table_fields(data))


def table(method: str, **sizes) -> TimeTable:
    """Any registered layout's table by name, sizes as keywords (see `cdpjax.layouts`)."""
    from cdpjax.layouts import LAYOUTS

    return LAYOUTS.lookup(method).make_table(**sizes)


def from_orders(method: str, orders: Sequence[Sequence[tuple]], stages: int, microbatches: int,
                steps: int = 1, device_of: Sequence[int] | None = None) -> TimeTable:
    """A flushed pipeline's table from each device's ordered list of actions, as
    `torch.distributed.pipelining` writes a schedule: `orders[d]` lists device d's
    (kind, stage, micro-batch) in the order it runs them, of registered kinds (`cdpjax.kinds`):
    'F' and 'B', and 'W' where the schedule splits the backward (then B is the input
    cotangent only, and W the weight gradient). An entry may instead be a tuple of actions
    that the device runs together in one tick (an overlapped cell: dualpipev's forward of one
    micro-batch beside the backward of another; a whole backward as its B and W), in the
    order given.

    Each entry takes one tick and starts at the first tick at which its device is
    free and the inputs of its actions exist, the ops their kinds' `after` rules name (an op
    earlier in the same entry counts as done): a forward of stage j > 0 after the forward of
    stage j-1 of the same micro-batch, a backward after the backward of stage j+1 (the last
    stage: after its own forward), a W after its own B; a device never reorders its list.
    Every stage and micro-batch must have one op of each kind the lists use, and of each kind
    those depend on. Every stage updates at the end of the step's last tick (the flush), and
    step k repeats step 0 shifted by k spans. `device_of[j]` is stage j's device (default: device j).
    """
    positive(stages=stages, microbatches=microbatches, steps=steps)
    device_of = list(range(stages)) if device_of is None else list(device_of)
    orders = [[_entry(a) for a in order] for order in orders]
    _check_orders(method, [[a for entry in order for a in entry] for order in orders], stages, microbatches, device_of)
    done: dict[tuple[str, int, int], int] = {}  # action -> its tick
    position = [0] * len(orders)
    free = [0] * len(orders)
    total = sum(len(o) for o in orders)
    entries = 0

    def waits_for(entry):
        """The first action an entry's ops wait for that is not done, or None."""
        inside = set()
        for kind, j, m in entry:
            need = KINDS[kind].after(j, stages)
            if need is not None and (*need, m) not in done and (*need, m) not in inside:
                return (*need, m)
            inside.add((kind, j, m))
        return None

    while entries < total:
        progressed = False
        for d, order in enumerate(orders):
            if position[d] == len(order):
                continue
            entry = order[position[d]]
            if waits_for(entry) is not None:
                continue
            ready = max([done[(*need, m)] + 1 for kind, j, m in entry
                         if (need := KINDS[kind].after(j, stages)) is not None and (*need, m) in done], default=0)
            tick = max(free[d], ready)
            done.update({action: tick for action in entry})
            free[d] = tick + 1
            position[d] += 1
            entries += 1
            progressed = True
        if not progressed:
            shown = lambda entry: entry[0] if len(entry) == 1 else entry  # noqa: E731
            stuck = "; ".join(f"device {d}'s {shown(order[position[d]])} waits for {waits_for(order[position[d]])}"
                              for d, order in enumerate(orders) if position[d] < len(order))
            raise ConfigError(f"{method}: the device orders deadlock ({stuck})")
    span = max(done.values()) + 1
    ops, updates = [], []
    for k in range(steps):
        for (kind, j, m), tick in done.items():
            ops.append(Op(span * k + tick, device_of[j], j, kind, k, m, version=k))
        updates += [Update(span * k + span - 1, j, k) for j in range(stages)]
    ops.sort(key=lambda o: (o.tick, o.device))
    return TimeTable(method, 1, stages, steps, span * steps, max(device_of) + 1, span, tuple(ops), tuple(updates),
                     microbatches=microbatches, steady=(0, span))


def _entry(entry) -> tuple[tuple[str, int, int], ...]:
    """An order's entry as the actions of its tick: one (kind, stage, micro-batch), or several."""
    entry = tuple(entry)
    return (entry,) if entry and isinstance(entry[0], str) else tuple(tuple(a) for a in entry)


def _check_orders(method, orders, stages, microbatches, device_of) -> None:
    """Refuses orders that are not each stage's ops of each micro-batch once, on its device: a
    ConfigError naming an unknown kind, a stage on the wrong device, what is missing, what is
    there twice and what no stage or micro-batch has."""
    given = [tuple(a) for order in orders for a in order]
    for name in sorted({k for k, _, _ in given}):
        if name not in KINDS:
            raise ConfigError(f"{method}: unknown op kind {name!r} in the device orders; registered: "
                              f"{', '.join(KINDS)}")
    for d, order in enumerate(orders):
        for kind, j, m in order:
            if not (0 <= j < stages and 0 <= m < microbatches):
                raise ConfigError(f"{method}: device {d}'s action {(kind, j, m)} is outside stages 0..{stages - 1} "
                                  f"and micro-batches 0..{microbatches - 1}")
            if device_of[j] != d:
                raise ConfigError(f"{method}: device {d}'s list holds stage {j}, which lives on device {device_of[j]}")
    required = kinds.requires({k for k, _, _ in given}, stages)
    need = [k for k in KINDS if k in required]  # in the registry's order: F, B, W
    expected = {(k, j, m) for k in need for j in range(stages) for m in range(microbatches)}
    twice = sorted(a for a, n in collections.Counter(given).items() if n > 1)[:3]
    missing, extra = sorted(expected - set(given))[:3], sorted(set(given) - expected)[:3]
    if missing or twice or extra:
        wrong = "; ".join(f"{what} e.g. {which}" for what, which in
                          (("missing", missing), ("twice", twice), ("not expected", extra)) if which)
        raise ConfigError(f"{method}: the device orders must run each stage's {', '.join(need)} of each of the "
                          f"{microbatches} micro-batches once ({wrong})")


def positive(**values) -> None:
    """Refuses any of `values` that is not a positive integer (a ConfigError naming it)."""
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ConfigError(f"{name}={v!r} must be a positive integer")


# ======================================================================= helpers


def _held(t: TimeTable, weight: np.ndarray) -> np.ndarray:
    """[ticks, devices] sum of `weight[stage]` over the stage-activations each device holds
    (`TimeTable.activation_per_worker`: from a forward until the last backward op of its stage
    and micro-batch; an op of a kind that is both, during its tick)."""
    out = np.zeros((t.num_ticks, t.devices), float)
    forward, last_backward = {}, {}
    for op in t.ops:
        key = (op.device, op.stage, op.step, op.micro)
        kind = KINDS[op.kind]
        if kind.forward and kind.backward:
            out[op.tick, op.device] += weight[op.stage]
        elif kind.forward:
            forward[key] = op.tick
        elif kind.backward:
            last_backward[key] = max(last_backward.get(key, op.tick), op.tick)
    for key, f in forward.items():
        b = last_backward.get(key, t.num_ticks)
        out[f:b, key[0]] += weight[key[1]]
    return out


def _check_stage_bytes(stage_bytes, stages):
    b = np.asarray(stage_bytes, float).reshape(-1)
    if b.size == 1:
        b = np.full(stages, float(b[0]))
    if b.size != stages:
        raise ConfigError(f"stage_bytes has {b.size} entries; the table has {stages} stages")
    return b


# message kind -> (its letter in the text grid, what one is)
_SENT = {"param": ("p", "parameter messages"), "partial": ("g", "partial gradient sums or pieces"),
         "sum": ("s", "completed sums")}


def _sent_cells(t: TimeTable) -> list[list[str]]:
    """[device][tick] the point-to-point messages the device sends at the end of the tick, by kind
    ('3p1g'); [] for a table without any."""
    counts = collections.Counter((m.src, m.tick, m.kind) for m in t.messages
                                 if m.src >= 0 and m.kind in _SENT and 0 <= m.tick < t.num_ticks)
    if not counts:
        return []
    return [["".join(f"{counts[(d, tick, k)]}{letter}" for k, (letter, _) in _SENT.items() if counts[(d, tick, k)])
             or "." for tick in range(t.num_ticks)] for d in range(t.devices)]


def format_grid(t: TimeTable) -> str:
    """The table as text: one row per device, one column per tick; '*' marks an op on
    the delayed rule, the last row shows which stages update at the end of each tick."""
    layout = t.layout
    g = t.grid()
    stale = {(o.tick, o.device) for o in t.ops if o.stale}
    cells = [[g[tick, d] + ("*" if (tick, d) in stale else "") for tick in range(t.num_ticks)]
             for d in range(t.devices)]
    updated = [[] for _ in range(t.num_ticks)]
    for u in t.updates:
        updated[u.tick].append(u.stage)
    upd = ["all" if len(s) == t.stages > 1 else ",".join(map(str, s)) for s in updated]
    sent = _sent_cells(t)
    width = max(3, max((len(c) for row in cells + sent for c in row), default=1)) + 1
    who = "w" if layout.columns == "worker" else "d"
    fields = {f.name: getattr(t, f.name) for f in dataclasses.fields(t) if f.name not in ("ops", "updates", "messages")}
    fields = {k: list(v) if isinstance(v, tuple) else v for k, v in {**fields, **t.meta}.items()}
    head = layout.title.format(**fields)
    head += f" ({t.steps} steps laid out)" if "steps" not in layout.title else ""
    legend = layout.legend + ("; *: reads the previous version (delayed)" if stale else "")
    lines = [head, legend, "tick".ljust(6) + "".join(str(i).rjust(width) for i in range(t.num_ticks))]
    for d, row in enumerate(cells):
        lines.append(f"{who}{d}".ljust(6) + "".join(c.rjust(width) for c in row))
    if t.updates and len(t.updates) != len(t.ops):  # every op updating (ppll) would repeat the grid
        lines.append("upd".ljust(6) + "".join(c.rjust(width) for c in upd))
    if sent:
        kinds = ", ".join(f"{letter}: {what}" for letter, what in _SENT.values()
                          if any(letter in c for row in sent for c in row))
        lines.append(f"sent at the end of each tick, point to point ({kinds}; 3{kinds[0]}: three):")
        for d, row in enumerate(sent):
            lines.append(f"{who}{d}>".ljust(6) + "".join(c.rjust(width) for c in row))
    bf = t.busy_fraction()
    lines.append(f"busy fraction (steady state): {bf['overall']:.3f} of stage slots, {bf['devices']:.3f} of device "
                 f"time; over all ticks: {bf['whole']:.3f}; in lockstep (each tick as long as its slowest "
                 f"device's op, a backward = 2 forwards): {t.lockstep_busy_fraction():.3f} of device time")
    lo, hi = t.steady
    held = t.activation_per_worker()[lo:hi]
    if held.size and any(not (KINDS[o.kind].forward and KINDS[o.kind].backward) for o in t.ops):  # not ppll's
        lines.append(f"activation slots (stage-activations held, steady-state peak) per "
                     f"{'worker' if who == 'w' else 'device'}: {' '.join(str(int(x)) for x in held.max(0))}")
    if stale or t.meta.get("rule"):
        lines.append(f"stale (worker, stage) pairs: {int(t.stale.sum())} of {t.stale.size}")
    lines.extend(t.notes)
    return "\n".join(lines)


__all__ = ["Apply", "KINDS", "Message", "Op", "TimeTable", "Update", "format_grid", "from_orders", "positive", "table"]
