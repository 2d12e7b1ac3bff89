"""Data: the exactly-once stream, the embedded digits, and the tensorflow-datasets loaders.

The tfds loaders run against `tfds.testing.mock_data` (no dataset can be
downloaded here): the real loader code runs, and only tfds' storage is faked.
"""
import contextlib
import importlib
import math
import threading
from unittest import mock

import numpy as np
import pytest
import tensorflow_datasets as tfds
from tensorflow_datasets.testing import mocking

from cdpjax.config import ConfigError, default_config
from cdpjax.data import REGISTRY, build
from cdpjax.data.base import Dataset, stream_indices
from cdpjax.data.tfds_data import (IMAGENET_CROP, SPECS, random_resized_crop_box, random_resized_crop_flip,
                                   resize_center_crop)

TFDS_NAMES = ["cifar10", "svhn_cropped", "stl10", "imagenet2012"]
# The evaluation split of each dataset, and the crop recipe (padding, flip) of the papers.
TEST_SPLITS = {"cifar10": "test", "svhn_cropped": "test", "stl10": "test", "imagenet2012": "validation"}
CROP_RECIPES = {"cifar10": (4, True), "svhn_cropped": (4, False), "stl10": (12, True)}


def index_dataset(n: int) -> Dataset:
    """A dataset whose labels are the example indices, to see exactly what the stream reads."""
    def read(split, idx):
        idx = np.asarray(idx)
        return np.zeros((len(idx), 1, 1, 1), np.float32), idx + (0 if split == "train" else 10**6)

    return Dataset("ids", (1, 1, 1), num_classes=n, num_train=n, num_test=n, read=read)


# ---------------------------------------------------------------- the stream


