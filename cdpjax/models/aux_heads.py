"""Auxiliary heads: the small networks that give each local module its loss.

In local learning module (stage) j < K-1 is trained on the loss of its own
head, built from the shape of the module's output; the last module has no head
and trains on the network's own cross-entropy. Heads may hold mutable state
(BatchNorm running averages): `init` gives per-stage parameters and state, and
`loss` returns the new state. BatchNorm statistics are those of each call (one
batch, or one data group's slice of it, on one device); the running averages
(PyTorch's momentum 0.1, eps 1e-5) are kept in the state but no training loss
reads them.

Kinds (config `aux_head`, options in `aux_kwargs`; every kind also takes
`head_lr_scale`, read by the methods):

- `greedy`: global average pool, then one linear layer (InfoPro's `0c1f`, the
  "greedy supervised learning" head).
- `dgl`: DGL's `auxillary_classifier2` (`eugenium/DGL`, `auxiliary_nets_study/
  models.py`) with its CIFAR default `--type_aux mlp-sr`: adaptive average pool
  to ceil(H/4) x ceil(W/4); `n_lin` = 3 times (1x1 conv C -> C without bias,
  BatchNorm, ReLU); adaptive average pool to 2x2; `mlp_layers` = 3 times
  (linear 4C -> 4C, BatchNorm, ReLU); linear 4C -> classes. With
  `mlp_layers=0`, as DGL: BatchNorm on the 2x2 map, then one linear layer.
- `infopro`: InfoPro's heads (`blackfeather-wang/InfoPro-Pytorch`, CIFAR code,
  `networks/auxiliary_nets.py`, used by `networks/resnet.py`). The classifier
  `arch` (`0c1f`, `0c2f`, `1c1f`, `1c2f` default, `1c3f`, `2c2f`: convolutions,
  then fully connected layers): 3x3 convolutions without bias (the first one to
  32 / 64 / 64 channels with stride 2 / 2 / 1 for 16 / 32 / 64-channel
  features, times `widen`), BatchNorm, ReLU; global average pooling; linear
  layers of `feature_dim` (128) times `widen` with ReLU; a linear layer to the
  classes; cross-entropy. With `reconstruction=True`, the decoder: features
  resized to the image size (bilinear, corners aligned, as PyTorch's
  `align_corners=True`), 3x3 conv with bias to 12 x `widen` channels,
  BatchNorm, ReLU, 3x3 conv with bias to the image's channels, sigmoid, binary
  cross-entropy against the raw image in [0, 1] (the network's input mapped
  back with `pixel_mean` and `pixel_std`, [0, 1] units per channel, as
  InfoPro's `_image_restore`; `build` defaults to 0 and 1, the input taken as
  the raw image, and `cdpjax.methods.local.setup` fills in the dataset's own). Module j's loss is `ixx_j * reconstruction +
  ixy_j * cross_entropy`, with InfoPro's interpolation over the K-1 heads:
  r_j = j / (K-2) (0 when K = 2), ixx_j = ixx_1 (1 - r_j) + ixx_2 r_j, ixy_j
  likewise from ixy_1 and ixy_2 (defaults: ixy 1 and 1; ixx 1 and 0 with
  reconstruction, 0 without). The reconstruction needs the image at every
  module, so pipelines carry it along.
- `vit`: PPLL's ViT head for tokens `[B, T, D]`: `blocks[j]` fresh encoder
  blocks of the network's own shape (PPLL's default 2, 2, 2, 1, 1, 1, then 0),
  then LayerNorm and a linear classifier on the class token (`pool='cls'`) or
  the mean token (`pool='mean'`).

Where we differ from the reference code, and why:

- InfoPro's `AuxClassifier` exists for 16, 32 and 64 channels only; for other
  widths we extend its table: the first convolution doubles the channels up
  to 64 and never narrows them (`max(C, min(2C, 64))`), with stride 2 below 64
  channels and 1 from 64 on. ResNet-32's heads are InfoPro's exactly.
- Features that are not images (`[B, D]` vectors, `[B, T, D]` tokens) skip the
  convolutions (and for `dgl` the poolings); tokens are averaged first.
- InfoPro's default loss in its commands is supervised contrastive; we give
  its softmax (cross-entropy) variant, the one of its Table 2's "softmax" rows
  and of PPLL. The decoder's BCE is computed from the logits (optax's
  `sigmoid_binary_cross_entropy`): PyTorch's `BCELoss` of the sigmoid equals
  it wherever float32's sigmoid does not saturate to 0 or 1 (there PyTorch
  clamps the log at -100). The decoder is for any image size and channel
  count; InfoPro's is square and RGB.
- A weight pair (ixx_j, ixy_j) = (0, 0) leaves module j without any loss, so it
  never trains; InfoPro's code accepts it (PPLL's command 5, 0.5, 0, 0 gives it
  to the last head for K > 2): `build` refuses it.
- DGL's module also builds a BatchNorm `self.bn` that its forward uses only
  when `mlp_layers=0`: we build it only then (2C fewer parameters otherwise).
- Initialisation follows each reference: InfoPro's convolutions N(0, 2 /
  (k^2 out)) (its model-wide loop), every other weight and bias of the InfoPro
  and DGL heads PyTorch's default U(+-1/sqrt(fan_in)); BatchNorm scale 1, bias
  0. `greedy` and `vit` keep flax's defaults (no reference code fixes them;
  with PyTorch's, `local` with greedy heads on digits reached 95.7% against
  e2e's 98.3%, outside the 2 points `tests/test_accuracy.py` allows).
- MAN's head (a learnable copy of the next module's blocks plus their EMA) is
  not provided: the only public code of it found (`resnetInfoPro_EMAPlus.py`
  in MLAAN's repository) does not run as published (its EMA update reads an
  `Update_Net` it never builds, its K=4 table of copied blocks is not a list
  of blocks), and which blocks are copied differs between it and the paper's
  description. It would also read the next module's weights, a dependency
  across modules that `ppll` could only serve a tick late.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from cdpjax.errors import ConfigError
from cdpjax.models import norms
from cdpjax.models.resnet import _torch_linear_bias, conv_init
from cdpjax.models.staging import accuracy, cross_entropy
from cdpjax.models.vit import EncoderBlock

PPLL_VIT_BLOCKS = (2, 2, 2, 1, 1, 1)  # then 0 for deeper modules
INFOPRO_ARCHS = ("0c1f", "0c2f", "1c1f", "1c2f", "1c3f", "2c2f")

# aux_kwargs each kind accepts (head_lr_scale is the methods' and accepted by all).
_OPTIONS = {
    "greedy": (),
    "dgl": ("n_lin", "mlp_layers"),
    "infopro": ("arch", "widen", "feature_dim", "reconstruction", "ixx_1", "ixy_1", "ixx_2", "ixy_2",
                "pixel_mean", "pixel_std"),
    "vit": ("blocks", "num_heads", "mlp_dim", "pool"),
}
_SHARED_OPTIONS = ("head_lr_scale",)

# PyTorch's default initialisation of Conv2d and Linear weights: U(+-1/sqrt(fan_in)).
torch_default = nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform")


def _pool(y):
    """Mean over every axis between the batch and the features."""
    return y.mean(axis=tuple(range(1, y.ndim - 1))) if y.ndim > 2 else y


def adaptive_avg_pool(x, size):
    """PyTorch's adaptive average pooling of `[B, H, W, C]` to `[B, h, w, C]` (`size`: h or (h, w)):
    output cell i averages rows floor(i H / h) to ceil((i + 1) H / h)."""
    rows, cols = (size, size) if isinstance(size, int) else size

    def cuts(n, m):
        return [(math.floor(i * n / m), math.ceil((i + 1) * n / m)) for i in range(m)]

    x = jnp.concatenate([x[:, a:b].mean(axis=1, keepdims=True) for a, b in cuts(x.shape[1], rows)], axis=1)
    return jnp.concatenate([x[:, :, a:b].mean(axis=2, keepdims=True) for a, b in cuts(x.shape[2], cols)], axis=2)


def resize_align_corners(x, height: int, width: int):
    """Bilinear resize of `[B, H, W, C]` with corners aligned (PyTorch's `align_corners=True`):
    output pixel i samples the input at i (H-1) / (height-1)."""

    def weights(n_in, n_out):  # [n_out, n_in], a constant of the shapes
        pos = np.arange(n_out) * ((n_in - 1) / (n_out - 1)) if n_out > 1 else np.zeros(1)
        lo = np.minimum(np.floor(pos).astype(int), n_in - 1)
        hi = np.minimum(lo + 1, n_in - 1)
        w = np.zeros((n_out, n_in))
        np.add.at(w, (np.arange(n_out), lo), 1 - (pos - lo))
        np.add.at(w, (np.arange(n_out), hi), pos - lo)
        return jnp.asarray(w, x.dtype)

    x = jnp.einsum("oh,bhwc->bowc", weights(x.shape[1], height), x)
    return jnp.einsum("pw,bowc->bopc", weights(x.shape[2], width), x)


def binary_cross_entropy(logits, targets):
    """Mean binary cross-entropy of sigmoid(logits) against targets in [0, 1] (PyTorch's BCELoss)."""
    return optax.sigmoid_binary_cross_entropy(logits, targets).mean()


class TorchDense(nn.Module):
    """A linear layer initialised as PyTorch's `nn.Linear`."""

    features: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.features, kernel_init=torch_default, bias_init=_torch_linear_bias(x.shape[-1]))(x)


def _conv3x3(features: int, stride: int = 1, bias: bool = False, fan_in: int = 1):
    bias_init = _torch_linear_bias(fan_in) if bias else nn.initializers.zeros
    return nn.Conv(features, (3, 3), (stride, stride), padding=((1, 1), (1, 1)), use_bias=bias,
                   kernel_init=conv_init, bias_init=bias_init)


def infopro_conv(channels: int) -> tuple[int, int]:
    """(width, stride) of InfoPro's first head convolution for `channels`-channel features:
    (32, 2), (64, 2), (64, 1) for 16, 32, 64 channels, extended (module docstring)."""
    return max(channels, min(2 * channels, 64)), (2 if channels < 64 else 1)


class GreedyHead(nn.Module):
    num_classes: int

    @nn.compact
    def __call__(self, y, train: bool = False):
        return nn.Dense(self.num_classes)(_pool(y)), None


class DGLHead(nn.Module):
    """DGL's `auxillary_classifier2` (module docstring)."""

    num_classes: int
    n_lin: int = 3
    mlp_layers: int = 3

    @nn.compact
    def __call__(self, y, train: bool = False):
        if y.ndim == 4:
            y = adaptive_avg_pool(y, (math.ceil(y.shape[1] / 4), math.ceil(y.shape[2] / 4)))
            for _ in range(self.n_lin):
                y = nn.Conv(y.shape[-1], (1, 1), use_bias=False, kernel_init=torch_default)(y)
                y = nn.relu(norms.make("batch", None, train)(y))
            y = adaptive_avg_pool(y, 2)
            if not self.mlp_layers:
                y = norms.make("batch", None, train)(y)
        else:
            y = _pool(y)
        y = y.reshape(y.shape[0], -1)
        for _ in range(self.mlp_layers):
            y = nn.relu(norms.make("batch", None, train)(TorchDense(y.shape[-1])(y)))
        return TorchDense(self.num_classes)(y), None


class InfoProClassifier(nn.Module):
    """InfoPro's `AuxClassifier` with the cross-entropy loss: `arch` = '<n>c<m>f'."""

    num_classes: int
    arch: str = "1c2f"
    widen: float = 1.0
    feature_dim: int = 128

    @nn.compact
    def __call__(self, y, train: bool = False):
        convs, fcs = int(self.arch[0]), int(self.arch[2])
        if y.ndim == 4 and convs:
            width, stride = infopro_conv(y.shape[-1])
            width = int(width * self.widen)
            for k in range(convs):
                y = _conv3x3(width, stride if k == 0 else 1)(y)
                y = nn.relu(norms.make("batch", None, train)(y))
        y = _pool(y)
        for _ in range(fcs - 1):
            y = nn.relu(TorchDense(int(self.feature_dim * self.widen))(y))
        return TorchDense(self.num_classes)(y)


class InfoProDecoder(nn.Module):
    """InfoPro's `Decoder`: the image's sigmoid logits from a module's features."""

    image_shape: tuple[int, ...]
    widen: float = 1.0

    @nn.compact
    def __call__(self, y, train: bool = False):
        height, width, channels = self.image_shape
        hidden = int(12 * self.widen)
        y = resize_align_corners(y, height, width)
        y = _conv3x3(hidden, bias=True, fan_in=9 * y.shape[-1])(y)
        y = nn.relu(norms.make("batch", None, train)(y))
        return _conv3x3(channels, bias=True, fan_in=9 * hidden)(y)


class InfoProHead(nn.Module):
    """The classifier, and with `reconstruction` the decoder: (class logits, image logits or None)."""

    num_classes: int
    image_shape: tuple[int, ...]
    arch: str = "1c2f"
    widen: float = 1.0
    feature_dim: int = 128
    reconstruction: bool = False

    @nn.compact
    def __call__(self, y, train: bool = False):
        logits = InfoProClassifier(self.num_classes, self.arch, self.widen, self.feature_dim,
                                   name="classifier")(y, train)
        if not self.reconstruction:
            return logits, None
        return logits, InfoProDecoder(self.image_shape, self.widen, name="decoder")(y, train)


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


def _count(tree) -> int:
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


@dataclasses.dataclass(frozen=True)
class AuxHeads:
    """One head per local module but the last, and the local loss of every module.

    Attributes:
      kind: the config's `aux_head`.
      modules: per module, the head (None for the last module).
      feature_shapes: per module, one example's output shape.
      image_shape: the network's input shape (for reconstruction).
      weights: per module, the (reconstruction, cross-entropy) loss weights; (0, 1) for
        heads without a decoder and for the last module.
      pixel_mean, pixel_std: the network's input -> the raw image in [0, 1], per channel.
    """

    kind: str
    modules: tuple
    feature_shapes: tuple[tuple[int, ...], ...]
    image_shape: tuple[int, ...]
    weights: tuple[tuple[float, float], ...]
    pixel_mean: tuple[float, ...] = (0.0,)
    pixel_std: tuple[float, ...] = (1.0,)

    @property
    def num_stages(self) -> int:
        return len(self.modules)

    @property
    def needs_image(self) -> bool:
        """Whether some module's local loss reads the input image (reconstruction)."""
        return any(ixx != 0.0 for ixx, _ in self.weights)

    def init(self, rng) -> tuple[list[Any], list[Any]]:
        """Per-module head parameters and state (`{}` and `{}` for the last module), module j's
        from its own key."""
        params, state = [], []
        for j, (module, shape) in enumerate(zip(self.modules, self.feature_shapes)):
            if module is None:
                params.append({})
                state.append({})
                continue
            variables = dict(module.init(jax.random.fold_in(rng, j), jnp.zeros((2, *shape), jnp.float32)))
            params.append(variables.pop("params", {}))
            state.append(variables)
        return params, state

    def loss(self, j: int, params, state, features, labels, images=None, train: bool = True):
        """Module j's local loss on its output `features`: `(loss, (accuracy, new_state))`.

        The last module's features are the network's logits: its loss is their cross-entropy
        and `state` passes through. With `train`, BatchNorm uses this call's statistics and
        updates its running averages in the new state.
        """
        module = self.modules[j]
        if module is None:
            return cross_entropy(features, labels), (accuracy(features, labels), state)
        variables = {"params": params, **state}
        if train and state:
            (logits, recon), new_state = module.apply(variables, features, train=True, mutable=list(state))
            new_state = dict(new_state)
        else:
            (logits, recon), new_state = module.apply(variables, features, train=train), state
        ixx, ixy = self.weights[j]
        loss = ixy * cross_entropy(logits, labels)
        if recon is not None and ixx:
            loss = loss + ixx * binary_cross_entropy(recon, self.raw_image(images))
        return loss, (accuracy(logits, labels), new_state)

    def raw_image(self, images):
        """The network's input mapped back to pixels in [0, 1] (InfoPro's `_image_restore`)."""
        raw = images * jnp.asarray(self.pixel_std, images.dtype) + jnp.asarray(self.pixel_mean, images.dtype)
        return jnp.clip(raw, 0.0, 1.0)  # BCE targets must lie in [0, 1]; exact for true pixels

    def param_counts(self) -> list[dict]:
        """Per module `{'head_params': int, 'decoder_params': int}` (trainable parameters; the
        decoder is InfoPro's reconstruction, counted apart from the classifier)."""
        params, _ = jax.eval_shape(lambda: self.init(jax.random.key(0)))  # the key too: nothing runs
        counts = []
        for p in params:
            decoder = _count(p.get("decoder", {})) if isinstance(p, dict) else 0
            counts.append({"head_params": _count(p) - decoder, "decoder_params": decoder})
        return counts


def check_options(kind: str, kwargs: dict) -> None:
    if kind not in _OPTIONS:
        raise ConfigError(f"aux_head={kind!r} is not one of {', '.join(_OPTIONS)}")
    allowed = _OPTIONS[kind] + _SHARED_OPTIONS
    for key in kwargs:
        if key not in allowed:
            raise ConfigError(f"aux_kwargs.{key} is not an option of the {kind!r} head; "
                              f"accepted: {', '.join(allowed)}")


def _number(kwargs: dict, key: str, default, kind=float, low=0):
    value = kwargs.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < low or \
            (kind is int and int(value) != value):
        what = "an integer" if kind is int else "a number"
        raise ConfigError(f"aux_kwargs.{key}={value!r} must be {what} >= {low}")
    return kind(value)


def infopro_weights(kwargs: dict, num_stages: int) -> list[tuple[float, float]]:
    """(ixx_j, ixy_j) of modules j = 0..K-1 as InfoPro's `forward` interpolates them over its
    K-1 heads (module docstring); the last module: (0, 1)."""
    reconstruct = bool(kwargs.get("reconstruction", False))
    ixx_1 = _number(kwargs, "ixx_1", 1.0 if reconstruct else 0.0)
    ixx_2 = _number(kwargs, "ixx_2", 0.0)
    ixy_1, ixy_2 = _number(kwargs, "ixy_1", 1.0), _number(kwargs, "ixy_2", 1.0)
    if not reconstruct and (ixx_1 or ixx_2):
        raise ConfigError(f"aux_kwargs.ixx_1={ixx_1}, ixx_2={ixx_2} weigh a reconstruction loss, but "
                          f"aux_kwargs.reconstruction is False: set reconstruction=True or the ixx to 0")
    weights = []
    for j in range(num_stages - 1):
        ratio = j / (num_stages - 2) if num_stages > 2 else 0.0
        weights.append((ixx_1 * (1 - ratio) + ixx_2 * ratio, ixy_1 * (1 - ratio) + ixy_2 * ratio))
    dead = [j for j, (ixx, ixy) in enumerate(weights) if ixx == 0 and ixy == 0]
    if dead:
        raise ConfigError(f"aux_kwargs ixx_1={ixx_1}, ixy_1={ixy_1}, ixx_2={ixx_2}, ixy_2={ixy_2} give local "
                          f"module {dead[0]} of {num_stages} the loss weights (0, 0): it would never train; "
                          f"give ixx_2 or ixy_2 a positive value")
    return weights + [(0.0, 1.0)]


def _per_channel(kwargs: dict, key: str, default: float, channels: int, positive: bool) -> tuple[float, ...]:
    value = kwargs.get(key, (default,))
    value = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    if len(value) not in (1, channels) or any(isinstance(v, bool) or not isinstance(v, (int, float))
                                              or (positive and v <= 0) for v in value):
        raise ConfigError(f"aux_kwargs.{key}={list(value)!r} must be 1 or {channels} "
                          f"{'positive ' if positive else ''}numbers (per channel, [0, 1] pixel units)")
    return tuple(float(v) for v in value) * (channels if len(value) == 1 else 1)


def _infopro_head(kwargs, j, shape, num_classes, image_shape, net_name):
    arch = kwargs.get("arch", "1c2f")
    if arch not in INFOPRO_ARCHS:
        raise ConfigError(f"aux_kwargs.arch={arch!r} is not one of {', '.join(INFOPRO_ARCHS)}")
    reconstruct = bool(kwargs.get("reconstruction", False))
    if reconstruct and (len(shape) != 3 or len(image_shape) != 3):
        raise ConfigError(f"aux_kwargs.reconstruction=True needs image-like module outputs [H, W, C]; "
                          f"module {j} of {net_name!r} gives {list(shape)}")
    widen = _number(kwargs, "widen", 1.0, low=1e-9)
    return InfoProHead(num_classes, image_shape, arch, widen, _number(kwargs, "feature_dim", 128, int, 1),
                       reconstruct)


def _vit_head(kwargs, j, shape, num_classes, net):
    if len(shape) != 2:
        raise ConfigError(f"aux_head='vit' needs token outputs [T, D]; module {j} of {net.name!r} "
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
    return ViTHead(num_classes, depth, heads, int(kwargs.get("mlp_dim", own_mlp)), pool)


def build(kind: str, net, num_classes: int, kwargs: dict | None = None) -> AuxHeads:
    """The heads of `kind` for the local modules (stages) of `net` (a StagedNet), options from
    `kwargs` (the config's `aux_kwargs`)."""
    kwargs = dict(kwargs or {})
    check_options(kind, kwargs)
    shapes = tuple(tuple(s[1:]) for s in net.stage_output_shapes(1))
    image_shape = tuple(net.input_shape)
    num_stages = len(shapes)
    modules = []
    for j, shape in enumerate(shapes[:-1]):
        if kind == "greedy":
            modules.append(GreedyHead(num_classes))
        elif kind == "dgl":
            modules.append(DGLHead(num_classes, _number(kwargs, "n_lin", 3, int),
                                   _number(kwargs, "mlp_layers", 3, int)))
        elif kind == "infopro":
            modules.append(_infopro_head(kwargs, j, shape, num_classes, image_shape, net.name))
        else:
            modules.append(_vit_head(kwargs, j, shape, num_classes, net))
    weights = infopro_weights(kwargs, num_stages) if kind == "infopro" else [(0.0, 1.0)] * num_stages
    channels = image_shape[-1]
    return AuxHeads(kind, (*modules, None), shapes, image_shape, tuple(weights),
                    _per_channel(kwargs, "pixel_mean", 0.0, channels, False),
                    _per_channel(kwargs, "pixel_std", 1.0, channels, True))


def head_lr_scale(kwargs: dict | None) -> float:
    scale = (kwargs or {}).get("head_lr_scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
        raise ConfigError(f"aux_kwargs.head_lr_scale={scale!r} must be a positive number")
    return float(scale)


__all__ = ["AuxHeads", "INFOPRO_ARCHS", "PPLL_VIT_BLOCKS", "adaptive_avg_pool", "binary_cross_entropy", "build",
           "check_options", "head_lr_scale", "infopro_conv", "infopro_weights", "resize_align_corners"]
