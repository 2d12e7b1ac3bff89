"""Random images of a given shape and class count, for benchmarks (no learning signal)."""
from __future__ import annotations

import numpy as np

from cdpjax.data.base import Dataset


def synthetic(image_shape=(32, 32, 3), num_classes: int = 10, num_train: int = 4096, num_test: int = 512,
              **_) -> Dataset:
    image_shape = tuple(int(s) for s in image_shape)

    def read(split, idx):
        offset = 0 if split == "train" else 10**9
        images = np.stack([
            np.random.default_rng(offset + int(i)).standard_normal(image_shape, np.float32) for i in idx
        ]) if len(idx) else np.zeros((0, *image_shape), np.float32)
        labels = (np.asarray(idx) * 7919 + offset) % num_classes
        return images, labels.astype(np.int32)

    return Dataset("synthetic", image_shape, num_classes, num_train, num_test, read)
