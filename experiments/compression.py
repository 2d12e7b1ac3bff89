"""Compressed transfers: bytes per step and final test loss per codec, for ppll's activations and
the CDP ring's gradient sums, on digits and the character language model.

    python experiments/compression.py --doc docs/compression.md --out out/compression  # the doc's every table
    python experiments/compression.py --tiny --out out/compression_tiny           # CI: a few minutes
    python experiments/compression.py --grid charlm --out out/compression_charlm  # one grid's tables only

Tasks: digits (`cdpjax/configs/digits.py`: the 4-stage MLP, batch 128, 200 steps) and charlm
(`cdpjax/configs/charlm.py`: the 4-block character GPT, 64 wide, windows of 32, batch 64, its
300 steps). `--codecs` / `--seeds` train a subset of the grid's rows (the rows earlier calls
wrote to OUT stay in its tables), `--no-step-times` skips steps.md. Every run
trains on 4 simulated CPU devices: `ppll` (one module per device, `compress.activations` set
to the codec; charlm's modules learn through its `token_linear` heads) or `cdp-v2` on the ring
(4 workers, `compress.gradients` set to the codec; `+feedback`: with `compress.feedback`,
which `topk-1/8` needs there),
each with the codecs (and seeds) `GRIDS[grid]` names for its task and route. A
row is (task, route, codec, seed). Bytes per step are the program's (`Program.sent_bytes`:
each `Send` event through its codec, per device and step, mean over devices;
tests/test_compress.py checks that the compiled program's permutes carry them within 1%); the
ratio is over the same task and route's bytes with no codec. The final test loss and accuracy
(charlm: per token) are over the whole test split (`cdpjax.loop.evaluate`).

The issue's target, ppll on charlm with at least 4x fewer forward bytes than float32 and at
most 2% higher final test loss (mean over seeds), is read off the charlm ppll rows (`TARGET`).

Writes OUT/compression.json (every run, after each: a call stopped part-way, as a simulated
device's collective timing out on an overloaded machine, goes on from there when run again) and
OUT/compression.md (mean and sample standard deviation over seeds). Wall times are not
reported: on simulated devices sharing the cores they say nothing about a real link.

`--doc PATH`: every grid a marker of PATH names, each in its own OUT/GRID folder, then each marked
table of PATH rewritten from that folder's stored results, the text outside the markers left as it
is. `<!-- compression:GRID -->` ... `<!-- /compression -->` holds the grid's loss and bytes table,
`<!-- compression-steps:GRID -->` ... `<!-- /compression -->` its step times. Runs (and step-time
rows) already stored are read, not trained (measured) again: a second call with nothing new
leaves PATH byte-equal.

`--bandwidth B [B ...]` (bytes/s): OUT/steps.md (and steps.json), the lockstep model's step
time (`cdpjax.speedup`: the route's time table replayed, stage costs measured here, each op alone
on one device) of each (task, route, codec) over the same step with no codec, a message taking
its wire bytes / B plus the codec's encode and decode time measured here for that message's
size; and the bandwidth below which the codec shortens the step. Ratios and a bandwidth only:
they depend on this device's compute and coding speeds, which a busy machine distorts. A row of
OUT/steps.json with the same bandwidths is kept, not measured again (remove the file to measure
anew); the missing rows of a (task, route) are measured together, its stage costs once.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import typing

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

DEVICES = 4
CODECS = ("none", "bf16", "fp8-e4m3", "fp8-e5m2", "int8", "int4")
FEEDBACK = "+feedback"  # a codec name ending in it: with compress.feedback (gradient routes only)
TOPK = "topk-1/8"  # on gradients with FEEDBACK only (compress.Codecs refuses it without)
# route: (method, config key of its messages, extra config)
ROUTES = {"ppll-activations": ("ppll", "activations", {}),
          "ring-gradients": ("cdp-v2", "gradients", {"cdp_impl": "ring", "workers": DEVICES})}
# task: its test metric besides the loss
METRICS = {"digits": "accuracy", "charlm": "token_accuracy"}
# A grid: tasks, routes, seeds, steps per task, the codecs of each (task, route) ("task/route" keys: JSON)
# and, where fewer than `seeds`, its seeds.
GRIDS = {
    "tiny": dict(tasks=("digits", "charlm"), routes=tuple(ROUTES), seeds=(0,), steps={"digits": 10, "charlm": 3},
                 codecs={f"{t}/{r}": ("none", "int4") for t in METRICS for r in ROUTES}),
    "digits": dict(tasks=("digits",), routes=tuple(ROUTES), seeds=(0, 1, 2), steps={"digits": 200},
                   codecs={"digits/ppll-activations": (*CODECS, TOPK),
                           "digits/ring-gradients": (*CODECS, "int8" + FEEDBACK, "int4" + FEEDBACK,
                                                     TOPK + FEEDBACK)}),
    # the recipe's full 300 steps, 3 seeds each: ppll's activations and the ring's gradient sums through
    # every codec family (fp8 as e4m3, the variant with more mantissa), the ring also with int4 + feedback
    "charlm": dict(tasks=("charlm",), routes=tuple(ROUTES), seeds=(0, 1, 2), steps={"charlm": 300},
                   codecs={"charlm/ppll-activations": ("none", "int4", "int8", "bf16", "fp8-e4m3", TOPK),
                           "charlm/ring-gradients": ("none", "int4", "int4" + FEEDBACK, "int8", "bf16",
                                                     "fp8-e4m3", TOPK + FEEDBACK)}),
}
# The target for (task, route): at least `ratio` x fewer bytes than float32, final test loss at most
# `loss` x float32's (means over seeds).
TARGET = {("charlm", "ppll-activations"): dict(ratio=4.0, loss=1.02)}


class Run(typing.NamedTuple):
    """One trained run: its row, the bytes each device sends per step (mean over devices) and the
    final test loss and accuracy (`METRICS[task]`)."""

    task: str
    route: str
    codec: str
    seed: int
    sent_bytes: float
    test_loss: float
    test_accuracy: float


def config_of(task: str, route: str, codec: str, seed: int, steps: int):
    from cdpjax import config as config_lib

    method, key, extra = ROUTES[route]
    c = config_lib.load_file(f"{task}:method={method},steps={steps}")
    c.seed, c.eval_every, c.checkpoint_every = seed, 0, 0
    c.update(extra)
    c.compress[key] = codec.removesuffix(FEEDBACK)
    c.compress.feedback = codec.endswith(FEEDBACK)
    return c


def train_one(task: str, route: str, codec: str, seed: int, steps: int) -> Run:
    """Trains one row in this process and evaluates it on the whole test split."""
    import jax

    from cdpjax import bench, loop, setup, tasks

    c = config_of(task, route, codec, seed, steps)
    ds, mesh, m = setup.setup(c, jax.devices()[:DEVICES])
    task_ = tasks.resolve(c, ds)
    state = m.init(jax.random.key(seed))
    for k in range(steps):
        batch = setup.put_batch(ds.train_batch(k, c.global_batch_size, seed, False), mesh, m.input_sharding)
        # one step in flight at a time: with several queued, 4 simulated devices on 2 busy cores
        # deadlocked (the pool's threads held by a later step's permutes, one device's earlier one unrun)
        state = jax.block_until_ready(m.train_step(state, batch)[0])
    if m.flush is not None:
        state = m.flush(state)
    params, model_state = m.export(state)
    metrics = loop.evaluate(loop.make_eval_fn(m.net, task_), params, model_state, ds, 256, task_)
    priced = bench.program_sizes(m, bench.micro_batch(m, c, mesh), task_)
    sent = float(m.program.sent_bytes(priced).mean())
    return Run(task, route, codec, seed, sent, float(metrics["loss"]), float(metrics[METRICS[task]]))


class StepTime(typing.NamedTuple):
    """The lockstep model's step time of a (task, route) through `codec` at each of `bandwidths`
    (bytes/s), as a ratio to the same step with no codec, and the bandwidth below which the codec
    shortens the step (`speedup.break_even_bandwidth`)."""

    task: str
    route: str
    codec: str
    bandwidths: tuple[float, ...]
    step_ratio: tuple[float, ...]
    break_even: float


def step_times(task: str, route: str, codecs, bandwidths, repeats: int = 5) -> list[StepTime]:
    """Each codec's `StepTime` on the route's table (`cdpjax.speedup`'s lockstep replay): stage
    costs measured here, each op alone on one device; each message's encode + decode of its size
    measured here (`speedup.measure_coding`; error feedback's one subtraction not counted)."""
    from cdpjax import speedup

    c = config_of(task, route, "none", 0, 1)
    table, costs = speedup.measured_costs(c, DEVICES, repeats=repeats)
    sizes = speedup.message_sizes(table, costs)
    out = []
    for codec in codecs:
        coding = speedup.measure_coding(codec.removesuffix(FEEDBACK), sizes, repeats)
        ratio = tuple(speedup.lockstep_step_seconds(table, costs, speedup.Link(b, codec.removesuffix(FEEDBACK), coding))
                      / speedup.lockstep_step_seconds(table, costs, speedup.Link(b)) for b in bandwidths)
        even = speedup.break_even_bandwidth(table, costs, codec.removesuffix(FEEDBACK), coding)
        out.append(StepTime(task, route, codec, tuple(bandwidths), ratio, even))
    return out


def step_table_markdown(times: list[StepTime]) -> str:
    """One line per (task, route, codec): the step time through the codec over the step without
    one at each bandwidth, and the bandwidth below which the codec pays for its coding."""
    bandwidths = times[0].bandwidths
    lines = ["| task | route | codec | " + " | ".join(f"step / float32's at {b:.0e} B/s" for b in bandwidths)
             + " | pays below (B/s) |", "|---|---|---|" + "---|" * len(bandwidths) + "---|"]
    for t in times:
        even = ("-" if t.codec == "none" else "never" if t.break_even <= 1.0 else
                "always" if t.break_even >= 1e15 else f"{t.break_even:.1e}")
        lines.append(f"| {t.task} | {t.route} | {t.codec} | " + " | ".join(f"{r:.3f}" for r in t.step_ratio)
                     + f" | {even} |")
    return "\n".join(lines) + "\n"


def spread(values) -> tuple[float, float]:
    values = list(values)
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def table_markdown(runs: list[Run]) -> str:
    """One line per (task, route, codec): bytes per device and step, their ratio to the task and
    route's uncompressed bytes, mean and spread of the final test loss and accuracy over seeds;
    where the issue sets a target (`TARGET`) for one of its (task, route)s, a last column: whether
    the row meets it."""
    groups: dict = {}
    for r in runs:
        groups.setdefault((r.task, r.route, r.codec), []).append(r)
    plain = {(task, route): (statistics.fmean(r.sent_bytes for r in rs), statistics.fmean(r.test_loss for r in rs))
             for (task, route, codec), rs in groups.items() if codec == "none"}
    targeted = any((task, route) in TARGET for task, route, _ in groups)
    lines = ["| task | route | codec | seeds | bytes / device / step | x fewer than float32 | test loss | "
             "test accuracy |" + (" target: >= 4x fewer, loss <= +2% |" if targeted else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|" if targeted else "")]
    for (task, route, codec), rs in groups.items():
        sent = statistics.fmean(r.sent_bytes for r in rs)
        (loss, dl), (acc, da) = spread(r.test_loss for r in rs), spread(r.test_accuracy for r in rs)
        base = plain.get((task, route))
        ratio = base[0] / sent if base and sent else None
        target = TARGET.get((task, route))
        meets = "-"
        if target and ratio is not None and codec != "none":
            met = ratio >= target["ratio"] and loss <= target["loss"] * base[1]
            meets = f"{'yes' if met else 'no'} ({ratio:.2f}x, {100 * (loss / base[1] - 1):+.1f}%)"
        lines.append(f"| {task} | {route} | {codec} | {len(rs)} | {sent:,.0f} | "
                     f"{'-' if ratio is None else f'{ratio:.2f}'} | {loss:.4f} ± {dl:.4f} | {acc:.4f} ± {da:.4f} |"
                     + (f" {meets} |" if targeted else ""))
    return "\n".join(lines) + "\n"


def finished(path: str, grid: dict) -> dict:
    """The runs an earlier call wrote to `path` with the same steps for their task, by (task, route,
    codec, seed)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        record = json.load(f)
    steps = record.get("grid", {}).get("steps", {})
    if not isinstance(steps, dict):  # a record from before the tasks: its runs are not these
        return {}
    return {(r["task"], r["route"], r["codec"], r["seed"]): Run(**r) for r in record["runs"]
            if "task" in r and steps.get(r["task"]) == grid["steps"].get(r["task"])}


def measured(path: str, bandwidths) -> dict:
    """The step-time rows an earlier call wrote to `path` at the same bandwidths, by (task, route, codec)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        stored = [StepTime(**{**t, "bandwidths": tuple(t["bandwidths"]), "step_ratio": tuple(t["step_ratio"])})
                  for t in json.load(f)]
    return {(t.task, t.route, t.codec): t for t in stored if t.bandwidths == tuple(bandwidths)}


def rows(grid: dict):
    """(task, route, codec, seed) of the grid."""
    for task in grid["tasks"]:
        for route in grid["routes"]:
            key = f"{task}/{route}"
            for codec in grid["codecs"][key]:
                for seed in grid.get("route_seeds", {}).get(key, grid["seeds"]):
                    yield task, route, codec, seed


class Chosen(typing.NamedTuple):
    """What a call trains and measures of a grid: the codecs and seeds asked for (None: all), the
    step times' bandwidths and repeats, and whether to measure step times at all."""

    codecs: tuple[str, ...] | None
    seeds: tuple[int, ...] | None
    bandwidths: tuple[float, ...]
    repeats: int
    step_times: bool


def run_grid(grid: dict, out: str, chosen: Chosen) -> tuple[list[Run], list[StepTime]]:
    """Trains the grid's chosen rows that OUT/compression.json lacks and measures the step-time rows
    OUT/steps.json lacks; writes both files (the runs after each one) and their tables (compression.md,
    steps.md). Returns every stored run and step-time row of the grid, in the grid's order."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "compression.json")
    results = finished(path, grid)
    picked = [row for row in rows(grid) if (chosen.codecs is None or row[2] in chosen.codecs)
              and (chosen.seeds is None or row[3] in chosen.seeds)]
    for task, route, codec, seed in picked:
        if (task, route, codec, seed) in results:
            continue
        r = train_one(task, route, codec, seed, grid["steps"][task])
        results[task, route, codec, seed] = r
        print(f"{task} {route} {codec} seed {seed}: {r.sent_bytes:,.0f} bytes/device/step, test loss "
              f"{r.test_loss:.4f}, {METRICS[task]} {r.test_accuracy:.4f}", flush=True)
        with open(path, "w") as f:  # after each run: a call stopped part-way goes on from there
            json.dump({"grid": grid, "runs": [results[row]._asdict() for row in rows(grid) if row in results]},
                      f, indent=1)
    runs = [results[row] for row in rows(grid) if row in results]
    if runs:
        with open(os.path.join(out, "compression.md"), "w") as f:
            f.write(table_markdown(runs))
    steps_path = os.path.join(out, "steps.json")
    times = measured(steps_path, chosen.bandwidths)
    if chosen.step_times:
        for task in grid["tasks"]:
            for route in grid["routes"]:
                missing = [c for c in grid["codecs"][f"{task}/{route}"] if (task, route, c) not in times
                           and (chosen.codecs is None or c in chosen.codecs)]
                if missing:
                    times.update(((t.task, t.route, t.codec), t) for t in
                                 step_times(task, route, missing, chosen.bandwidths, chosen.repeats))
    ordered = [times[task, route, codec] for task in grid["tasks"] for route in grid["routes"]
               for codec in grid["codecs"][f"{task}/{route}"] if (task, route, codec) in times]
    if ordered and chosen.step_times:
        with open(steps_path, "w") as f:
            json.dump([t._asdict() for t in ordered], f, indent=1)
        with open(os.path.join(out, "steps.md"), "w") as f:
            f.write(step_table_markdown(ordered))
    return runs, ordered


MARKED = re.compile(r"(<!-- compression(-steps)?:([\w-]+) -->\n)(.*?)(<!-- /compression -->)", re.DOTALL)


def marked_grids(text: str) -> list[str]:
    """The grids a doc's markers name, in their order, each once."""
    return list(dict.fromkeys(m.group(3) for m in MARKED.finditer(text)))


def fill_doc(text: str, tables: dict[str, str], steps: dict[str, str]) -> str:
    """`text` with each marked table replaced: `tables[grid]` between `<!-- compression:GRID -->` and
    `<!-- /compression -->`, `steps[grid]` between `<!-- compression-steps:GRID -->` and the same end,
    each between blank lines; everything outside the markers as it was."""
    def table(m: re.Match) -> str:
        body = (steps if m.group(2) else tables)[m.group(3)]
        return f"{m.group(1)}\n{body}\n{m.group(5)}"

    return MARKED.sub(table, text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="the CI grid (same as --grid tiny)")
    p.add_argument("--grid", choices=sorted(GRIDS), help="the grid to train (default charlm; not with --doc)")
    p.add_argument("--out", required=True, help="folder for compression.json and compression.md (with --doc: a "
                                                "folder per grid in it)")
    p.add_argument("--doc", metavar="PATH", help="train (resume) every grid PATH's markers name, then rewrite each "
                                                 "marked table of PATH from OUT/GRID's stored results")
    p.add_argument("--bandwidth", type=float, nargs="+", default=(1e8, 1e9, 1e10), metavar="B",
                   help="link bandwidths in bytes/s for the lockstep model's step time per codec (steps.md)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per op for the step times (median)")
    p.add_argument("--codecs", nargs="+", metavar="CODEC",
                   help="train only the grid's rows of these codecs (the rows earlier calls wrote stay in the tables)")
    p.add_argument("--seeds", type=int, nargs="+", metavar="SEED", help="train only the grid's rows of these seeds")
    p.add_argument("--no-step-times", action="store_true", help="train only: no step time measured (with --doc: "
                                                                "the steps tables from the rows stored)")
    args = p.parse_args(argv)
    bad = [b for b in args.bandwidth if not b > 0]
    if bad:
        p.error(f"--bandwidth {bad[0]!r} must be a positive number of bytes/s")
    if args.doc and (args.tiny or args.grid):
        p.error(f"--doc with {'--tiny' if args.tiny else '--grid ' + args.grid}: the doc's markers name its grids "
                "(<!-- compression:GRID -->); drop it")
    text = None
    if args.doc:
        with open(args.doc) as f:
            text = f.read()
        names = marked_grids(text)
        unknown = [g for g in names if g not in GRIDS]
        if unknown or not names:
            p.error(f"--doc {args.doc!r}: marker grid {unknown[0]!r} is not one of {', '.join(sorted(GRIDS))}"
                    if unknown else f"--doc {args.doc!r} has no <!-- compression:GRID --> marker")
        grids = {g: os.path.join(args.out, g) for g in names}
    else:
        grids = {"tiny" if args.tiny else args.grid or "charlm": args.out}
    named = sorted({codec for g in grids for _, _, codec, _ in rows(GRIDS[g])})
    unknown = [c for c in args.codecs or () if c not in named]
    if unknown:
        p.error(f"--codecs {unknown[0]!r} is not a codec of this grid; its codecs: {', '.join(named)}")
    from cdpjax import mesh as mesh_lib

    mesh_lib.setup_devices(DEVICES)  # simulated CPU devices, where JAX has not started yet
    chosen = Chosen(None if args.codecs is None else tuple(args.codecs), None if args.seeds is None
                    else tuple(args.seeds), tuple(args.bandwidth), args.repeats, not args.no_step_times)
    tables, steps = {}, {}
    for g, out in grids.items():
        runs, times = run_grid(GRIDS[g], out, chosen)
        tables[g] = table_markdown(runs) if runs else "(no stored runs)\n"
        steps[g] = step_table_markdown(times) if times else "(no stored step times)\n"
        print(f"wrote {out}/compression.md" + (" and steps.md" if times and chosen.step_times else ""))
    if text is not None:
        filled = fill_doc(text, tables, steps)
        if filled != text:
            with open(args.doc, "w") as f:
                f.write(filled)
        print(f"{args.doc}: {'rewrote its tables' if filled != text else 'unchanged'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
