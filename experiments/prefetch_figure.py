"""The input pipeline, measured: images/s of `dp` on an input-bound configuration with batches
prefetched (`cdpjax.data.prefetch`: a background thread reads, augments and puts each batch on
the devices, 2 ahead) against without (each batch read, augmented and put in the training
thread, before its step), and the fraction of the timed steps spent waiting for a batch.

    python experiments/prefetch_figure.py --repeats 3

The configuration: synthetic 32x32x3 images (each drawn from its own generator: a read that
costs what decoding costs) with the CIFAR recipe's random crop and flip, a 2-layer MLP of
width 64, a global batch of 512, on 2 simulated CPU devices. The two settings alternate, fresh
work directories each; medians over `repeats` runs; ratios only.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args(argv)
    from cdpjax.mesh import setup_devices

    setup_devices(args.devices)
    from cdpjax import data, train
    from cdpjax.config import default_config
    from cdpjax.data import prefetch
    from cdpjax.data.base import random_crop_flip
    from cdpjax.data.synthetic import synthetic

    def augmented(image_shape=(32, 32, 3), num_classes: int = 10, num_train: int = 4096, num_test: int = 512):
        return dataclasses.replace(synthetic(image_shape, num_classes, num_train, num_test),
                                   name="synthetic_augmented", augment=random_crop_flip)

    data.REGISTRY.add("synthetic_augmented", augmented)
    c = default_config()
    c.method, c.model, c.dataset = "dp", "mlp", "synthetic_augmented"
    c.dataset_kwargs = {"image_shape": (32, 32, 3), "num_classes": 10, "num_train": 8192}
    c.model_kwargs = {"width": 64, "depth": 2}
    c.stages, c.global_batch_size, c.num_steps = 2, 512, args.steps
    c.log_every, c.eval_every, c.checkpoint_every = args.steps, 0, 0
    results = {2: [], 0: []}
    with tempfile.TemporaryDirectory(prefix="cdpjax-prefetch-figure-") as root:
        for r in range(args.repeats):
            for depth in (2, 0):
                prefetch.DEPTH = depth
                s = train.train(c, os.path.join(root, f"{depth}-{r}"), progress=False)
                results[depth].append((s["images_per_second"], s["input_wait_fraction"]))
                print(f"  depth {depth}: {s['images_per_second']:.0f} images/s, input wait "
                      f"{s['input_wait_fraction']:.1%}", file=sys.stderr)
    ips = {d: statistics.median(x[0] for x in v) for d, v in results.items()}
    wait = {d: statistics.median(x[1] for x in v) for d, v in results.items()}
    print(f"prefetch 2 / none: images/s {ips[2] / ips[0]:.2f}x; input wait {wait[2]:.1%} of the step with "
          f"prefetch, {wait[0]:.1%} without (medians of {args.repeats} runs each)")


if __name__ == "__main__":
    main()
