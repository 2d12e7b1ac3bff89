"""Delay corrections: optax transformations keyed by the staleness of the step's reads.

Each is an `optax.GradientTransformationExtraArgs` of one stage (`cdp-random`:
`config.delay.correction`), placed before its optimizer, or after it for those of `ON_UPDATES`
(a learning-rate scale, which Adam's normalisation would undo on the gradient). Its
`update(grads, state, params, staleness=tau)` takes the step's mean gradient of the stage (or the
optimizer's update), the stage's current parameters theta_k (the
version the update is applied to) and `tau`, an int array of every worker's staleness for that
stage at this step (the table's reads: worker i's gradient was taken at theta_{k - tau_i}).
The gradient is the mean over workers, so a correction keyed per read acts on the mean through
the mean of its per-read factor (exact where the stage's reads share one tau: the uniform and
per-stage models).

- `staleness_scaled`: g <- g * mean_i 1 / (1 + tau_i) (staleness-aware SGD, Zhang et al. 2016:
  the learning rate divided by the delay; 1 + tau so that tau = 0 is plain SGD). 'staleness-sqrt':
  g * mean_i (1 + tau_i)^(-1/2), the learning rate divided by the delay's square root (a milder cut);
  'staleness-square': g * mean_i (1 + tau_i)^-2, by its square (a stronger one).
- `delayed_nesterov`: m <- beta m + g; g <- g + beta (1 + mean_i tau_i) m. Nesterov's
  look-ahead (optax's nesterov trace: g + beta m) taken over the 1 + tau steps between the read
  and the update, as PipeNAG looks ahead by the known delay; tau = 0: the nesterov trace.
- `delay_compensated`: g <- g + lambda g * g * (theta_k - mean_i theta_{k - tau_i}) (DC-ASGD,
  Zheng et al. 2017: a first-order Taylor step of the gradient from the read version to the
  current one, the Hessian approximated by the diagonal lambda g * g). The state holds the last
  `max_staleness` versions of the stage (theta_0 before step 0); tau = 0 or lambda = 0: g.

One correction moves the read instead of the gradient (`READ_SIDE`): `look_ahead`, 'pipenag'.
PipeNAG (Ajanthan et al., ICML 2025, "Nesterov Method for Asynchronous Pipeline Parallel
Optimization") modifies Nesterov's look-ahead step so that a gradient that arrives tau updates
late is taken at weights predicted tau updates ahead of the ones the stage holds at its forward,
along the optimizer's direction of motion (its abstract; its exact coefficients were not at hand
when this was written: the form below is that prediction, linear in the delay, as PipeMare's
and SpecTrain's weight predictions are). Worker i's read of stage j at step k, tau = tau(k, i, j)
updates behind, takes

    theta_hat = theta_{k-tau} + lambda tau (theta_{k-tau} - theta_{k-tau-1})

(lambda: `delay.strength`, 1 a linear extrapolation over the tau missing updates; theta_v for v < 0
is theta_0): the last update the read version holds, repeated for each update it misses. Under SGD
with momentum that difference is -lr times the optimizer's momentum buffer of update k - tau - 1,
so theta_hat is the momentum's look-ahead over the delay; the gradient is taken at theta_hat and
applied to theta_k by the unchanged optimizer. tau = 0 (or lambda = 0): the plain read. It needs
the version before the oldest read one: the simulation keeps max tau + 2 versions.

One correction weighs the reads instead (`WEIGHTED`): 'fresh-weighted' replaces the stage's mean
gradient mean_i g_i by mean_i w_i g_i, w_i = (1 + tau_i)^-2 / mean_l (1 + tau_l)^-2
(`fresh_weights`): the reads' weights keep their mean 1 (the step's size is kept, only its
direction leans to the fresher reads), and the square makes the lean strong: over tau uniform on
{0..8} the weighted mean staleness is sum_t t / (1+t)^2 / sum_t 1 / (1+t)^2 = 0.84 (4 unweighted;
2.2 with the first power). Every read's tau equal (dp, uniform, per-stage): the plain mean.
'fresh-sharp' leans harder, w_i proportional to (1 + tau_i)^-4 (`WEIGHT_POWERS`), and 'freshest' is
its limit p -> infinity, a "drop the stalest reads" rule with the cut set by each step's reads:
w_i = [tau_i = min_l tau_l] / mean_l [tau_l = min_l' tau_l'] (`freshest_weights`), the mean over the
stage's freshest reads alone (the others weigh 0; with one freshest read, its gradient alone).

Corrections combine with '+' (`parts`): 'pipenag' (the read), one of WEIGHTED (the mean over
reads) and at most one of the others (the gradient or update), each acting where it acts alone:
'pipenag+staleness-lr' takes each gradient at PipeNAG's predicted weights and scales the
optimizer's update by mean_i 1 / (1 + tau_i).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from cdpjax.errors import ConfigError

CORRECTIONS = ("none", "staleness-lr", "nesterov", "dc-asgd", "pipenag", "staleness-sqrt", "fresh-weighted",
               "staleness-square", "fresh-sharp", "freshest")
# Corrections applied to the optimizer's update (a learning rate) rather than to the gradient before it:
# the update times mean_i (1 + tau_i)^-power (`staleness_scaled`), by name.
LR_POWERS = {"staleness-lr": 1.0, "staleness-sqrt": 0.5, "staleness-square": 2.0}
ON_UPDATES = tuple(LR_POWERS)
# Corrections that move the read (the weights a stale gradient is taken at): `look_ahead`.
READ_SIDE = ("pipenag",)
# Corrections that weigh each read's gradient by its staleness before the mean over workers: `read_weights`.
WEIGHTED = ("fresh-weighted", "fresh-sharp", "freshest")
# The power p of each weighting's w_i proportional to (1 + tau_i)^-p ('freshest': the limit p -> infinity).
WEIGHT_POWERS = {"fresh-weighted": 2.0, "fresh-sharp": 4.0}


def _mean_inverse(tau, power: float = 1.0) -> jax.Array:
    return jnp.mean((1.0 + jnp.asarray(tau, jnp.float32)) ** -power)


def staleness_scaled(power: float = 1.0) -> optax.GradientTransformationExtraArgs:
    """g * mean_i (1 + tau_i)^-power (module docstring; each name's power: `LR_POWERS`)."""

    def init(params):
        return optax.EmptyState()

    def update(updates, state, params=None, *, staleness, **_):
        scale = _mean_inverse(staleness, power)
        return jax.tree.map(lambda g: g * scale.astype(g.dtype), updates), state

    return optax.GradientTransformationExtraArgs(init, update)


class NesterovState(NamedTuple):
    """The momentum m of `delayed_nesterov`."""

    momentum: optax.Updates


def delayed_nesterov(beta: float) -> optax.GradientTransformationExtraArgs:
    """m <- beta m + g; g <- g + beta (1 + mean_i tau_i) m (module docstring)."""

    def init(params):
        return NesterovState(jax.tree.map(jnp.zeros_like, params))

    def update(updates, state, params=None, *, staleness, **_):
        ahead = beta * (1.0 + jnp.mean(jnp.asarray(staleness, jnp.float32)))
        m = jax.tree.map(lambda m, g: beta * m + g, state.momentum, updates)
        return jax.tree.map(lambda g, m: g + ahead.astype(g.dtype) * m, updates, m), NesterovState(m)

    return optax.GradientTransformationExtraArgs(init, update)


class CompensationState(NamedTuple):
    """`past[t]`: the stage's parameters t + 1 updates ago (theta_0 before step 0)."""

    past: optax.Params


def delay_compensated(strength: float, max_staleness: int) -> optax.GradientTransformationExtraArgs:
    """g + lambda g * g * (theta_k - mean_i theta_{k - tau_i}) (module docstring); reads more than
    `max_staleness` updates behind are refused at trace time only by their shape: keep tau <= it."""
    depth = max(int(max_staleness), 1)

    def init(params):
        return CompensationState(jax.tree.map(lambda p: jnp.stack([p] * depth), params))

    def update(updates, state, params=None, *, staleness, **_):
        if params is None:
            raise ConfigError("delay correction dc-asgd needs the parameters: call update(grads, state, params)")
        tau = jnp.asarray(staleness, jnp.int32)

        def one(g, p, past):
            versions = jnp.concatenate([p[None], past])  # versions[t]: theta_{k - t}
            read = jnp.mean(versions[tau], axis=0)
            return g + strength * g * g * (p - read)

        out = jax.tree.map(one, updates, params, state.past)
        past = jax.tree.map(lambda p, past: jnp.concatenate([p[None], past[:-1]]), params, state.past)
        return out, CompensationState(past)

    return optax.GradientTransformationExtraArgs(init, update)


def look_ahead(versions, tau, strength: float = 1.0):
    """PipeNAG's predicted weights for a read tau updates late (module docstring):
    versions[tau] + strength * tau * (versions[tau] - versions[tau + 1]), where `versions[t]` is
    theta_{k-t} (a stacked pytree leaf or array; it must hold tau + 2 versions)."""
    read, before = versions[tau], versions[tau + 1]
    ahead = strength * jnp.asarray(tau, read.dtype)
    return read + ahead * (read - before)


def fresh_weights(tau, axis: int = 0, power: float = 2.0) -> jax.Array:
    """'fresh-weighted''s weight of each read: (1 + tau_i)^-p / mean_l (1 + tau_l)^-p over the
    workers' reads of one stage (`axis`), so the weights' mean is 1 (module docstring); p = 2
    ('fresh-sharp': 4)."""
    w = (1.0 + jnp.asarray(tau, jnp.float32)) ** -power
    return w / jnp.mean(w, axis=axis, keepdims=True)


def freshest_weights(tau, axis: int = 0) -> jax.Array:
    """'freshest''s weight of each read: 1 where tau_i is the least of the stage's reads (`axis`),
    0 elsewhere, over the mean of those indicators (weights' mean 1): the stage's mean gradient
    becomes the mean over its freshest reads, the staler ones dropped (module docstring)."""
    tau = jnp.asarray(tau)
    w = (tau == jnp.min(tau, axis=axis, keepdims=True)).astype(jnp.float32)
    return w / jnp.mean(w, axis=axis, keepdims=True)


def read_weights(name: str, tau, axis: int = 0) -> jax.Array:
    """The weight of each read under correction `name` (its part of WEIGHTED; ones if it has none)."""
    weighting = [p for p in parts(name) if p in WEIGHTED]
    if not weighting:
        return jnp.ones(jnp.shape(tau), jnp.float32)
    if weighting[0] == "freshest":
        return freshest_weights(tau, axis)
    return fresh_weights(tau, axis, WEIGHT_POWERS[weighting[0]])


def parts(name: str) -> tuple[str, ...]:
    """The corrections `name` combines ('a+b': module docstring): each one of CORRECTIONS, none
    twice, at most one of WEIGHTED and at most one that is neither READ_SIDE nor WEIGHTED (the optax
    transformation)."""
    ps = tuple(name.split("+"))
    bad = [p for p in ps if p not in CORRECTIONS or (p == "none" and len(ps) > 1)]
    if bad:
        raise ConfigError(f"delay.correction={name!r} is not one of {', '.join(CORRECTIONS)} (or "
                          f"several joined by '+', 'none' not among them)")
    transforms = [p for p in ps if p not in READ_SIDE + WEIGHTED]
    if len(transforms) > 1 or len(set(ps)) < len(ps):
        raise ConfigError(f"delay.correction={name!r} combines {' and '.join(transforms)}: join at most one "
                          f"correction besides {', '.join(READ_SIDE + WEIGHTED)}, each once")
    weightings = [p for p in ps if p in WEIGHTED]
    if len(weightings) > 1:
        raise ConfigError(f"delay.correction={name!r} combines {' and '.join(weightings)}: join at most one "
                          f"of {', '.join(WEIGHTED)}")
    return ps


def moves_read(name: str) -> bool:
    """Whether correction `name` moves the read (`look_ahead`)."""
    return any(p in READ_SIDE for p in parts(name))


def weighs_reads(name: str) -> bool:
    """Whether correction `name` weighs each read's gradient (`read_weights`)."""
    return any(p in WEIGHTED for p in parts(name))


def on_updates(name: str) -> bool:
    """Whether correction `name`'s optax part acts on the optimizer's update (`ON_UPDATES`)."""
    return any(p in ON_UPDATES for p in parts(name))


def make(name: str, max_staleness: int, momentum: float = 0.9, strength: float = 1.0):
    """The optax part of correction `name` (`parts`): None where it has none ('none', 'pipenag',
    'fresh-weighted' and their combinations: the engine moves the read, `look_ahead`, or weighs
    it, `fresh_weights`)."""
    transforms = [p for p in parts(name) if p not in ("none", *READ_SIDE, *WEIGHTED)]
    if not transforms:
        return None
    name = transforms[0]
    if name in LR_POWERS:
        return staleness_scaled(LR_POWERS[name])
    if name == "nesterov":
        return delayed_nesterov(momentum)
    return delay_compensated(strength, max_staleness)
