"""Benchmark: ResNet-18 of CIFAR shape (32x32x3, 10 classes) on synthetic data, 4 stages.

The CDP bench of the README: N = L = 4 workers and stages on 4 devices,
global batch 32 (8 images per worker), split points [3, 6, 8]: the gradient
sizes of the stages set CDP's comm balance (FLOPs-balanced cut (3, 5, 7): 3.07,
params-balanced (7, 8, 9): 2.02, this cut: 1.87, at FLOPs imbalance 1.46).

    cdpjax bench --config experiments/configs/bench_resnet18.py --methods dp,cdp-v1,cdp-v2 --cpu-devices 4

Expected (from the time table, any hardware): CDP's total activation peak at
most 0.55 of DP's (0.50), comm balance of CDP at most 2 (DP: 8), no model-sized
all-reduce in the ring's HLO. `--config.model_kwargs.width=0.25` shrinks it for
quick runs.
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
