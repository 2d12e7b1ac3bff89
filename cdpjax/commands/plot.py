"""`cdpjax plot`: the training curves of one or more work directories, overlaid.

    cdpjax plot workdirs/dp-* workdirs/cdp-v2-* --out curves.png

Two panels over the step for each metric the runs' metrics.jsonl lines carry
(train, then test): loss and accuracy for classification; loss, perplexity and
token_accuracy for language modelling; one line per work directory (labelled by
its directory name and method). No JAX: instant. Matplotlib with the Agg
canvas, `.png` or `.svg` by the suffix of `--out`, which must be writable in a folder
that exists (created first). Lines of metrics.jsonl that are not metrics records
(cut short, not UTF-8, not an object) are left out, saying so, and so are values that are
not finite or past `PLOT_LIMIT` (a step among them); a config.json that is not a run's leaves the
label to the directory's name. Names (directories, methods, metric keys) are drawn as plain text:
no TeX, no mathtext (`$` is a dollar sign), characters that are not text (a lone surrogate) shown
as escapes, at most `NAME_CHARS` characters; the first `METRIC_LIMIT` metrics are drawn, those past
them named as left out.
"""
from __future__ import annotations

import json
import math
import os
import sys

from cdpjax import events, files
from cdpjax.commands.common import FIGURE_SUFFIXES, created_output
from cdpjax.errors import ConfigError

# Fields of a metrics line that are not metrics (throughputs, `<unit>_per_second`, neither).
NOT_METRICS = ("step", "split", "time", "lr")
# The largest magnitude drawn: matplotlib's axes overflow laying out values near the float64
# maximum (a diverged run's perplexity, exp(loss), reaches 1.8e308).
PLOT_LIMIT = 1e300
METRIC_LIMIT = 6  # metrics drawn (two panels each; a task has 2 or 3): a figure drawn in seconds
NAME_CHARS = 80  # characters of a name drawn in a title, an axis label or the legend


def add_parser(subparsers):
    p = subparsers.add_parser("plot", help="overlay the training curves (loss, accuracy...) of work directories",
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
        saved = json.loads(files.read_text(os.path.join(workdir, "config.json")))
        method = saved.get("method") if isinstance(saved, dict) else None
    except (OSError, ValueError, RecursionError):
        method = None
    method = method if isinstance(method, str) else None
    return f"{name} ({method})" if method and method not in name else name


def _finite(v) -> bool:
    """A number matplotlib can place on an axis: finite, at most PLOT_LIMIT (an integer of 400 digits
    is past it, and past a float too)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        v = float(v)
    except OverflowError:
        return False
    return math.isfinite(v) and abs(v) <= PLOT_LIMIT


def plain(name: str) -> str:
    """`name` as plain text for matplotlib: what is not UTF-8 text escaped, `$` escaped so that mathtext
    leaves it a dollar sign, at most NAME_CHARS characters."""
    text = name.encode("utf-8", "backslashreplace").decode("utf-8")
    text = text if len(text) <= NAME_CHARS else text[:NAME_CHARS - 3] + "..."
    return text.replace("$", r"\$")


def curves(records: list[dict], split: str, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one field of one split, in file order (values that are not finite
    numbers, or past PLOT_LIMIT, left out)."""
    rows = [r for r in records if r.get("split") == split and _finite(r.get(key)) and _finite(r["step"])]
    return [r["step"] for r in rows], [r[key] for r in rows]


def metric_names(runs) -> list[str]:
    """The metrics the runs' lines carry, in the order first met (the task's order: loss first)."""
    names = {}  # a dict: ordered, and a key found in it at once (3,000 keys)
    for _, records in runs:
        for r in records:
            names.update((k, None) for k, v in r.items() if k not in NOT_METRICS and not k.endswith("_per_second")
                         and isinstance(v, (int, float)) and not isinstance(v, bool))
    return list(names) or ["loss"]


def plot_curves(workdirs, out: str):
    """Draws a train and a test panel per metric (the first METRIC_LIMIT) for `workdirs` into `out`;
    returns the Figure."""
    import matplotlib

    with matplotlib.rc_context({"text.usetex": False}):  # names are plain text, whatever the rc file says
        return _plot_curves(workdirs, out)


def _plot_curves(workdirs, out: str):
    from cdpjax.plotting import _figure, _save

    runs = [(_label(w), read_metrics(w)) for w in workdirs]
    names = metric_names(runs)
    if len(names) > METRIC_LIMIT:
        left = names[METRIC_LIMIT:]
        shown = ", ".join(left[:3]).encode("utf-8", "backslashreplace").decode("utf-8")[:3 * NAME_CHARS]
        print(f"cdpjax plot: {len(names)} metrics; drawing the first {METRIC_LIMIT}, leaving out {len(left)}: "
              f"{shown}{', ...' if len(left) > 3 else ''}", file=sys.stderr)
        names = names[:METRIC_LIMIT]
    # constrained layout: the top row's x labels clear the next row's titles
    fig = _figure(10.0, 3.2 * len(names), layout="constrained")
    axes = fig.subplots(len(names), 2, squeeze=False).ravel()
    for ax, (split, key) in zip(axes, [(split, key) for key in names for split in ("train", "test")]):
        for label, records in runs:
            steps, values = curves(records, split, key)
            if steps:
                ax.plot(steps, values, marker="o" if split == "test" else None, markersize=3, label=plain(label))
        ax.set(xlabel="step", ylabel=plain(f"{split} {key}"), title=plain(f"{split} {key}"))
        ax.grid(alpha=0.3)
    drawn = [ax for ax in axes if ax.get_lines()]
    if drawn:  # the first panel with a line (none at all: no legend, rather than matplotlib's warning)
        drawn[0].legend(fontsize=7)
    _save(fig, out)
    return fig


def run(args) -> int:
    with created_output(args.out, "--out", FIGURE_SUFFIXES):
        plot_curves(args.workdirs, args.out)
    print(f"cdpjax: wrote {args.out} ({len(args.workdirs)} run{'s' if len(args.workdirs) > 1 else ''})",
          file=sys.stderr)
    return 0
