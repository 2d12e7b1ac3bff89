"""Compiled cost per device per step: FLOPs and bytes accessed, from XLA, that do not move with load.

XLA's `cost_analysis()` of a compiled program counts a while loop's body once and a
conditional as its costliest branch (measured: a scan of 10 matmuls reports one; a
switch reports its largest branch), so it cannot price a tick engine's step, which is
a loop over ticks whose every tick takes one branch. Where a method has a lowered
program (`cdpjax.program.Program`) its cost is counted from the program instead:
each op piece (a stage's F, B, W or local FB for one micro-batch, and each unit's
optimizer update) is compiled on its own and priced by XLA, and the pieces are summed
over the ops and updates the program runs on each device in one call (one step). A
method without loops or branches (e2e, dp, simulate, local) is priced by XLA whole.
Messages are not FLOPs and are left out; bytes accessed are each piece's own (the
engine's buffer traffic around them is not counted).
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cdpjax.kinds import KINDS
from cdpjax.program import Apply, Compute, piece_size


def xla_cost(compiled) -> dict[str, float]:
    """{'flops', 'bytes_accessed'} of a compiled program, as XLA reports them."""
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else (ca or {})
    return {"flops": float(ca.get("flops", 0.0)), "bytes_accessed": float(ca.get("bytes accessed", 0.0))}


def _priced(fn, *args) -> dict[str, float]:
    return xla_cost(jax.jit(fn).lower(*args).compile())


def piece_costs(method, micro: int, tx, task=None) -> dict[tuple[str, int], dict[str, float]]:
    """(kind, stage) -> XLA's cost of one op of that kind on one micro-batch of `micro` examples,
    as the program's runtime computes it (recomputed or from kept residuals), ('update', j)
    of stage j's optimizer update and, where the program updates pieces, ('update-piece', j) of one
    worker's 1/N of it."""
    from cdpjax.methods.local import stage_grads
    from cdpjax.methods.stage_ops import StageOps

    from cdpjax import tasks

    program, net = method.program, method.net
    task = task or tasks.CLASSIFICATION
    ops = StageOps(net, 1.0, task=task)
    carry = program.carries
    params, state = net.init(jax.random.key(0))
    x = image = jnp.zeros((micro, *net.input_shape), net.input_dtype)
    labels = jnp.zeros((micro, *task.label_shape(tuple(net.input_shape))), jnp.int32)
    local_kinds = [k for k in program.kinds if KINDS[k].forward and KINDS[k].backward]
    if local_kinds:
        heads = method.heads
        head_params, head_state = heads.init(jax.random.key(1))
    out = {}
    pieces = {op for ops in program_ops(program) for op in ops}
    for j in range(net.num_stages):
        p, s = params[j], state[j]
        y = net.apply_stage(j, p, s, x, True)[0]
        cot = jnp.zeros_like(y) if j < net.num_stages - 1 else None
        # traced as the backward's template will be (under jit): their residuals then agree leaf by leaf
        residuals = jax.jit(lambda p, s, x: ops.forward_residuals(j, p, s, x, labels)[1])(p, s, x) if carry else None
        for kind in program.kinds:
            op = KINDS[kind]
            if op.forward and not op.backward:
                fn = (lambda p, s, x: ops.forward_residuals(j, p, s, x, labels)[:2]) if carry else \
                     (lambda p, s, x: ops.run(j, p, s, x, labels)[0])
                out[(kind, j)] = _priced(fn, p, s, x)
            elif op.backward and not op.forward:
                want = _backward_wants(op, program.split_backward)
                if j == 0 and want == ("input",):  # the batch needs no cotangent: nothing to run
                    out[(kind, j)] = {"flops": 0.0, "bytes_accessed": 0.0}
                    continue
                fn = functools.partial(_backward, ops, j, want)
                out[(kind, j)] = _priced(fn, p, s, x, labels, cot, residuals)
            else:
                def local(p, h, s, g, x):
                    return stage_grads(net, heads, j, p, h, s, g, x, labels, image)[:3]
                out[(kind, j)] = _priced(local, p, head_params[j], s, head_state[j], x)
        out[("update", j)] = _priced(_update(tx), p, tx.init(p), p)
        if ("update-piece", j) in pieces:  # every worker updates its 1/N piece of the stage, flattened
            piece = jnp.zeros((piece_size(sum(x.size for x in jax.tree.leaves(p)), program.devices),), jnp.float32)
            out[("update-piece", j)] = _priced(_update(tx), piece, tx.init(piece), piece)
        x = y
    return out


def _backward_wants(op, split_backward: bool) -> tuple[str, ...]:
    """What a backward op computes: the weight gradient where it completes it; the cotangent of the
    stage's input unless it is a split backward's weight half (which computes nothing else)."""
    completes = op.completes_gradient(split_backward)
    return (("params",) if completes else ()) + (() if split_backward and completes else ("input",))


def _update(tx):
    return lambda p, o, g: jax.tree.map(jnp.add, p, tx.update(g, o, p)[0])


def _backward(ops, j, want, p, s, x, labels, cot, residuals):
    d_params, d_input, _ = ops.backward(j, p, s, x, labels, cot, residuals, want)
    return d_params, d_input


def program_ops(program) -> list[list[tuple[str, int]]]:
    """Per device, the (kind, stage) of every op and ('update', stage) of every update (a device's
    1/N piece of the stage: ('update-piece', stage)) one call of the program runs (every op taken,
    whatever its step: a steady-state call), from the program's `Compute` and `Apply` events."""
    per: list[list[tuple[str, int]]] = [[] for _ in range(program.devices)]
    for e in program.events:
        if isinstance(e, Compute):
            per[e.device].append((e.kind, e.stage))
        elif isinstance(e, Apply):
            per[e.device].append(("update-piece" if e.piece else "update", e.stage))
    return per


def program_cost(method, micro: int, tx, task=None) -> dict[str, Any]:
    """The cost per device of one call (one step) of `method`'s program, counted from its ops."""
    costs = piece_costs(method, micro, tx, task)
    per = program_ops(method.program)
    flops = np.array([sum(costs[key]["flops"] for key in ops) for ops in per])
    accessed = np.array([sum(costs[key]["bytes_accessed"] for key in ops) for ops in per])
    return {"flops": float(flops.mean()), "flops_max_device": float(flops.max()),
            "bytes_accessed": float(accessed.mean()), "bytes_accessed_max_device": float(accessed.max()),
            "flops_total": float(flops.sum()),
            "counted": "from the program: XLA's cost of each op piece times how often each device runs it "
                       "(XLA counts a loop body once and a conditional as its costliest branch)"}


def step_cost(method, compiled, micro: int, tx, devices: int, task=None) -> dict[str, Any]:
    """`cost` of a bench record: from the program where the method has one, else XLA's own (per
    device: an SPMD program's cost analysis is of the per-device module)."""
    if method.program is not None:
        return program_cost(method, micro, tx, task)
    out = xla_cost(compiled)
    return {**out, "flops_max_device": out["flops"], "bytes_accessed_max_device": out["bytes_accessed"],
            "flops_total": out["flops"] * max(int(method.devices or devices), 1),
            "counted": "by XLA, whole (no loop or conditional to see into)"}


__all__ = ["piece_costs", "program_cost", "program_ops", "step_cost", "xla_cost"]
