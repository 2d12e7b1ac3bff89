"""A model of one's own: a small CNN for 8x8 digits, written as any Flax user would.

It is a list of blocks, each a Flax module called as `block(x, train)`; the last
returns the logits. cdpjax cuts the list into stages (`config.stages`), so a
stage is a run of consecutive blocks, and every method (one device, data
parallel, CDP, pipelines) trains it with no other code. Importing this module
registers the factory under the name "my_cnn" (`config.model = "my_cnn"`).
"""
from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn

from cdpjax import models

# He initialisation for the ReLU layers, LeCun for the classifier (plain normal distributions).
he_normal = nn.initializers.variance_scaling(2.0, "fan_in", "normal")
lecun_normal = nn.initializers.variance_scaling(1.0, "fan_in", "normal")


class ConvBlock(nn.Module):
    """3x3 convolution (of stride `stride`), normalisation, ReLU."""

    features: int
    stride: int = 1
    norm: str = "none"
    bn_axis_name: str | None = None  # BatchNorm's statistics are reduced over this mesh axis when set
    dtype: Any = None  # what the block computes in (config.dtype); parameters stay float32

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(self.features, (3, 3), strides=self.stride, padding="SAME", kernel_init=he_normal,
                    dtype=self.dtype)(x)
        if self.norm == "batch":
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name=self.bn_axis_name,
                             dtype=self.dtype)(x)
        elif self.norm == "group":
            x = nn.GroupNorm(num_groups=4, dtype=self.dtype)(x)
        return nn.relu(x)


class Classify(nn.Module):
    """A linear layer on the flattened features: the logits."""

    num_classes: int

    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dense(self.num_classes, kernel_init=lecun_normal)(x.reshape(x.shape[0], -1))


@models.register("my_cnn")
def my_cnn(num_classes: int, input_shape, norm: str = "none", bn_axis_name=None, *,
           widths: Sequence[int] = (16, 32, 32), dtype=None) -> list[nn.Module]:
    """One ConvBlock per entry of `widths` (an option: `config.model_kwargs.widths`), the second
    of stride 2, then the classifier."""
    del input_shape  # the layers take any image size
    strides = [2 if i == 1 else 1 for i in range(len(widths))]
    return [ConvBlock(w, s, norm, bn_axis_name, dtype) for w, s in zip(widths, strides)] + [Classify(num_classes)]
