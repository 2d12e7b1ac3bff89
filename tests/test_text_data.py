"""Text data: the embedded corpus (the same bytes everywhere), windows of next characters, and the
tensorflow-datasets text loaders against `tfds.testing.mock_data` (nothing is downloaded)."""
import hashlib
import importlib.resources
import threading
from unittest import mock

import numpy as np
import pytest
import tensorflow_datasets as tfds
from test_data import mock_tfds  # noqa: F401 - the fixture: tfds' storage faked, the loaders real

from cdpjax.data import REGISTRY
from cdpjax.data.base import stream_indices
from cdpjax.data.text import coriolanus_text, coriolanus_vocabulary, decode
from cdpjax.errors import ConfigError

CORIOLANUS_SHA256 = "275be51ae4b9460c2407a17f8900649300f63bb90c8bf53a5fd88cff6b07297f"
CORIOLANUS_CHARS = 154_469


def test_embedded_corpus_is_the_same_everywhere():
    raw = (importlib.resources.files("cdpjax.data") / "coriolanus.txt").read_bytes()
    assert len(raw) == CORIOLANUS_CHARS and hashlib.sha256(raw).hexdigest() == CORIOLANUS_SHA256
    text = coriolanus_text()
    assert text.startswith("First Citizen:\nBefore we proceed any further") and text.endswith("Assist.\n")
    vocabulary = coriolanus_vocabulary()
    assert len(vocabulary) == 61 and list(vocabulary) == sorted(set(text))


@pytest.mark.parametrize("window", [8, 32])
def test_windows_are_the_next_characters(window):
    """Example i of a split is text[s:s+T] with labels text[s+1:s+T+1], s = i (training, every
    position) or i*T (test, no overlap), the splits the first 90% and the last 10% of the text."""
    ds = REGISTRY["coriolanus"](window=window)
    text, vocabulary = coriolanus_text(), coriolanus_vocabulary()
    cut = int(len(text) * 0.9)
    splits = {"train": (text[:cut], 1), "test": (text[cut:], window)}
    assert (ds.num_train, ds.num_test) == (cut - window, (len(text) - cut - window - 1) // window + 1)
    assert (ds.input_shape, ds.label_shape, ds.num_classes, ds.task) == ((window,), (window,), 61,
                                                                        "language_modelling")
    for split, (part, stride) in splits.items():
        last = ds.num_train - 1 if split == "train" else ds.num_test - 1
        idx = np.array([0, 7, last])
        inputs, labels = ds.read(split, idx)
        assert inputs.shape == labels.shape == (3, window) and inputs.dtype == labels.dtype == np.int32
        for row, i in enumerate(idx):
            s = i * stride
            assert decode(inputs[row], vocabulary) == part[s:s + window]
            assert decode(labels[row], vocabulary) == part[s + 1:s + window + 1]
        assert (last + 1) * stride + window + 1 > len(part)  # no window left out


def test_batches_keep_token_ids_as_integers():
    ds = REGISTRY["coriolanus"](window=16)
    batch = ds.train_batch(3, 8, seed=2)  # augment=True: nothing to augment in text
    inputs, labels = ds.read("train", stream_indices(3, 8, ds.num_train, 2))
    np.testing.assert_array_equal(batch["image"], inputs)
    np.testing.assert_array_equal(batch["label"], labels)
    assert batch["image"].dtype == np.int32 and batch["label"].shape == (8, 16)
    tests = list(ds.test_batches(100))
    assert [int(t["mask"].sum()) for t in tests][-1] == ds.num_test % 100
    assert all(t["image"].dtype == np.int32 and t["label"].shape == (100, 16) for t in tests)


def test_byte_level_and_bad_options():
    ds = REGISTRY["coriolanus"](window=8, level="byte")
    text = coriolanus_text()
    assert ds.num_classes == 256
    np.testing.assert_array_equal(ds.read("train", [5])[0][0], np.frombuffer(text[5:13].encode(), np.uint8))
    with pytest.raises(ConfigError, match="level='word' is not one of char, byte"):
        REGISTRY["coriolanus"](level="word")
    with pytest.raises(ConfigError, match="window=0 must be a positive integer"):
        REGISTRY["coriolanus"](window=0)
    with pytest.raises(ConfigError, match="test split holds .* too few for one window"):
        REGISTRY["coriolanus"](window=20_000)


def _mocked_records(name, split, data_dir):
    """The mocked split's texts, read straight from tfds (not through the loader)."""
    source = tfds.data_source(name, split=split, data_dir=data_dir, download=False)
    return [source[i]["text"] for i in range(len(source))]


def test_tiny_shakespeare_reads_the_splits_without_download(mock_tfds):  # noqa: F811
    data_dir = mock_tfds(num_examples=6)
    with mock.patch.object(tfds, "data_source", wraps=tfds.data_source) as data_source:
        ds = REGISTRY["tiny_shakespeare"](data_dir=data_dir, window=8)
    calls = {c.kwargs["split"]: c.kwargs for c in data_source.call_args_list}
    assert set(calls) == {"train", "test"} and all(c["download"] is False for c in calls.values())
    train = "".join(_mocked_records("tiny_shakespeare", "train", data_dir))
    test = "".join(_mocked_records("tiny_shakespeare", "test", data_dir))
    vocabulary = "".join(sorted(set(train + test)))
    assert ds.num_classes == len(vocabulary) and ds.num_train == len(train) - 8
    inputs, labels = ds.read("train", np.array([0, 3]))
    assert decode(inputs[1], vocabulary) == train[3:11] and decode(labels[1], vocabulary) == train[4:12]
    inputs, _ = ds.read("test", np.array([1]))
    assert decode(inputs[0], vocabulary) == test[8:16]
    assert ds.train_batch(0, 4, 0)["image"].dtype == np.int32
    byte = REGISTRY["tiny_shakespeare"](data_dir=data_dir, window=8, level="byte")
    assert byte.num_classes == 256 and bytes(byte.read("train", [2])[0][0].tolist()) == train[2:10].encode()


def test_lm1b_windows_run_on_through_the_next_sentences(mock_tfds):  # noqa: F811
    data_dir = mock_tfds(num_examples=5)
    ds = REGISTRY["lm1b"](data_dir=data_dir, window=40)
    sentences = _mocked_records("lm1b", "train", data_dir)
    assert (ds.num_train, ds.num_classes, ds.input_shape) == (5, 256, (40,))
    stream = "".join(s + "\n" for s in sentences * 10).encode()  # wraps around past the last sentence
    starts = np.cumsum([0] + [len(s.encode()) + 1 for s in sentences])
    inputs, labels = ds.read("train", np.array([0, 4, 2]))
    for row, i in enumerate([0, 4, 2]):
        assert bytes(inputs[row].tolist()) == stream[starts[i]:starts[i] + 40]
        assert bytes(labels[row].tolist()) == stream[starts[i] + 1:starts[i] + 41]
    assert inputs.dtype == np.int32
    with pytest.raises(ConfigError, match="lm1b is read at byte level only"):
        REGISTRY["lm1b"](data_dir=data_dir, level="char")


def test_text_loaders_not_prepared_fail_fast_offline(tmp_path):
    results = {}

    def attempt():
        for name in ("tiny_shakespeare", "lm1b"):
            try:
                REGISTRY[name](data_dir=str(tmp_path))
            except ConfigError as e:
                results[name] = str(e)

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "the not-prepared check hung"
    for name in ("tiny_shakespeare", "lm1b"):
        assert "download_and_prepare" in results[name] and "array_record" in results[name]
    assert list(tmp_path.iterdir()) == []
