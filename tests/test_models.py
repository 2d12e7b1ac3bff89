"""The model zoo and stage partitions: shapes, parameter counts, staged == whole, balanced cuts, BN across devices."""
import itertools

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from cdpjax import models
from cdpjax.errors import ConfigError
from cdpjax.mesh import make_mesh
from cdpjax.models import partition
from cdpjax.models.staging import Chain

DIGITS = (8, 8, 1)
CIFAR = (32, 32, 3)


def blocks_of(name, shape=CIFAR, classes=10, **kwargs):
    return models.REGISTRY[name](num_classes=classes, input_shape=shape, **kwargs)


def num_params(name, shape=CIFAR, classes=10, **kwargs):
    return int(sum(partition.block_costs(blocks_of(name, shape, classes, **kwargs), shape, "params")))


def config(model, stages, norm="batch", partition_by="params", **model_kwargs):
    return ml_collections.ConfigDict({"model": model, "model_kwargs": model_kwargs, "norm": norm,
                                      "stages": stages, "partition": partition_by})


def images(shape, batch, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(batch, *shape)), jnp.float32)


def key(seed):
    # XLA:CPU takes 1-2 s to compile each threefry draw; the 'rbg' generator compiles in a
    # tenth of that, and these tests only need some initial parameters.
    return jax.random.key(seed, impl="rbg")


# On 8x8 digits the tiny models run in test_staged_apply_equals_one_chain.
@pytest.mark.parametrize("name,shape,kwargs", [
    ("resnet_tiny", CIFAR, {}),
    ("resnet32", CIFAR, {}),
    ("resnet18", CIFAR, {}),
    ("vit_tiny", CIFAR, {}),
])
def test_forward_runs(name, shape, kwargs):
    net = models.build(config(name, 2, **kwargs), shape, 10)
    params, state = net.init(key(0))
    logits, new_state = jax.jit(lambda p, s, x: net.apply(p, s, x, True))(params, state, images(shape, 2))
    assert logits.shape == (2, 10)
    assert np.all(np.isfinite(logits))
    assert jax.tree.structure(new_state) == jax.tree.structure(state)


@pytest.mark.parametrize("name,shape,kwargs,blocks", [
    ("resnet18", CIFAR, {"stem": "imagenet"}, 10),
    ("resnet50", CIFAR, {}, 18),
    ("resnet50", (64, 64, 3), {"stem": "imagenet"}, 18),
    ("vit_b", CIFAR, {}, 14),
])
def test_large_models_abstract(name, shape, kwargs, blocks):
    net = models.build(config(name, 4, partition_by="blocks", **kwargs), shape, 10)
    assert len(net.blocks) == blocks
    params, state = jax.eval_shape(lambda: net.init(jax.random.key(0)))
    logits = jax.eval_shape(lambda p, s, x: net.apply(p, s, x, True)[0], params, state,
                            jax.ShapeDtypeStruct((2, *shape), jnp.float32))
    assert logits.shape == (2, 10)


def test_stems_and_patches_set_the_resolution():
    cifar = partition.block_shapes(blocks_of("resnet18"), CIFAR)
    imagenet = partition.block_shapes(blocks_of("resnet18", (64, 64, 3), stem="imagenet"), (64, 64, 3))
    assert cifar[1] == (1, 32, 32, 64) and cifar[-2] == (1, 4, 4, 512)
    assert imagenet[1] == (1, 16, 16, 64) and imagenet[-2] == (1, 2, 2, 512)
    assert partition.block_shapes(blocks_of("resnet32"), CIFAR)[-2] == (1, 8, 8, 64)
    assert partition.block_shapes(blocks_of("resnet50"), CIFAR)[-2] == (1, 4, 4, 2048)
    # ViT: tokens [B, 1 + patches, D] between every pair of blocks.
    assert set(partition.block_shapes(blocks_of("vit_b"), CIFAR)[1:-1]) == {(1, 65, 768)}
    assert set(partition.block_shapes(blocks_of("vit_tiny", DIGITS), DIGITS)[1:-1]) == {(1, 17, 32)}


