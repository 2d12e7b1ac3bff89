"""`language_modelling`: predict the next token at every position of a window; tokens/s.

Inputs are token ids `[B, T]`, labels the ids that follow each position `[B, T]`
(input t+1 is label t), outputs `[B, T, V]` logits. An example's loss is its T
tokens' softmax cross-entropies averaged over the tokens; every window holds T
tokens, so the mean over examples is the mean over tokens (the per-token loss,
in nats). Reported: `loss` (per token), `perplexity` = exp(loss), and
`token_accuracy`, the fraction of tokens whose largest logit is the next token.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from cdpjax.tasks import Task, register
from cdpjax.tasks.classification import example_mask

SUM_NAMES = ("token_loss_sum", "token_correct", "token_count")


def token_losses(logits, labels):
    """[B, T] softmax cross-entropy of each token."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def example_losses(logits, labels):
    """[B] each window's per-token cross-entropy averaged over its tokens."""
    losses = token_losses(logits, labels)
    return losses.reshape(losses.shape[0], -1).mean(axis=1)


def metric_sums(logits, labels, mask=None):
    """[token_loss_sum, token_correct, token_count] over the windows `mask` keeps."""
    batch = labels.shape[0]
    mask = example_mask(mask, batch)
    tokens = labels.reshape(batch, -1).shape[1]
    losses = token_losses(logits, labels).reshape(batch, -1).sum(axis=1)
    correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32).reshape(batch, -1).sum(axis=1)
    return jnp.stack([(losses * mask).sum(), (correct * mask).sum(), mask.sum() * tokens])


def finish(sums) -> dict:
    """{'loss': per-token loss, 'perplexity': exp(loss), 'token_accuracy'} of the counted tokens."""
    count = sums[2] + (sums[2] == 0)  # none counted (a pipeline's fill ticks): 0, not NaN
    loss = sums[0] / count
    exp = jnp.exp if isinstance(loss, jax.Array) else np.exp  # float64 stays float64 on the host
    return {"loss": loss, "perplexity": exp(loss), "token_accuracy": sums[1] / count}


def token_accuracy(logits, labels):
    """The fraction of tokens whose largest logit is the next token."""
    return (jnp.argmax(logits, -1) == labels).astype(jnp.float32).mean()


@register("language_modelling")
def task() -> Task:
    return Task("language_modelling", example_losses, metric_sums, SUM_NAMES, finish,
                ("loss", "perplexity", "token_accuracy"), label_shape=lambda input_shape: tuple(input_shape),
                unit="tokens", headline="loss",
                short_names={"loss": "loss", "perplexity": "ppl", "token_accuracy": "tok_acc"}, rate_label="tok_s",
                score=token_accuracy)

