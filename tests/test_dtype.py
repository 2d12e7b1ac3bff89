"""`config.dtype`: the models compute in bfloat16 when asked, with float32 parameters, float32 stage
outputs (what methods store and send between stages) and float32 logits; bad values are refused."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cdpjax import checks, models
from cdpjax.config import ConfigError, default_config, validate


def config(model="mlp", dtype="float32", **kwargs):
    c = default_config()
    c.model, c.dtype, c.stages = model, dtype, 2
    for k, v in kwargs.items():
        c[k] = v
    return c


def test_dtype_is_one_of_the_choices():
    with pytest.raises(ConfigError, match="dtype='float16' is not one of float32, bfloat16"):
        validate(config(dtype="float16"))


def test_a_factory_without_dtype_refuses_bfloat16():
    def plain(num_classes, input_shape, norm="none", bn_axis_name=None):
        return models.REGISTRY["mlp"](num_classes, input_shape)

    with models.REGISTRY.temporarily("plain", plain):
        checks.validate(config("plain"))  # float32: fine
        with pytest.raises(ConfigError, match="model 'plain' computes in float32 only"):
            checks.validate(config("plain", "bfloat16"))
    with pytest.raises(ConfigError, match="model_kwargs.dtype is set by the config key 'dtype'"):
        checks.validate(config(model_kwargs={"dtype": "bfloat16"}))


def _ops(fn, *args):
    """(primitive, operand dtypes) of the matrix products and convolutions `fn` runs."""
    eqns = jax.make_jaxpr(fn)(*args).jaxpr.eqns
    return [(e.primitive.name, {str(v.aval.dtype) for v in e.invars})
            for e in eqns if e.primitive.name in ("dot_general", "conv_general_dilated")]


@pytest.mark.parametrize("model", ["mlp", "resnet_tiny", "vit_tiny"])
def test_bfloat16_computes_in_bfloat16_with_float32_parameters_and_stage_outputs(model):
    """Abstractly (shapes and dtypes, nothing computed)."""
    net = models.build(config(model, "bfloat16", norm="batch" if model == "resnet_tiny" else "none"), (8, 8, 1), 10)
    params, state = jax.eval_shape(lambda: net.init(jax.random.key(0)))
    assert {x.dtype for x in jax.tree.leaves((params, state))} == {jnp.dtype(jnp.float32)}
    x = jax.ShapeDtypeStruct((2, 8, 8, 1), jnp.float32)
    for j in range(net.num_stages):
        def stage(p, s, v, j=j):
            return net.apply_stage(j, p, s, v, True)[0]

        ops = _ops(stage, params[j], state[j], x)
        assert ops and all(dtypes == {"bfloat16"} for _, dtypes in ops), ops
        x = jax.eval_shape(stage, params[j], state[j], x)
        assert x.dtype == jnp.float32  # stage boundary (and logits after the last stage)


def test_bfloat16_logits_are_float32_logits_to_bfloat16_precision():
    """Same parameters, two computation dtypes: different (bfloat16 keeps 8 bits of mantissa), and
    close (a few bfloat16 roundings through a small ResNet)."""
    f32 = models.build(config("resnet_tiny", norm="group"), (8, 8, 1), 10)
    b16 = models.build(config("resnet_tiny", "bfloat16", norm="group"), (8, 8, 1), 10)
    rng = np.random.default_rng(0)  # parameters drawn on the host: no initialiser to compile
    params, state = jax.tree.map(lambda a: rng.normal(0.0, 0.3, a.shape).astype(np.float32),
                                 jax.eval_shape(lambda: f32.init(jax.random.key(0))))
    images = jax.random.normal(jax.random.key(1), (4, 8, 8, 1))
    want = np.asarray(jax.jit(lambda p, s, v: f32.apply(p, s, v, False)[0])(params, state, images))
    got = np.asarray(jax.jit(lambda p, s, v: b16.apply(p, s, v, False)[0])(params, state, images))
    assert got.dtype == np.float32
    scale = np.abs(want).max()
    assert 0 < np.abs(got - want).max() <= 0.05 * scale
