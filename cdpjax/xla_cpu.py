"""An XLA:CPU artifact and its fix: convolutions nested in loops and branches.

XLA:CPU rewrites convolutions of other layouts (the gradients' convolutions) into
the layout its fast kernels take only in a program's entry computation. Inside a
`lax.scan` body or a `lax.switch` branch, where a pipeline tick or a CDP worker
runs its stages, they fall back to a naive loop, 11 to 35 times slower
(`python experiments/xla_cpu_nested_conv.py`). `use_canonical_cpu_convolutions`
lowers every CPU convolution in that layout instead. GPUs are untouched.
"""
from __future__ import annotations

from jax import lax

_CANONICAL_CONV_INSTALLED = False


def use_canonical_cpu_convolutions() -> bool:
    """Lower every CPU convolution in the layout XLA's fast CPU kernels take; returns whether installed.

    XLA:CPU rewrites convolutions of other layouts (the gradients' convolutions)
    into that layout only in a program's entry computation. Inside a loop body
    or a `lax.switch` branch, where a pipeline tick runs its stages, they fall
    back to a naive loop: a weight gradient there ran 35x slower than at top
    level. This lowering does the same rewrite for every convolution (transpose
    to NHWC / HWIO, convolve, transpose back): the same arithmetic, on every
    computation (results equal the top-level ones bit for bit). It registers a
    CPU lowering rule for `conv_general_dilated` process-wide, through JAX's
    private `mlir` module: where that module differs (another JAX version) it
    does nothing and returns False. GPUs are untouched. Idempotent.
    """
    global _CANONICAL_CONV_INSTALLED
    if _CANONICAL_CONV_INSTALLED:
        return True
    try:
        from jax._src.interpreters import mlir

        ConvDimensionNumbers = lax.ConvDimensionNumbers
        original = mlir._platform_specific_lowerings["cpu"][lax.conv_general_dilated_p].rule
    except (ImportError, AttributeError, KeyError):  # another JAX: keep its lowering
        return False

    def rule(ctx, lhs, rhs, *, dimension_numbers, feature_group_count, batch_group_count, **params):
        lhs_spec, rhs_spec, out_spec = (tuple(s) for s in dimension_numbers)
        nd = len(lhs_spec)
        nhwc = (0, nd - 1, *range(1, nd - 1))
        hwio = (nd - 1, nd - 2, *range(nd - 2))
        # Inside `shard_map` a gradient's convolution carries an out_sharding on the manual mesh,
        # unsharded in every dimension: still plain (and kept as it is for any output layout).
        out_sharding = params.get("out_sharding")
        unsharded = out_sharding is None or all(s is None for s in getattr(out_sharding, "spec", (0,)))
        plain = feature_group_count == 1 and batch_group_count == 1 and unsharded
        if (lhs_spec, rhs_spec, out_spec) == (nhwc, hwio, nhwc) or not plain:
            return original(ctx, lhs, rhs, dimension_numbers=dimension_numbers,
                            feature_group_count=feature_group_count, batch_group_count=batch_group_count, **params)

        def canonical(lhs, rhs):
            lhs = lax.transpose(lhs, (lhs_spec[0], *lhs_spec[2:], lhs_spec[1]))
            rhs = lax.transpose(rhs, (*rhs_spec[2:], rhs_spec[1], rhs_spec[0]))
            y = lax.conv_general_dilated_p.bind(lhs, rhs, dimension_numbers=ConvDimensionNumbers(nhwc, hwio, nhwc),
                                                feature_group_count=1, batch_group_count=1, **params)
            perm = [0] * nd
            perm[out_spec[0]], perm[out_spec[1]] = 0, nd - 1
            for i, d in enumerate(out_spec[2:]):
                perm[d] = 1 + i
            return lax.transpose(y, tuple(perm))

        return mlir.lower_fun(canonical, multiple_results=False)(ctx, lhs, rhs)

    mlir.register_lowering(lax.conv_general_dilated_p, rule, platform="cpu")
    _CANONICAL_CONV_INSTALLED = True
    return True


__all__ = ["use_canonical_cpu_convolutions"]
