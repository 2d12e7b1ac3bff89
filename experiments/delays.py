"""CDP under random and asynchronous delays: final test loss and accuracy against the mean delay.

    python experiments/delays.py --tiny --out out/delays_tiny                  # CI: seconds
    python experiments/delays.py --grid digits --out out/delays/digits \\
        --figure docs/figures/delays_digits.png                                # docs/delays.md's digits grid
    python experiments/delays.py --grid charlm --out out/delays/charlm \\
        --figure docs/figures/delays_charlm_grid.png                           # its character language model grid
    python experiments/delays.py --grid target --out out/delays/target \\
        --figure docs/figures/delays_charlm.png                                # the issue's target point
    python experiments/delays.py --grid charlm --out out/delays/charlm --part 0/2 --resume &   # two processes,
    python experiments/delays.py --grid charlm --out out/delays/charlm --part 1/2 --resume     # one OUT
    python experiments/delays.py --docs --out out/delays                       # docs/delays.md's three figures

Every run trains `cdp-random` (`cdpjax.layouts.delays`) with `cdp_impl='simulate'` on one device,
N = 4 workers vmapped, the model cut into 4 stages: on digits (`cdpjax/configs/digits.py`, the
4-stage MLP, batch 128) and, in the charlm, target and full grids, on the character language model
(`cdpjax/configs/charlm.py`, batch 64). A row is (task, delay model, nominal delay tau,
correction, seed); each delay model is set for its nominal tau as `delay_for` says, and the
x-axis is the *realised* mean staleness of the run's table (`cdpjax.staleness.mean`, over the
steps from tau's bound on), so the models sit where their draws put them. tau = 0 is dp for every
model (every read fresh). The corrections are `cdpjax.delay_corrections`' ('none' the plain
update). For the timed models (async, straggler) the table's own time is reported next to dp's
with the same op durations (dp waits for its slowest worker at every all-reduce: `meta['time']`).

Writes OUT/runs.jsonl (a line per run as it finishes), OUT/delays.json (every run), OUT/delays.md
(the table: mean and sample standard deviation over seeds; then the timed models' ticks over
dp's, from their tables alone) and, with --figure, the curves (one panel per delay model, a line
per correction, the seeds' spread as error bars). With --resume the rows already in
OUT/runs.jsonl are kept and only the others trained (a run cut short, or a grid grown).
Wall times are not reported: on simulated devices sharing the cores they say nothing about real
devices (the ticks are the tables' lockstep model).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shutil
import statistics
import sys
import typing

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

WORKERS, STAGES = 4, 4
MODELS = ("uniform-tau", "geometric", "per-stage", "async", "straggler")
CORRECTIONS = ("none", "staleness-lr", "nesterov", "dc-asgd", "pipenag")
# tried at the target only (docs/delays.md): a milder learning-rate cut, fresher reads weighed more, and
# combinations ('+': `delay_corrections.parts`) of PipeNAG's read with the cut and the weights ('@0.5': at
# delay.strength 0.5, PipeNAG's look-ahead halved); sharper weights ((1 + tau)^-4, only the freshest reads)
TARGET_CORRECTIONS = ("staleness-sqrt", "fresh-weighted", "pipenag+staleness-lr", "fresh-weighted+staleness-lr",
                      "pipenag+staleness-lr+fresh-weighted", "pipenag+staleness-lr+fresh-weighted@0.5",
                      "pipenag+staleness-lr+fresh-sharp", "pipenag+staleness-lr+freshest",
                      "pipenag+staleness-lr+fresh-sharp@2")
GRIDS = {
    # CI: one model, two delays, two corrections (staleness-lr is the identity at tau = 0)
    "tiny": dict(tasks=("digits",), models=("uniform-tau",), taus=(0, 2), corrections=("none", "staleness-lr"),
                 seeds=(0,), steps={"digits": 40}),
    # a quick look: digits, two models, 1 seed
    "small": dict(tasks=("digits",), models=("uniform-tau", "straggler"), taus=(0, 2, 8), corrections=CORRECTIONS,
                  seeds=(0,), steps={"digits": 200}),
    # the target: the character language model at tau = L (random delays, uniform on {0..2 tau}),
    # every correction, 3 seeds, against dp's plain update (tau = 0: the gap's other end)
    "target": dict(tasks=("charlm",), models=("uniform-tau",), taus=(0, STAGES),
                   corrections=CORRECTIONS + TARGET_CORRECTIONS,
                   seeds=(0, 1, 2), steps={"charlm": 300}, fresh_corrections=("none",)),
    # the target's corrections tried at seed 0 only and dropped (docs/delays.md): a stronger and a milder cut in the
    # three-way combination, the sharper weights without PipeNAG
    "target-trials": dict(tasks=("charlm",), models=("uniform-tau",), taus=(0, STAGES),
                          corrections=("none", "pipenag+staleness-square+fresh-weighted",
                                       "pipenag+staleness-sqrt+fresh-weighted", "fresh-sharp+staleness-lr"),
                          seeds=(0,), steps={"charlm": 300}, fresh_corrections=("none",)),
    # the grid, one task at a time (docs/delays.md's two curve figures; together: "full")
    "digits": dict(tasks=("digits",), models=MODELS, taus=(0, 1, 2, 4, 8), corrections=CORRECTIONS,
                   seeds=(0, 1, 2), steps={"digits": 600}),
    "charlm": dict(tasks=("charlm",), models=MODELS, taus=(0, 1, 2, 4, 8), corrections=CORRECTIONS,
                   seeds=(0, 1, 2), steps={"charlm": 300}),
    # the grid: both tasks, every model, tau in {0, 1, 2, 4, 8}, 3 seeds
    "full": dict(tasks=("digits", "charlm"), models=MODELS, taus=(0, 1, 2, 4, 8), corrections=CORRECTIONS,
                 seeds=(0, 1, 2), steps={"digits": 600, "charlm": 300}),
}


def delay_for(model: str, tau: int) -> dict:
    """The delay block of `model` at nominal mean delay `tau` (`cdpjax.layouts.delays.at_mean_delay`)."""
    from cdpjax.layouts.delays import at_mean_delay

    return at_mean_delay(model, tau, STAGES)


class Run(typing.NamedTuple):
    """One trained run: its row and its final test metrics; `mean_tau`: the table's realised mean
    staleness; `ticks`, `dp_ticks`: the table's time and dp's with the same durations (timed
    models, else 0)."""

    task: str
    model: str
    tau: int
    correction: str
    seed: int
    mean_tau: float
    test_loss: float
    test_metric: float
    ticks: int
    dp_ticks: int


def config_of(task: str, model: str, tau: int, correction: str, seed: int, steps: int):
    from cdpjax import config as config_lib

    c = config_lib.load_file(f"{task}:method=cdp-random,steps={steps}")
    c.cdp_impl, c.workers, c.stages, c.seed = "simulate", WORKERS, STAGES, seed
    c.eval_every = c.checkpoint_every = 0
    name, _, strength = correction.partition("@")  # 'NAME@LAMBDA': the correction at delay.strength LAMBDA
    c.delay.update({**delay_for(model, tau), "seed": seed, "correction": name,
                    **({"strength": float(strength)} if strength else {})})
    return c


def train_one(task: str, model: str, tau: int, correction: str, seed: int, steps: int) -> Run:
    """Trains one row in this process and evaluates it on the whole test split."""
    import jax

    from cdpjax import data, loop, methods, staleness, tasks
    from cdpjax.mesh import make_mesh

    c = config_of(task, model, tau, correction, seed, steps)
    ds = data.build(c)
    task_ = tasks.resolve(c, ds)
    ctx = methods.Context(c, make_mesh({"data": 1}, jax.devices()[:1]), tuple(ds.image_shape), ds.num_classes,
                          ds.input_dtype, task_)
    m = methods.build(ctx)
    state = m.init(jax.random.key(seed))
    for k in range(steps):
        state, _ = m.train_step(state, ds.train_batch(k, c.global_batch_size, seed, augment=False))
    params, model_state = m.export(state)
    metrics = loop.evaluate(loop.make_eval_fn(m.net, task_), params, model_state, ds, 256, task_)
    loss = float(metrics["loss"])
    metric = float(metrics.get("accuracy", metrics.get("token_accuracy", float("nan"))))
    bound = max(int(staleness.per_read(m.table).max()), 0)
    time = m.table.meta.get("time", {})
    return Run(task, model, tau, correction, seed, float(staleness.mean(m.table, bound).mean()), loss, metric,
               int(time.get("ticks", 0)), int(time.get("dp_ticks", 0)))


def _resume_key(task, model, tau, correction, seed) -> tuple:
    """What a finished run is found by on --resume: at tau = 0 every model is dp, so not the model
    (a call with --models may have filed those rows under another first model)."""
    return task, None if tau == 0 else model, tau, correction, seed


def rows(grid: dict):
    """(task, model, tau, correction, seed) of the grid; tau = 0 once per task, correction and seed
    (every model is dp there), under the first model; only the grid's `fresh_corrections` there if it
    names them. Model by model after the tau = 0 rows, so that a grid cut short holds whole models."""
    for task in grid["tasks"]:
        for seed in grid["seeds"]:
            for correction in grid["corrections"]:
                if 0 in grid["taus"] and correction in grid.get("fresh_corrections", grid["corrections"]):
                    yield task, grid["models"][0], 0, correction, seed
        for model in grid["models"]:
            for seed in grid["seeds"]:
                for correction in grid["corrections"]:
                    for tau in grid["taus"]:
                        if tau:
                            yield task, model, tau, correction, seed


def spread(values) -> tuple[float, float]:
    """Mean and sample standard deviation over seeds; a diverged seed (nan) makes both nan."""
    values = list(values)
    if any(math.isnan(v) for v in values):
        return math.nan, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def table_markdown(runs: list[Run]) -> str:
    """One line per (task, model, tau, correction): mean and spread over seeds."""
    groups: dict = {}
    for r in runs:
        groups.setdefault((r.task, r.model if r.tau else "dp (tau = 0)", r.tau, r.correction), []).append(r)
    lines = ["| task | delay model | tau | realised mean tau | correction | test loss | test accuracy | "
             "ticks / dp's |", "|---|---|---|---|---|---|---|---|"]
    for (task, model, tau, corr), rs in groups.items():
        (loss, dl), (acc, da) = spread(r.test_loss for r in rs), spread(r.test_metric for r in rs)
        ratio = f"{statistics.fmean(r.ticks / r.dp_ticks for r in rs):.3f}" if rs[0].dp_ticks else "-"
        lines.append(f"| {task} | {model} | {tau} | {statistics.fmean(r.mean_tau for r in rs):.2f} | {corr} | "
                     f"{loss:.4f} ± {dl:.4f} | {acc:.4f} ± {da:.4f} | {ratio} |")
    return "\n".join(lines) + "\n"


def time_markdown(taus, steps: int = 64) -> str:
    """The timed models' tables (no training): their ticks over dp's with the same op durations
    (dp: each step as long as its slowest worker's), and their realised mean staleness."""
    from cdpjax import staleness
    from cdpjax.layouts.delays import delay_table

    lines = ["| delay model | tau | realised mean tau | ticks / dp's ticks |", "|---|---|---|---|"]
    for model in ("async", "straggler"):
        for tau in (t for t in taus if t):
            t = delay_table(WORKERS, STAGES, steps, delay_for(model, tau))
            time = t.meta["time"]
            lines.append(f"| {model} | {tau} | {staleness.mean(t, tau).mean():.2f} | "
                         f"{time['ticks'] / time['dp_ticks']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(runs: list[Run], path: str) -> None:
    """Per task, one column per delay model: test loss (top) and accuracy (bottom) against the
    realised mean delay, a line per correction, the dp point (tau = 0) on every panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r.task for r in runs})
    models = [m for m in MODELS if any(r.model == m and r.tau for r in runs)]
    drawn = [c for c in CORRECTIONS + TARGET_CORRECTIONS if any(r.correction == c for r in runs)]
    outside = len(drawn) > 10  # so many lines that a legend inside would cover the curves: right of the axes
    fig, axes = plt.subplots(2 * len(tasks), len(models), squeeze=False,
                             figsize=(3.6 * len(models) + 3.4 * outside, 5.2 * len(tasks)))
    colors = dict(zip(drawn, plt.cm.tab20.colors if len(drawn) > 10 else plt.cm.tab10.colors))
    for t, task in enumerate(tasks):
        for c, model in enumerate(models):
            for corr in CORRECTIONS + TARGET_CORRECTIONS:
                rs = [r for r in runs if r.task == task and r.correction == corr and (r.model == model or not r.tau)]
                taus = sorted({r.tau for r in rs})
                if not taus:
                    continue
                xs = [statistics.fmean(r.mean_tau for r in rs if r.tau == tau) for tau in taus]
                for row, field in ((2 * t, "test_loss"), (2 * t + 1, "test_metric")):
                    ys = [spread(getattr(r, field) for r in rs if r.tau == tau) for tau in taus]
                    axes[row][c].errorbar(xs, [y for y, _ in ys], yerr=[e for _, e in ys], marker="o",
                                          capsize=3, label=corr, color=colors[corr])
            axes[2 * t][c].set_title(f"{task}: {model}")
            axes[2 * t][c].set_ylabel("final test loss")
            axes[2 * t + 1][c].set_ylabel("final test accuracy")
            axes[2 * t + 1][c].set_xlabel("realised mean staleness (updates behind)")
    if outside:
        axes[0][-1].legend(title="correction", fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    else:
        axes[0][0].legend(title="correction", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def kept_runs(figure) -> pathlib.Path:
    """Where a docs figure's runs are kept in the repository (its runs.jsonl, beside it:
    `docs/figures/NAME.runs.jsonl`), for `--docs` to start from where OUT/GRID has none."""
    figure = pathlib.Path(figure)
    return figure.with_name(figure.stem + ".runs.jsonl")


# docs/delays.md's figures: (grid, figure), each grid's runs in OUT/GRID (`--docs`)
DOC_FIGURES = (("digits", "docs/figures/delays_digits.png"), ("charlm", "docs/figures/delays_charlm_grid.png"),
               ("target", "docs/figures/delays_charlm.png"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--docs", action="store_true",
                   help="every figure of docs/delays.md from its grid's runs in OUT/GRID, training only the "
                        "missing ones (--resume per grid)")
    p.add_argument("--tiny", action="store_true", help="the CI grid (same as --grid tiny)")
    p.add_argument("--grid", choices=sorted(GRIDS), default="small")
    p.add_argument("--out", required=True, help="folder for delays.json and delays.md")
    p.add_argument("--figure", default=None, help="write the curves to this .png")
    p.add_argument("--resume", action="store_true",
                   help="keep the rows already in OUT/runs.jsonl (a run cut short, or a grid grown) and train the rest")
    p.add_argument("--corrections", default=None,
                   help="comma-separated: train only these of the grid's corrections (then --resume for the rest)")
    p.add_argument("--models", default=None, help="comma-separated: train only these of the grid's delay models")
    p.add_argument("--part", default=None, metavar="I/N",
                   help="train only the grid's rows I, I + N, I + 2N, ... (N processes sharing one OUT, each with "
                        "--resume; then one whole --resume call writes the table and figure)")
    args = p.parse_args(argv)
    part, parts = 0, 1
    if args.part:
        try:
            part, parts = (int(v) for v in args.part.split("/"))
        except ValueError:
            p.error(f"--part {args.part}: give I/N, e.g. 0/2")
        if not 0 <= part < parts:
            p.error(f"--part {args.part}: I must be in 0..N-1")
        if not args.resume:
            p.error(f"--part {args.part} needs --resume: the parts append to one OUT/runs.jsonl, which a fresh "
                    "start empties")
    if args.docs:
        if args.tiny or args.figure or args.corrections or args.models or args.part:
            p.error("--docs runs the docs' grids whole: give it only --out")
        root = pathlib.Path(__file__).resolve().parents[1]
        for name, figure in DOC_FIGURES:
            out = os.path.join(args.out, name)
            kept = kept_runs(root / figure)
            if kept.exists() and not os.path.exists(os.path.join(out, "runs.jsonl")):
                # the runs the figure was drawn from, kept beside it: hours of training not repeated
                os.makedirs(out, exist_ok=True)
                shutil.copyfile(kept, os.path.join(out, "runs.jsonl"))
                print(f"{name}: starting from the runs kept in {kept}", flush=True)
            main(["--grid", name, "--out", out, "--figure", str(root / figure), "--resume"])
        return 0
    grid = GRIDS["tiny" if args.tiny else args.grid]
    for key, value in (("corrections", args.corrections), ("models", args.models)):
        if value:
            only = tuple(value.split(","))
            bad = sorted(set(only) - set(grid[key]))
            if bad:
                p.error(f"--{key} {','.join(bad)}: the grid's {key} are {', '.join(grid[key])}")
            grid = {**grid, key: only}
    os.makedirs(args.out, exist_ok=True)
    log = os.path.join(args.out, "runs.jsonl")
    done = {}
    if args.resume and os.path.exists(log):
        with open(log) as f:
            done = {_resume_key(*r[:5]): r for r in (Run(**json.loads(line)) for line in f if line.strip())}
    runs = []
    with open(log, "a" if args.resume else "w") as f:
        for index, (task, model, tau, correction, seed) in enumerate(rows(grid)):
            if index % parts != part:
                continue
            r = done.get(_resume_key(task, model, tau, correction, seed))
            if r is None:
                r = train_one(task, model, tau, correction, seed, grid["steps"][task])
                f.write(json.dumps(r._asdict()) + "\n")
                f.flush()
                print(f"{task} {model} tau={tau} (mean {r.mean_tau:.2f}) {correction} seed {seed}: "
                      f"test loss {r.test_loss:.4f}, accuracy {r.test_metric:.4f}", flush=True)
            runs.append(r)
    if parts > 1:
        print(f"part {part}/{parts} of {args.out} trained: one whole --resume call writes its table and figure")
        return 0
    with open(os.path.join(args.out, "delays.json"), "w") as f:
        json.dump({"grid": {k: v for k, v in grid.items()}, "runs": [r._asdict() for r in runs]}, f, indent=1)
    with open(os.path.join(args.out, "delays.md"), "w") as f:
        f.write(table_markdown(runs) + "\n" + time_markdown(grid["taus"]))
    if args.figure:
        plot(runs, args.figure)
    print(f"wrote {args.out}/delays.md" + (f" and {args.figure}" if args.figure else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
