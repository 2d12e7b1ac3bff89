"""Optimizers and learning-rate schedules from the config, all optax.

SGD follows the papers (PyTorch semantics): weight decay is added to the
gradient before momentum (coupled L2), optionally Nesterov. `adamw` decouples it.
"""
from __future__ import annotations

import optax

from cdpjax.errors import ConfigError


def schedule(config, num_steps: int | None = None) -> optax.Schedule:
    steps = int(num_steps or config.num_steps)
    lr = float(config.learning_rate)
    warmup = int(config.get("warmup_steps", 0))
    kind = config.get("schedule", "constant")
    if kind == "constant":
        main = optax.constant_schedule(lr)
    elif kind == "cosine":
        main = optax.cosine_decay_schedule(lr, max(steps - warmup, 1))
    elif kind == "step":
        every = int(config.get("decay_every", 0)) or steps
        boundaries = {k * every: float(config.decay_factor) for k in range(1, steps // every + 1)}
        main = optax.piecewise_constant_schedule(lr, boundaries)
    else:
        raise ConfigError(f"schedule={kind!r} is not one of constant, cosine, step")
    if warmup:
        return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), main], [warmup])
    return main


def make(config, num_steps: int | None = None, learning_rate_scale: float = 1.0) -> optax.GradientTransformation:
    """The optimizer named by `config.optimizer`, with the config's schedule."""
    lr = schedule(config, num_steps)
    if learning_rate_scale != 1.0:
        base = lr
        lr = lambda count: base(count) * learning_rate_scale  # noqa: E731
    wd = float(config.get("weight_decay", 0.0))
    kind = config.get("optimizer", "sgd")
    if kind == "sgd":
        momentum = float(config.get("momentum", 0.0)) or None
        return optax.chain(
            optax.add_decayed_weights(wd) if wd else optax.identity(),
            optax.sgd(lr, momentum=momentum, nesterov=bool(config.get("nesterov", False))),
        )
    if kind == "adam":
        return optax.chain(optax.add_decayed_weights(wd) if wd else optax.identity(), optax.adam(lr))
    if kind == "adamw":
        return optax.adamw(lr, weight_decay=wd)
    raise ConfigError(f"optimizer={kind!r} is not one of sgd, adam, adamw")


def apply(tx: optax.GradientTransformation, params, opt_state, grads):
    """One optimizer step on one pytree (a stage, a padded row, a whole model):
    (new params, new optimizer state). Every method updates through this."""
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def apply_per_stage(tx: optax.GradientTransformation, params, opt_state, grads):
    """`apply` to each stage of per-stage lists: (new params list, new optimizer state list)."""
    pairs = [apply(tx, p, s, g) for p, s, g in zip(params, opt_state, grads)]
    return [p for p, _ in pairs], [s for _, s in pairs]
