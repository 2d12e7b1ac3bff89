"""ViT-B-shaped (768 wide, 12 heads, 12 blocks), blocks as local modules: e2e / local / ppll / gpipe.

Reproduces the ViT rows of PPLL (Guo et al., arXiv 2411.12780) with the recipe of
its public code: SGD lr 8e-4, batch 128, PPLL auxiliary heads (fresh transformer
blocks, 2,2,2,1,1,1,0,... deep, then LayerNorm and a linear classifier); 32x32
inputs (patch 4) for CIFAR-10 / SVHN, 96x96 (patch 12) for STL-10. The public
summary does not give the epoch count; 200 is used here.

    cdpjax train --config experiments/configs/ppll_vit.py:K=4,method=ppll,dataset=svhn_cropped

Hardware: K GPUs (mesh stage=K). Expected: PPLL 2.62x sequential local learning
and 1.25x model parallelism on 4 GPUs, accuracy comparable to e2e.
"""
from cdpjax.config import default_config, parse_arg

TRAIN_SIZES = {"cifar10": 50_000, "svhn_cropped": 73_257, "stl10": 5_000}


def get_config(arg=None):
    a = parse_arg(arg, K=4, method="ppll", dataset="cifar10", epochs=200)
    c = default_config()
    c.method, c.model, c.dataset = a["method"], "vit", a["dataset"]
    patch = 12 if c.dataset == "stl10" else 4
    c.model_kwargs = {"dim": 768, "depth": 12, "heads": 12, "mlp_dim": 3072, "patch": patch}
    c.norm = "none"
    c.global_batch_size = 128
    c.stages = a["K"]
    c.aux_head = "vit"
    c.optimizer, c.learning_rate, c.momentum, c.weight_decay = "sgd", 8e-4, 0.9, 0.0
    c.schedule = "cosine"
    steps_per_epoch = TRAIN_SIZES[c.dataset] // 128 + 1
    c.num_steps = a["epochs"] * steps_per_epoch
    c.eval_every = c.checkpoint_every = 10 * steps_per_epoch
    return c
