"""Message codecs (`cdpjax.compress`): each codec's round-trip error within the bound its format gives.

Claims: `none` gives the message back bit for bit; bf16 keeps 8 significant bits (relative error
<= 2^-8, round to nearest); int8 with a per-block scale max|x|/127 is off by at most half a step,
max|x|/254, per block, int4 (scale max|x|/7, two values a byte) by max|x|/14; fp8 e4m3 / e5m2 keep
4 / 3 significant bits of the scaled value (relative
error <= 2^-4 / 2^-3) except below the smallest normal, where the error is at most half the
smallest subnormal times the scale. The bytes on the wire are the payload's plus one float32
scale per block. top-k keeps each block's 16 largest magnitudes exact and sends them beside
their uint8 positions (16 x 5 bytes a block); what it drops is zero, each no larger than the
smallest kept. Error feedback resends what the codec dropped (hand-computed three-step cases:
int8, and top-k, whose feedback sends a small entry once it has grown past a kept one).
"""
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cdpjax import compress
from cdpjax.cli import main
from cdpjax.config import ConfigError
from cdpjax.methods.common import loss_and_metrics
from helpers import build, random_batches, small_config

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


@pytest.mark.parametrize("shape", SHAPES)
def test_int4_half_a_step_per_block(shape):
    x = _message(shape)
    y = compress.lookup("int4").round_trip(x)
    assert y.dtype == jnp.float32 and y.shape == x.shape
    err = _blocks(np.asarray(y) - np.asarray(x))
    peak = np.abs(_blocks(x)).max(axis=1, keepdims=True)
    # scale = peak / 7; 15 levels -7..7, rounding to the nearest: half a step, peak / 14 (float32 slack)
    assert np.all(np.abs(err) <= peak / 14 * (1 + 1e-5) + 1e-30)
    assert x.size == 1 or np.any(np.abs(err) > peak / 254)  # coarser than int8: it does round to 4 bits


@pytest.mark.parametrize("shape", SHAPES)
def test_topk_keeps_the_largest_exactly(shape):
    """Per block of 128 (the last zero-padded): every entry arrives exact or as zero, at most 16
    arrive nonzero, every entry larger in magnitude than the block's 16th largest arrives exact, and
    every entry dropped is no larger in magnitude than the smallest one kept."""
    x = _message(shape)
    y = compress.lookup("topk-1/8").round_trip(x)
    assert y.dtype == jnp.float32 and y.shape == x.shape
    xb, yb = _blocks(x), _blocks(y)
    assert np.all((yb == xb) | (yb == 0))
    for xs, ys in zip(xb, yb):
        sixteenth = np.sort(np.abs(xs))[::-1][15]
        assert np.count_nonzero(ys) <= 16
        assert np.all(ys[np.abs(xs) > sixteenth] == xs[np.abs(xs) > sixteenth])
        dropped, kept = np.abs(xs[ys != xs]), np.abs(xs[ys != 0])
        if dropped.size and kept.size:
            assert dropped.max() <= kept.min()
    assert np.any(yb != xb) or x.size == 1  # it does drop


def test_topk_sends_values_and_uint8_positions():
    """A block of 128 whose 16 largest magnitudes sit at positions 3, 10, ..., 108 (7p + 3, values
    +-(p + 1) * 10), the rest 0.5: the payload is those 16 values, the index their positions (uint8:
    a block's 128 positions fit a byte), and the message comes back with every 0.5 zeroed."""
    x = np.full(128, 0.5, np.float32)
    positions = [7 * p + 3 for p in range(16)]
    x[positions] = [(-1) ** p * (p + 1) * 10.0 for p in range(16)]
    codec = compress.lookup("topk-1/8")
    enc = codec.encode(jnp.asarray(x))
    assert enc.scale is None and enc.index.dtype == jnp.uint8 and enc.index.shape == (1, 16)
    assert enc.payload.dtype == jnp.float32 and enc.payload.shape == (1, 16)
    assert sorted(np.asarray(enc.index[0]).tolist()) == positions
    np.testing.assert_array_equal(np.asarray(enc.payload[0]), x[np.asarray(enc.index[0])])
    want = np.zeros(128, np.float32)
    want[positions] = x[positions]
    np.testing.assert_array_equal(np.asarray(codec.decode(enc, x)), want)


