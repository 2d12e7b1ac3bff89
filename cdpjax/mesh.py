"""Devices and the named mesh (`data`, `stage`).

On a machine without accelerators cdpjax simulates N CPU devices so that every
method runs anywhere; on GPUs the real devices are used and the CPU setting is
irrelevant. `setup_devices` must run before JAX initialises its backends.
"""
from __future__ import annotations

import os
from typing import Mapping

import numpy as np

from cdpjax.errors import ConfigError

AXES = ("stage", "data")  # mesh axis order: stage-major, so a data group shares a stage


def setup_devices(cpu_devices: int | None = 8) -> None:
    """Asks JAX for `cpu_devices` simulated CPU devices (ignored where an accelerator is the default)."""
    import jax

    if cpu_devices is None:
        return
    if cpu_devices < 1:
        raise ConfigError(f"--cpu-devices {cpu_devices} must be >= 1")
    try:
        jax.config.update("jax_num_cpu_devices", int(cpu_devices))
    except RuntimeError:
        # Backends already initialised (a notebook, a test session): keep what there is.
        pass
    os.environ.setdefault("XLA_FLAGS", "")


def devices():
    import jax

    return jax.devices()


def resolve_axes(mesh_config: Mapping[str, int], num_devices: int) -> dict[str, int]:
    """Axis sizes with -1 resolved; raises ConfigError if they do not match the devices."""
    sizes = {a: int(s) for a, s in dict(mesh_config).items()}
    fixed = int(np.prod([s for s in sizes.values() if s != -1])) if sizes else 1
    for axis, size in sizes.items():
        if size == -1:
            if num_devices % fixed:
                raise ConfigError(
                    f"mesh {dict(mesh_config)}: {num_devices} devices cannot be split by {fixed}"
                )
            sizes[axis] = num_devices // fixed
    total = int(np.prod(list(sizes.values()))) if sizes else 1
    if total > num_devices:
        raise ConfigError(
            f"mesh {dict(mesh_config)} needs {total} devices but only {num_devices} exist "
            f"(on CPU, more can be simulated with --cpu-devices)"
        )
    if total != num_devices:
        raise ConfigError(
            f"mesh {dict(mesh_config)} covers {total} of the {num_devices} devices; the axis sizes must "
            f"multiply to {num_devices} (use -1 for one axis, or run with --cpu-devices {total} on CPU "
            f"or CUDA_VISIBLE_DEVICES on GPUs)"
        )
    return sizes


def make_mesh(mesh_config: Mapping[str, int], devs=None):
    """A `jax.sharding.Mesh` over the first prod(sizes) devices, axes in `AXES` order.

    Built directly from a device array so that axes are Auto on every JAX version
    (`jax.make_mesh` defaults to Explicit axes on recent ones).
    """
    from jax.sharding import Mesh

    devs = list(devices() if devs is None else devs)
    sizes = resolve_axes(mesh_config, len(devs))
    names = tuple(a for a in AXES if a in sizes)
    shape = tuple(sizes[a] for a in names)
    n = int(np.prod(shape)) if shape else 1
    return Mesh(np.array(devs[:n]).reshape(shape), names)


def axis_size(mesh, axis: str) -> int:
    return int(mesh.shape[axis]) if axis in mesh.shape else 1
