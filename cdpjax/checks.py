"""Validation of a whole config: `config.validate` (types, ranges, combinations) and then
the names and the options that the registries own (method, model, dataset), all before
any device is touched or anything compiles. The trainer, `bench` and `reproduce.py` call
`validate` first, so a misspelt method fails with the other config keys."""
from __future__ import annotations

import inspect
import math

from cdpjax import config as cfg_lib
from cdpjax.errors import ConfigError

# Arguments a model receives from other config keys, never from model_kwargs.
MODEL_RESERVED = ("num_classes", "input_shape", "norm", "bn_axis_name", "dtype")
# Sizes of a model, refused before it is built (docs/guarantees.md, "Limits"): a model option named
# like a depth past DEPTH_LIMIT (each block is Python work when the model is built, even abstractly:
# a depth of 20,000 took minutes), any other number past OPTION_LIMIT; then, built abstractly, at
# most PARAM_LIMIT parameters (16 GiB in float32, before gradients and optimizer state).
DEPTH_LIMIT = 256
OPTION_LIMIT = 2**20
PARAM_LIMIT = 2**32


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


def check_values(key: str, kwargs, fn, owner: str) -> None:
    """Each value of `kwargs` must be of the kind of `fn`'s default for it (an integer where the
    default is an integer...); what the default does not say is left to `try_model`."""
    params = inspect.signature(fn).parameters
    for name, value in dict(kwargs).items():
        kind = cfg_lib.kind_of(params[name].default) if name in params else None
        if kind is not None and not cfg_lib.is_kind(value, kind):
            raise ConfigError(f"{key}.{name}={value!r}: {owner} takes {cfg_lib.KIND_WORDS[kind]} there (its "
                              f"default is {params[name].default!r})")


def check_model_sizes(key: str, kwargs, owner: str) -> None:
    """Each number of `kwargs` at most DEPTH_LIMIT (an option named like a depth) or OPTION_LIMIT in
    magnitude; a ConfigError naming the option and its limit."""
    for name, value in dict(kwargs).items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        limit = DEPTH_LIMIT if "depth" in name or "layers" in name else OPTION_LIMIT
        if abs(value) > limit:
            raise ConfigError(f"{key}.{name}={value!r}: {owner} takes at most {limit} there (a larger model is not "
                              f"built in seconds or held in memory)")


def try_model(config, input_shape, num_classes, input_dtype: str = "float32") -> None:
    """The model with the config's `model_kwargs`, built and initialised abstractly at batch 1
    (`jax.eval_shape`: nothing runs or compiles), so that an option its factory cannot work
    with (a width of 0) is a ConfigError here, not an error deep inside JAX later."""
    kwargs = dict(config.get("model_kwargs", {}) or {})
    if not kwargs:
        return
    import jax

    from cdpjax import models

    try:
        net = models.build(config, input_shape, num_classes, stages=1, input_dtype=input_dtype)
        shapes = jax.eval_shape(lambda: net.init(jax.random.key(0), 1))
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's options: one line naming them
        text = " ".join(str(e).split())[:200] or type(e).__name__
        raise ConfigError(f"model {config.model!r} with model_kwargs {kwargs} cannot be built for "
                          f"{tuple(input_shape)} inputs and {num_classes} classes ({type(e).__name__}: {text}): "
                          f"fix those options") from None
    count = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(shapes) if hasattr(leaf, "shape"))
    if count > PARAM_LIMIT:
        raise ConfigError(f"model {config.model!r} with model_kwargs {kwargs} holds {count:.3g} parameters and state "
                          f"values, more than {PARAM_LIMIT:.3g} (16 GiB in float32): give smaller options")


def validate(config) -> None:
    """`config.validate`, then the method, model, dataset and auxiliary head names and their options."""
    from cdpjax import compress, data, layouts, models  # the registries (models and data import JAX)
    from cdpjax.models import aux_heads

    cfg_lib.validate(config)
    layouts.LAYOUTS.lookup(config.method)
    compress.Codecs.from_config(config)
    if not isinstance(config.get("aux_head", "greedy"), str):
        raise ConfigError(f"aux_head must be a string, got {config.aux_head!r}")
    aux_heads.check_options(config.get("aux_head", "greedy"), dict(config.get("aux_kwargs", {}) or {}))
    model = models.REGISTRY.lookup(config.model)
    dataset = data.REGISTRY.lookup(config.dataset)
    check_kwargs("model_kwargs", config.get("model_kwargs", {}) or {}, model, f"model {config.model!r}",
                 MODEL_RESERVED)
    check_values("model_kwargs", config.get("model_kwargs", {}) or {}, model, f"model {config.model!r}")
    check_model_sizes("model_kwargs", config.get("model_kwargs", {}) or {}, f"model {config.model!r}")
    dtype = config.get("dtype", "float32")
    if dtype != "float32" and not takes_dtype(model):
        raise ConfigError(f"dtype={dtype!r}: model {config.model!r} computes in float32 only (its factory takes "
                          f"no `dtype` argument); set --config.dtype=float32 or give the factory a `dtype` "
                          f"argument that sets its Flax modules' dtype")
    check_kwargs("dataset_kwargs", config.get("dataset_kwargs", {}) or {}, dataset,
                 f"dataset {config.dataset!r}", ("data_dir",))


__all__ = ["DEPTH_LIMIT", "MODEL_RESERVED", "OPTION_LIMIT", "PARAM_LIMIT", "check_kwargs", "check_model_sizes",
           "check_values", "options", "takes_dtype", "try_model", "validate"]