def test_int4_packs_two_nibbles_a_byte():
    """One block whose peak is 7 has scale 1: the payload is the integers themselves, q + 8 as a
    nibble, element 2i in byte i's low 4 bits, 2i + 1 in its high 4 (written out by hand)."""
    x = np.zeros(128, np.float32)
    x[:6] = [7, -7, 0, 1, -2.4, 3.6]
    enc = compress.lookup("int4").encode(jnp.asarray(x))
    assert enc.payload.dtype == jnp.uint8 and enc.payload.shape == (1, 64)
    assert float(enc.scale[0]) == 1.0
    # bytes: (7+8) | (-7+8) << 4 = 15 + 16; (0+8) | (1+8) << 4 = 8 + 144; (-2+8) | (4+8) << 4 = 6 + 192; then 8 | 8 << 4
    assert np.asarray(enc.payload[0, :4]).tolist() == [31, 152, 198, 136]
    assert np.asarray(compress.lookup("int4").decode(enc, x))[:6].tolist() == [7, -7, 0, 1, -2, 4]


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
                                                   ("fp8-e5m2", 1, True), ("int8", 1, True), ("int4", 0.5, True)])
@pytest.mark.parametrize("shape", SHAPES)
def test_wire_bytes_are_the_payload_and_scales(shape, name, itemsize, scaled):
    codec = compress.lookup(name)
    x = _message(shape)
    enc = codec.encode(x)
    n = int(np.prod(shape))
    blocks = -(-n // 128)
    expected = blocks * (int(128 * itemsize) + 4) if scaled else n * itemsize
    got = sum(np.asarray(a).nbytes for a in enc if a is not None)
    assert got == expected == codec.wire_bytes(n)


@pytest.mark.parametrize("shape", SHAPES)
def test_topk_wire_bytes_are_values_and_positions(shape):
    """top-k sends 16 float32 values and 16 uint8 positions per block of 128: 80 bytes a block."""
    codec = compress.lookup("topk-1/8")
    enc = codec.encode(_message(shape))
    n = int(np.prod(shape))
    expected = -(-n // 128) * 16 * (4 + 1)
    assert sum(np.asarray(a).nbytes for a in enc if a is not None) == expected == codec.wire_bytes(n)


def test_zero_block_decodes_to_zeros():
    x = jnp.zeros((2, 200), jnp.float32)
    for name in compress.CODECS:
        assert np.array_equal(compress.lookup(name).round_trip(x), x)


def test_unknown_codec_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^compress.gradients='int2' is not a codec; codecs: none, bf16, "
                                          r"fp8-e4m3, fp8-e5m2, int8, int4, topk-1/8$"):
        compress.Codecs.from_config({"compress": {"gradients": "int2"}})
    with pytest.raises(ConfigError, match="unknown config key 'compress.weights'"):
        compress.Codecs.from_config({"compress": {"weights": "bf16"}})
    with pytest.raises(ConfigError, match=r"^compress.feedback=True .* compress.gradients='none' drops nothing"):
        compress.Codecs.from_config({"compress": {"feedback": True}})
    with pytest.raises(ConfigError, match=r"^compress.feedback must be True or False, got 'yes'$"):
        compress.Codecs.from_config({"compress": {"gradients": "int8", "feedback": "yes"}})


def test_topk_refused_where_nothing_resends_what_it_drops():
    """top-k drops 7/8 of a message: on gradients only with error feedback (cdp-zero, which keeps
    none, refuses that in turn), never on parameters; on activations it runs as it is."""
    with pytest.raises(ConfigError, match=r"^compress.gradients='topk-1/8' drops 7/8 of every gradient message and, "
                                          r"without compress.feedback=True, never sends it: .*top-k cannot run there"):
        compress.Codecs.from_config({"compress": {"gradients": "topk-1/8"}})
    with pytest.raises(ConfigError, match=r"^compress.parameters='topk-1/8' would zero 7/8 of each parameter piece"):
        compress.Codecs.from_config({"compress": {"parameters": "topk-1/8"}})
    assert compress.Codecs.from_config({"compress": {"gradients": "topk-1/8", "feedback": True}}).gradients.sparse
    assert compress.Codecs.from_config({"compress": {"activations": "topk-1/8"}}).activations.sparse
    config = small_config("cdp-zero", "mlp", stages=4, workers=4, global_batch_size=16)
    config.compress.gradients, config.compress.feedback = "topk-1/8", True
    with pytest.raises(ConfigError, match=r"^compress.feedback=True: cdp-zero's gradient pieces keep no error"):
        build(config, {"data": 4})


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


def test_topk_error_feedback_three_steps():
    """top-k of one block: 16 entries 2.5 + 0.01 p at positions p = 0..15, 1.0 at position 16, zeros
    after. Step 1 sends positions 0..15 and keeps 1.0 at 16; step 2 holds 1 + 1 = 2.0 at 16, still
    below the 16 kept, so it sends the same 16 and keeps 2.0; step 3 holds 3.0 at 16, larger than
    position 0's 2.5, so it sends position 16's 3.0 and keeps position 0's 2.5 instead."""
    codec = compress.lookup("topk-1/8")
    message = np.zeros(128, np.float32)
    message[:16] = 2.5 + 0.01 * np.arange(16)
    message[16] = 1.0
    message = jnp.asarray(message)
    state = compress.Feedback(jnp.zeros((128,), jnp.float32))
    received, kept = [], []
    for _ in range(3):
        enc, state = compress.feedback_encode(codec, message, state)
        got = np.asarray(codec.decode(enc, message))
        received.append((float(got[0]), float(got[16])))
        kept.append((float(state.kept[0]), float(state.kept[16])))
    np.testing.assert_allclose(received, [(2.5, 0.0), (2.5, 0.0), (0.0, 3.0)], atol=1e-6)
    np.testing.assert_allclose(kept, [(0.0, 1.0), (0.0, 2.0), (2.5, 0.0)], atol=1e-6)
    assert not np.asarray(state.kept)[17:].any() and not np.asarray(state.kept)[1:16].any()


# ---------------------------------------------------------------- on the wire: the compiled program's permutes

_PERMUTE = re.compile(r"=\s*(\(.*?\)|\S+)\s+collective-permute(?:-start)?\(")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([0-9,]*)\]")
_ITEMSIZE = {"f32": 4, "u16": 2, "u8": 1, "s8": 1}


