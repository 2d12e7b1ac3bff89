"""Local learning and PPLL.

The central claim (docs/design.md, the ppll table): PPLL's pipeline over K devices gives
exactly the parameters of sequential local learning on one device after the same
batches, for stages of different shapes (a ResNet) and for a ViT. Around it: the
fill ticks must be masked, the gradient stops at every stage's input, the heads'
learning rate scales alone, compile time does not grow with the number of ticks,
and bad input fails before anything compiles.
"""
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cdpjax.config import ConfigError
from cdpjax.models import aux_heads
from helpers import assert_trees_close, assert_trees_equal, build, random_batches, run, small_config

BATCH = 8


def _config(method, model="mlp", stages=2, norm="none", head="greedy", **kw):
    return small_config(method, model, **{"norm": norm, "aux_head": head, "stages": stages, "global_batch_size": BATCH,
                                          "bn_cross_device": False, **kw})


CASES = {
    # model, K, data groups, norm, head, aux_kwargs
    # Data groups: heads without BatchNorm (with it, ppll's statistics are per data group, local's not).
    # InfoPro's supervised contrastive loss on 2c2f embeddings
    "mlp-K2-infopro-contrast": ("mlp", 2, 1, "none", "infopro", {"arch": "2c2f", "loss": "contrast", "feature_dim": 8}),
}
HEAVY = {
    "resnet-K2-infopro-reconstruction": ("resnet_tiny", 2, 1, "none", "infopro", {"reconstruction": True}),
    "vit-K4xdata2-vit": ("vit_tiny", 4, 2, "none", "vit", {"blocks": (1, 0, 1)}),  # fresh blocks, and none
    # the last module's two heads (PPLL's released ViT): its block on its own head, the classifier stopped
    "vit-K3xdata2-vit-last-head": ("vit_tiny", 3, 2, "none", "vit", {"blocks": (1, 0, 1), "last_head": True}),
    "resnet-K4-dgl-batchnorm": ("resnet_tiny", 4, 1, "batch", "dgl", {"head_lr_scale": 0.5}),
    "resnet-K2-greedy-batchnorm": ("resnet_tiny", 2, 1, "batch", "greedy", {}),
    "resnet-K3-infopro-batchnorm": ("resnet_tiny", 3, 1, "batch", "infopro", {"arch": "2c2f"}),
    "vit-K2xdata4-greedy": ("vit_tiny", 2, 4, "none", "greedy", {}),
}


@pytest.mark.parametrize("case", list(CASES) + [pytest.param(c, marks=pytest.mark.heavy) for c in HEAVY])
def test_ppll_equals_local(case):
    """After T batches and a flush, ppll on K devices has local's bodies, heads and model state."""
    model, stages, groups, norm, head, kwargs = {**CASES, **HEAVY}[case]
    kw = {"aux_kwargs": kwargs, "stages": stages}
    local = build(_config("local", model, norm=norm, head=head, **kw), {"data": 1})
    ppll = build(_config("ppll", model, norm=norm, head=head, **kw), {"stage": stages, "data": groups})
    if model.startswith("resnet"):  # what the carrier is for: stages of different sizes
        assert len(set(ppll.carrier.params.sizes)) == stages
    batches = random_batches(3, BATCH)
    s_local, s_ppll = run(local, batches), run(ppll, batches)
    assert_trees_close(ppll.export(s_ppll), local.export(s_local))
    assert_trees_close(ppll.export_heads(s_ppll), local.export_heads(s_local))
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()),
                         local.export(s_local)[0], local.export(local.init(jax.random.key(0)))[0])
    assert min(max(jax.tree.leaves(m)) for m in moved) > 1e-4  # every stage trained


