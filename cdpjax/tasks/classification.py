"""`classification`: one integer label per example, softmax cross-entropy, accuracy; images/s.

Outputs `[B, C]` (logits), labels `[B]`. The loss of an example is the softmax
cross-entropy of its logits against its label (optax's, with integer labels);
accuracy counts the examples whose largest logit is their label.
"""
from __future__ import annotations

import jax.numpy as jnp
import optax

from cdpjax.tasks import Task, register

SUM_NAMES = ("loss_sum", "correct", "count")


def example_losses(logits, labels):
    """[B] softmax cross-entropy of each example."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def example_mask(mask, batch: int):
    """`mask` as float32 [B]; None counts every example."""
    return jnp.ones((batch,), jnp.float32) if mask is None else jnp.asarray(mask, jnp.float32)


def metric_sums(logits, labels, mask=None):
    """[loss_sum, correct, count] over the examples `mask` keeps."""
    mask = example_mask(mask, labels.shape[0])
    correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
    return jnp.stack([(example_losses(logits, labels) * mask).sum(), (correct * mask).sum(), mask.sum()])


def finish(sums) -> dict:
    """{'loss': mean loss, 'accuracy': fraction correct} of the counted examples (0 where none is: a
    pipeline's fill ticks finish no micro-batch)."""
    count = sums[2] + (sums[2] == 0)
    return {"loss": sums[0] / count, "accuracy": sums[1] / count}


def accuracy(logits, labels):
    """The fraction of examples whose largest logit is their label."""
    return (jnp.argmax(logits, -1) == labels).astype(jnp.float32).mean()


@register("classification")
def task() -> Task:
    return Task("classification", example_losses, metric_sums, SUM_NAMES, finish, ("loss", "accuracy"),
                label_shape=lambda input_shape: (), unit="images", headline="accuracy",
                short_names={"loss": "loss", "accuracy": "acc"}, rate_label="img_s", score=accuracy)

