"""Auxiliary heads: the small networks that give each local module its loss, as a registry.

In local learning module (stage) j < K-1 is trained on the loss of its own
head, built from the shape of the module's output; the last module has no head
and trains on the network's own loss, the task's (`cdpjax.tasks`), unless the kind
gives it one (`last_head`, below). Heads may hold mutable state
(BatchNorm running averages, and parameters that follow the next module by an
exponential moving average): `init` gives per-module parameters and state, and
`loss` returns the new state. BatchNorm statistics are those of each call (one
batch, or one data group's slice of it, on one device); the running averages
(PyTorch's momentum 0.1, eps 1e-5) are kept in the state but no training loss
reads them.

**A head kind** (the config's `aux_head`, options in `aux_kwargs`) is an entry of
`REGISTRY`, added with `@aux_heads.register(name)` as models are (a config's own
folder can hold one: `experiments/own_head/`). The entry (`HeadKind`) is:

- `factory(ctx, **options) -> flax Module | Head`: called once per local module j
  < K-1 with its `HeadContext` (the module's index, output shape, the network, the
  module groups) and the kind's options from `aux_kwargs`. A Flax module is called
  as `module(features, train)` and returns the head's outputs; a `Head` wraps one
  with what is particular to module j (its own loss, whether it reads the image,
  parameters kept as a moving average of the next module's).
- `loss(outputs, labels, images) -> (loss, score)`: the kind's own local loss on
  the outputs, or None (the default): the task's (`task_loss`: `Task.loss` and
  `Task.score` of the head's outputs: cross-entropy for classification, per-token
  cross-entropy for language modelling, a user's task its own), so that local
  learning follows the task. Labels reach it as the task gives them (a regression
  task's float targets unchanged).
- `tasks`: the tasks a kind's own loss serves (default: classification, which every
  built-in own loss is); a kind on another task is refused in one line, as is a
  task-loss head whose outputs are not the task's (`Task.check_outputs`).
- `options`: the `aux_kwargs` it accepts (default: the factory's keyword
  arguments, less `ctx`); every kind also takes `head_lr_scale` (read by the methods).
- `grouped`: whether its heads depend on which modules share a device
  (`config.module_groups`), as `man`'s do.
- `last`: whether its factory also builds a head for the last module (index K-1),
  asked for with `aux_kwargs.last_head=True`: the head reads the features before the
  network's last block (its classifier); the last module's other blocks train on that
  head's loss, and the classifier on the task's loss of the same features with the
  gradient stopped (`StagedNet.apply_stage_split`), so no gradient of the
  classifier's loss reaches the blocks. The two losses are added; each parameter gets
  the gradient of one of them. The last module must hold a block besides the classifier.

Built-in kinds (each registered through `register`):

- `greedy`: global average pool, then one linear layer (InfoPro's `0c1f`, the
  "greedy supervised learning" head).
- `dgl`: DGL's `auxillary_classifier2` (`eugenium/DGL`, `auxiliary_nets_study/
  models.py`) with its CIFAR default `--type_aux mlp-sr`: adaptive average pool
  to ceil(H/4) x ceil(W/4); `n_lin` = 3 times (1x1 conv C -> C without bias,
  BatchNorm, ReLU); adaptive average pool to 2x2; `mlp_layers` = 3 times
  (linear 4C -> 4C, BatchNorm, ReLU); linear 4C -> classes. With
  `mlp_layers=0`, as DGL: BatchNorm on the 2x2 map, then one linear layer.
- `infopro`, `man`: InfoPro's classifiers and decoder, and PPLL's momentum heads
  (copies of the next module's first blocks followed by EMA): `cdpjax.models.infopro`.
- `vit`: PPLL's ViT head for tokens `[B, T, D]`: `blocks[j]` fresh encoder
  blocks of the network's own shape (PPLL's default 2, 2, 2, 1, 1, 1, then 0),
  then LayerNorm and a linear classifier on the class token (`pool='cls'`) or
  the mean token (`pool='mean'`). `last_head=True` gives the last module one too
  (`blocks[K-1]` fresh blocks: 0 by default, LayerNorm and a linear classifier), as
  PPLL's released ViT trains its last part (`models/vit_model.py`,
  `VisionTransformer_back.forward_features`, lines 936-941: every block, the last
  included, trains through its `AuxClassifier` and is detached; 951-969: the final
  LayerNorm and `head` read the detached features; `util/utils.py:243-249`: the
  cross-entropy of that head's output, backward; with `configs/k4_vit_224_p16.yaml`'s
  back `aux_depth_list: [3,4,4,4]` (line 46) and `max_depth = 2` (`vit_model.py:883`), the
  last block's `AuxClassifier` holds `range(2 - 4 + 1)`, no blocks: LayerNorm and linear).

Where we differ from the reference code, and why:

- Features that are not images (`[B, D]` vectors, `[B, T, D]` tokens) skip the
  convolutions (and for `dgl` the poolings); tokens are averaged first.
- DGL's module also builds a BatchNorm `self.bn` that its forward uses only
  when `mlp_layers=0`: we build it only then (2C fewer parameters otherwise).
- Initialisation follows each reference: the DGL head's weights and biases
  PyTorch's default U(+-1/sqrt(fan_in)); BatchNorm scale 1, bias 0. `vit`'s
  linear layers as the network's blocks (PPLL's released ViT, `_init_vit_weights`:
  a normal of std 0.01, biases 0; `cdpjax.models.vit`). `greedy` keeps flax's defaults (no reference code fixes it; with
  PyTorch's, `local` with greedy heads on digits reached 95.7% against e2e's
  98.3%, outside the 2 points `tests/test_accuracy.py` allows).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from cdpjax.checks import options as declared_options
from cdpjax.errors import ConfigError
from cdpjax.models import norms, partition
from cdpjax.models.resnet import _torch_linear_bias
from cdpjax.models.staging import StagedNet, accuracy, cross_entropy
from cdpjax.models.vit import RELEASED_DENSE, EncoderBlock
from cdpjax.registry import Registry

PPLL_VIT_BLOCKS = (2, 2, 2, 1, 1, 1)  # then 0 for deeper modules
SHARED_OPTIONS = ("head_lr_scale",)  # every kind takes them; the methods read them
LAST_OPTION = "last_head"  # kinds registered with `last=True` take it; `build` reads it

# PyTorch's default initialisation of Conv2d and Linear weights: U(+-1/sqrt(fan_in)).
torch_default = nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform")

LocalLoss = Callable[[Any, jax.Array, Any], tuple[jax.Array, jax.Array]]


def classification_loss(outputs, labels, images=None):
    """(mean softmax cross-entropy, accuracy) of a head's logits: classification's local loss, for kinds
    that compose their own with it."""
    del images
    return cross_entropy(outputs, labels), accuracy(outputs, labels)


def task_loss(task) -> LocalLoss:
    """The task's local loss on a head's outputs: `(task.loss, task.score)` (score 0 where the task
    has none); labels as the task gives them."""
    def loss(outputs, labels, images=None):
        del images
        score = task.score(outputs, labels) if task.score is not None else jnp.zeros((), jnp.float32)
        return task.loss(outputs, labels), score
    return loss


# ---------------------------------------------------------------- the registry


@dataclasses.dataclass(frozen=True)
class HeadContext:
    """What a head factory knows about local module `index` (module docstring).

    Attributes:
      index: j, the module the head belongs to (0 .. K-2).
      net: the network cut into its K local modules (`StagedNet`).
      num_classes: the dataset's classes.
      feature_shapes: every module's output shape for one example.
      groups: local modules per device, in order (`config.module_groups`; one module per
        device when not given).
      block_shapes: `() -> shapes`, the input shape of every block of `net` and then its
        output shape (`cdpjax.models.partition.block_shapes`, batch 1), computed once.
      task: the task the heads learn (`cdpjax.tasks`): its loss is the default local loss.
    """

    index: int
    net: StagedNet
    num_classes: int
    feature_shapes: tuple[tuple[int, ...], ...]
    groups: tuple[int, ...]
    block_shapes: Callable[[], list] = dataclasses.field(default=None, compare=False, repr=False)
    task: Any = None  # the run's `cdpjax.tasks.Task` (None: classification)

    @property
    def num_modules(self) -> int:
        return len(self.feature_shapes)

    @property
    def feature_shape(self) -> tuple[int, ...]:
        return self.feature_shapes[self.index]

    @property
    def image_shape(self) -> tuple[int, ...]:
        return tuple(self.net.input_shape)

    @property
    def next_bounds(self) -> tuple[int, int]:
        """The block range [first, last + 1) of module j+1."""
        return self.net.bounds[self.index + 1]

    @property
    def group(self) -> int:
        """The index of the group (device) module j belongs to."""
        ends = [sum(self.groups[:g + 1]) for g in range(len(self.groups))]
        return next(g for g, end in enumerate(ends) if self.index < end)

    @property
    def next_on_same_device(self) -> bool:
        """Whether module j+1 is in module j's group (runs on the same device, in the same tick)."""
        return self.index + 1 < sum(self.groups[:self.group + 1])

    def next_stages(self) -> list[int]:
        """For every module i < K-1, the network stage (resolution group, 1-based, `block_stages`)
        of module i+1's first block: PPLL's `lo`."""
        stages = block_stages(self.block_shapes()[1:])
        return [stages[self.net.bounds[i + 1][0]] for i in range(self.num_modules - 1)]

    def copy_shape(self, depth: int) -> tuple[int, ...]:
        """One example's output of module j+1's first `depth` blocks."""
        return tuple(self.block_shapes()[self.next_bounds[0] + depth][1:])


