"""Vision transformers as blocks: [patch embedding, encoder blocks..., head].

Between blocks the activation is a token sequence [B, T, D] with T = 1 + the
number of patches (a class token first), so every encoder block has the same
input and output shape and the same parameters: stages of a ViT stack
natively. The head reads the class token through a final LayerNorm.

- `vit_b` (ViT-B shape: 768 wide, 12 heads, 12 blocks, MLP 3072) with patch 16,
  or patch 4 for inputs of 32x32 or less (the PPLL setup on CIFAR-10 / SVHN);
- `vit_tiny` (32 wide, 2 heads, 4 blocks) with patch 2 for inputs up to 16x16
  (8x8 digits give 16 patches), 4 above;
- `vit`: any size (`patch`, `dim`, `depth`, `heads`, `mlp_dim`).

Normalisation is always pre-LayerNorm, whatever `norm` says: it is per token,
so it keeps no state and gives the same result however the batch is split.

Initialisation (`init`): `'released'` (default) is PPLL's released ViT
(`models/vit_model.py`, `_init_vit_weights`, applied by every part's
constructor): every linear layer (attention's projections, the MLP, the
classifier) from PyTorch's `trunc_normal_(std=0.01)`, whose cut at +-2 (absolute,
200 standard deviations) leaves a plain normal of std 0.01, biases 0; the patch
projection `kaiming_normal_(mode='fan_out')`, a normal of variance 2 / (patch^2
dim); class token and positions `trunc_normal_(std=0.02)` (cut at +-2, a normal of
std 0.02); LayerNorm scale 1, bias 0. `'xavier'`: what cdpjax had, Xavier-uniform
linear layers, flax's LeCun-normal patch projection, a zero class token: the
default of `vit_tiny`. Decoder blocks (`cdpjax.models.gpt`) keep Xavier.

Activation (`gelu`): `'exact'` (default) is PPLL's released ViT, PyTorch's `nn.GELU()`
(`models/vit_model.py`, `Block`'s `act_layer=nn.GELU`, lines 181 and 230), the erf form
x Phi(x); `'tanh'`: flax's default tanh approximation, what cdpjax had (`vit_tiny`'s
default; decoder blocks keep it). PPLL's ViT heads (`aux_head='vit'`) take the network's.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from cdpjax.errors import ConfigError
from cdpjax.models import register

dense_init = nn.initializers.xavier_uniform()
# PyTorch's trunc_normal_(std) cuts at +-2 in absolute units: at std 0.01 or 0.02 that is 200 or 100
# standard deviations, so the draw is a plain normal (JAX's truncated_normal cuts in standard deviations).
RELEASED_DENSE = nn.initializers.normal(0.01)
RELEASED_TOKENS = nn.initializers.normal(0.02)
RELEASED_PATCH = nn.initializers.variance_scaling(2.0, "fan_out", "normal")  # kaiming_normal_: untruncated
INITS = ("released", "xavier")
GELUS = ("exact", "tanh")  # PyTorch's nn.GELU() (erf) | flax's default tanh approximation


class PatchEmbedding(nn.Module):
    """Non-overlapping patches projected to `dim`, a learned class token, learned positions."""

    patch: int
    dim: int
    dtype: Any = None  # computation dtype (every block here); parameters stay float32
    scheme: str = "released"  # the initialisation (module docstring)

    @nn.compact
    def __call__(self, x, train: bool = False):
        p, released = self.patch, self.scheme == "released"
        kernel_init = RELEASED_PATCH if released else nn.initializers.lecun_normal()
        x = nn.Conv(self.dim, (p, p), (p, p), padding="VALID", name="projection", dtype=self.dtype,
                    kernel_init=kernel_init)(x)
        b, h, w, d = x.shape
        x = x.reshape(b, h * w, d)
        cls = self.param("cls", RELEASED_TOKENS if released else nn.initializers.zeros, (1, 1, d))
        x = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, d)).astype(x.dtype), x], axis=1)
        return x + self.param("pos_embedding", RELEASED_TOKENS, (1, h * w + 1, d)).astype(x.dtype)


class EncoderBlock(nn.Module):
    """Pre-norm transformer block: x + attention(LN(x)), then x + MLP(LN(x)); with `causal`, token t
    attends to tokens 0..t only (a decoder block: `cdpjax.models.gpt`)."""

    heads: int
    mlp_dim: int
    dtype: Any = None
    causal: bool = False
    kernel_init: Any = dense_init  # of every linear layer (ViT: `init`, module docstring)
    approximate_gelu: bool = True  # tanh GELU; False: the exact erf form (ViT: `gelu`, module docstring)

    @nn.compact
    def __call__(self, x, train: bool = False):
        d = x.shape[-1]
        y = nn.LayerNorm(epsilon=1e-6, dtype=self.dtype)(x)
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32)) if self.causal else None  # [B, 1, T, T]
        y = nn.MultiHeadDotProductAttention(num_heads=self.heads, kernel_init=self.kernel_init, dtype=self.dtype)(
            y, y, mask=mask, deterministic=True)
        x = x + y
        y = nn.LayerNorm(epsilon=1e-6, dtype=self.dtype)(x)
        y = nn.gelu(nn.Dense(self.mlp_dim, kernel_init=self.kernel_init, dtype=self.dtype)(y),
                    approximate=self.approximate_gelu)
        return x + nn.Dense(d, kernel_init=self.kernel_init, dtype=self.dtype)(y)


class Head(nn.Module):
    """Final LayerNorm of the class token and a linear classifier; float32 logits."""

    num_classes: int
    dtype: Any = None
    scheme: str = "released"  # the initialisation (module docstring)

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.LayerNorm(epsilon=1e-6, dtype=self.dtype)(x[:, 0])
        kernel_init = RELEASED_DENSE if self.scheme == "released" else nn.initializers.truncated_normal(0.02)
        dense = nn.Dense(self.num_classes, kernel_init=kernel_init, dtype=self.dtype)
        return dense(x).astype(jnp.float32)


@register("vit")
def vit(num_classes: int, input_shape, norm: str = "batch", bn_axis_name=None, *, patch: int | None = None,
        dim: int = 768, depth: int = 12, heads: int = 12, mlp_dim: int | None = None, dtype=None,
        init: str = "released", gelu: str = "exact") -> list[nn.Module]:
    """`depth + 2` blocks. `patch=None`: 4 for inputs of 32x32 or less, else 16; `mlp_dim=None`: 4 * dim;
    `dtype`: what every block computes in (None: float32); `init`: 'released' or 'xavier'; `gelu`: 'exact'
    or 'tanh' (module docstring)."""
    del norm, bn_axis_name  # LayerNorm throughout (see the module docstring)
    h, w = input_shape[:2]
    patch = (4 if max(h, w) <= 32 else 16) if patch is None else int(patch)
    if patch < 1 or h % patch or w % patch:
        raise ConfigError(f"ViT patch={patch} must divide the input's height and width ({h}x{w})")
    if dim < 1 or heads < 1 or dim % heads:
        raise ConfigError(f"ViT dim={dim} must be a positive multiple of heads={heads}")
    if depth < 1:
        raise ConfigError(f"ViT depth={depth} must be >= 1")
    if init not in INITS:
        raise ConfigError(f"ViT init={init!r} is not one of {', '.join(INITS)}")
    if gelu not in GELUS:
        raise ConfigError(f"ViT gelu={gelu!r} is not one of {', '.join(GELUS)}")
    mlp_dim = 4 * dim if mlp_dim is None else int(mlp_dim)
    kernel_init = RELEASED_DENSE if init == "released" else dense_init
    return ([PatchEmbedding(patch, dim, dtype, init)]
            + [EncoderBlock(heads, mlp_dim, dtype, kernel_init=kernel_init, approximate_gelu=gelu == "tanh")
               for _ in range(depth)]
            + [Head(num_classes, dtype, init)])


@register("vit_b")
def vit_b(num_classes, input_shape, norm="batch", bn_axis_name=None, *, patch=None, dtype=None, init="released",
          gelu="exact"):
    """ViT-B: 768 wide, 12 heads, 12 blocks, MLP 3072 (85.2M parameters at patch 4 on 32x32, 10 classes)."""
    return vit(num_classes, input_shape, norm, bn_axis_name, patch=patch, dim=768, depth=12, heads=12, dtype=dtype,
               init=init, gelu=gelu)


@register("vit_tiny")
def vit_tiny(num_classes, input_shape, norm="batch", bn_axis_name=None, *, patch=None, dim=32, depth=4, heads=2,
             mlp_dim=64, dtype=None, init="xavier", gelu="tanh"):
    """6 blocks by default; patch 2 for inputs up to 16x16, else 4. Xavier and tanh GELU by default: a model
    for tests with no reference code, where std 0.01 leaves 32-wide blocks near the identity for many steps."""
    if patch is None:
        patch = 2 if max(input_shape[:2]) <= 16 else 4
    return vit(num_classes, input_shape, norm, bn_axis_name, patch=patch, dim=dim, depth=depth, heads=heads,
               mlp_dim=mlp_dim, dtype=dtype, init=init, gelu=gelu)
