"""Stage partitions: where the blocks of a model are cut into stages."""
from __future__ import annotations

from typing import Sequence

from cdpjax.config import ConfigError


def split_points(blocks: Sequence, spec, strategy: str, input_shape, model_name: str = "model") -> tuple[int, ...]:
    """Block indices where stages 1..L-1 start.

    `spec` is a number of stages (balanced by `strategy`) or explicit split points.
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
    # Even split by block count; the balanced strategies refine it.
    return tuple(round(n * k / stages) for k in range(1, stages))
