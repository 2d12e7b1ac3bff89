"""ViT-B-shaped (768 wide, 12 heads, 12 blocks), blocks as local modules: e2e / local / ppll / gpipe.

    cdpjax train --config ppll_vit:method=ppll                       # K=12 on 4 GPUs
    cdpjax train --config ppll_vit:method=ppll,devices=2,dataset=svhn_cropped
    cdpjax train --config ppll_vit:K=4,recipe=infopro,method=ppll
    cdpjax describe --config ppll_vit:K=12,devices=4

`recipe=ppll` (default): PPLL's released ViT code (gxy233/Faster-Multi-GPU-Training-with-PPLL;
the differences that remain, and why, are in docs/ppll.md), each value from:

- 12 one-block local modules (K=12; the patch embedding joins the first, the classifier
  the last), grouped [2, 3, 3, 4] on 4 GPUs (`configs/k4_vit_224_p16.yaml`: the parts'
  `aux_depth_list`s of 2, 3, 3, 4 entries) and [5, 7] on 2 (`configs/k2_vit_224_p16.yaml`);
  other device counts: even contiguous groups (no released file);
- heads `vit`: fresh encoder blocks 2, 2, 2, 1, 1, 1, then 0, LayerNorm and a linear
  classifier on the class token (`models/vit_model.py`: `AuxClassifier`, `get_block_count`
  = 2 - aux_depth + 1 with the configs' aux depths 1, 1, 1, 2, 2, 2, 3, ...);
- the last module's two heads (`aux_kwargs.last_head=True`): its block trains through its
  own `AuxClassifier` (no blocks: LayerNorm and linear), and the final LayerNorm and
  classifier train on the block's detached output (`models/vit_model.py:936-941`, the
  loop that backpropagates each block's auxiliary loss and detaches; `:951-969`, norm and
  head on the detached features; `util/utils.py:243-249`, the back part's cross-entropy of
  that head, backward): local loss CE(aux(h)) + CE(classifier(stop_gradient(h)));
- SGD lr 8e-4, momentum 0.9 (no Nesterov), weight decay 5e-5, batch 128, 50 epochs: the
  configs' `lr: 0.0008`, `momentum: 0.9`, `weight_decay: 0.00005`, `batch_size: 128`,
  `epochs: 50`, with `util/get_optimizer.py` (plain `optim.SGD`); a constant rate: the
  configs' `milestones: [80, 120]` are never reached in 50 epochs;
- no augmentation, mean and std 0.5 on every dataset: `dataloader/load_data.py` (`ToTensor`, then
  `Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))`: lines 22, 41, 59 for CIFAR-10, STL-10, SVHN);
- patch 16 at 32x32 (`k4_vit_224_p16.yaml`, `img_size: 32`, `patch_size: 16`; `patch=4`:
  `k4_vit_224_p4.yaml`), patch 16 at 96x96 for STL-10 (`k4_vit_224_p16_stl.yaml`).

`recipe=infopro`: the recipe cdpjax ran before: K=4 modules of 3 blocks by default, SGD
8e-4 with momentum 0.9, weight decay 0, a cosine schedule over 200 epochs, crop and flip,
patch 4 at 32x32 and 12 at 96x96.

Arguments: K, devices (PPLL's GPUs: default 4 for recipe=ppll, one per module for
infopro), method, dataset, epochs, recipe, patch. A backprop pipeline (`gpipe`, ...) on
fewer devices than modules runs one stage per device holding that device's blocks (PPLL's
"model parallelism": [2, 3, 3, 4] blocks on 4 GPUs).

Epochs: every method runs the recipe's 50 by default, so that the table compares equal
work. The released baselines ran longer: end-to-end `train_vite2e.py` defaults to 400
epochs (`train_vite2e.py:174`, at batch 1024, `:175`, with the rate divided by 10 at
epochs 80 and 120, `:70-74`), the pipeline baseline `train_vitpp.py` 200 (`run_vitpp.sh:2`,
`--epochs 200`); `epochs=400` / `epochs=200` gives those lengths (batch and schedule stay
the recipe's).

Initialisation: `cdpjax.models.vit`'s default, PPLL's `_init_vit_weights`
(`models/vit_model.py:1937-1952`: linear layers `trunc_normal_(std=.01)`, biases 0, the patch
projection `kaiming_normal_(mode="fan_out")`), class token and positions std 0.02
(`:789-793`), for the auxiliary heads too (`aux_head='vit'`). Activation: PyTorch's exact
`nn.GELU()` (`Block`'s `act_layer`, `models/vit_model.py:181,230`), `cdpjax.models.vit`'s default.

Hardware: one GPU per device of the pipeline (`devices`). Expected: PPLL's paper, 2.62x
sequential local learning and 1.25x model parallelism on 4 GPUs, accuracy comparable to e2e.
"""
from cdpjax.config import ConfigError, default_config, parse_arg

TRAIN_SIZES = {"cifar10": 50_000, "svhn_cropped": 73_257, "stl10": 5_000}
DEPTH = 12
# GPUs -> modules per GPU of PPLL's K=12 configs (the length of each part's aux_depth_list).
PPLL_GROUPS = {4: [2, 3, 3, 4], 2: [5, 7]}
LOCAL_METHODS = ("local", "ppll")  # the methods with local modules (module groups); others get one stage a device


def get_config(arg=None):
    a = parse_arg(arg, K=0, devices=0, method="ppll", dataset="cifar10", epochs=0, recipe="ppll", patch=0)
    if a["recipe"] not in ("ppll", "infopro"):
        raise ConfigError(f"recipe={a['recipe']!r} is not one of ppll, infopro")
    ppll = a["recipe"] == "ppll"
    c = default_config()
    c.method, c.model, c.dataset = a["method"], "vit", a["dataset"]
    patch = int(a["patch"]) or (16 if ppll else 12 if c.dataset == "stl10" else 4)
    c.model_kwargs = {"dim": 768, "depth": DEPTH, "heads": 12, "mlp_dim": 3072, "patch": patch}
    c.norm = "none"
    c.global_batch_size = 128
    # Blocks: [patch embedding, encoder 1..12, classifier]; module k starts at encoder block 1 + 12k/K.
    k = int(a["K"]) or (DEPTH if ppll else 4)
    c.stages = [1 + DEPTH * i // k for i in range(1, k)]
    devices = int(a["devices"]) or (4 if ppll else k)
    if devices != k:  # contiguous, as even as the counts allow where PPLL has no file
        groups = (PPLL_GROUPS.get(devices) if ppll and k == DEPTH else None) or [
            k // devices + (d < k % devices) for d in range(devices)]
        if c.method in LOCAL_METHODS:
            c.module_groups = groups
        else:  # a backprop pipeline: one stage per device, holding that device's modules' blocks
            c.stages = [c.stages[sum(groups[:d]) - 1] for d in range(1, devices)]
    c.aux_head = "vit"
    if ppll:  # the released last module: its block on its own head, the classifier on the detached features
        c.aux_kwargs = {"last_head": True}
        c.dataset_kwargs = {"pixel_mean": 0.5, "pixel_std": 0.5}  # load_data.py's Normalize
    c.optimizer, c.learning_rate, c.momentum = "sgd", 8e-4, 0.9
    c.weight_decay, c.schedule, c.augment = (5e-5, "constant", False) if ppll else (0.0, "cosine", True)
    steps_per_epoch = TRAIN_SIZES[c.dataset] // 128 + 1
    c.num_steps = (int(a["epochs"]) or (50 if ppll else 200)) * steps_per_epoch
    c.eval_every = c.checkpoint_every = (5 if ppll else 10) * steps_per_epoch
    return c
