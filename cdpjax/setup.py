"""Set-up: a config to (dataset, mesh, method), every check done and nothing compiled.

`setup(config, devices)` validates the config, builds the dataset, tries the model abstractly,
makes the mesh the method's layout asks for and builds the method on it (a builder's refusal
worded with the mesh: `mesh_error`). The trainer (`cdpjax.rundir.prepare`), `cdpjax bench` and
the CUDA lowering check (`cdpjax.lowering`) all set a method up through it, so they refuse the
same configs with the same words; none of them needs the trainer's loop for it.
`check_dataset_against_model` (abstract shapes) and `check_batches` (a first real batch) check the
data against the model before anything compiles; `put_batch` places a host batch on the mesh.
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from cdpjax import checks, layouts, tasks
from cdpjax import data as data_lib
from cdpjax import methods as methods_lib
from cdpjax.errors import ConfigError
from cdpjax.mesh import make_mesh


def setup(config, devices=None):
    """Validated config -> (dataset, mesh, method); everything that can fail before compiling."""
    checks.validate(config)
    dataset = data_lib.build(config)
    if config.global_batch_size > dataset.num_train:
        raise ConfigError(f"global_batch_size={config.global_batch_size} is larger than the training set of "
                          f"{dataset.name!r} ({dataset.num_train} examples): each example is used once per "
                          f"epoch, so a batch must fit in it")
    if config.global_batch_size % jax.process_count():
        raise ConfigError(f"global_batch_size={config.global_batch_size} is not divisible by the "
                          f"{jax.process_count()} processes")
    checks.try_model(config, tuple(dataset.image_shape), dataset.num_classes, dataset.input_dtype)
    mesh = make_mesh(layouts.mesh_for(config), devices, config.method, config.get("cdp_impl", None))
    ctx = methods_lib.Context(config, mesh, tuple(dataset.image_shape), dataset.num_classes, dataset.input_dtype,
                              tasks.resolve(config, dataset))
    try:
        method = methods_lib.build(ctx)
    except ConfigError as e:
        raise mesh_error(config, mesh, e) from None
    if jax.process_count() > 1 and isinstance(method.input_sharding, jax.sharding.SingleDeviceSharding):
        raise ConfigError(f"method {config.method!r} runs on one device, but this run has "
                          f"{jax.process_count()} processes: run it as a single process")
    return dataset, mesh, method


def mesh_error(config, mesh, e: ConfigError) -> ConfigError:
    """A method builder's refusal, worded with the mesh it was built on: the builder sees sizes
    (workers=3), the user chose a mesh (or got one by default)."""
    n = int(mesh.devices.size)
    note = ""
    if "data" in mesh.shape and not config.get("workers", 0) and "workers" in str(e):
        note = (f" (workers=0 takes the size of the data axis, {int(mesh.shape['data'])}: change "
                f"--config.mesh.data or set --config.workers)")
    return ConfigError(f"{config.method} on the mesh {dict(mesh.shape)} ({n} device{'s' if n > 1 else ''}): "
                       f"{e}{note}")


def check_dataset_against_model(dataset, config, net) -> None:
    """The dataset's inputs fit the model and the model's outputs fit the task's labels (abstract
    shapes only: called before the parameters are initialised, so nothing has compiled yet)."""
    if tuple(dataset.image_shape) != tuple(net.input_shape):
        raise ConfigError(f"images of shape {dataset.image_shape} do not fit the model's input {net.input_shape}")
    task = tasks.resolve(config, dataset)
    label_shape = task.label_shape(tuple(net.input_shape))
    task.check_outputs(net.stage_output_shapes(1)[-1][1:], label_shape, dataset.num_classes, net.name)


def check_batches(dataset, config, net, step: int = 0) -> dict:
    """Reads training batch `step` and a test batch and checks them against the model before
    the train step compiles (a loader whose images are not what it declares fails here, not
    inside XLA); returns the training batch, which the loop then uses, so that it is read once.
    The labels' shape is the task's (`config.task`, or the dataset's own); that the model's
    outputs fit it is `check_dataset_against_model`'s, before the parameters exist."""
    pcount = jax.process_count()
    per_process = config.global_batch_size // pcount
    task = tasks.resolve(config, dataset)
    label_shape = task.label_shape(tuple(net.input_shape))
    batch = dataset.train_batch(step, config.global_batch_size, config.seed, config.augment,
                                jax.process_index(), pcount)
    want = (per_process, *net.input_shape)
    for split, b, n in (("training", batch, per_process),
                        ("test", next(iter(dataset.test_batches(2, limit=2)), None), 2)):
        if b is None:
            raise ConfigError(f"dataset {dataset.name!r} has no test examples")
        image, label = np.asarray(b["image"]), np.asarray(b["label"])
        if image.shape != (n, *net.input_shape):
            raise ConfigError(
                f"dataset {dataset.name!r} gives {split} images of shape {image.shape[1:]} (a batch of "
                f"{image.shape}), but it declares {tuple(dataset.image_shape)} and the model expects "
                f"{tuple(net.input_shape)} (a batch of {(n, *want[1:])}): fix the loader or its image_shape")
        if image.dtype != np.dtype(net.input_dtype):
            raise ConfigError(f"dataset {dataset.name!r} gives {split} inputs of dtype {image.dtype}, but it declares "
                              f"input_dtype {net.input_dtype!r}: fix the loader or its input_dtype")
        if label.shape != (n, *label_shape) or label.dtype != np.dtype(task.label_dtype):
            raise ConfigError(f"dataset {dataset.name!r} gives {split} labels of shape {label.shape} and dtype "
                              f"{label.dtype}; task {task.name!r} expects {task.label_dtype} labels of shape "
                              f"{(n, *label_shape)}")
        # Class or token ids index the outputs; a regression task's float targets have no range to check.
        if np.issubdtype(label.dtype, np.integer) and label.size and (
                label.min() < 0 or label.max() >= dataset.num_classes):
            raise ConfigError(f"dataset {dataset.name!r} gives {split} labels in [{label.min()}, {label.max()}], "
                              f"outside [0, {dataset.num_classes}) for its {dataset.num_classes} classes")
    return batch


def batch_sharding(mesh) -> NamedSharding:
    return NamedSharding(mesh, P("data") if "data" in mesh.axis_names else P())


def put_batch(batch: dict, mesh, sharding=None) -> dict:
    """This process's slice of the global batch as global arrays (default: sharded over `data`)."""
    sharding = sharding or batch_sharding(mesh)
    if jax.process_count() == 1:
        return jax.device_put(batch, sharding)
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}
