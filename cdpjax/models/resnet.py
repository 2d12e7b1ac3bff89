"""ResNets as blocks: [stem, residual blocks..., head].

Every residual block is one block of the list, so a stage cut can fall between
any two residual blocks (the granularity both papers use). Shapes follow the
PyTorch models the papers train:

- `resnet18`, `resnet50`: torchvision layouts (basic / bottleneck blocks, widths
  64..512, stride on the 3x3 convolution), with `stem='cifar'` (3x3 stride-1
  convolution, no max-pool: the CDP code's CIFAR models) or `stem='imagenet'`
  (7x7 stride-2 convolution and 3x3 stride-2 max-pool).
- `resnet32`: the CIFAR ResNet of InfoPro and PPLL (16-channel 3x3 stem, three
  groups of five basic blocks with 16/32/64 channels, projection shortcuts).
- `resnet_tiny`: the same shape at toy size, for tests on 8x8 digits.

Convolutions carry no bias and are initialised kaiming-normal (fan_out), the
classifier like PyTorch's `nn.Linear`. Normalisation is chosen by
`norms.make` (`batch` with optional cross-device statistics, `group`, `none`).
"""
from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from cdpjax.errors import ConfigError
from cdpjax.models import norms, register

conv_init = nn.initializers.variance_scaling(2.0, "fan_out", "normal")
STEMS = ("cifar", "imagenet")
BLOCKS = ("basic", "bottleneck")


def _conv(features: int, kernel: int, stride: int = 1, name: str | None = None, dtype=None):
    # Explicit symmetric padding: flax's 'SAME' pads stride-2 convolutions on one side only.
    pad = (kernel - 1) // 2
    return nn.Conv(features, (kernel, kernel), (stride, stride), padding=((pad, pad), (pad, pad)),
                   use_bias=False, kernel_init=conv_init, name=name, dtype=dtype)


class Stem(nn.Module):
    features: int
    kind: str = "cifar"
    norm: str = "batch"
    bn_axis_name: str | None = None
    dtype: Any = None  # computation dtype (every block here); parameters stay float32

    @nn.compact
    def __call__(self, x, train: bool = False):
        norm = norms.make(self.norm, self.bn_axis_name, train, dtype=self.dtype)
        if self.kind == "imagenet":
            x = _conv(self.features, 7, 2, dtype=self.dtype)(x)
            x = nn.relu(norm(x))
            return nn.max_pool(x, (3, 3), (2, 2), padding=((1, 1), (1, 1)))
        x = _conv(self.features, 3, 1, dtype=self.dtype)(x)
        return nn.relu(norm(x))


class Shortcut(nn.Module):
    """Identity, or a 1x1 projection (with normalisation) where the shape changes."""

    features: int
    stride: int
    norm: str
    bn_axis_name: str | None
    dtype: Any = None

    @nn.compact
    def __call__(self, x, train: bool):
        if self.stride == 1 and x.shape[-1] == self.features:
            return x
        x = _conv(self.features, 1, self.stride, dtype=self.dtype)(x)
        return norms.make(self.norm, self.bn_axis_name, train, dtype=self.dtype)(x)


class BasicBlock(nn.Module):
    features: int
    stride: int = 1
    norm: str = "batch"
    bn_axis_name: str | None = None
    dtype: Any = None

    @nn.compact
    def __call__(self, x, train: bool = False):
        norm = lambda y: norms.make(self.norm, self.bn_axis_name, train, dtype=self.dtype)(y)  # noqa: E731
        y = nn.relu(norm(_conv(self.features, 3, self.stride, dtype=self.dtype)(x)))
        y = norm(_conv(self.features, 3, dtype=self.dtype)(y))
        shortcut = Shortcut(self.features, self.stride, self.norm, self.bn_axis_name, self.dtype)
        return nn.relu(y + shortcut(x, train))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride, as torchvision's v1.5), 1x1 expand by 4."""

    features: int
    stride: int = 1
    norm: str = "batch"
    bn_axis_name: str | None = None
    expansion: int = 4
    dtype: Any = None

    @nn.compact
    def __call__(self, x, train: bool = False):
        norm = lambda y: norms.make(self.norm, self.bn_axis_name, train, dtype=self.dtype)(y)  # noqa: E731
        out = self.features * self.expansion
        y = nn.relu(norm(_conv(self.features, 1, dtype=self.dtype)(x)))
        y = nn.relu(norm(_conv(self.features, 3, self.stride, dtype=self.dtype)(y)))
        y = norm(_conv(out, 1, dtype=self.dtype)(y))
        return nn.relu(y + Shortcut(out, self.stride, self.norm, self.bn_axis_name, self.dtype)(x, train))


