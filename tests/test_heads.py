"""The auxiliary heads of the literature, checked against the reference implementations.

Parameter counts are derived in each test from the reference's own layer list
(InfoPro-Pytorch `networks/auxiliary_nets.py`, DGL `auxiliary_nets_study/models.py`),
written out here with PyTorch's counting rules, never read from our modules; loss
weights from InfoPro's interpolation rule written out here; the losses from cases small
enough to compute by hand. Then: every head trains on digits under `local`.
"""
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from cdpjax import models
from cdpjax.config import default_config
from cdpjax.errors import ConfigError
from cdpjax.models import aux_heads
from cdpjax.models.partition import infopro_points

CIFAR = (32, 32, 3)


# PyTorch's parameter counts of the reference layers.
def conv(k, cin, cout, bias=False):
    return k * k * cin * cout + (cout if bias else 0)


def bn(c):  # weight and bias (running statistics are buffers, not parameters)
    return 2 * c


def linear(i, o):
    return (i + 1) * o


def infopro_classifier(arch, c, classes=10, feature_dim=128):
    """InfoPro's AuxClassifier(inplanes=c, net_config=arch, loss_mode='cross_entropy'), widen 1."""
    width = {16: 32, 32: 64, 64: 64}[c]
    return {
        "0c1f": linear(c, classes),
        "0c2f": linear(c, feature_dim) + linear(feature_dim, classes),
        "1c1f": conv(3, c, width) + bn(width) + linear(width, classes),
        "1c2f": conv(3, c, width) + bn(width) + linear(width, feature_dim) + linear(feature_dim, classes),
        "1c3f": conv(3, c, width) + bn(width) + linear(width, feature_dim) + linear(feature_dim, feature_dim)
        + linear(feature_dim, classes),
        "2c2f": conv(3, c, width) + bn(width) + conv(3, width, width) + bn(width) + linear(width, feature_dim)
        + linear(feature_dim, classes),
    }[arch]


def infopro_decoder(c, image_channels=3):
    """InfoPro's Decoder(inplanes=c): conv3x3 (bias) to 12, BN, ReLU, conv3x3 (bias) to 3, sigmoid."""
    return conv(3, c, 12, bias=True) + bn(12) + conv(3, 12, image_channels, bias=True)


def dgl_mlp_sr(c, classes=10, n_lin=3, mlp_layers=3):
    """DGL's auxillary_classifier2(input_features=c, n_lin=3, mlp_layers=3) as its forward uses it:
    n_lin x (conv1x1 no bias, BN2d), mlp_layers x (Linear 4c -> 4c, BN1d), Linear 4c -> classes.
    (The module also builds `self.bn = BatchNorm2d(c)`, 2c parameters its forward never uses
    when mlp_layers > 0; ours leaves it out.)"""
    return n_lin * (conv(1, c, c) + bn(c)) + mlp_layers * (linear(4 * c, 4 * c) + bn(4 * c)) + linear(4 * c, classes)


def resnet32(k, norm="batch"):
    c = ml_collections.ConfigDict({"model": "resnet32", "model_kwargs": {}, "norm": norm,
                                   "stages": infopro_points(k), "partition": "params"})
    return models.build(c, CIFAR, 10)


def counts(heads):
    return ([c["head_params"] for c in heads.param_counts()], [c["decoder_params"] for c in heads.param_counts()])


@pytest.mark.parametrize("arch", aux_heads.INFOPRO_ARCHS)
def test_infopro_heads_have_the_reference_parameters(arch):
    """ResNet-32 at K = 4 (InfoPro's cuts: module outputs of 16, 32, 64 channels): classifier and
    decoder sizes of InfoPro's layer lists; the last module has no head."""
    heads = aux_heads.build("infopro", resnet32(4), 10, {"arch": arch, "reconstruction": True})
    assert [s[-1] for s in heads.feature_shapes] == [16, 32, 64, 10]
    head, decoder = counts(heads)
    assert head == [infopro_classifier(arch, c) for c in (16, 32, 64)] + [0]
    assert decoder == [infopro_decoder(c) for c in (16, 32, 64)] + [0]


