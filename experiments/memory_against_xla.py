"""The memory model against XLA: for every registered method on the digits MLP and `resnet_tiny` at
2, 4 and 8 simulated CPU devices, `bench.memory_model`'s prediction (arguments + temporaries) over
XLA's held bytes per device of the compiled, donated step (`bench.memory`), the figures that
docs/plan.md quotes and `tests/test_plan.py` records (`MEASURED`: the cases off by more than 5%).

    python experiments/memory_against_xla.py                      # the whole grid (minutes on CPU)
    python experiments/memory_against_xla.py --models mlp --devices 4 --methods gpipe,dp

Compiled as the tests compile (8 simulated devices, LLVM unoptimised: the same HLO and buffers).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import sys

os.environ.setdefault("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"


def case(model: str, devices: int, method: str):
    """(XLA's held bytes, the prediction) per device, or None where the grid leaves the case out (a
    one-device method measured at 2 only; a stage count whose devices do not divide `devices`)."""
    import jax

    from cdpjax import bench, speedup
    from cdpjax.config import default_config
    from cdpjax.layouts import LAYOUTS

    c = default_config()
    c.method, c.model, c.stages = method, model, 4
    layout = LAYOUTS[method]
    if layout.device_axis == "data":
        c.mesh.data = devices
    elif layout.device_axis is None and devices != 2:
        return None
    elif layout.device_axis == "stage":
        s = layout.default_mesh(c)["stage"]
        if devices % s:
            return None
        c.mesh.stage, c.mesh.data = s, devices // s
    n = math.prod(dict(c.mesh).values()) if dict(c.mesh) else 1
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        run = bench._prepare(c, jax.devices()[:n])
    m = run["method"]
    table = m.table if m.table is not None or layout.table is None else speedup.table_for(c, n, m.net.num_stages)
    micro = bench.micro_batch(m, c, run["mesh"])
    model_ = bench.memory_model(m, c, table, bench.stage_sizes(m.net, micro), n,
                                bench.program_sizes(m, micro, run["task"]))
    return bench.memory(run["compiled"])["held_bytes"], model_["arguments"]["total"] + model_["temporaries"]["total"]


def main(argv=None) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_threefry_partitionable", True)
    from cdpjax.layouts import LAYOUTS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,resnet_tiny")
    parser.add_argument("--devices", default="2,4,8")
    parser.add_argument("--methods", default=",".join(LAYOUTS))
    args = parser.parse_args(argv)
    print("| model | devices | method | XLA held MiB | predicted MiB | predicted / XLA |\n|---|---|---|---|---|---|")
    off = []
    for model in args.models.split(","):
        for devices in map(int, args.devices.split(",")):
            for method in args.methods.split(","):
                found = case(model, devices, method)
                if found is None:
                    continue
                held, predicted = found
                ratio = predicted / held
                mib = f"{held / 2**20:.3f} | {predicted / 2**20:.3f}"
                print(f"| {model} | {devices} | {method} | {mib} | {ratio:.3f} |", flush=True)
                if abs(ratio - 1) > 0.05:
                    off.append(f'("{model}", {devices}, "{method}"): {ratio:.3f}')
    print(f"\noff by more than 5% ({len(off)}), as tests/test_plan.py's MEASURED:", file=sys.stderr)
    print(", ".join(off), file=sys.stderr)


if __name__ == "__main__":
    main()
