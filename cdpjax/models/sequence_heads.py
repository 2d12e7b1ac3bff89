"""Auxiliary heads for local learning on a language model: per-token logits from a module's tokens.

In local learning (`local`, `ppll`) each local module but the last trains on the loss of
its own small head. On a language model a module's output is a token sequence
`[B, T, D]` and its local loss is the task's own (`cdpjax.tasks`: the per-token
cross-entropy of the next token, averaged over the tokens, then over the examples):

    logits = head.apply(variables, features)         # [B, T, vocab], float32
    local_loss = task.loss(logits, labels)           # labels [B, T]: the next tokens

The last module needs no head: its outputs are the network's logits. Both heads are
registered kinds of `cdpjax.models.aux_heads` (`aux_head='token_linear'` and
`'token_blocks'`), whose default local loss, the mean cross-entropy of the logits
against the labels, is the language-modelling task's loss on them: every window has T
tokens, so the mean over tokens of the batch is the mean over windows of their means.

- `TokenLinearHead`: one linear layer applied to every token (the "greedy" head of a
  sequence: no pooling, one prediction per position).
- `TokenOutputHead` (`aux_head='token_output'`): a copy of the model's own output head,
  its final LayerNorm and unembedding (`cdpjax.models.gpt.OutputHead`, untied, fresh
  parameters of the same shapes and initialisation), optionally after `depth` private
  causal decoder blocks of the network's own shape (default 0): the design of published
  block-local training of transformer language models (each module's head is the model's
  own output layer, with a few private blocks).
- `TokenBlocksHead`: PPLL's ViT head made for sequences: `depth` fresh decoder
  blocks of the network's own shape, then LayerNorm and a per-token linear layer.
  The blocks are causal, as the network's are: position t of a module's output holds
  tokens 0..t only, and a head that attended to t+1 would read the very token it is
  asked to predict (its input is the label at t), so its local loss would fall
  without the module learning anything. `ppll_depth(j)` gives PPLL's depths by
  module (2, 2, 2, 1, 1, 1, then 0: deeper modules get shallower heads).

Heads compute in float32 (as every auxiliary head here) and keep no state.
"""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from cdpjax.errors import ConfigError
from cdpjax.models.aux_heads import PPLL_VIT_BLOCKS, register
from cdpjax.models.gpt import OutputHead, decoder_block
from cdpjax.models.vit import EncoderBlock


def _tokens(features):
    if features.ndim != 3:
        raise ConfigError(f"a sequence head reads token features [B, T, D]; a local module gives "
                          f"{list(features.shape)}")
    return features


class TokenLinearHead(nn.Module):
    """Per-token logits [B, T, vocab] from features [B, T, D] by one linear layer."""

    vocab: int

    @nn.compact
    def __call__(self, features, train: bool = False):
        return nn.Dense(self.vocab)(_tokens(features)).astype(jnp.float32)


class TokenBlocksHead(nn.Module):
    """`depth` fresh causal decoder blocks, LayerNorm, per-token linear logits [B, T, vocab]."""

    vocab: int
    depth: int
    heads: int
    mlp_dim: int

    @nn.compact
    def __call__(self, features, train: bool = False):
        y = _tokens(features)
        for _ in range(self.depth):
            y = decoder_block(self.heads, self.mlp_dim)(y)
        y = nn.LayerNorm(epsilon=1e-6)(y)
        return nn.Dense(self.vocab)(y).astype(jnp.float32)


class TokenOutputHead(nn.Module):
    """`depth` private causal decoder blocks, then a copy of the model's final LayerNorm and unembedding."""

    vocab: int
    depth: int = 0
    heads: int = 1
    mlp_dim: int = 4

    @nn.compact
    def __call__(self, features, train: bool = False):
        y = _tokens(features)
        for _ in range(self.depth):
            y = decoder_block(self.heads, self.mlp_dim)(y)
        return OutputHead(self.vocab)(y)


def ppll_depth(j: int, blocks=PPLL_VIT_BLOCKS) -> int:
    """Fresh blocks in the head of local module j: PPLL's (2, 2, 2, 1, 1, 1), then 0."""
    return int(blocks[j]) if j < len(blocks) else 0


def decoder_shape(net, width: int) -> tuple[int, int]:
    """Attention heads and MLP width of the network's own decoder blocks (else 64-wide heads, MLP 4x)."""
    for block in net.blocks:
        if isinstance(block, EncoderBlock) and block.causal:
            return block.heads, block.mlp_dim
    return max(1, width // 64) if width % 64 == 0 else 1, 4 * width


def token_blocks_head(net, j: int, width: int, vocab: int, depth: int | None = None) -> TokenBlocksHead:
    """The head of local module j of `net` (a StagedNet of `gpt`), whose output tokens are `width` wide."""
    heads, mlp_dim = decoder_shape(net, width)
    return TokenBlocksHead(vocab, ppll_depth(j) if depth is None else int(depth), heads, mlp_dim)


@register("token_linear")
def token_linear(ctx):
    """A per-token linear head for local module j of a language model."""
    if len(ctx.feature_shape) != 2:
        raise ConfigError(f"aux_head='token_linear' needs token outputs [T, D]; module {ctx.index} of "
                          f"{ctx.net.name!r} gives {list(ctx.feature_shape)}")
    return TokenLinearHead(ctx.num_classes)


@register("token_blocks")
def token_blocks(ctx, *, depth: int | None = None):
    """PPLL's ViT head for sequences: fresh causal blocks (PPLL's depths by module), LayerNorm, logits."""
    if len(ctx.feature_shape) != 2:
        raise ConfigError(f"aux_head='token_blocks' needs token outputs [T, D]; module {ctx.index} of "
                          f"{ctx.net.name!r} gives {list(ctx.feature_shape)}")
    return token_blocks_head(ctx.net, ctx.index, ctx.feature_shape[-1], ctx.num_classes, depth)


@register("token_output")
def token_output(ctx, *, depth: int = 0):
    """A copy of the model's own final LayerNorm and unembedding, after `depth` private decoder blocks."""
    if len(ctx.feature_shape) != 2:
        raise ConfigError(f"aux_head='token_output' needs token outputs [T, D]; module {ctx.index} of "
                          f"{ctx.net.name!r} gives {list(ctx.feature_shape)}")
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise ConfigError(f"aux_kwargs.depth={depth!r} must be an integer >= 0 (private decoder blocks)")
    last = ctx.net.blocks[-1]
    vocab = last.vocab if isinstance(last, OutputHead) else ctx.num_classes
    heads, mlp_dim = decoder_shape(ctx.net, ctx.feature_shape[-1])
    return TokenOutputHead(vocab, depth, heads, mlp_dim)


__all__ = ["TokenBlocksHead", "TokenLinearHead", "TokenOutputHead", "decoder_shape", "ppll_depth", "token_blocks",
           "token_blocks_head", "token_linear", "token_output"]