GROUPED = {  # model, its options, K local modules, module groups (None: balanced by measured time), devices
    "digits-mlp-K8-on-4-by-time": ("mlp", {"width": 16, "depth": 7}, 8, None, 4),
    "digits-mlp-K16-on-4-uneven": ("mlp", {"width": 16, "depth": 15}, 16, [9, 3, 2, 2], 4),
    "resnet-K8-on-4": ("resnet", {"depths": (2, 2, 3), "widths": (4, 8, 8)}, 8, [2, 2, 2, 2], 4),
    "resnet-K16-on-4-uneven": ("resnet", {"depths": (5, 5, 5), "widths": (4, 4, 8)}, 16, [9, 3, 2, 2], 4),
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.heavy) if c.startswith("resnet-") else c
                                  for c in GROUPED])
def test_ppll_with_modules_grouped_on_devices_equals_local(case):
    """K local modules on D < K devices (PPLL's ResNet-32 with K = 16 on 4 GPUs): a device runs its
    modules one after another in a tick, each on its own loss and optimizer, and hands the last
    output on. After T batches and a flush: local's bodies and heads with the same K."""
    model, options, K, groups, devices = GROUPED[case]
    kw = {"model_kwargs": options, "stages": K, "module_groups": groups}
    local = build(_config("local", model, head="greedy", **kw), {"data": 1})
    ppll = build(_config("ppll", model, head="greedy", **kw), {"stage": devices})
    assert len(ppll.module_groups) == devices and sum(ppll.module_groups) == K
    if groups is not None:
        assert list(ppll.module_groups) == list(groups)
    batches = random_batches(devices + 1, BATCH)
    s_local, s_ppll = run(local, batches), run(ppll, batches)
    assert_trees_close(ppll.export(s_ppll), local.export(s_local))
    assert_trees_close(ppll.export_heads(s_ppll), local.export_heads(s_local))


MOMENTUM_CASES = {  # model, norm, K, module groups (None: one module per device), aux_kwargs
    # boundaries 0 -> 1 and 2 -> 3 within a device (EMA), 1 -> 2 across (the copy trained)
    "mlp-K4-groups-2-2": ("mlp", "none", 4, [2, 2], {"ema_decay": 0.5}),
}
MOMENTUM_HEAVY = {
    "mlp-K4-one-per-device": ("mlp", "none", 4, None, {}),
    # BatchNorm in the copies, InfoPro's decoder, weights by stage index
    "resnet-K3-groups-2-1-reconstruction": ("resnet_tiny", "batch", 3, [2, 1], {
        "ema_decay": 0.5, "reconstruction": True, "ixx_1": 1.0, "ixy_1": 1.0, "weight_by": "stage", "weight_k": 6}),
}


@pytest.mark.parametrize("case", list(MOMENTUM_CASES) + [pytest.param(c, marks=pytest.mark.heavy)
                                                         for c in MOMENTUM_HEAVY])
def test_ppll_equals_local_with_momentum_heads(case):
    """`man` heads: a copy of the next module follows it by EMA where the two share a device and is
    trained where they do not. With the same module groups, ppll's bodies, heads and head states
    (EMA copies included) after T batches and a flush are local's; every EMA copy moved."""
    model, norm, K, groups, kwargs = {**MOMENTUM_CASES, **MOMENTUM_HEAVY}[case]
    kw = {"aux_kwargs": kwargs, "stages": K, "module_groups": groups}
    local = build(_config("local", model, norm=norm, head="man", **kw), {"data": 1})
    ppll = build(_config("ppll", model, norm=norm, head="man", **kw), {"stage": len(groups or [1] * K)})
    batches = random_batches(3, BATCH)
    s_local, s_ppll = run(local, batches), run(ppll, batches)
    assert_trees_close(ppll.export(s_ppll), local.export(s_local))
    assert_trees_close(ppll.export_heads(s_ppll), local.export_heads(s_local))
    states = local.export_head_state(s_local)
    follows = {"mlp-K4-groups-2-2": [0, 2], "mlp-K4-one-per-device": [],  # modules whose next shares the device
               "resnet-K3-groups-2-1-reconstruction": [0]}[case]
    assert [j for j, st in enumerate(states) if "ema" in st] == follows
    if follows:
        assert_trees_close(ppll.export_head_state(s_ppll), states)
        start = local.export_head_state(local.init(jax.random.key(0)))
        for j in follows:
            moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()),
                                 states[j]["ema"], start[j]["ema"])
            assert min(jax.tree.leaves(moved)) > 1e-6


