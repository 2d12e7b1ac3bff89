"""InfoPro's auxiliary heads and PPLL's momentum heads (`aux_head='infopro'`, `'man'`).

**`infopro`**: InfoPro's heads (`blackfeather-wang/InfoPro-Pytorch`, CIFAR code,
`networks/auxiliary_nets.py`, used by `networks/resnet.py`). The classifier `arch`
(`0c1f`, `0c2f`, `1c1f`, `1c2f` default, `1c3f`, `2c2f`: convolutions, then fully
connected layers): 3x3 convolutions without bias (the first one to 32 / 64 / 64
channels with stride 2 / 2 / 1 for 16 / 32 / 64-channel features, times `widen`),
BatchNorm, ReLU; global average pooling; linear layers of `feature_dim` (128)
times `widen` with ReLU; a last linear layer to the classes (`loss='cross_entropy'`,
the default) or to `feature_dim` embeddings (`loss='contrast'`: InfoPro's
supervised contrastive loss, `networks/losses.py`'s `SupConLoss` with temperature
0.07 on the L2-normalised embeddings, one view per example, as `AuxClassifier`
calls it). With `reconstruction=True`, the decoder: features resized to the image
size (bilinear, corners aligned, as PyTorch's `align_corners=True`), 3x3 conv with
bias to 12 x `widen` channels, BatchNorm, ReLU, 3x3 conv with bias to the image's
channels, sigmoid, binary cross-entropy against the raw image in [0, 1] (the
network's input mapped back with `pixel_mean` and `pixel_std`, [0, 1] units per
channel, as InfoPro's `_image_restore`; `build` defaults to 0 and 1, the input taken
as the raw image, and `cdpjax.methods.local.setup` fills in the dataset's own).

Module j's loss is `ixx_j * reconstruction + ixy_j * classification` (cross-entropy
or contrastive), the weights interpolated from (ixx_1, ixy_1) to (ixx_2, ixy_2):
w_j = w_1 (1 - r_j) + w_2 r_j with r_j = p_j / (N - 2) (0 when N <= 2), N =
`weight_k` (default: the number of local modules K) and p_j by `weight_by`:

- `'module'` (default, InfoPro's `networks/resnet.py`): p_j = j, the module's index;
- `'stage'` (PPLL's `models/resnetInfoPro_gxy_ppll.py`, its `lo`): p_j = the network
  stage (1, 2, 3 on ResNet-32: `aux_heads.block_stages`) of module j+1's first block.

Defaults: ixy 1 and 1; ixx 1 and 0 with reconstruction, 0 without. A module left
with weights (0, 0), or with a negative weight (r_j > 1 extrapolates), is refused:
it would never train, or climb its own loss. The reconstruction needs the image at
every module, so pipelines carry it along.

**`man`**: the heads of PPLL's released ResNet code (`gxy233/Faster-Multi-GPU-
Training-with-PPLL`, `models/resnetInfoPro_gxy_ppll.py`, `InfoProResNet_basic`):
MAN's momentum auxiliary network. For module j its input y is the sum of two
copies of module j+1's first block (`copy_depth` = 1 block, as the released `LB`
and `EMA_Net`; more blocks on request, at most module j+1's): `copy`, trained with
the head (the released `LB`, `learned_copy=True`), and `momentum_copy` (the
released `EMA_Net`); then InfoPro's classifier (`arch`, the released configs'
`2c2f`) and decoder on y, with the loss above. The `momentum_copy`:

- where module j+1 runs on module j's device (the same group of
  `config.module_groups`), it is not trained: after module j's step it moves to
  module j+1's parameters as they are before module j+1's own update on the same
  batch, `ema <- ema_decay * ema + (1 - ema_decay) * theta_{j+1}` (parameters only;
  its BatchNorm running averages are its own), the released `paramEMA.data =
  paramEMA.data * self.momentum + paramEncoder.data * (1 - self.momentum)` after each
  module's backward and before the optimizer's step;
- where module j+1 is on the next device (the last module of a group), it is
  trained with the head, as the released front and middle parts do
  (`requires_grad = (i == len(self.EMA_Net) - 1)`): a second learned copy.

Its state is the head's (`head_state['ema']`): checkpointed, restored and resharded
with the rest, and `ppll` still equals `local` given the same `module_groups`.
Initialisation as released: the copies are initialised independently of the block
they copy (the model-wide loop re-draws every convolution after the deep copies).

Where we differ from the reference code, and why:

- InfoPro's `AuxClassifier` exists for 16, 32 and 64 channels only; for other
  widths we extend its table: the first convolution doubles the channels up
  to 64 and never narrows them (`max(C, min(2C, 64))`), with stride 2 below 64
  channels and 1 from 64 on. ResNet-32's heads are InfoPro's exactly.
- The decoder's BCE is computed from the logits (optax's
  `sigmoid_binary_cross_entropy`): PyTorch's `BCELoss` of the sigmoid equals it
  wherever float32's sigmoid does not saturate to 0 or 1 (there PyTorch clamps the
  log at -100). The decoder is for any image size and channel count; InfoPro's is
  square and RGB.
- InfoPro's code accepts a weight pair (0, 0), leaving that module without any
  loss (InfoPro's interpolation of PPLL's command 5, 0.5, 0, 0 gives it to the last
  head for K > 2), and negative weights: `build` refuses both.
- Heads with the contrastive loss output embeddings, not classes: their accuracy
  is reported as 0.
- `man`'s EMA decay default is 0.9, the value the released PPLL ResNet code runs
  with (`InfoProResNet_basic(momentum=0.9)`, never passed by its `train_front`,
  `train_mid`, `train_back`); the configs' `momentum: 0.995` goes to SGD there. MAN's
  own model (`models/resnetInfoPro_MAN.py`, default 0.999) takes its `momentum` as the
  EMA decay, and the repository's `run.sh` passes `--momentum 0.995` to MAN's
  `train.py` (not in PPLL's release), whose SGD momentum is 0.9: the runs behind the
  logged accuracies. `cdpjax/configs/ppll_resnet32.py` has both readings
  (`recipe=ppll`: `ema_decay=0.995`, SGD 0.9; `recipe=ppll-multiprocess`: 0.9, SGD 0.995).
- The released middle parts (`InfoProResNet_mid`) have no EMA update: their copies
  that should follow stay at their initial values. The default, `mid_ema=False`, is
  that release (copies of middle groups, but for each group's last, never move);
  `mid_ema=True` moves every copy whose next module shares its device, as the front
  and back parts and MAN's single-process model do (`recipe=ppll` sets it: MAN's
  `train.py` ran those runs).
- The copies compute in the dtype of the blocks they copy (`config.dtype`); the
  rest of the head in float32.
"""
from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from cdpjax.errors import ConfigError
from cdpjax.models import norms
from cdpjax.models.aux_heads import Head, HeadContext, TorchDense, number, per_channel, pool, register
from cdpjax.models.resnet import _torch_linear_bias, conv_init
from cdpjax.models.staging import Chain, accuracy, cross_entropy

