"""The step the trainer compiles: a method's train step with its finite checks (`guarded_step`).

Every step checks, in the same compiled program, that the loss, every stage's parameters after
the update and the whole train state (batches in flight) are finite; with `skip` a step that
fails leaves the state as it was. The trainer's loop (`cdpjax.loop`) reads the flags at its sync
steps (`all_finite`, `describe_nonfinite`); the CUDA lowering check (`cdpjax.lowering`) lowers
this same step.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cdpjax.methods.common import tree_select


def guarded_step(method, skip: bool):
    """The method's step and, in the same program, where non-finite values appeared.

    Returns a jitted `(state, batch) -> (state, metrics, flags)`; `flags['stages']` says per
    stage whether its parameters after the update are finite (a NaN or Inf gradient makes
    them non-finite for every optimizer used here), whether its `stage_loss` (methods that
    report one) is finite, and what the method's own optional per-stage `metrics['finite']`
    says; `flags['state']` covers the whole train state, in-flight buffers included (a
    poisoned batch still inside a pipeline or a CDP partial sum). With `skip`, a step with
    any flag down or a non-finite loss leaves the whole train state as it was: a select on
    device, with no host copy, which the method's own buffer donation does not defeat.
    """
    num_stages = method.net.num_stages

    def guarded_train_step(state, batch):
        new, metrics = method.train_step(state, batch)
        stages = stage_finite(method.export(new)[0])
        for key in ("finite", "stage_loss"):
            value = metrics.get(key)
            if value is not None and jnp.shape(value) == (num_stages,):
                stages = stages & (value.astype(bool) if key == "finite" else jnp.isfinite(value))
        whole = _finite(new)
        if skip:
            ok = jnp.all(stages) & whole & jnp.all(jnp.isfinite(metrics["loss"]))
            new = tree_select(ok, new, state)
        return new, metrics, {"stages": stages, "state": whole}

    return jax.jit(guarded_train_step, donate_argnums=0)


def stage_finite(params) -> jax.Array:
    """[num_stages] bool: whether every floating value of each stage's parameters is finite."""
    return jnp.stack([_finite(p) for p in params])


def _finite(tree) -> jax.Array:
    flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack(flags)) if flags else jnp.array(True)


def all_finite(metrics, flags) -> bool:
    return bool(np.all(flags["stages"]) and flags["state"] and np.all(np.isfinite(metrics["loss"])))


def describe_nonfinite(metrics, flags) -> str:
    """Where a step went non-finite, in words: the first stage, or the in-flight state, or the loss."""
    finite = np.asarray(flags["stages"])
    loss = float(np.asarray(metrics["loss"]))
    bad = [j for j, f in enumerate(finite) if not f]
    stage_loss = metrics.get("stage_loss")
    if bad:
        j = bad[0]
        lossy = stage_loss is not None and np.shape(stage_loss) == finite.shape and not np.isfinite(stage_loss[j])
        what = "its loss" if lossy else "its parameters after the update (a NaN or Inf gradient)"
        others = f"; also stage(s) {', '.join(map(str, bad[1:]))}" if len(bad) > 1 else ""
        return f"stage {j}: {what}{others}; loss {loss:.4g}"
    if not flags["state"]:
        return (f"the in-flight state (activations, gradients or partial sums of a batch still in "
                f"flight), every stage's parameters still finite; loss {loss:.4g}")
    return f"the loss ({loss}), every stage's parameters still finite"