def test_dgl_and_greedy_heads_have_the_reference_parameters():
    net = resnet32(4)
    assert counts(aux_heads.build("dgl", net, 10))[0] == [dgl_mlp_sr(c) for c in (16, 32, 64)] + [0]
    assert counts(aux_heads.build("dgl", net, 10, {"n_lin": 1, "mlp_layers": 0}))[0] == [
        conv(1, c, c) + bn(c) + bn(c) + linear(4 * c, 10) for c in (16, 32, 64)] + [0]  # BN on the 2x2 map
    assert counts(aux_heads.build("greedy", net, 10))[0] == [linear(c, 10) for c in (16, 32, 64)] + [0]


def test_vit_heads_are_fresh_encoder_blocks():
    """PPLL's ViT head: blocks[j] pre-norm encoder blocks of the network's width, LayerNorm, linear."""
    c = ml_collections.ConfigDict({"model": "vit_tiny", "model_kwargs": {}, "norm": "none", "stages": 4,
                                   "partition": "blocks"})
    net = models.build(c, (8, 8, 1), 10)
    d, mlp = 32, 64  # vit_tiny: 32 wide, MLP 64
    block = 2 * bn(d) + 4 * linear(d, d) + linear(d, mlp) + linear(mlp, d)  # 2 LayerNorms, q k v o, MLP
    expect = [depth * block + bn(d) + linear(d, 10) for depth in aux_heads.PPLL_VIT_BLOCKS[:3]] + [0]
    assert counts(aux_heads.build("vit", net, 10))[0] == expect


def _shapes_of(module, features, name):
    """Output shape of each submodule call whose name starts with `name` (flax's intermediates)."""
    variables = jax.eval_shape(module.init, jax.random.key(0), features)
    _, found = jax.eval_shape(lambda v, y: module.apply(v, y, capture_intermediates=True, mutable=["intermediates"]),
                              variables, features)
    inner = found["intermediates"]
    for part in ("classifier",):
        inner = inner.get(part, inner)
    return [v["__call__"][0].shape for k, v in sorted(inner.items()) if k.startswith(name)]


def test_head_convolutions_follow_the_references():
    """InfoPro: the first conv has stride 2 on 16 and 32 channels, 1 on 64 (widths 32, 64, 64).
    DGL: pool to ceil(H/4), 1x1 convs keep the channels."""
    heads = aux_heads.build("infopro", resnet32(4), 10, {"arch": "2c2f"})
    dgl = aux_heads.build("dgl", resnet32(4), 10)
    expect_infopro = [[(1, 16, 16, 32)] * 2, [(1, 8, 8, 64)] * 2, [(1, 8, 8, 64)] * 2]
    expect_dgl = [[(1, 8, 8, 16)] * 3, [(1, 4, 4, 32)] * 3, [(1, 2, 2, 64)] * 3]
    for j, shape in enumerate(heads.feature_shapes[:-1]):
        y = jax.ShapeDtypeStruct((1, *shape), jnp.float32)
        assert _shapes_of(heads.modules[j], y, "Conv") == expect_infopro[j]
        assert _shapes_of(dgl.modules[j], y, "Conv") == expect_dgl[j]


@pytest.mark.parametrize("k", [2, 3, 4, 8, 16])
def test_infopro_loss_weights_interpolate_as_infopro(k):
    """InfoPro's forward: for local module i = 0..K-2, ratio = i / (K-2) if K > 2 else 0,
    ixx = ixx_1 (1 - ratio) + ixx_2 ratio, ixy likewise; the last module: cross-entropy alone."""
    ixx_1, ixy_1, ixx_2, ixy_2 = 5.0, 0.05, 0.2, 0.5  # InfoPro's ResNet-32 K=16 command
    expect = []
    for i in range(k - 1):
        ratio = i / (k - 2) if k > 2 else 0
        expect.append((ixx_1 * (1 - ratio) + ixx_2 * ratio, ixy_1 * (1 - ratio) + ixy_2 * ratio))
    kwargs = {"reconstruction": True, "ixx_1": ixx_1, "ixy_1": ixy_1, "ixx_2": ixx_2, "ixy_2": ixy_2}
    weights = aux_heads.infopro_weights(kwargs, k)
    np.testing.assert_allclose(weights, expect + [(0.0, 1.0)])


def test_a_module_without_loss_weight_is_refused():
    """PPLL's command (5, 0.5, 0, 0) gives the last head (0, 0) once K > 2: that module never trains."""
    ppll = {"reconstruction": True, "ixx_1": 5, "ixy_1": 0.5, "ixx_2": 0, "ixy_2": 0}
    assert aux_heads.infopro_weights(ppll, 2) == [(5.0, 0.5), (0.0, 1.0)]
    with pytest.raises(ConfigError, match="local module 2 of 4 .* never train"):
        aux_heads.infopro_weights(ppll, 4)
    with pytest.raises(ConfigError, match="reconstruction is False"):
        aux_heads.infopro_weights({"ixx_1": 1.0}, 4)