INFOPRO_ARCHS = ("0c1f", "0c2f", "1c1f", "1c2f", "1c3f", "2c2f")
WEIGHT_RULES = ("module", "stage")
LOSSES = ("cross_entropy", "contrast")
SUPCON_TEMPERATURE = 0.07  # InfoPro's AuxClassifier passes 0.07; SupConLoss's base_temperature is 0.07
MAN_EMA_DECAY = 0.9  # the released PPLL ResNet code's (module docstring)
INFOPRO_OPTIONS = ("arch", "widen", "feature_dim", "reconstruction", "loss", "ixx_1", "ixy_1", "ixx_2", "ixy_2",
                   "weight_by", "weight_k", "pixel_mean", "pixel_std")
MAN_OPTIONS = ("copy_depth", "ema_decay", "learned_copy", "mid_ema")


def infopro_conv(channels: int) -> tuple[int, int]:
    """(width, stride) of InfoPro's first head convolution for `channels`-channel features:
    (32, 2), (64, 2), (64, 1) for 16, 32, 64 channels, extended (module docstring)."""
    return max(channels, min(2 * channels, 64)), (2 if channels < 64 else 1)


def _conv3x3(features: int, stride: int = 1, bias: bool = False, fan_in: int = 1):
    bias_init = _torch_linear_bias(fan_in) if bias else nn.initializers.zeros
    return nn.Conv(features, (3, 3), (stride, stride), padding=((1, 1), (1, 1)), use_bias=bias,
                   kernel_init=conv_init, bias_init=bias_init)


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


