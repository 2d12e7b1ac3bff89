"""What every method shares: the builder contract and small SPMD helpers.

A method's builder (named by its `cdpjax.layouts.Layout`) takes a `Context`
(config, mesh, input shape and dtype, classes, task) and returns a `Method`: pure functions over an explicit train
state (a NamedTuple of arrays with fixed fields, a part the method does not keep None,
registered with `cdpjax.train_state.typed_state`; checkpointed whole, so in-flight state resumes
exactly):

- `init(rng) -> state`, placed on the mesh;
- `train_step(state, batch) -> (state, metrics)`, jitted with the state donated;
  `batch` is one global batch `{'image': [B, *input_shape], 'label': [B, *label_shape]}` (float
  images or int32 token ids; labels as `ctx.task` reads them);
- `export(state) -> (params, model_state)`: per-stage lists in the common
  `StagedNet` layout, which evaluation, checkpoint inspection and the equality
  tests use;
- `flush(state) -> state` (pipelines only): completes the work still in flight,
  so that the parameters account for every batch fed;
- `input_sharding`: where the trainer places each global batch (default: over `data`).

What the trainer reads besides (`cdpjax.train`, docs/guarantees.md): `train_step`
and `export` must trace inside the trainer's own jit (it adds the finite checks
there); `metrics['loss']` (required: the step's `ctx.task.loss`), `metrics['metric_sums']`
(`ctx.task.metric_sums` added over the whole global batch: the trainer's train lines are
`task.finish` of them; a method without them has its `loss` and `accuracy` averaged),
`metrics['stage_loss']` and an optional
`metrics['finite']`, one value per stage, name the stage that went non-finite;
`Method.state_depends_on_mesh` refuses a checkpoint from another mesh even when
the state's shapes fit; `Method.stale` (CDP) is compared with the checkpoint's.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
from jax import lax

from cdpjax import models, optim, tasks
from cdpjax.errors import ConfigError
from cdpjax.mesh import axis_size

@dataclasses.dataclass(frozen=True)
class Context:
    """What a builder is given: the config, the mesh, one example's input shape and dtype (the
    dataset's), the classes, and the task (`cdpjax.tasks`: the loss and metrics to use)."""

    config: ml_collections.ConfigDict
    mesh: Any
    input_shape: tuple[int, ...]
    num_classes: int
    input_dtype: str = "float32"
    task: tasks.Task = tasks.CLASSIFICATION

    def net(self, bn_axis_name=None, stages=None) -> models.StagedNet:
        return models.build(self.config, self.input_shape, self.num_classes, bn_axis_name, stages, self.input_dtype)

    def axis(self, name: str) -> int:
        return axis_size(self.mesh, name)

    def optimizer(self):
        return optim.make(self.config)

    def require_axes(self, method: str, allowed: tuple[str, ...]) -> None:
        for axis, size in self.mesh.shape.items():
            if axis not in allowed and size > 1:
                raise ConfigError(
                    f"method {method!r} runs on mesh axes {allowed}, but the mesh has {axis}={size}; "
                    f"set --config.mesh.{axis}=1 or choose another method"
                )

    def require_divisible(self, what: str, value: int, by: int, by_what: str) -> None:
        if value % by:
            raise ConfigError(f"{what}={value} is not divisible by {by_what}={by}")