def _permutes(hlo_text: str) -> list[tuple[str, int]]:
    """(dtype, bytes) of each array a collective-permute of the compiled program sends."""
    out = []
    for line in hlo_text.splitlines():
        m = _PERMUTE.search(line)
        for dtype, dims in _ARRAY.findall(m.group(1)) if m else ():
            out.append((dtype, int(np.prod([int(d) for d in dims.split(",") if d])) * _ITEMSIZE[dtype]))
    return out


def _wire(codec: str, n: int) -> list[tuple[str, int]]:
    """What a message of n float32 elements should cross as, written out per codec: bf16 its 2-byte
    bits, fp8 and int8 one byte an element padded to blocks of 128 beside one float32 scale a block,
    int4 half a byte an element (64 bytes a block) beside the same scales; top-k 1/8 a block's 16
    float32 values beside their 16 uint8 positions (a block's 128 positions fit a byte)."""
    blocks = -(-n // 128)
    return {"none": [("f32", 4 * n)], "bf16": [("u16", 2 * n)], "int8": [("s8", 128 * blocks), ("f32", 4 * blocks)],
            "int4": [("u8", 64 * blocks), ("f32", 4 * blocks)],
            "fp8-e4m3": [("u8", 128 * blocks), ("f32", 4 * blocks)],
            "fp8-e5m2": [("u8", 128 * blocks), ("f32", 4 * blocks)],
            "topk-1/8": [("f32", 4 * 16 * blocks), ("u8", 16 * blocks)]}[codec]


@pytest.mark.parametrize("codec", ["none", "bf16", "int8", "fp8-e4m3", "fp8-e5m2", "int4", "topk-1/8"])
def test_ppll_activation_permutes_carry_the_codec(codec):
    """ppll on 2 devices, an MLP 16 wide, 12 examples a step: one message, stage 0's output
    [12, 16] = 192 float32 elements, crosses per step, in the codec's dtype and bytes."""
    config = small_config("ppll", "mlp", stages=2, global_batch_size=12)
    config.compress.activations = codec
    method = build(config, {"stage": 2})
    batch = random_batches(1, 12)[0]
    hlo = jax.jit(method.train_step).lower(method.init(jax.random.key(0)), batch).compile().as_text()
    assert sorted(_permutes(hlo)) == sorted(_wire(codec, 12 * 16))


@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_gpipe_cotangent_permutes_carry_the_codec(codec):
    """gpipe on 2 devices, 2 micro-batches of 4: the activation [4, 16] forward as float32, its
    cotangent [4, 16] back in the codec's dtype (compress.cotangents only)."""
    config = small_config("gpipe", "mlp", stages=2, microbatches=2, global_batch_size=8)
    config.compress.cotangents = codec
    method = build(config, {"stage": 2})
    batch = random_batches(1, 8)[0]
    hlo = jax.jit(method.train_step).lower(method.init(jax.random.key(0)), batch).compile().as_text()
    assert sorted(_permutes(hlo)) == sorted(_wire("none", 4 * 16) + _wire(codec, 4 * 16))


def _ring(codec: str, workers: int = 2, stages: int = 2, batch: int = 8):
    config = small_config("cdp-v2", "mlp", cdp_impl="ring", workers=workers, stages=stages, global_batch_size=batch,
                          momentum=0.0, weight_decay=0.0, schedule="constant", learning_rate=0.5)
    config.compress.gradients = codec
    config.compress.feedback = compress.lookup(codec).sparse  # top-k runs on gradients with feedback only
    return build(config, {"data": workers})


@pytest.mark.parametrize("codec", ["bf16", "int8", "fp8-e4m3", "fp8-e5m2", "int4", "topk-1/8"])
def test_ring_gradient_permutes_carry_the_codec(codec):
    """Each gradient message of the ring (a stage's gradient raveled, n float32 elements with no
    codec) crosses as the codec's wire arrays for n elements."""
    batch = random_batches(1, 8)[0]

    def permutes(method):
        return _permutes(jax.jit(method.train_step).lower(method.init(jax.random.key(0)), batch).compile().as_text())

    plain = permutes(_ring("none"))
    assert plain and {dtype for dtype, _ in plain} == {"f32"}
    assert sorted(permutes(_ring(codec))) == sorted(w for _, nbytes in plain for w in _wire(codec, nbytes // 4))


def test_ring_with_bf16_sums_within_the_rounding_bound():
    """CDP-v2's ring, 2 workers, 2 stages, SGD without momentum: one step (and a flush) applies
    theta_1 = theta_0 - lr G, G summed along the chain from the workers' gradients g_w at theta_0.
    With bf16 messages the partial worker 0 sends is rounded (error <= 2^-8 |g_0|), the sum worker
    1 completes is rounded once (<= 2^-8 |g_0 + g_1|, with slack) and passed on exactly (bf16 again),
    so |theta_1(bf16) - theta_1(none)| <= lr 2^-8 (2 |g_0| + |g_1|)(1 + 2^-7), each g_w here taken as
    the gradient of its micro-batch's mean loss (at least the share a worker adds). Every worker
    ends with the same parameters (the completing worker applies what it sends)."""
    batch = random_batches(1, 8)[0]
    runs = {}
    for codec in ("none", "bf16"):
        method = _ring(codec)
        state, _ = method.train_step(method.init(jax.random.key(0)), batch)
        runs[codec] = method, method.flush(state)
    method, state = runs["none"]
    theta0 = method.export(method.init(jax.random.key(0)))[0]
    model_state = method.export(method.init(jax.random.key(0)))[1]

    def grad(rows):
        loss = lambda p: loss_and_metrics(method.net, p, model_state, batch["image"][rows], batch["label"][rows])[0]  # noqa: E731,E501
        return jax.grad(loss)(theta0)

    g0, g1 = grad(slice(0, 4)), grad(slice(4, 8))
    bound = jax.tree.map(lambda a, b: 0.5 * 2.0**-8 * (2 * np.abs(a) + np.abs(b)) * (1 + 2.0**-7) + 1e-7, g0, g1)
    got, want = runs["bf16"][0].export(runs["bf16"][1])[0], method.export(state)[0]
    diff = jax.tree.map(lambda a, b: np.abs(np.asarray(a) - np.asarray(b)), got, want)
    assert all(jax.tree.leaves(jax.tree.map(lambda d, b: bool(np.all(d <= b)), diff, bound)))
    assert max(float(d.max()) for d in jax.tree.leaves(diff)) > 0  # the codec did round
    for j, stage in enumerate(runs["bf16"][1].params):  # every worker's copy the same
        for leaf in jax.tree.leaves(stage):
            np.testing.assert_array_equal(np.asarray(leaf)[0], np.asarray(leaf)[1])


@pytest.mark.parametrize("codec,wire_bytes", [("bf16", 2 * 64 * 16), ("int8", 8 * (128 + 4)), ("int4", 8 * (64 + 4)),
                                              ("topk-1/8", 8 * 16 * (4 + 1))])
def test_bench_counts_the_wire_bytes(tmp_path, codec, wire_bytes):
    """ppll on two devices, a 16-wide MLP cut after two blocks, 64 examples a step: one message a
    step, the [64, 16] hidden layer, crosses as `wire_bytes` (written out: bf16 2 bytes an element;
    int8 1024 elements = 8 blocks of 128 bytes and a 4-byte scale; int4 8 blocks of 64 bytes and a
    scale; top-k 8 blocks of 16 float32 values and 16 uint8 positions), i.e. half that per
    device. What the program says (its Send events through their codec) and what the compiled
    program's permutes carry (bench's HLO count) agree within 1%."""
    path = tmp_path / "b.json"
    assert main(["bench", "--methods", "ppll", "--cpu-devices", "2", "--repeats", "1",
                 "--config.stages=[2]", "--config.model_kwargs.width=16", "--config.global_batch_size=64",
                 f"--config.compress.activations={codec}", "--json", str(path)]) == 0
    (r,) = json.loads(path.read_text())
    assert r["sent_bytes_per_device_per_step"] == wire_bytes / 2
    permuted = r["sent_bytes_by_kind"]["collective-permute"] / 2  # the rest: the metric scalars' all-reduce
    assert permuted == pytest.approx(r["sent_bytes_per_device_per_step"], rel=0.01)


@pytest.mark.parametrize("method,mesh,key", [
    ("dp", {"data": 2}, "gradients"), ("ppll", {"stage": 2}, "cotangents"), ("ppll", {"stage": 2}, "gradients"),
    ("gpipe", {"stage": 2}, "parameters")])
def test_a_codec_no_message_takes_is_refused(method, mesh, key):
    config = small_config(method, "mlp", stages=2, microbatches=2, global_batch_size=8)
    config.compress[key] = "bf16"
    with pytest.raises(ConfigError, match=rf"^compress.{key}='bf16': method '{method}' encodes no {key} messages .*"
                                          rf"set compress.{key}='none'$"):
        build(config, mesh)


def test_gpipe_with_bf16_messages_is_backprop_through_bf16_boundaries():
    """A second implementation: gpipe with bf16 activations and cotangents computes the gradient
    of the network whose stage boundary is x -> float32(bfloat16(x)), as `jax.grad` differentiates
    it (the cast's transpose rounds the cotangent to bfloat16 too). 2 stages, 2 micro-batches of 4
    (powers of two: the loss's scalings commute with the rounding)."""
    config = small_config("gpipe", "mlp", stages=2, microbatches=2, global_batch_size=8)
    config.compress.activations = config.compress.cotangents = "bf16"
    gpipe = build(config, {"stage": 2})
    state, batch = gpipe.init(jax.random.key(0)), random_batches(1, 8)[0]
    params, model_state = gpipe.export(state)
    net = gpipe.net

    def loss(p):
        x = batch["image"]
        for j in range(net.num_stages):
            if j:
                x = x.astype(jnp.bfloat16).astype(jnp.float32)
            x, _ = net.apply_stage(j, p[j], model_state[j], x, True)
        return mean_cross_entropy(x, batch["label"])

    def mean_cross_entropy(logits, labels):
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))

    reference = jax.grad(loss)(params)
    got = gpipe.gradients(state, batch)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(reference)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    plain = small_config("gpipe", "mlp", stages=2, microbatches=2, global_batch_size=8)
    unrounded = build(plain, {"stage": 2}).gradients(state, batch)
    assert max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
               for a, b in zip(jax.tree.leaves(unrounded), jax.tree.leaves(reference))) > 1e-6  # the codec is felt


