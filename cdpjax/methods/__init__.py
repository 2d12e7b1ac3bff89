"""The methods: one module each, with one builder `build(ctx) -> Method`.

Which builder a method name runs, and everything else the rest of cdpjax reads
about a method (mesh axes, time table, diagrams), is its `Layout` in
`cdpjax.layouts`; a new layout is one module there and one here.
"""
from __future__ import annotations

from cdpjax import compress
from cdpjax.layouts import LAYOUTS
from cdpjax.methods.common import Context, Method

REGISTRY = LAYOUTS  # the method names, with their layouts


def build(ctx: Context) -> Method:
    """The method `ctx.config.method`, built for `ctx` (its builder checks what needs the mesh
    or the model, before anything compiles)."""
    from cdpjax.xla_cpu import use_canonical_cpu_convolutions

    # Every method of a process compiles with the same convolution lowering, so that side-by-side
    # timings compare like with like (see cdpjax.xla_cpu; CPU only).
    use_canonical_cpu_convolutions()
    method = LAYOUTS.lookup(ctx.config.method).build(ctx)
    compress.check_method(ctx.config.method, method.program, compress.Codecs.from_config(ctx.config))
    return method


__all__ = ["REGISTRY", "Context", "Method", "build"]