def test_binary_cross_entropy_by_hand():
    logits = jnp.array([0.0, math.log(3.0), -math.log(3.0)])  # sigmoid: 1/2, 3/4, 1/4
    targets = jnp.array([0.5, 1.0, 0.25])
    by_hand = [math.log(2.0), -math.log(0.75), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]
    np.testing.assert_allclose(aux_heads.binary_cross_entropy(logits, targets), np.mean(by_hand), rtol=1e-6)


def test_resize_aligns_corners_by_hand():
    """PyTorch's bilinear `align_corners=True`: 2x2 -> 3x3 keeps the corners, midpoints average."""
    x = jnp.array([[0.0, 1.0], [2.0, 3.0]]).reshape(1, 2, 2, 1)
    out = aux_heads.resize_align_corners(x, 3, 3)[0, :, :, 0]
    np.testing.assert_allclose(out, [[0, 0.5, 1], [1, 1.5, 2], [2, 2.5, 3]], atol=1e-6)
    row = jnp.array([0.0, 3.0, 6.0]).reshape(1, 1, 3, 1)  # 3 -> 4 columns: samples at 0, 2/3, 4/3, 2
    np.testing.assert_allclose(aux_heads.resize_align_corners(row, 1, 4)[0, 0, :, 0], [0, 2, 4, 6], atol=1e-5)


def test_infopro_loss_adds_weighted_reconstruction_and_cross_entropy():
    """With the classifier's last layer at zero (uniform over 10 classes: CE = ln 10) and the
    decoder's last conv at weight 0, bias ln 3 (every pixel 3/4), on images whose raw pixels
    (input * std + mean) are all 1 (BCE = -ln 3/4): loss = ixx ln(4/3) + ixy ln 10."""
    c = ml_collections.ConfigDict({"model": "resnet_tiny", "model_kwargs": {}, "norm": "none", "stages": 2,
                                   "partition": "blocks"})
    net = models.build(c, (8, 8, 1), 10)
    heads = aux_heads.build("infopro", net, 10, {"reconstruction": True, "ixx_1": 2.0, "ixy_1": 0.5,
                                                 "pixel_mean": [0.3], "pixel_std": [0.4]})
    params, state = jax.jit(heads.init)(jax.random.key(0, impl="rbg"))  # rbg: compiles in seconds on CPU
    head = jax.tree.map(lambda x: x, params[0])
    last_dense = sorted(k for k in head["classifier"] if k.startswith("TorchDense"))[-1]
    head["classifier"][last_dense] = jax.tree.map(jnp.zeros_like, head["classifier"][last_dense])
    last_conv = sorted(k for k in head["decoder"] if k.startswith("Conv"))[-1]
    head["decoder"][last_conv] = {"kernel": jnp.zeros_like(head["decoder"][last_conv]["kernel"]),
                                  "bias": jnp.full_like(head["decoder"][last_conv]["bias"], math.log(3.0))}
    features = jnp.asarray(np.random.default_rng(0).normal(size=(4, *heads.feature_shapes[0])), jnp.float32)
    images = jnp.full((4, 8, 8, 1), (1.0 - 0.3) / 0.4)
    loss, (_, new_state) = jax.jit(lambda *a: heads.loss(0, *a, True))(head, state[0], features, jnp.arange(4), images)
    np.testing.assert_allclose(loss, 2.0 * math.log(4 / 3) + 0.5 * math.log(10.0), rtol=1e-5)
    moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), new_state, state[0])
    assert max(jax.tree.leaves(moved)) > 0  # BatchNorm's running averages follow the batch


def _digits_local(model, head, kwargs, stages=3):
    from cdpjax import methods
    from cdpjax.mesh import make_mesh

    c = default_config()
    c.method, c.model, c.aux_head, c.norm = "local", model, head, "batch" if model.startswith("resnet") else "none"
    c.stages, c.aux_kwargs, c.global_batch_size = stages, kwargs, 64
    c.schedule, c.learning_rate = "constant", 0.1
    return methods.build(methods.Context(c, make_mesh({"data": 1}, jax.devices()[:1]), (8, 8, 1), 10)), c


