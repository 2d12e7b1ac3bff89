"""Model registry: each entry returns the model's blocks; `build` cuts them into stages.

A model factory (docs/extending.md) is called with keyword arguments
`num_classes`, `input_shape` (one example, e.g. (32, 32, 3)), `norm` ('batch' | 'group' |
'none', the config's), `bn_axis_name` (the mesh axis BatchNorm reduces its statistics over,
or None), its own options from `config.model_kwargs`, and `dtype` (the computation dtype of
`config.dtype`, as a JAX dtype) where it declares a `dtype` argument. It returns the list of
Flax blocks, each called as `block(x, train)`, the last returning logits.
"""
from __future__ import annotations

from typing import Callable

import jax.numpy as jnp

from cdpjax.checks import MODEL_RESERVED, check_kwargs, takes_dtype
from cdpjax.models import mlp as _mlp
from cdpjax.models.partition import split_points
from cdpjax.models.staging import StagedNet, accuracy, cross_entropy
from cdpjax.registry import Registry

# name -> factory(num_classes, input_shape, norm, bn_axis_name, **model_kwargs) -> list of blocks
REGISTRY: Registry[Callable] = Registry("model")
REGISTRY.add("mlp", _mlp.mlp)
register = REGISTRY.register


def build(config, input_shape, num_classes, bn_axis_name=None, stages=None, input_dtype="float32") -> StagedNet:
    """The model named by `config.model`, cut into `config.stages` stages (or `stages`), computing
    in `config.dtype` (passed to a factory that takes `dtype`; `checks.validate` refuses
    'bfloat16' for one that does not), reading inputs of `input_dtype` (the dataset's)."""
    factory = REGISTRY.lookup(config.model)
    kwargs = dict(config.get("model_kwargs", {}) or {})
    check_kwargs("model_kwargs", kwargs, factory, f"model {config.model!r}", MODEL_RESERVED)
    if takes_dtype(factory):
        kwargs["dtype"] = jnp.dtype(config.get("dtype", "float32"))
    blocks = factory(
        num_classes=num_classes,
        input_shape=tuple(input_shape),
        norm=config.get("norm", "none"),
        bn_axis_name=bn_axis_name,
        **kwargs,
    )
    spec = config.stages if stages is None else stages
    # `partition='time'` times blocks at a tick's micro-batch: the global batch over the workers
    # (the ring, cdp-mp: one micro-batch a worker; N = L where `workers` is left to the mesh).
    workers = config.get("workers", 0) or (spec if isinstance(spec, int) else len(spec) + 1)
    micro_batch = max(1, int(config.get("global_batch_size", 1)) // max(1, int(workers)))
    points = split_points(blocks, spec, config.get("partition", "params"), tuple(input_shape), config.model,
                          str(input_dtype), batch_size=micro_batch)
    bounds = tuple(zip((0, *points), (*points, len(blocks))))
    return StagedNet(config.model, tuple(blocks), bounds, tuple(input_shape), num_classes, str(input_dtype))


# Families register themselves on import.
from cdpjax.models import resnet as _resnet  # noqa: E402,F401
from cdpjax.models import vit as _vit  # noqa: E402,F401
from cdpjax.models import gpt as _gpt  # noqa: E402,F401

__all__ = ["REGISTRY", "StagedNet", "accuracy", "build", "cross_entropy", "register"]
