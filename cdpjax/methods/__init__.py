"""Method registry: a name maps to a builder `build(ctx) -> Method`.

A new layout is one new module with a builder decorated by `@register(name)`
and one import line below.
"""
from __future__ import annotations

from cdpjax.methods.common import REGISTRY, Context, Method, register

from cdpjax.methods import e2e as _e2e  # noqa: E402,F401
from cdpjax.methods import dp as _dp  # noqa: E402,F401

for _name in ("cdp", "local", "ppll", "gpipe", "cdp_mp", "cdp_zero"):
    try:
        __import__(f"cdpjax.methods.{_name}")
    except ModuleNotFoundError as e:  # a method not written yet
        if e.name != f"cdpjax.methods.{_name}":
            raise


def build(ctx: Context) -> Method:
    from cdpjax.config import ConfigError

    # Every method of a process compiles with the same convolution lowering, so that side-by-side
    # timings compare like with like (see carrier.use_canonical_cpu_convolutions; CPU only).
    from cdpjax.carrier import use_canonical_cpu_convolutions

    use_canonical_cpu_convolutions()
    name = ctx.config.method
    if name not in REGISTRY:
        raise ConfigError(f"unknown method {name!r}; registered: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name](ctx)


__all__ = ["REGISTRY", "Context", "Method", "build", "register"]