def test_ring_error_feedback_resends_what_the_codec_dropped():
    """CDP-v2's ring, 2 workers, 2 stages, bf16 sums with error feedback, learning rate 0 and the
    same batch every step: the parameters stay theta_0, so worker w adds the same g_w = (1/2) x the
    gradient of its micro-batch's mean loss at theta_0 to every partial sum it sends. With
    feedback the k-th partial it sends is x_k = g_w + e_{k-1} and it keeps e_k = x_k - bf16(x_k)
    (e_0 = 0), written out below in numpy (ml_dtypes' rounding); a step's partial sent `lag` calls
    after it was fed has been sent K - lag times after K calls. The sum a worker completes keeps
    its own remainder, at most half a bf16 step of what it sent."""
    import ml_dtypes

    config = small_config("cdp-v2", "mlp", cdp_impl="ring", workers=2, stages=2, global_batch_size=8,
                          momentum=0.0, weight_decay=0.0, schedule="constant", learning_rate=0.0)
    config.compress.gradients, config.compress.feedback = "bf16", True
    ring = build(config, {"data": 2})
    batch = random_batches(1, 8)[0]
    state = ring.init(jax.random.key(0))
    theta0, model_state = ring.export(state)
    steps = 3
    for _ in range(steps):
        state, _ = ring.train_step(state, batch)

    def g(worker, j):
        rows = slice(4 * worker, 4 * worker + 4)
        loss = lambda p: loss_and_metrics(ring.net, p, model_state, batch["image"][rows], batch["label"][rows])[0]  # noqa: E731,E501
        grad = jax.grad(loss)(theta0)[j]
        return 0.5 * np.concatenate([np.asarray(leaf, np.float32).reshape(-1) for leaf in jax.tree.leaves(grad)])

    def kept_after(x_part, times):
        e = np.zeros_like(x_part)
        for _ in range(times):
            x = (x_part + e).astype(np.float32)
            e = x - x.astype(ml_dtypes.bfloat16).astype(np.float32)
        return e

    partials = {(s.stage, s.src): s.lag for s in ring.program.sends if s.what == "partial"}
    assert partials  # the ring sends partial sums
    for j in range(2):
        feedback = np.asarray(state.feedback[j])  # [workers, 2, n]
        for w in range(2):
            if (j, w) in partials:
                expected = kept_after(g(w, j), steps - partials[j, w])
                assert np.abs(expected).max() > 0
                np.testing.assert_allclose(feedback[w, 0], expected, rtol=1e-3, atol=1e-9)
            else:
                assert not feedback[w, 0].any()  # it sends no partial of stage j: nothing kept
        completing = [w for w in range(2) if feedback[w, 1].any()]
        assert len(completing) == 1  # one worker completes stage j's sum and keeps its remainder


