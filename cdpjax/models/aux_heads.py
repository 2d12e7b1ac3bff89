"""Auxiliary heads: the small networks that give each stage its local loss.

In local learning stage j < L-1 is trained on the loss of its own head, built
from the shape of the stage's output; the last stage has no head and trains on
the network's own classifier. Heads hold no mutable state (no BatchNorm), so a
stage's head is a pure function of its parameters and the stage's output.

Kinds (config `aux_head`, options in `aux_kwargs`):

- `greedy`: global average pool, then one linear layer (for 2-D features: just
  the linear layer).
- `dgl`: DGL's head: a 3x3 conv (`width` channels) and ReLU, adaptive average
  pooling to 2x2, then a 2-layer MLP (`hidden` units). Tokens are averaged and
  2-D features go straight to the MLP.
- `infopro`: InfoPro's conv classifier (a 3x3 conv and ReLU, global pooling, a
  2-layer MLP), plus with `reconstruction=True` a decoder (bilinear upsampling
  to the image size, then a 3x3 conv to the image's channels) whose mean
  squared error to the input image is added with weight lambda_j, linear over
  depth from `recon_start` (first stage) to `recon_end` (last head). The
  reconstruction needs the image at every stage, so pipelines carry it along.
- `vit`: PPLL's ViT head for tokens `[B, T, D]`: `blocks[j]` fresh encoder
  blocks of the network's own shape (PPLL's default 2, 2, 2, 1, 1, 1, then 0),
  then LayerNorm and a linear classifier on the class token (`pool='cls'`) or
  the mean token (`pool='mean'`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from cdpjax.errors import ConfigError
from cdpjax.models.staging import accuracy, cross_entropy
from cdpjax.models.vit import EncoderBlock

PPLL_VIT_BLOCKS = (2, 2, 2, 1, 1, 1)  # then 0 for deeper stages

# aux_kwargs each kind accepts (head_lr_scale is the methods' and accepted by all).
_OPTIONS = {
    "greedy": (),
    "dgl": ("width", "hidden"),
    "infopro": ("width", "hidden", "reconstruction", "recon_start", "recon_end"),
    "vit": ("blocks", "num_heads", "mlp_dim", "pool"),
}
_SHARED_OPTIONS = ("head_lr_scale",)


def _pool(y):
    """Mean over every axis between the batch and the features."""
    return y.mean(axis=tuple(range(1, y.ndim - 1))) if y.ndim > 2 else y


def adaptive_avg_pool(x, size: int = 2):
    """PyTorch's adaptive average pooling of `[B, H, W, C]` to `[B, size, size, C]`."""
    def cuts(n):
        return [(math.floor(i * n / size), math.ceil((i + 1) * n / size)) for i in range(size)]

    rows = [x[:, a:b].mean(axis=1, keepdims=True) for a, b in cuts(x.shape[1])]
    x = jnp.concatenate(rows, axis=1)
    cols = [x[:, :, a:b].mean(axis=2, keepdims=True) for a, b in cuts(x.shape[2])]
    return jnp.concatenate(cols, axis=2)


class GreedyHead(nn.Module):
    num_classes: int

    @nn.compact
    def __call__(self, y, train: bool = False):
        return nn.Dense(self.num_classes)(_pool(y)), None


class MLPClassifier(nn.Module):
    hidden: int
    num_classes: int

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(self.hidden)(x.reshape(x.shape[0], -1)))
        return nn.Dense(self.num_classes)(x)


class DGLHead(nn.Module):
    num_classes: int
    width: int | None = None
    hidden: int = 128

    @nn.compact
    def __call__(self, y, train: bool = False):
        if y.ndim == 4:
            y = nn.relu(nn.Conv(self.width or y.shape[-1], (3, 3))(y))
            y = adaptive_avg_pool(y, 2)
        else:
            y = _pool(y)
        return MLPClassifier(self.hidden, self.num_classes)(y), None


class InfoProHead(nn.Module):
    num_classes: int
    image_shape: tuple[int, ...]
    width: int | None = None
    hidden: int = 128
    reconstruction: bool = False

    @nn.compact
    def __call__(self, y, train: bool = False):
        h = nn.relu(nn.Conv(self.width or 2 * y.shape[-1], (3, 3))(y)) if y.ndim == 4 else y
        logits = MLPClassifier(self.hidden, self.num_classes)(_pool(h))
        if not self.reconstruction:
            return logits, None
        height, width, channels = self.image_shape
        up = jax.image.resize(y, (y.shape[0], height, width, y.shape[-1]), "bilinear")
        return logits, nn.Conv(channels, (3, 3))(up)


class ViTHead(nn.Module):
    num_classes: int
    depth: int
    heads: int
    mlp_dim: int
    pool: str = "cls"

    @nn.compact
    def __call__(self, y, train: bool = False):
        for _ in range(self.depth):
            y = EncoderBlock(self.heads, self.mlp_dim)(y)
        y = nn.LayerNorm(epsilon=1e-6)(y)
        y = y[:, 0] if self.pool == "cls" else y.mean(axis=1)
        return nn.Dense(self.num_classes)(y), None


