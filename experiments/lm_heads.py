"""Local learning's heads on a language model: charlm's per-token test loss by method and head, against end-to-end.

    python experiments/lm_heads.py --tiny --out out/lm_heads_tiny   # 1 seed, 60 steps: CI
    python experiments/lm_heads.py --out out/lm_heads --figure docs/figures/lm_heads.png   # 3 seeds: the docs

Every row trains `cdpjax/configs/charlm.py` (a 4-block character GPT, 64 wide, on the
embedded *Coriolanus*, windows of 32, batch 64, Adam 3e-3 cosine) cut into 4 stages, once
per seed, into OUT/<row>-seed<S>/ (a finished run is reused):

- `e2e`: backpropagation through the whole network, on one device;
- `1f1b`: the same update rule as a pipeline on 4 stage devices;
- `ppll` with each local head on 4 stage devices (modules 0-2 train on their head's
  per-token cross-entropy, module 3 on the network's own output): `token_linear` (one
  per-token Dense on the raw residual stream, charlm's default), `token_output` (a copy of
  the model's final LayerNorm and unembedding) and `token_output` after 1 private decoder
  block (`aux_kwargs.depth=1`).

Two readings of the final per-token test loss (nats; mean and sample standard deviation
over seeds; gap = the row's mean minus e2e's):
- at equal steps: each run's test loss after its last step;
- at equal FLOPs: each run's test loss at the step where its training FLOPs reach e2e's
  total, interpolated linearly between its evaluations (every `steps // EVALS` steps).
  A step's training FLOPs are 3x the forward FLOPs of the blocks and of the local heads
  (backward ~ 2x forward), per example times the batch; the forward FLOPs are XLA's cost
  analysis of each block and head as `cdpjax describe` reports them. The reading of a
  row whose steps cost more is taken before its cosine schedule has decayed: it is the
  loss that run had reached on e2e's budget, not that of a run scheduled for that budget.

Writes OUT/lm_heads.md (the table), OUT/lm_heads.json (the rows and the runs) and
OUT/lm_heads.png (each row's gap to e2e at equal steps and at equal FLOPs, with the
seeds' spread). Times are not reported: on simulated CPU devices sharing the cores they
say nothing about real devices.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import typing

HERE = os.path.dirname(os.path.abspath(__file__))
CHARLM = os.path.join(HERE, "..", "cdpjax", "configs", "charlm.py")
STAGES = 4
EVALS = 5  # test evaluations per run: the points the equal-FLOPs reading interpolates between
BACKWARD_FACTOR = 3  # a training step's FLOPs over its forward's: the backward costs about twice the forward
FULL = {"steps": 150, "seeds": (0, 1, 2)}
TINY = {"steps": 60, "seeds": (0,)}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One row: `method` on charlm with `overrides` (config keys: its mesh and its local head)."""

    name: str
    method: str
    overrides: tuple[str, ...] = ()


VARIANTS = (
    Variant("e2e", "e2e", ("mesh.data=1",)),
    Variant("1f1b", "1f1b", (f"mesh.stage={STAGES}", "mesh.data=1")),
    Variant("ppll token_linear", "ppll", (f"mesh.stage={STAGES}", "mesh.data=1", "aux_head=token_linear")),
    Variant("ppll token_output", "ppll", (f"mesh.stage={STAGES}", "mesh.data=1", "aux_head=token_output")),
    Variant("ppll token_output depth 1", "ppll",
            (f"mesh.stage={STAGES}", "mesh.data=1", "aux_head=token_output", "aux_kwargs.depth=1")),
)
REFERENCE = "e2e"


class Run(typing.NamedTuple):
    """One seed of one row: its test loss after each evaluated step, and its training FLOPs per step."""

    variant: str
    seed: int
    eval_steps: tuple[int, ...]
    eval_losses: tuple[float, ...]
    flops_per_step: float

    @property
    def final_loss(self) -> float:
        return self.eval_losses[-1]


def variant_config(variant: Variant, steps: int, seed: int):
    from cdpjax import config as cfg_lib

    config = cfg_lib.load_file(f"{CHARLM}:method={variant.method},stages={STAGES},steps={steps}")
    cfg_lib.apply_overrides(config, [f"seed={seed}", f"eval_every={max(1, steps // EVALS)}",
                                     "checkpoint_every=0", f"log_every={max(1, steps // EVALS)}",
                                     *variant.overrides])
    return config


def training_flops_per_step(config) -> float:
    """BACKWARD_FACTOR x (blocks' + local heads' forward FLOPs per example) x the global batch."""
    from cdpjax.commands.describe import describe

    totals = describe(config)["totals"]
    return float(BACKWARD_FACTOR * (totals["flops"] + totals["head_flops"]) * config.global_batch_size)


def devices_for(config) -> list:
    import jax

    from cdpjax.layouts import devices_needed

    needed = devices_needed(config)
    return jax.devices() if needed is None else jax.devices()[:needed]


def run_one(variant: Variant, steps: int, seed: int, out: str, log=print) -> Run:
    """Trains one seed of one row into OUT/<row>-seed<S>/ (reusing a finished run) and reads its test losses."""
    from cdpjax import train

    config = variant_config(variant, steps, seed)
    workdir = os.path.join(out, f"{variant.name.replace(' ', '_')}-seed{seed}")
    log(f"{variant.name}, seed {seed}: {workdir}")
    train.train(config, workdir, progress=False, devices=devices_for(config))
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        tests = [r for r in map(json.loads, f) if r["split"] == "test"]
    if not tests or tests[-1]["step"] != steps:
        raise RuntimeError(f"{workdir}: no test loss after step {steps} (choose another --out or remove it)")
    return Run(variant.name, seed, tuple(r["step"] for r in tests), tuple(float(r["loss"]) for r in tests),
               training_flops_per_step(config))