@pytest.mark.parametrize("model,head,kwargs", [
    pytest.param("resnet_tiny", "greedy", {}, marks=pytest.mark.heavy),  # the default head: trained everywhere
    ("resnet_tiny", "dgl", {}),
    pytest.param("resnet_tiny", "infopro", {"reconstruction": True, "ixx_1": 1.0, "ixy_1": 1.0},
                 marks=pytest.mark.heavy),  # CI: tests/test_local_ppll.py trains infopro with its decoder
    ("vit_tiny", "vit", {"blocks": (1, 1)}),
])
def test_local_trains_on_digits_with_every_head(model, head, kwargs):
    """40 steps of `local` on digits: every module's local loss goes down by 10% at least, heads'
    BatchNorm statistics move."""
    from cdpjax import data

    method, c = _digits_local(model, head, kwargs)
    dataset = data.build(c)
    state = method.init(jax.random.key(0, impl="rbg"))  # compiles faster on CPU; any start will do
    first_head_state = jax.device_get(state.head_state)
    losses = []
    for step in range(40):
        state, metrics = method.train_step(state, dataset.train_batch(step, 64, 0, augment=False))
        losses.append(np.asarray(metrics["stage_loss"]))
    losses = np.array(losses)
    assert np.all(np.isfinite(losses))
    start, end = losses[:5].mean(axis=0), losses[-5:].mean(axis=0)
    assert np.all(end < 0.9 * start), (start, end)
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()),
                         jax.device_get(state.head_state), first_head_state)
    assert head in ("greedy", "vit") or max(jax.tree.leaves(moved)) > 1e-3


def test_reconstruction_needs_pixel_statistics():
    """The decoder reconstructs raw pixels: a dataset whose statistics cdpjax does not know needs them given."""
    from cdpjax import methods
    from cdpjax.mesh import make_mesh

    c = default_config()
    c.method, c.model, c.aux_head, c.stages, c.dataset = "local", "resnet_tiny", "infopro", 2, "synthetic"
    c.aux_kwargs = {"reconstruction": True}
    ctx = methods.Context(c, make_mesh({"data": 1}, jax.devices()[:1]), (8, 8, 1), 10)
    with pytest.raises(ConfigError, match="pixel_mean"):
        methods.build(ctx)
    c.aux_kwargs = {"reconstruction": True, "pixel_mean": 0.5, "pixel_std": 0.25}
    assert methods.build(ctx).heads.pixel_std == (0.25,)


