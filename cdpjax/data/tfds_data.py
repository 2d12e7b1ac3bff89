"""tensorflow-datasets loaders (cifar10, svhn_cropped, stl10, imagenet2012) without TensorFlow.

Examples are read by random access through `tfds.data_source` (array_record
files, decoded to numpy by tfds with PIL), so the exactly-once stream of
`cdpjax.data.base` applies unchanged. Reading needs a dataset prepared
beforehand in the array_record format: preparing it needs TensorFlow and the
internet (or, for ImageNet, the manually downloaded archives), reading does not.
A dataset that is not prepared raises `ConfigError` with the command that
prepares it; the check looks at `data_dir` only (`DatasetBuilder.is_prepared`)
and `data_source` is called with `download=False`, so nothing ever touches the
network and nothing hangs offline. `tfds.load` is never called (it needs
TensorFlow, and offline it hangs).

Augmentation, as in the papers' code:

| dataset | training | test |
|---|---|---|
| cifar10 (32x32) | random crop, zero padding 4; horizontal flip | as is |
| svhn_cropped (32x32) | random crop, zero padding 4; no flip (a mirrored digit is another glyph) | as is |
| stl10 (96x96) | random crop, zero padding 12; horizontal flip | as is |
| imagenet2012 | random resized crop 224 (area 0.08-1, aspect 3/4-4/3); flip | shorter side 256, centre 224 |

The crop's padding is a loader option for the fixed-size datasets:
`dataset_kwargs.crop_padding` (pixels on every side; default as above) and
`dataset_kwargs.padding_mode` ('zeros', default, or 'reflect': PPLL's and InfoPro's
CIFAR-10 code pad with `F.pad(mode='reflect')`, and their SVHN code crops with zero
padding 2; `cdpjax/configs/ppll_resnet32.py` sets them). `dataset_kwargs.pixel_mean`
and `pixel_std` (one number or one per channel, [0, 1] units) replace the normalisation's
statistics: InfoPro's and MAN's STL-10 and SVHN code normalise with 0.5 and 0.5.

(ImageNet resizing is bilinear with PIL's antialiasing, as torchvision on PIL images.)

ImageNet images differ in size, so `read` decodes and resizes (to the test
transform, also for un-augmented training reads) and training batches come
from `read_augmented`, which crops each original image before resizing it.
Images are read as uint8 in 0..255; the per-channel mean and std (the usual
training-set statistics) are scaled to match. The test split is 'test' for
cifar10, svhn_cropped and stl10 and 'validation' for imagenet2012; the training
split is 'train' (svhn's 'extra' and stl10's 'unlabelled' are not used unless
asked for with `train_split`, e.g. 'train+extra').
"""
from __future__ import annotations

import dataclasses
import math
import os

import numpy as np

from cdpjax.errors import ConfigError
from cdpjax.data.base import PADDING_MODES, Dataset, random_crop_flip

IMAGENET_CROP = 224
IMAGENET_RESIZE = 256
RRC_SCALE = (0.08, 1.0)
RRC_RATIO = (3 / 4, 4 / 3)


@dataclasses.dataclass(frozen=True)
class _Spec:
    """What differs between the fixed-size datasets; mean and std in [0, 1] units."""

    image_shape: tuple[int, int, int]
    num_classes: int
    test_split: str
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    pad: int = 0  # random-crop padding
    flip: bool = True


