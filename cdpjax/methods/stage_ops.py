"""A stage's ops, written once for every engine.

The SPMD engines (`cdpjax.methods.pipeline`: stages behind padded carrier rows;
`cdpjax.methods.ring`: every stage in its natural shapes) differ in where a stage's
parameters, inputs and gradients are kept; what one op computes is this module's:

- `run`: the stage's forward on one micro-batch; the last stage returns its share
  of the step's mean loss (the task's loss times `loss_scale`, so that the engine's
  sum of gradients over micro-batches or workers is the gradient of the mean) and
  the task's metric sums of the micro-batch (`cdpjax.tasks`: they add over
  micro-batches and devices, and `task.finish` turns their total into the step's
  loss, accuracy, perplexity...).
- `vjp`: `jax.vjp` of `run` with respect to the parameters and the input (the
  first stage's input, the batch, gets no cotangent).
- `backward`: the parameter gradient and the input cotangent of one micro-batch,
  from a pullback recomputed from the stage's input ('recompute') or rebuilt from
  the residuals its forward kept ('carry'). A split backward asks for one of the
  two: the input cotangent (`B`, sent upstream at once) or the parameter gradient
  (`W`, later); the other is never computed (XLA removes what no output needs).
- `residual_leaves` / `rebuild`: the residuals a forward keeps (all the pullback's leaves but
  the stage's own parameters, which the backward reads from the version its
  forward read) and the pullback rebuilt from them on the structure of a template
  traced in the backward's own branch (the template's own leaves are dead code).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from cdpjax import tasks


@dataclasses.dataclass(frozen=True)
class StageOps:
    """The ops of `net`'s stages for `task`; the last stage's loss is scaled by `loss_scale`. `vary`
    makes a constant device-varying the way the engine's values are inside its `shard_map` (the
    loss's starting cotangent must be)."""

    net: Any
    loss_scale: float = 1.0
    vary: Callable = lambda x: x
    task: tasks.Task = tasks.CLASSIFICATION

    @property
    def last(self) -> int:
        return self.net.num_stages - 1

    def metrics(self, outputs, labels):
        """The micro-batch's metric sums (the task's)."""
        return self.task.metric_sums(outputs, labels)

    def no_metrics(self):
        return jnp.zeros((len(self.task.sum_names),), jnp.float32)

    def finish(self, sums) -> dict:
        """A step's metrics from its summed metric sums (`methods.common.step_metrics`)."""
        from cdpjax.methods.common import step_metrics

        return step_metrics(self.task, self.task.finish(sums)["loss"], sums)

    def run(self, j, p, s, x, labels):
        """Stage j on x: (output, or the last stage's scaled loss), (new model state, metrics)."""
        y, new_state = self.net.apply_stage(j, p, s, x, True)
        if j < self.last:
            return y, (new_state, self.no_metrics())
        return self.task.loss(y, labels) * self.loss_scale, (new_state, self.metrics(y, labels))

    def vjp(self, j, p, s, x, labels):
        """(out, pullback, (new state, metrics)) of stage j; the pullback (a pytree: its leaves are
        the residuals) gives (d params, d input), or (d params,) for the first stage."""
        if j == 0:
            return jax.vjp(lambda p_: self.run(j, p_, s, x, labels), p, has_aux=True)
        return jax.vjp(lambda p_, x_: self.run(j, p_, s, x_, labels), p, x, has_aux=True)

    def seed(self, j, cotangent):
        """The cotangent a backward of stage j starts from: 1 for the loss, else the output's."""
        return self.vary(jnp.ones((), jnp.float32)) if j == self.last else cotangent

    @staticmethod
    def residual_leaves(pullback, p) -> tuple[list, Any, list[int]]:
        """A pullback's leaves, its structure, and the indices of its residuals (the leaves a
        forward keeps): all but the stage's own parameters."""
        own = {id(q) for q in jax.tree.leaves(p)}
        leaves, structure = jax.tree.flatten(pullback)
        return leaves, structure, [i for i, leaf in enumerate(leaves) if id(leaf) not in own]

    def forward_residuals(self, j, p, s, x, labels):
        """A forward that keeps its residuals: (out, residuals (a list of leaves), (new state, metrics))."""
        out, pullback, aux = self.vjp(j, p, s, x, labels)
        leaves, _, idx = self.residual_leaves(pullback, p)
        return out, [leaves[i] for i in idx], aux

    def rebuild(self, j, p, s, x_template, labels, residuals):
        """The pullback of the forward that kept `residuals`, on the structure of a template
        traced here from `x_template` (any input of the right shape). `residuals` may be a
        function of the template's own residuals (to unflatten a raveled buffer like them)."""
        leaves, structure, idx = self.residual_leaves(self.vjp(j, p, s, x_template, labels)[1], p)
        if callable(residuals):
            residuals = residuals([leaves[i] for i in idx])
        for i, leaf in zip(idx, residuals):
            leaves[i] = leaf
        return jax.tree.unflatten(structure, leaves)

    def backward(self, j, p, s, x, labels, cotangent, residuals=None, want: tuple[str, ...] = ("params", "input")):
        """(d params, d input, metrics) of one micro-batch at stage j; a gradient not in `want` is
        None (and never computed). From the kept residuals where given (`rebuild`: x then only
        shapes the template; metrics None, the forward counted them), else recomputed from x (the
        running averages are the forward's to update; metrics those of the recomputed forward)."""
        if residuals is None:
            _, pullback, (_, metrics) = self.vjp(j, p, s, x, labels)
        else:
            pullback, metrics = self.rebuild(j, p, s, x, labels, residuals), None
        grads = pullback(self.seed(j, cotangent))
        d_params = grads[0] if "params" in want else None
        d_input = grads[1] if "input" in want and j > 0 else None
        return d_params, d_input, metrics

    def residual_shapes(self, params, state, inputs, labels, trace_inside) -> tuple:
        """Per stage, the `ShapeDtypeStruct`s of the leaves its forward keeps for one micro-batch
        (`inputs[j]`, `labels`: its shapes), found by `trace_inside(fn)`, which traces `fn(varying)`
        inside the engine's `shard_map`, where inputs are device-varying as in a tick (outside
        it, a few scalars differ)."""
        found = []
        zeros = lambda a: jnp.zeros(a.shape, a.dtype)  # noqa: E731

        def probe(varying):
            for j in range(self.net.num_stages):
                p, s, x, y = varying(jax.tree.map(zeros, (params[j], state[j], inputs[j], labels)))
                residuals = self.forward_residuals(j, p, s, x, y)[1]
                found.append(tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in residuals))

        trace_inside(probe)
        return tuple(found)


__all__ = ["StageOps"]