def test_parameter_counts():
    # CIFAR stem, 10 classes (the CDP paper's models), and InfoPro's ResNet-32 (projection shortcuts).
    assert num_params("resnet18") == 11_173_962
    assert num_params("resnet50") == 23_520_842
    assert num_params("resnet32") == 466_906
    # torchvision's and timm's ImageNet models, counted independently of this code.
    imagenet = (224, 224, 3)
    assert num_params("resnet18", imagenet, 1000, stem="imagenet") == 11_689_512
    assert num_params("resnet50", imagenet, 1000, stem="imagenet") == 25_557_032
    assert num_params("vit_b", imagenet, 1000) == 86_567_656  # ViT-B/16
    # GroupNorm has BatchNorm's affine parameters; 'none' drops them.
    assert num_params("resnet32", norm="group") == 466_906
    assert num_params("resnet32", norm="none") < 466_906
    assert num_params("resnet_tiny", width=2.0) > num_params("resnet_tiny")


def merged(net, per_stage):
    """Per-stage variables renamed to the block indices of one Chain over every block."""
    out = {}
    for (a, b), tree in zip(net.bounds, per_stage):
        for i in range(b - a):
            if f"blocks_{i}" in tree:
                out[f"blocks_{a + i}"] = tree[f"blocks_{i}"]
    return out


@pytest.mark.parametrize("name,shape,norm,stages", [
    ("resnet_tiny", DIGITS, "batch", 3),
    ("resnet_tiny", DIGITS, "group", [1, 5]),
    ("resnet32", CIFAR, "batch", 4),
    ("vit_tiny", DIGITS, "batch", 3),
])
def test_staged_apply_equals_one_chain(name, shape, norm, stages):
    net = models.build(config(name, stages, norm=norm), shape, 10)
    assert net.num_stages == (stages if isinstance(stages, int) else len(stages) + 1)
    params, state = net.init(key(1))
    whole = Chain(tuple(net.blocks))
    variables = {"params": merged(net, params)}
    if any(state):
        variables["batch_stats"] = merged(net, [s.get("batch_stats", {}) for s in state])
    x = images(shape, 4)
    for train in (False, True):
        staged, staged_state = net.apply(params, state, x, train)
        if train and "batch_stats" in variables:
            reference, new = whole.apply(variables, x, train=True, mutable=["batch_stats"])
            chex.assert_trees_all_close(merged(net, [s["batch_stats"] for s in staged_state]),
                                        new["batch_stats"], rtol=1e-5, atol=1e-5)
        else:
            reference = whole.apply(variables, x, train=train)
        np.testing.assert_allclose(staged, reference, rtol=1e-5, atol=1e-5)


def test_more_stages_than_blocks_is_a_config_error():
    with pytest.raises(ConfigError, match="resnet_tiny has only 6 blocks"):
        models.build(config("resnet_tiny", 7), DIGITS, 10)
    with pytest.raises(ConfigError, match="17 blocks"):
        models.build(config("resnet32", [4, 4]), CIFAR, 10)