def loss_at_step(run: Run, step: float) -> float:
    """The run's test loss at `step`, linear between its evaluations (not before the first)."""
    points = list(zip(run.eval_steps, run.eval_losses))
    if step <= points[0][0]:
        return points[0][1]
    for (s0, l0), (s1, l1) in zip(points, points[1:]):
        if step <= s1:
            return l0 + (l1 - l0) * (step - s0) / (s1 - s0)
    return points[-1][1]


def _mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarise(runs: list[Run], steps: int) -> list[dict]:
    """One row per variant: final loss and loss at e2e's FLOPs (mean, sd), their gaps to e2e, FLOPs per step."""
    by = {v.name: [r for r in runs if r.variant == v.name] for v in VARIANTS}
    budget = steps * statistics.fmean(r.flops_per_step for r in by[REFERENCE])
    rows = []
    for name, rs in by.items():
        flops = statistics.fmean(r.flops_per_step for r in rs)
        at_budget = [loss_at_step(r, min(steps, budget / r.flops_per_step)) for r in rs]
        rows.append({"variant": name, "seeds": len(rs), "flops_per_step": flops,
                     "flops_ratio": flops / (budget / steps), "step_at_equal_flops": min(steps, budget / flops),
                     "final": _mean_sd([r.final_loss for r in rs]), "equal_flops": _mean_sd(at_budget)})
    ref = rows[0]
    for row in rows:
        row["gap_steps"] = row["final"][0] - ref["final"][0]
        row["gap_flops"] = row["equal_flops"][0] - ref["equal_flops"][0]
    return rows


def markdown(rows: list[dict], steps: int) -> str:
    lines = [f"| method (head) | seeds | training FLOPs / step (x e2e) | test loss after {steps} steps | "
             f"gap to e2e | step at e2e's FLOPs | test loss there | gap to e2e |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['seeds']} | {r['flops_per_step']:.3g} ({r['flops_ratio']:.2f}) | "
                     f"{r['final'][0]:.3f} ± {r['final'][1]:.3f} | {r['gap_steps']:+.3f} | "
                     f"{r['step_at_equal_flops']:.0f} | {r['equal_flops'][0]:.3f} ± {r['equal_flops'][1]:.3f} | "
                     f"{r['gap_flops']:+.3f} |")
    return "\n".join(lines) + "\n"


def figure(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    others = rows[1:]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    xs = range(len(others))
    w = 0.38
    ax.bar([x - w / 2 for x in xs], [r["gap_steps"] for r in others], w, yerr=[r["final"][1] for r in others],
           capsize=3, label="equal steps")
    ax.bar([x + w / 2 for x in xs], [r["gap_flops"] for r in others], w,
           yerr=[r["equal_flops"][1] for r in others], capsize=3, label="equal FLOPs (heads counted)")
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_xticks(list(xs), [r["variant"].replace(" ", "\n", 1) for r in others], fontsize=8)
    ax.set_ylabel("test loss - e2e's (nats/token)")
    ax.set_title(f"charlm, gap to end-to-end ({rows[0]['seeds']} seeds; bars: sd over seeds)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_all(out: str, steps: int, seeds, log=print, figure_copy: str | None = None) -> dict:
    os.makedirs(out, exist_ok=True)
    runs = [run_one(v, steps, s, out, log) for v in VARIANTS for s in seeds]
    rows = summarise(runs, steps)
    table = markdown(rows, steps)
    with open(os.path.join(out, "lm_heads.md"), "w") as f:
        f.write(table)
    with open(os.path.join(out, "lm_heads.json"), "w") as f:
        json.dump({"steps": steps, "seeds": list(seeds), "rows": rows,
                   "runs": [r._asdict() for r in runs]}, f, indent=1)
    figure(rows, os.path.join(out, "lm_heads.png"))
    if figure_copy:
        figure(rows, figure_copy)
    return {"rows": rows, "markdown": table}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help=f"{TINY['steps']} steps, 1 seed (CI)")
    p.add_argument("--out", help="output directory (default out/lm_heads or out/lm_heads_tiny)")
    p.add_argument("--steps", type=int, help=f"training steps per run (default {FULL['steps']}, tiny {TINY['steps']})")
    p.add_argument("--seeds", type=int, help="seeds per row (default 3, tiny 1)")
    p.add_argument("--figure", help="also draw the figure to this path (docs/figures/lm_heads.png for the docs)")
    args = p.parse_args(argv)
    sizes = TINY if args.tiny else FULL
    steps = sizes["steps"] if args.steps is None else args.steps
    if steps < EVALS:
        p.error(f"--steps {steps} must be >= {EVALS} (the test evaluations of a run)")
    if args.seeds is not None and not 1 <= args.seeds <= 100:
        p.error(f"--seeds {args.seeds} must be 1 to 100")
    seeds = sizes["seeds"] if args.seeds is None else tuple(range(args.seeds))
    out = args.out or os.path.join("out", "lm_heads_tiny" if args.tiny else "lm_heads")

    from cdpjax.mesh import setup_devices

    setup_devices(STAGES)  # before anything starts JAX's backends
    result = run_all(out, steps, seeds, figure_copy=args.figure)
    print(result["markdown"])
    print("figure:", os.path.join(out, "lm_heads.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
