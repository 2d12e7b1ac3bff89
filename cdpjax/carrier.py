"""The uniform stage carrier's layouts: stages of different shapes on one `stage` mesh axis.

Every device of the `stage` axis runs the same program, so everything it
holds must have one shape whatever stage it serves. A `FlatLayout` gives each
per-stage pytree (parameters, optimizer state, model state) one row of a
zero-padded `[L, width]` array sharded `P('stage')`, and an `ActLayout` each
activation a zero-padded flat buffer `[B, width]`. The stage-axis engine
(`cdpjax.methods.pipeline`) picks a device's stage with
`lax.switch(lax.axis_index('stage'), branches)`: branch j unravels its row,
runs stage j, and ravels and pads what it returns. Collectives (`ppermute`)
stay outside the switch, on the padded buffers.

Padding stays zero under elementwise optimizers (SGD, momentum, Nesterov,
Adam, coupled or decoupled weight decay): a zero parameter with a zero
gradient gets a zero update. So the optimizer runs on the padded rows
directly (`cdpjax.optim.apply`), outside the switch, with one optax state per
stage (`jax.vmap(tx.init)` of the rows).

On CPU, stages inside `lax.switch` branches and `lax.scan` bodies need
`cdpjax.xla_cpu.use_canonical_cpu_convolutions` (installed by the method
builders): XLA:CPU puts convolutions into its fast layout only at a program's
top level.

The price is storage: every device reserves the largest stage's row and
buffer. `padding()` gives the ratio (padded / real); methods print it at
set-up (`format_report`) and put it in `Method.padding`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree


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


def format_report(report: dict) -> str:
    parts = [f"{k} x{v:.2f}" for k, v in report.items() if isinstance(v, float)]
    return "carrier padding (stored/real): " + ", ".join(parts)


__all__ = ["ActLayout", "FlatLayout", "format_report"]
