"""The causal language model `gpt`: its forward pass against one written out by hand, causality,
integer inputs from the first stage on, tied embeddings, stage cuts, and the refusals."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cdpjax.config import default_config
from cdpjax.errors import ConfigError
from cdpjax.models import build, gpt, partition

VOCAB, WINDOW = 11, 6


def gpt_config(stages=1, partition_="params", **model_kwargs):
    c = default_config()
    c.model, c.stages, c.partition = "gpt", stages, partition_
    c.model_kwargs = {"width": 8, "depth": 2, "heads": 2, **model_kwargs}
    return c


def net_of(stages=1, partition_="params", **model_kwargs):
    return build(gpt_config(stages, partition_, **model_kwargs), (WINDOW,), VOCAB, input_dtype="int32")


def token_ids(batch=3, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, (batch, WINDOW)), jnp.int32)


# ------------------------------------------------------------------ a GPT written out by hand


def layer_norm(x, p, eps=1e-6):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * p["scale"] + p["bias"]


def causal_attention(x, p):
    """Multi-head self-attention where position t reads positions 0..t only."""
    q, k, v = (np.einsum("btd,dhk->bthk", x, p[n]["kernel"]) + p[n]["bias"] for n in ("query", "key", "value"))
    scores = np.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(q.shape[-1])
    t = x.shape[1]
    scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    heads = np.einsum("bhqs,bshk->bqhk", weights, v)
    return np.einsum("bqhk,hkd->bqd", heads, p["out"]["kernel"]) + p["out"]["bias"]


def gelu(x):  # the tanh approximation (GPT-2's, and flax's default)
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def reference_logits(params, ids, tied=False):
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    table = p["blocks_0"]["table"]["embedding"]
    x = table[np.asarray(ids)] + p["blocks_0"]["position"][: ids.shape[1]]
    depth = len(p) - 2
    for j in range(1, depth + 1):
        b = p[f"blocks_{j}"]
        x = x + causal_attention(layer_norm(x, b["LayerNorm_0"]), b["MultiHeadDotProductAttention_0"])
        h = gelu(layer_norm(x, b["LayerNorm_1"]) @ b["Dense_0"]["kernel"] + b["Dense_0"]["bias"])
        x = x + h @ b["Dense_1"]["kernel"] + b["Dense_1"]["bias"]
    head = p[f"blocks_{depth + 1}"]
    x = layer_norm(x, head["LayerNorm_0"])
    return x @ table.T if tied else x @ head["Dense_0"]["kernel"] + head["Dense_0"]["bias"]


@pytest.mark.parametrize("tied", [False, True])
def test_forward_equals_the_hand_written_gpt(tied):
    net = net_of(tied=tied)
    params, state = net.init(jax.random.key(1))
    ids = token_ids()
    logits, _ = net.apply(params, state, ids, train=False)
    assert logits.shape == (3, WINDOW, VOCAB) and logits.dtype == jnp.float32
    np.testing.assert_allclose(logits, reference_logits(params[0], ids, tied), rtol=2e-4, atol=2e-5)


def test_tied_head_has_no_matrix_of_its_own_and_both_uses_train_the_table():
    net = net_of(tied=True)
    params, state = net.init(jax.random.key(0))
    head = params[0]["blocks_3"]
    assert set(head) == {"LayerNorm_0"}  # no Dense: the logits are the table's
    ids = token_ids()

    def loss(table):
        p = jax.tree.map(lambda a: a, params)
        p[0]["blocks_0"]["table"]["embedding"] = table
        return net.apply(p, state, ids, train=False)[0].sum()

    grad = jax.grad(loss)(params[0]["blocks_0"]["table"]["embedding"])
    # Rows of ids that never occur are reached through the head only: a non-zero gradient there
    # means the head reads the embedding table.
    unused = sorted(set(range(VOCAB)) - set(np.asarray(ids).ravel().tolist()))
    assert unused and np.abs(np.asarray(grad)[unused]).max() > 0


def test_causal_a_later_token_changes_no_earlier_logit():
    net = net_of()
    params, state = net.init(jax.random.key(0))
    ids = token_ids()
    changed = ids.at[:, 3].set((ids[:, 3] + 1) % VOCAB)
    a, _ = net.apply(params, state, ids, train=False)
    b, _ = net.apply(params, state, changed, train=False)
    np.testing.assert_array_equal(a[:, :3], b[:, :3])
    assert np.abs(np.asarray(a[:, 3:] - b[:, 3:])).max() > 1e-4


@pytest.mark.parametrize("strategy", ["params", "blocks"])
def test_cut_into_stages_integer_inputs_reach_the_first_stage(strategy):
    """3 stages of [embedding, 2 decoder blocks, head]: each cut is valid, every stage after the first
    passes [B, T, width] activations, the parameters of the stages are those of the whole model,
    and the first stage is traced with int32 ids (a float input is refused there)."""
    net = net_of(stages=3, partition_=strategy)
    assert net.num_stages == 3 and net.input_dtype == "int32"
    assert net.stage_output_shapes(2) == [(2, WINDOW, 8), (2, WINDOW, 8), (2, WINDOW, VOCAB)]
    whole = net_of(stages=1)
    count = lambda tree: sum(x.size for x in jax.tree.leaves(tree))  # noqa: E731
    params, state = net.init(jax.random.key(0))
    assert count(params) == count(whole.init(jax.random.key(0))[0])
    report = partition.balance_report(net.blocks, [a for a, _ in net.bounds[1:]], net.input_shape, "int32")
    assert report["params"] == [count(p) for p in params]
    seen = []
    jax.make_jaxpr(lambda p, x: seen.append(x.dtype) or net.apply_stage(0, p, state[0], x, False)[0])(
        params[0], token_ids(2))
    assert seen == [jnp.int32]
    with pytest.raises(TypeError, match="integer token ids"):
        net.apply_stage(0, params[0], state[0], token_ids(2).astype(jnp.float32), False)


def test_params_partition_balances_parameter_counts():
    """Each block's parameter count, written out here, and the 'params' cut of [embedding, 4 blocks,
    head] into 3 stages: the one with the smallest largest stage, found by trying every cut."""
    d, mlp, vocab = 8, 32, 200
    emb = vocab * d + WINDOW * d
    block = 4 * (d * d + d) + 2 * 2 * d + d * mlp + mlp + mlp * d + d
    head = 2 * d + d * vocab + vocab
    blocks = gpt.gpt(vocab, (WINDOW,), width=d, depth=4, heads=2, mlp_dim=mlp)
    assert partition.block_costs(blocks, (WINDOW,), "params", "int32") == [emb, block, block, block, block, head]
    costs = [emb, block, block, block, block, head]
    best = min(((i, j) for i in range(1, 6) for j in range(i + 1, 6)),
               key=lambda c: max(sum(costs[:c[0]]), sum(costs[c[0]:c[1]]), sum(costs[c[1]:])))
    assert best == (2, 5)  # [embedding, block], [3 blocks], [head]: 2520, 2616, 1816
    assert partition.split_points(blocks, 3, "params", (WINDOW,), "gpt", "int32") == best


def test_bfloat16_computes_and_logits_stay_float32():
    c = gpt_config()
    c.dtype = "bfloat16"
    net = build(c, (WINDOW,), VOCAB, input_dtype="int32")
    params, state = net.init(jax.random.key(0))
    logits, _ = net.apply(params, state, token_ids(), train=False)
    assert logits.dtype == jnp.float32
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(params))
    jaxpr = str(jax.make_jaxpr(lambda p: net.apply(p, state, token_ids(), False)[0])(params))
    assert "bf16" in jaxpr


@pytest.mark.parametrize("kwargs,message", [
    ({"vocab_size": VOCAB - 1}, f"vocab_size={VOCAB - 1} is smaller than the dataset's {VOCAB} symbols"),
    ({"max_len": WINDOW - 1}, f"windows of {WINDOW} tokens are longer than gpt's position table"),
    ({"width": 9, "heads": 2}, "width=9 must be a multiple of heads=2"),
    ({"tied": "yes"}, "tied='yes' must be True or False"),
])
def test_bad_sizes_are_refused_when_built(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        net_of(**kwargs)


def test_images_and_a_cut_between_tied_ends_are_refused():
    with pytest.raises(ConfigError, match="windows of token ids of shape"):
        build(gpt_config(), (8, 8, 1), VOCAB)
    net = net_of(stages=2, partition_="blocks", tied=True)  # the cut itself needs no parameters
    with pytest.raises(ConfigError, match="tied=True .* only one stage can hold"):
        net.init(jax.random.key(0))
    assert net_of(vocab_size=VOCAB + 5).stage_output_shapes(1)[-1] == (1, WINDOW, VOCAB + 5)
