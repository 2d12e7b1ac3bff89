"""The typed events of a lowered program: what each device does in each tick of one period.

Every lowering (`cdpjax.program.stage_axis`, `.ring`, `.zero`) emits `Program.events`,
one flat tuple of these frozen records, and every reader of a program (the cost model,
bench's bytes and memory, describe, the tests) reads them and nothing engine-specific:

- `Compute`: a device runs an op of a kind (`cdpjax.kinds.OpKind`) on a stage for a
  micro-batch, reading a parameter version (0: the newest it stores, 1: the one before); on
  the ring, a gradient op also says whether it starts its stage's running sum and whether
  it completes it.
- `Send` / `Receive`: a point-to-point message at the end of a tick, from `src` to `dst`:
  what it carries (`MESSAGES`), its size in per-stage units (`Size`: one stage's own
  size, never a padded row) and the codec it crosses in (`cdpjax.compress`; set on a
  lowered program by `compress.with_codecs`). Every `Send` has its `Receive` in the same tick.
- `Apply`: a device applies a completed gradient sum to a stage at the end of a tick, to
  the whole stage (`parts` 1) or to its 1/`parts` piece of it.
- `Gather`: at the start of a tick, a device assembles a stage (version row `row`) from
  the pieces the others sent it at the end of the previous tick.

Each event names the step it belongs to by `lag`: 0 for the step whose batch the call
feeds, 1 for the previous call's, and so on (never negative).
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING, Union

from cdpjax.kinds import KINDS

if TYPE_CHECKING:  # cdpjax.program imports this module
    from cdpjax.program import Size

# What a message carries: a stage's input for the next stage (the image for stage 0), the cotangent
# of that input going back, a running gradient sum, a completed one, a piece of a stage's parameters,
# or the micro-batch's image travelling along with it (heads that reconstruct it).
MESSAGES = ("activation", "cotangent", "partial", "sum", "parameters", "image")


def _check(event, **fields: int) -> None:
    """Refuses a negative count; called where `min` of the fields is negative (a lowering makes
    some 10^5 events: the common case costs one `min`, no keyword dict)."""
    for name, value in fields.items():
        if int(value) < 0:
            raise ValueError(f"{type(event).__name__}.{name}={value} is negative; it counts ticks, devices, "
                             f"stages or calls back (>= 0)")


@dataclasses.dataclass(frozen=True, slots=True)
class Compute:
    """Device `device` runs an op of kind `kind` (a registered `OpKind` name) on `stage` for
    micro-batch `microbatch` of the step `lag` calls back, reading parameter version `version`
    (0: the newest the device stores, 1: the previous, d: d versions before the newest; the
    program stores `Program.versions` of them), in tick `tick`.

    A gradient op of a ring (where a stage's gradient sum hops from worker to worker) names the
    sum it writes: `starts_sum`, it starts the stage's running sum of its step (nothing received
    to add to; else it adds to the 'partial' it received); `completes_sum`, what it writes is the
    completed sum (which `Apply` reads and 'sum' messages carry; else a 'partial' sent on). On
    cdp-zero's ring a gradient op's pieces start their keepers' running sums of its step
    (`starts_sum`; the sums complete at the keepers, never in one op). Both False on any other op
    and engine."""

    tick: int
    device: int
    kind: str
    stage: int
    microbatch: int = 0
    version: int = 0
    lag: int = 0
    starts_sum: bool = False
    completes_sum: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Compute.kind={self.kind!r} is not a registered op kind ({', '.join(KINDS)})")
        if min(self.tick, self.device, self.stage, self.microbatch, self.version, self.lag) < 0:
            _check(self, tick=self.tick, device=self.device, stage=self.stage, microbatch=self.microbatch,
                   version=self.version, lag=self.lag)


@dataclasses.dataclass(frozen=True, slots=True)
class _Message:
    tick: int
    what: str
    size: Size
    src: int
    dst: int
    stage: int
    lag: int = 0
    codec: str = "none"

    def __post_init__(self):
        if self.what not in MESSAGES:
            raise ValueError(f"{type(self).__name__}.what={self.what!r} is not one of {', '.join(MESSAGES)}")
        if self.src == self.dst:
            raise ValueError(f"{type(self).__name__} from device {self.src} to itself: a copy, not a message")
        if min(self.tick, self.src, self.dst, self.stage, self.lag) < 0:
            _check(self, tick=self.tick, src=self.src, dst=self.dst, stage=self.stage, lag=self.lag)
        if self.codec != "none":  # the registry imports JAX: only a program with codecs reads it
            from cdpjax import compress
            compress.lookup(self.codec, f"{type(self).__name__}.codec")

    def wire_bytes(self, sizes) -> float:
        """The bytes it takes on the wire: its size (`Size.bytes`, float32 values) through its codec
        (`cdpjax.compress`), counted as one array (each further array of a message pads at most one
        block of its codec more)."""
        nbytes = self.size.bytes(sizes)
        if self.codec == "none":
            return nbytes
        from cdpjax import compress
        return float(compress.lookup(self.codec).wire_bytes(-(-int(nbytes) // 4)))


@dataclasses.dataclass(frozen=True, slots=True)
class Send(_Message):
    """Device `src` sends `what` of `stage` (`size`) to `dst` at the end of `tick`, encoded by
    `codec` (a `cdpjax.compress` name; 'none': as it is)."""

    @property
    def device(self) -> int:
        return self.src


@dataclasses.dataclass(frozen=True, slots=True)
class Receive(_Message):
    """Device `dst` receives `what` of `stage` (`size`) from `src` at the end of `tick`."""

    @property
    def device(self) -> int:
        return self.dst


@dataclasses.dataclass(frozen=True, slots=True)
class Apply:
    """Device `device` applies the completed gradient sum of `stage` (the step `lag` calls back)
    to its copy (`parts` 1) or to its 1/`parts` piece of the stage, at the end of `tick`."""

    tick: int
    device: int
    stage: int
    parts: int = 1
    lag: int = 0

    def __post_init__(self):
        if min(self.tick, self.device, self.stage, self.lag) < 0:
            _check(self, tick=self.tick, device=self.device, stage=self.stage, lag=self.lag)

    @property
    def piece(self) -> bool:
        return self.parts > 1


@dataclasses.dataclass(frozen=True, slots=True)
class Gather:
    """Device `device` assembles `stage`'s version row `row` (0 current, 1 previous) from every
    device's 1/`parts` piece at the start of `tick`, for a visit of the step `lag` calls back."""

    tick: int
    device: int
    stage: int
    parts: int
    row: int = 0
    lag: int = 0

    def __post_init__(self):
        _check(self, tick=self.tick, device=self.device, stage=self.stage, row=self.row, lag=self.lag)


Event = Union[Compute, Send, Receive, Apply, Gather]


def messages(sends: list[Send]) -> list[Event]:
    """Each send with its receive (same tick, same message), in that order."""
    out: list[Event] = []
    for s in sends:
        out += [s, Receive(s.tick, s.what, s.size, s.src, s.dst, s.stage, s.lag, s.codec)]
    return out


def sorted_events(events) -> tuple[Event, ...]:
    """Events in tick order (then device, then kind of event: computes, sends, receives, applies,
    gathers), so that two lowerings of one table give equal tuples."""
    order = {Compute: 0, Send: 1, Receive: 2, Apply: 3, Gather: 4}
    place = lambda e: (e.tick, e.device, order[type(e)])  # noqa: E731
    out = []
    for _, same in itertools.groupby(sorted(events, key=place), key=place):  # then by repr: only ties need it
        same = list(same)
        out += sorted(same, key=repr) if len(same) > 1 else same
    return tuple(out)


__all__ = ["Apply", "Compute", "Event", "Gather", "MESSAGES", "Receive", "Send", "messages", "sorted_events"]