def supcon_loss(features, labels, temperature: float = SUPCON_TEMPERATURE, base_temperature: float = 0.07):
    """Supervised contrastive loss (Khosla et al. 2020) of `features` [B, D], one view each, as
    InfoPro's `SupConLoss(contrast_mode='all')` on `F.normalize(features).unsqueeze(1)`: the
    features L2-normalised, logits f_i . f_k / temperature (less each row's maximum), positives
    the other examples of the same label, and per anchor the mean log-probability of its
    positives against every other example (an anchor without positives counts 0), times
    -temperature / base_temperature, averaged over the anchors."""
    f = features / jnp.maximum(jnp.linalg.norm(features, axis=1, keepdims=True), 1e-12)
    logits = f @ f.T / temperature
    logits = logits - lax.stop_gradient(logits.max(axis=1, keepdims=True))
    others = 1.0 - jnp.eye(f.shape[0], dtype=f.dtype)
    positives = (labels[:, None] == labels[None, :]).astype(f.dtype) * others
    log_prob = logits - jnp.log((jnp.exp(logits) * others).sum(axis=1, keepdims=True))
    count = positives.sum(axis=1)
    mean_log_prob = (positives * log_prob).sum(axis=1) / jnp.where(count == 0, 1.0, count)
    return -(temperature / base_temperature) * mean_log_prob.mean()


def raw_image(images, pixel_mean, pixel_std):
    """The network's input mapped back to pixels in [0, 1] (InfoPro's `_image_restore`)."""
    raw = images * jnp.asarray(pixel_std, images.dtype) + jnp.asarray(pixel_mean, images.dtype)
    return jnp.clip(raw, 0.0, 1.0)  # BCE targets must lie in [0, 1]; exact for true pixels


def infopro_loss(outputs, labels, images, *, ixx: float, ixy: float, contrast: bool, pixel_mean, pixel_std):
    """`ixy * classification + ixx * reconstruction` of a head's (class logits or embeddings,
    image logits or None), and its accuracy (0 for embeddings)."""
    scores, recon = outputs
    if contrast:
        loss, acc = ixy * supcon_loss(scores, labels), jnp.zeros((), jnp.float32)
    else:
        loss, acc = ixy * cross_entropy(scores, labels), accuracy(scores, labels)
    if recon is not None and ixx:
        loss = loss + ixx * binary_cross_entropy(recon, raw_image(images, pixel_mean, pixel_std))
    return loss, acc


class InfoProClassifier(nn.Module):
    """InfoPro's `AuxClassifier`: `arch` = '<n>c<m>f'; `outputs` classes or embedding features."""

    outputs: int
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
        y = pool(y)
        for _ in range(fcs - 1):
            y = nn.relu(TorchDense(int(self.feature_dim * self.widen))(y))
        return TorchDense(self.outputs)(y)


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
    """The classifier, and with `reconstruction` the decoder: (scores, image logits or None)."""

    outputs: int
    image_shape: tuple[int, ...]
    arch: str = "1c2f"
    widen: float = 1.0
    feature_dim: int = 128
    reconstruction: bool = False

    @nn.compact
    def __call__(self, y, train: bool = False):
        return _classify(self, y, train)


def _classify(head, y, train):
    """`head`'s classifier and decoder on `y`, defined inside its compact call (names `classifier`,
    `decoder`)."""
    scores = InfoProClassifier(head.outputs, head.arch, head.widen, head.feature_dim, name="classifier")(y, train)
    if not head.reconstruction:
        return scores, None
    return scores, InfoProDecoder(head.image_shape, head.widen, name="decoder")(y, train)


@dataclasses.dataclass(frozen=True)
class BlockCopies:
    """Blocks of the network that a head copies, held outside Flax's module tree: a Flax module
    given as an attribute becomes one submodule of its holder, so two copies would share their
    parameters; `fresh()` gives new, unbound copies for each use."""

    blocks: tuple

    def fresh(self) -> tuple:
        return tuple(block.clone(parent=None) for block in self.blocks)


