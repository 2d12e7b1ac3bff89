"""CIFAR-10, ResNet-18 / ResNet-50 (3x3 stride-1 stem, no max-pool), DP / CDP-v1 / CDP-v2.

Reproduces the CIFAR-10 rows of Cyclic Data Parallelism (Fournier and Oyallon,
arXiv 2403.08837) with the recipe of the paper's public code: 8 workers, 64
images per worker (global 512), SGD momentum 0.9, lr 0.05, weight decay 5e-4,
step decay x0.2 every 30 epochs, 101 epochs, 4 stages balanced by FLOPs,
random crop (pad 4) and flip.

    cdpjax train --config cdp_cifar10:model=resnet18,method=cdp-v2

BatchNorm: statistics per worker for DP as for CDP (the paper's code; the cross-device
variant: `--config.bn_cross_device=True`). Rule: the authors' released rule by default
(`rule=paper-code`: worker i reads stage j's current version iff j >= L-1-i, 6 of the 32
(worker, stage) pairs stale at N = 8, L = 4), the rule the paper's 8-GPU runs used. Its
reads at N = 8 > L need a step of 16 ticks, not 8 (each step ends with 8 idle ticks, the
workers 2 ticks apart as at N = L), which the ring runs (`cdpjax schedule --method cdp-v2
--rule paper-code --workers 8`); `impl=simulate` gives the same parameters in one program.
`rule=cdp-v2` is the table's rule at 8 ticks a step (the version each forward finds: 16
of 32 pairs stale).

Hardware: 8 GPUs (mesh data=8); any number of devices with cdp_impl='simulate'.
Expected: about 95% test accuracy for ResNet-18 (and ResNet-50), CDP-v1 and
CDP-v2 within noise of DP. Needs CIFAR-10 prepared for tensorflow-datasets.
"""
from cdpjax.config import default_config, parse_arg

STEPS_PER_EPOCH = 50_000 // 512 + 1


def get_config(arg=None):
    a = parse_arg(arg, model="resnet18", method="cdp-v2", impl="ring", rule="paper-code", epochs=101)
    c = default_config()
    c.method, c.model, c.dataset = a["method"], a["model"], "cifar10"
    c.model_kwargs = {"stem": "cifar"}
    c.norm = "batch"
    c.bn_cross_device = False  # DP as the paper's code runs it: BatchNorm statistics per worker, as CDP's
    c.global_batch_size = 512
    c.workers = 8
    c.mesh = {"data": 8}
    c.cdp_impl = a["impl"]
    c.cdp_rule = a["rule"]
    c.stages = 4
    c.partition = "flops"
    c.optimizer, c.learning_rate, c.momentum, c.weight_decay = "sgd", 0.05, 0.9, 5e-4
    c.schedule, c.decay_every, c.decay_factor = "step", 30 * STEPS_PER_EPOCH, 0.2
    c.num_steps = a["epochs"] * STEPS_PER_EPOCH
    c.eval_every = 5 * STEPS_PER_EPOCH
    c.checkpoint_every = 5 * STEPS_PER_EPOCH
    c.log_every = 50
    return c