@pytest.mark.parametrize("batch", [1, 5, 10, 20, 3, 7, 13, 25])
def test_stream_exactly_once_per_epoch(batch):
    n, seed = 10, 3
    period = math.lcm(batch, n) // batch  # batches per whole number of epochs
    for start in (0, period, 3 * period):  # windows of batches that cover whole epochs exactly
        window = np.concatenate([stream_indices(s, batch, n, seed) for s in range(start, start + period)])
        np.testing.assert_array_equal(np.bincount(window, minlength=n), np.full(n, period * batch // n))
    # Inside the stream every epoch is one permutation, whatever the batch straddles.
    stream = np.concatenate([stream_indices(s, batch, n, seed) for s in range(4 * period)])
    epochs = stream.reshape(-1, n)
    for e in epochs:
        np.testing.assert_array_equal(np.sort(e), np.arange(n))
    assert len({tuple(e) for e in epochs}) > 1  # reshuffled per epoch
    # Any window of consecutive batches sees each index between #whole and #touched epochs times.
    for start in range(2 * period + 1):
        for length in (1, 2, period + 1):
            lo, hi = start * batch, (start + length) * batch
            counts = np.bincount(stream[lo:hi], minlength=n)
            whole = max(0, hi // n - math.ceil(lo / n))
            touched = math.ceil(hi / n) - lo // n
            assert counts.min() >= whole and counts.max() <= touched


def test_stream_depends_on_seed_and_step_only():
    np.testing.assert_array_equal(stream_indices(7, 6, 50, 1), stream_indices(7, 6, 50, 1))
    assert not np.array_equal(stream_indices(7, 6, 50, 1), stream_indices(7, 6, 50, 2))
    assert not np.array_equal(stream_indices(7, 6, 50, 1), stream_indices(8, 6, 50, 1))


@pytest.mark.parametrize("process_count", [1, 2, 4, 8])
@pytest.mark.parametrize("step", [0, 5, 13])
def test_process_slices_disjoint_and_cover_global_batch(process_count, step):
    n, batch, seed = 37, 16, 0  # 16 does not divide 37: step 2 straddles two epochs
    ds = index_dataset(n)
    slices = [ds.train_batch(step, batch, seed, process_index=p, process_count=process_count)["label"]
              for p in range(process_count)]
    assert all(len(s) == batch // process_count for s in slices)
    # Concatenated in process order they are the global batch: disjoint, covering, and ordered.
    np.testing.assert_array_equal(np.concatenate(slices), stream_indices(step, batch, n, seed))


def test_train_batch_deterministic():
    ds = REGISTRY["digits"]()
    a, b = ds.train_batch(4, 32, seed=7), ds.train_batch(4, 32, seed=7)
    np.testing.assert_array_equal(a["image"], b["image"])
    np.testing.assert_array_equal(a["label"], b["label"])
    assert a["image"].dtype == np.float32 and a["label"].dtype == np.int32
    assert not np.array_equal(a["image"], ds.train_batch(5, 32, seed=7)["image"])
    assert not np.array_equal(a["image"], ds.train_batch(4, 32, seed=8)["image"])
    # Augmentation draws per (seed, step, process): same examples, different crops.
    plain = ds.train_batch(4, 32, seed=7, augment=False)
    np.testing.assert_array_equal(plain["label"], a["label"])
    assert not np.array_equal(plain["image"], a["image"])


@pytest.mark.parametrize("batch", [64, 100, 300, 512])
def test_test_batches_pad_and_mask(batch):
    ds = REGISTRY["digits"]()
    batches = list(ds.test_batches(batch))
    assert len(batches) == math.ceil(300 / batch)
    assert all(b["image"].shape == (batch, 8, 8, 1) and b["mask"].shape == (batch,) for b in batches)
    mask = np.concatenate([b["mask"] for b in batches])
    np.testing.assert_array_equal(mask, (np.arange(len(mask)) < 300).astype(np.float32))
    labels = np.concatenate([b["label"] for b in batches])[mask > 0]
    np.testing.assert_array_equal(labels, ds.read("test", np.arange(300))[1])
    images = np.concatenate([b["image"] for b in batches])[mask > 0]
    np.testing.assert_allclose(images, ds._normalise(ds.read("test", np.arange(300))[0]), atol=1e-6)
    limited = list(ds.test_batches(64, limit=70))
    assert len(limited) == 2 and limited[1]["mask"].sum() == 6


# ---------------------------------------------------------------- digits


def test_digits_split_fixed():
    from sklearn.datasets import load_digits

    digits_module = importlib.import_module("cdpjax.data.digits")  # the package exports the function

    ds = REGISTRY["digits"]()
    assert (ds.num_train, ds.num_test, ds.image_shape, ds.num_classes) == (1497, 300, (8, 8, 1), 10)
    train = ds.read("train", np.arange(1497))
    test = ds.read("test", np.arange(300))
    # Disjoint and covering: together they are scikit-learn's 1,797 images, each once.
    full = load_digits()
    ours = np.concatenate([train[0], test[0]]).reshape(1797, -1) * 16.0
    key = lambda a: np.lexsort(a.T)  # noqa: E731
    np.testing.assert_array_equal(ours[key(ours)], full.data[key(full.data)])
    # Fixed: rebuilding from scratch gives the same split, and it is pinned.
    digits_module._arrays.cache_clear()
    again = REGISTRY["digits"]().read("test", np.arange(300))
    np.testing.assert_array_equal(again[0], test[0])
    np.testing.assert_array_equal(test[1][:12], PINNED_DIGITS_TEST_LABELS)
    np.testing.assert_array_equal(np.bincount(test[1], minlength=10), PINNED_DIGITS_TEST_COUNTS)


# The first test labels and the class counts of the fixed split (seed 1797): a changed split fails here.
PINNED_DIGITS_TEST_LABELS = [5, 7, 6, 5, 7, 0, 5, 3, 4, 5, 9, 3]
PINNED_DIGITS_TEST_COUNTS = [24, 26, 34, 30, 33, 41, 28, 33, 23, 28]


# ---------------------------------------------------------------- tfds loaders


def _getitems(record_keys, generator, serialized=False):
    return [mocking._getitem(None, k, generator, serialized) for k in record_keys]


@pytest.fixture
def mock_tfds(tmp_path):
    """`tfds.testing.mock_data` made to work with the real loader code.

    Two holes in the mock are patched: it redirects every builder to a data_dir
    that does not exist, so `is_prepared()` would say False; and its batched
    `__getitems__` is installed as a plain attribute of a MagicMock, so it is
    called without `self` and fails. Everything else (builder, `data_source`,
    `ArrayRecordDataSource`, the loaders) is the real code.
    """
    def enter(num_examples):
        stack.enter_context(tfds.testing.mock_data(num_examples=num_examples))
        stack.enter_context(mock.patch.object(tfds.core.DatasetBuilder, "is_prepared", return_value=True))
        stack.enter_context(mock.patch.object(mocking, "_getitems", _getitems))
        return str(tmp_path)

    with contextlib.ExitStack() as stack:
        yield enter


@pytest.mark.parametrize("name", TFDS_NAMES)
def test_tfds_loader_reads_and_augments(name, mock_tfds):
    data_dir = mock_tfds(num_examples=21)
    spec = SPECS[name]
    with mock.patch.object(tfds, "data_source", wraps=tfds.data_source) as data_source:
        ds = REGISTRY[name](data_dir=data_dir)
    # The splits the papers evaluate on, read without any download.
    calls = {c.kwargs["split"]: c.kwargs for c in data_source.call_args_list}
    assert set(calls) == {"train", TEST_SPLITS[name]}
    assert all(c["download"] is False and c["data_dir"] == data_dir for c in calls.values())
    assert (ds.num_train, ds.num_test, ds.image_shape) == (21, 21, spec.image_shape)

    images, labels = ds.read("train", np.array([3, 0, 20]))
    assert images.shape == (3, *spec.image_shape) and images.dtype == np.uint8
    assert labels.dtype == np.int32 and labels.min() >= 0 and labels.max() < spec.num_classes
    assert ds.read("test", np.array([], np.int64))[0].shape == (0, *spec.image_shape)

    # Un-augmented: exactly the stored images, normalised with the dataset's mean and std.
    plain = ds.train_batch(2, 8, seed=1, augment=False)
    idx = stream_indices(2, 8, 21, 1)
    raw, raw_labels = ds.read("train", idx)
    mean, std = np.asarray(spec.mean) * 255, np.asarray(spec.std) * 255
    np.testing.assert_allclose(plain["image"], (raw - mean) / std, atol=1e-5)
    np.testing.assert_array_equal(plain["label"], raw_labels)

    batch = ds.train_batch(2, 8, seed=1)
    assert batch["image"].shape == (8, *spec.image_shape) and batch["image"].dtype == np.float32
    assert batch["label"].dtype == np.int32
    np.testing.assert_array_equal(batch["label"], raw_labels)
    np.testing.assert_array_equal(batch["image"], ds.train_batch(2, 8, seed=1)["image"])
    assert not np.array_equal(batch["image"], plain["image"])

    tests = list(ds.test_batches(8))
    assert [int(t["mask"].sum()) for t in tests] == [8, 8, 5]
    assert all(t["image"].shape == (8, *spec.image_shape) for t in tests)


@pytest.mark.parametrize("name", ["cifar10", "svhn_cropped", "stl10"])
def test_tfds_crop_recipe(name, mock_tfds):
    """Every augmented image is a crop of the zero-padded original, mirrored only where the recipe flips."""
    ds = REGISTRY[name](data_dir=mock_tfds(num_examples=6))
    pad, flip = CROP_RECIPES[name]
    h, w, _ = SPECS[name].image_shape
    idx = stream_indices(0, 6, 6, 0)
    raw = ds.read("train", idx)[0].astype(np.float32)
    augmented = ds.augment(raw.copy(), np.random.default_rng(0))
    padded = np.pad(raw, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    crops = {(dy, dx, f): padded[:, dy:dy + h, dx:dx + w, :][:, :, ::-1 if f else 1]
             for dy in range(2 * pad + 1) for dx in range(2 * pad + 1) for f in (False, True)}
    shifts, flips = set(), set()
    for k in range(len(raw)):
        found = [key for key, crop in crops.items() if np.array_equal(augmented[k], crop[k])]
        assert found, f"image {k} is not a padded crop of its original"
        shifts |= {(dy, dx) for dy, dx, _ in found}
        flips |= {f for _, _, f in found}
    assert len(shifts) > 1
    assert flips == ({False, True} if flip else {False})
    # The padding is exactly `pad`: on blank images the largest zero border seen is `pad` on every side.
    blank = ds.augment(np.ones((300, h, w, 3), np.float32), np.random.default_rng(1))
    rows, cols = blank[..., 0].max(axis=2) == 0, blank[..., 0].max(axis=1) == 0
    for border in (rows, rows[:, ::-1], cols, cols[:, ::-1]):
        assert np.argmin(border, axis=1).max() == pad


def test_imagenet_transforms():
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (256, 300, 3), dtype=np.uint8)
    # Shorter side already 256: the test transform is the exact centre crop.
    np.testing.assert_array_equal(resize_center_crop(image), image[16:240, 38:262])
    portrait = rng.integers(0, 256, (500, 375, 3), dtype=np.uint8)
    assert resize_center_crop(portrait).shape == (IMAGENET_CROP, IMAGENET_CROP, 3)
    for h, w in [(500, 375), (64, 640), (640, 64), (224, 224)]:
        for _ in range(200):
            top, left, ch, cw = random_resized_crop_box(h, w, rng)
            assert 0 <= top and top + ch <= h and 0 <= left and left + cw <= w
            if (h, w) == (500, 375):  # room for every draw: the recipe's ranges hold (up to rounding)
                assert 0.08 * h * w * 0.98 <= ch * cw <= h * w
                assert 3 / 4 * 0.98 <= cw / ch <= 4 / 3 * 1.02
    # A thin image has no room for a crop of its whole area at aspect <= 4/3: the fallback is
    # the centred crop with the aspect clamped to 4/3 (and to 3/4 for a tall one).
    assert random_resized_crop_box(64, 640, rng, scale=(1.0, 1.0)) == (0, (640 - 85) // 2, 64, 85)
    assert random_resized_crop_box(640, 64, rng, scale=(1.0, 1.0)) == ((640 - 85) // 2, 0, 85, 64)
    # On a left-to-right ramp a kept crop still rises to the right and a mirrored one falls: both occur.
    ramp = np.broadcast_to(np.linspace(0, 255, 300).astype(np.uint8)[None, :, None], (256, 300, 3)).copy()
    slopes = []
    for seed in range(40):
        out = random_resized_crop_flip(ramp, np.random.default_rng(seed))
        assert out.shape == (IMAGENET_CROP, IMAGENET_CROP, 3) and out.dtype == np.float32
        step = np.diff(out[IMAGENET_CROP // 2, :, 0])
        assert (step >= 0).all() or (step <= 0).all()
        slopes.append(np.sign(out[0, -1, 0] - out[0, 0, 0]))
    assert 10 <= slopes.count(-1) <= 30 and slopes.count(0) == 0


def test_tfds_not_prepared_fails_fast_offline(tmp_path):
    """An empty data_dir: a ConfigError that says how to prepare the data, not a download or a hang."""
    results = {}

    def attempt():
        for name in TFDS_NAMES:
            try:
                REGISTRY[name](data_dir=str(tmp_path))
            except ConfigError as e:
                results[name] = str(e)
        config = default_config()
        config.dataset, config.data_dir = "cifar10", str(tmp_path)
        try:
            build(config)
        except ConfigError as e:
            results["build"] = str(e)

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "the not-prepared check hung"
    assert set(results) == {*TFDS_NAMES, "build"}
    for name in TFDS_NAMES:
        assert "download_and_prepare" in results[name] and str(tmp_path) in results[name]
        assert "array_record" in results[name]
    assert "ILSVRC2012_img_train.tar" in results["imagenet2012"]
    assert list(tmp_path.iterdir()) == []  # nothing was written


def test_tfds_wrong_format_and_kwargs(tmp_path):
    # Prepared, but as tfrecord (the default without file_format): no random access.
    with mock.patch.object(tfds.core.DatasetBuilder, "is_prepared", return_value=True):
        with pytest.raises(ConfigError, match="array_record"):
            REGISTRY["cifar10"](data_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="data_dirr"):
        REGISTRY["stl10"](data_dirr=str(tmp_path))
