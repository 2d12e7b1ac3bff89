"""A multilayer perceptron as blocks: the embedded digits default and the smallest test model."""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from cdpjax.models import norms


class DenseBlock(nn.Module):
    features: int
    norm: str = "none"
    bn_axis_name: str | None = None
    dtype: Any = None  # computation dtype; parameters stay float32

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = x.reshape(x.shape[0], -1)
        x = nn.Dense(self.features, dtype=self.dtype)(x)
        x = norms.make(self.norm, self.bn_axis_name, train, dtype=self.dtype)(x)
        return nn.relu(x)


class Classifier(nn.Module):
    """A linear classifier; its logits are float32 whatever it computes in (the loss's precision)."""

    num_classes: int
    dtype: Any = None

    @nn.compact
    def __call__(self, x, train: bool = False):
        if x.ndim > 2:
            x = jnp.mean(x, axis=tuple(range(1, x.ndim - 1)))
        return nn.Dense(self.num_classes, dtype=self.dtype)(x).astype(jnp.float32)


def mlp(num_classes: int, input_shape, norm: str = "none", bn_axis_name=None, width: int = 128, depth: int = 3,
        dtype=None):
    """`depth` hidden dense blocks of `width`, then a linear classifier block; `dtype`: what they compute in."""
    del input_shape
    return [DenseBlock(width, norm, bn_axis_name, dtype) for _ in range(depth)] + [Classifier(num_classes, dtype)]
