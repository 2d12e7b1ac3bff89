"""Benchmark: ResNet-18 of CIFAR shape (32x32x3, 10 classes) on synthetic data, 4 stages.

The CDP bench of docs/measured.md: N = L = 4 workers and stages on 4 devices,
global batch 32 (8 images per worker), split points [3, 6, 8]: the gradient
sizes of the stages set CDP's comm balance (this cut: 1.88 at FLOPs imbalance
1.46), BatchNorm statistics per worker for dp as for CDP (the paper's code).

    cdpjax bench --config bench_resnet18 --cpu-devices 4 --repeats 10 \
      --methods dp,cdp-v2,cdp-v2@cdp_ticks=paired@residuals=carry,cdp-zero,cdp-mp

Expected (docs/measured.md): the cdp-v2 ring sends dp's bytes per worker per
step (1.00x), no collective-permute larger than its largest stage (18.5 MiB),
FLOPs 1.33x dp's (recomputed backwards; 1.00x with `residuals=carry`), arguments
1.77x dp's and 1.06x dp's memory held per device (the state donated), step about
2x dp's at 2 devices (paired forwards with kept residuals: 1.1x to 1.35x); cdp-zero
sends 1.29x dp's bytes and holds 0.66x dp's memory (each worker keeps 1/N of every
stage); the table's activation peak in bytes is 0.86 of dp's (the unit model: 0.50). `--config.model_kwargs.width=0.25`
shrinks it for quick runs.
"""
from cdpjax.config import default_config, parse_arg


def get_config(arg=None):
    a = parse_arg(arg, model="resnet18", batch=32, stages=[3, 6, 8])
    c = default_config()
    c.model, c.dataset = a["model"], "synthetic"
    c.dataset_kwargs = {"image_shape": (32, 32, 3), "num_classes": 10}
    c.model_kwargs = {"stem": "cifar", "width": 1.0}
    c.norm = "batch"
    c.bn_cross_device = False  # DP with per-worker BatchNorm, as CDP's (the paper's code)
    c.global_batch_size = a["batch"]
    c.stages = a["stages"]
    c.mesh = {"data": -1}
    c.cdp_impl = "ring"
    c.num_steps = 10
    return c