@dataclasses.dataclass(frozen=True)
class Head:
    """One local module's head.

    Attributes:
      module: the Flax module, called as `module(features, train)`.
      loss: `(outputs, labels, images) -> (loss, accuracy)`; None: the kind's.
      needs_image: whether the loss reads the network's input (pipelines then carry it).
      weights: the weights of its loss terms (reconstruction, classification), for the
        record (`AuxHeads.weights`).
      ema: top-level parameter subtrees of `module` held as train state (`state['ema']`),
        not trained: copies of the next module's parameters.
      follow: `(ema, next_body_params) -> ema`, applied by `AuxHeads.follow` once the
        module's own step is computed; None: the `ema` parameters stay as they are.
    """

    module: nn.Module
    loss: LocalLoss | None = None
    needs_image: bool = False
    weights: tuple[float, float] = (0.0, 1.0)
    ema: tuple[str, ...] = ()
    follow: Callable | None = None


@dataclasses.dataclass(frozen=True)
class HeadKind:
    """A registered head kind (module docstring)."""

    name: str
    factory: Callable[..., Any]
    loss: LocalLoss | None = None  # None: the task's (`task_loss`)
    options: tuple[str, ...] = ()
    grouped: bool = False
    tasks: tuple[str, ...] = ("classification",)  # the tasks its own loss (the kind's or a `Head`'s) serves
    last: bool = False  # whether it builds a head for the last module too (`aux_kwargs.last_head`)