class MomentumHead(nn.Module):
    """`man`'s head (module docstring): `momentum_copy` (+ `copy`) of the next module's first
    blocks, then InfoPro's classifier and, with `reconstruction`, its decoder."""

    copies: BlockCopies
    learned_copy: bool
    outputs: int
    image_shape: tuple[int, ...]
    arch: str = "2c2f"
    widen: float = 1.0
    feature_dim: int = 128
    reconstruction: bool = False

    @nn.compact
    def __call__(self, y, train: bool = False):
        z = Chain(self.copies.fresh(), name="momentum_copy")(y, train)
        if self.learned_copy:
            z = z + Chain(self.copies.fresh(), name="copy")(y, train)
        return _classify(self, z, train)


def ema_update(ema, next_body, decay: float):
    """`ema <- decay * ema + (1 - decay) * theta` for every copied block (`ema[key]['blocks_i']`
    against module j+1's `next_body['blocks_i']`), parameters only."""
    return {key: {name: jax.tree.map(lambda e, p: decay * e + (1.0 - decay) * p, tree, next_body[name])
                  for name, tree in copies.items()} for key, copies in ema.items()}


def infopro_weights(kwargs: dict, num_stages: int, next_stages=None) -> list[tuple[float, float]]:
    """(ixx_j, ixy_j) of modules j = 0..K-1, interpolated over the K-1 heads by `weight_by`
    (module docstring; `next_stages[j]`, for `'stage'`: the network stage of module j+1's first
    block); the last module: (0, 1)."""
    reconstruct = bool(kwargs.get("reconstruction", False))
    ixx_1 = number(kwargs.get("ixx_1", 1.0 if reconstruct else 0.0), "ixx_1")
    ixx_2 = number(kwargs.get("ixx_2", 0.0), "ixx_2")
    ixy_1, ixy_2 = number(kwargs.get("ixy_1", 1.0), "ixy_1"), number(kwargs.get("ixy_2", 1.0), "ixy_2")
    if not reconstruct and (ixx_1 or ixx_2):
        raise ConfigError(f"aux_kwargs.ixx_1={ixx_1}, ixx_2={ixx_2} weigh a reconstruction loss, but "
                          f"aux_kwargs.reconstruction is False: set reconstruction=True or the ixx to 0")
    rule = kwargs.get("weight_by", "module")
    if rule not in WEIGHT_RULES:
        raise ConfigError(f"aux_kwargs.weight_by={rule!r} is not one of {', '.join(WEIGHT_RULES)}")
    span = number(kwargs.get("weight_k", num_stages), "weight_k", int, 1)
    positions = range(num_stages - 1) if rule == "module" else list(next_stages)
    weights = []
    for p in positions:
        ratio = p / (span - 2) if span > 2 else 0.0
        weights.append((ixx_1 * (1 - ratio) + ixx_2 * ratio, ixy_1 * (1 - ratio) + ixy_2 * ratio))
    given = (f"aux_kwargs ixx_1={ixx_1}, ixy_1={ixy_1}, ixx_2={ixx_2}, ixy_2={ixy_2}, weight_by={rule!r}, "
             f"weight_k={span}")
    for j, (ixx, ixy) in enumerate(weights):
        if ixx < 0 or ixy < 0:
            raise ConfigError(f"{given} give local module {j} of {num_stages} the loss weights ({ixx:g}, {ixy:g}) "
                              f"(interpolation ratio {positions[j] / (span - 2):g} > 1): it would climb its own "
                              f"loss; raise weight_k or use weight_by='module'")
        if ixx == 0 and ixy == 0:
            raise ConfigError(f"{given} give local module {j} of {num_stages} the loss weights (0, 0): it would "
                              f"never train; give ixx_2 or ixy_2 a positive value")
    return weights + [(0.0, 1.0)]


