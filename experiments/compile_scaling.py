"""Compile time against the ring size: lowering, compile and HLO size of each method's train
step at N simulated devices, each point in its own process (`--xla_force_host_platform_device_count`).

    python experiments/compile_scaling.py --devices 2,4,8,16,32,64 --stages 4,N
    python experiments/compile_scaling.py --lowering 32,64,128  # cdp-v2's table and ring program at N = L
    python experiments/compile_scaling.py --methods dp,cdp-zero,cdp-zero@zero_period=scan --devices 2,4,8
    python experiments/compile_scaling.py --methods dp,cdp-zero@zero_period=scan --devices 8,16,32,64 --stages 32

A method may be a variant, METHOD@KEY=VALUE (as `cdpjax bench --methods` takes).

Digits and its MLP (a stage per block: depth L - 1 where L > 4), 8 N examples a step. Per
point: `lowering`, the seconds from the config to the traced program (the method built: its
table, the lowered program, its pieces; then `jit(train_step).lower`; the data loaded and
the state initialised apart); `compile`, XLA's
compile of it; `hlo`, the compiled program's instructions (every `name = op(...)` line).
Times are printed as ratios to dp's at the same N and L (absolute CPU seconds depend on the
machine and its load), dp measured again right after each point, so that a ratio's two times
share the load of one moment (a shared machine's load drifts over the minutes between a row's
points; `--dp-once`: the ratios to the dp row's own points instead); a point that fails, is
refused or runs past `--timeout` says so.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

METHODS = "dp,cdp-v2,cdp-zero,cdp-zero@zero_period=scan,cdp-mp,1f1b,zb-h1,ppll"


def instructions(hlo: str) -> int:
    """Instructions of compiled HLO text: every `name = op(...)` line of every computation."""
    return sum(1 for line in hlo.splitlines() if re.match(r"^\s+(ROOT )?%?\S+ = ", line))


def point(method: str, devices: int, stages: int) -> dict:
    """One measurement, in this process (its device count set by the parent)."""
    import jax

    from cdpjax import layouts, methods, setup, tasks
    from cdpjax.bench import variant_config
    from cdpjax.config import default_config
    from cdpjax.mesh import make_mesh
    from cdpjax.methods.common import Context

    c = variant_config(default_config(), method)  # METHOD or METHOD@KEY=VALUE (cdp-zero@zero_period=scan)
    c.stages, c.global_batch_size = stages, 8 * devices
    c.eval_every = c.checkpoint_every = 0
    if stages > 4:
        c.model_kwargs.depth = stages - 1
    dataset = setup.setup(c)[0]  # validated and the data loaded; the method built again below, timed
    t0 = time.perf_counter()
    mesh = make_mesh(layouts.mesh_for(c), None)
    m = methods.build(Context(c, mesh, tuple(dataset.image_shape), dataset.num_classes, dataset.input_dtype,
                              tasks.resolve(c, dataset)))
    t1 = time.perf_counter()
    state = m.init(jax.random.key(0))  # compiled and run apart: not the step's lowering
    batch = setup.put_batch(dataset.train_batch(0, c.global_batch_size, 0, False), mesh, m.input_sharding)
    t2 = time.perf_counter()
    lowered = jax.jit(m.train_step).lower(state, batch)
    t3 = time.perf_counter()
    compiled = lowered.compile()
    t4 = time.perf_counter()
    return {"build_s": t1 - t0, "lowering_s": (t1 - t0) + (t3 - t2), "compile_s": t4 - t3,
            "hlo": instructions(compiled.as_text())}


def lowering_only(n: int) -> dict:
    """cdp-v2's table at N = L = n and its ring program with the period and routing the engine
    compiles from the program's events (Python only, no devices): wall and this process's CPU
    seconds (the load of other processes inflates the first far more)."""
    from cdpjax.layouts.cdp import cdp_table
    from cdpjax.program.ring import lower_ring, program_period, ring_routing

    w0, c0 = time.perf_counter(), time.process_time()
    table = cdp_table("cdp-v2", n, n)
    w1, c1 = time.perf_counter(), time.process_time()
    ring_routing(program_period(lower_ring(table)))
    w2, c2 = time.perf_counter(), time.process_time()
    return {"table_s": w1 - w0, "program_s": w2 - w1, "table_cpu_s": c1 - c0, "program_cpu_s": c2 - c1,
            "ops": len(table.ops)}


def lowering_rows(sizes: list[int]) -> list[str]:
    """One line per N = L (each in its own process): its ops, then its table's and program's
    times as ratios to the first size's (the growth against the ops' growth), wall and CPU."""
    rows, first = [], None
    for n in sizes:
        done = subprocess.run([sys.executable, __file__, "--lowering-point", str(n)], capture_output=True,
                              text=True, check=True)
        rec = json.loads(done.stdout.strip().splitlines()[-1])
        first = first or rec
        wall = (rec["table_s"] + rec["program_s"]) / (first["table_s"] + first["program_s"])
        cpu = (rec["table_cpu_s"] + rec["program_cpu_s"]) / (first["table_cpu_s"] + first["program_cpu_s"])
        rows.append(f"| {n} | {rec['ops']:,} ({rec['ops'] / first['ops']:.0f}x) | {wall:.1f}x | {cpu:.1f}x | "
                    f"{rec['table_cpu_s'] / rec['program_cpu_s']:.1f} |")
    return rows


def run_point(method: str, devices: int, stages: int, timeout: float) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}")
    cmd = [sys.executable, __file__, "--point", f"{method},{devices},{stages}"]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout:.0f} s"}
    if done.returncode != 0:
        lines = [x for x in done.stderr.strip().splitlines() if x.strip()]
        last = lines[-1] if lines else f"exit {done.returncode}"
        if "does not divide" in last:
            return {"error": "refused (N does not divide the period)"}
        if "cannot be split" in last:
            return {"error": "refused (fewer devices than stages)"}
        return {"error": ("refused: " + last.split(": ", 1)[-1] if "Error" in last else last)[:100]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def cell(rec: dict, dp: dict | None) -> str:
    if "error" in rec:
        return rec["error"]
    if not dp or "error" in dp:
        return f"{rec['hlo']:,}"
    return (f"{rec['hlo']:,} / {rec['lowering_s'] / dp['lowering_s']:.1f}x / "
            f"{rec['compile_s'] / dp['compile_s']:.1f}x")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=METHODS)
    parser.add_argument("--devices", default="2,4,8,16,32,64")
    parser.add_argument("--stages", default="4,N", help="stage counts; N: as many as devices")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per point")
    parser.add_argument("--json", default="", help="also write every record here")
    parser.add_argument("--dp-once", action="store_true", help="ratios to the dp row's points, not to dp measured "
                                                               "again right after each point")
    parser.add_argument("--point", default="", help=argparse.SUPPRESS)
    parser.add_argument("--lowering", default="", help="only time cdp-v2's table and program at N = L (sizes, "
                                                       "comma-separated)")
    parser.add_argument("--lowering-point", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.point:
        method, devices, stages = args.point.split(",")
        print(json.dumps(point(method, int(devices), int(stages))))
        return
    if args.lowering_point:
        print(json.dumps(lowering_only(args.lowering_point)))
        return
    if args.lowering:
        print("| N = L | ops (x first) | wall x first | CPU x first | table / program (CPU) |")
        print("|---|---|---|---|---|")
        for row in lowering_rows([int(n) for n in args.lowering.split(",")]):
            print(row, flush=True)
        return
    methods, devices = args.methods.split(","), [int(d) for d in args.devices.split(",")]
    records = []
    for spec in args.stages.split(","):
        print(f"\nL = {spec}: HLO instructions / lowering vs dp / compile vs dp", flush=True)
        print("| method | " + " | ".join(f"N = {n}" for n in devices) + " |")
        print("|---" * (len(devices) + 1) + "|", flush=True)
        dp = {}
        for method in methods:
            cells = []
            for n in devices:
                stages = n if spec == "N" else int(spec)
                rec = run_point(method, n, stages, args.timeout)
                if method == "dp":
                    dp[n] = rec
                elif "error" not in rec and not args.dp_once:  # the same moment's load as the point's
                    rec["dp_beside"] = run_point("dp", n, stages, args.timeout)
                records.append({"method": method, "devices": n, "stages": stages, **rec})
                cells.append(cell(rec, None if method == "dp" else rec.get("dp_beside", dp.get(n))))
                print(f"  {method} N={n} L={stages}: {rec}", file=sys.stderr, flush=True)
            print(f"| {method} | " + " | ".join(cells) + " |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