# ---------------------------------------------------------------- the lockstep model's step time through a codec

def test_lockstep_step_time_through_a_codec_two_ticks():
    """ppll, 2 stages, 1 step: tick 0 runs stage 0's FB on device 0 (F 1 + B 2 = 3 s), whose
    1000-byte activation (250 float32) crosses at the tick's end; tick 1 runs stage 1's FB (3 s).
    The steady window is both ticks, one tick a period: a step is half the total. By hand:
    - none at 100 bytes/s: (3 + 1000/100 + 3) / 2 = 8;
    - int8, 2 blocks of 128 + 4 bytes = 264 bytes, coding 0.5 s: (3 + 2.64 + 0.5 + 3) / 2 = 4.57;
    - int4, 2 blocks of 64 + 4 = 136 bytes, coding 0.5 s: (3 + 1.36 + 0.5 + 3) / 2 = 3.93;
    - int8 pays for its coding below 1000/B = 264/B + 0.5, B = 1472 bytes/s: at 2000 bytes/s
      (3 + 0.132 + 0.5 + 3) / 2 = 3.316 > none's (3 + 0.5 + 3) / 2 = 3.25."""
    from cdpjax import speedup
    from cdpjax.layouts.ppll import ppll_table

    table = ppll_table(2, 1)
    costs = speedup.uniform_costs({"F": 1, "B": 2}, 2, activation_bytes=1000.0)
    coding = ((1000.0, 0.5),)
    step = {codec: speedup.lockstep_step_seconds(table, costs, speedup.Link(100.0, codec, coding))
            for codec in ("none", "int8", "int4")}
    assert step == pytest.approx({"none": 8.0, "int8": 4.57, "int4": 3.93})
    assert step["none"] == speedup.simulate(table, costs, 100.0)["step_seconds"]  # the same replay without a codec
    at_2000 = {codec: speedup.lockstep_step_seconds(table, costs, speedup.Link(2000.0, codec, coding))
               for codec in ("none", "int8")}
    assert at_2000 == pytest.approx({"none": 3.25, "int8": 3.316})
    assert speedup.message_sizes(table, costs) == (1000.0,)
    assert speedup.break_even_bandwidth(table, costs, "int8", coding) == pytest.approx(1472.0, rel=1e-6)
    assert speedup.break_even_bandwidth(table, costs, "int8", coding, high=1000.0) == 1000.0  # pays everywhere
    with pytest.raises(ConfigError, match=r"^Link\(codec='int8'\) has no coding time for a message of 1000 bytes; "
                                          r"measured for: 500$"):
        speedup.lockstep_step_seconds(table, costs, speedup.Link(100.0, "int8", ((500.0, 0.1),)))
