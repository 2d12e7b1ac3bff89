"""tensorflow-datasets text loaders for language modelling: `tiny_shakespeare`, `lm1b`.

Read as the image loaders of `cdpjax.data.tfds_data` are: by random access through
`tfds.data_source` (array_record files) with `download=False`, from a dataset
prepared beforehand (a `ConfigError` says how: `download_and_prepare(file_format=
'array_record')`, TensorFlow and the internet needed once); `tfds.load` is never
called. Examples are token windows as in `cdpjax.data.text` (input ids `[T]`, the
next ids as labels; task `language_modelling`).

- `tiny_shakespeare` (karpathy/char-rnn's 1,115,394 characters, tfds's 90/5/5 split
  into 'train', 'validation' and 'test', each one record): the records of a split
  are joined in order and cut into windows, training ones every `train_stride`
  characters, test ones every `window`. `level='char'`: the vocabulary is the
  characters of the training and test splits read (65 for the whole text); 'byte':
  UTF-8 bytes (256 ids).
- `lm1b` (the One Billion Word benchmark: 30,301,028 training sentences, 306,688
  held out in 'test'), byte level (a character vocabulary would need a pass over
  every sentence first): window i starts at sentence i and runs on through the
  sentences after it, each ended by a newline, so every sentence starts one window
  and no window is padded; the last windows wrap around to the split's first
  sentences.
"""
from __future__ import annotations

import numpy as np

from cdpjax.data.base import Dataset
from cdpjax.data.text import check_level, encode_bytes, text_splits, token_dataset
from cdpjax.data.tfds_data import _open, _records
from cdpjax.errors import ConfigError

def _text(record) -> str:
    text = record["text"]
    return text.decode("utf-8") if isinstance(text, (bytes, np.bytes_)) else str(text)


def _whole_split(source) -> str:
    """Every record of a split, joined in order."""
    return "".join(_text(r) for r in _records(source, range(len(source))))


def tiny_shakespeare(data_dir: str | None = None, window: int = 256, level: str = "char", train_stride: int = 1,
                     train_split: str = "train", test_split: str = "test") -> Dataset:
    """tiny_shakespeare as character (or byte) windows; see the module docstring."""
    check_level(level)
    sources = _open("tiny_shakespeare", {"train": train_split, "test": test_split}, data_dir or None)
    splits, vocabulary = text_splits(_whole_split(sources["train"]), _whole_split(sources["test"]), level)
    return token_dataset("tiny_shakespeare", splits, 256 if vocabulary is None else len(vocabulary), window,
                         train_stride)


def sentence_windows(source, indices, window: int) -> np.ndarray:
    """[n, window + 1] byte ids: for each index i, sentences i, i+1, ... each ended by a newline,
    cut to window + 1 bytes (wrapping past the last sentence). Reads sentences in batched rounds."""
    count = len(source)
    pending = {k: (int(i), b"") for k, i in enumerate(np.asarray(indices).reshape(-1))}
    done = {}
    while pending:
        keys = list(pending)
        records = _records(source, [pending[k][0] % count for k in keys])
        for k, record in zip(keys, records):
            nxt, text = pending[k]
            text += _text(record).encode("utf-8") + b"\n"
            if len(text) > window:
                done[k] = text[:window + 1]
                del pending[k]
            else:
                pending[k] = (nxt + 1, text)
    return np.stack([encode_bytes(done[k]) for k in range(len(done))]) if done else np.zeros((0, window + 1),
                                                                                             np.int32)


def lm1b(data_dir: str | None = None, window: int = 128, level: str = "byte", train_split: str = "train",
         test_split: str = "test") -> Dataset:
    """lm1b as byte windows starting at every sentence; see the module docstring."""
    if level != "byte":
        raise ConfigError(f"dataset_kwargs.level={level!r}: lm1b is read at byte level only (a character "
                          f"vocabulary would need a pass over its 30M sentences first): set level='byte'")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConfigError(f"dataset_kwargs.window={window!r} must be a positive integer (tokens per example)")
    sources = _open("lm1b", {"train": train_split, "test": test_split}, data_dir or None)
    for split, source in sources.items():
        if not len(source):
            name = train_split if split == "train" else test_split
            raise ConfigError(f"dataset 'lm1b': its {split} split ({name!r}) holds no sentences")

    def read(split, indices):
        tokens = sentence_windows(sources[split], indices, window)
        return tokens[:, :-1], tokens[:, 1:]

    return Dataset("lm1b", (window,), 256, len(sources["train"]), len(sources["test"]), read, input_dtype="int32",
                   label_shape=(window,), task="language_modelling")


TFDS_TEXT_DATASETS = {"tiny_shakespeare": tiny_shakespeare, "lm1b": lm1b}
