"""The last local module's two heads, as PPLL's released ViT trains its last part.

`models/vit_model.py:936-941` (gxy233/Faster-Multi-GPU-Training-with-PPLL): each block of the back
part, the last included, backpropagates its `AuxClassifier`'s cross-entropy and is detached;
`:951-969` and `util/utils.py:243-249`: the final LayerNorm and classifier run on the detached
features and backpropagate their own cross-entropy. So the classifier's parameters get the gradient
of CE(classifier(sg(h))) alone, the last block's of CE(aux(h)) alone, the aux head's of CE(aux(h)).
Here that rule is written out by hand (each block applied on its own, the stop by feeding a
constant) and compared with one `local` step; `ppll` then equals `local` with such heads.
"""
import jax
import jax.numpy as jnp
import optax
import pytest

from cdpjax.config import ConfigError
from cdpjax.models import aux_heads
from helpers import assert_trees_close, build, random_batches, run, small_config

BATCH, LR = 8, 0.5
STAGES = 3  # vit_tiny: [patch embedding, 4 encoder blocks, head] -> the last module holds encoder 4 and head


def _config(method, **overrides):
    return small_config(method, "vit_tiny", **{
        "stages": STAGES, "aux_head": "vit", "global_batch_size": BATCH, "learning_rate": LR, "momentum": 0.0,
        "weight_decay": 0.0, "schedule": "constant", "aux_kwargs": {"blocks": (1, 0, 1), "last_head": True},
        **overrides})


def _ce(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _blockwise(net, body):
    """Per block, its parameters (each stage's Chain names its blocks blocks_0, blocks_1, ...)."""
    return [body[j][f"blocks_{i - a}"] for j, (a, b) in enumerate(net.bounds) for i in range(a, b)]


def test_last_module_trains_block_on_its_head_and_classifier_on_stopped_features():
    method = build(_config("local"), {"data": 1})
    net, heads = method.net, method.heads
    start = method.init(jax.random.key(0))
    body0 = method.export(start)[0]
    head0 = method.export_heads(start)[-1]
    batch = random_batches(1, BATCH)[0]
    blocks, per_block = net.blocks, _blockwise(net, body0)
    x = jnp.asarray(batch["image"])
    for block, p in zip(blocks[:-2], per_block[:-2]):  # everything before the last module's encoder block
        x = block.apply({"params": p}, x)
    labels = jnp.asarray(batch["label"])
    aux = heads.heads[-1].module

    def aux_loss(encoder, head):  # the last block and its own head: LayerNorm + linear (0 blocks)
        return _ce(aux.apply({"params": head}, blocks[-2].apply({"params": encoder}, x)), labels)

    h0 = blocks[-2].apply({"params": per_block[-2]}, x)  # a constant: the stop, by construction

    def classifier_loss(classifier):
        return _ce(blocks[-1].apply({"params": classifier}, h0), labels)

    g_encoder, g_head = jax.grad(aux_loss, argnums=(0, 1))(per_block[-2], head0)
    g_classifier = jax.grad(classifier_loss)(per_block[-1])
    step = lambda p, g: jax.tree.map(lambda a, b: a - LR * b, p, g)  # noqa: E731 - plain SGD
    expected_body = dict(body0[-1], blocks_0=step(per_block[-2], g_encoder), blocks_1=step(per_block[-1], g_classifier))

    state = run(method, [batch], flush=False)
    assert_trees_close(method.export(state)[0][-1], expected_body)
    assert_trees_close(method.export_heads(state)[-1], step(head0, g_head))
    # The rule is not one head's: the classifier's loss through h would move the block otherwise.
    one_head = jax.grad(lambda e: _ce(blocks[-1].apply({"params": per_block[-1]},
                                                       blocks[-2].apply({"params": e}, x)), labels))(per_block[-2])
    gap = max(jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), one_head, g_encoder)))
    assert gap > 1e-3


@pytest.mark.heavy
def test_ppll_equals_local_with_a_last_head():
    """Three modules on three devices, then on two ([1, 2]: the last head on the device that also runs
    module 1): after the batches and a flush, local's bodies and heads."""
    batches = random_batches(3, BATCH)
    local = build(_config("local"), {"data": 1})
    s_local = run(local, batches)
    for groups, devices in ((None, STAGES), ([1, 2], 2)):
        ppll = build(_config("ppll", module_groups=groups), {"stage": devices})
        s_ppll = run(ppll, batches)
        assert_trees_close(ppll.export(s_ppll), local.export(s_local))
        assert_trees_close(ppll.export_heads(s_ppll), local.export_heads(s_local))


def test_last_head_is_refused_where_it_cannot_be_built():
    """A kind that builds no last head, a last module holding the classifier alone, a non-boolean."""
    net = build(_config("local"), {"data": 1}).net
    with pytest.raises(ConfigError, match="last_head is not an option of the 'greedy' head"):
        aux_heads.build("greedy", net, 10, {"last_head": True})
    with pytest.raises(ConfigError, match="must be True or False"):
        aux_heads.build("vit", net, 10, {"last_head": 1})
    alone = build(_config("local", stages=[1, 5], aux_kwargs={}), {"data": 1}).net
    assert alone.bounds[-1] == (5, 6)
    with pytest.raises(ConfigError, match="needs a block before the classifier"):
        aux_heads.build("vit", alone, 10, {"last_head": True})


def test_released_vit_recipe_gives_the_last_module_its_head():
    """recipe=ppll: `last_head` (the back part's last block on its own AuxClassifier, of no blocks
    since `range(2 - 4 + 1)` is empty); recipe=infopro keeps the one head cdpjax had."""
    import os

    from cdpjax.config import load_file

    configs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cdpjax", "configs")
    assert load_file(os.path.join(configs, "ppll_vit.py")).aux_kwargs.last_head is True
    assert "last_head" not in load_file(os.path.join(configs, "ppll_vit.py:recipe=infopro")).aux_kwargs


def test_the_last_head_is_counted_where_heads_are_costed():
    """describe's per-module head size and FLOPs and speedup's head timings include the last head: with
    `blocks=(1, 0, 0)` it is LayerNorm and a linear layer on vit_tiny's 32-wide tokens, 2 x 32 + 32 x 10 + 10
    parameters (written out), read from the classifier's input."""
    from cdpjax.commands.describe import _stages
    from cdpjax.speedup import measure_stage_costs

    net = build(_config("local"), {"data": 1}).net
    heads = aux_heads.build("vit", net, 10, {"blocks": (1, 0, 0), "last_head": True})
    last = _stages(net, heads)[-1]
    assert last["head_params"] == 2 * 32 + 32 * 10 + 10 and last["head_flops"] > 0
    assert len(measure_stage_costs(net, 4, repeats=1, heads=heads).head) == STAGES
