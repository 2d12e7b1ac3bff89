"""Train the own-model example from Python: cdp-v2, then ppll.

    python experiments/own_model/train_from_python.py [--steps 300] [--methods cdp-v2,ppll] [--out workdirs/own_model]

The config file is loaded as the command line loads it (`cdpjax.config.load_file`, which
makes its folder importable), then `cdpjax.train.train` runs it on the devices its
method's mesh needs. On a machine without GPUs 8 CPU devices are simulated.
"""
from __future__ import annotations

import argparse
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def run(method: str, steps: int, workdir: str, devices=None, progress: bool = True) -> dict:
    """Trains the example with `method` for `steps` steps in `workdir`; returns the run's summary.
    `devices`: the devices to run on (default: the first ones the method's mesh needs)."""
    import jax

    from cdpjax import config as cfg_lib, layouts, train

    config = cfg_lib.load_file(f"{os.path.join(HERE, 'config.py')}:method={method},steps={steps}")
    if devices is None:
        n = layouts.devices_needed(config)
        devices = jax.devices()[:n] if n else None
    return train.train(config, workdir, progress=progress, devices=devices)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--methods", default="cdp-v2,ppll")
    parser.add_argument("--out", default=os.path.join("workdirs", "own_model"))
    args = parser.parse_args(argv)
    from cdpjax.mesh import setup_devices

    setup_devices(8)  # before JAX starts: simulated CPU devices where there is no accelerator
    for method in args.methods.split(","):
        summary = run(method, args.steps, os.path.join(args.out, method))
        print(f"{method}: test accuracy {summary['test_accuracy']:.4f} after {summary['steps']} steps "
              f"on {summary['devices']} device(s)")


if __name__ == "__main__":
    main()
