"""Sequence auxiliary heads: shapes, causality, PPLL's depths, and a local module of a GPT trained on
its head's per-token loss."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cdpjax import data, tasks
from cdpjax.config import default_config
from cdpjax.errors import ConfigError
from cdpjax.models import build
from cdpjax.models.sequence_heads import TokenBlocksHead, TokenLinearHead, ppll_depth, token_blocks_head

B, T, D, V = 2, 7, 16, 11


def features(seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(B, T, D)), jnp.float32)


@pytest.mark.parametrize("head", [TokenLinearHead(V), TokenBlocksHead(V, depth=2, heads=2, mlp_dim=32),
                                  TokenBlocksHead(V, depth=0, heads=2, mlp_dim=32)])
def test_per_token_logits_of_every_position(head):
    variables = head.init(jax.random.key(0), features())
    logits = head.apply(variables, features())
    assert logits.shape == (B, T, V) and logits.dtype == jnp.float32
    params = variables["params"]
    assert params[sorted(k for k in params if k.startswith("Dense"))[-1]]["kernel"].shape == (D, V)
    blocks = [k for k in params if k.startswith("EncoderBlock")]  # causal ones (vit.EncoderBlock)
    assert len(blocks) == getattr(head, "depth", 0)


@pytest.mark.parametrize("head", [TokenLinearHead(V), TokenBlocksHead(V, depth=1, heads=2, mlp_dim=32)])
def test_a_later_position_changes_no_earlier_logit(head):
    """Position t's logits must not read positions after t (its features there hold the token
    it predicts)."""
    x = features()
    variables = head.init(jax.random.key(0), x)
    a = head.apply(variables, x)
    b = head.apply(variables, x.at[:, 4].set(features(1)[:, 4]))  # not a shift: LayerNorm removes those
    np.testing.assert_array_equal(a[:, :4], b[:, :4])
    assert np.abs(np.asarray(a[:, 4] - b[:, 4])).max() > 1e-4


def test_ppll_depths_and_the_networks_own_block_shape():
    assert [ppll_depth(j) for j in range(8)] == [2, 2, 2, 1, 1, 1, 0, 0]
    c = default_config()
    c.model, c.stages, c.model_kwargs = "gpt", 2, {"width": D, "depth": 2, "heads": 4, "mlp_dim": 24}
    net = build(c, (T,), V, input_dtype="int32")
    head = token_blocks_head(net, 0, D, V)
    assert (head.depth, head.heads, head.mlp_dim, head.vocab) == (2, 4, 24, V)
    with pytest.raises(ConfigError, match=r"token features \[B, T, D\]"):
        TokenLinearHead(V).init(jax.random.key(0), jnp.zeros((B, D)))


@pytest.mark.heavy  # CI: ppll = local on token windows with these heads (tests/test_language_model.py)
def test_first_local_module_of_a_gpt_learns_from_its_head():
    """Module 0 of a two-module GPT and its head, trained on the head's per-token loss (the
    task's loss on the head's outputs) and nothing else: the loss falls well below its start,
    about log(vocabulary) for untrained weights."""
    ds = data.REGISTRY["coriolanus"](window=T)
    c = default_config()
    c.model, c.stages, c.model_kwargs = "gpt", 2, {"width": D, "depth": 2, "heads": 2}
    net = build(c, (T,), ds.num_classes, input_dtype="int32")
    params, state = net.init(jax.random.key(0))
    width = net.stage_output_shapes(1)[0][-1]
    head = token_blocks_head(net, 0, width, ds.num_classes, depth=1)
    head_params = head.init(jax.random.key(1), jnp.zeros((1, T, width)))["params"]
    task, tx = tasks.LANGUAGE_MODELLING, optax.adam(3e-3)

    def local_loss(trained, ids, labels):
        module_params, own_head = trained
        tokens, _ = net.apply_stage(0, module_params, state[0], ids, True)
        return task.loss(head.apply({"params": own_head}, tokens), labels)

    @jax.jit
    def step(trained, opt_state, ids, labels):
        loss, grads = jax.value_and_grad(local_loss)(trained, ids, labels)
        updates, opt_state = tx.update(grads, opt_state)
        return optax.apply_updates(trained, updates), opt_state, loss

    trained = (params[0], head_params)
    opt_state, losses = tx.init(trained), []
    for k in range(40):
        batch = ds.train_batch(k, 32, 0)
        trained, opt_state, loss = step(trained, opt_state, batch["image"], batch["label"])
        losses.append(float(loss))
    assert losses[0] > 0.9 * np.log(ds.num_classes)
    assert np.mean(losses[-5:]) < 0.85 * losses[0]


@pytest.mark.parametrize("depth", [0, 1])
def test_token_output_head_is_a_copy_of_the_models_own_output_layer(depth):
    """`token_output`: the model's own last block (its final LayerNorm and unembedding) has exactly the
    parameter shapes of the head's output part; `depth` private causal decoder blocks of the network's own
    shape (heads 4, MLP 24) come before it; position t reads no later position; with a task whose labels
    are not per token it is refused in one line."""
    from cdpjax.models import aux_heads

    c = default_config()
    c.model, c.stages, c.model_kwargs = "gpt", 2, {"width": D, "depth": 2, "heads": 4, "mlp_dim": 24}
    net = build(c, (T,), V, input_dtype="int32")
    heads = aux_heads.build("token_output", net, V, {"depth": depth}, task=tasks.LANGUAGE_MODELLING)
    head = heads.heads[0].module
    variables = head.init(jax.random.key(0), features())
    own = net.blocks[-1].init(jax.random.key(1), features())["params"]
    shapes = jax.tree.map(jnp.shape, variables["params"])
    assert shapes["OutputHead_0"] == jax.tree.map(jnp.shape, own)
    blocks = [k for k in shapes if k.startswith("EncoderBlock")]
    assert len(blocks) == depth and (head.heads, head.mlp_dim) == (4, 24)
    if depth:
        assert shapes[blocks[0]]["Dense_0"]["kernel"] == (D, 24)
    a = head.apply(variables, features())
    b = head.apply(variables, features().at[:, 4].set(features(1)[:, 4]))
    assert a.shape == (B, T, V) and a.dtype == jnp.float32
    np.testing.assert_array_equal(a[:, :4], b[:, :4])
    with pytest.raises(ConfigError, match="aux_head='token_output' gives module 0 outputs of shape"):
        aux_heads.build("token_output", net, V, {}, task=tasks.CLASSIFICATION)
    with pytest.raises(ConfigError, match="aux_kwargs.depth=-1 must be an integer >= 0"):
        aux_heads.build("token_output", net, V, {"depth": -1}, task=tasks.LANGUAGE_MODELLING)
