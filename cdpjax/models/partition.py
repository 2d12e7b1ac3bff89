"""Stage partitions: where the blocks of a model are cut into stages.

A partition is a tuple of split points: the block indices where stages
1..L-1 start. It is given explicitly, or computed for a number of stages by a
strategy:

- `blocks`: the same number of blocks per stage (rounded);
- `params`: balance parameter counts (each block's `init` evaluated abstractly),
  which sets the padding of a uniform parameter carrier;
- `flops`: balance XLA's cost-analysis FLOPs of each block's forward at batch 1,
  which sets the pace of a pipeline (the slowest stage);
- `memory`: the cut whose cyclic schedule (`cdp-v2`, N = L workers; `cdp-mp` runs the
  same ops on stage devices) holds the fewest activation bytes at its busiest tick,
  counting each stage's real output bytes from its forward to its backward, the
  table's model (`TimeTable.activation_stats`); ties go to the most even outputs.
  Searched over every cut. The unit model (every stage's output one "stage-
  activation") gives CDP half of DP's peak whatever the cut; in bytes the cut
  decides (`memory_report`);
- `time`: balance each block's MEASURED forward + backward seconds on this machine's
  default device at the step's micro-batch (`block_seconds`): the pace of a lockstep
  tick, where a stage of higher resolution can be slower per FLOP than `flops` says.
  The cut is the machine's, not the model's: it can differ between a CPU and a GPU,
  and between runs when two blocks time alike.

The balanced strategies return the contiguous partition that minimises the
largest stage cost (exactly, by dynamic programming), and among those the one
with the smallest sum of squared stage costs, so ties go to the most even cut.

`INFOPRO_SPLITS` holds InfoPro's ResNet-32 cuts for K local modules as split
points of `resnet32`'s block list; `infopro_points(K)` returns them for a config.
"""
from __future__ import annotations

import functools
import math
from typing import Sequence

import numpy as np

from cdpjax.errors import ConfigError

STRATEGIES = ("params", "flops", "blocks", "memory", "time")


def split_points(blocks: Sequence, spec, strategy: str, input_shape, model_name: str = "model",
                 input_dtype: str = "float32", batch_size: int = 1) -> tuple[int, ...]:
    """Block indices where stages 1..L-1 start.

    `spec` is a number of stages (balanced by `strategy`) or explicit split points;
    `input_dtype` is what the first block reads (int32 token ids for a language model);
    `batch_size` is the batch `time` measures at (the micro-batch of a tick).
    """
    n = len(blocks)
    if isinstance(spec, (list, tuple)):
        points = tuple(int(p) for p in spec)
        if any(b <= a for a, b in zip((0, *points), (*points, n))):
            raise ConfigError(
                f"split points {list(points)} must be strictly increasing within 1..{n - 1} "
                f"({model_name} has {n} blocks)"
            )
        return points
    stages = int(spec)
    if stages > n:
        raise ConfigError(f"stages={stages} but {model_name} has only {n} blocks: choose stages <= {n}")
    if stages < 1:
        raise ConfigError(f"stages={stages} must be >= 1")
    if strategy not in STRATEGIES:
        raise ConfigError(f"partition={strategy!r} is not one of {', '.join(STRATEGIES)}")
    if strategy == "blocks" or stages in (1, n):  # nothing to balance
        return even_points(n, stages)
    if strategy == "memory":
        return memory_points(blocks, input_shape, stages, input_dtype)
    if strategy == "time":
        return balanced_points(block_seconds(blocks, input_shape, batch_size, input_dtype), stages)
    return balanced_points(block_costs(blocks, input_shape, strategy, input_dtype), stages)


def _held_peaks(outputs: Sequence[float], stages: int) -> tuple[float, float]:
    """(CDP's, DP's) activation bytes held at the busiest tick over all N = L workers, each
    stage holding its output from its forward to its backward."""
    from cdpjax.layouts.cdp import cdp_table  # pure Python; late: the layouts import the registry

    cdp, dp = (cdp_table(rule, stages, stages, steps=3) for rule in ("cdp-v2", "dp"))
    return cdp.activation_stats(outputs)["total_peak_bytes"], dp.activation_stats(outputs)["total_peak_bytes"]


def memory_points(blocks: Sequence, input_shape, stages: int, input_dtype: str = "float32") -> tuple[int, ...]:
    """The cut of `blocks` into `stages` stages whose cyclic schedule holds the fewest activation
    bytes at its busiest tick (ties: the most even stage outputs); every cut is tried."""
    import itertools

    outputs = [float(np.prod(s)) * 4 for s in block_shapes(blocks, input_shape, input_dtype=input_dtype)[1:]]
    n = len(blocks)
    best = None
    for points in itertools.combinations(range(1, n), stages - 1):
        stage_out = [outputs[b - 1] for b in (*points, n)]
        key = (_held_peaks(stage_out, stages)[0], float(np.square(stage_out).sum()))
        if best is None or key < best[0]:
            best = (key, points)
    return tuple(best[1])


