"""Tasks: what a network's outputs are judged by. A registry beside models and datasets.

A task owns, as small pure functions over arrays (JAX-traceable; the same code on the
host with numpy):

- the label shape of one example, from the example's input shape
  (`classification`: `()`; `language_modelling`: `(T,)`, the next token at each of
  the window's T positions), and `check_outputs`, which refuses a model whose
  per-example output shape is not the labels' shape plus one score per class;
- the loss: `example_losses(outputs, labels) -> [B]` (language modelling: each
  example's per-token cross-entropy averaged over its T tokens) and
  `loss(outputs, labels)`, their mean over the examples. Every method cuts a batch
  into equal micro-batches, so a mean of equal-sized micro-batch means is the batch's
  mean: every method minimises the same number;
- additive metric sums: `metric_sums(outputs, labels, mask=None) -> float32
  [len(sum_names)]` (mask: `[B]`, 0 for padded examples). Sums add over micro-batches,
  devices (one `psum`) and steps, so a runtime adds them up however it cuts the batch,
  and `finish(sums) -> dict` turns a total into the reported metrics, in
  `metric_names` order, `loss` first (`classification`: loss, accuracy;
  `language_modelling`: loss per token, perplexity, token_accuracy). `finish` takes a
  numpy array on the host (float64 kept) or a JAX array on device;
- the throughput unit: `unit` ('images', 'tokens'; metrics.jsonl writes
  `<unit>_per_second`) and `items_per_example(input_shape)`, the predictions one
  example holds (1 image; T tokens).

What a runtime needs (the whole contract):

    loss = task.loss(outputs, labels)              # the objective, differentiated
    sums = task.metric_sums(outputs, labels)       # added over micro-batches, psum over devices
    metrics = {"loss": loss_of_the_step, "metric_sums": sums_of_the_global_batch}

The trainer logs `task.finish` of the sums added over its logging window (train lines)
and over the test split (test lines); a method that reports no `metric_sums` has its
`loss` and `accuracy` averaged as before. Labels are integer class ids of shape
`[B, *label_shape]` (dtype `Task.label_dtype`: class ids, or a regression task's float
targets, which reach its loss as they are) and outputs float scores `[B, *label_shape,
classes]`.

`config.task` picks the task by name; '' (the default) takes the dataset's own
(`Dataset.task`). `resolve(config, dataset)` does that and checks that the dataset's
labels are the task's; a new task registers with `@register("name")` on a function
returning a `Task`, or `REGISTRY.add(name, task)`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from cdpjax.errors import ConfigError
from cdpjax.registry import Registry


@dataclasses.dataclass(frozen=True)
class Task:
    """A task's pure functions and names (module docstring).

    Attributes:
      name: its registry name (`config.task`).
      example_losses: `(outputs [B, *L, C], labels [B, *L]) -> [B]` per-example losses.
      metric_sums: `(outputs, labels, mask=None) -> [len(sum_names)]` additive sums.
      sum_names: what each entry of the sums is.
      finish: `sums -> {name: value}`, the reported metrics in `metric_names` order.
      metric_names: the reported metrics, `loss` first.
      label_shape: `input_shape -> label shape` of one example.
      unit: what throughput counts ('images' -> images_per_second).
      headline: the reported metric a one-line summary names first.
      short_names: reported metric -> the progress bar's label for it.
      rate_label: the progress bar's label for the throughput.
      label_dtype: the labels' dtype as the dataset gives them and every method carries them
        ('int32' class ids; a regression task's 'float32' targets).
      score: `(outputs, labels) -> scalar`, what local learning logs beside each module's local
        loss (classification: accuracy); None: 0.
    """

    name: str
    example_losses: Callable[[Any, Any], Any]
    metric_sums: Callable[..., Any]
    sum_names: tuple[str, ...]
    finish: Callable[[Any], dict]
    metric_names: tuple[str, ...]
    label_shape: Callable[[tuple], tuple]
    unit: str
    headline: str
    short_names: dict = dataclasses.field(default_factory=dict)
    rate_label: str = "items_s"
    label_dtype: str = "int32"
    score: Callable[[Any, Any], Any] | None = None

    def loss(self, outputs, labels):
        """The mean of the per-example losses: what every method minimises."""
        return self.example_losses(outputs, labels).mean()

    def items_per_example(self, input_shape) -> int:
        """Predictions per example (what throughput counts): 1 image, T tokens."""
        return math.prod(self.label_shape(tuple(input_shape)))

    def check_outputs(self, output_shape, label_shape, num_classes: int, model: str) -> None:
        """ConfigError unless one example's outputs are its labels' shape plus at least
        `num_classes` scores."""
        output_shape, label_shape = tuple(output_shape), tuple(label_shape)
        if output_shape[:-1] != label_shape or not output_shape or output_shape[-1] < num_classes:
            raise ConfigError(
                f"task {self.name!r} needs outputs of shape {(*label_shape, num_classes)} per example (labels "
                f"{label_shape} and a score for each of the {num_classes} classes), but model {model!r} gives "
                f"{output_shape}: choose a model for this task, or set --config.task to one its outputs fit "
                f"(registered: {', '.join(sorted(REGISTRY))})")


REGISTRY: Registry[Task] = Registry("task")


def register(name: str):
    """Decorator: `@register("name")` on a function returning the `Task` (called once, now)."""
    return lambda make: REGISTRY.add(name, make())


def lookup(name: str) -> Task:
    return REGISTRY.lookup(name)


def resolve(config, dataset) -> Task:
    """`config.task`, or the dataset's own where it is '' ; ConfigError when the dataset's
    labels are not the task's (e.g. token windows under 'classification')."""
    task = lookup(config.get("task", "") or getattr(dataset, "task", "classification"))
    want, have = task.label_shape(tuple(dataset.image_shape)), tuple(getattr(dataset, "label_shape", ()))
    if want != have:
        raise ConfigError(
            f"task {task.name!r} reads labels of shape {want} per example from inputs of shape "
            f"{tuple(dataset.image_shape)}, but dataset {dataset.name!r} gives labels of shape {have} (its task: "
            f"{getattr(dataset, 'task', 'classification')!r}): set --config.task='' to use the dataset's own")
    dtype = getattr(dataset, "label_dtype", "int32")
    if dtype != task.label_dtype:
        raise ConfigError(f"task {task.name!r} reads {task.label_dtype} labels, but dataset {dataset.name!r} gives "
                          f"{dtype} ones (its task: {getattr(dataset, 'task', 'classification')!r})")
    return task


from cdpjax.tasks import classification as _classification  # noqa: E402, F401  (registers itself)
from cdpjax.tasks import language_modelling as _language_modelling  # noqa: E402, F401

CLASSIFICATION: Task = REGISTRY["classification"]
LANGUAGE_MODELLING: Task = REGISTRY["language_modelling"]

__all__ = ["CLASSIFICATION", "LANGUAGE_MODELLING", "REGISTRY", "Task", "lookup", "register", "resolve"]
