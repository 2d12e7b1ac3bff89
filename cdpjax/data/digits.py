"""scikit-learn's handwritten digits (1,797 real 8x8 images, 10 classes): the embedded default.

Shipped inside scikit-learn, so it needs no download. Split with a fixed seed
into 1,497 training and 300 test images; pixel values 0..16 are scaled to [0, 1].
"""
from __future__ import annotations

import functools

import numpy as np

from cdpjax.data.base import Dataset, random_crop_flip

NUM_TEST = 300


@functools.lru_cache(maxsize=1)
def _arrays():
    from sklearn.datasets import load_digits

    d = load_digits()
    images = (d.images.astype(np.float32) / 16.0)[..., None]
    labels = d.target.astype(np.int32)
    order = np.random.default_rng(1797).permutation(len(labels))
    test, train = order[:NUM_TEST], order[NUM_TEST:]
    return {"train": (images[train], labels[train]), "test": (images[test], labels[test])}


def _read(split, idx):
    images, labels = _arrays()[split]
    return images[idx], labels[idx]


def _augment(images, rng):
    # 8x8 digits: a one-pixel shift; no flip (digits are not mirror-symmetric).
    return random_crop_flip(images, rng, pad=1, flip=False)


def digits(**_) -> Dataset:
    arrays = _arrays()
    return Dataset(
        name="digits",
        image_shape=(8, 8, 1),
        num_classes=10,
        num_train=len(arrays["train"][1]),
        num_test=len(arrays["test"][1]),
        read=_read,
        augment=_augment,
        mean=(0.3,),
        std=(0.4,),
    )
