"""Compressed transfers: bytes per step and final test loss per codec, for ppll's activations and
the CDP ring's gradient sums.

    python experiments/compression.py --tiny --out out/compression_tiny       # CI: a minute
    python experiments/compression.py --grid small --out out/compression      # docs/compression.md's table

Every run trains on digits (`cdpjax/configs/digits.py`: the 4-stage MLP, batch 128) on 4
simulated CPU devices: `ppll` (one module per device, `compress.activations` set to the codec)
or `cdp-v2` on the ring (4 workers, `compress.gradients` set to the codec; `int8+feedback`:
int8 with `compress.feedback`). A row is (route, codec, seed). Bytes per step are the
program's (`Program.sent_bytes`: each `Send` event through its codec, per device and step, mean
over devices; tests/test_compress.py checks that the compiled program's permutes carry them
within 1%); the ratio is over the same run's bytes with no codec. The final test loss and
accuracy are over the whole test split.

Writes OUT/compression.json (every run, after each: a call stopped part-way, as a simulated
device's collective timing out on an overloaded machine, goes on from there when run again) and
OUT/compression.md (mean and sample standard deviation over seeds). Wall times are not
reported: on simulated devices sharing the cores they say nothing about a real link.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import typing

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

DEVICES = 4
CODECS = ("none", "bf16", "fp8-e4m3", "fp8-e5m2", "int8")
FEEDBACK = "+feedback"  # a codec name ending in it: with compress.feedback (gradient routes only)
# route: (method, config key of its messages, extra config)
ROUTES = {"ppll-activations": ("ppll", "activations", {}),
          "ring-gradients": ("cdp-v2", "gradients", {"cdp_impl": "ring", "workers": DEVICES})}
GRIDS = {
    "tiny": dict(routes=tuple(ROUTES), codecs=("none", "int8"), seeds=(0,), steps=10),
    "small": dict(routes=tuple(ROUTES), codecs=(*CODECS, "int8" + FEEDBACK), seeds=(0, 1, 2), steps=200),
}


class Run(typing.NamedTuple):
    """One trained run: its row, the bytes each device sends per step (mean over devices) and the
    final test loss and accuracy."""

    route: str
    codec: str
    seed: int
    sent_bytes: float
    test_loss: float
    test_accuracy: float


def config_of(route: str, codec: str, seed: int, steps: int):
    from cdpjax import config as config_lib

    method, key, extra = ROUTES[route]
    c = config_lib.load_file(f"digits:method={method},steps={steps}")
    c.seed, c.eval_every, c.checkpoint_every = seed, 0, 0
    c.update(extra)
    c.compress[key] = codec.removesuffix(FEEDBACK)
    c.compress.feedback = codec.endswith(FEEDBACK)
    return c


def train_one(route: str, codec: str, seed: int, steps: int) -> Run:
    """Trains one row in this process and evaluates it on the whole test split."""
    import jax
    import numpy as np

    from cdpjax import bench, setup, tasks

    c = config_of(route, codec, seed, steps)
    ds, mesh, m = setup.setup(c, jax.devices()[:DEVICES])
    task = tasks.resolve(c, ds)
    state = m.init(jax.random.key(seed))
    for k in range(steps):
        batch = setup.put_batch(ds.train_batch(k, c.global_batch_size, seed, False), mesh, m.input_sharding)
        state, _ = m.train_step(state, batch)
    if m.flush is not None:
        state = m.flush(state)
    params, model_state = m.export(state)
    net = m.net

    @jax.jit
    def sums(images, labels, mask):
        outputs, _ = net.apply(params, model_state, images, False)
        return task.metric_sums(outputs, labels, mask)

    totals = np.zeros(len(task.sum_names), np.float64)
    for b in ds.test_batches(256):
        totals += np.asarray(jax.device_get(sums(b["image"], b["label"], b["mask"])), np.float64)
    metrics = task.finish(totals)
    priced = bench.program_sizes(m, bench.micro_batch(m, c, mesh), task)
    sent = float(m.program.sent_bytes(priced).mean())
    return Run(route, codec, seed, sent, float(metrics["loss"]), float(metrics["accuracy"]))


def spread(values) -> tuple[float, float]:
    values = list(values)
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def table_markdown(runs: list[Run]) -> str:
    """One line per (route, codec): bytes per device and step, their ratio to the route's
    uncompressed bytes, mean and spread of the final test loss and accuracy over seeds."""
    groups: dict = {}
    for r in runs:
        groups.setdefault((r.route, r.codec), []).append(r)
    plain = {route: statistics.fmean(r.sent_bytes for r in rs) for (route, codec), rs in groups.items()
             if codec == "none"}
    lines = ["| route | codec | seeds | bytes / device / step | x fewer than float32 | test loss | test accuracy |",
             "|---|---|---|---|---|---|---|"]
    for (route, codec), rs in groups.items():
        sent = statistics.fmean(r.sent_bytes for r in rs)
        (loss, dl), (acc, da) = spread(r.test_loss for r in rs), spread(r.test_accuracy for r in rs)
        ratio = f"{plain[route] / sent:.2f}" if route in plain and sent else "-"
        lines.append(f"| {route} | {codec} | {len(rs)} | {sent:,.0f} | {ratio} | {loss:.4f} ± {dl:.4f} | "
                     f"{acc:.4f} ± {da:.4f} |")
    return "\n".join(lines) + "\n"


def finished(path: str, grid: dict) -> dict:
    """The runs an earlier call of the same grid wrote to `path`, by (route, codec, seed)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        record = json.load(f)
    if record.get("grid", {}).get("steps") != grid["steps"]:
        return {}
    return {(r["route"], r["codec"], r["seed"]): Run(**r) for r in record["runs"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="the CI grid (same as --grid tiny)")
    p.add_argument("--grid", choices=sorted(GRIDS), default="small")
    p.add_argument("--out", required=True, help="folder for compression.json and compression.md")
    args = p.parse_args(argv)
    grid = GRIDS["tiny" if args.tiny else args.grid]
    from cdpjax import mesh as mesh_lib

    mesh_lib.setup_devices(DEVICES)  # simulated CPU devices, where JAX has not started yet
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "compression.json")
    done = finished(path, grid)
    runs = []
    for route in grid["routes"]:
        for codec in grid["codecs"]:
            if codec.endswith(FEEDBACK) and ROUTES[route][1] != "gradients":
                continue
            for seed in grid["seeds"]:
                r = done.get((route, codec, seed)) or train_one(route, codec, seed, grid["steps"])
                runs.append(r)
                print(f"{route} {codec} seed {seed}: {r.sent_bytes:,.0f} bytes/device/step, test loss "
                      f"{r.test_loss:.4f}, accuracy {r.test_accuracy:.4f}", flush=True)
                with open(path, "w") as f:  # after each run: a call stopped part-way goes on from there
                    json.dump({"grid": grid, "runs": [r._asdict() for r in runs]}, f, indent=1)
                with open(os.path.join(args.out, "compression.md"), "w") as f:
                    f.write(table_markdown(runs))
    print(f"wrote {args.out}/compression.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
