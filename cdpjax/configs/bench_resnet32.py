"""Benchmark: ResNet-32 of CIFAR shape (32x32x3) on synthetic data, K = 4 local modules.

The PPLL bench of docs/measured.md: e2e, local, ppll and gpipe on the same model and
batch (InfoPro's K=4 split points; InfoPro's `1c2f` heads with the
reconstruction decoder and its K=4 loss weights, as `ppll_resnet32.py`), 4
devices for the pipelines. The synthetic images are not pixels: the decoder's
targets take them as pixels of mean 0.5 and standard deviation 0.25 (clipped
to [0, 1]), which leaves its cost, the bench's concern, as on CIFAR-10.

    cdpjax bench --config bench_resnet32 --methods e2e,local,ppll,gpipe --cpu-devices 4

Expected: ppll busy fraction 1.0 in steady state (gpipe with M=4: 4/7); on
simulated CPU devices, which share the same cores, ppll's time per batch over
local's is the framework's own overhead (at most 1.15).
"""
from cdpjax.config import default_config, parse_arg
from cdpjax.models.partition import infopro_points


def get_config(arg=None):
    a = parse_arg(arg, K=4, batch=64, head="infopro")
    c = default_config()
    c.model, c.dataset = "resnet32", "synthetic"
    c.dataset_kwargs = {"image_shape": (32, 32, 3), "num_classes": 10}
    c.norm = "batch"
    c.global_batch_size = a["batch"]
    c.stages = list(infopro_points(a["K"]))
    c.aux_head = a["head"]
    if a["head"] == "infopro":
        c.aux_kwargs = {"arch": "1c2f", "reconstruction": True, "ixx_1": 6, "ixy_1": 0, "ixx_2": 1, "ixy_2": 2,
                        "pixel_mean": 0.5, "pixel_std": 0.25}
    c.microbatches = 4
    c.optimizer, c.learning_rate, c.momentum, c.nesterov, c.weight_decay = "sgd", 0.1, 0.9, True, 1e-4
    c.num_steps = 10
    return c