def _infopro_parts(ctx: HeadContext, options: dict, features) -> dict:
    """What an InfoPro classifier (and decoder) on `features` (one example's shape) needs for
    module ctx.index: its module arguments, its loss, its weights, whether it reads the image."""
    arch = options.get("arch", "1c2f")
    if arch not in INFOPRO_ARCHS:
        raise ConfigError(f"aux_kwargs.arch={arch!r} is not one of {', '.join(INFOPRO_ARCHS)}")
    mode = options.get("loss", "cross_entropy")
    if mode not in LOSSES:
        raise ConfigError(f"aux_kwargs.loss={mode!r} is not one of {', '.join(LOSSES)}")
    if mode == "contrast" and "feature_dim" not in options:
        raise ConfigError("aux_kwargs.loss='contrast' makes the head's last layer output feature_dim embeddings "
                          "(InfoPro's AuxClassifier): give aux_kwargs.feature_dim (InfoPro's commands: 128)")
    reconstruct = bool(options.get("reconstruction", False))
    if reconstruct and (len(features) != 3 or len(ctx.image_shape) != 3):
        raise ConfigError(f"aux_kwargs.reconstruction=True needs image-like module outputs [H, W, C]; "
                          f"module {ctx.index} of {ctx.net.name!r} gives {list(features)}")
    widen = number(options.get("widen", 1.0), "widen", low=1e-9)
    feature_dim = number(options.get("feature_dim", 128), "feature_dim", int, 1)
    stages = ctx.next_stages() if options.get("weight_by", "module") == "stage" else None
    ixx, ixy = infopro_weights(options, ctx.num_modules, stages)[ctx.index]
    channels = ctx.image_shape[-1]
    loss = functools.partial(infopro_loss, ixx=ixx, ixy=ixy, contrast=mode == "contrast",
                             pixel_mean=per_channel(options, "pixel_mean", 0.0, channels, False),
                             pixel_std=per_channel(options, "pixel_std", 1.0, channels, True))
    module = {"outputs": feature_dim if mode == "contrast" else ctx.num_classes, "image_shape": ctx.image_shape,
              "arch": arch, "widen": widen, "feature_dim": feature_dim, "reconstruction": reconstruct}
    return {"module": module, "loss": loss, "weights": (ixx, ixy), "needs_image": bool(reconstruct and ixx)}


@register("infopro", options=INFOPRO_OPTIONS)
def infopro(ctx: HeadContext, **options):
    parts = _infopro_parts(ctx, options, ctx.feature_shape)
    return Head(InfoProHead(**parts["module"]), parts["loss"], parts["needs_image"], parts["weights"])


@register("man", options=MAN_OPTIONS + INFOPRO_OPTIONS, grouped=True)
def man(ctx: HeadContext, *, copy_depth: int = 1, ema_decay: float = MAN_EMA_DECAY, learned_copy: bool = True,
        mid_ema: bool = False, **options):
    first, end = ctx.next_bounds
    depth = number(copy_depth, "copy_depth", int, 1)
    if depth > end - first:
        raise ConfigError(f"aux_kwargs.copy_depth={depth} copies past local module {ctx.index + 1}, which has "
                          f"{end - first} block(s): module {ctx.index}'s head can copy at most {end - first}")
    decay = number(ema_decay, "ema_decay")
    if not decay < 1:
        raise ConfigError(f"aux_kwargs.ema_decay={ema_decay!r} must be in [0, 1): each update moves the copy by "
                          f"1 - ema_decay towards the next module (the released code: {MAN_EMA_DECAY})")
    for key, value in (("learned_copy", learned_copy), ("mid_ema", mid_ema)):
        if not isinstance(value, bool):
            raise ConfigError(f"aux_kwargs.{key}={value!r} must be True or False")
    parts = _infopro_parts(ctx, {"arch": "2c2f", **options}, ctx.copy_shape(depth))
    module = MomentumHead(BlockCopies(tuple(ctx.net.blocks[first:first + depth])), learned_copy, **parts["module"])
    follows = ctx.next_on_same_device
    middle = 0 < ctx.group < len(ctx.groups) - 1
    moving = follows and (mid_ema or not middle)
    return Head(module, parts["loss"], parts["needs_image"], parts["weights"],
                ema=("momentum_copy",) if follows else (),
                follow=functools.partial(ema_update, decay=decay) if moving else None)


__all__ = ["INFOPRO_ARCHS", "INFOPRO_OPTIONS", "LOSSES", "MAN_EMA_DECAY", "MAN_OPTIONS", "WEIGHT_RULES",
           "BlockCopies", "InfoProClassifier", "InfoProDecoder", "InfoProHead", "MomentumHead",
           "binary_cross_entropy", "ema_update", "infopro_conv", "infopro_loss", "infopro_weights", "raw_image",
           "resize_align_corners", "supcon_loss"]
