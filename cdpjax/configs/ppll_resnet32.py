"""ResNet-32 with K local modules: e2e / local / ppll / gpipe on CIFAR-10, SVHN or STL-10, in two recipes.

    cdpjax train --config experiments/configs/ppll_resnet32.py:K=16,method=ppll             # PPLL, 4 GPUs
    cdpjax train --config experiments/configs/ppll_resnet32.py:K=16,method=local            # the same, one GPU
    cdpjax train --config experiments/configs/ppll_resnet32.py:K=4,recipe=infopro,method=local,epochs=160
    cdpjax train --config experiments/configs/ppll_resnet32.py:K=8,recipe=infopro,loss=contrast,method=local
    cdpjax describe --config experiments/configs/ppll_resnet32.py:K=16

`recipe=ppll` (default): PPLL's released code (gxy233/Faster-Multi-GPU-Training-with-PPLL;
the differences that remain, and why, are in docs/ppll.md), each value from:

- heads `man` (`cdpjax.models.infopro`): a trained copy of the next module's first block
  plus a copy that follows it by EMA where it shares the device (trained across devices),
  then InfoPro's classifier and decoder: `models/resnetInfoPro_gxy_ppll.py`
  (`InfoProResNet_basic`: `LB`, `EMA_Net`, `_initialize_auxiliary_nets`, `forward_features`);
  classifier `2c2f` with cross-entropy: the configs' `aux_net_config: '2c2f'`,
  `local_loss_mode: 'cross_entropy'` (`configs/k4_resnet32_gxy_ppll.yaml`,
  `k2_resnet32_gxy_ppll_k8.yaml`, `k2_resnet32_gxy_ppll_k16.yaml`); EMA decay 0.9: the
  default `momentum=0.9` of `InfoProResNet_basic`, which `train_front`, `train_mid`,
  `train_back` never pass;
- loss weights (ixx_1, ixy_1, ixx_2, ixy_2) = (5, 0.5, 0, 0), interpolated by the ResNet
  stage index `lo` of the block after the split, r = lo / (N - 2):
  `forward_features` and its callers (`ixx_1=5, ixy_1=0.5, ixx_2=0, ixy_2=0`) in
  `models/resnetInfoPro_gxy_ppll.py`, N = the configs' `local_module_num` (16 for K=16's
  15 modules, 8 for K=8; 8 for K=4 in `k2_resnet32_gxy_ppll_k4.yaml`: with N = 4 module 1
  would get no loss and module 2 negative weights);
- SGD Nesterov, momentum 0.995, weight decay 1e-4: the configs' `momentum: 0.995`,
  `weight_decay: 0.0001` and `torch.optim.SGD(..., nesterov=True)` in `train_front` /
  `train_mid` / `train_back`; cosine learning rate with peak 0.8 after 10 warm-up epochs,
  400 epochs, batch 1024: `adjust_learning_rate` and `training_configurations` of
  `models/resnetInfoPro_gxy_ppll.py` (`cos_lr: True` in the K=8 and K=16 configs);
- local modules: InfoPro's table (`models/config.py`, `InfoPro['resnet32']`); K=16 is 15
  modules, the stem merged into the first;
- module groups: K=16 on 4 GPUs [8, 3, 2, 2] (`configs/k4_resnet32_gxy_ppll.yaml`,
  `infrop_s` / `infrop_e`), on 2 [9, 6] (`k2_resnet32_gxy_ppll_k16.yaml`); K=8 on 2 [5, 3]
  (`k2_resnet32_gxy_ppll_k8.yaml`); K=4 on 2 [3, 1] (`k2_resnet32_gxy_ppll_k4.yaml`); other
  sizes: one module per device, or even contiguous groups (no released file);
- augmentation: CIFAR-10 reflect padding 4, random crop, flip (`training()` in
  `models/resnetInfoPro_gxy_ppll.py`); SVHN zero padding 2, random crop, no flip (same).

`recipe=infopro`: InfoPro's recipe as cdpjax ran it before (InfoPro's Table 2 setting):
classifier `1c2f` with the decoder, weights by module index from InfoPro's ResNet-32
commands (`comand.sh`): K=2 (5, 1, 0, 0), K=4 (6, 0, 1, 2), K=8 (5, 0, 0, 2), K=16
(5, 0.05, 0.2, 0.5), K=3 takes K=4's; SGD Nesterov momentum 0.9, weight decay 1e-4,
cosine peak 0.8 after 10 warm-up epochs, batch 1024; K=16 as 16 modules (the stem alone);
`loss=contrast` trains the heads with InfoPro's supervised contrastive loss (temperature
0.07, 128-dimensional embeddings) as its published commands do (those weights are the
commands' own, which all use the contrastive loss).

Arguments: K (2, 4, 8, 16; infopro also 3), method, dataset, epochs, recipe (ppll,
infopro), devices (PPLL's GPUs: ppll default min(K, 4); infopro default one per module),
head (ppll: man; infopro: infopro, dgl, greedy), recon (InfoPro's decoder), loss
(cross_entropy, contrast). A `man` head's copies follow by EMA only within a device, so
`local` builds its heads for the same `module_groups` and equals `ppll`.

Hardware: one GPU per device of the pipeline (`devices`, 4 for K >= 4 in recipe=ppll) for
ppll / gpipe; one for e2e / local.
Expected CIFAR-10 test accuracy (recipe=ppll): PPLL's code's own logs of its (unreleased)
`train.py` runs on 2 GPUs, 400 epochs: 91.3% at K=8 (`rd/rd_epoch_acc/
k2_resnet_newfw_k8s2_valid.json`), 89.0% at K=16 after 298 epochs (`k2_resnet_newfw_k16s2`);
PPLL's paper: 1.33x sequential local learning and 0.85x model parallelism on 4 GPUs.
Expected test error (recipe=infopro), InfoPro's Table 2 (160 epochs): e2e 7.37%; softmax
heads with reconstruction K=2 8.13, K=4 8.64, K=8 11.40, K=16 14.23; contrastive 7.76,
8.58, 11.13, 12.75; head=dgl 8.69, 11.48, 14.17, 16.21; head=greedy 10.30, 16.07, 21.19,
24.59 (ppll equal to local throughout).
"""
from cdpjax.config import ConfigError, default_config, parse_arg
from cdpjax.models.partition import infopro_points

