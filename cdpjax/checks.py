"""Validation of a whole config: `config.validate` (types, ranges, combinations) and then
the names and the options that the registries own (method, model, dataset), all before
any device is touched or anything compiles. The trainer, `bench` and `reproduce.py` call
`validate` first, so a misspelt method fails with the other config keys."""
from __future__ import annotations

import inspect

from cdpjax import config as cfg_lib
from cdpjax.errors import ConfigError

# Arguments a model receives from other config keys, never from model_kwargs.
MODEL_RESERVED = ("num_classes", "input_shape", "norm", "bn_axis_name", "dtype")


def takes_dtype(factory) -> bool:
    """Whether a model factory declares a `dtype` argument (the computation dtype, `config.dtype`)."""
    return "dtype" in options(factory)


def options(fn, reserved=()) -> set[str]:
    """The keyword options `fn` names (less `reserved`); a `**kwargs` catch-all ignores what it
    takes, so it accepts nothing more."""
    params = inspect.signature(fn).parameters.values()
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return named - set(reserved)


def check_kwargs(key: str, kwargs, fn, owner: str, reserved=()) -> None:
    """Each key of `kwargs` must be an option of `fn`; `key` names the config entry."""
    known = options(fn, reserved)
    for name in dict(kwargs):
        if name in reserved:
            raise ConfigError(f"{key}.{name} is set by the config key {name!r}, not by {key}")
        if name not in known:
            raise ConfigError(f"{key}.{name} is not an option of {owner}; its options: "
                              f"{', '.join(sorted(known)) or 'none'}")


def validate(config) -> None:
    """`config.validate`, then the method, model, dataset and auxiliary head names and their options."""
    from cdpjax import data, layouts, models  # the registries (models and data import JAX)
    from cdpjax.models import aux_heads

    cfg_lib.validate(config)
    layouts.LAYOUTS.lookup(config.method)
    if not isinstance(config.get("aux_head", "greedy"), str):
        raise ConfigError(f"aux_head must be a string, got {config.aux_head!r}")
    aux_heads.check_options(config.get("aux_head", "greedy"), dict(config.get("aux_kwargs", {}) or {}))
    model = models.REGISTRY.lookup(config.model)
    dataset = data.REGISTRY.lookup(config.dataset)
    check_kwargs("model_kwargs", config.get("model_kwargs", {}) or {}, model, f"model {config.model!r}",
                 MODEL_RESERVED)
    dtype = config.get("dtype", "float32")
    if dtype != "float32" and not takes_dtype(model):
        raise ConfigError(f"dtype={dtype!r}: model {config.model!r} computes in float32 only (its factory takes "
                          f"no `dtype` argument); set --config.dtype=float32 or give the factory a `dtype` "
                          f"argument that sets its Flax modules' dtype")
    check_kwargs("dataset_kwargs", config.get("dataset_kwargs", {}) or {}, dataset,
                 f"dataset {config.dataset!r}", ("data_dir",))


__all__ = ["MODEL_RESERVED", "check_kwargs", "options", "takes_dtype", "validate"]
