"""ImageNet, ResNet-18 / ResNet-50 (ImageNet stem), DP / CDP-v1 / CDP-v2.

Reproduces the ImageNet rows of Cyclic Data Parallelism (arXiv 2403.08837) with
the recipe of the paper's public code: 8 workers, 32 images per worker (global
256), SGD momentum 0.9, lr 0.1, weight decay 1e-4, step decay x0.1 every 30
epochs, 91 epochs, 4 stages balanced by FLOPs, random resized crop 224 and flip.

    cdpjax train --config cdp_imagenet:model=resnet50,method=cdp-v1

BatchNorm per worker for DP as for CDP, and the staleness rule (the authors' released
`rule=paper-code` by default, on the ring; `rule=cdp-v2` for the table's rule): as in
`cdp_cifar10.py`, whose docstring says why.

Hardware: 8 GPUs. Expected top-1: about 70% (ResNet-18), 76% (ResNet-50), CDP
within noise of DP. Needs imagenet2012 prepared for tensorflow-datasets (manual download).
"""
from cdpjax.config import default_config, parse_arg

STEPS_PER_EPOCH = 1_281_167 // 256 + 1


def get_config(arg=None):
    a = parse_arg(arg, model="resnet18", method="cdp-v2", impl="ring", rule="paper-code", epochs=91)
    c = default_config()
    c.method, c.model, c.dataset = a["method"], a["model"], "imagenet2012"
    c.model_kwargs = {"stem": "imagenet"}
    c.norm = "batch"
    c.bn_cross_device = False  # DP as the paper's code runs it: BatchNorm statistics per worker, as CDP's
    c.global_batch_size = 256
    c.workers = 8
    c.mesh = {"data": 8}
    c.cdp_impl = a["impl"]
    c.cdp_rule = a["rule"]
    c.stages = 4
    c.partition = "flops"
    c.optimizer, c.learning_rate, c.momentum, c.weight_decay = "sgd", 0.1, 0.9, 1e-4
    c.schedule, c.decay_every, c.decay_factor = "step", 30 * STEPS_PER_EPOCH, 0.1
    c.num_steps = a["epochs"] * STEPS_PER_EPOCH
    c.eval_every = c.checkpoint_every = STEPS_PER_EPOCH
    c.log_every = 100
    return c
