"""The persistent compilation cache, measured: `cdpjax train` started cold (an empty cache) and
warm (the same command again, the cache filled by the cold run), in alternation.

    python experiments/compile_cache.py --methods dp,gpipe --repeats 3

Per method, the medians over `repeats` pairs of: the seconds of the first step (compiling it,
or reading it from the cache, and running it: the `compiled ... in X s` line) and of the whole
command (set-up, data, compile, 20 steps, evaluation); then the cold / warm ratios. Each cold
run gets an empty cache directory; every run a fresh work directory. Ratios only: absolute
times depend on the machine and its load.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

FIRST_STEP = re.compile(r"compiled \S+ and ran its first step in ([0-9.]+) s")


def one_run(method: str, cache: str, workdir: str, steps: int) -> tuple[float, float]:
    """(first-step seconds, command seconds) of one `cdpjax train`."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "cdpjax.cli", "train", "--no-progress", "--workdir", workdir,
                           "--compilation-cache", cache, f"--config.method={method}", f"--config.num_steps={steps}",
                           "--config.eval_every=0", "--config.checkpoint_every=0"],
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(done.stderr[-2000:])
    return float(FIRST_STEP.search(done.stderr).group(1)), wall


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="dp,gpipe")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cdpjax-cache-figure-") as root:
        for method in args.methods.split(","):
            cold, warm = [], []
            for r in range(args.repeats):
                cache = os.path.join(root, f"{method}-{r}-xla")
                cold.append(one_run(method, cache, os.path.join(root, f"{method}-{r}-cold"), args.steps))
                warm.append(one_run(method, cache, os.path.join(root, f"{method}-{r}-warm"), args.steps))
            first = [statistics.median(x[0] for x in runs) for runs in (cold, warm)]
            whole = [statistics.median(x[1] for x in runs) for runs in (cold, warm)]
            print(f"{method}: first step cold/warm {first[0] / first[1]:.2f}x, whole command cold/warm "
                  f"{whole[0] / whole[1]:.2f}x (medians of {args.repeats} pairs)")


if __name__ == "__main__":
    main()
