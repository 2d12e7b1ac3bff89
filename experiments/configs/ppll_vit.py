"""ViT-B-shaped (768 wide, 12 heads, 12 blocks), blocks as local modules: e2e / local / ppll / gpipe.

Reproduces the ViT rows of PPLL (Guo et al., arXiv 2411.12780) with the recipe of
its public code: SGD lr 8e-4, batch 128, PPLL auxiliary heads (fresh transformer
blocks, 2,2,2,1,1,1,0,... deep by module, then LayerNorm and a linear
classifier); 32x32 inputs (patch 4) for CIFAR-10 / SVHN, 96x96 (patch 12) for
STL-10. The public summary does not give the epoch count; 200 is used here.

K local modules of 12 / K encoder blocks each (the patch embedding joins the
first, the classifier the last); PPLL's own setting is one module per encoder
block, K = 12, grouped on 4 GPUs (`devices=4`: 3 modules per GPU).

    cdpjax train --config experiments/configs/ppll_vit.py:K=4,method=ppll,dataset=svhn_cropped
    cdpjax train --config experiments/configs/ppll_vit.py:K=12,devices=4,method=ppll
    cdpjax describe --config experiments/configs/ppll_vit.py:K=12,devices=4

Hardware: one GPU per device of the pipeline (K, or `devices`). Expected: PPLL
2.62x sequential local learning and 1.25x model parallelism on 4 GPUs, accuracy
comparable to e2e.
"""
from cdpjax.config import default_config, parse_arg

TRAIN_SIZES = {"cifar10": 50_000, "svhn_cropped": 73_257, "stl10": 5_000}
DEPTH = 12


def get_config(arg=None):
    a = parse_arg(arg, K=4, devices=0, method="ppll", dataset="cifar10", epochs=200)
    c = default_config()
    c.method, c.model, c.dataset = a["method"], "vit", a["dataset"]
    patch = 12 if c.dataset == "stl10" else 4
    c.model_kwargs = {"dim": 768, "depth": DEPTH, "heads": 12, "mlp_dim": 3072, "patch": patch}
    c.norm = "none"
    c.global_batch_size = 128
    # Blocks: [patch embedding, encoder 1..12, classifier]; module k starts at encoder block 1 + 12k/K.
    k = int(a["K"])
    c.stages = [1 + DEPTH * i // k for i in range(1, k)]
    devices = int(a["devices"])
    if devices and devices != k:  # contiguous, as even as the counts allow
        c.module_groups = [k // devices + (d < k % devices) for d in range(devices)]
    c.aux_head = "vit"
    c.optimizer, c.learning_rate, c.momentum, c.weight_decay = "sgd", 8e-4, 0.9, 0.0
    c.schedule = "cosine"
    steps_per_epoch = TRAIN_SIZES[c.dataset] // 128 + 1
    c.num_steps = a["epochs"] * steps_per_epoch
    c.eval_every = c.checkpoint_every = 10 * steps_per_epoch
    return c