SPECS = {
    "cifar10": _Spec((32, 32, 3), 10, "test", (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), pad=4),
    "svhn_cropped": _Spec((32, 32, 3), 10, "test", (0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970),
                          pad=4, flip=False),
    "stl10": _Spec((96, 96, 3), 10, "test", (0.4467, 0.4398, 0.4066), (0.2603, 0.2566, 0.2713), pad=12),
    "imagenet2012": _Spec((IMAGENET_CROP, IMAGENET_CROP, 3), 1000, "validation",
                          (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}


def _prepare_hint(name: str, root: str) -> str:
    prepare = (f"python -c \"import tensorflow_datasets as tfds; tfds.builder('{name}', data_dir='{root}')"
               f".download_and_prepare(file_format='array_record')\"")
    manual = (f"first put ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar (from image-net.org) in "
              f"{os.path.join(root, 'downloads', 'manual')}, then " if name == "imagenet2012" else "")
    return (f"prepare it once with TensorFlow installed (pip install tensorflow tensorflow-datasets"
            f"{'' if manual else ', internet needed'}): {manual}run {prepare}; or copy a prepared "
            f"'{name}' folder (array_record format) into {root}, or point data_dir at one")


def _open(name: str, splits: dict[str, str], data_dir: str | None) -> dict:
    """Random-access sources {'train': ..., 'test': ...}, or ConfigError saying how to prepare them."""
    # Imported here: cdpjax imports without tensorflow-datasets (a GPU image running synthetic benchmarks).
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise ConfigError(f"dataset {name!r} is read through tensorflow-datasets, which is not installed "
                          f"({e}): pip install tensorflow-datasets") from e
    builder = tfds.builder(name, data_dir=data_dir)
    # The variant folder is <root>/<name>/<version>.
    root = os.path.dirname(os.path.dirname(os.fspath(builder.data_dir)))
    if not builder.is_prepared():
        raise ConfigError(f"dataset {name!r} (version {builder.version}) is not prepared in data_dir {root!r} "
                          f"(no {builder.data_dir}); {_prepare_hint(name, root)}")
    sources = {}
    for role, split in splits.items():
        try:
            sources[role] = tfds.data_source(name, split=split, data_dir=data_dir, download=False)
        except NotImplementedError as e:  # prepared, but in a format without random access (tfrecord)
            raise ConfigError(f"dataset {name!r} in {root!r} is not in a random-access format; "
                              f"re-prepare it with file_format='array_record': {e}") from e
        except ValueError as e:  # e.g. an unknown split name
            raise ConfigError(f"cannot open split {split!r} of {name!r} in {root!r}: {e}") from e
    return sources


def _records(source, indices) -> list:
    keys = [int(i) for i in indices]
    # `__getitems__` is array_record's batched (parallel) read.
    return list(source.__getitems__(keys)) if keys else []


def _labels(records) -> np.ndarray:
    return np.asarray([r["label"] for r in records], np.int32).reshape(-1)


def _read_fixed(sources: dict, image_shape):
    def read(split, indices):
        records = _records(sources[split], indices)
        if not records:
            return np.zeros((0, *image_shape), np.uint8), np.zeros((0,), np.int32)
        return np.stack([np.asarray(r["image"], np.uint8) for r in records]), _labels(records)

    return read


def resize_center_crop(image: np.ndarray, resize: int = IMAGENET_RESIZE, crop: int = IMAGENET_CROP) -> np.ndarray:
    """The ImageNet test transform: shorter side to `resize` (bilinear), then the centre `crop` x `crop`."""
    h, w = image.shape[:2]
    nh, nw = (resize, resize * w // h) if h <= w else (resize * h // w, resize)
    from PIL import Image

    resized = np.asarray(Image.fromarray(image).resize((nw, nh), Image.BILINEAR))
    top, left = int(round((nh - crop) / 2)), int(round((nw - crop) / 2))
    return resized[top:top + crop, left:left + crop]


def random_resized_crop_box(h: int, w: int, rng: np.random.Generator, scale=RRC_SCALE, ratio=RRC_RATIO):
    """(top, left, height, width) of a crop with area fraction in `scale` and aspect (w/h) in `ratio`.

    Ten tries at a uniform area fraction and a log-uniform aspect; if none fits,
    the largest centred crop whose aspect is clamped to `ratio`.
    """
    area = h * w
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        cw, ch = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if 0 < cw <= w and 0 < ch <= h:
            return int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1)), ch, cw
    aspect = w / h
    if aspect < ratio[0]:
        cw, ch = w, int(round(w / ratio[0]))
    elif aspect > ratio[1]:
        cw, ch = int(round(h * ratio[1])), h
    else:
        cw, ch = w, h
    return (h - ch) // 2, (w - cw) // 2, ch, cw


def random_resized_crop_flip(image: np.ndarray, rng: np.random.Generator, size: int = IMAGENET_CROP) -> np.ndarray:
    """The ImageNet training transform on one uint8 image of any size: float32 [size, size, C]."""
    top, left, ch, cw = random_resized_crop_box(*image.shape[:2], rng)
    from PIL import Image

    out = np.asarray(Image.fromarray(image).resize((size, size), Image.BILINEAR,
                                                   box=(left, top, left + cw, top + ch)), np.float32)
    return out[:, ::-1] if rng.random() < 0.5 else out


def _imagenet_readers(sources: dict):
    def read(split, indices):
        records = _records(sources[split], indices)
        if not records:
            return np.zeros((0, IMAGENET_CROP, IMAGENET_CROP, 3), np.uint8), np.zeros((0,), np.int32)
        return np.stack([resize_center_crop(np.asarray(r["image"], np.uint8)) for r in records]), _labels(records)

    def read_augmented(indices, rng):
        records = _records(sources["train"], indices)
        images = [random_resized_crop_flip(np.asarray(r["image"], np.uint8), rng) for r in records]
        images = np.stack(images) if images else np.zeros((0, IMAGENET_CROP, IMAGENET_CROP, 3), np.float32)
        return images, _labels(records)

    return read, read_augmented


def _per_channel(value, key: str, channels: int, positive: bool) -> tuple[float, ...]:
    """`value` (one number or one per channel, [0, 1] pixel units) as `channels` floats."""
    values = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    if len(values) not in (1, channels) or any(isinstance(v, bool) or not isinstance(v, (int, float))
                                               or (positive and v <= 0) for v in values):
        raise ConfigError(f"dataset_kwargs.{key}={value!r} must be 1 or {channels} "
                          f"{'positive ' if positive else ''}numbers ([0, 1] pixel units)")
    return tuple(float(v) for v in values) * (channels if len(values) == 1 else 1)


def _builder(name: str):
    spec = SPECS[name]

    def build(data_dir: str | None = None, train_split: str = "train", test_split: str | None = None,
              crop_padding: int | None = None, padding_mode: str = "zeros", pixel_mean=None, pixel_std=None,
              **unknown) -> Dataset:
        if unknown:
            raise ConfigError(f"unknown dataset_kwargs {sorted(unknown)} for {name!r}; accepted: data_dir, "
                              "train_split, test_split, crop_padding, padding_mode, pixel_mean, pixel_std")
        mean = spec.mean if pixel_mean is None else _per_channel(pixel_mean, "pixel_mean", 3, False)
        std = spec.std if pixel_std is None else _per_channel(pixel_std, "pixel_std", 3, True)
        pad = spec.pad if crop_padding is None else crop_padding
        if isinstance(pad, bool) or not isinstance(pad, int) or pad < 0:
            raise ConfigError(f"dataset_kwargs.crop_padding={crop_padding!r} must be an integer >= 0 (pixels)")
        if padding_mode not in PADDING_MODES:
            raise ConfigError(f"dataset_kwargs.padding_mode={padding_mode!r} is not one of {', '.join(PADDING_MODES)}")
        if name == "imagenet2012" and (crop_padding is not None or padding_mode != "zeros"):
            raise ConfigError("imagenet2012 is augmented by random resized crops: it takes no crop_padding or "
                              "padding_mode")
        sources = _open(name, {"train": train_split, "test": test_split or spec.test_split}, data_dir or None)
        if name == "imagenet2012":
            read, read_augmented = _imagenet_readers(sources)
            augment = None
        else:
            read, read_augmented = _read_fixed(sources, spec.image_shape), None

            def augment(images, rng):
                return random_crop_flip(images, rng, pad=pad, flip=spec.flip, mode=padding_mode)

        return Dataset(
            name=name,
            image_shape=spec.image_shape,
            num_classes=spec.num_classes,
            num_train=len(sources["train"]),
            num_test=len(sources["test"]),
            read=read,
            augment=augment,
            mean=tuple(255.0 * m for m in mean),
            std=tuple(255.0 * s for s in std),
            read_augmented=read_augmented,
        )

    build.__name__ = name
    build.__doc__ = f"The {name} loader (tensorflow-datasets, array_record); see the module docstring."
    return build


TFDS_DATASETS = {name: _builder(name) for name in SPECS}
