"""The dataset interface and the exactly-once sample stream.

A `Dataset` gives random access to its examples (numpy, no TensorFlow). The
training stream concatenates one seeded permutation per epoch, and batch k is
positions [k*B, (k+1)*B) of that stream: every training example is seen exactly
once per epoch whatever the batch size, a batch may straddle two epochs, and
the data position of a run is its step number alone (so resume needs nothing
else). Each process of a multi-host run reads its own contiguous slice of the
global batch.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np


@dataclasses.dataclass
class Dataset:
    """Random-access examples.

    Whatever the inputs are (images, token ids), a batch holds them under `image`, the key
    every method reads.

    Attributes:
      name: registry name.
      image_shape: one example's input shape after preprocessing ((H, W, C) images, (T,) token
        windows); `input_shape` is the same.
      num_classes: number of labels (a language model's vocabulary).
      num_train, num_test: split sizes.
      read: read(split, indices) -> (inputs [n, ...]: uint8 or float images, or integer token ids;
        int labels [n, *label_shape]); unaugmented.
      augment: augment(images float32 [n,H,W,C], rng: np.random.Generator) -> images; the papers' recipe.
      mean, std: per-channel normalisation applied after augmentation.
      read_augmented: optional read_augmented(indices, rng) -> (float32 images, labels): reads and
        augments training examples together, replacing read + augment in `train_batch`, for
        datasets whose augmentation needs the raw image (ImageNet's random resized crop of images
        of varying size).
      input_dtype: the dtype inputs reach the model in: 'float32' (images, normalised with mean
        and std after augmentation) or an integer dtype (token ids, passed as they are).
      label_shape: one example's label shape: () for a class, (T,) for a window's next tokens.
      task: the `cdpjax.tasks` name this dataset is for (`config.task` '' takes it).
      label_dtype: the labels' dtype in a batch ('int32' class ids or token ids; 'float32'
        regression targets): the task's `label_dtype`.
    """

    name: str
    image_shape: tuple[int, int, int]
    num_classes: int
    num_train: int
    num_test: int
    read: Callable[[str, np.ndarray], tuple[np.ndarray, np.ndarray]]
    augment: Callable | None = None
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    read_augmented: Callable | None = None
    input_dtype: str = "float32"
    label_shape: tuple[int, ...] = ()
    task: str = "classification"
    label_dtype: str = "int32"

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.image_shape)

    @property
    def image_inputs(self) -> bool:
        """Whether the inputs are images (floating: cast, augmented, normalised), not token ids."""
        return np.issubdtype(np.dtype(self.input_dtype), np.floating)

    def _normalise(self, images: np.ndarray) -> np.ndarray:
        if not self.image_inputs:
            return np.asarray(images, self.input_dtype)
        images = images.astype(np.float32)
        return (images - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)

    def train_batch(self, step: int, global_batch: int, seed: int, augment: bool = True,
                    process_index: int = 0, process_count: int = 1) -> dict:
        """Batch `step` of the training stream (this process's slice of it)."""
        idx = stream_indices(step, global_batch, self.num_train, seed)
        per_process = global_batch // process_count
        idx = idx[process_index * per_process:(process_index + 1) * per_process]
        rng = np.random.default_rng([seed, step, process_index, 1])
        if augment and self.read_augmented is not None:
            images, labels = self.read_augmented(idx, rng)
        else:
            images, labels = self.read("train", idx)
            images = images.astype(np.float32) if self.image_inputs else images
            if augment and self.augment is not None:
                images = self.augment(images, rng)
        return {"image": self._normalise(images), "label": labels.astype(self.label_dtype)}

    def test_batches(self, batch_size: int, limit: int | None = None):
        """The test split in order, the last batch padded and masked (`mask` is 0 for padding)."""
        n = self.num_test if limit is None else min(limit, self.num_test)
        for start in range(0, n, batch_size):
            idx = np.arange(start, min(start + batch_size, n))
            images, labels = self.read("test", idx)
            pad = batch_size - len(idx)
            mask = np.concatenate([np.ones(len(idx), np.float32), np.zeros(pad, np.float32)])
            if pad:
                images = np.concatenate([images, np.repeat(images[-1:], pad, 0)])
                labels = np.concatenate([labels, np.repeat(labels[-1:], pad, 0)])
            yield {"image": self._normalise(images), "label": labels.astype(self.label_dtype), "mask": mask}


def epoch_permutation(epoch: int, num_examples: int, seed: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch, 0]).permutation(num_examples)


def stream_indices(step: int, global_batch: int, num_examples: int, seed: int) -> np.ndarray:
    """Example indices at stream positions [step*B, (step+1)*B)."""
    positions = np.arange(step * global_batch, (step + 1) * global_batch)
    epochs = positions // num_examples
    out = np.empty(global_batch, np.int64)
    for e in np.unique(epochs):
        sel = epochs == e
        out[sel] = epoch_permutation(int(e), num_examples, seed)[positions[sel] % num_examples]
    return out


PADDING_MODES = ("zeros", "reflect")


def random_crop_flip(images: np.ndarray, rng: np.random.Generator, pad: int = 4, flip: bool = True,
                     mode: str = "zeros") -> np.ndarray:
    """Random crop of the image padded by `pad` on every side, and random horizontal flip (the
    CIFAR recipe). `mode`: 'zeros' (torchvision's `RandomCrop(padding=pad)`) or 'reflect' (the
    border mirrored without repeating the edge pixel, PyTorch's `F.pad(mode='reflect')`, which
    PPLL's and InfoPro's CIFAR code apply before `RandomCrop`)."""
    if mode not in PADDING_MODES:
        raise ValueError(f"padding mode {mode!r} is not one of {', '.join(PADDING_MODES)}")
    n, h, w, _ = images.shape
    padded = np.pad(images, ((0, 0), (pad, pad), (pad, pad), (0, 0)), mode="constant" if mode == "zeros" else "reflect")
    dy = rng.integers(0, 2 * pad + 1, n)
    dx = rng.integers(0, 2 * pad + 1, n)
    out = np.stack([padded[i, dy[i]:dy[i] + h, dx[i]:dx[i] + w] for i in range(n)])
    if flip:
        flips = rng.random(n) < 0.5
        out[flips] = out[flips, :, ::-1]
    return out
