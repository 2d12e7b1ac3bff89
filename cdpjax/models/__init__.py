"""Model registry: each entry returns the model's blocks; `build` cuts them into stages."""
from __future__ import annotations

from typing import Callable

from cdpjax.config import ConfigError
from cdpjax.models import mlp as _mlp
from cdpjax.models.partition import split_points
from cdpjax.models.staging import StagedNet, accuracy, cross_entropy

REGISTRY: dict[str, Callable] = {
    "mlp": _mlp.mlp,
}


def register(name: str):
    def wrap(fn):
        REGISTRY[name] = fn
        return fn

    return wrap


def build(config, input_shape, num_classes, bn_axis_name=None, stages=None) -> StagedNet:
    """The model named by `config.model`, cut into `config.stages` stages (or `stages`)."""
    if config.model not in REGISTRY:
        raise ConfigError(f"unknown model {config.model!r}; available: {', '.join(sorted(REGISTRY))}")
    kwargs = dict(config.get("model_kwargs", {}) or {})
    import inspect

    factory = REGISTRY[config.model]
    accepted = [p for p in inspect.signature(factory).parameters
                if p not in ("num_classes", "input_shape", "norm", "bn_axis_name")]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ConfigError(f"model_kwargs {unknown} are not options of {config.model!r}; it accepts {accepted}")
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