def memory_report(blocks: Sequence, points: Sequence[int], input_shape, input_dtype: str = "float32") -> dict:
    """Activation bytes (per example) a cut holds at the busiest tick over N = L workers, CDP's and
    DP's, their ratio (the unit model says 0.5 for every cut), and each stage's output bytes."""
    outputs = [float(np.prod(s)) * 4 for s in block_shapes(blocks, input_shape, input_dtype=input_dtype)[1:]]
    stage_out = [outputs[b - 1] for b in (*tuple(points), len(blocks))]
    cdp, dp = _held_peaks(stage_out, len(stage_out))
    return {"points": list(points), "stage_output_bytes": stage_out, "cdp_peak_bytes": cdp, "dp_peak_bytes": dp,
            "ratio": cdp / dp if dp else 0.0}


def even_points(n: int, stages: int) -> tuple[int, ...]:
    """The same number of blocks per stage, rounded."""
    return tuple(round(n * k / stages) for k in range(1, stages))


def balanced_points(costs: Sequence[float], stages: int) -> tuple[int, ...]:
    """Split points of the contiguous partition of `costs` into `stages` non-empty parts
    with the smallest maximum part; among those, the smallest sum of squared parts."""
    costs = [float(c) for c in costs]
    n = len(costs)
    if not 1 <= stages <= n:
        raise ConfigError(f"cannot cut {n} blocks into {stages} non-empty stages")
    prefix = np.concatenate([[0.0], np.cumsum(costs)])

    def part(a, b):
        return prefix[b] - prefix[a]

    # Pass 1: the optimal bottleneck. worst[k][i]: best max cost of the first i blocks in k parts.
    inf = math.inf
    worst = [[inf] * (n + 1) for _ in range(stages + 1)]
    worst[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            worst[k][i] = min(max(worst[k - 1][j], part(j, i)) for j in range(k - 1, i))
    bound = worst[stages][n] * (1 + 1e-9) + 1e-12
    # Pass 2: under that bound, the most even partition (least sum of squares).
    square = [[inf] * (n + 1) for _ in range(stages + 1)]
    choice = [[0] * (n + 1) for _ in range(stages + 1)]
    square[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                c = part(j, i)
                if c <= bound and square[k - 1][j] + c * c < square[k][i]:
                    square[k][i], choice[k][i] = square[k - 1][j] + c * c, j
    points, i = [], n
    for k in range(stages, 1, -1):
        i = choice[k][i]
        points.append(i)
    return tuple(reversed(points))


def _cached(fn):
    """Memoise per (block, input shape, input dtype); blocks are frozen dataclasses, so equal blocks
    share costs."""
    cached = functools.lru_cache(maxsize=None)(fn)

    @functools.wraps(fn)
    def wrapper(block, shape, dtype="float32", *rest):
        try:
            return cached(block, shape, str(dtype), *rest)
        except TypeError:  # an unhashable block: compute without the cache
            return fn(block, shape, dtype, *rest)

    return wrapper


def _abstract_init(block, shape, dtype="float32"):
    import jax

    x = jax.ShapeDtypeStruct(shape, dtype)
    y, variables = jax.eval_shape(lambda v: block.init_with_output(jax.random.key(0), v, train=False), x)
    return x, y, variables


@_cached
def _params_and_output(block, shape: tuple[int, ...], dtype="float32") -> tuple[int, tuple[int, ...]]:
    import jax

    _, y, variables = _abstract_init(block, shape, dtype)
    count = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(variables.get("params", {})))
    return count, tuple(y.shape)


@_cached
def _flops(block, shape: tuple[int, ...], dtype="float32") -> float:
    import jax

    x, _, variables = _abstract_init(block, shape, dtype)
    lowered = jax.jit(lambda v, a: block.apply(v, a, train=False)).lower(variables, x)
    # Cost analysis of the lowered module avoids a compile where the backend offers it.
    cost = _first(lowered.cost_analysis())
    if not cost or "flops" not in cost:
        cost = _first(lowered.compile().cost_analysis())
    return float(cost["flops"])


def _first(cost):
    return cost[0] if isinstance(cost, (list, tuple)) and cost else cost


def _input_dtypes(blocks: Sequence, input_dtype: str) -> list[str]:
    """What each block reads: the model's input dtype, then float32 activations."""
    return [input_dtype] + ["float32"] * (len(blocks) - 1)


def block_shapes(blocks: Sequence, input_shape, batch_size: int = 1, input_dtype: str = "float32"
                 ) -> list[tuple[int, ...]]:
    """The input shape of every block, then the model's output shape (len(blocks) + 1 entries)."""
    shapes = [(batch_size, *tuple(input_shape))]
    for block, dtype in zip(blocks, _input_dtypes(blocks, input_dtype)):
        shapes.append(_params_and_output(block, shapes[-1], dtype)[1])
    return shapes


def block_costs(blocks: Sequence, input_shape, metric: str, input_dtype: str = "float32") -> list[float]:
    """Per-block cost: `params` (parameter count), `flops` (forward FLOPs at batch 1), `blocks` (1 each)
    or `time` (measured seconds at batch 1; `block_seconds` for another batch)."""
    if metric == "time":
        return list(block_seconds(blocks, input_shape, 1, input_dtype))
    if metric == "blocks":
        return [1.0] * len(blocks)
    if metric not in STRATEGIES:
        raise ConfigError(f"partition={metric!r} is not one of {', '.join(STRATEGIES)}")
    shapes, dtypes = block_shapes(blocks, input_shape, input_dtype=input_dtype), _input_dtypes(blocks, input_dtype)
    if metric == "params":
        return [float(_params_and_output(b, s, d)[0]) for b, s, d in zip(blocks, shapes, dtypes)]
    return [_flops(b, s, d) for b, s, d in zip(blocks, shapes, dtypes)]


def block_seconds(blocks: Sequence, input_shape, batch_size: int, input_dtype: str = "float32",
                  repeats: int = 5) -> tuple[float, ...]:
    """Each block's forward + backward (the gradient w.r.t. its parameters and its input), median
    seconds over `repeats` calls at `batch_size` on zeros of its input shape, on the default
    device; measured once a process per block and shape."""
    shapes = block_shapes(blocks, input_shape, batch_size, input_dtype)
    return tuple(_seconds(b, s, d, repeats) for b, s, d in zip(blocks, shapes, _input_dtypes(blocks, input_dtype)))


@_cached
def _seconds(block, shape: tuple[int, ...], dtype="float32", repeats: int = 5) -> float:
    import jax
    import jax.numpy as jnp

    from cdpjax.speedup import median_seconds  # late: speedup imports this module

    x = jnp.zeros(shape, dtype)
    variables = block.init(jax.random.key(0), x, train=False)
    wrt = (0, 1) if jnp.issubdtype(x.dtype, jnp.floating) else 0  # token ids have no gradient

    def forward_backward(v, inp):
        def loss(params, i):
            return block.apply({**v, "params": params}, i, train=False).astype(jnp.float32).sum()

        return jax.grad(loss, argnums=wrt)(v["params"], inp)

    return median_seconds(jax.jit(forward_backward), variables, x, repeats=repeats)


def _imbalance(costs: Sequence[float]) -> float:
    mean = float(np.mean(costs))
    return float(np.max(costs)) / mean if mean > 0 else 1.0


def balance_report(blocks: Sequence, points: Sequence[int], input_shape, input_dtype: str = "float32") -> dict:
    """Per-stage parameter counts and forward FLOPs (batch 1) of a partition, and the
    imbalance of each: the largest stage over the mean stage (1.0 is perfect)."""
    points = tuple(points)
    bounds = list(zip((0, *points), (*points, len(blocks))))
    report = {"bounds": bounds}
    for metric in ("params", "flops"):
        costs = block_costs(blocks, input_shape, metric, input_dtype)
        per_stage = [float(sum(costs[a:b])) for a, b in bounds]
        report[metric] = [int(c) for c in per_stage] if metric == "params" else per_stage
        report[f"{metric}_imbalance"] = _imbalance(per_stage)
    return report


# InfoPro's ResNet-32 table (InfoPro-Pytorch, networks/configs.py): the local module
# ends after residual block `b` (0-based) of group `g` (1..3); (0, 0) is the stem.
# The last module always ends with the classifier.
_INFOPRO_CUTS = {
    1: (),
    2: ((2, 1),),
    3: ((1, 4), (2, 4)),
    4: ((1, 2), (2, 1), (3, 0)),
    8: ((1, 0), (1, 2), (1, 4), (2, 1), (2, 3), (3, 0), (3, 2)),
    16: ((0, 0), (1, 0), (1, 1), (1, 2), (1, 3), (1, 4), (2, 0), (2, 1), (2, 2), (2, 3), (2, 4),
         (3, 0), (3, 1), (3, 2), (3, 3)),
}
_RESNET32_GROUP_DEPTH = 5


def _infopro_point(group: int, block: int) -> int:
    # resnet32's blocks: stem 0, group g's block b at 1 + 5 (g - 1) + b, head 16. A cut after
    # a block is a split point at the next index.
    return 1 if group == 0 else 1 + _RESNET32_GROUP_DEPTH * (group - 1) + block + 1


# K -> split points of `resnet32`. K = 4: (4, 8, 12), i.e. stages [stem, g1b0-g1b2],
# [g1b3-g2b1], [g2b2-g3b0], [g3b1-g3b4, head]. K = 16 follows InfoPro too: the stem alone is
# the first module, and the last residual block shares the last module with the classifier.
INFOPRO_SPLITS: dict[int, tuple[int, ...]] = {
    k: tuple(_infopro_point(g, b) for g, b in cuts) for k, cuts in _INFOPRO_CUTS.items()
}


def infopro_points(k: int) -> list[int]:
    """InfoPro's split points of `resnet32` for K local modules (K in 1, 2, 3, 4, 8, 16).

    In a config file: `config.stages` is typed as an int, so set it with
    `with config.ignore_type(): config.stages = infopro_points(4)`.
    """
    if k not in INFOPRO_SPLITS:
        raise ConfigError(f"no InfoPro split for K={k!r}; tables exist for K in {sorted(INFOPRO_SPLITS)}")
    return list(INFOPRO_SPLITS[k])