@pytest.mark.parametrize("kwargs,match", [
    ({"arch": "3c1f"}, "arch"),
    ({"feature_dim": 0}, "feature_dim"),
    ({"pixel_std": [0.1, 0.2]}, "pixel_std"),
    ({"ixx_2": -1}, "ixx_2"),
])
def test_bad_head_options_are_named(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        aux_heads.build("infopro", resnet32(2, norm="none"), 10, {"reconstruction": True, **kwargs})


# ------------------------------------------------------------------ PPLL's momentum heads (man)


def basic_block(cin, cout):
    """The released code's BasicBlock: conv3x3-BN-ReLU-conv3x3-BN, plus a 1x1 conv-BN shortcut where
    the shape changes (stride 2 or other widths)."""
    own = conv(3, cin, cout) + bn(cout) + conv(3, cout, cout) + bn(cout)
    return own + (conv(1, cin, cout) + bn(cout) if cin != cout else 0)


def test_man_heads_have_the_released_parameters():
    """`models/resnetInfoPro_gxy_ppll.py` at K = 4 (InfoPro's cuts after [1, 2], [2, 1], [3, 0]):
    head j = LB and EMA_Net, copies of module j+1's first block ([1, 3], [2, 2], [3, 1]: 16, 32, 64
    channels), then AuxClassifier('2c2f') and Decoder of those channels. The EMA copy is trained
    where module j+1 is on another device, held as state where it shares the device."""
    net = resnet32(4)
    copies = [basic_block(16, 16), basic_block(32, 32), basic_block(64, 64)]
    classifier = [infopro_classifier("2c2f", c) for c in (16, 32, 64)]
    kwargs = {"reconstruction": True}
    apart = aux_heads.build("man", net, 10, kwargs)  # one module per device: every copy trained
    assert counts(apart) == ([2 * b + c for b, c in zip(copies, classifier)] + [0],
                             [infopro_decoder(c) for c in (16, 32, 64)] + [0])
    assert [c["ema_params"] for c in apart.param_counts()] == [0, 0, 0, 0]
    grouped = aux_heads.build("man", net, 10, kwargs, groups=[2, 2])  # 0 -> 1 and 2 -> 3 on one device
    assert counts(grouped)[0] == [copies[0] + classifier[0], 2 * copies[1] + classifier[1],
                                  copies[2] + classifier[2], 0]
    assert [c["ema_params"] for c in grouped.param_counts()] == [copies[0], 0, copies[2], 0]


def test_man_copies_a_downsampling_block_and_deeper():
    """K = 8 cuts after [1, 4]: module 3 starts with [2, 0] (16 -> 32 channels, stride 2, projection):
    its copy is that block and the classifier reads 32 channels; copy_depth=2 copies [2, 0] and [2, 1]."""
    net = resnet32(8)
    head = counts(aux_heads.build("man", net, 10, {}, groups=[8]))[0][2]
    assert head == basic_block(16, 32) + infopro_classifier("2c2f", 32)
    deeper = aux_heads.build("man", net, 10, {"copy_depth": 2}, groups=[8]).param_counts()[2]
    assert deeper["ema_params"] == basic_block(16, 32) + basic_block(32, 32)
    assert deeper["head_params"] == deeper["ema_params"] + infopro_classifier("2c2f", 32)


def test_ema_follows_the_next_module_by_the_released_rule():
    """paramEMA <- m paramEMA + (1 - m) paramEncoder, parameters of module j+1's first block only;
    heads with nothing to follow keep their state."""
    net = resnet32(4, norm="none")
    heads = aux_heads.build("man", net, 10, {"ema_decay": 0.75}, groups=[2, 2])
    body, _ = jax.eval_shape(lambda: net.init(jax.random.key(0)))
    rng = np.random.default_rng(0)
    nxt = jax.tree.map(lambda a: rng.normal(size=a.shape).astype(np.float32), body[1])
    params, state = jax.tree.map(np.asarray, jax.jit(heads.init)(jax.random.key(0, impl="rbg")))
    new = heads.follow(0, params[0], state[0], nxt)
    expect = jax.tree.map(lambda e, p: 0.75 * e + 0.25 * p, state[0]["ema"]["momentum_copy"]["blocks_0"],
                          nxt["blocks_0"])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), new["ema"]["momentum_copy"]["blocks_0"],
                 expect)
    assert heads.follow(1, params[1], state[1], nxt) is state[1]  # module 2 is on the next device


# InfoPro's ResNet-32 table of PPLL's K = 16 (models/config.py): module i ends after block [g, b]; the
# block after it is in stage lo = g + 1 if b == 4 else g (`forward_features`).
PPLL_K16_TABLE = [[1, 0], [1, 1], [1, 2], [1, 3], [1, 4], [2, 0], [2, 1], [2, 2], [2, 3], [2, 4],
                  [3, 0], [3, 1], [3, 2], [3, 3]]


def test_weights_by_stage_index_as_ppll():
    """PPLL's rule: ratio = lo / (local_module_num - 2), (ixx, ixy) = (5 (1 - r), 0.5 (1 - r)) with its
    (5, 0.5, 0, 0); K = 16 is 15 modules (the stem merged) and local_module_num 16."""
    c = ml_collections.ConfigDict({"model": "resnet32", "model_kwargs": {}, "norm": "batch",
                                   "stages": infopro_points(16)[1:], "partition": "params"})
    net = models.build(c, CIFAR, 10)
    kwargs = {"reconstruction": True, "ixx_1": 5, "ixy_1": 0.5, "ixx_2": 0, "ixy_2": 0, "weight_by": "stage",
              "weight_k": 16}
    lo = [g + 1 if b == 4 else g for g, b in PPLL_K16_TABLE]
    expect = [(5 * (1 - s / 14), 0.5 * (1 - s / 14)) for s in lo] + [(0.0, 1.0)]
    for kind in ("infopro", "man"):
        np.testing.assert_allclose(aux_heads.build(kind, net, 10, kwargs).weights, expect)


