"""Dataset registry. `digits` and `synthetic` are embedded; the rest go through tensorflow-datasets."""
from __future__ import annotations

from cdpjax.config import ConfigError
from cdpjax.data.base import Dataset, stream_indices
from cdpjax.data.digits import digits
from cdpjax.data.synthetic import synthetic

REGISTRY = {
    "digits": digits,
    "synthetic": synthetic,
}

try:  # the tensorflow-datasets loaders (cifar10, svhn_cropped, stl10, imagenet2012)
    from cdpjax.data.tfds_data import TFDS_DATASETS

    REGISTRY.update(TFDS_DATASETS)
except ImportError:  # pragma: no cover - tfds is a declared dependency
    pass


def build(config) -> Dataset:
    if config.dataset not in REGISTRY:
        raise ConfigError(f"unknown dataset {config.dataset!r}; available: {', '.join(sorted(REGISTRY))}")
    kwargs = dict(config.get("dataset_kwargs", {}) or {})
    if config.get("data_dir"):
        kwargs["data_dir"] = config.data_dir
    return REGISTRY[config.dataset](**kwargs)


__all__ = ["Dataset", "REGISTRY", "build", "stream_indices"]