def test_local_momentum_copy_is_the_moving_average_of_the_next_module():
    """Written out: ema_{t+1} = m ema_t + (1 - m) theta_{j+1, t}, theta_{j+1, t} module j+1's parameters
    when batch t reaches it (before its own update on t); every module on one device (groups [3])."""
    m, K = 0.8, 3
    local = build(_config("local", head="man", stages=K, module_groups=[K], aux_kwargs={"ema_decay": m}),
                  {"data": 1})
    state = local.init(jax.random.key(0))
    ema = [jax.device_get(state.head_state[j]["ema"]["momentum_copy"]["blocks_0"]) for j in range(K - 1)]
    for batch in random_batches(3, BATCH):
        before = jax.device_get(state.params.body)
        state, _ = local.train_step(state, batch)
        ema = [jax.tree.map(lambda e, p: m * e + (1 - m) * p, ema[j], before[j + 1]["blocks_0"]) for j in range(K - 1)]
    for j in range(K - 1):
        assert_trees_close(jax.device_get(state.head_state[j]["ema"]["momentum_copy"]["blocks_0"]), ema[j])


def test_ppll_losses_are_locals_delayed_by_the_pipeline():
    """Stage j's loss at tick t is local's stage-j loss on batch t-j; fill ticks report nothing."""
    stages = 4
    local = build(_config("local", stages=stages), {"data": 1})
    ppll = build(_config("ppll", stages=stages), {"stage": stages})
    batches = random_batches(5, BATCH)
    s_local, s_ppll = local.init(jax.random.key(0)), ppll.init(jax.random.key(0))
    local_losses, ppll_losses, valid = [], [], []
    for b in batches:
        s_local, m = local.train_step(s_local, b)
        local_losses.append(np.asarray(m["stage_loss"]))
        s_ppll, m = ppll.train_step(s_ppll, b)
        ppll_losses.append(np.asarray(m["stage_loss"]))
        valid.append(np.asarray(m["stage_valid"]))
    for t in range(len(batches)):
        for j in range(stages):
            assert valid[t][j] == (t >= j)
            if t >= j:
                np.testing.assert_allclose(ppll_losses[t][j], local_losses[t - j][j], rtol=1e-5)


def test_fill_ticks_are_masked():
    """After the first tick only stage 0 has trained: the later stages ran on no batch and kept
    their parameters, heads and optimizer states bit for bit (unmasked, they would move)."""
    stages = 4
    ppll = build(_config("ppll", stages=stages, momentum=0.9), {"stage": stages})
    init = jax.device_get(ppll.init(jax.random.key(0)))
    state, _ = ppll.train_step(ppll.init(jax.random.key(0)), random_batches(1, BATCH)[0])
    state = jax.device_get(state)
    for key in ("rows", "opt_state"):
        for a, b in zip(jax.tree.leaves(getattr(state, key)), jax.tree.leaves(getattr(init, key))):
            np.testing.assert_array_equal(a[1:], b[1:])  # devices 1..3 (stages 1..3): untouched
    assert np.abs(state.rows.body[0] - init.rows.body[0]).max() > 1e-4


def test_local_with_one_stage_is_e2e():
    """One stage has no auxiliary head: local learning is then plain backprop."""
    e2e = build(_config("e2e", stages=1), {"data": 1})
    local = build(_config("local", stages=1), {"data": 1})
    batches = random_batches(3, BATCH)
    assert_trees_close(local.export(run(local, batches)), e2e.export(run(e2e, batches)), atol=1e-6)


