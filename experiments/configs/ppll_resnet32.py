"""ResNet-32 with K local modules: e2e / local / ppll / gpipe on CIFAR-10 or SVHN or STL-10.

Reproduces the ResNet rows of PPLL (Guo et al., arXiv 2411.12780) with the
recipe of its public code: batch 1024, SGD Nesterov momentum 0.9, weight decay
1e-4, cosine learning rate with peak 0.8 and 10 warm-up epochs, 400 epochs,
crop + flip, InfoPro auxiliary heads, InfoPro's split points for K = 2, 4, 8, 16.

    cdpjax train --config experiments/configs/ppll_resnet32.py:K=4,method=ppll

Hardware: K GPUs for ppll / gpipe (mesh stage=K); one for e2e / local.
Expected CIFAR-10 test error (InfoPro Table 2, softmax heads): e2e 7.37%;
local/ppll K=2 8.13, K=4 8.64, K=8 11.40, K=16 14.23 (ppll equal to local).
Throughput: PPLL's claim is 1.33x sequential local learning on 4 GPUs for ResNet.
"""
from cdpjax.config import default_config, parse_arg

TRAIN_SIZES = {"cifar10": 50_000, "svhn_cropped": 73_257, "stl10": 5_000}


def get_config(arg=None):
    a = parse_arg(arg, K=4, method="ppll", dataset="cifar10", epochs=400, head="infopro")
    c = default_config()
    c.method, c.model, c.dataset = a["method"], "resnet32", a["dataset"]
    c.norm = "batch"
    c.global_batch_size = 1024
    steps_per_epoch = TRAIN_SIZES[c.dataset] // 1024 + 1
    try:
        from cdpjax.models.partition import infopro_points

        c.stages = list(infopro_points(a["K"]))
    except ImportError:
        c.stages = a["K"]
    c.aux_head = a["head"]
    c.optimizer, c.learning_rate, c.momentum, c.nesterov, c.weight_decay = "sgd", 0.8, 0.9, True, 1e-4
    c.schedule, c.warmup_steps = "cosine", 10 * steps_per_epoch
    c.num_steps = a["epochs"] * steps_per_epoch
    c.eval_every = c.checkpoint_every = 10 * steps_per_epoch
    return c
