"""The uniform stage carrier: stages of different shapes on one `stage` mesh axis.

Every device of the `stage` axis runs the same program, so everything it
holds must have one shape whatever stage it serves. The carrier gives each
per-stage pytree (parameters, optimizer state, model state) one row of a
zero-padded `[L, width]` array sharded `P('stage')`, and each activation a
zero-padded flat buffer `[B, width]`. A device picks its stage with
`lax.switch(lax.axis_index('stage'), branches)`: branch j unravels its row,
runs stage j, and ravels and pads what it returns. Collectives (`ppermute`)
stay outside the switch, on the padded buffers.

Padding stays zero under elementwise optimizers (SGD, momentum, Nesterov,
Adam, coupled or decoupled weight decay): a zero parameter with a zero
gradient gets a zero update. So the optimizer runs on the padded rows
directly (`cdpjax.optim.apply`), outside the switch, with one optax state per
stage (`init_opt`).

On CPU, stages inside `lax.switch` branches and `lax.scan` bodies need
`cdpjax.xla_cpu.use_canonical_cpu_convolutions` (installed by
`StageCarrier.from_net`): XLA:CPU puts convolutions into its fast layout only at
a program's top level.

The price is storage: every device reserves the largest stage's row and
buffer. `padding_report` gives the ratios (padded / real); methods print it at
set-up and put it in `Method.padding`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.flatten_util import ravel_pytree
from jax.sharding import PartitionSpec as P

from cdpjax.xla_cpu import use_canonical_cpu_convolutions


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """Per-stage pytrees of different structures as the rows of one `[L, width]` array.

    Attributes:
      sizes: real length of each stage's raveled pytree.
      width: the row length, max(sizes) (at least 1, so that no array is empty).
      unravels: per stage, the flat vector -> pytree map of `ravel_pytree`.
    """

    sizes: tuple[int, ...]
    width: int
    unravels: tuple[Callable, ...] = dataclasses.field(compare=False, repr=False)

    @classmethod
    def from_trees(cls, trees: Sequence[Any]) -> "FlatLayout":
        """The layout of `trees` (one pytree per stage; arrays or ShapeDtypeStructs)."""
        sizes, unravels = [], []
        for tree in trees:
            # Traced abstractly: the unravel map depends only on the structure, shapes and dtypes.
            found = []

            def ravel(t):
                flat, unravel = ravel_pytree(t)
                found.append(unravel)
                return flat

            sizes.append(int(jax.eval_shape(ravel, tree).size))
            unravels.append(found[0])
        return cls(tuple(sizes), max(1, *sizes), tuple(unravels))

    @property
    def num_stages(self) -> int:
        return len(self.sizes)

    def pack_one(self, j: int, tree) -> jax.Array:
        flat, _ = ravel_pytree(tree)
        if flat.size != self.sizes[j]:
            raise ValueError(f"stage {j}: a pytree of {flat.size} elements does not fit its layout of {self.sizes[j]}")
        return jnp.pad(flat, (0, self.width - flat.size))

    def unpack_one(self, j: int, row: jax.Array):
        return self.unravels[j](row[: self.sizes[j]])

    def pack(self, trees: Sequence[Any]) -> jax.Array:
        return jnp.stack([self.pack_one(j, t) for j, t in enumerate(trees)])

    def unpack(self, rows: jax.Array) -> list:
        return [self.unpack_one(j, rows[j]) for j in range(self.num_stages)]

    def padding(self) -> float:
        """Stored / real elements (1.0: no padding; also for a layout with nothing in it)."""
        real = sum(self.sizes)
        return self.num_stages * self.width / real if real else 1.0


@dataclasses.dataclass(frozen=True)
class ActLayout:
    """Activations of different shapes as zero-padded flat buffers `[B, width]`.

    Attributes:
      shapes: one example's shape in each slot.
      width: the buffer's row length, max over slots of prod(shape).
    """

    shapes: tuple[tuple[int, ...], ...]
    width: int

    @classmethod
    def from_shapes(cls, shapes: Sequence[Sequence[int]]) -> "ActLayout":
        shapes = tuple(tuple(int(d) for d in s) for s in shapes)
        return cls(shapes, max(1, *(math.prod(s) for s in shapes)))

    def pack_one(self, j: int, x: jax.Array) -> jax.Array:
        flat = x.reshape(x.shape[0], -1)
        return jnp.pad(flat, ((0, 0), (0, self.width - flat.shape[1])))

    def unpack_one(self, j: int, buf: jax.Array) -> jax.Array:
        shape = self.shapes[j]
        return buf[:, : math.prod(shape)].reshape(buf.shape[0], *shape)

    def padding(self) -> float:
        return len(self.shapes) * self.width / max(sum(math.prod(s) for s in self.shapes), 1)


@dataclasses.dataclass(frozen=True)
class StageCarrier:
    """Layouts for one staged network on the `stage` axis.

    Attributes:
      num_stages: L.
      batch_size: rows of every activation buffer.
      params: the stage bodies' parameters.
      model_state: the stage bodies' mutable state (BatchNorm statistics).
      acts: slot j is stage j's input (slot 0 the image, slot j the output of stage j-1).
      extra: further per-stage layouts by name (e.g. auxiliary heads' parameters).
    """

    num_stages: int
    batch_size: int
    params: FlatLayout
    model_state: FlatLayout
    acts: ActLayout
    extra: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def from_net(cls, net, batch_size: int, extra: dict | None = None) -> "StageCarrier":
        """The carrier of `net` for buffers of `batch_size` examples.

        `extra` maps a name to per-stage pytrees (arrays or shapes) that get a layout too.
        Installs `use_canonical_cpu_convolutions`: the carrier puts stages in switch
        branches, where XLA:CPU would otherwise run gradient convolutions naively.
        """
        use_canonical_cpu_convolutions()
        params, state = jax.eval_shape(lambda: net.init(jax.random.key(0)))
        inputs = [tuple(net.input_shape)] + [s[1:] for s in net.stage_output_shapes(1)[:-1]]
        layouts = {k: FlatLayout.from_trees(v) for k, v in (extra or {}).items()}
        return cls(net.num_stages, int(batch_size), FlatLayout.from_trees(params),
                   FlatLayout.from_trees(state), ActLayout.from_shapes(inputs), layouts)

    # Parameters, model state and activations, in and out of the padded layouts.
    def pack_params(self, params: Sequence[Any]) -> jax.Array:
        return self.params.pack(params)

    def unpack_params(self, rows: jax.Array) -> list:
        return self.params.unpack(rows)

    def pack_state(self, state: Sequence[Any]) -> jax.Array:
        return self.model_state.pack(state)

    def unpack_state(self, rows: jax.Array) -> list:
        return self.model_state.unpack(rows)

    def pack_act(self, j: int, x: jax.Array) -> jax.Array:
        """Stage j's input `[B, *shape]` as a padded buffer `[B, width]`."""
        return self.acts.pack_one(j, x)

    def unpack_act(self, j: int, buf: jax.Array) -> jax.Array:
        return self.acts.unpack_one(j, buf)

    def switch(self, fn_per_stage: Callable, *operands, axes: Sequence[str] = ("stage",)):
        """`fn_per_stage(j, *operands)` for this device's stage j, inside `shard_map`.

        Every branch output is made varying over `axes` (the branches of one
        `lax.switch` must agree). `fn_per_stage` must return fixed-shape
        (padded) values and must not contain collectives.
        """
        from cdpjax.methods.common import varying  # late: the methods package imports this module

        branches = [lambda *ops, j=j: varying(fn_per_stage(j, *ops), axes) for j in range(self.num_stages)]
        return lax.switch(lax.axis_index("stage"), branches, *operands)

    def padding_report(self) -> dict:
        """Padded / real storage: parameters (and their optimizer state), model state, activations."""
        report = {
            "params": self.params.padding(),
            "model_state": self.model_state.padding(),
            "activations": self.acts.padding(),
            "param_sizes": list(self.params.sizes),
            "activation_sizes": [math.prod(s) for s in self.acts.shapes],
        }
        for name, layout in self.extra.items():
            report[name] = layout.padding()
            report[f"{name}_sizes"] = list(layout.sizes)
        return report


def init_opt(tx, rows: jax.Array):
    """One optax state per stage for the padded rows `[L, width]`: every leaf gets a leading L."""
    return jax.vmap(tx.init)(rows)


def stage_specs(tree):
    """`P('stage')` for every leaf: the leading axis of every carried array is the stage
    (replicated over any other mesh axis)."""
    return jax.tree.map(lambda _: P("stage"), tree)


def squeeze(tree):
    """A device's block `[1, ...]` of a `P('stage')` array as its row."""
    return jax.tree.map(lambda a: a[0], tree)


def unsqueeze(tree):
    return jax.tree.map(lambda a: a[None], tree)


def format_report(report: dict) -> str:
    parts = [f"{k} x{v:.2f}" for k, v in report.items() if isinstance(v, float)]
    return "carrier padding (stored/real): " + ", ".join(parts)


__all__ = ["ActLayout", "FlatLayout", "StageCarrier", "format_report", "init_opt", "squeeze", "stage_specs",
           "unsqueeze"]