def test_gradient_stops_at_stage_input():
    """Stage 0's update depends on its own head but on nothing after it."""
    local = build(_config("local", stages=2), {"data": 1})
    batch = random_batches(1, BATCH)[0]

    def stage0_after_step(change):
        state = local.init(jax.random.key(0))
        state = state._replace(params=change(state.params))
        state, _ = local.train_step(state, batch)
        return jax.device_get((state.params.body[0], state.params.head[0]))

    def shift(tree):  # not a uniform shift of a classifier: softmax would ignore that
        return jax.tree.map(lambda x: 2.0 * x + 0.1, tree)

    base = stage0_after_step(lambda p: p)
    later_changed = stage0_after_step(lambda p: p._replace(body=[p.body[0], shift(p.body[1])]))
    own_head_changed = stage0_after_step(lambda p: p._replace(head=[shift(p.head[0]), p.head[1]]))
    assert_trees_equal(later_changed, base)
    diff = jax.tree.map(lambda x, y: float(np.abs(x - y).max()), own_head_changed[0], base[0])
    assert max(jax.tree.leaves(diff)) > 1e-6  # the test would see a gradient arriving


@pytest.mark.parametrize("head", ["greedy", "dgl"])
def test_head_learning_rate_scale(head):
    """With plain SGD the heads' first update scales with head_lr_scale; the bodies' does not (also
    for heads with BatchNorm state)."""
    kw = dict(stages=2, momentum=0.0, weight_decay=0.0, schedule="constant", head=head)
    batch = random_batches(1, BATCH)[0]
    deltas = []
    for scale in (1.0, 0.25):
        local = build(_config("local", aux_kwargs={"head_lr_scale": scale}, **kw), {"data": 1})
        start = jax.device_get(local.init(jax.random.key(0)).params)
        end, _ = local.train_step(local.init(jax.random.key(0)), batch)
        deltas.append(jax.tree.map(lambda x, y: np.asarray(x) - y, jax.device_get(end.params), start))
    assert_trees_close(deltas[1].body, deltas[0].body, atol=1e-7)
    assert_trees_close(deltas[1].head, jax.tree.map(lambda d: 0.25 * d, deltas[0].head), atol=1e-7)


def test_compile_time_does_not_grow_with_ticks(no_compilation_cache):
    """Ticks are a `lax.scan`: the compiled program of 64 ticks has as many instructions as that
    of 8 (only the trip count and the stacked shapes differ), and compiling it takes about as
    long (a generous bound: timings on shared cores are noisy)."""
    stages = 4
    ppll = build(_config("ppll", stages=stages), {"stage": stages})
    state = ppll.init(jax.random.key(0))
    seconds, instructions = {}, {}
    for ticks in (9, 8, 64):  # 9: a first compile that warms up tracing (each length compiles anew)
        batches = {"image": jnp.zeros((ticks, BATCH, 8, 8, 1)), "label": jnp.zeros((ticks, BATCH), jnp.int32)}
        t0 = time.perf_counter()
        text = ppll.run_steps.lower(state, batches).compile().as_text()
        seconds[ticks] = time.perf_counter() - t0
        instructions[ticks] = sum(1 for line in text.splitlines() if " = " in line and "constant(" not in line)
    assert instructions[64] == instructions[8], instructions
    assert seconds[64] < 2 * seconds[8], seconds


def test_run_ticks_equals_train_steps():
    stages = 2
    ppll = build(_config("ppll", stages=stages), {"stage": stages})
    batches = random_batches(3, BATCH)
    stacked = {k: np.stack([b[k] for b in batches]) for k in batches[0]}
    scanned, metrics = ppll.run_steps(ppll.init(jax.random.key(0)), stacked)
    assert metrics["stage_loss"].shape == (3, stages)
    stepped = ppll.init(jax.random.key(0))
    for b in batches:
        stepped, _ = ppll.train_step(stepped, b)
    assert_trees_close(ppll.export(scanned), ppll.export(stepped), atol=1e-6)