@pytest.mark.parametrize("name,kwargs,match", [
    ("resnet18", {"stem": "tiny"}, "stem='tiny'"),
    ("resnet", {"block": "wide"}, "block='wide'"),
    ("resnet", {"depths": (2, 2), "widths": (8,)}, "depths"),
    ("vit_tiny", {"patch": 3}, "patch=3"),
    ("vit", {"dim": 30, "heads": 4}, "heads=4"),
])
def test_bad_model_arguments_are_config_errors(name, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        blocks_of(name, DIGITS, **kwargs)


def test_unknown_partition_strategy_is_a_config_error():
    with pytest.raises(ConfigError, match="partition='memroy' is not one of"):
        partition.split_points(blocks_of("resnet_tiny", DIGITS), 3, "memroy", DIGITS)


def test_balanced_points_is_the_optimal_contiguous_partition():
    rng = np.random.default_rng(0)
    for n, stages in [(5, 2), (7, 3), (8, 4), (9, 5), (6, 6)]:
        costs = rng.integers(1, 100, n).astype(float)
        best = min(max(sum(costs[a:b]) for a, b in zip((0, *cut), (*cut, n)))
                   for cut in itertools.combinations(range(1, n), stages - 1))
        points = partition.balanced_points(costs, stages)
        assert len(points) == stages - 1
        assert max(sum(costs[a:b]) for a, b in zip((0, *points), (*points, n))) == best
    # Ties on the maximum go to the most even cut.
    assert partition.balanced_points([1, 1, 1, 1, 4], 3) == (2, 4)


@pytest.mark.parametrize("name,shape", [("resnet18", CIFAR), ("resnet32", CIFAR), ("resnet50", CIFAR),
                                        ("vit_tiny", DIGITS), ("resnet_tiny", DIGITS)])
@pytest.mark.parametrize("metric", ["params", "flops"])
def test_balanced_split_beats_or_equals_the_even_split(name, shape, metric):
    blocks = blocks_of(name, shape)
    costs = partition.block_costs(blocks, shape, metric)
    for stages in (2, 3, 4):
        balanced = partition.split_points(blocks, stages, metric, shape)
        even = partition.split_points(blocks, stages, "blocks", shape)
        assert even == partition.even_points(len(blocks), stages)
        report_b = partition.balance_report(blocks, balanced, shape)
        report_e = partition.balance_report(blocks, even, shape)
        assert max(report_b[metric]) <= max(report_e[metric]) * (1 + 1e-9)
        assert report_b[f"{metric}_imbalance"] <= report_e[f"{metric}_imbalance"] * (1 + 1e-9)
        np.testing.assert_allclose(sum(report_b[metric]), sum(costs), rtol=1e-9)


def test_time_partition_is_the_minimax_cut_of_the_measured_block_times(monkeypatch):
    """partition='time' cuts where the measured seconds say: with block times injected, its cut's
    slowest stage equals the brute-force minimum over every cut, and `models.build` asks for the
    times at a tick's micro-batch (global batch 64 over 4 workers: 16)."""
    asked = []
    seconds = (0.5, 3.0, 1.0, 1.0, 2.5, 0.25, 4.0, 0.5)

    def injected(blocks, input_shape, batch_size, input_dtype="float32", repeats=5):
        asked.append(batch_size)
        return seconds[:len(blocks)]

    monkeypatch.setattr(partition, "block_seconds", injected)
    blocks = blocks_of("resnet_tiny", DIGITS)
    n = len(blocks)
    times = seconds[:n]
    for stages in range(2, n):
        cut = partition.split_points(blocks, stages, "time", DIGITS, batch_size=16)
        slowest = max(sum(times[a:b]) for a, b in zip((0, *cut), (*cut, n)))
        best = min(max(sum(times[a:b]) for a, b in zip((0, *c), (*c, n)))
                   for c in itertools.combinations(range(1, n), stages - 1))
        assert slowest == best
    c = config("resnet_tiny", 3)
    c.partition, c.global_batch_size, c.workers = "time", 64, 4
    models.build(c, DIGITS, 10)
    assert asked[-1] == 16


def test_block_seconds_times_every_block():
    from cdpjax.models.mlp import mlp

    blocks = tuple(mlp(10, DIGITS, width=16, depth=3))
    seconds = partition.block_seconds(blocks, DIGITS, 4, repeats=2)
    assert len(seconds) == len(blocks) and all(s > 0 for s in seconds)
    from cdpjax.models.gpt import gpt  # token ids in: the first block has no input gradient

    tokens = gpt(11, (6,), width=16, depth=2, heads=2, mlp_dim=32)
    seconds = partition.block_seconds(tokens, (6,), 4, "int32", repeats=2)
    assert len(seconds) == len(tokens) and all(s > 0 for s in seconds)


def test_balance_report_of_resnet18():
    blocks = blocks_of("resnet18")
    points = partition.split_points(blocks, 4, "params", CIFAR)
    report = partition.balance_report(blocks, points, CIFAR)
    assert sum(report["params"]) == 11_173_962
    # No cut can beat the largest single block (the last residual block, 4.72M).
    assert max(report["params"]) == max(partition.block_costs(blocks, CIFAR, "params")) == 4_720_640
    assert report["params_imbalance"] == pytest.approx(max(report["params"]) / (11_173_962 / 4))
    assert report["bounds"] == list(zip((0, *points), (*points, 10)))
    # FLOPs: the stem at full resolution dominates, deep blocks are cheap per parameter.
    flops = partition.block_costs(blocks, CIFAR, "flops")
    assert flops[1] > 100 * flops[-1] and min(flops[:-1]) > 0
    # The CDP paper's cut (4 stages by FLOPs) is strictly more even than 10 blocks cut 2/3/3/2.
    by_flops = partition.balance_report(blocks, partition.split_points(blocks, 4, "flops", CIFAR), CIFAR)
    by_blocks = partition.balance_report(blocks, partition.even_points(10, 4), CIFAR)
    assert by_flops["flops_imbalance"] < by_blocks["flops_imbalance"] - 0.1


def test_infopro_splits():
    assert partition.INFOPRO_SPLITS[4] == (4, 8, 12)  # after [g1, b2], [g2, b1], [g3, b0]
    assert partition.INFOPRO_SPLITS[2] == (8,)
    assert partition.INFOPRO_SPLITS[8] == (2, 4, 6, 8, 10, 12, 14)
    assert partition.INFOPRO_SPLITS[16] == tuple(range(1, 16))  # stem alone; last block with the head
    for k in (2, 4, 8, 16):
        net = models.build(config("resnet32", partition.infopro_points(k)), CIFAR, 10)
        assert net.num_stages == k
        shapes = partition.block_shapes(net.blocks, CIFAR)
        # The cuts fall where InfoPro's do: e.g. K=4 after a 16-, a 32- and a 64-channel block.
        if k == 4:
            assert [shapes[a][1:] for a, _ in net.bounds[1:]] == [(32, 32, 16), (16, 16, 32), (8, 8, 64)]
    # The FLOPs-balanced 4-way cut of ResNet-32 is InfoPro's.
    assert partition.split_points(blocks_of("resnet32"), 4, "flops", CIFAR) == partition.INFOPRO_SPLITS[4]
    with pytest.raises(ConfigError, match="K=5"):
        partition.infopro_points(5)


def test_cross_device_batchnorm_matches_the_global_batch():
    mesh = make_mesh({"data": 8})
    cfg = config("resnet_tiny", 2, norm="batch")
    local = models.build(cfg, DIGITS, 10, bn_axis_name="data")
    single = models.build(cfg, DIGITS, 10)
    params, state = single.init(key(2))
    x = images(DIGITS, 16, seed=3)

    def step(p, s, xs):
        return local.apply(p, s, xs, True)

    sharded = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data")),
                                    out_specs=(P("data"), P()), check_vma=True))
    logits, new_state = sharded(params, state, x)
    ref_logits, ref_state = jax.jit(lambda p, s, v: single.apply(p, s, v, True))(params, state, x)
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(new_state, ref_state, rtol=1e-5, atol=1e-5)
    # Per-device statistics (no axis name) differ: the test can tell the two apart.
    per_device = jax.jit(jax.shard_map(lambda p, s, xs: single.apply(p, s, xs, True)[0], mesh=mesh,
                                       in_specs=(P(), P(), P("data")), out_specs=P("data"), check_vma=False))
    assert not np.allclose(per_device(params, state, x), ref_logits, atol=1e-3)
