"""Text as token windows for language modelling, and `coriolanus`, the embedded corpus.

A text is encoded to token ids, character level (the vocabulary: the corpus' own
characters, sorted by code point) or byte level (its UTF-8 bytes, 256 symbols).
Example i of a split is the window of T + 1 tokens starting at position
i * stride: its first T tokens are the input (int32 ids `[T]`), its last T the
labels (the next token at each position). Training windows start at every
position (stride 1) unless `train_stride` says otherwise; test windows do not
overlap (stride T), so every test token but the last few is predicted exactly
once and the test loss is the split's per-token loss.

`coriolanus`: Shakespeare's *Coriolanus* as it opens karpathy/char-rnn's
`data/tinyshakespeare/input.txt` (its first 154,469 characters, up to where
*Richard III* begins): 61 ASCII symbols. Shakespeare's text is in the public domain;
the file comes from a repository under the MIT licence. It is shipped in this package
(`cdpjax/data/coriolanus.txt`), so it needs no download and is the same on every
machine (tests/test_text_data.py checks its length and SHA-256). The first 90% of
its characters are the training split, the last 10% the test split.
"""
from __future__ import annotations

import functools

import numpy as np

from cdpjax.data.base import Dataset
from cdpjax.errors import ConfigError

LEVELS = ("char", "byte")
TRAIN_FRACTION = 0.9
CORIOLANUS_FILE = "coriolanus.txt"


def char_vocabulary(*texts: str) -> str:
    """Every character of `texts`, once, in code-point order: id k is the k-th."""
    return "".join(sorted(set().union(*map(set, texts))))


def encode_chars(text: str, vocabulary: str) -> np.ndarray:
    """int32 ids of `text`'s characters in `vocabulary` (each must be in it)."""
    points = np.frombuffer(text.encode("utf-32-le"), np.uint32)
    table = np.frombuffer(vocabulary.encode("utf-32-le"), np.uint32)
    ids = np.searchsorted(table, points)
    if len(points) and (ids.max() >= len(table) or not np.array_equal(table[ids], points)):
        missing = sorted(set(text) - set(vocabulary))
        raise ConfigError(f"characters {''.join(missing[:10])!r} are not in the vocabulary of {len(vocabulary)}")
    return ids.astype(np.int32)


def encode_bytes(text: str | bytes) -> np.ndarray:
    """int32 ids of the UTF-8 bytes of `text`."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return np.frombuffer(data, np.uint8).astype(np.int32)


def decode(ids, vocabulary: str | None = None) -> str:
    """Text of `ids`: characters of `vocabulary`, or UTF-8 bytes when it is None."""
    ids = np.asarray(ids).reshape(-1)
    if vocabulary is None:
        return bytes(ids.astype(np.uint8).tolist()).decode("utf-8", errors="replace")
    return "".join(vocabulary[i] for i in ids)


def check_level(level: str) -> None:
    if level not in LEVELS:
        raise ConfigError(f"dataset_kwargs.level={level!r} is not one of {', '.join(LEVELS)}")


def num_windows(length: int, window: int, stride: int) -> int:
    """Windows of window + 1 tokens at positions 0, stride, 2 stride, ... inside `length` tokens."""
    return max(0, (length - window - 1) // stride + 1)


def read_windows(ids: np.ndarray, window: int, stride: int, indices) -> tuple[np.ndarray, np.ndarray]:
    """(inputs [n, T], labels [n, T]) int32 of windows `indices` (labels: inputs shifted by one)."""
    starts = np.asarray(indices, np.int64).reshape(-1) * stride
    tokens = ids[starts[:, None] + np.arange(window + 1)] if len(starts) else np.zeros((0, window + 1), np.int32)
    return tokens[:, :-1].astype(np.int32), tokens[:, 1:].astype(np.int32)


def token_dataset(name: str, splits: dict, vocab_size: int, window: int, train_stride: int = 1) -> Dataset:
    """A language-modelling `Dataset` over token-id arrays {'train': ids, 'test': ids}: windows of
    `window` inputs, training ones every `train_stride` tokens, test ones every `window`."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConfigError(f"dataset_kwargs.window={window!r} must be a positive integer (tokens per example)")
    if isinstance(train_stride, bool) or not isinstance(train_stride, int) or train_stride < 1:
        raise ConfigError(f"dataset_kwargs.train_stride={train_stride!r} must be a positive integer")
    strides = {"train": train_stride, "test": window}
    counts = {split: num_windows(len(splits[split]), window, strides[split]) for split in ("train", "test")}
    for split, count in counts.items():
        if not count:
            raise ConfigError(f"dataset {name!r}: its {split} split holds {len(splits[split])} tokens, too few for "
                              f"one window of {window} + 1: lower dataset_kwargs.window")

    def read(split, indices):
        return read_windows(splits[split], window, strides[split], indices)

    return Dataset(name, (window,), vocab_size, counts["train"], counts["test"], read, input_dtype="int32",
                   label_shape=(window,), task="language_modelling")


def text_splits(train: str, test: str, level: str) -> tuple[dict, str | None]:
    """({'train': ids, 'test': ids}, vocabulary) of two texts; the vocabulary is None at byte level."""
    check_level(level)
    if level == "byte":
        return {"train": encode_bytes(train), "test": encode_bytes(test)}, None
    vocabulary = char_vocabulary(train, test)
    return {"train": encode_chars(train, vocabulary), "test": encode_chars(test, vocabulary)}, vocabulary


@functools.lru_cache(maxsize=1)
def coriolanus_text() -> str:
    """The embedded corpus (module docstring), as shipped."""
    import importlib.resources

    return (importlib.resources.files("cdpjax.data") / CORIOLANUS_FILE).read_text(encoding="utf-8")


def coriolanus(window: int = 32, level: str = "char", train_stride: int = 1, **_) -> Dataset:
    """The embedded corpus: `window` tokens per example, 'char' (61 symbols) or 'byte' level
    (`data_dir` is ignored: nothing is read from disk but the package)."""
    text = coriolanus_text()
    cut = int(len(text) * TRAIN_FRACTION)
    splits, vocabulary = text_splits(text[:cut], text[cut:], level)
    return token_dataset("coriolanus", splits, 256 if vocabulary is None else len(vocabulary), window,
                         train_stride)


def coriolanus_vocabulary() -> str:
    """The characters of the embedded corpus, id k the k-th (for `decode`)."""
    return char_vocabulary(coriolanus_text())
