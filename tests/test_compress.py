"""Message codecs (`cdpjax.compress`): each codec's round-trip error within the bound its format gives.

Claims: `none` gives the message back bit for bit; bf16 keeps 8 significant bits (relative error
<= 2^-8, round to nearest); int8 with a per-block scale max|x|/127 is off by at most half a step,
max|x|/254, per block; fp8 e4m3 / e5m2 keep 4 / 3 significant bits of the scaled value (relative
error <= 2^-4 / 2^-3) except below the smallest normal, where the error is at most half the
smallest subnormal times the scale. The bytes on the wire are the payload's plus one float32
scale per block. Error feedback resends what the codec dropped (a hand-computed three-step case).
"""
import jax.numpy as jnp
import numpy as np
import pytest

from cdpjax import compress
from cdpjax.config import ConfigError

SHAPES = [(3, 50), (128,), (7, 300), (1,)]


def _message(shape, seed=0):
    rng = np.random.default_rng(seed)
    # magnitudes over many binades, signs mixed, a few exact zeros
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-8, 8, shape))
    x.reshape(-1)[::17] = 0.0
    return jnp.asarray(x, jnp.float32)


def _blocks(x, block=128):
    """Rows of `block` elements, the last zero-padded (the block codecs' scale groups)."""
    flat = np.asarray(x, np.float64).reshape(-1)
    return np.pad(flat, (0, -flat.size % block)).reshape(-1, block)


@pytest.mark.parametrize("shape", SHAPES)
def test_none_is_the_message(shape):
    x = _message(shape)
    codec = compress.lookup("none")
    enc = codec.encode(x)
    assert enc.payload is x and enc.scale is None
    assert codec.decode(enc, x) is x


@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_relative_error(shape):
    x = _message(shape)
    y = compress.lookup("bf16").round_trip(x)
    assert y.dtype == jnp.float32 and y.shape == x.shape
    # bfloat16: 8 significant bits, round to nearest: |y - x| <= 2^-8 |x|
    err = np.abs(np.asarray(y, np.float64) - np.asarray(x, np.float64))
    assert np.all(err <= 2.0**-8 * np.abs(np.asarray(x, np.float64)))
    assert x.size == 1 or np.any(err > 0)  # it does round (the one-element message is an exact 0)


@pytest.mark.parametrize("shape", SHAPES)
def test_int8_half_a_step_per_block(shape):
    x = _message(shape)
    y = compress.lookup("int8").round_trip(x)
    err = _blocks(np.asarray(y) - np.asarray(x))
    peak = np.abs(_blocks(x)).max(axis=1, keepdims=True)
    # scale = peak / 127; rounding to the nearest multiple: half a step, peak / 254 (float32 slack)
    assert np.all(err <= peak / 254 * (1 + 1e-5) + 1e-30)


@pytest.mark.parametrize("name,largest,mantissa,min_subnormal_exp", [
    ("fp8-e4m3", 448.0, 3, -9),   # e4m3fn: bias 7, 3 mantissa bits, smallest subnormal 2^-6 * 2^-3
    ("fp8-e5m2", 57344.0, 2, -16),  # e5m2: bias 15, 2 mantissa bits, smallest subnormal 2^-14 * 2^-2
])
@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_error(shape, name, largest, mantissa, min_subnormal_exp):
    x = _message(shape)
    y = compress.lookup(name).round_trip(x)
    blocks, err = _blocks(x), np.abs(_blocks(np.asarray(y) - np.asarray(x)))
    scale = np.abs(blocks).max(axis=1, keepdims=True) / largest
    # round to nearest with `mantissa` bits: relative 2^-(mantissa+1); below the normals, half a subnormal step
    bound = 2.0**-(mantissa + 1) * np.abs(blocks) + 2.0**(min_subnormal_exp - 1) * scale
    assert np.all(err <= bound * (1 + 1e-5) + 1e-30)


@pytest.mark.parametrize("name,itemsize,scaled", [("none", 4, False), ("bf16", 2, False), ("fp8-e4m3", 1, True),
                                                   ("fp8-e5m2", 1, True), ("int8", 1, True)])
@pytest.mark.parametrize("shape", SHAPES)
def test_wire_bytes_are_the_payload_and_scales(shape, name, itemsize, scaled):
    codec = compress.lookup(name)
    x = _message(shape)
    enc = codec.encode(x)
    n = int(np.prod(shape))
    blocks = -(-n // 128)
    expected = blocks * (128 * itemsize + 4) if scaled else n * itemsize
    got = sum(np.asarray(a).nbytes for a in enc if a is not None)
    assert got == expected == codec.wire_bytes(n)


def test_zero_block_decodes_to_zeros():
    x = jnp.zeros((2, 200), jnp.float32)
    for name in compress.CODECS:
        assert np.array_equal(compress.lookup(name).round_trip(x), x)


def test_unknown_codec_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^compress.gradients='int4' is not a codec; codecs: none, bf16, "
                                          r"fp8-e4m3, fp8-e5m2, int8$"):
        compress.Codecs.from_config({"compress": {"gradients": "int4"}})
    with pytest.raises(ConfigError, match="unknown config key 'compress.weights'"):
        compress.Codecs.from_config({"compress": {"weights": "bf16"}})


def test_codecs_by_message():
    codecs = compress.Codecs.from_config({"compress": {"activations": "int8", "gradients": "bf16"}})
    assert codecs.of("activation").name == "int8" and codecs.of("cotangent").name == "none"
    assert codecs.of("partial").name == codecs.of("sum").name == "bf16"
    assert codecs.of("image").name == "none" and not codecs.lossless
    assert compress.Codecs().lossless


def test_error_feedback_three_steps():
    """int8 with one block [x, 127]: the scale is 1, so the payload is x rounded to an integer.
    Step 1 sends 0.4 -> 0, keeps 0.4; step 2 sends 0.4 + 0.4 = 0.8 -> 1, keeps -0.2;
    step 3 sends 0.4 - 0.2 = 0.2 -> 0, keeps 0.2. Received in all: 1 of the 1.2 given, 0.2 kept."""
    codec = compress.lookup("int8")
    state = compress.Feedback(jnp.zeros((2,), jnp.float32))
    message = jnp.asarray([0.4, 127.0], jnp.float32)
    received, kept = [], []
    for _ in range(3):
        enc, state = compress.feedback_encode(codec, message, state)
        received.append(float(codec.decode(enc, message)[0]))
        kept.append(float(state.kept[0]))
    np.testing.assert_allclose(received, [0.0, 1.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(kept, [0.4, -0.2, 0.2], atol=1e-6)
    assert float(state.kept[1]) == 0.0  # 127 is exact every time
