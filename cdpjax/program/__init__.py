"""Lowered programs: what the devices of a tick-driven method run, as typed data (no JAX).

Every tick-driven method goes table -> `lower` -> `Program`: a time table
(`cdpjax.timetable`, what runs when and where) becomes the program one SPMD
runtime executes call after call. The program is the contract between the
lowering and everything that reads it: the runtimes (`cdpjax.methods.pipeline`
for `engine='stage'`, `cdpjax.methods.ring` for `engine='ring'`), `bench` (its
memory model and bytes come from `Program.buffers` and the `Send` events with no
knowledge of the method), `cost` (each device's `Compute` and `Apply` events), `train`
and the tests.

- `events`: what each device does in each tick of one *period* (the ticks of one
  call, which feeds one batch), as typed records (`cdpjax.program.events`):
  `Compute`, `Send` / `Receive`, `Apply`, `Gather`, each naming its step by
  `lag >= 0`. Every reader (cost, bench, the tests) reads these and nothing
  engine-specific; `sends` is the `Send` events. The engines execute them too: each
  compiles its own per-tick data from the events and the typed fields below alone
  (`stage_axis.program_ticks`: the arrays the stage engine's scan reads;
  `ring.program_period`: the ring's `RingTicks`; `zero.zero_program_period`:
  cdp-zero's `ZeroTicks`), so the program holds no engine's form of them.
- `buffers`: every buffer a device allocates, what it holds, its size in
  per-stage units (`Size`), whether it lives between calls (part of the train
  state, checkpointed) and, for a call's temporaries, the ticks it is live.
- `versions`: parameter versions each device stores; `lag`: how many calls back
  a period's ops reach (0: nothing in flight between calls); `grads_in_flight`:
  gradient sums that outlive a call.

Sizes are in per-stage units so that a program, which knows no shapes, says what
it holds; `Size.bytes` prices them with a method's per-stage byte counts (`bench`
measures those: parameters, stage inputs, kept residuals...).
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from cdpjax.errors import ConfigError
from cdpjax.program.events import MESSAGES, Apply, Compute, Event, Gather, Receive, Send, sorted_events

ENGINES = ("stage", "ring")
SIZE_KINDS = ("param", "model_state", "head_param", "head_state", "input", "residual", "label", "image", "flag")
# What a backward op starts from: the stage's kept input, the forward rerun under `jax.vjp`
# ('recompute'), or the residuals the forward's `jax.vjp` kept ('carry').
RESIDUALS = ("recompute", "carry")
# What a device keeps of a micro-batch between the ops that read it: its slotted buffers.
STASHES = ("activations", "images", "cotangents", "residuals")
CATEGORIES = ("parameters", "previous_parameters", "optimizer_state", "model_state", "gradients", "activations",
              "cotangents", "residuals", "relayed_parameters", "labels", "images", "flags", "reduced_gradients")


def op_branches(per_worker) -> tuple[tuple, np.ndarray]:
    """A scanned period's op switch as data: `per_worker[t][w]`, a worker's ops of tick t in the
    order it runs them (each with `kind` and `stage`). Returns (kinds, branch): kinds[k], the
    sorted (kind, stage) pairs any worker runs at position k; branch[t, w, k], the index of that
    worker's k-th op in kinds[k], or len(kinds[k]) (the no-op branch) where it has none. Shape
    (ticks, workers, max(positions, 1))."""
    T, N = len(per_worker), len(per_worker[0]) if per_worker else 0
    K = max((len(ops) for row in per_worker for ops in row), default=0)
    kinds = tuple(tuple(sorted({(o.kind, o.stage) for row in per_worker for ops in row for o in ops[k:k + 1]}))
                  for k in range(K))
    branch = np.zeros((T, N, max(K, 1)), np.int32)
    for k in range(K):
        branch[:, :, k] = len(kinds[k])
    branch_of = [{kind: b for b, kind in enumerate(at_k)} for at_k in kinds]
    for t, row in enumerate(per_worker):
        for w, ops in enumerate(row):
            for k, o in enumerate(ops):
                branch[t, w, k] = branch_of[k][(o.kind, o.stage)]
    return kinds, branch


def carries(residuals: str) -> bool:
    """Whether `residuals` keeps the forward's residuals ('carry'); a ConfigError for anything
    but `RESIDUALS`."""
    if residuals not in RESIDUALS:
        raise ConfigError(f"residuals={residuals!r} is not one of {', '.join(RESIDUALS)}")
    return residuals == "carry"


def piece_size(size: int, parts: int) -> int:
    """Elements in each of `parts` equal pieces of `size` elements, the last zero-padded (at least
    one, so that every device's piece has a shape)."""
    return max(-(-int(size) // int(parts)), 1)


@dataclasses.dataclass(frozen=True)
class Size:
    """A size in per-stage units.

    of: the per-stage quantity ('param': a stage's parameters; 'input': a stage's input for
      one micro-batch, the image for stage 0; 'residual': the `jax.vjp` residuals one
      micro-batch keeps at a stage; 'model_state', 'head_param', 'head_state', 'label',
      'image' likewise; 'flag': one boolean).
    groups: the stage groups it can hold; a group's size is the sum over its stages.
    padded: each of `count` items is as large as the largest group (a carrier row, one
      shape whatever it holds); else it holds every group at its own size, `count` times.
    count: how many.
    parts: each item is one of `parts` equal pieces of it (a device's shard of a stage that
      every device keeps a piece of, as ZeRO-3 partitions each parameter over the devices).
    """

    of: str
    groups: tuple[tuple[int, ...], ...]
    padded: bool = False
    count: int = 1
    parts: int = 1

    def __post_init__(self):
        if self.of not in SIZE_KINDS:
            raise ValueError(f"Size.of={self.of!r} is not one of {', '.join(SIZE_KINDS)}")

    @classmethod
    def stage(cls, of: str, stage: int, count: int = 1, parts: int = 1) -> "Size":
        return cls(of, ((int(stage),),), False, count, parts)

    @classmethod
    def stages(cls, of: str, stages, count: int = 1, parts: int = 1) -> "Size":
        """Every stage of `stages` at its own size, `count` times (natural shapes)."""
        return cls(of, tuple((int(j),) for j in stages), False, count, parts)

    def bytes(self, sizes: Mapping[str, Sequence[float]]) -> float:
        """The bytes it takes, `sizes[of][j]` being stage j's bytes."""
        per = [float(sum(sizes[self.of][j] for j in group)) for group in self.groups]
        if not per:
            return 0.0
        return self.count * (max(per) if self.padded else sum(per)) / self.parts


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One buffer every device allocates.

    name: unique within the program. holds: its category (`CATEGORIES`). between_steps: it is
    part of the train state (an argument of the compiled step); else a temporary of one call,
    live over the ticks `live` = (first, last) of the period (None: the whole call).
    """

    name: str
    holds: str
    size: Size
    between_steps: bool
    live: tuple[int, int] | None = None

    def __post_init__(self):
        if self.holds not in CATEGORIES:
            raise ValueError(f"Buffer {self.name!r}: holds={self.holds!r} is not one of {', '.join(CATEGORIES)}")


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the stages live: `units[u]` the stages of unit u (consecutive), `device[u]` its
    device, `chunk[u]` its index among its device's units; `chunks`: units per device. A ring
    program places every stage on every device (`devices` workers, one unit per stage)."""

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

    @property
    def every_worker_holds_every_unit(self) -> bool:
        """The units are placed once for all `devices` workers (a ring's: `device` names worker 0's
        placement, the same on every worker), not spread over the devices."""
        return self.devices > max(self.device, default=0) + 1


@dataclasses.dataclass(frozen=True)
class Program:
    """A lowered table (module docstring).

    method: the layout's name. engine: 'stage' or 'ring'. period: ticks per call. lag: calls
    back its ops reach. devices: devices of the engine's axis. microbatches: per call (per
    data group of the stage engine; per worker of the ring: 1). kinds: op kinds it runs.
    split_backward: its backwards are B + W. residuals: 'recompute' | 'carry'. versions:
    parameter versions stored per stage. grads_in_flight: gradient sums outlive a call.
    """

    method: str
    engine: str
    period: int
    lag: int
    devices: int
    microbatches: int
    kinds: tuple[str, ...]
    split_backward: bool
    residuals: str
    versions: int
    grads_in_flight: bool
    placement: Placement
    buffers: tuple[Buffer, ...]
    events: tuple[Event, ...]

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise ValueError(f"Program.engine={self.engine!r} is not one of {', '.join(ENGINES)}")
        names = [b.name for b in self.buffers]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.method}: buffer names repeat: {sorted(n for n in names if names.count(n) > 1)}")
        late = next((e for e in self.events if not 0 <= e.tick < self.period), None)
        if late is not None:
            raise ValueError(f"{self.method}: event {late} is outside the period's ticks 0..{self.period - 1}")

    @property
    def sends(self) -> tuple[Send, ...]:
        """Every point-to-point message of a period (its `Send` events)."""
        return tuple(e for e in self.events if isinstance(e, Send))

    def device_events(self, device: int) -> tuple[Event, ...]:
        """The events of one device, in tick order (a message: its sender's and its receiver's)."""
        return tuple(e for e in self.events if e.device == device)

    @property
    def carries(self) -> bool:
        """Whether its backward ops read the forward's kept residuals (`residuals='carry'`)."""
        return carries(self.residuals)

    # ----------------------------------------------------------------- messages

    def sent_bytes(self, sizes: Mapping[str, Sequence[float]]) -> np.ndarray:
        """[devices] bytes each device sends per call (per training step), through each message's codec."""
        out = np.zeros(self.devices)
        for s in self.sends:
            out[s.src] += s.wire_bytes(sizes)
        return out

    def sends_per_tick(self) -> np.ndarray:
        """[period, devices] messages each device sends at the end of each tick."""
        out = np.zeros((self.period, self.devices), np.int64)
        for s in self.sends:
            out[s.tick, s.src] += 1
        return out

    def largest_send(self, sizes: Mapping[str, Sequence[float]]) -> float:
        return max((s.wire_bytes(sizes) for s in self.sends), default=0.0)

    # ------------------------------------------------------------------- memory

    def arguments(self, sizes: Mapping[str, Sequence[float]]) -> dict[str, float]:
        """Bytes per device between calls (the train state), by category."""
        out: dict[str, float] = {}
        for b in self.buffers:
            if b.between_steps:
                out[b.holds] = out.get(b.holds, 0.0) + b.size.bytes(sizes)
        return out

    def temporaries(self, sizes: Mapping[str, Sequence[float]]) -> np.ndarray:
        """[period] bytes per device of a call's own buffers live in each tick (what the program
        declares; XLA adds each op's workspace)."""
        out = np.zeros(self.period)
        for b in self.buffers:
            if not b.between_steps:
                first, last = b.live if b.live is not None else (0, self.period - 1)
                out[first:last + 1] += b.size.bytes(sizes)
        return out

    def held(self, holds: str, sizes: Mapping[str, Sequence[float]]) -> np.ndarray:
        """[period + 1] bytes of category `holds` per device at a call's start and after each tick."""
        base = sum(b.size.bytes(sizes) for b in self.buffers if b.holds == holds and b.between_steps)
        out = np.full(self.period + 1, base, float)
        for b in self.buffers:
            if b.holds == holds and not b.between_steps:
                first, last = b.live if b.live is not None else (0, self.period - 1)
                out[first + 1:last + 2] += b.size.bytes(sizes)
        return out

    def summary(self) -> dict:
        """The program's shape as JSON-able data (records, `describe`)."""
        out = {"engine": self.engine, "period": self.period, "lag": self.lag, "devices": self.devices,
               "microbatches": self.microbatches, "kinds": list(self.kinds), "split_backward": self.split_backward,
               "residuals": self.residuals, "versions": self.versions, "grads_in_flight": self.grads_in_flight,
               "sends_per_call": len(self.sends), "buffers": [b.name for b in self.buffers],
               "events": {kind.__name__: sum(isinstance(e, kind) for e in self.events)
                          for kind in (Compute, Send, Receive, Apply, Gather)}}
        slots = self.slots()
        if slots:
            out["slots"] = slots
        return out

    def slots(self) -> dict[str, int]:
        """Slots of each stash: a buffer of data in flight (`STASHES`) laid out as rows of one shape
        whatever micro-batch or unit a row holds (`Size.padded`), counted by its `Size`. The stage
        engine's; the ring and cdp-zero keep each stage's data in its own buffer (none)."""
        return {b.name: b.size.count for b in self.buffers if b.holds in STASHES and b.size.padded}

    def buffer(self, name: str) -> Buffer:
        for b in self.buffers:
            if b.name == name:
                return b
        raise KeyError(f"{self.method}'s program declares no buffer {name!r}")


def lower(table, residuals: str = "recompute", **options) -> Program:
    """The program of `table` for its engine, from the table's own data: the stage-axis engine
    for a table whose columns are devices the stages are placed on (`axis='stage'`); for one whose
    columns are workers each holding every stage (`axis='data'`), cdp-zero's engine where the
    parameters travel in pieces (messages with `parts` > 1), else the ring."""
    if table.axis == "data":
        if any(m.parts > 1 for m in table.messages):
            from cdpjax.program.zero import lower_zero

            return lower_zero(table, residuals=residuals, **options)
        from cdpjax.program.ring import lower_ring

        return lower_ring(table, residuals=residuals, **options)
    from cdpjax.program.stage_axis import lower_stage_axis

    return lower_stage_axis(table, residuals=residuals, **options)


__all__ = ["Apply", "Buffer", "CATEGORIES", "Compute", "ENGINES", "Event", "Gather", "MESSAGES", "Placement",
           "Program", "Receive", "SIZE_KINDS", "STASHES", "Send", "Size", "lower", "sorted_events"]
