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
import os
import sys

os.environ.setdefault("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"


def main(argv=None) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_threefry_partitionable", True)
    from cdpjax.layouts import LAYOUTS
    from cdpjax.plan import held_and_predicted, memory_cases

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,resnet_tiny")
    parser.add_argument("--devices", default="2,4,8")
    parser.add_argument("--methods", default=",".join(LAYOUTS))
    args = parser.parse_args(argv)
    print("| model | devices | method | XLA held MiB | predicted MiB | predicted / XLA |\n|---|---|---|---|---|---|")
    off = []
    for case in memory_cases(args.models.split(","), tuple(map(int, args.devices.split(","))),
                             args.methods.split(",")):
        if case.left_out:
            continue
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            held, predicted = held_and_predicted(case)
        ratio = predicted / held
        mib = f"{held / 2**20:.3f} | {predicted / 2**20:.3f}"
        print(f"| {case.model} | {case.devices} | {case.method} | {mib} | {ratio:.3f} |", flush=True)
        if abs(ratio - 1) > 0.05:
            off.append(f'("{case.model}", {case.devices}, "{case.method}"): {ratio:.3f}')
    print(f"\noff by more than 5% ({len(off)}), as tests/test_plan.py's MEASURED:", file=sys.stderr)
    print(", ".join(off), file=sys.stderr)


if __name__ == "__main__":
    main()
