"""Figures drawn from time tables: the papers' timing diagram, activation memory over
time and gradient bytes per tick. Matplotlib with the Agg canvas (no display, no
global backend switch); `.png` or `.svg` chosen by the path's suffix.
"""
from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from cdpjax.errors import ConfigError
from cdpjax.timetable import TimeTable

_SUFFIXES = (".png", ".svg")


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
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


def _shade(rgb, backward: bool):
    rgb = np.asarray(rgb[:3], float)
    # Forward light, backward dark: the same hue either way, so the worker stays readable.
    return tuple(rgb * 0.65) if backward else tuple(1 - 0.45 * (1 - rgb))


def plot_schedule(table: TimeTable, path: str, title: str | None = None) -> str:
    """The timing diagram: ticks on x, stages on y (stage 0 at the top), one colour per
    worker (pipelines: per batch), forward light and backward dark with 'F'/'B' text,
    ops on the delayed rule hatched, updates marked, training-step boundaries drawn."""
    from matplotlib import colormaps
    from matplotlib.patches import Patch, Rectangle

    keys = sorted({_colour_key(table, op) for op in table.ops})
    cmap = colormaps["tab10" if len(keys) <= 10 else "tab20"]
    colour = {k: cmap(i % cmap.N) for i, k in enumerate(keys)}
    fig = _figure(max(6.0, 0.32 * table.num_ticks + 1.5), max(2.0, 0.55 * table.stages + 1.2))
    ax = fig.add_subplot()
    # Several ops can share a (tick, stage) cell (N = 2L workers): split its height.
    cells: dict = {}
    for op in table.ops:
        cells.setdefault((op.tick, op.stage), []).append(op)
    for (tick, stage), ops in cells.items():
        h = 0.9 / len(ops)
        for n, op in enumerate(sorted(ops, key=lambda o: o.device)):
            y = stage - 0.45 + n * h
            ax.add_patch(Rectangle((tick, y), 1, h, facecolor=_shade(colour[_colour_key(table, op)], op.kind == "B"),
                                   edgecolor="black", linewidth=0.4, hatch="///" if op.stale else None))
            text = table.layout.cell(op, diagram=True)
            ax.text(tick + 0.5, y + h / 2, text, ha="center", va="center", fontsize=6 if len(ops) > 1 else 7,
                    color="white" if op.kind == "B" else "black")
    for u in table.updates:  # the update lands at the end of its tick
        ax.plot([u.tick + 1], [u.stage], marker="|", color="red", markersize=14, markeredgewidth=2)
    # Worker 0's (CDP) or every stage's (gpipe) step boundaries; ppll has none.
    step_starts = range(0, table.num_ticks + 1, table.period) if table.period > 1 else ()
    for x in step_starts:
        ax.axvline(x, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xlim(0, table.num_ticks)
    ax.set_ylim(table.stages - 0.5, -0.5)
    ax.set_yticks(range(table.stages))
    ax.set_yticklabels([f"stage {j}" for j in range(table.stages)])
    ax.set_xlabel("time step (tick)")
    ax.set_title(title or _title(table))
    who = _WHO[table.layout.colour]
    handles = [Patch(facecolor=_shade(colour[k], False), edgecolor="black", label=f"{who} {k}") for k in keys[:12]]
    if any(op.stale for op in table.ops):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="///", label="reads previous version"))
    handles.append(Patch(facecolor="red", label="update (end of tick)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    return _save(fig, path)


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
