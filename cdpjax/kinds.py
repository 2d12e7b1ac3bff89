"""Op kinds: what one op of a time table is, as data (pure Python, no JAX).

Every op of a `cdpjax.timetable.TimeTable` has a kind. A kind declares, once, what
every reader of a table needs to know about it:

- its dependency: the op of the same micro-batch that must be done before it can
  start (`after`), which `timetable.from_orders` uses to lay orders out in ticks and
  the speedup models use to replay them;
- its cost in the speedup models (`cost`: a field of `cdpjax.speedup.StageCosts`);
- how diagrams draw it (`shade`) and how the legends word it (`summary`);
- whether it runs a forward (`forward`) and whether it is part of the backward work
  (`backward`): an op that only runs the forward keeps its stage-activation (input or
  residuals) until the last backward op of that stage and micro-batch, which is the
  activation-memory model of every table; an op that does both (local learning)
  holds it during its own tick only;
- whether it computes the stage's weight gradient (`weight_gradient`; where a `W`
  follows, `B` does not: `completes_gradient`), which decides when a stage's update
  can be applied;
- whether it computes the cotangent of the stage's input and sends it to the previous
  stage (`cotangent`); a backward op that runs no forward reads the cotangent of its
  stage's output (`reads_cotangent`).

The engines and the lowerings read these flags, never a kind's letters: a new kind is
its registration here and its piece in each engine that runs it.

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
      forward: runs the stage's forward (keeps what the backward needs, unless it is also
        backward work).
      backward: part of the backward work (drawn dark).
      weight_gradient: computes the stage's weight gradient where the backward is not
        split; in a split table only `W` does (`completes_gradient`).
      split_weight_gradient: whether it still computes the weight gradient in a table that
        splits the backward (None: as `weight_gradient`; `B`: False, the `W` after it does).
      shade: 'forward' | 'backward' | 'weight' | 'local', the diagrams' shading.
      cotangent: computes the cotangent of the stage's input, sent to the previous stage.
    """

    name: str
    summary: str
    after: Callable[[int, int], tuple[str, int] | None]
    cost: str
    split_cost: str | None = None
    forward: bool = False
    backward: bool = False
    weight_gradient: bool = False
    split_weight_gradient: bool | None = None
    shade: str = "forward"
    cotangent: bool = False

    def __post_init__(self):
        if self.shade not in SHADES:
            raise ValueError(f"op kind {self.name!r}: shade={self.shade!r} is not one of {', '.join(SHADES)}")

    def completes_gradient(self, split_backward: bool) -> bool:
        """Whether this op completes the stage's weight gradient for its micro-batch in a table
        that does (or does not) split its backwards."""
        if split_backward and self.split_weight_gradient is not None:
            return self.split_weight_gradient
        return self.weight_gradient

    @property
    def reads_cotangent(self) -> bool:
        """Backward work without a forward of its own: it starts from the cotangent of its stage's
        output (the loss, at the last stage) and keeps its stage's input (or residuals) alive until it runs."""
        return self.backward and not self.forward

    @property
    def single_direction(self) -> bool:
        """A forward alone or backward work alone, not both in one op (local learning's op does both):
        what the ring engines have pieces for, a backward reading what its forward stashed."""
        return self.forward != self.backward

    @property
    def splits_backward(self) -> bool:
        """The weight half of a split backward (`W`): backward work that reads the output's
        cotangent but sends none; a table with such ops has backwards (`B`) that send only."""
        return self.reads_cotangent and not self.cotangent


# The diagrams' shades, with what the legends call them (cdpjax.plotting draws them).
SHADES = {"forward": "forward (light)", "backward": "backward (dark)", "weight": "weight gradient (W)",
          "local": "local forward + backward"}


KINDS: Registry[OpKind] = Registry("op kind")


def register(kind: OpKind) -> OpKind:
    return KINDS.add(kind.name, kind)


FORWARD = register(OpKind("F", "forward of one micro-batch through a stage",
                after=lambda j, L: ("F", j - 1) if j > 0 else None, cost="forward", forward=True))
BACKWARD = register(OpKind("B", "backward of one micro-batch through a stage (input cotangent only where a W follows)",
                after=lambda j, L: ("B", j + 1) if j + 1 < L else ("F", j), cost="backward",
                split_cost="backward_input", backward=True, weight_gradient=True, split_weight_gradient=False,
                shade="backward", cotangent=True))
WEIGHT = register(OpKind("W", "weight gradient of a stage for one micro-batch, from its kept residuals and cotangent",
                after=lambda j, L: ("B", j), cost="backward_weight", backward=True, weight_gradient=True,
                shade="weight"))
LOCAL = register(OpKind("FB", "local learning: forward, local loss through the auxiliary head, backward and update",
                after=lambda j, L: ("FB", j - 1) if j > 0 else None, cost="local", forward=True, backward=True,
                weight_gradient=True, shade="local"))


def lookup(name: str) -> OpKind:
    """The kind `name`; a ConfigError listing the kinds where it is unknown."""
    return KINDS.lookup(name)


def split(kinds: Iterable[str]) -> bool:
    """Whether ops of these kinds split the backward: some kind among them is the weight half of
    a backward (`splits_backward`, as `W`)."""
    return any(lookup(name).splits_backward for name in set(kinds))


def gradient_kind(split_backward: bool) -> str:
    """The kind whose op completes a stage's weight gradient for a micro-batch in a backprop
    table ('W' where the backward is split, else 'B'): the first registered kind that is backward
    work, runs no forward and completes the gradient there."""
    for kind in KINDS.values():
        if kind.backward and not kind.forward and kind.completes_gradient(split_backward):
            return kind.name
    raise ConfigError(f"no registered op kind completes the weight gradient (split={split_backward})")


def completes_gradient(name: str, split_backward: bool) -> bool:
    """Whether an op of kind `name` completes its stage's weight gradient (`OpKind.completes_gradient`)."""
    return lookup(name).completes_gradient(split_backward)


def requires(names: Iterable[str], stages: int) -> set[str]:
    """The kinds a table of ops of kinds `names` must hold for every stage and micro-batch: the
    kinds themselves, every kind their `after` rules name (for some stage of `stages`), and the
    gradient kind where none of them completes the weight gradient (a forward-only list)."""

    def closure(todo):
        need = set()
        while todo:
            name = todo.pop()
            if name not in need:
                need.add(name)
                todo += [dep[0] for j in range(stages) if (dep := lookup(name).after(j, stages)) is not None]
        return need

    need = closure(list(names))
    if not any(lookup(n).completes_gradient(split(need)) for n in need):
        need = closure([*need, gradient_kind(split(need))])
    return need


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


__all__ = ["BACKWARD", "FORWARD", "KINDS", "LOCAL", "OpKind", "SHADES", "WEIGHT", "completes_gradient", "cost_field",
           "gradient_kind", "lookup", "refuse_unknown", "register", "requires", "split"]