REGISTRY: Registry[HeadKind] = Registry("auxiliary head")


def register(name: str, *, loss: LocalLoss | None = None, options=None, grouped: bool = False,
             tasks=("classification",), last: bool = False):
    """Decorator: `@aux_heads.register("my_head")` on a factory `factory(ctx, **options)`
    (module docstring); `loss` is its own local loss (default None: the task's), `options`
    its `aux_kwargs` (default: the factory's arguments after the first, the context), `tasks` the
    tasks its own loss serves (where it has one), `last` whether the factory builds a head for the
    last module too (then `aux_kwargs.last_head` is one of its options)."""
    def add(factory):
        context = next(iter(inspect.signature(factory).parameters), None)  # the first argument: the context
        opts = tuple(options) if options is not None else tuple(sorted(declared_options(factory, (context,))))
        REGISTRY.add(name, HeadKind(name, factory, loss, opts + ((LAST_OPTION,) if last else ()), grouped,
                                    tuple(tasks), last))
        return factory
    return add


def check_options(kind: str, kwargs: dict) -> None:
    """`kind` is registered and every key of `kwargs` is one of its options."""
    allowed = REGISTRY.lookup(kind).options + SHARED_OPTIONS
    for key in kwargs:
        if key not in allowed:
            raise ConfigError(f"aux_kwargs.{key} is not an option of the {kind!r} head; "
                              f"accepted: {', '.join(allowed)}")


# ---------------------------------------------------------------- the built heads


def _count(tree) -> int:
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


