"""A method's programs lowered for another platform (CUDA) on this machine, with no GPU.

`jax.export` lowers a jitted function to StableHLO for any platform JAX knows,
whatever devices the machine has: with `platforms=['cuda']` every primitive
takes its CUDA lowering rule. Arguments are abstract
(`jax.ShapeDtypeStruct(shape, dtype, sharding=...)`) with the shardings the
method's state and batches have on the mesh of this machine's devices (the 8
simulated CPU devices of the tests): `jax.export` accepts shardings over CPU
devices for a CUDA export and records only the device count and the sharding of
each argument, so the module it gives is the one a mesh of as many GPUs runs.
Nothing is compiled.

What a CUDA export refuses, and `cuda_problems` reports:
- a primitive with no CUDA lowering: one whose lowering was registered for CPU
  only (`mlir.register_lowering(..., platform='cpu')` with no generic rule), or a
  `lax.platform_dependent` with no branch for CUDA ("MLIR translation rule for
  primitive ... not found for platform cuda");
- a host callback (`jax.pure_callback`, `jax.debug.callback`, `io_callback`):
  not exportable (on a GPU it stalls the device on the host every step anyway);
- a custom call outside the targets `jax.export` guarantees stable (a CPU-only
  LAPACK or hand-written kernel called directly). Conservative: a hand-written CUDA
  kernel would be reported too.

What it cannot catch: a failure inside XLA:GPU's own compiler (StableHLO it
cannot compile, out of memory), and speed; `experiments/gpu_figures.sh` compiles
and times the real thing on one GPU. A CPU-only lowering of an op that has a
generic one (as `cdpjax.xla_cpu`'s convolutions) is never used for CUDA: the
export takes the generic rule, which the tests check on the convolutions.
"""
from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp


def abstract(tree) -> Any:
    """Each array of `tree` as a `jax.ShapeDtypeStruct` with its shape, dtype and sharding."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def abstract_batch(dataset, mesh, method, global_batch_size: int) -> dict:
    """One global batch as the trainer feeds it: images and integer labels, placed where the
    method takes them (`Method.input_sharding`, else over `data`)."""
    from cdpjax import setup

    sharding = method.input_sharding or setup.batch_sharding(mesh)
    images = jax.ShapeDtypeStruct((global_batch_size, *dataset.image_shape), jnp.float32, sharding=sharding)
    labels = jax.ShapeDtypeStruct((global_batch_size,), jnp.int32, sharding=sharding)
    return {"image": images, "label": labels}


def programs(config, devices=None, rng=None) -> dict[str, tuple]:
    """The programs the trainer compiles for `config.method`: name -> (jitted function, abstract
    arguments).

    `train_step` is the trainer's own step (`cdpjax.guard.guarded_step`: the method's step
    with its finite checks and `export`, skipping as `config.nonfinite` says), `flush` the
    pipelines' end-of-run flush. The state is the method's `init(rng)` on this machine's mesh,
    made abstract (concrete first: a small config's state is cheap, and its shardings are then
    exactly those of the trainer's state). `rng`: a key for `init` other than the trainer's
    `jax.random.key(config.seed)`, e.g. an `rbg` key, whose initialisers compile faster on CPU
    (the tests); it gives the trainer's programs as long as the state holds no PRNG key, and
    where it does, the trainer's key is used instead. A ConfigError of the method's builder
    propagates.
    """
    from cdpjax import guard, setup

    dataset, mesh, method = setup.setup(config, devices)
    key = jax.random.key(config.seed)
    state = method.init(key if rng is None else rng)
    if rng is not None and any(jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) for x in jax.tree.leaves(state)):
        state = method.init(key)  # the keys' implementation is part of the programs
    state = abstract(state)
    batch = abstract_batch(dataset, mesh, method, config.global_batch_size)
    step = guard.guarded_step(method, skip=config.get("nonfinite", "stop") == "skip")
    out = {"train_step": (step, (state, batch))}
    if method.flush is not None:
        out["flush"] = (method.flush if hasattr(method.flush, "lower") else jax.jit(method.flush), (state,))
    return out


def export(program: tuple, platform: str = "cuda") -> jax.export.Exported:
    """One of `programs(config)`'s (function, arguments) exported for `platform`; an export that
    fails raises its own error."""
    fn, args = program
    return jax.export.export(fn, platforms=[platform])(*args)


def cuda_problems(config, devices=None, rng=None) -> list[str]:
    """Why `config.method`'s programs cannot run on CUDA GPUs, one line per program ([] when
    they all lower): the method, the program and the first line of the export's error."""
    from cdpjax.errors import ConfigError

    problems = []
    for name, program in programs(config, devices, rng).items():
        try:
            export(program, "cuda")
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - any refusal of the CUDA lowering is the finding
            first = (str(e).strip().splitlines() or [""])[0]
            found = sorted({p for p in primitives(*program) if "callback" in p})
            why = f"it calls back to the host ({', '.join(found)}), which an export refuses; " if found else ""
            problems.append(f"method {config.method!r}: {name} does not lower for CUDA: {why}"
                            f"{type(e).__name__}: {first}")
    return problems


def equations(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs its equations hold (scan and loop bodies, cond
    branches, calls), each equation before the ones it holds."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's, or a bare Jaxpr
                if hasattr(inner, "eqns"):
                    yield from equations(inner)


def primitives(fn, args) -> list[str]:
    """The names of the primitives `fn(*args)` runs, in nested jaxprs too (scan bodies, branches)."""
    return [eqn.primitive.name for eqn in equations(jax.make_jaxpr(fn)(*args).jaxpr)]


_CONVOLUTION = re.compile(r"stablehlo\.convolution\(.*?dim_numbers = (\[[^\]]*\]x\[[^\]]*\]->\[[^\]]*\])")


def convolution_layouts(exported: jax.export.Exported) -> list[str]:
    """The dimension numbers of every convolution in an exported module, e.g.
    '[b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f]' (input x kernel -> output)."""
    return _CONVOLUTION.findall(exported.mlir_module())


__all__ = ["abstract", "abstract_batch", "convolution_layouts", "cuda_problems", "equations", "export", "primitives",
           "programs"]
