"""Model registry: each entry returns the model's blocks; `build` cuts them into stages."""
from __future__ import annotations

from typing import Callable

from cdpjax.checks import MODEL_RESERVED, check_kwargs
from cdpjax.models import mlp as _mlp
from cdpjax.models.partition import split_points
from cdpjax.models.staging import StagedNet, accuracy, cross_entropy
from cdpjax.registry import Registry

# name -> factory(num_classes, input_shape, norm, bn_axis_name, **model_kwargs) -> list of blocks
REGISTRY: Registry[Callable] = Registry("model")
REGISTRY.add("mlp", _mlp.mlp)
register = REGISTRY.register


def build(config, input_shape, num_classes, bn_axis_name=None, stages=None) -> StagedNet:
    """The model named by `config.model`, cut into `config.stages` stages (or `stages`)."""
    factory = REGISTRY.lookup(config.model)
    kwargs = dict(config.get("model_kwargs", {}) or {})
    check_kwargs("model_kwargs", kwargs, factory, f"model {config.model!r}", MODEL_RESERVED)
    blocks = factory(
        num_classes=num_classes,
        input_shape=tuple(input_shape),
        norm=config.get("norm", "none"),
        bn_axis_name=bn_axis_name,
        **kwargs,
    )
    spec = config.stages if stages is None else stages
    points = split_points(blocks, spec, config.get("partition", "params"), tuple(input_shape), config.model)
    bounds = tuple(zip((0, *points), (*points, len(blocks))))
    return StagedNet(config.model, tuple(blocks), bounds, tuple(input_shape), num_classes)


# Families register themselves on import.
from cdpjax.models import resnet as _resnet  # noqa: E402,F401
from cdpjax.models import vit as _vit  # noqa: E402,F401

__all__ = ["REGISTRY", "StagedNet", "accuracy", "build", "cross_entropy", "register"]