def test_heads_fit_their_stages():
    """Every head kind builds from its stage's output shape and gives a scalar loss and a state of
    the structure it started with (abstractly evaluated: shapes only); the last stage has no head.
    A head's module returns logits, or InfoPro's (logits, image logits or None)."""
    from cdpjax import models

    for model, kind, kwargs in [("resnet_tiny", "greedy", {}), ("resnet_tiny", "dgl", {}),
                                ("resnet_tiny", "infopro", {"reconstruction": True}), ("vit_tiny", "vit", {}),
                                ("mlp", "greedy", {}), ("mlp", "dgl", {}), ("mlp", "infopro", {}),
                                ("vit_tiny", "infopro", {"arch": "2c2f"}),
                                ("resnet_tiny", "man", {"reconstruction": True}), ("mlp", "man", {})]:
        net = models.build(_config("local", model, stages=3), (8, 8, 1), 10)
        heads = aux_heads.build(kind, net, 10, kwargs)
        params, state = jax.eval_shape(heads.init, jax.random.key(0))
        assert heads.modules[-1] is None and params[-1] == {} and state[-1] == {}
        labels, images = jnp.zeros(2, jnp.int32), jnp.ones((2, 8, 8, 1))
        for j, shape in enumerate(heads.feature_shapes[:-1]):
            y = jnp.ones((2, *shape))
            out = jax.eval_shape(lambda p, s, y: heads.modules[j].apply({"params": {**p, **s.get("ema", {})}, **{
                k: v for k, v in s.items() if k != "ema"}}, y), params[j], state[j], y)
            logits, recon = out if isinstance(out, tuple) else (out, None)
            assert logits.shape == (2, 10)
            assert (recon is not None) == bool(kwargs.get("reconstruction"))
            if recon is not None:
                assert recon.shape == (2, 8, 8, 1)  # the image's logits
            loss, (acc, new_state) = jax.eval_shape(
                lambda p, s, y: heads.loss(j, p, s, y, labels, images, True), params[j], state[j], y)
            assert loss.shape == () and acc.shape == ()
            assert jax.tree.structure(new_state) == jax.tree.structure(state[j])
        assert heads.needs_image == bool(kwargs.get("reconstruction"))


def test_vit_head_depths_follow_ppll():
    from cdpjax import models

    net = models.build(_config("local", "vit_tiny", stages=[1, 2, 3, 4, 5]), (8, 8, 1), 10)
    heads = aux_heads.build("vit", net, 10, {})
    assert [m.depth for m in heads.modules[:-1]] == [2, 2, 2, 1, 1]
    assert heads.modules[0].heads == 2  # the network's own encoder shape


def test_infopro_reconstruction_weights_interpolate():
    """InfoPro's rule over the K-1 heads: r_j = j / (K-2), w_j = w_1 (1 - r_j) + w_2 r_j; the last
    module trains on plain cross-entropy."""
    from cdpjax import models

    net = models.build(_config("local", "resnet_tiny", stages=4), (8, 8, 1), 10)
    kwargs = {"reconstruction": True, "ixx_1": 2.0, "ixy_1": 0.5, "ixx_2": 0.0, "ixy_2": 1.5}
    heads = aux_heads.build("infopro", net, 10, kwargs)
    assert heads.weights == ((2.0, 0.5), (1.0, 1.0), (0.0, 1.5), (0.0, 1.0))


def test_adaptive_pool_is_pytorchs():
    x = jnp.arange(5 * 5, dtype=jnp.float32).reshape(1, 5, 5, 1)
    out = aux_heads.adaptive_avg_pool(x, 2)[0, :, :, 0]
    grid = np.arange(25.0).reshape(5, 5)  # windows [0, 3) and [2, 5): they overlap on row / column 2
    expect = [[grid[:3, :3].mean(), grid[:3, 2:].mean()], [grid[2:, :3].mean(), grid[2:, 2:].mean()]]
    np.testing.assert_allclose(out, expect)
    out = aux_heads.adaptive_avg_pool(x, (1, 3))[0, :, :, 0]  # columns [0, 2), [1, 4), [3, 5)
    np.testing.assert_allclose(out, [[grid[:, :2].mean(), grid[:, 1:4].mean(), grid[:, 3:].mean()]])


