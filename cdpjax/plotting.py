"""Figures drawn from time tables: the papers' timing diagram, activation memory over
time and gradient bytes per tick. Matplotlib with the Agg canvas (no display, no
global backend switch); `.png` or `.svg` chosen by the path's suffix.
"""
from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from cdpjax.errors import ConfigError
from cdpjax.kinds import KINDS, SHADES
from cdpjax.timetable import TimeTable

_SUFFIXES = (".png", ".svg")


def _figure(width: float, height: float, layout: str | None = None):
    """A figure on its own Agg canvas; `layout='constrained'` keeps the panels' labels and titles
    apart (figures of several panels)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout=layout)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: str) -> str:
    suffix = os.path.splitext(str(path))[1].lower()
    if suffix not in _SUFFIXES:
        raise ConfigError(f"figure path {path!r} must end in {' or '.join(_SUFFIXES)}")
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fig.savefig(path, format=suffix[1:], bbox_inches="tight", dpi=120)
    return str(path)


def _colour_key(table: TimeTable, op) -> int:
    """One colour per what the layout says: a worker (an op's `micro` in CDP tables), a
    micro-batch, or a step (ppll's batches)."""
    return op.step if table.layout.colour == "step" else op.micro


_WHO = {"worker": "worker", "micro": "micro-batch", "step": "batch"}


def _shade(rgb, shade: str):
    """The colour of an op of the kinds' `shade` ('forward', 'backward', 'weight', 'local') in
    the hue `rgb`: forward (and local) light, backward dark, weight gradient in between, the
    same hue throughout so the worker or micro-batch stays readable."""
    rgb = np.asarray(rgb[:3], float)
    if shade == "backward":
        return tuple(rgb * 0.55)
    if shade == "weight":
        return tuple(0.25 + 0.6 * rgb)
    return tuple(1 - 0.4 * (1 - rgb))


def _text_colour(shade: str) -> str:
    return "white" if shade == "backward" else "black"


def plot_schedule(table: TimeTable, path: str, title: str | None = None, costs=None,
                  bandwidth: float = float("inf")) -> str:
    """The timing diagram: ticks on x, stages on y (stage 0 at the top, with its device where
    devices hold several stages or not in order), one colour per worker (pipelines: per
    micro-batch or batch), each op in its kind's shade (`cdpjax.kinds`: forward light, backward
    dark, weight gradient in between) with its text, ops on the delayed rule hatched, updates
    marked, training-step boundaries drawn. With `costs` (`cdpjax.speedup.StageCosts`), x is time
    in the lockstep replay (`speedup.lockstep_starts`): each tick as long as its slowest op, each
    op as wide as it lasts."""
    from matplotlib import colormaps
    from matplotlib.patches import Patch, Rectangle

    keys = sorted({_colour_key(table, op) for op in table.ops})
    cmap = colormaps["tab10" if len(keys) <= 10 else "tab20"]
    colour = {k: cmap(i % cmap.N) for i, k in enumerate(keys)}
    x, width = _time_axis(table, costs, bandwidth)
    fig = _figure(max(6.0, 0.32 * table.num_ticks + 1.5), max(2.0, 0.55 * table.stages + 1.2))
    ax = fig.add_subplot()
    # Several ops can share a (tick, stage) cell (N = 2L workers): split its height.
    cells: dict = {}
    for op in table.ops:
        cells.setdefault((op.tick, op.stage), []).append(op)
    for (tick, stage), ops in cells.items():
        h = 0.9 / len(ops)
        for n, op in enumerate(sorted(ops, key=lambda o: o.device)):
            y, shade, w = stage - 0.45 + n * h, KINDS[op.kind].shade, width(op)
            ax.add_patch(Rectangle((x[tick], y), w, h, facecolor=_shade(colour[_colour_key(table, op)], shade),
                                   edgecolor="black", linewidth=0.4, hatch="///" if op.stale else None))
            text = table.layout.cell(op, diagram=True)
            ax.text(x[tick] + w / 2, y + h / 2, text, ha="center", va="center", fontsize=6 if len(ops) > 1 else 7,
                    color=_text_colour(shade))
    for u in table.updates:  # the update lands at the end of its tick
        ax.plot([x[u.tick + 1]], [u.stage], marker="|", color="red", markersize=14, markeredgewidth=2)
    # Worker 0's (CDP) or every stage's (gpipe) step boundaries; ppll has none.
    step_starts = range(0, table.num_ticks + 1, table.period) if table.period > 1 else ()
    for tick in step_starts:
        ax.axvline(x[tick], color="grey", linewidth=0.8, linestyle="--")
    ax.set_xlim(0, x[table.num_ticks])
    ax.set_ylim(table.stages - 0.5, -0.5)
    ax.set_yticks(range(table.stages))
    ax.set_yticklabels(_stage_labels(table))
    ax.set_xlabel("time step (tick)" if costs is None else "time (cost units; lockstep ticks)")
    ax.set_title(title or _title(table))
    who = _WHO[table.layout.colour]
    handles = [Patch(facecolor=_shade(colour[k], "forward"), edgecolor="black", label=f"{who} {k}") for k in keys[:12]]
    shades = sorted({KINDS[op.kind].shade for op in table.ops}, key=list(SHADES).index)
    handles += [Patch(facecolor=_shade((0.5, 0.5, 0.5), s), edgecolor="black", label=SHADES[s]) for s in shades]
    if any(op.stale for op in table.ops):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="///", label="reads previous version"))
    handles.append(Patch(facecolor="red", label="update (end of tick)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    return _save(fig, path)


def _time_axis(table: TimeTable, costs, bandwidth: float):
    """(x of each tick's start, the width of an op): ticks, or the lockstep replay's time."""
    if costs is None:
        return np.arange(table.num_ticks + 1, dtype=float), lambda op: 1.0
    from cdpjax.speedup import lockstep_starts

    starts = lockstep_starts(table, costs, bandwidth)
    return starts, lambda op: costs.seconds(op.kind, op.stage, table.split_backward)


def _stage_labels(table: TimeTable) -> list[str]:
    """'stage j', with 'device d' where each stage lives on one device and the devices are not
    simply the stages in order (several stages per device, or the V placement)."""
    devices = {}
    for op in table.ops:
        devices.setdefault(op.stage, set()).add(op.device)
    placed = all(len(d) == 1 for d in devices.values()) and len(devices) == table.stages
    if not placed or all(devices[j] == {j} for j in devices):
        return [f"stage {j}" for j in range(table.stages)]
    return [f"stage {j} (device {min(devices[j])})" for j in range(table.stages)]


def _title(table: TimeTable) -> str:
    return table.format_grid().splitlines()[0]  # the grid's heading, from the layout's title


def plot_activation(tables: Sequence[TimeTable], path: str) -> str:
    """Stage-activations held in total over ticks, one line per table (e.g. dp against cdp)."""
    fig = _figure(7.0, 3.2)
    ax = fig.add_subplot()
    for t in tables:
        total = t.activation_total()
        ax.step(np.arange(len(total)), total, where="post", label=f"{t.method} (peak {total.max()})")
    ax.set_xlabel("time step (tick)")
    ax.set_ylabel("stage-activations held (all workers)")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_comm(tables: Sequence[TimeTable], stage_bytes: Sequence[float], path: str) -> str:
    """Gradient bytes sent per tick, one line per table (dp's burst against cdp's flat profile)."""
    fig = _figure(7.0, 3.2)
    ax = fig.add_subplot()
    for t in tables:
        b = t.bytes_per_tick(stage_bytes)
        ax.step(np.arange(len(b)), b, where="post", label=f"{t.method} (balance {t.comm_balance(stage_bytes):.2f})")
    ax.set_xlabel("time step (tick)")
    ax.set_ylabel("gradient bytes sent")
    ax.legend(fontsize=8)
    return _save(fig, path)
