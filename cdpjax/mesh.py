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


def simulates_its_workers(method: str | None) -> bool:
    """Whether `method`'s workers run on the data axis and `cdp_impl='simulate'` runs them on fewer
    devices than workers (CDP's ring needs a device per worker): read from its layout, which names
    the simulation as the reference its ring equals."""
    from cdpjax.layouts import LAYOUTS

    layout = LAYOUTS[method] if method and method in LAYOUTS else None
    return (layout is not None and layout.device_axis == "data" and layout.reference is not None
            and ("cdp_impl", "simulate") in layout.reference.settings)


def more_devices_hint(sizes: Mapping[str, int], num_devices: int, platform: str = "cpu",
                      method: str | None = None, cdp_impl: str | None = None) -> str:
    """What helps, on this backend, a mesh of `sizes` that needs more than the `num_devices` there
    are: on CPU more simulated devices; on an accelerator (its devices are what the host has) a
    data axis that takes the devices there are, with CDP's `simulate` where its ring would need a
    device per worker, or more hosts."""
    if platform == "cpu":
        return "on CPU, more can be simulated with --cpu-devices"
    # (jax names CUDA's and ROCm's devices 'gpu'; their plugins' own names are taken too)
    where = "on " + {"gpu": "GPUs", "cuda": "GPUs", "rocm": "GPUs", "tpu": "TPUs"}.get(platform, f"{platform} devices")
    rest = int(np.prod([s for a, s in sizes.items() if a != "data" and s != -1])) if sizes else 1
    if "data" in sizes and num_devices % rest == 0:
        if simulates_its_workers(method) and cdp_impl != "simulate":
            return (f"{where}, --config.mesh.data=-1 --config.cdp_impl=simulate runs on the {num_devices} there are: "
                    f"{method}'s workers then share them")
        fits = {**sizes, "data": num_devices // rest}
        return f"{where}, --config.mesh.data=-1 runs on the {num_devices} there are, as the mesh {fits}"
    return f"{where}, run on a host with more, or on several hosts: docs/guarantees.md, multi-process runs"


def resolve_axes(mesh_config: Mapping[str, int], num_devices: int, platform: str = "cpu",
                 method: str | None = None, cdp_impl: str | None = None) -> dict[str, int]:
    """Axis sizes with -1 resolved; raises ConfigError if they do not match the devices, naming a
    mesh that would fit (on fewer devices, or with pipeline replicas on `data`). `platform`,
    `method`, `cdp_impl`: what the hint for too few devices says (`more_devices_hint`)."""
    sizes = {a: int(s) for a, s in dict(mesh_config).items()}
    fixed = int(np.prod([s for s in sizes.values() if s != -1])) if sizes else 1
    for axis, size in sizes.items():
        if size == -1:
            if num_devices % fixed:
                fits = {a: (s if s != -1 else num_devices // fixed) for a, s in sizes.items()}
                used = int(np.prod(list(fits.values())))
                hint = (f"the mesh {fits} fits {used} of them ({_fewer_devices(used)})" if used
                        else f"the fixed axes need {fixed} devices")
                raise ConfigError(
                    f"mesh {dict(mesh_config)}: {num_devices} devices cannot be split by {fixed}; {hint}"
                )
            sizes[axis] = num_devices // fixed
    total = int(np.prod(list(sizes.values()))) if sizes else 1
    if total > num_devices:
        raise ConfigError(
            f"mesh {dict(mesh_config)} needs {total} devices but only {num_devices} exist "
            f"({more_devices_hint(sizes, num_devices, platform, method, cdp_impl)})"
        )
    if total != num_devices:
        if "data" not in sizes and num_devices % total == 0:
            fits = {**sizes, "data": num_devices // total}
            hint = (f"--config.mesh.data={num_devices // total} fills them (the mesh {fits}: "
                    f"{num_devices // total} replicas, each fed its share of the global batch), or "
                    f"{_fewer_devices(total)}")
        else:
            hint = f"use -1 for one axis, or {_fewer_devices(total)}"
        raise ConfigError(
            f"mesh {dict(mesh_config)} covers {total} of the {num_devices} devices; the axis sizes must "
            f"multiply to {num_devices}: {hint}"
        )
    return sizes


def _fewer_devices(count: int) -> str:
    return f"run with --cpu-devices {count} on CPU or CUDA_VISIBLE_DEVICES on GPUs"


def make_mesh(mesh_config: Mapping[str, int], devs=None, method: str | None = None, cdp_impl: str | None = None):
    """A `jax.sharding.Mesh` over the first prod(sizes) devices, axes in `AXES` order.

    Built directly from a device array so that axes are Auto on every JAX version
    (`jax.make_mesh` defaults to Explicit axes on recent ones). `method`, `cdp_impl`: the
    config's, for the hint when the devices are too few.
    """
    from jax.sharding import Mesh

    devs = list(devices() if devs is None else devs)
    platform = devs[0].platform if devs else "cpu"
    sizes = resolve_axes(mesh_config, len(devs), platform, method, cdp_impl)
    names = tuple(a for a in AXES if a in sizes)
    shape = tuple(sizes[a] for a in names)
    n = int(np.prod(shape)) if shape else 1
    return Mesh(np.array(devs[:n]).reshape(shape), names)


def axis_size(mesh, axis: str) -> int:
    return int(mesh.shape[axis]) if axis in mesh.shape else 1


def replicas_words(sizes: Mapping[str, int], global_batch: int | None = None) -> str:
    """'' or, on a (stage, data) mesh with data > 1, what the data axis holds: '2 pipeline replicas
    of 4 stage devices, each fed 64 of the 128 examples a step'."""
    stage, data = int(sizes.get("stage", 1)), int(sizes.get("data", 1))
    if "stage" not in sizes or data <= 1:
        return ""
    fed = f", each fed {global_batch // data} of the {global_batch} examples a step" if global_batch else ""
    return f"{data} pipeline replicas of {stage} stage devices{fed}"


def mesh_words(mesh_config: Mapping[str, int], example_devices: int = 8) -> str:
    """A config's mesh in words, before any device is known: its sizes, and where an axis is -1
    what it resolves to on `example_devices` devices (or the first count it divides)."""
    sizes = {a: int(s) for a, s in dict(mesh_config).items()}
    if -1 not in sizes.values():
        extra = replicas_words(sizes)
        return f"{sizes}" + (f" ({extra})" if extra else "")
    fixed = int(np.prod([s for s in sizes.values() if s != -1])) if sizes else 1
    n = example_devices if example_devices % fixed == 0 else 2 * fixed
    resolved = {a: (s if s != -1 else n // fixed) for a, s in sizes.items()}
    extra = replicas_words(resolved)
    axis = next(a for a, s in sizes.items() if s == -1)
    return (f"{sizes} ({axis} takes the devices the other axes leave: on {n} devices {resolved}"
            + (f", {extra}" if extra else "") + ")")