def test_weights_that_leave_a_module_without_loss_or_negative_are_refused():
    """At K = 4 PPLL's rule with local_module_num 4 gives module 1 (0, 0) (lo = 2, ratio 1) and module 2
    negative weights; its K = 4 config's local_module_num 8 gives every head a positive loss."""
    ppll = {"reconstruction": True, "ixx_1": 5, "ixy_1": 0.5, "ixx_2": 0, "ixy_2": 0, "weight_by": "stage"}
    with pytest.raises(ConfigError, match="local module 1 of 4 .* never train"):
        aux_heads.build("man", resnet32(4), 10, ppll)
    weights = aux_heads.build("man", resnet32(4), 10, {**ppll, "weight_k": 8}).weights
    np.testing.assert_allclose(weights, [(5 * (1 - s / 6), 0.5 * (1 - s / 6)) for s in (1, 2, 3)] + [(0, 1)])
    with pytest.raises(ConfigError, match="local module 2 of 4 .* climb its own loss"):
        aux_heads.infopro_weights({"ixy_1": 1.0, "ixy_2": 0.25, "weight_k": 3}, 4)  # ratio 2: -1 + 0.5 < 0


def test_supervised_contrastive_loss_by_hand():
    """Three orthonormal embeddings, labels (0, 0, 1): every logit off the diagonal is 0 against 1/T on
    it, so log p(k | i) = -ln 2 for each other k; anchors 0 and 1 have one positive, anchor 2 none
    (counts 0): loss = -(ln(1/2) + ln(1/2) + 0) / 3 = (2/3) ln 2, whatever the scale of the features."""
    features = jnp.asarray(np.diag([3.0, 0.5, 2.0]))
    np.testing.assert_allclose(aux_heads.supcon_loss(features, jnp.array([0, 0, 1])), 2 / 3 * math.log(2), rtol=1e-6)
    # Two examples of one label, identical features, and one other at 90 degrees, temperature 1: the
    # positive pair's logit is 1, the other's 0: log p = 1 - ln(e + 1) for anchors 0 and 1, anchor 2 counts 0.
    same = jnp.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    expect = -(2 * (1 - math.log(math.e + 1))) / 3
    np.testing.assert_allclose(aux_heads.supcon_loss(same, jnp.array([0, 0, 1]), 1.0, 1.0), expect, rtol=1e-6)


def test_contrastive_heads_output_feature_dim_embeddings():
    """loss='contrast': the classifier's last layer outputs feature_dim (InfoPro: fc_out_channels =
    feature_dim), so 1c2f on 16 channels has Linear(128 -> 64) where cross-entropy has Linear(128 -> 10)."""
    heads = aux_heads.build("infopro", resnet32(4), 10, {"loss": "contrast", "feature_dim": 64})
    assert counts(heads)[0][0] == infopro_classifier("1c2f", 16, classes=64, feature_dim=64)


@pytest.mark.parametrize("kind,kwargs,match", [
    ("man", {"ema_decay": 1.0}, "ema_decay=1.0 must be in \\[0, 1\\)"),
    ("man", {"ema_decay": -0.1}, "ema_decay=-0.1 must be a number >= 0"),
    ("man", {"copy_depth": 5}, "copy_depth=5 copies past local module 1, which has 4 block"),
    ("infopro", {"loss": "contrast"}, "give aux_kwargs.feature_dim"),
    ("man", {"loss": "contrast"}, "give aux_kwargs.feature_dim"),
    ("infopro", {"loss": "hinge"}, "loss='hinge' is not one of"),
    ("infopro", {"weight_by": "depth"}, "weight_by='depth' is not one of module, stage"),
    ("man", {"mid_ema": 1}, "mid_ema=1 must be True or False"),
])
def test_bad_momentum_and_contrast_options_are_named(kind, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        aux_heads.build(kind, resnet32(4, norm="none"), 10, kwargs)


def test_released_middle_parts_keep_their_copies_with_mid_ema_false():
    """`InfoProResNet_mid` never updates its EMA copies (models/resnetInfoPro_gxy_ppll.py:461-500, against
    the front's :432 and the back's :558): with mid_ema=False, the default as released, the copies of the
    middle groups' modules (not each group's last) are state that never moves; the first and last groups'
    follow; every group's last module trains its copy (groups [1, 3, 4] of K = 8). mid_ema=True moves every
    copy that shares its next module's device (MAN's single-process model)."""
    heads = aux_heads.build("man", resnet32(8), 10, {}, groups=[1, 3, 4])
    kept = [bool(h.ema) for h in heads.heads[:-1]]
    moving = [h.follow is not None for h in heads.heads[:-1]]
    assert kept == [False, True, True, False, True, True, True]
    assert moving == [False, False, False, False, True, True, True]
    every = aux_heads.build("man", resnet32(8), 10, {"mid_ema": True}, groups=[1, 3, 4])
    assert [h.follow is not None for h in every.heads[:-1]] == kept
