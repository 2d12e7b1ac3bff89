"""`cdpjax plot`: the training curves of one or more work directories, overlaid.

    cdpjax plot workdirs/dp-* workdirs/cdp-v2-* --out curves.png

Four panels over the step: train loss, test loss, train accuracy, test accuracy,
one line per work directory (labelled by its directory name and method), read
from each WORKDIR/metrics.jsonl. No JAX: instant. Matplotlib with the Agg
canvas, `.png` or `.svg` by the suffix of `--out`, which must be writable in a folder
that exists (checked first). Lines of metrics.jsonl that are not metrics records
(cut short, not UTF-8, not an object) are left out, saying so; a config.json that is not
a run's leaves the label to the directory's name.
"""
from __future__ import annotations

import json
import math
import os
import sys

from cdpjax import events
from cdpjax.commands.common import FIGURE_SUFFIXES, check_output
from cdpjax.errors import ConfigError

PANELS = (("train", "loss"), ("test", "loss"), ("train", "accuracy"), ("test", "accuracy"))


def add_parser(subparsers):
    p = subparsers.add_parser("plot", help="overlay the loss and accuracy curves of work directories",
                              description=__doc__.splitlines()[0])
    p.add_argument("workdirs", nargs="+", metavar="WORKDIR", help="work directories holding metrics.jsonl")
    p.add_argument("--out", default="curves.png", help="the figure: FILE.png or FILE.svg (default: curves.png)")
    return p


def read_metrics(workdir: str) -> list[dict]:
    """WORKDIR/metrics.jsonl as records (lines that are not records are left out, saying so)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        raise ConfigError(f"{workdir} holds no metrics.jsonl: give work directories of cdpjax train runs")
    try:
        records, dropped = events.read_metrics(path)
    except OSError as e:
        raise ConfigError(f"{path} cannot be read ({e.strerror or e})") from None
    if dropped:
        print(f"cdpjax plot: {path}: left out {len(dropped)} line{'s' if len(dropped) > 1 else ''} that "
              f"{'are' if len(dropped) > 1 else 'is'} not a metrics record ({dropped[0]})", file=sys.stderr)
    return records


def _label(workdir: str) -> str:
    name = os.path.basename(os.path.normpath(workdir))
    try:
        with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
            saved = json.load(f)
        method = saved.get("method") if isinstance(saved, dict) else None
    except (OSError, ValueError, RecursionError):
        method = None
    method = method if isinstance(method, str) else None
    return f"{name} ({method})" if method and method not in name else name


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def curves(records: list[dict], split: str, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one field of one split, in file order (values that are not finite
    numbers left out)."""
    rows = [r for r in records if r.get("split") == split and _finite(r.get(key))]
    return [r["step"] for r in rows], [r[key] for r in rows]


def plot_curves(workdirs, out: str):
    """Draws the four panels for `workdirs` into `out`; returns the matplotlib Figure."""
    from cdpjax.plotting import _figure, _save

    runs = [(_label(w), read_metrics(w)) for w in workdirs]
    fig = _figure(10.0, 6.4)
    axes = fig.subplots(2, 2).ravel()
    for ax, (split, key) in zip(axes, PANELS):
        for label, records in runs:
            steps, values = curves(records, split, key)
            if steps:
                ax.plot(steps, values, marker="o" if split == "test" else None, markersize=3, label=label)
        ax.set(xlabel="step", ylabel=f"{split} {key}", title=f"{split} {key}")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    _save(fig, out)
    return fig


def run(args) -> int:
    check_output(args.out, "--out", FIGURE_SUFFIXES)
    plot_curves(args.workdirs, args.out)
    print(f"cdpjax: wrote {args.out} ({len(args.workdirs)} run{'s' if len(args.workdirs) > 1 else ''})",
          file=sys.stderr)
    return 0
