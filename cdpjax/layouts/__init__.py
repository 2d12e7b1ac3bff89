"""Layouts: every method's metadata in one place, importable without JAX.

A `Layout` declares what the rest of cdpjax needs to know about a method: its
builder (the SPMD program, in `cdpjax.methods`), the mesh axes it runs on and the
one bench puts every device on, its time table function (pure Python), whether it
reads `config.microbatches`, and how its ops are coloured and labelled in
diagrams and in the text grid. `cdpjax schedule`, `bench`, the speedup model,
the plots, `reproduce.py`, the default mesh of a config and the registry-driven
tests all read it from `LAYOUTS`; nothing else names a method.

Each module of this package holds one family's table functions and registers
its layouts; every module here is imported with the package, so a new layout is
one module here (its table and registration) and one in `cdpjax/methods/` (its
builder), with no edit elsewhere. A layout defined outside the package registers
itself with `LAYOUTS.add(Layout(...))` (or `LAYOUTS.temporarily` in a test), its
builder given as a function.

A table function takes its sizes as keyword arguments from this set, each with a
default: `workers`, `stages`, `steps`, `microbatches`, `rule`, `chunks`,
`module_groups`, `ticks`. `Layout.make_table` passes the ones it accepts and refuses the
others by name, so `cdpjax schedule --method ppll --workers 8` says that ppll has
no workers instead of ignoring the flag.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import pkgutil
from typing import Any, Callable

from cdpjax.errors import ConfigError
from cdpjax.registry import Registry

# The sizes a table function may take, with what each means (for errors and --help).
TABLE_SIZES = {
    "workers": "CDP workers N",
    "stages": "stages L (local modules K for ppll)",
    "steps": "training steps laid out (ppll: batches)",
    "microbatches": "micro-batches M per step",
    "rule": "staleness rule",
    "chunks": "stages per device V (interleaved pipelines)",
    "module_groups": "local modules per device (ppll)",
    "ticks": "CDP's ops per tick: 'whole' (F, B), 'split' (F, B, W) or 'paired' (two forwards a tick)",
    "delay": "the delay model and its parameters (cdp-random: cdpjax.layouts.delays.Delay)",
}
COLOURS = ("worker", "micro", "step")


@dataclasses.dataclass(frozen=True)
class Reference:
    """The method a layout's gradients and updates equal (its equality test): after the same
    steps on the same batches, and a flush where the method has one, the same parameters.

    Attributes:
      method: a registered method's name, formatted with the config ('{cdp_rule}': the CDP
        rule the config runs, for a method whose rule is a config key).
      settings: config keys the reference runs with on top of the method's config, as
        (key, value) pairs (CDP's ring against `cdp_impl='simulate'`).
    """

    method: str
    settings: tuple[tuple[str, Any], ...] = ()

    def config_of(self, config):
        """The reference's config: `config` with its method and settings (a copy)."""
        ref = config.copy_and_resolve_references()
        with ref.unlocked():
            ref.method = self.method.format_map(config)
            for key, value in self.settings:
                ref[key] = value
        return ref


@dataclasses.dataclass(frozen=True)
class Layout:
    """A method: its program, its mesh, its time table and how to draw it.

    Attributes:
      name: the config's `method`.
      builder: `build(ctx) -> Method`, or "module:function" imported at first use
        (the methods import JAX; this registry does not).
      axes: mesh axes the method runs on; () runs on one device (the mesh's first).
      device_axis: the axis that takes every device when no mesh is given (bench,
        configs without `mesh`); None for one-device methods.
      table: the time table function (keyword sizes, see the module docstring), or
        None for a method without one (e2e, local).
      microbatches: whether the method reads `config.microbatches`.
      colour: what one colour is in diagrams: 'worker', 'micro' (micro-batch) or 'step'.
      label: a cell's text in the grid, formatted with the op's fields (`kind`, `stage`,
        `micro`, `step`, `device`, `version`). One spelling throughout: a bare number after
        F/B is what the layout's cells are about (the stage for CDP, the micro-batch for
        gpipe, the batch for ppll), `w<i>` is worker i.
      diagram_label: a cell's text in the diagram, whose rows are stages (default: `label`;
        CDP's grid rows are workers and its diagram rows stages, so the two differ).
      legend: what a cell says, for the text grid.
      title: the diagram's title, formatted with the table's fields.
      columns: 'worker' or 'device': what a row of the text grid is.
      summary: one line saying what the method is.
      reference: what the method must equal (`Reference`): the equality test every registered
        method gets from its registration (`tests/test_references.py`); None only for e2e and
        local, the two references, checked against rules written out in their own tests.
      messages_per_op: the table's size its messages per op grow with, where they outnumber its
        ops (`cdpjax schedule` counts them with the ops before laying a table out); None: about
        one message per op or fewer.
      state_as: the method whose train state this one's is (the same pytree with the same meaning,
        as dp's is e2e's: one update rule), so that a checkpoint of either resumes as the other;
        None: its own.
    """

    name: str
    builder: Callable | str
    axes: tuple[str, ...] = ()
    device_axis: str | None = None
    table: Callable[..., Any] | None = None
    microbatches: bool = False
    colour: str = "worker"
    label: str = "{kind}{stage}"
    diagram_label: str | None = None
    legend: str = "F<j>/B<j>: forward/backward of stage j"
    title: str = "{method}: {stages} stages"
    columns: str = "device"
    summary: str = ""
    reference: Reference | None = None
    messages_per_op: str | None = None
    state_as: str | None = None

    def __post_init__(self):
        if self.colour not in COLOURS:
            raise ValueError(f"layout {self.name!r}: colour={self.colour!r} is not one of {', '.join(COLOURS)}")
        if self.device_axis is not None and self.device_axis not in self.axes:
            raise ValueError(f"layout {self.name!r}: device_axis {self.device_axis!r} is not one of its axes "
                             f"{self.axes}")

    def cell(self, op, diagram: bool = False) -> str:
        """The text of `op`'s cell in the grid (or, with `diagram`, in the timing diagram)."""
        fmt = (self.diagram_label or self.label) if diagram else self.label
        return fmt.format(**dataclasses.asdict(op))

    # ------------------------------------------------------------------ builder

    def build(self, ctx):
        """The method for `ctx` (a `cdpjax.methods.Context`)."""
        builder = self.builder
        if isinstance(builder, str):
            module, _, attr = builder.partition(":")
            builder = getattr(importlib.import_module(module), attr)
        return builder(ctx)

    # -------------------------------------------------------------------- table

    def table_sizes(self) -> dict[str, Any]:
        """The sizes its table function takes, with their defaults."""
        if self.table is None:
            return {}
        params = inspect.signature(self.table).parameters.values()
        return {p.name: p.default for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}

    def make_table(self, **sizes):
        """The table for `sizes`; a size given as None takes the table's default, a size the
        table does not take is refused (ConfigError) unless it is None."""
        if self.table is None:
            raise ConfigError(f"method {self.name!r} has no time table")
        accepted = self.table_sizes()
        unknown = [k for k, v in sizes.items() if v is not None and k not in accepted]
        if unknown:
            raise ConfigError(f"{self.name}'s table takes no {', '.join(unknown)}; it takes "
                              f"{', '.join(accepted) or 'nothing'}")
        return self.table(**{k: v for k, v in sizes.items() if v is not None and k in accepted})

    # --------------------------------------------------------------------- mesh

    def default_mesh(self, config) -> dict[str, int]:
        """The mesh when the config gives none: every device on `device_axis`; a stage-axis
        layout takes the devices its table places the config's stages on."""
        if self.device_axis is None:  # runs on the mesh's first device, whatever the mesh
            return {"data": -1}
        if self.device_axis == "stage":
            return {"stage": table_for_config(config, devices=1, stages=stage_count(config), steps=2).devices}
        return {self.device_axis: -1}


def stage_count(config) -> int:
    """The stages (local modules) a config cuts its model into: `stages`, or its split points + 1."""
    spec = config.stages
    return len(spec) + 1 if isinstance(spec, (list, tuple)) else int(spec)


def stage_devices(config) -> int:
    """Devices on the `stage` axis the config's method needs (its table's devices)."""
    return LAYOUTS.lookup(config.method).default_mesh(config)["stage"]


LAYOUTS: Registry[Layout] = Registry("method")


def register(layout: Layout) -> Layout:
    return LAYOUTS.add(layout.name, layout)


def mesh_for(config) -> dict[str, int]:
    """The config's mesh, or where the config gives none the mesh that fills the host: the
    method's default mesh, and for a stage-axis method also `data: -1`, pipeline replicas over
    the devices its stages leave (4 stage devices on 8: {'stage': 4, 'data': 2}, each replica
    fed half of every global batch, their gradients averaged)."""
    mesh = dict(config.get("mesh", {}) or {})
    if mesh:
        return mesh
    layout = LAYOUTS.lookup(config.method)
    own = layout.default_mesh(config)
    if layout.device_axis == "stage" and "data" in layout.axes:
        return {**own, "data": -1}
    return own


def _mesh_sizes(config) -> list[int] | None:
    """The config's mesh axis sizes (-1 at most once: whatever there is), or None where the config
    does not say yet (a method name that validation will refuse, a malformed mesh)."""
    try:
        sizes = list(mesh_for(config).values())
    except (ConfigError, TypeError):
        return None
    if any(not isinstance(s, int) or (s < 1 and s != -1) for s in sizes) or sizes.count(-1) > 1:
        return None
    return sizes


def devices_needed(config) -> int | None:
    """Devices the config's mesh needs, or None where an axis is -1 (whatever there is) or
    where the config does not say yet (a method name that validation will refuse)."""
    sizes = _mesh_sizes(config)
    if sizes is None or -1 in sizes:
        return None
    return math.prod(sizes) if sizes else 1


def devices_to_use(config, available: int) -> int:
    """How many of `available` devices the config's mesh takes, 0 where it cannot run on them: a
    mesh without a -1 axis takes its size; one with a -1 axis (a stage-axis method's default
    `{'stage': K, 'data': -1}`) takes the most devices its fixed axes divide, at least their
    product (the -1 axis at least 1). Where the config does not say yet (a method name that
    validation will refuse, a malformed mesh) all of them, so that validation names the fault.
    Unlike `devices_needed`, which answers None for a -1 axis, this says whether it fits."""
    sizes = _mesh_sizes(config)
    if sizes is None:
        return available
    fixed = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        return available // fixed * fixed
    return fixed if fixed <= available else 0


def table_for_config(config, devices: int, stages: int, steps: int | None = None):
    """The time table of `config.method` as the config runs it on `devices` devices with
    `stages` stages (None for a method without one): the config's worker count (data-axis
    layouts: `workers`, else the devices), micro-batches, rule and module groups, each passed
    where the layout's table takes it."""
    layout = LAYOUTS.lookup(config.method)
    if layout.table is None:
        return None
    accepted = layout.table_sizes()
    candidates = {
        "workers": int(config.get("workers", 0) or 0) or devices,
        "stages": stages,
        "steps": steps,
        "microbatches": config.get("microbatches", None),
        "rule": config.get("cdp_rule", None),
        "module_groups": config.get("module_groups", None) or None,
        "chunks": config.get("chunks", None),
        "ticks": config.get("cdp_ticks", None),
        "delay": config.get("delay", None),
    }
    sizes = {k: v for k, v in candidates.items() if k in accepted and v is not None}
    if isinstance(sizes.get("module_groups"), (list, tuple)):
        sizes["module_groups"] = tuple(int(g) for g in sizes["module_groups"])
    return layout.make_table(**sizes)


def _import_all() -> None:
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")


_import_all()

__all__ = ["COLOURS", "LAYOUTS", "Layout", "Reference", "TABLE_SIZES", "devices_needed", "devices_to_use", "mesh_for",
           "register", "stage_count", "stage_devices", "table_for_config"]