TRAIN_SIZES = {"cifar10": 50_000, "svhn_cropped": 73_257, "stl10": 5_000}
# InfoPro's ResNet-32 commands: K -> (ixx_1, ixy_1, ixx_2, ixy_2); K=3: K=4's (none published).
INFOPRO_WEIGHTS = {1: (0, 1, 0, 1), 2: (5, 1, 0, 0), 3: (6, 0, 1, 2), 4: (6, 0, 1, 2), 8: (5, 0, 0, 2),
                   16: (5, 0.05, 0.2, 0.5)}
PPLL_WEIGHTS = (5, 0.5, 0, 0)
# The `local_module_num` of PPLL's configs, the N its weight rule divides by (K=4: its file's 8).
PPLL_WEIGHT_K = {2: 2, 4: 8, 8: 8, 16: 16}
# (K, GPUs) -> modules per GPU in PPLL's released configs (infrop_s / infrop_e of each part).
PPLL_GROUPS = {(16, 4): [8, 3, 2, 2], (16, 2): [9, 6], (8, 2): [5, 3], (4, 2): [3, 1]}
# PPLL's augmentation: dataset -> dataset_kwargs of cdpjax's loaders.
PPLL_CROPS = {"cifar10": {"padding_mode": "reflect"}, "svhn_cropped": {"crop_padding": 2}}


def even_groups(modules: int, devices: int) -> list[int]:
    """Contiguous groups of `modules` on `devices`, as even as the counts allow."""
    return [modules // devices + (d < modules % devices) for d in range(devices)]


def _ppll(c, a):
    K = a["K"]
    if K not in PPLL_WEIGHT_K:
        raise ConfigError(f"recipe=ppll has K in {sorted(PPLL_WEIGHT_K)} (PPLL's ResNet-32 runs), got K={K}")
    c.stages = infopro_points(K)[1:] if K == 16 else infopro_points(K)  # 15 modules: the stem joins the first
    modules = len(c.stages) + 1
    devices = int(a["devices"]) or min(K, 4)
    if devices != modules:
        c.module_groups = PPLL_GROUPS.get((K, devices)) or even_groups(modules, devices)
    c.aux_head = a["head"] or "man"
    ixx_1, ixy_1, ixx_2, ixy_2 = PPLL_WEIGHTS
    c.aux_kwargs = {"arch": "2c2f", "reconstruction": True, "ixx_1": ixx_1, "ixy_1": ixy_1, "ixx_2": ixx_2,
                    "ixy_2": ixy_2, "weight_by": "stage", "weight_k": PPLL_WEIGHT_K[K]}
    c.momentum = 0.995
    c.dataset_kwargs = dict(PPLL_CROPS.get(c.dataset, {}))


def _infopro(c, a):
    K = a["K"]
    c.stages = infopro_points(K)
    if int(a["devices"]):
        c.module_groups = even_groups(K, int(a["devices"]))
    c.aux_head = a["head"] or "infopro"
    if c.aux_head == "infopro":
        ixx_1, ixy_1, ixx_2, ixy_2 = INFOPRO_WEIGHTS[K] if a["recon"] else (0, 1, 0, 1)
        c.aux_kwargs = {"arch": "1c2f", "reconstruction": bool(a["recon"]),
                        "ixx_1": ixx_1, "ixy_1": ixy_1, "ixx_2": ixx_2, "ixy_2": ixy_2}
    c.momentum = 0.9


def get_config(arg=None):
    a = parse_arg(arg, K=4, method="ppll", dataset="cifar10", epochs=400, recipe="ppll", devices=0, head="",
                  recon=True, loss="cross_entropy")
    if a["recipe"] not in ("ppll", "infopro"):
        raise ConfigError(f"recipe={a['recipe']!r} is not one of ppll, infopro")
    c = default_config()
    c.method, c.model, c.dataset = a["method"], "resnet32", a["dataset"]
    c.norm = "batch"
    c.global_batch_size = 1024
    steps_per_epoch = TRAIN_SIZES[c.dataset] // 1024 + 1
    (_ppll if a["recipe"] == "ppll" else _infopro)(c, a)
    if a["loss"] != "cross_entropy":
        c.aux_kwargs = {**c.aux_kwargs, "loss": a["loss"], "feature_dim": 128}
    c.optimizer, c.learning_rate, c.nesterov, c.weight_decay = "sgd", 0.8, True, 1e-4
    c.schedule, c.warmup_steps = "cosine", 10 * steps_per_epoch
    c.num_steps = a["epochs"] * steps_per_epoch
    c.eval_every = c.checkpoint_every = 10 * steps_per_epoch
    return c
