"""Dataset registry. `digits`, `synthetic` and `coriolanus` (text) are embedded; the rest go
through tensorflow-datasets."""
from __future__ import annotations

from cdpjax.data.base import Dataset, stream_indices
from cdpjax.data.digits import digits
from cdpjax.data.synthetic import synthetic
from cdpjax.data.text import coriolanus
from cdpjax.data.tfds_data import TFDS_DATASETS
from cdpjax.data.tfds_text import TFDS_TEXT_DATASETS
from cdpjax.registry import Registry

# name -> loader(**dataset_kwargs) -> Dataset
REGISTRY: Registry = Registry("dataset")
REGISTRY.add("digits", digits)
REGISTRY.add("synthetic", synthetic)
REGISTRY.add("coriolanus", coriolanus)  # language modelling: character windows of the embedded play
for _name, _loader in {**TFDS_DATASETS, **TFDS_TEXT_DATASETS}.items():  # cifar10, ..., tiny_shakespeare, lm1b
    REGISTRY.add(_name, _loader)
register = REGISTRY.register


def build(config) -> Dataset:
    loader = REGISTRY.lookup(config.dataset)
    kwargs = dict(config.get("dataset_kwargs", {}) or {})
    if config.get("data_dir"):
        kwargs["data_dir"] = config.data_dir
    return loader(**kwargs)


__all__ = ["Dataset", "REGISTRY", "build", "register", "stream_indices"]
