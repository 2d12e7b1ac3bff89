"""A network as a sequence of blocks, cut into stages.

Every model in cdpjax is a list of Flax linen blocks, each called as
`block(x, train)`; the last block returns logits. A partition (split points)
groups consecutive blocks into stages. Methods see only `StagedNet`: per-stage
`init` and `apply_stage`, with parameters and mutable state (BatchNorm
statistics) as lists over stages, so that every method's parameters have the
same structure and can be compared leaf by leaf.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

Params = Any  # a pytree
State = dict  # {'batch_stats': ...} or {}


class Chain(nn.Module):
    """Consecutive blocks applied in order: one stage.

    Its output is float32 whatever its blocks compute in (`config.dtype`): a stage boundary is
    where methods store, stash and send activations (the pipelines and the CDP ring in float32
    carriers), so every method hands the same values from stage to stage and computes the same
    function whatever its layout.
    """

    blocks: tuple

    @nn.compact
    def __call__(self, x, train: bool = False):
        for block in self.blocks:
            x = block(x, train)
        return _float32(x)

    def split(self, x, train: bool = False):
        """`(h, y)`: h the output of every block but the last, y the last block's output on
        `stop_gradient(h)`, both float32: the last block learns from y's loss alone, and no gradient of
        it reaches the blocks before (`AuxHeads`' last head)."""
        for block in self.blocks[:-1]:
            x = block(x, train)
        return _float32(x), _float32(self.blocks[-1](jax.lax.stop_gradient(x), train))


def _float32(tree):
    """Floating leaves as float32: what a stage hands on (`Chain`)."""
    return jax.tree.map(lambda y: y.astype(jnp.float32) if jnp.issubdtype(y.dtype, jnp.floating) else y, tree)


@dataclasses.dataclass(frozen=True)
class StagedNet:
    """A model cut into stages.

    Attributes:
      name: the model's registry name.
      blocks: every block of the model, in order.
      bounds: for each stage, the half-open range of block indices it holds.
      input_shape: one example's shape ((H, W, C) images, (T,) token ids).
      num_classes: logits of the last block.
      input_dtype: the dtype the first stage receives ('float32' images, 'int32' token ids): `init`
        and `stage_output_shapes` trace the stages with inputs of this dtype.
    """

    name: str
    blocks: tuple
    bounds: tuple[tuple[int, int], ...]
    input_shape: tuple[int, ...]
    num_classes: int
    input_dtype: str = "float32"

    @property
    def num_stages(self) -> int:
        return len(self.bounds)

    @property
    def stages(self) -> tuple[Chain, ...]:
        return tuple(Chain(blocks=tuple(self.blocks[a:b])) for a, b in self.bounds)

    def init(self, rng, batch_size: int = 2) -> tuple[list[Params], list[State]]:
        """Per-stage parameters and state, each stage initialised from its own key."""
        x = jnp.zeros((batch_size, *self.input_shape), self.input_dtype)
        params, state = [], []
        for j, stage in enumerate(self.stages):
            variables = stage.init(jax.random.fold_in(rng, j), x, train=False)
            variables = dict(variables)
            params.append(variables.pop("params", {}))
            state.append(variables)
            x = stage.apply({"params": params[-1], **variables}, x, train=False)
        return params, state

    def apply_stage(self, j: int, params: Params, state: State, x, train: bool):
        """Stage j's output and its new state (unchanged when not training)."""
        stage = self.stages[j]
        variables = {"params": params, **state}
        if train and state:
            y, new_state = stage.apply(variables, x, train=True, mutable=list(state))
            return y, dict(new_state)
        return stage.apply(variables, x, train=train), state

    def apply_stage_split(self, j: int, params: Params, state: State, x, train: bool):
        """`(h, y, new_state)`: stage j's features before its last block, and its output, the last block
        applied to `stop_gradient(h)` (`Chain.split`); stage j needs two blocks at least."""
        stage = self.stages[j]
        variables = {"params": params, **state}
        if train and state:
            (h, y), new_state = stage.apply(variables, x, train=True, mutable=list(state), method=Chain.split)
            return h, y, dict(new_state)
        h, y = stage.apply(variables, x, train=train, method=Chain.split)
        return h, y, state

    def apply(self, params: Sequence[Params], state: Sequence[State], x, train: bool):
        """Logits and the new per-stage states, running the stages in order."""
        new_state = []
        for j in range(self.num_stages):
            x, s = self.apply_stage(j, params[j], state[j], x, train)
            new_state.append(s)
        return x, new_state

    def stage_output_shapes(self, batch_size: int = 1) -> list[tuple[int, ...]]:
        """Shape of each stage's output (abstract evaluation, nothing computed)."""
        params, state = jax.eval_shape(lambda: self.init(jax.random.key(0), batch_size))
        shapes, x = [], jax.ShapeDtypeStruct((batch_size, *self.input_shape), self.input_dtype)
        for j in range(self.num_stages):
            x = jax.eval_shape(lambda p, s, v, j=j: self.apply_stage(j, p, s, v, False)[0], params[j], state[j], x)
            shapes.append(tuple(x.shape))
        return shapes


def cross_entropy(logits, labels):
    """Mean softmax cross-entropy with integer labels."""
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def accuracy(logits, labels):
    return (jnp.argmax(logits, -1) == labels).mean()