@dataclasses.dataclass(frozen=True)
class AuxHeads:
    """One head per local module but the last, and the local loss of every module.

    Attributes:
      kind: the config's `aux_head`.
      heads: per module, its `Head`; for the last module None (it trains on the task's loss), or
        its last head (`last_head`: its blocks but the network's classifier train on it).
      feature_shapes: per module, one example's shape of the features its head reads: the
        module's output; with a last head, the last module's features before the classifier.
      image_shape: the network's input shape (for reconstruction).
      groups: local modules per device the heads were built for.
      grouped: whether the heads depend on `groups` (`HeadKind.grouped`).
      pixel_mean, pixel_std: the network's input -> the raw image in [0, 1], per channel
        (kinds that reconstruct it).
      task: the run's task (None: classification).
    """

    kind: str
    heads: tuple
    feature_shapes: tuple[tuple[int, ...], ...]
    image_shape: tuple[int, ...]
    groups: tuple[int, ...]
    grouped: bool = False
    pixel_mean: tuple[float, ...] = (0.0,)
    pixel_std: tuple[float, ...] = (1.0,)
    task: Any = None  # the `cdpjax.tasks.Task` whose loss the last module (and task-loss heads) train on

    @property
    def num_stages(self) -> int:
        return len(self.heads)

    @property
    def splits_last(self) -> bool:
        """Whether the last module has a head: its classifier (the network's last block) then trains
        on the task's loss of stopped features, its other blocks on the head's loss
        (`StagedNet.apply_stage_split`)."""
        return self.heads[-1] is not None

    @property
    def modules(self) -> tuple:
        """Per module, the head's Flax module (None for the last module)."""
        return tuple(None if h is None else h.module for h in self.heads)

    @property
    def weights(self) -> tuple[tuple[float, float], ...]:
        """Per module, its (reconstruction, classification) loss weights; (0, 1) for the last."""
        return tuple((0.0, 1.0) if h is None else h.weights for h in self.heads)

    @property
    def needs_image(self) -> bool:
        """Whether some module's local loss reads the input image (reconstruction)."""
        return any(h is not None and h.needs_image for h in self.heads)

    def init(self, rng) -> tuple[list[Any], list[Any]]:
        """Per-module head parameters and state (`{}` and `{}` for the last module), module j's
        from its own key. Parameters a head follows by EMA (`Head.ema`) go to `state['ema']`."""
        params, state = [], []
        for j, (head, shape) in enumerate(zip(self.heads, self.feature_shapes)):
            if head is None:
                params.append({})
                state.append({})
                continue
            variables = dict(head.module.init(jax.random.fold_in(rng, j), jnp.zeros((2, *shape), jnp.float32)))
            p = dict(variables.pop("params", {}))
            ema = {key: p.pop(key) for key in head.ema}
            params.append(p)
            state.append({**variables, **({"ema": ema} if ema else {})})
        return params, state

    def loss(self, j: int, params, state, features, labels, images=None, train: bool = True):
        """Module j's local loss on the `features` its head reads: `(loss, (accuracy, new_state))`.

        The last module without a head: `features` are the network's outputs, its loss is the
        task's on them and `state` passes through. With a last head (`splits_last`), this is
        that head's loss on the features before the classifier; the task's loss of the
        classifier's outputs is added by the caller (`cdpjax.methods.local.stage_grads`). With
        `train`, BatchNorm uses this call's statistics and updates its running averages in the new
        state; EMA parameters pass through (no gradient reaches them).
        """
        head = self.heads[j]
        if head is None:
            loss, score = self.output_loss(features, labels)
            return loss, (score, state)
        ema = state.get("ema")
        mutable = {k: v for k, v in state.items() if k != "ema"}
        variables = {"params": {**params, **lax.stop_gradient(ema)} if ema else params, **mutable}
        if train and mutable:
            outputs, new_state = head.module.apply(variables, features, train=True, mutable=list(mutable))
            new_state = dict(new_state)
        else:
            outputs, new_state = head.module.apply(variables, features, train=train), dict(mutable)
        if ema is not None:
            new_state["ema"] = ema
        loss, acc = head.loss(outputs, labels, images)
        return loss, (acc, new_state)

    def output_loss(self, outputs, labels):
        """`(loss, score)`: the task's on the network's outputs."""
        return task_loss(_task(self.task))(outputs, labels)

    def follow(self, j: int, params, state, next_body):
        """Module j's head state after its step: its EMA parameters moved towards module j+1's
        (`next_body`, read before module j+1's own update on the same batch). Identity for
        heads with nothing to follow. `params` (module j's head parameters) are not read by the
        built-in kinds."""
        del params
        head = self.heads[j]
        if head is None or head.follow is None:
            return state
        return {**state, "ema": head.follow(state["ema"], next_body)}

    def param_counts(self) -> list[dict]:
        """Per module `{'head_params', 'decoder_params', 'ema_params'}`: trained parameters less
        InfoPro's reconstruction decoder, the decoder's, and those that follow the next module
        by EMA (state, not trained)."""
        params, state = jax.eval_shape(lambda: self.init(jax.random.key(0)))  # the key too: nothing runs
        counts = []
        for p, s in zip(params, state):
            decoder = _count(p.get("decoder", {}))
            counts.append({"head_params": _count(p) - decoder, "decoder_params": decoder,
                           "ema_params": _count(s.get("ema", {}))})
        return counts


