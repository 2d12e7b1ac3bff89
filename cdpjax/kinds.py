"""Op kinds: what one op of a time table is, as data (pure Python, no JAX).

Every op of a `cdpjax.timetable.TimeTable` has a kind. A kind declares, once, what
every reader of a table needs to know about it:

- its dependency: the op of the same micro-batch that must be done before it can
  start (`after`), which `timetable.from_orders` uses to lay orders out in ticks and
  the speedup models use to replay them;
- its cost in the speedup models (`cost`: a field of `cdpjax.speedup.StageCosts`);
- how diagrams draw it (`shade`) and how the legends word it (`summary`);
- whether it is part of the backward work (`backward`) and whether it computes the
  stage's weight gradient (`weight_gradient`), which decides when a stage's update
  can be applied and how long the stage's kept input or residuals live.

The kinds here:

- `F`: a stage's forward of one micro-batch; its input (or its `jax.vjp`
  residuals) is kept for the backward.
- `B`: the backward of one micro-batch through a stage. In a table without `W`
  ops for that stage it is the whole backward (input cotangent and weight
  gradient). In a table that also has `W` it is the input cotangent only,
  handed to the previous stage at once (the zero-bubble split, Qi et al. 2023).
- `W`: the weight gradient of a stage for one micro-batch, from what its `F`
  and `B` kept (the residuals and the output cotangent); it may run any time
  after its `B`, which is what lets zero-bubble schedules fill the bubble.
- `FB`: local learning's op (ppll): a module's forward, its local loss through
  its auxiliary head, its own backward and update; nothing goes back.

The SPMD runtimes run a kind through one registered piece each
(`cdpjax.methods.pipeline`, `cdpjax.methods.ring`); a kind a runtime has no piece
for is refused when the method is built, naming the kind and the runtime.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

from cdpjax.errors import ConfigError
from cdpjax.registry import Registry


@dataclasses.dataclass(frozen=True)
class OpKind:
    """One kind of op (module docstring).

    Attributes:
      name: the kind as tables spell it ('F', 'B', 'W', 'FB').
      summary: what the op does, for legends and errors.
      after: `(stage, stages) -> (kind, stage)` of the op of the same micro-batch that
        must be done first, or None (the first stage's forward).
      cost: the `StageCosts` field that gives its time per micro-batch.
      split_cost: the field used instead in a table that splits the backward (a `W`
        follows the `B`), or None where the cost does not change.
      backward: part of the backward work (drawn dark).
      weight_gradient: computes the stage's weight gradient where the backward is not
        split; in a split table only `W` does (`gradient_kind`).
      shade: 'forward' | 'backward' | 'weight' | 'local', the diagrams' shading.
    """

    name: str
    summary: str
    after: Callable[[int, int], tuple[str, int] | None]
    cost: str
    split_cost: str | None = None
    backward: bool = False
    weight_gradient: bool = False
    shade: str = "forward"


KINDS: Registry[OpKind] = Registry("op kind")


def register(kind: OpKind) -> OpKind:
    return KINDS.add(kind.name, kind)


register(OpKind("F", "forward of one micro-batch through a stage",
                after=lambda j, L: ("F", j - 1) if j > 0 else None, cost="forward"))
register(OpKind("B", "backward of one micro-batch through a stage (input cotangent only where a W follows)",
                after=lambda j, L: ("B", j + 1) if j + 1 < L else ("F", j), cost="backward",
                split_cost="backward_input", backward=True, weight_gradient=True, shade="backward"))
register(OpKind("W", "weight gradient of a stage for one micro-batch, from its kept residuals and cotangent",
                after=lambda j, L: ("B", j), cost="backward_weight", backward=True, weight_gradient=True,
                shade="weight"))
register(OpKind("FB", "local learning: forward, local loss through the auxiliary head, backward and update",
                after=lambda j, L: ("FB", j - 1) if j > 0 else None, cost="local", backward=True,
                weight_gradient=True, shade="local"))


def lookup(name: str) -> OpKind:
    """The kind `name`; a ConfigError listing the kinds where it is unknown."""
    return KINDS.lookup(name)


def split(kinds: Iterable[str]) -> bool:
    """Whether ops of these kinds split the backward (some `W` among them)."""
    return "W" in set(kinds)


def gradient_kind(split_backward: bool) -> str:
    """The kind whose op completes a stage's weight gradient for a micro-batch."""
    return "W" if split_backward else "B"


def cost_field(name: str, split_backward: bool) -> str:
    """The `StageCosts` field that times an op of kind `name` in a table that does (or does not)
    split its backwards."""
    kind = lookup(name)
    return kind.split_cost if split_backward and kind.split_cost else kind.cost


def refuse_unknown(kinds: Iterable[str], supported: Iterable[str], who: str) -> None:
    """A ConfigError naming the first kind of `kinds` that `who` (a runtime) has no piece for."""
    supported = tuple(supported)
    for name in kinds:
        lookup(name)
        if name not in supported:
            raise ConfigError(f"{who} has no piece for op kind {name!r} ({KINDS[name].summary}); it runs "
                              f"{', '.join(supported)}")


__all__ = ["KINDS", "OpKind", "cost_field", "gradient_kind", "lookup", "refuse_unknown", "register", "split"]
