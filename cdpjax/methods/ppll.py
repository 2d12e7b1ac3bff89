"""`ppll`: local learning pipelined over the `stage` axis (Guo et al., 2024).

Timing (`cdpjax.layouts.ppll.ppll_table`): K local modules (the config's stages,
each with its auxiliary head and its own optimizer state) on D devices, in
contiguous groups (`config.module_groups`, e.g. PPLL's [8, 3, 2, 2] for its 15
ResNet-32 modules on 4; without it, one module per device when the mesh leaves
`stage` out, else groups balanced by the modules' measured time, heads included). At tick t device d runs
batch t-d through its modules one after another: each module's forward, its local
loss through its auxiliary head, its own update; the last module's output goes on
to device d+1 with the batch's labels (and its image, for heads that reconstruct
it) through a `ppermute`, a queue of depth one. No gradient crosses a module
boundary, so once the pipeline is full every device works at every tick; the only
bubbles are the D-1 fill ticks at the start of the run and the D-1 drain ticks of
`flush` at its end (the queues are part of the train state).

Update rule: exactly `local`'s. Module j sees the batches in order and updates on
each with its own optimizer, so after T batches and a flush the parameters are
those of `local` with the same K modules after T steps. Ticks whose input is not a
batch (fill and drain) run nothing. A head that follows the next module by EMA
(`aux_head='man'`) does so where module j+1 runs in the same tick on the same
device (`AuxHeads.follow` in the unit's FB op, with module j+1's parameters before
their update); across devices its copy is trained instead. The heads are built for
the groups ppll runs, and `local` builds them for `config.module_groups`: with
such heads ppll needs the groups given (or one module per device) to equal `local`,
and refuses to pick them by measured time.

SPMD realisation: the tick runtime (`cdpjax.methods.pipeline`, 'FB' ops): one
`train_step` is one tick; `run_steps(state, batches)` scans over T ticks in one
program. With a `data` axis each data group runs its own pipeline on its slice
of the batch and gradients are averaged over `data` every tick.
"""
from __future__ import annotations

import dataclasses

from cdpjax.errors import ConfigError
from cdpjax.layouts.ppll import module_devices, ppll_table
from cdpjax.methods import pipeline
from cdpjax.methods.common import Context, Method
from cdpjax.methods.local import setup


def module_groups(ctx: Context, net, heads) -> tuple[int, ...]:
    """The config's groups; else one module per device where the mesh's stage axis has K devices
    (or is not given), else contiguous groups balanced by measured time (body and head)."""
    cfg = ctx.config
    K = net.num_stages
    if cfg.get("module_groups", None):
        groups = tuple(int(g) for g in cfg.module_groups)
        module_devices(K, groups)  # refuses groups that do not add up to K
        return groups
    devices = ctx.axis("stage") if "stage" in ctx.mesh.axis_names else K
    if devices == K:
        return (1,) * K
    if devices > K:
        raise ConfigError(f"ppll puts each of the {K} local modules (stages) on one device at most: mesh.stage="
                          f"{devices} is more than {K}")
    if heads.grouped:
        raise ConfigError(f"aux_head={heads.kind!r} builds each head from whether the next module shares its "
                          f"device, so its modules cannot be grouped by measured time: give module_groups (e.g. "
                          f"{[K // devices + (d < K % devices) for d in range(devices)]}) for mesh.stage={devices} "
                          f"and {K} local modules")
    from cdpjax.speedup import group_by_time

    return group_by_time(net, heads, devices, max(1, cfg.global_batch_size // max(ctx.axis("data"), 1)))


def build(ctx: Context) -> Method:
    net, heads, body_tx, head_tx = setup(ctx)
    if net.num_stages < 2:
        raise ConfigError(f"ppll needs at least 2 stages (local modules), got stages={ctx.config.stages!r}")
    groups = module_groups(ctx, net, heads)
    assert not heads.grouped or tuple(groups) == heads.groups, (groups, heads.groups)  # both from module_groups
    table = ppll_table(stages=net.num_stages, steps=2 * len(groups) + 5,
                       module_groups=groups if len(groups) != net.num_stages else None)
    shown = ppll_table(stages=net.num_stages, module_groups=groups if len(groups) != net.num_stages else None)
    method = pipeline.build(ctx, "ppll", table, pipeline.Rules(local=True), shown=shown, heads=heads,
                            optimizers=pipeline.Rows(body=body_tx, head=head_tx))
    return dataclasses.replace(
        method, module_groups=tuple(groups),
        export_head_state=lambda state: per_module(method, method.carrier.head_state, state.head_state))


def per_module(method: Method, layout, rows) -> list:
    """Per local module, its tree from the carrier rows `[devices, units, width]` of `layout`."""
    place = method.program.placement
    trees = {}
    for u, modules in enumerate(place.units):
        trees.update(zip(modules, layout.unpack_one(u, rows[place.device[u], place.chunk[u]])))
    return [trees[j] for j in range(method.net.num_stages)]


__all__ = ["build", "module_groups", "per_module"]