def _torch_linear_bias(fan_in: int):
    bound = fan_in ** -0.5
    return lambda key, shape, dtype=jnp.float32: jax.random.uniform(key, shape, dtype, -bound, bound)


class Head(nn.Module):
    """Global average pool and a linear classifier (PyTorch `nn.Linear` initialisation); float32
    logits whatever it computes in."""

    num_classes: int
    dtype: Any = None

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = jnp.mean(x, axis=(1, 2))
        dense = nn.Dense(self.num_classes, kernel_init=nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform"),
                         bias_init=_torch_linear_bias(x.shape[-1]), dtype=self.dtype)
        return dense(x).astype(jnp.float32)


def _check(norm: str, stem: str, block: str) -> None:
    if norm not in ("batch", "group", "none"):
        raise ConfigError(f"norm={norm!r} is not one of batch, group, none")
    if stem not in STEMS:
        raise ConfigError(f"ResNet stem={stem!r} is not one of {', '.join(STEMS)}")
    if block not in BLOCKS:
        raise ConfigError(f"ResNet block={block!r} is not one of {', '.join(BLOCKS)}")


def _scaled(channels: int, width: float) -> int:
    return max(1, int(round(channels * width)))


@register("resnet")
def resnet(num_classes: int, input_shape, norm: str = "batch", bn_axis_name=None, *,
           block: str = "basic", depths: Sequence[int] = (2, 2, 2, 2),
           widths: Sequence[int] = (64, 128, 256, 512), stem: str = "cifar",
           stem_width: int | None = None, width: float = 1.0, dtype=None) -> list[nn.Module]:
    """Any ResNet: `depths[g]` blocks of `widths[g]` channels in group g; groups after
    the first halve the resolution. `width` multiplies every channel count; `dtype` is what
    every block computes in (None: float32)."""
    del input_shape
    _check(norm, stem, block)
    if len(depths) != len(widths) or not depths or min(depths) < 1:
        raise ConfigError(f"ResNet depths={tuple(depths)} and widths={tuple(widths)} must be equally long, "
                          f"with at least one block per group")
    if width <= 0:
        raise ConfigError(f"ResNet width={width!r} must be > 0")
    kind = BasicBlock if block == "basic" else Bottleneck
    blocks: list[nn.Module] = [Stem(_scaled(stem_width or widths[0], width), stem, norm, bn_axis_name, dtype)]
    for g, (depth, features) in enumerate(zip(depths, widths)):
        for i in range(depth):
            stride = 2 if g > 0 and i == 0 else 1
            blocks.append(kind(_scaled(features, width), stride, norm, bn_axis_name, dtype=dtype))
    return blocks + [Head(num_classes, dtype)]


@register("resnet18")
def resnet18(num_classes, input_shape, norm="batch", bn_axis_name=None, *, stem="cifar", width=1.0, dtype=None):
    """10 blocks: stem, 8 basic blocks, head (11.17M parameters with the CIFAR stem, 10 classes)."""
    return resnet(num_classes, input_shape, norm, bn_axis_name, block="basic", depths=(2, 2, 2, 2),
                  stem=stem, width=width, dtype=dtype)


@register("resnet50")
def resnet50(num_classes, input_shape, norm="batch", bn_axis_name=None, *, stem="cifar", width=1.0, dtype=None):
    """18 blocks: stem, 16 bottleneck blocks, head (23.52M parameters with the CIFAR stem, 10 classes)."""
    return resnet(num_classes, input_shape, norm, bn_axis_name, block="bottleneck", depths=(3, 4, 6, 3),
                  stem=stem, width=width, dtype=dtype)


@register("resnet32")
def resnet32(num_classes, input_shape, norm="batch", bn_axis_name=None, *, width=1.0, dtype=None):
    """17 blocks: stem (index 0), groups 1..3 of five basic blocks (indices 1-5, 6-10, 11-15), head (16).
    0.47M parameters (InfoPro's layout, projection shortcuts)."""
    return resnet(num_classes, input_shape, norm, bn_axis_name, block="basic", depths=(5, 5, 5),
                  widths=(16, 32, 64), stem="cifar", width=width, dtype=dtype)


@register("resnet_tiny")
def resnet_tiny(num_classes, input_shape, norm="batch", bn_axis_name=None, *,
                depths=(2, 2), widths=(8, 16), width=1.0, dtype=None):
    """6 blocks by default: stem, two groups of two basic blocks (8 and 16 channels), head."""
    return resnet(num_classes, input_shape, norm, bn_axis_name, block="basic", depths=tuple(depths),
                  widths=tuple(widths), stem="cifar", width=width, dtype=dtype)
