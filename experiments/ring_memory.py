"""The ring's memory per device against dp's as the device count grows, and where it goes.

    python experiments/ring_memory.py --devices 2,4,8,16,32 --stages 16

For each device count D (its own process: the simulated CPU devices are fixed at start), the
digits MLP cut into `stages` stages, global batch 2 D: dp on D devices; cdp-v2 as one ring of D
workers; and cdp-v2 as rings of `--rings` workers side by side (D / ring rings, their completed
sums added over the rings once per stage and step). Per method XLA's compiled memory analysis of
the step as the trainer runs it (the state donated: `held` = arguments + temporaries), and for the
rings the gradient buffers the ring's program declares: those carried between calls (`between`,
in XLA's arguments) and the most alive at once within a call (`within`, in its temporaries), in
units of the model's parameters, beside the most one worker needs at once (`worker_needs`): the least
each worker's pool (`cdpjax.program.ring.RingPool`, the buffer the program declares) can be. Compiled
only: memory analysis does not move with load.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

MIB = 2 ** 20


def worker_needs(program, stage_bytes: list[float], periods: int = 8) -> float:
    """The most gradient-buffer bytes one worker needs at once: each (sum, worker) from its first
    access by that worker to its last (the ring's events over `periods` periods, a buffer's step
    its period minus its lag; the middle periods, steady state). The SPMD program allocates every
    buffer any worker needs at a tick on every device: the union, which grows with the ring."""
    from cdpjax.program.ring import accesses, program_period

    T, N = program.period, program.devices
    spans: dict = {}
    period = program_period(program).ticks  # the ring's period, as its engine reads it from the events
    for per in range(periods):
        for t, tk in enumerate(period):
            for (kind, j, lag), w, _ in accesses(tk):
                key, at = (kind, j, per - lag, w), per * T + t
                lo, hi = spans.get(key, (at, at))
                spans[key] = (min(lo, at), max(hi, at))
    held = [[0.0] * N for _ in range(periods * T)]
    for (_, j, _, w), (lo, hi) in spans.items():
        for at in range(lo, hi + 1):
            held[at][w] += stage_bytes[j]
    return max(max(row) for row in held[2 * T:(periods - 2) * T])


def one(devices: int, stages: int, rings: list[int], single: bool = True) -> list[dict]:
    from cdpjax import mesh as mesh_lib

    mesh_lib.setup_devices(devices)
    import jax

    from cdpjax import bench
    from cdpjax.config import default_config

    rows = []
    runs = [("dp", {})] + ([("cdp-v2", {"workers": devices})] if single else [])
    runs += [("cdp-v2", {"workers": n}) for n in rings if n < devices]
    for method, extra in runs:
        c = default_config()
        c.method, c.stages = method, stages
        c.model_kwargs.depth = stages - 1  # the mlp: a stage per block
        c.global_batch_size = 2 * devices
        c.eval_every = c.checkpoint_every = 0
        for k, v in extra.items():
            c[k] = v
        run = bench._prepare(c, jax.devices()[:devices])
        m = run["method"]
        mem = bench.memory(run["compiled"])
        params = bench.tree_bytes(m.export(run["state"])[0])
        row = {"devices": devices, "method": method, "workers": m.workers or devices,
               "rings": (m.report or {}).get("rings", 1), "held_mib": mem["held_bytes"] / MIB,
               "arguments_mib": mem["argument_bytes"] / MIB, "temporaries_mib": mem["temp_bytes"] / MIB,
               "model_mib": params / MIB}
        if m.program is not None:
            sizes = bench.program_sizes(m, bench.micro_batch(m, c, run["mesh"]), run["task"])
            held = m.program.held("gradients", sizes)
            row["gradients_between_models"] = held[0] / params
            row["gradients_within_models"] = max(held) / params
            row["worker_needs_models"] = worker_needs(m.program, sizes["param"]) / params
        rows.append(row)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="2,4,8,16,32")
    parser.add_argument("--stages", type=int, default=16)
    parser.add_argument("--rings", default="4,8", help="workers per ring of the rows with rings side by side")
    parser.add_argument("--no-single", action="store_true", help="leave out the one ring of every device")
    parser.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one, args.stages, [int(n) for n in args.rings.split(",")], not args.no_single)))
        return
    print("| devices | method | workers x rings | held MiB | x dp | args MiB | temps MiB | model MiB "
          "| sums between calls (models) | sums in a call, peak (models) | sums one worker needs (models) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for d in (int(x) for x in args.devices.split(",")):
        single = ["--no-single"] if args.no_single else []
        done = subprocess.run([sys.executable, __file__, "--one", str(d), "--stages", str(args.stages), "--rings",
                               args.rings, *single], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(done.stderr[-3000:])
        rows = json.loads(done.stdout.strip().splitlines()[-1])
        dp = rows[0]["held_mib"]
        for r in rows:
            print(f"| {d} | {r['method']} | {r['workers']} x {r['rings']} | {r['held_mib']:.2f} | "
                  f"{r['held_mib'] / dp:.2f} | {r['arguments_mib']:.2f} | {r['temporaries_mib']:.2f} | "
                  f"{r['model_mib']:.2f} | {r.get('gradients_between_models', 0):.2f} | "
                  f"{r.get('gradients_within_models', 0):.2f} | {r.get('worker_needs_models', 0):.2f} |", flush=True)


if __name__ == "__main__":
    main()
