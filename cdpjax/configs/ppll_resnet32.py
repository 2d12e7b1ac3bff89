"""ResNet-32 with K local modules: e2e / local / ppll / gpipe on CIFAR-10, SVHN or STL-10, in three recipes.

    cdpjax train --config ppll_resnet32:K=16,method=ppll             # PPLL, 4 GPUs
    cdpjax train --config ppll_resnet32:K=16,method=local            # the same, one GPU
    cdpjax train --config ppll_resnet32:K=4,recipe=infopro,method=local   # 160 epochs
    cdpjax train --config ppll_resnet32:K=8,recipe=infopro,loss=contrast,method=local
    cdpjax describe --config ppll_resnet32:K=16

`recipe=ppll` (default): the runs behind PPLL's logged 91.3% (K=8) and 89.0% (K=16), PPLL's
released code (gxy233/Faster-Multi-GPU-Training-with-PPLL; the differences that remain, and
why, are in docs/ppll.md) with the optimizer and EMA decay of the `train.py` its `run.sh`
calls (`run.sh:13,48,50`: `python train.py --model resnet --local_module_num 16|8 ...
--momentum 0.995`). That `train.py` is not in PPLL's release; it is MAN's (JunhaoSu0/MAN,
`Exp on CIFAR-SVHN-STL/train.py`, whose `--ixx_1 --ixy_1 --ixx_2 --ixy_2 --momentum` flags
the command passes), and PPLL's ResNet model file is MAN's `InfoProResNet` split in parts.
Each value from:

- heads `man` (`cdpjax.models.infopro`): a trained copy of the next module's first block
  plus a copy that follows it by EMA where it shares the device (trained across devices),
  then InfoPro's classifier and decoder: `models/resnetInfoPro_gxy_ppll.py`
  (`InfoProResNet_basic`: `LB`, `EMA_Net`, `_initialize_auxiliary_nets`, `forward_features`);
  classifier `2c2f` with cross-entropy: the configs' `aux_net_config: '2c2f'`,
  `local_loss_mode: 'cross_entropy'` (`configs/k4_resnet32_gxy_ppll.yaml`,
  `k2_resnet32_gxy_ppll_k8.yaml`, `k2_resnet32_gxy_ppll_k16.yaml`);
- EMA decay 0.995: `run.sh`'s `--momentum 0.995`, which MAN's `train.py:95` declares as
  "momentum for EMA" and passes to the model (`train.py:215`), where it moves every copy,
  `paramEMA = paramEMA * momentum + param * (1 - momentum)`
  (`networks/resnetInfoPro_MAN.py:288-289`); every copy follows, middle devices' too
  (`mid_ema=True`): MAN's model updates all of them;
- SGD Nesterov, momentum 0.9, weight decay 1e-4: MAN's `train.py:107-109`
  (`training_configurations`: `'momentum': 0.9, 'nesterov': True, 'weight_decay': 1e-4`)
  and `train.py:224-228` (`torch.optim.SGD`), the same values as PPLL's own
  `training_configurations` (`models/resnetInfoPro_gxy_ppll.py:661-663`);
- loss weights (ixx_1, ixy_1, ixx_2, ixy_2) = (5, 0.5, 0, 0), interpolated by the ResNet
  stage index `lo` of the block after the split, r = lo / (N - 2):
  `forward_features` and its callers (`ixx_1=5, ixy_1=0.5, ixx_2=0, ixy_2=0`) in
  `models/resnetInfoPro_gxy_ppll.py` and `run.sh`'s flags, N = the configs'
  `local_module_num` (16 for K=16's 15 modules, 8 for K=8; 8 for K=4 in
  `k2_resnet32_gxy_ppll_k4.yaml`: with N = 4 module 1 would get no loss and module 2
  negative weights);
- cosine learning rate with peak 0.8 after 10 warm-up epochs, 400 epochs, batch 1024
  (CIFAR-10, SVHN): `adjust_learning_rate` and `training_configurations` of MAN's
  `train.py:101-104,414-424` and of `models/resnetInfoPro_gxy_ppll.py:655-686`
  (`--cos_lr`; `cos_lr: True` in the K=8 and K=16 configs);
- local modules: InfoPro's table (`models/config.py`, `InfoPro['resnet32']`); K=16 is 15
  modules, the stem merged into the first;
- module groups: K=16 on 4 GPUs [8, 3, 2, 2] (`configs/k4_resnet32_gxy_ppll.yaml`,
  `infrop_s` / `infrop_e`), on 2 [9, 6] (`k2_resnet32_gxy_ppll_k16.yaml`); K=8 on 2 [5, 3]
  (`k2_resnet32_gxy_ppll_k8.yaml`); K=4 on 2 [3, 1] (`k2_resnet32_gxy_ppll_k4.yaml`); other
  sizes: one module per device, or even contiguous groups (no released file);
- augmentation: CIFAR-10 reflect padding 4, random crop, flip (`training()` in
  `models/resnetInfoPro_gxy_ppll.py`); SVHN zero padding 2, random crop, no flip, mean and
  std 0.5 (same, `:1752-1755`);
- STL-10 (PPLL releases no STL-10 loader; InfoPro's, which MAN's `train.py` keeps, for every
  recipe): batch 128 and peak learning rate 0.1 (`train.py:103-104`: 1024 and 0.8 only for
  cifar10 and svhn), `RandomCrop(96, padding=4)` (zero padding), flip, mean and std 0.5
  (`train.py:144-145,162-168`; InfoPro's `train.py:97-98,145-146,163-166`).

`recipe=ppll-multiprocess`: the released multi-process code read as written
(`training/trainingFw.py` -> `train_front` / `train_mid` / `train_back` of
`models/resnetInfoPro_gxy_ppll.py:1447,1518,1573`): the configs' `momentum: 0.995`
(`k2_resnet32_gxy_ppll_k8.yaml:123`, `k2_resnet32_gxy_ppll_k16.yaml:117`,
`k4_resnet32_gxy_ppll.yaml:168`) goes to SGD (`:1462,1480-1484`, `:1533,1547-1551`,
`:1598,1627-1631`, Nesterov); the EMA decay is `InfoProResNet_basic`'s default
`momentum=0.9` (`:119`), never passed; the middle parts never update their copies
(`InfoProResNet_mid.forward_features`, `:461-500`, against the front's `:432` and the
back's `:558`): `mid_ema=False`. Everything else as recipe=ppll. The authors' own log of
this path, `k2_resnet_oldfw_k8s2_valid.json` (the `rd_eva` of
`k2_resnet32_gxy_ppll_k8.yaml:163`), peaks at 35.3% test accuracy (epoch 6) and falls to
16.1% by epoch 10 as the warm-up raises the learning rate: a reading kept to reproduce
that collapse, not the 91.3%.

`recipe=infopro`: InfoPro's Table 2 setting (`Experiments on CIFAR-SVHN-STL10/train.py` of
blackfeather-wang/InfoPro-Pytorch): 160 epochs (`train.py:96`), its crops (CIFAR-10 reflect
padding 4, `:151-153`; SVHN and STL-10 as above, `:163-173`),
classifier `1c2f` with the decoder, weights by module index from InfoPro's ResNet-32
commands (`comand.sh`): K=2 (5, 1, 0, 0), K=4 (6, 0, 1, 2), K=8 (5, 0, 0, 2), K=16
(5, 0.05, 0.2, 0.5), K=3 takes K=4's; SGD Nesterov momentum 0.9, weight decay 1e-4,
cosine peak 0.8 after 10 warm-up epochs, batch 1024 (STL-10 as above); K=16 as 16 modules (the stem alone);
`loss=contrast` trains the heads with InfoPro's supervised contrastive loss (temperature
0.07, 128-dimensional embeddings) as its published commands do (those weights are the
commands' own, which all use the contrastive loss).

Arguments: K (2, 4, 8, 16; infopro also 3), method, dataset, epochs, recipe (ppll,
ppll-multiprocess, infopro), devices (PPLL's GPUs: ppll default min(K, 4); infopro default one per module),
head (ppll: man; infopro: infopro, dgl, greedy), recon (InfoPro's decoder), loss
(cross_entropy, contrast). A `man` head's copies follow by EMA only within a device, so
`local` builds its heads for the same `module_groups` and equals `ppll`.

Hardware: one GPU per device of the pipeline (`devices`, 4 for K >= 4 in recipe=ppll) for
ppll / gpipe; one for e2e / local.
Expected CIFAR-10 test accuracy (recipe=ppll): PPLL's code's own logs of its (unreleased)
`train.py` runs on 2 GPUs, 400 epochs: 91.3% at K=8 (`rd/rd_epoch_acc/
k2_resnet_newfw_k8s2_valid.json`), 89.0% at K=16 after 298 epochs (`k2_resnet_newfw_k16s2`);
PPLL's paper: 1.33x sequential local learning and 0.85x model parallelism on 4 GPUs.
recipe=ppll-multiprocess: the collapse of `k2_resnet_oldfw_k8s2_valid.json` (35.3% at
epoch 6, 16.1% at epoch 10).
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
# InfoPro's train.py augmentation, which PPLL's and MAN's keep: dataset -> dataset_kwargs of cdpjax's
# loaders; STL-10: RandomCrop(96, padding=4) with zeros, flip, mean and std 0.5 (every recipe).
CROPS = {"cifar10": {"padding_mode": "reflect"},
         "svhn_cropped": {"crop_padding": 2, "pixel_mean": 0.5, "pixel_std": 0.5},
         "stl10": {"crop_padding": 4, "padding_mode": "zeros", "pixel_mean": 0.5, "pixel_std": 0.5}}
# recipe -> default epochs: PPLL's configs' and MAN's `epochs: 400`; InfoPro's train.py `'epochs': 160`.
EPOCHS = {"ppll": 400, "ppll-multiprocess": 400, "infopro": 160}
# dataset -> (batch, peak learning rate): InfoPro's and MAN's train.py (1024 and 0.8 for cifar10 and svhn).
BATCH_AND_LR = {"cifar10": (1024, 0.8), "svhn_cropped": (1024, 0.8), "stl10": (128, 0.1)}
# recipe -> (SGD momentum, EMA decay of the `man` copies, whether middle devices' copies follow).
PPLL_MOMENTA = {"ppll": (0.9, 0.995, True), "ppll-multiprocess": (0.995, 0.9, False)}
RECIPES = ("ppll", "ppll-multiprocess", "infopro")


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
    c.momentum, ema_decay, mid_ema = PPLL_MOMENTA[a["recipe"]]
    if c.aux_head == "man":
        c.aux_kwargs.update(ema_decay=ema_decay, mid_ema=mid_ema)


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
    a = parse_arg(arg, K=4, method="ppll", dataset="cifar10", epochs=0, recipe="ppll", devices=0, head="",
                  recon=True, loss="cross_entropy")
    if a["recipe"] not in RECIPES:
        raise ConfigError(f"recipe={a['recipe']!r} is not one of {', '.join(RECIPES)}")
    c = default_config()
    c.method, c.model, c.dataset = a["method"], "resnet32", a["dataset"]
    if c.dataset not in BATCH_AND_LR:
        raise ConfigError(f"dataset={c.dataset!r} is not one of {', '.join(BATCH_AND_LR)}")
    c.norm = "batch"
    batch, peak_lr = BATCH_AND_LR[c.dataset]
    c.global_batch_size = batch
    steps_per_epoch = TRAIN_SIZES[c.dataset] // batch + 1
    (_infopro if a["recipe"] == "infopro" else _ppll)(c, a)
    c.dataset_kwargs = dict(CROPS[c.dataset])
    if a["loss"] != "cross_entropy":
        c.aux_kwargs = {**c.aux_kwargs, "loss": a["loss"], "feature_dim": 128}
    c.optimizer, c.learning_rate, c.nesterov, c.weight_decay = "sgd", peak_lr, True, 1e-4
    c.schedule, c.warmup_steps = "cosine", 10 * steps_per_epoch
    c.num_steps = (int(a["epochs"]) or EPOCHS[a["recipe"]]) * steps_per_epoch
    c.eval_every = c.checkpoint_every = 10 * steps_per_epoch
    return c