def _groups(groups, num_modules: int, kind: str, strict: bool) -> tuple[int, ...]:
    """The module groups the heads are built for: `groups` if given (checked where the kind
    depends on them), else one module per device."""
    if not groups:
        return (1,) * num_modules
    groups = tuple(int(g) for g in groups)
    if sum(groups) != num_modules or min(groups) < 1:
        if strict:
            raise ConfigError(f"module_groups={list(groups)} must be positive and add up to the {num_modules} "
                              f"local modules: aux_head={kind!r} builds its heads from them")
        return (1,) * num_modules
    return groups


def block_stages(outputs) -> tuple[int, ...]:
    """Per block (`outputs`: each block's output shape), the network stage it belongs to
    (1-based): 1 + how many times the feature map's spatial size has shrunk from the first
    block's output to this block's output (ResNet-32: 1, 2, 3 for its three groups of 16, 32,
    64 channels; its stem is in stage 1); 1 for every block of a network whose blocks output no
    spatial maps."""
    stages, stage = [], 1
    for k, shape in enumerate(outputs):
        previous = outputs[k - 1] if k else shape
        if len(shape) == 4 and len(previous) == 4 and math.prod(shape[1:3]) < math.prod(previous[1:3]):
            stage += 1
        stages.append(stage)
    return tuple(stages)


def _task(task):
    if task is None:
        from cdpjax import tasks

        return tasks.CLASSIFICATION
    return task


def _check_task(kind: str, entry: HeadKind, head: Head, task, j: int, feature_shape, num_classes: int,
                input_shape) -> Head:
    """`head` with its local loss: its own where the kind serves `task` with one, else the task's on outputs
    of the task's shape; a ConfigError otherwise."""
    own = head.loss or entry.loss
    if own is not None:
        if task.name not in entry.tasks:
            raise ConfigError(f"aux_head={kind!r} trains on its own loss, for task {', '.join(entry.tasks)}; this "
                              f"run's task is {task.name!r}: choose a head that takes the task's loss")
        return dataclasses.replace(head, loss=own)
    outputs = jax.eval_shape(lambda: head.module.init_with_output(
        jax.random.key(0), jnp.zeros((1, *feature_shape), jnp.float32))[0]).shape[1:]
    labels = tuple(task.label_shape(tuple(input_shape)))
    if tuple(outputs[:-1]) != labels or not outputs or outputs[-1] < num_classes:
        raise ConfigError(f"aux_head={kind!r} gives module {j} outputs of shape {tuple(outputs)} per example; task "
                          f"{task.name!r} needs {(*labels, num_classes)} (labels {labels}, {num_classes} scores)")
    return dataclasses.replace(head, loss=task_loss(task))


def build(kind: str, net, num_classes: int, kwargs: dict | None = None, groups=None, task=None) -> AuxHeads:
    """The heads of `kind` for the local modules (stages) of `net` (a StagedNet), options from
    `kwargs` (the config's `aux_kwargs`), for modules grouped on devices as `groups` says
    (`config.module_groups`; None: one module per device), learning `task` (a `cdpjax.tasks.Task`;
    None: classification)."""
    kwargs = dict(kwargs or {})
    check_options(kind, kwargs)
    entry = REGISTRY.lookup(kind)
    task = _task(task)
    shapes = tuple(tuple(s[1:]) for s in net.stage_output_shapes(1))
    own = {k: v for k, v in kwargs.items() if k not in SHARED_OPTIONS + (LAST_OPTION,)}
    groups = _groups(groups, len(shapes), kind, entry.grouped)
    shapes_of_blocks = functools.cache(lambda: partition.block_shapes(net.blocks, net.input_shape))
    last = kwargs.get(LAST_OPTION, False)
    if not isinstance(last, bool):
        raise ConfigError(f"aux_kwargs.{LAST_OPTION}={last!r} must be True or False")
    if last:
        first, end = net.bounds[-1]
        if end - first < 2:
            raise ConfigError(f"aux_kwargs.{LAST_OPTION}=True needs a block before the classifier in the last "
                              f"module; it holds block {first} alone: cut the stages one block earlier")
        shapes = (*shapes[:-1], tuple(shapes_of_blocks()[-2][1:]))  # the classifier's input
    heads = []
    for j in range(len(shapes) - (0 if last else 1)):
        made = entry.factory(HeadContext(j, net, num_classes, shapes, groups, shapes_of_blocks, task), **own)
        head = made if isinstance(made, Head) else Head(made)
        heads.append(_check_task(kind, entry, head, task, j, shapes[j], num_classes, net.input_shape))
    mean, std = (0.0,), (1.0,)
    if "pixel_mean" in entry.options:
        channels = net.input_shape[-1]
        mean = per_channel(kwargs, "pixel_mean", 0.0, channels, False)
        std = per_channel(kwargs, "pixel_std", 1.0, channels, True)
    heads = (*heads, *(() if last else (None,)))  # the last module's: its last head, else none
    return AuxHeads(kind, heads, shapes, tuple(net.input_shape), groups, entry.grouped, mean, std, task)


