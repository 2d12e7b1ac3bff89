"""A multilayer perceptron as blocks: the embedded digits default and the smallest test model."""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from cdpjax.models import norms


class DenseBlock(nn.Module):
    features: int
    norm: str = "none"
    bn_axis_name: str | None = None

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = x.reshape(x.shape[0], -1)
        x = nn.Dense(self.features)(x)
        x = norms.make(self.norm, self.bn_axis_name, train)(x)
        return nn.relu(x)


class Classifier(nn.Module):
    num_classes: int

    @nn.compact
    def __call__(self, x, train: bool = False):
        if x.ndim > 2:
            x = jnp.mean(x, axis=tuple(range(1, x.ndim - 1)))
        return nn.Dense(self.num_classes)(x)


def mlp(num_classes: int, input_shape, norm: str = "none", bn_axis_name=None, width: int = 128, depth: int = 3):
    """`depth` hidden dense blocks of `width`, then a linear classifier block."""
    del input_shape
    return [DenseBlock(width, norm, bn_axis_name) for _ in range(depth)] + [Classifier(num_classes)]
