"""Normalisation layers chosen by name: the papers' BatchNorm, or GroupNorm / none for exact equality tests."""
from __future__ import annotations

import flax.linen as nn


def make(norm: str, bn_axis_name: str | None, train: bool, groups: int = 8, dtype=None):
    """`batch`: BatchNorm whose statistics are reduced over `bn_axis_name` when it is set
    (cross-device BatchNorm) or per device otherwise; `group`: GroupNorm; `none`: identity.
    `dtype`: what the layer computes in (Flax reduces the statistics in float32 regardless)."""
    if norm == "batch":
        return nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5, axis_name=bn_axis_name,
                            dtype=dtype)
    if norm == "group":
        return lambda x: nn.GroupNorm(num_groups=min(groups, x.shape[-1]), dtype=dtype)(x)
    if norm == "none":
        return lambda x: x
    raise ValueError(f"norm {norm!r} is not one of batch, group, none")