@dataclasses.dataclass(frozen=True)
class Method:
    """A built method: its pure functions and what the trainer, bench and tests read of it.

    Every field is typed and named: nothing outside `cdpjax.methods` reads a method by
    guessing from which keys it has.

    Attributes:
      name, net: the method's name and the staged network it trains.
      init, train_step, export, flush: see the module docstring.
      table: its time table (`cdpjax.timetable.TimeTable`), None for one-device methods.
      program: its lowered program (`cdpjax.program.Program`) where a tick engine runs it:
        the buffers, sends, versions and lag that bench's memory model and bytes read.
      run_steps: `(state, batches) -> (state, metrics)` over S stacked batches `[S, B, ...]`
        in one compiled program, where the method has one.
      periods: the engine's jitted program of S calls, `(state, images [S, B, ...], labels
        [S, B], feeding [S]) -> (state, metrics)`, whose compiled HLO the tests and bench read.
      gradients: `(state, batch) -> per-stage gradients` of one step with no update (flushed
        pipelines; the equality tests).
      worker_losses: `(state, batch) -> [N]` each CDP worker's loss (simulate).
      carrier: the flat layouts its state is stored in (`cdpjax.carrier`), for padding and
        memory reports.
      padding: the carrier's stored / real ratios (`carrier.format_report`), None without one.
      heads, export_heads, export_head_state: local learning's auxiliary heads, `state -> head
        parameters` and `state -> head state` (BatchNorm averages, EMA copies), per module.
      module_groups: local modules per device (ppll).
      stale: CDP's `[workers, stages]` matrix of pairs that read the previous version; a
        checkpoint written under another one is refused.
      stored_versions: parameter versions it keeps per stage (its program's where it has one).
      workers: CDP workers (None elsewhere). devices: devices it runs on.
      dp_mp_devices: the devices DP with model parallelism needs for the same workers and
        stages (cdp-mp's comparison).
      state_depends_on_mesh: a checkpoint from another mesh is refused even when the
        state's shapes fit.
      input_sharding: where the trainer puts each global batch; None: over `data`
        (replicated when there is none); one-device methods give their device's.
      report: JSON-able figures for the records (bench, summary.json), written whole.
    """

    name: str
    net: models.StagedNet
    init: Callable[[jax.Array], Any]
    train_step: Callable[[Any, dict], tuple[Any, dict]]
    export: Callable[[Any], tuple[list, list]]
    flush: Callable[[Any], Any] | None = None
    table: Any = None
    program: Any = None
    run_steps: Callable | None = None
    periods: Callable | None = None
    gradients: Callable | None = None
    worker_losses: Callable | None = None
    carrier: Any = None
    padding: dict | None = None
    heads: Any = None
    export_heads: Callable | None = None
    export_head_state: Callable | None = None
    module_groups: tuple[int, ...] | None = None
    stale: Any = None
    stored_versions: int = 1
    workers: int | None = None
    devices: int | None = None
    dp_mp_devices: int | None = None
    state_depends_on_mesh: bool = False
    input_sharding: Any = None
    report: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.program is not None and self.stored_versions != self.program.versions:
            object.__setattr__(self, "stored_versions", self.program.versions)


def varying(x, axes):
    """`x` made device-varying over `axes`, leaving axes it already varies over.

    Scan carries, switch branch outputs and loss cotangents inside `shard_map`
    must agree on which axes they vary over; pcasting an already varying value
    raises, hence the check.
    """
    axes = (axes,) if isinstance(axes, str) else tuple(axes)

    def one(leaf):
        have = varying_axes(leaf)
        missing = tuple(a for a in axes if a not in have)
        return lax.pcast(leaf, missing, to="varying") if missing else leaf

    return jax.tree.map(one, x)


def varying_axes(x) -> frozenset:
    """The mesh axes `x` varies over inside `shard_map` (`.vma` on JAX 0.11, `.manual_axis_type` on 0.10)."""
    t = jax.typeof(x)
    if hasattr(t, "vma"):
        return frozenset(t.vma)
    mat = getattr(t, "manual_axis_type", None)
    return frozenset(mat.varying) if mat is not None else frozenset()


def loss_and_metrics(net: models.StagedNet, params, state, images, labels, train: bool = True,
                     task: tasks.Task = tasks.CLASSIFICATION):
    """`(task.loss, (new model state, task.metric_sums))` of the whole network on one batch."""
    outputs, new_state = net.apply(params, state, images, train)
    return task.loss(outputs, labels), (new_state, task.metric_sums(outputs, labels))


def step_metrics(task: tasks.Task, loss, sums) -> dict:
    """A train step's metrics: its loss, the task's reported metrics of the step (classification's
    `accuracy`...) and the sums the trainer adds over its logging window (`metric_sums`)."""
    return {**task.finish(sums), "loss": loss, "metric_sums": sums}


def tree_select(pred, on_true, on_false):
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)
