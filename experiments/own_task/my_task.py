"""A regression task of one's own, and a dataset for it, in the steps of docs/extending.md ("A task").

`ink` (a `cdpjax.tasks.Task`): one float target per example, the model's single output
`[B, 1]` its prediction; an example's loss is the squared error (MSE over the batch);
reported: `loss` (the MSE) and `mae`, the mean absolute error; labels float32, which
every method carries as they are (`Task.label_dtype`), and local learning's heads train
on this loss too (`cdpjax.models.aux_heads.task_loss`).

`digits_ink` (a dataset): scikit-learn's digits (the embedded `digits`), the target of an
image its ink, 10 x its mean pixel value in [0, 1] (about 3 on average: a float no
integer cast keeps).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from cdpjax import data, tasks
from cdpjax.data.base import Dataset
from cdpjax.data.digits import digits

SUM_NAMES = ("squared_error_sum", "absolute_error_sum", "count")


def ink(images) -> np.ndarray:
    """The target of each [0, 1] image: 10 x its mean pixel value, float32."""
    return (10.0 * np.asarray(images, np.float32).reshape(len(images), -1).mean(axis=1)).astype(np.float32)


def example_losses(outputs, targets):
    """[B] squared error of each example's single output."""
    return (outputs[..., 0] - targets) ** 2


def metric_sums(outputs, targets, mask=None):
    mask = jnp.ones(targets.shape[:1], jnp.float32) if mask is None else jnp.asarray(mask, jnp.float32)
    error = outputs[..., 0] - targets
    return jnp.stack([(error ** 2 * mask).sum(), (jnp.abs(error) * mask).sum(), mask.sum()])


def finish(sums) -> dict:
    count = sums[2] + (sums[2] == 0)
    return {"loss": sums[0] / count, "mae": sums[1] / count}


@tasks.register("ink")
def ink_task() -> tasks.Task:
    return tasks.Task("ink", example_losses, metric_sums, SUM_NAMES, finish, ("loss", "mae"),
                      label_shape=lambda input_shape: (), unit="images", headline="loss",
                      short_names={"loss": "mse", "mae": "mae"}, rate_label="img_s", label_dtype="float32")


@data.register("digits_ink")
def digits_ink(**kwargs) -> Dataset:
    base = digits(**kwargs)

    def read(split, indices):
        images, _ = base.read(split, indices)
        return images, ink(images)

    return Dataset(name="digits_ink", image_shape=base.image_shape, num_classes=1, num_train=base.num_train,
                   num_test=base.num_test, read=read, augment=None, mean=base.mean, std=base.std, task="ink",
                   label_dtype="float32")