def _encoder_shape(net, width: int) -> tuple[int, int]:
    """Heads and MLP width of the network's own encoder blocks (else 64-wide heads, MLP 4x)."""
    for block in net.blocks:
        if isinstance(block, EncoderBlock):
            return block.heads, block.mlp_dim
    return max(1, width // 64) if width % 64 == 0 else 1, 4 * width


@dataclasses.dataclass(frozen=True)
class AuxHeads:
    """One head per stage but the last, and the local loss of every stage.

    Attributes:
      kind: the config's `aux_head`.
      modules: per stage, the head (None for the last stage).
      feature_shapes: per stage, one example's output shape.
      image_shape: the network's input shape (for reconstruction).
      recon_weights: per stage, the reconstruction loss weight (0 when none).
    """

    kind: str
    modules: tuple
    feature_shapes: tuple[tuple[int, ...], ...]
    image_shape: tuple[int, ...]
    recon_weights: tuple[float, ...]

    @property
    def num_stages(self) -> int:
        return len(self.modules)

    @property
    def needs_image(self) -> bool:
        """Whether a stage's local loss reads the input image (reconstruction)."""
        return any(w != 0.0 for w in self.recon_weights)

    def init(self, rng) -> list[Any]:
        """Per-stage head parameters (`{}` for the last stage), stage j's from its own key."""
        params = []
        for j, (module, shape) in enumerate(zip(self.modules, self.feature_shapes)):
            if module is None:
                params.append({})
                continue
            y = jnp.zeros((2, *shape), jnp.float32)
            params.append(module.init(jax.random.fold_in(rng, j), y)["params"])
        return params

    def loss(self, j: int, params, features, labels, images=None):
        """Stage j's local loss and accuracy on its output `features`.

        The last stage's features are the network's logits.
        """
        module = self.modules[j]
        if module is None:
            return cross_entropy(features, labels), accuracy(features, labels)
        logits, recon = module.apply({"params": params}, features)
        loss = cross_entropy(logits, labels)
        if recon is not None and self.recon_weights[j]:
            loss = loss + self.recon_weights[j] * jnp.mean((recon - images) ** 2)
        return loss, accuracy(logits, labels)


def check_options(kind: str, kwargs: dict) -> None:
    if kind not in _OPTIONS:
        raise ConfigError(f"aux_head={kind!r} is not one of {', '.join(_OPTIONS)}")
    allowed = _OPTIONS[kind] + _SHARED_OPTIONS
    for key in kwargs:
        if key not in allowed:
            raise ConfigError(f"aux_kwargs.{key} is not an option of the {kind!r} head; "
                              f"accepted: {', '.join(allowed)}")


def build(kind: str, net, num_classes: int, kwargs: dict | None = None) -> AuxHeads:
    """The heads of `kind` for the stages of `net` (a StagedNet), options from `kwargs`."""
    kwargs = dict(kwargs or {})
    check_options(kind, kwargs)
    shapes = tuple(tuple(s[1:]) for s in net.stage_output_shapes(1))
    image_shape = tuple(net.input_shape)
    num_stages = len(shapes)
    reconstruct = bool(kwargs.get("reconstruction", False))
    modules, recon = [], []
    for j, shape in enumerate(shapes):
        if j == num_stages - 1:
            modules.append(None)
            recon.append(0.0)
            continue
        if kind == "greedy":
            module = GreedyHead(num_classes)
        elif kind == "dgl":
            module = DGLHead(num_classes, kwargs.get("width"), int(kwargs.get("hidden", 128)))
        elif kind == "infopro":
            if reconstruct and len(shape) != 3:
                raise ConfigError(f"aux_kwargs.reconstruction=True needs image-like stage outputs [H, W, C]; "
                                  f"stage {j} of {net.name!r} gives {list(shape)}")
            module = InfoProHead(num_classes, image_shape, kwargs.get("width"), int(kwargs.get("hidden", 128)),
                                 reconstruct)
        else:  # vit
            if len(shape) != 2:
                raise ConfigError(f"aux_head='vit' needs token outputs [T, D]; stage {j} of {net.name!r} "
                                  f"gives {list(shape)}: use greedy, dgl or infopro")
            blocks = tuple(kwargs.get("blocks", PPLL_VIT_BLOCKS))
            depth = int(blocks[j]) if j < len(blocks) else 0
            own_heads, own_mlp = _encoder_shape(net, shape[-1])
            heads = int(kwargs.get("num_heads", own_heads))
            if shape[-1] % heads:
                raise ConfigError(f"aux_kwargs.num_heads={heads} does not divide the token width {shape[-1]}")
            pool = kwargs.get("pool", "cls")
            if pool not in ("cls", "mean"):
                raise ConfigError(f"aux_kwargs.pool={pool!r} is not one of cls, mean")
            module = ViTHead(num_classes, depth, heads, int(kwargs.get("mlp_dim", own_mlp)), pool)
        modules.append(module)
        recon.append(_recon_weight(kwargs, j, num_stages) if reconstruct else 0.0)
    return AuxHeads(kind, tuple(modules), shapes, image_shape, tuple(recon))


def _recon_weight(kwargs: dict, j: int, num_stages: int) -> float:
    """lambda_j: linear over the heads 0..L-2 from recon_start to recon_end."""
    start = float(kwargs.get("recon_start", 1.0))
    end = float(kwargs.get("recon_end", 0.0))
    last = max(num_stages - 2, 1)
    return start + (end - start) * j / last


def head_lr_scale(kwargs: dict | None) -> float:
    scale = (kwargs or {}).get("head_lr_scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
        raise ConfigError(f"aux_kwargs.head_lr_scale={scale!r} must be a positive number")
    return float(scale)


__all__ = ["AuxHeads", "PPLL_VIT_BLOCKS", "adaptive_avg_pool", "build", "check_options", "head_lr_scale"]