@pytest.mark.parametrize("changes,mesh_axes,match", [
    ({"aux_head": "vit", "model": "resnet_tiny"}, {"stage": 2}, "token outputs"),
    ({"aux_kwargs": {"reconstruction": True}, "aux_head": "infopro"}, {"stage": 2}, "image-like"),
    ({"aux_kwargs": {"depth": 3}}, {"stage": 2}, "aux_kwargs.depth"),
    ({"aux_kwargs": {"head_lr_scale": -1.0}}, {"stage": 2}, "head_lr_scale"),
    ({"stages": 2}, {"stage": 4}, "on one device at most: mesh.stage=4"),
    ({"stages": 4, "module_groups": [1, 2]}, {"stage": 2}, "add up to the 4 local modules"),
    ({"stages": 4, "module_groups": [1, 1, 2]}, {"stage": 2}, "runs on 3 stage devices but mesh.stage=2"),
    ({"norm": "batch", "bn_cross_device": True}, {"stage": 2, "data": 2}, "bn_cross_device"),
    ({"global_batch_size": 9}, {"stage": 2, "data": 2}, "global_batch_size=9"),
    ({}, {"data": 2}, "stage"),
    ({"stages": 4, "aux_head": "man"}, {"stage": 2}, "give module_groups \\(e.g. \\[2, 2\\]\\) for mesh.stage=2"),
    ({"stages": 4, "aux_head": "man", "module_groups": [1, 2]}, {"stage": 2}, "add up to the 4 local modules"),
])
def test_bad_config_fails_early(changes, mesh_axes, match, compiles):
    c = _config("ppll", **changes)
    with pytest.raises(ConfigError, match=match):
        build(c, mesh_axes)
    assert not [e for e in compiles if e[0] == "backend"], compiles  # refused before compiling anything


# greedy, the default head, is resumed in CI by tests/test_reliability.py (the train state as a
# pytree, whatever its leaves); man's EMA leaves here, with `make test-heavy`
@pytest.mark.parametrize("head", [pytest.param("greedy", marks=pytest.mark.heavy),
                                  pytest.param("man", marks=pytest.mark.heavy)])
def test_ppll_resume_equals_uninterrupted(head, digits_config, tmp_path):
    """The pipeline's queues are part of the checkpointed state: a run killed mid-way and resumed
    ends with the parameters and metrics of an uninterrupted one (flushed once, at the end). With
    `man` heads (4 modules as [2, 2]) their EMA copies are checkpointed state too."""
    from cdpjax import setup as setup_lib, train
    from cdpjax.checkpoint import Checkpointer

    c = digits_config
    c.method, c.model, c.stages, c.num_steps, c.checkpoint_every, c.eval_every = "ppll", "mlp", 2, 8, 4, 4
    c.mesh = {"stage": 2, "data": -1}
    if head == "man":
        c.aux_head, c.stages, c.module_groups = "man", 4, [2, 2]
    full = train.train(c, str(tmp_path / "full"), progress=False)
    part = tmp_path / "part"
    assert train.train(c, str(part), progress=False, stop_after=6) == {"stopped_at": 6}
    resumed = train.train(c, str(part), progress=False)
    assert resumed["resumed_from"] == 4 and resumed["test_accuracy"] == full["test_accuracy"]

    def final(workdir):
        _, _, method = setup_lib.setup(c)
        ckpt = Checkpointer(str(workdir))
        state, _ = ckpt.restore(ckpt.latest_step(), method.init(jax.random.key(c.seed)))
        ckpt.close()
        return jax.device_get((method.export(state)[0], method.export_head_state(state)))

    jax.tree.map(np.testing.assert_array_equal, final(part), final(tmp_path / "full"))
    from metrics_lines import without_timing  # metrics.jsonl less its timing fields

    assert without_timing((part / "metrics.jsonl").read_text()) == without_timing(
        (tmp_path / "full" / "metrics.jsonl").read_text())
