"""The uniform stage carrier: stages of different shapes as padded rows on one `stage` axis.

Claims: packing is lossless, the padding stays exactly zero under the elementwise
optimizers (so they can run on the padded rows), and the layouts' padding says what the
uniform layout costs. (That a `lax.switch` over the rows runs each device's own stage is
shown by every equality test of a stage-axis method against its reference.)
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cdpjax import models
from cdpjax.carrier import ActLayout, FlatLayout
from cdpjax.optim import apply as update
from cdpjax.config import default_config


def _net(model="resnet_tiny", stages=4, norm="batch"):
    c = default_config()
    c.model, c.stages, c.norm, c.model_kwargs = model, stages, norm, {}
    return models.build(c, (8, 8, 1), 10)


class Layouts(NamedTuple):
    """A staged network's layouts, built here as the stage-axis engine builds its own."""

    params: FlatLayout
    model_state: FlatLayout
    acts: ActLayout


def _layouts(net) -> Layouts:
    params, state = jax.eval_shape(lambda: net.init(jax.random.key(0)))
    inputs = [tuple(net.input_shape)] + [s[1:] for s in net.stage_output_shapes(1)[:-1]]
    return Layouts(FlatLayout.from_trees(params), FlatLayout.from_trees(state), ActLayout.from_shapes(inputs))


@pytest.fixture(scope="module")
def tiny():
    """resnet_tiny cut into 4 stages of different shapes, its parameters and state, its layouts."""
    net = _net()
    params, state = net.init(jax.random.key(0))
    return net, params, state, _layouts(net)


def test_stages_differ_in_shape(tiny):
    """The test network is what the carrier is for: no two stages alike."""
    net, _, _, carrier = tiny
    assert len(set(carrier.params.sizes)) == net.num_stages
    assert len(set(carrier.acts.shapes)) > 1


def test_params_and_state_round_trip(tiny):
    net, params, state, carrier = tiny
    rows = carrier.params.pack(params)
    assert rows.shape == (net.num_stages, max(carrier.params.sizes))
    jax.tree.map(np.testing.assert_array_equal, carrier.params.unpack(rows), params)
    jax.tree.map(np.testing.assert_array_equal, carrier.model_state.unpack(carrier.model_state.pack(state)), state)
    for j, size in enumerate(carrier.params.sizes):
        assert not np.any(np.asarray(rows[j, size:])), f"stage {j}: padding is not zero"


def test_activation_round_trip_and_padding(tiny):
    carrier = tiny[3]
    for j, shape in enumerate(carrier.acts.shapes):
        x = jax.random.normal(jax.random.key(j), (4, *shape))
        buf = carrier.acts.pack_one(j, x)
        assert buf.shape == (4, carrier.acts.width)
        np.testing.assert_array_equal(carrier.acts.unpack_one(j, buf), x)
        assert not np.any(np.asarray(buf[:, x[0].size:]))


def test_padding(tiny):
    """Padded over real storage, L rows of the largest stage against the stages' sum, from sizes
    counted here: each stage's parameters (its leaves) and each stage's input (the image, then the
    outputs of running the stages one after another)."""
    net, params, state, carrier = tiny
    sizes = [sum(int(np.size(x)) for x in jax.tree.leaves(p)) for p in params]
    x, inputs = jnp.zeros((1, 8, 8, 1)), []
    for j in range(net.num_stages):
        inputs.append(x[0].size)
        x, _ = net.apply_stage(j, params[j], state[j], x, False)
    assert list(carrier.params.sizes) == sizes and [int(np.prod(s)) for s in carrier.acts.shapes] == inputs
    np.testing.assert_allclose(carrier.params.padding(), len(sizes) * max(sizes) / sum(sizes))
    np.testing.assert_allclose(carrier.acts.padding(), len(inputs) * max(inputs) / sum(inputs))
    assert carrier.params.padding() > 1.0 and carrier.acts.padding() > 1.0
    one = _layouts(_net(stages=1))
    assert one.params.padding() == 1.0 and one.acts.padding() == 1.0  # one stage: nothing to pad