def head_lr_scale(kwargs: dict | None) -> float:
    scale = (kwargs or {}).get("head_lr_scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
        raise ConfigError(f"aux_kwargs.head_lr_scale={scale!r} must be a positive number")
    return float(scale)


# ---------------------------------------------------------------- shared pieces


def number(value, key: str, kind=float, low=0):
    """`value` as a `kind` >= `low`, or a ConfigError naming `aux_kwargs.<key>`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < low or \
            (kind is int and int(value) != value):
        what = "an integer" if kind is int else "a number"
        raise ConfigError(f"aux_kwargs.{key}={value!r} must be {what} >= {low}")
    return kind(value)


def per_channel(kwargs: dict, key: str, default: float, channels: int, positive: bool) -> tuple[float, ...]:
    value = kwargs.get(key, (default,))
    value = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    if len(value) not in (1, channels) or any(isinstance(v, bool) or not isinstance(v, (int, float))
                                              or (positive and v <= 0) for v in value):
        raise ConfigError(f"aux_kwargs.{key}={list(value)!r} must be 1 or {channels} "
                          f"{'positive ' if positive else ''}numbers (per channel, [0, 1] pixel units)")
    return tuple(float(v) for v in value) * (channels if len(value) == 1 else 1)


def pool(y):
    """Mean over every axis between the batch and the features."""
    return y.mean(axis=tuple(range(1, y.ndim - 1))) if y.ndim > 2 else y


def adaptive_avg_pool(x, size):
    """PyTorch's adaptive average pooling of `[B, H, W, C]` to `[B, h, w, C]` (`size`: h or (h, w)):
    output cell i averages rows floor(i H / h) to ceil((i + 1) H / h)."""
    rows, cols = (size, size) if isinstance(size, int) else size

    def cuts(n, m):
        return [(math.floor(i * n / m), math.ceil((i + 1) * n / m)) for i in range(m)]

    x = jnp.concatenate([x[:, a:b].mean(axis=1, keepdims=True) for a, b in cuts(x.shape[1], rows)], axis=1)
    return jnp.concatenate([x[:, :, a:b].mean(axis=2, keepdims=True) for a, b in cuts(x.shape[2], cols)], axis=2)


class TorchDense(nn.Module):
    """A linear layer initialised as PyTorch's `nn.Linear`."""

    features: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.features, kernel_init=torch_default, bias_init=_torch_linear_bias(x.shape[-1]))(x)


# ---------------------------------------------------------------- built-in kinds


class GreedyHead(nn.Module):
    num_classes: int

    @nn.compact
    def __call__(self, y, train: bool = False):
        return nn.Dense(self.num_classes)(pool(y))


class DGLHead(nn.Module):
    """DGL's `auxillary_classifier2` (module docstring)."""

    num_classes: int
    n_lin: int = 3
    mlp_layers: int = 3

    @nn.compact
    def __call__(self, y, train: bool = False):
        if y.ndim == 4:
            y = adaptive_avg_pool(y, (math.ceil(y.shape[1] / 4), math.ceil(y.shape[2] / 4)))
            for _ in range(self.n_lin):
                y = nn.Conv(y.shape[-1], (1, 1), use_bias=False, kernel_init=torch_default)(y)
                y = nn.relu(norms.make("batch", None, train)(y))
            y = adaptive_avg_pool(y, 2)
            if not self.mlp_layers:
                y = norms.make("batch", None, train)(y)
        else:
            y = pool(y)
        y = y.reshape(y.shape[0], -1)
        for _ in range(self.mlp_layers):
            y = nn.relu(norms.make("batch", None, train)(TorchDense(y.shape[-1])(y)))
        return TorchDense(self.num_classes)(y)


