"""A GPT-style causal language model as blocks: [embedding, decoder blocks..., output head].

- Embedding: token ids `[B, T]` (integers, from the first stage on) -> a learned token
  embedding plus a learned position embedding (a table of `max_len` rows, of which
  a window reads its first T) -> `[B, T, width]`.
- `depth` decoder blocks, pre-norm as GPT-2: x + attention(LN(x)) with a causal mask
  (position t attends to positions <= t), then x + MLP(LN(x)) (GELU, `mlp_dim`).
  Every block has the same input and output shape and the same parameters, so
  stages of a GPT stack natively.
- Output head: a final LayerNorm and a per-token linear layer to the vocabulary:
  float32 logits `[B, T, vocab]`.

Options (`model_kwargs`): `width` (128), `depth` (4), `heads` (4), `mlp_dim`
(4 * width), `max_len` (the window length), `vocab_size` (the dataset's
`num_classes`: its symbols; larger is allowed, smaller refused), `tied` (False).
`dtype` is `config.dtype`, what every block computes in; parameters stay float32.

`tied=True` reads the output logits off the token embedding table (x @ E^T, as
GPT-2) instead of a head matrix of its own. The table then belongs to the first
block and the head at once: a parameter shared across blocks, which only one
stage can hold (each stage keeps, updates and sends its own parameters). It is
accepted only when the embedding and the head fall in one stage (`stages=1`:
e2e, dp); a cut that separates them is refused when the stages are first built,
with a line saying so. Initialisation: the embeddings and the output layer N(0, 0.02)
(GPT-2's), the blocks' dense kernels Xavier-uniform (as `cdpjax.models.vit`, whose
`EncoderBlock` with `causal=True` is the decoder block), LayerNorm scale 1 and bias 0.

Normalisation is always LayerNorm, whatever `norm` says (per token: no state, the
same result however a batch is split).
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from cdpjax.errors import ConfigError
from cdpjax.models import register
from cdpjax.models.vit import EncoderBlock

embedding_init = nn.initializers.normal(0.02)


class Embedding(nn.Module):
    """Token ids [B, T] -> token embedding (`table`, an `nn.Embed`, in its dtype) + position embedding."""

    table: nn.Module
    max_len: int

    @nn.compact
    def __call__(self, ids, train: bool = False):
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"gpt reads integer token ids; it was given {ids.dtype} inputs")
        x = self.table(ids)
        position = self.param("position", embedding_init, (self.max_len, x.shape[-1]))
        return x + position[: ids.shape[1]].astype(x.dtype)


def decoder_block(heads: int, mlp_dim: int, dtype=None) -> EncoderBlock:
    """Pre-norm causal transformer block: x + causal attention(LN(x)), then x + MLP(LN(x))."""
    return EncoderBlock(heads, mlp_dim, dtype, causal=True)


class OutputHead(nn.Module):
    """Final LayerNorm and per-token logits [B, T, vocab] (float32): a dense layer of its own, or
    with `tied` the embedding's table transposed."""

    vocab: int
    dtype: Any = None
    tied: Any = None  # the Embedding's nn.Embed, shared, or None

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.LayerNorm(epsilon=1e-6, dtype=self.dtype)(x)
        if self.tied is None:
            logits = nn.Dense(self.vocab, kernel_init=embedding_init, dtype=self.dtype)(x)
        else:
            # Flax binds a shared module to the first block that uses it: in a stage holding the
            # embedding that is the embedding; in a stage without it, this head. (Alone, outside
            # any stage, as the partition's per-block costs see it, the head holds the table.)
            if self.tied.parent is self and isinstance(self.parent, nn.Module):
                raise ConfigError(
                    "model 'gpt' with model_kwargs.tied=True reads its logits off the token embedding of its "
                    "first block, a parameter that only one stage can hold, but this cut puts the output head "
                    "in a stage without the embedding: set --config.stages=1 (e2e, dp) or tied=False")
            logits = self.tied.attend(x)
        return logits.astype(jnp.float32)


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"gpt model_kwargs.{name}={value!r} must be a positive integer")
    return value


@register("gpt")
def gpt(num_classes: int, input_shape, norm: str = "none", bn_axis_name=None, *, width: int = 128, depth: int = 4,
        heads: int = 4, mlp_dim: int | None = None, max_len: int | None = None, vocab_size: int | None = None,
        tied: bool = False, dtype=None) -> list[nn.Module]:
    """`depth + 2` blocks (module docstring); `num_classes` is the dataset's vocabulary."""
    del norm, bn_axis_name  # LayerNorm throughout (see the module docstring)
    if len(tuple(input_shape)) != 1:
        raise ConfigError(f"gpt reads windows of token ids of shape (T,), but the dataset gives inputs of shape "
                          f"{tuple(input_shape)}: use a text dataset (coriolanus, tiny_shakespeare, lm1b)")
    window = int(input_shape[0])
    width, depth, heads = _positive("width", width), _positive("depth", depth), _positive("heads", heads)
    if width % heads:
        raise ConfigError(f"gpt model_kwargs.width={width} must be a multiple of heads={heads}")
    vocab = num_classes if vocab_size is None else _positive("vocab_size", vocab_size)
    if vocab < num_classes:
        raise ConfigError(f"gpt model_kwargs.vocab_size={vocab} is smaller than the dataset's {num_classes} symbols "
                          f"(token ids up to {num_classes - 1}): set vocab_size >= {num_classes}, or leave it unset")
    max_len = window if max_len is None else _positive("max_len", max_len)
    if window > max_len:
        raise ConfigError(f"windows of {window} tokens are longer than gpt's position table (model_kwargs.max_len="
                          f"{max_len}): set max_len >= {window}, or lower dataset_kwargs.window")
    if not isinstance(tied, bool):
        raise ConfigError(f"gpt model_kwargs.tied={tied!r} must be True or False")
    mlp_dim = 4 * width if mlp_dim is None else _positive("mlp_dim", mlp_dim)
    table = nn.Embed(vocab, width, dtype=dtype, embedding_init=embedding_init)
    return ([Embedding(table, max_len)] + [decoder_block(heads, mlp_dim, dtype) for _ in range(depth)]
            + [OutputHead(vocab, dtype, table if tied else None)])