@pytest.mark.parametrize("name,tx", [
    ("sgd-momentum-wd", optax.chain(optax.add_decayed_weights(5e-4), optax.sgd(0.1, momentum=0.9, nesterov=True))),
    ("adam-wd", optax.chain(optax.add_decayed_weights(1e-3), optax.adam(1e-2))),
    ("adamw", optax.adamw(1e-2, weight_decay=0.1)),
])
def test_elementwise_optimizer_on_padded_rows(name, tx):
    """Updating the padded rows equals updating each stage's pytree, and the padding stays zero."""
    shapes = [{"kernel": (3, 3, 2, 4), "bias": (4,)}, {"kernel": (5, 7)}, {"scale": (6,), "dense": {"w": (6, 2)}}]
    params = [jax.tree.map(lambda s, j=j: 1.0 + jax.random.normal(jax.random.key(j), s), t,
                           is_leaf=lambda s: isinstance(s, tuple)) for j, t in enumerate(shapes)]
    layout = FlatLayout.from_trees(params)

    @jax.jit
    def step(rows, opt_rows, params, opt_trees, key):
        grads = jax.tree.map(lambda p: jax.random.normal(key, p.shape), params)
        rows, opt_rows = jax.vmap(lambda g, s, r: update(tx, r, s, g))(layout.pack(grads), opt_rows, rows)
        for j in range(len(params)):
            u, opt_trees[j] = tx.update(grads[j], opt_trees[j], params[j])
            params[j] = optax.apply_updates(params[j], u)
        return rows, opt_rows, params, opt_trees

    rows, opt_rows = layout.pack(params), jax.vmap(tx.init)(layout.pack(params))  # one state per stage
    opt_trees = [tx.init(p) for p in params]
    for k in range(3):
        rows, opt_rows, params, opt_trees = step(rows, opt_rows, params, opt_trees, jax.random.key(k))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), layout.unpack(rows), params)
    for j, size in enumerate(layout.sizes):
        assert not np.any(np.asarray(rows[j, size:])), f"{name}: stage {j}'s padding moved"


def test_flat_layout_refuses_a_foreign_tree():
    layout = FlatLayout.from_trees([{"a": jnp.zeros(3)}, {"b": jnp.zeros((2, 2))}])
    assert layout.width == 4 and layout.sizes == (3, 4)
    with pytest.raises(ValueError, match="stage 0"):
        layout.pack_one(0, {"a": jnp.zeros(4)})


def test_gradient_convolutions_inside_loops_take_the_fast_layout():
    """XLA:CPU puts convolutions into its fast NHWC/HWIO layout only at top level; with the carrier's
    lowering every convolution of a gradient inside a scan is in that layout, and the result is
    bit for bit the top-level one."""
    import flax.linen as nn
    from jax import lax

    from cdpjax.xla_cpu import use_canonical_cpu_convolutions

    assert use_canonical_cpu_convolutions()
    conv = nn.Conv(8, (3, 3), strides=2, use_bias=False)
    x = jax.random.normal(jax.random.key(0), (4, 8, 8, 3))
    v = conv.init(jax.random.key(1), x)

    def grads(v, x):
        return jax.grad(lambda v, x: (conv.apply(v, x) ** 2).sum(), argnums=(0, 1))(v, x)

    def in_loop(v, x):
        return lax.scan(lambda c, _: (c, grads(v, x)), 0, None, length=1)[1]

    hlo = jax.jit(in_loop).lower(v, x).compile().as_text()
    labels = [line.split("dim_labels=")[1].split(",")[0] for line in hlo.splitlines() if " convolution(" in line]
    assert len(labels) >= 2 and set(labels) == {"b01f_01io->b01f"}, labels
    looped = jax.tree.map(lambda a: a[0], jax.jit(in_loop)(v, x))
    jax.tree.map(np.testing.assert_array_equal, looped, jax.jit(grads)(v, x))