class ViTHead(nn.Module):
    num_classes: int
    depth: int
    heads: int
    mlp_dim: int
    pool: str = "cls"
    kernel_init: Any = RELEASED_DENSE  # of its linear layers: the network's blocks' (`_encoder_shape`)
    approximate_gelu: bool = False  # the network's blocks' activation (`_encoder_shape`)

    @nn.compact
    def __call__(self, y, train: bool = False):
        for _ in range(self.depth):
            y = EncoderBlock(self.heads, self.mlp_dim, kernel_init=self.kernel_init,
                             approximate_gelu=self.approximate_gelu)(y)
        y = nn.LayerNorm(epsilon=1e-6)(y)
        y = y[:, 0] if self.pool == "cls" else y.mean(axis=1)
        return nn.Dense(self.num_classes, kernel_init=self.kernel_init)(y)


def _encoder_shape(net, width: int) -> tuple[int, int, Any, bool]:
    """Heads, MLP width, linear layers' initialiser and GELU form (approximate or not) of the network's
    own encoder blocks (else 64-wide heads, MLP 4x, PPLL's released initialiser and exact GELU)."""
    for block in net.blocks:
        if isinstance(block, EncoderBlock):
            return block.heads, block.mlp_dim, block.kernel_init, block.approximate_gelu
    return max(1, width // 64) if width % 64 == 0 else 1, 4 * width, RELEASED_DENSE, False


@register("greedy")
def greedy(ctx: HeadContext):
    return GreedyHead(ctx.num_classes)


@register("dgl")
def dgl(ctx: HeadContext, *, n_lin: int = 3, mlp_layers: int = 3):
    return DGLHead(ctx.num_classes, number(n_lin, "n_lin", int), number(mlp_layers, "mlp_layers", int))


@register("vit", last=True)
def vit(ctx: HeadContext, *, blocks=PPLL_VIT_BLOCKS, num_heads: int | None = None, mlp_dim: int | None = None,
        pool: str = "cls"):
    shape, j = ctx.feature_shape, ctx.index
    if len(shape) != 2:
        raise ConfigError(f"aux_head='vit' needs token outputs [T, D]; module {j} of {ctx.net.name!r} "
                          f"gives {list(shape)}: use greedy, dgl or infopro")
    blocks = tuple(blocks)
    depth = int(blocks[j]) if j < len(blocks) else 0
    own_heads, own_mlp, kernel_init, approximate_gelu = _encoder_shape(ctx.net, shape[-1])
    heads = int(own_heads if num_heads is None else num_heads)
    if shape[-1] % heads:
        raise ConfigError(f"aux_kwargs.num_heads={heads} does not divide the token width {shape[-1]}")
    if pool not in ("cls", "mean"):
        raise ConfigError(f"aux_kwargs.pool={pool!r} is not one of cls, mean")
    return ViTHead(ctx.num_classes, depth, heads, int(own_mlp if mlp_dim is None else mlp_dim), pool, kernel_init,
                   approximate_gelu)


# InfoPro's classifiers and decoder, and PPLL's momentum heads, register themselves on import.
from cdpjax.models import infopro as _infopro  # noqa: E402
from cdpjax.models import sequence_heads as _sequence_heads  # noqa: E402,F401 - registers token_linear, token_blocks, token_output
from cdpjax.models.infopro import (  # noqa: E402,F401 - the InfoPro pieces, under their old names too
    INFOPRO_ARCHS, binary_cross_entropy, infopro_conv, infopro_weights, resize_align_corners, supcon_loss)

__all__ = ["AuxHeads", "Head", "HeadContext", "HeadKind", "INFOPRO_ARCHS", "PPLL_VIT_BLOCKS", "REGISTRY",
           "adaptive_avg_pool", "binary_cross_entropy", "block_stages", "build", "check_options",
           "classification_loss", "head_lr_scale", "task_loss", "infopro_conv", "infopro_weights", "register",
           "resize_align_corners", "supcon_loss"]
del _infopro
