"""The realised staleness of any time table: how many updates behind each read is (pure numpy).

A forward of stage j at step k reading version v has staleness k - v (the backward reads what its
forward read). Per read: `per_read(table)[k, i, j]`, i the op's worker (its `micro`: CDP's worker,
a pipeline's micro-batch). Over steps: `histogram(table)[i, j, t]` counts the steps at which
(i, j) read t updates behind, `pooled(table)[t]` the same over every pair. `format_staleness`
writes both as text (`cdpjax schedule --staleness`), `plot_staleness` draws them.
"""
from __future__ import annotations

import numpy as np

from cdpjax import kinds


def per_read(table) -> np.ndarray:
    """[steps, workers, stages] int: k - version of each op that runs a forward (the read: the
    backward reads what its forward read; -1 where the table has none)."""
    forwards = [op for op in table.ops if kinds.lookup(op.kind).forward]
    workers = max([table.workers] + [op.micro + 1 for op in forwards])
    out = np.full((table.steps, workers, table.stages), -1, np.int64)
    for op in forwards:
        out[op.step, op.micro, op.stage] = op.step - op.version
    return out


def histogram(table, first_step: int = 0) -> np.ndarray:
    """[workers, stages, tau_max + 1] counts over the steps from `first_step` (reads before step tau
    are of theta_0 and so at most k behind: skip them to see the model's own distribution)."""
    s = per_read(table)[first_step:]
    top = max(int(s.max()) if s.size else 0, 0)
    out = np.zeros(s.shape[1:] + (top + 1,), np.int64)
    for t in range(top + 1):
        out[..., t] = (s == t).sum(0)
    return out


def pooled(table, first_step: int = 0) -> np.ndarray:
    """[tau_max + 1] counts of every read over every (worker, stage) and step from `first_step`."""
    return histogram(table, first_step).sum((0, 1))


def mean(table, first_step: int = 0) -> np.ndarray:
    """[workers, stages] mean staleness over the steps from `first_step`."""
    h = histogram(table, first_step)
    n = np.maximum(h.sum(-1), 1)
    return (h * np.arange(h.shape[-1])).sum(-1) / n


def format_staleness(table, first_step: int = 0) -> str:
    """The mean staleness per (worker, stage) and the pooled histogram, as text."""
    m, counts = mean(table, first_step), pooled(table, first_step)
    lines = [f"{table.method}: staleness (updates behind) of each read, steps {first_step}..{table.steps - 1}",
             "mean per worker (rows) and stage (columns):",
             "        " + " ".join(f"stage{j:<3d}" for j in range(m.shape[1]))]
    lines += [f"w{i:<6d} " + " ".join(f"{x:8.2f}" for x in row) for i, row in enumerate(m)]
    total = max(int(counts.sum()), 1)
    lines.append("histogram over every read: " + ", ".join(
        f"tau={t}: {c} ({c / total:.1%})" for t, c in enumerate(counts)))
    lines.append(f"mean {float((counts * np.arange(len(counts))).sum()) / total:.3f}, max {len(counts) - 1}")
    return "\n".join(lines)


def plot_staleness(table, path: str, first_step: int = 0) -> None:
    """Draws the mean staleness per (worker, stage) and the pooled histogram to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m, counts = mean(table, first_step), pooled(table, first_step)
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    im = a.imshow(m, cmap="viridis", aspect="auto", vmin=0)
    a.set(xlabel="stage", ylabel="worker", title="mean staleness per (worker, stage)")
    fig.colorbar(im, ax=a)
    b.bar(np.arange(len(counts)), counts / max(counts.sum(), 1))
    b.set(xlabel="staleness tau (updates behind)", ylabel="fraction of reads", title="histogram over steps")
    fig.suptitle(f"{table.method}: {table.workers} workers, {table.stages} stages, {table.steps} steps")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
