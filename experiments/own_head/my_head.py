"""An auxiliary head and a local loss of one's own, registered next to the config that uses them.

`aux_heads.register(name, loss=...)` adds a head kind, as `models.register` adds a model:
the factory is called once per local module j < K-1 with its `HeadContext` (`ctx`: the
module's index, its output shape `ctx.feature_shape`, `ctx.num_classes`, the network and
the module groups) and the kind's options from `config.aux_kwargs` (its keyword
arguments: here `hidden` and `smoothing`); it returns a Flax module called as
`module(features, train)`. The loss maps the head's outputs, the labels and the input
images to (loss, accuracy). Importing this module registers "smooth_mlp"
(`config.aux_head = "smooth_mlp"`).
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax.numpy as jnp
import optax

from cdpjax.errors import ConfigError
from cdpjax.models import aux_heads


class PooledMLP(nn.Module):
    """Average over every axis between the batch and the features, one hidden layer, the logits."""

    hidden: int
    num_classes: int

    @nn.compact
    def __call__(self, y, train: bool = False):
        if y.ndim > 2:
            y = y.mean(axis=tuple(range(1, y.ndim - 1)))
        return nn.Dense(self.num_classes)(nn.relu(nn.Dense(self.hidden)(y)))


def smoothed_cross_entropy(logits, labels, images=None, *, smoothing: float):
    """Cross-entropy against labels smoothed towards the uniform distribution, and the accuracy."""
    del images  # this loss does not read the image
    one_hot = (labels[:, None] == jnp.arange(logits.shape[-1])[None, :]).astype(jnp.float32)
    targets = optax.smooth_labels(one_hot, smoothing)
    loss = optax.softmax_cross_entropy(logits, targets).mean()
    return loss, (jnp.argmax(logits, -1) == labels).mean()


@aux_heads.register("smooth_mlp")
def smooth_mlp(ctx: aux_heads.HeadContext, *, hidden: int = 32, smoothing: float = 0.1):
    if not 0 <= smoothing < 1:
        raise ConfigError(f"aux_kwargs.smoothing={smoothing!r} must be in [0, 1)")
    # A module's own loss, with its option bound (a registry entry's `loss` serves every module alike).
    return aux_heads.Head(PooledMLP(int(hidden), ctx.num_classes),
                          loss=functools.partial(smoothed_cross_entropy, smoothing=float(smoothing)))
