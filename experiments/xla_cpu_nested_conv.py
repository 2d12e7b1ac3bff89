"""Measures an XLA:CPU artifact that dominates pipeline timings of conv models on CPU.

The same convolution gradient (two 3x3 convs, batch 8, 16x16x32) is timed at
the top level of a jitted function and inside a `lax.scan` body (as every
pipeline and ring realisation runs its stages: a scan over ticks, a switch over
stages). On XLA:CPU the nested one is compiled to a much slower convolution
path (15-30x measured here, JAX 0.10.2); matrix multiplies (MLP, ViT) do not
suffer it. On GPUs the same programs use cuDNN either way.

cdpjax installs `cdpjax.xla_cpu.use_canonical_cpu_convolutions` when it builds a
method: a CPU-only lowering that transposes every convolution into the layout
XLA:CPU's fast kernels take, which removes the gap (measured 1.0x). The script
measures both, before and after installing it.

    python experiments/xla_cpu_nested_conv.py
"""
import jax
import jax.numpy as jnp
from jax import lax


def conv(w, x):
    return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))


def loss(w, x):
    return (conv(w, jnp.tanh(conv(w, x))) ** 2).sum()


def steps_top_level(w, x, n=4):
    for _ in range(n):
        gw, gx = jax.grad(loss, argnums=(0, 1))(w, x)
        w, x = w - 1e-3 * gw, x - 1e-3 * gx
    return w.sum()


def steps_in_scan(w, x, n=4):
    def body(carry, _):
        w, x = carry
        gw, gx = jax.grad(loss, argnums=(0, 1))(w, x)
        return (w - 1e-3 * gw, x - 1e-3 * gx), None

    (w, x), _ = lax.scan(body, (w, x), None, length=n)
    return w.sum()


def main():
    from cdpjax.xla_cpu import use_canonical_cpu_convolutions
    from cdpjax.speedup import median_seconds

    w = jax.random.normal(jax.random.key(0), (3, 3, 32, 32))
    x = jax.random.normal(jax.random.key(1), (8, 16, 16, 32))
    for label in ("XLA's own lowering", "canonical CPU lowering"):
        if label.startswith("canonical"):
            use_canonical_cpu_convolutions()
            jax.clear_caches()
        top = median_seconds(jax.jit(steps_top_level), w, x, repeats=7)
        nested = median_seconds(jax.jit(steps_in_scan), w, x, repeats=7)
        print(f"{jax.default_backend()}, {label}: top level {top * 1e3:.1f} ms, inside lax.scan "
              f"{nested * 1e3:.1f} ms, ratio {nested / top:.1f}x")


if __name__ == "__main__":
    main()
