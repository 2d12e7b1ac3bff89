"""Codecs for point-to-point messages: what a message becomes on the wire, and back.

A codec is a frozen `Codec`: `encode(x) -> Encoded` (the wire payload in the codec's
dtype, and per-block float32 scales where the codec has blocks), `decode(encoded, like)`
(the message in `like`'s shape and dtype), both pure and jittable; `wire_bytes(n)` the
bytes a message of n elements takes on the wire (payload plus scales), which the program's
`Send` events and bench's byte counts use. The engines encode before `lax.ppermute` and
decode after it, so the collective-permute in the compiled program carries the wire dtype.

Registered codecs (`CODECS`):

- `none`: the message as it is (bit-equal: no op at all is added).
- `bf16`: rounded to bfloat16 (round to nearest even): relative error <= 2^-8.
- `fp8-e4m3`, `fp8-e5m2`: per block of `BLOCK` elements, scaled so that the block's largest
  magnitude is the format's largest finite value, then rounded to float8 (3 or 2 mantissa
  bits: relative error <= 2^-4 or 2^-3, and half the smallest subnormal times the scale
  near zero).
- `int8`: per block, scale = max|x| / 127, rounded to the nearest integer: absolute error
  <= scale / 2 = max|x| / 254.
- `int4`: per block, scale = max|x| / 7, rounded to the nearest integer in [-7, 7], stored
  as the nibble q + 8 and packed two to a byte (element 2i in the low nibble, 2i + 1 in the
  high), so the wire carries 4 bits an element: absolute error <= max|x| / 14.
- `topk-1/8`: per block, the `BLOCK / 8` = 16 entries of largest magnitude, sent exact (in the
  message's dtype) beside their positions in the block (`index_dtype`, the smallest unsigned
  integer that indexes a block: uint8); the others arrive as zeros, each no larger in magnitude
  than the smallest entry kept. 16 x (4 + 1) bytes a block of 128 float32: 6.4x fewer bytes.
  It drops most of every message, so on gradient messages it needs error feedback (refused
  without: the dropped part would never be sent) and parameter messages refuse it (they keep
  none: the receiver would compute with 7/8 of a piece zeroed).

Error feedback (`feedback_encode`): the sender adds what the codec dropped from its last
message on a route to its next one on that route, keeping the new remainder (`Feedback`).

Message kinds (`KINDS`, the config keys `compress.<kind>`): which codec each kind of message
takes (`Codecs.of(what)`, `what` a `cdpjax.program.events.MESSAGES` name).
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from cdpjax.errors import ConfigError

# Elements that share one float32 scale (the block codecs).
BLOCK = 128
SCALE_BYTES = 4


class Encoded(NamedTuple):
    """A message on the wire: `payload` in the codec's dtype, a float format as its bits (blocks
    of `BLOCK` elements as rows, the last zero-padded, for the block codecs, int4's rows of
    BLOCK / 2 bytes, two nibbles each; top-k's [blocks, kept] values; else the message's own
    shape), `scale` [blocks] float32 (None for codecs without scales), `index` top-k's [blocks,
    kept] positions of its values in their block (`Codec.index_dtype`; None for the others)."""

    payload: jax.Array
    scale: jax.Array | None = None
    index: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Codec:
    """A message codec.

    name: its registry name. wire: the payload's dtype name (None: the message's own, `none`).
    largest: the largest magnitude a block is scaled to (block codecs; 0: no blocks, no scale).
    integer: the payload is rounded to integers (int8, int4) rather than cast to a float format.
    packed: values per payload element: 2 for int4, whose nibbles share a uint8 (1: one value each).
    keep: top-k: the entries of largest magnitude a block keeps, sent with their positions (0: not top-k).
    """

    name: str
    wire: str | None = None
    largest: float = 0.0
    integer: bool = False
    packed: int = 1
    keep: int = 0

    @property
    def blocked(self) -> bool:
        return self.largest > 0 or self.sparse

    @property
    def sparse(self) -> bool:
        """Top-k: a block's `keep` largest entries and their positions."""
        return self.keep > 0

    @property
    def lossless(self) -> bool:
        return self.wire is None and not self.sparse

    @property
    def index_dtype(self):
        """Top-k's position dtype: the smallest unsigned integer that indexes a block of BLOCK."""
        return next(jnp.dtype(t) for t in ("uint8", "uint16", "uint32") if jnp.iinfo(t).max >= BLOCK - 1)

    def wire_itemsize(self, dtype=jnp.float32) -> int:
        """Bytes of one payload element (a message of `dtype` for `none`)."""
        return jnp.dtype(self.wire or dtype).itemsize

    def wire_bytes(self, elements: int, dtype=jnp.float32) -> int:
        """Bytes of a message of `elements` elements of `dtype` on the wire: the payload (padded to
        whole blocks for the block codecs) and one float32 scale per block."""
        if not self.blocked:
            return int(elements) * self.wire_itemsize(dtype)
        blocks = -(-int(elements) // BLOCK)
        if self.sparse:
            return blocks * self.keep * (jnp.dtype(dtype).itemsize + self.index_dtype.itemsize)
        return blocks * (BLOCK // self.packed * self.wire_itemsize() + SCALE_BYTES)

    def ratio(self, dtype=jnp.float32) -> float:
        """Wire bytes per byte of the message, for large messages (scales included)."""
        return self.wire_bytes(BLOCK * 1024, dtype) / (BLOCK * 1024 * jnp.dtype(dtype).itemsize)

    def encode(self, x: jax.Array) -> Encoded:
        if self.lossless:
            return Encoded(x)
        if not self.blocked:
            return Encoded(_bits(x.astype(self.wire)))
        if self.sparse:
            return _top_k(x, self.keep, self.index_dtype)
        blocks = _blocks(x.astype(jnp.float32))
        peak = jnp.max(jnp.abs(blocks), axis=1)
        scale = peak / self.largest
        # an all-zero block has scale 0: its payload is zeros, not 0/0
        safe = jnp.where(scale > 0, scale, 1.0)
        scaled = blocks / safe[:, None]
        if self.integer:
            scaled = jnp.clip(jnp.round(scaled), -self.largest, self.largest)
        if self.packed == 2:
            return Encoded(_pack_nibbles(scaled), scale)
        return Encoded(_bits(scaled.astype(self.wire)), scale)

    def decode(self, encoded: Encoded, like: jax.Array | jax.ShapeDtypeStruct) -> jax.Array:
        """The message in `like`'s shape and dtype."""
        if self.lossless:
            return encoded.payload
        if self.sparse:
            return _from_blocks(_scatter_top_k(encoded), like)
        if self.packed == 2:
            payload = _unpack_nibbles(encoded.payload)
        else:
            payload = _unbits(encoded.payload, self.wire)
        if not self.blocked:
            return payload.astype(like.dtype)
        return _from_blocks(payload.astype(jnp.float32) * encoded.scale[:, None], like)

    def round_trip(self, x: jax.Array) -> jax.Array:
        """What the receiver gets for `x`: `decode(encode(x))`."""
        return self.decode(self.encode(x), x)

    def encode_tree(self, tree):
        return jax.tree.map(self.encode, tree)

    def decode_tree(self, encoded, like):
        """`encode_tree`'s inverse, in `like`'s shapes and dtypes."""
        leaves, tree = jax.tree.flatten(like)
        sent = tree.flatten_up_to(encoded)
        return jax.tree.unflatten(tree, [self.decode(e, x) for e, x in zip(sent, leaves)])


def _bits(payload: jax.Array) -> jax.Array:
    """A float payload as its bits, an unsigned integer of its width (an integer payload as it is):
    XLA:CPU widens bfloat16 and float8 collectives to f32 / f16, never an integer one, so the
    message crosses in the codec's bytes on every backend."""
    if not jnp.issubdtype(payload.dtype, jnp.floating):
        return payload
    return lax.bitcast_convert_type(payload, jnp.dtype(f"uint{8 * payload.dtype.itemsize}"))


def _unbits(payload: jax.Array, wire: str) -> jax.Array:
    """`_bits`' inverse: the payload in the codec's wire dtype."""
    if payload.dtype == jnp.dtype(wire):
        return payload
    return lax.bitcast_convert_type(payload, jnp.dtype(wire))


# The nibble of integer q in [-7, 7] is q + NIBBLE_ZERO, in [1, 15] (an unsigned 4-bit field).
NIBBLE_ZERO = 8


def _pack_nibbles(q: jax.Array) -> jax.Array:
    """Integer-valued rows [blocks, BLOCK] in [-7, 7] as uint8 [blocks, BLOCK / 2]: element 2i's
    nibble in the low 4 bits of byte i, element 2i + 1's in the high 4 (packed by hand: XLA has no
    4-bit collective on every backend, a uint8 one it sends as it is)."""
    nibbles = (q + NIBBLE_ZERO).astype(jnp.uint8).reshape(q.shape[0], -1, 2)
    return nibbles[..., 0] | (nibbles[..., 1] << 4)


def _unpack_nibbles(packed: jax.Array) -> jax.Array:
    """`_pack_nibbles`' inverse: float32 rows [blocks, BLOCK] of the integers."""
    nibbles = jnp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    return nibbles.astype(jnp.float32) - NIBBLE_ZERO


def _blocks(x: jax.Array) -> jax.Array:
    """`x` raveled into rows of BLOCK elements, the last zero-padded."""
    flat = x.reshape(-1)
    pad = -flat.shape[0] % BLOCK
    return jnp.pad(flat, (0, pad)).reshape(-1, BLOCK)


def _from_blocks(rows: jax.Array, like) -> jax.Array:
    """`_blocks`' inverse: the rows' first elements in `like`'s shape and dtype (the padding dropped)."""
    n = math.prod(like.shape)
    return rows.reshape(-1)[:n].reshape(like.shape).astype(like.dtype)


def _top_k(x: jax.Array, keep: int, index_dtype) -> Encoded:
    """Each block's `keep` entries of largest magnitude (exact, in x's dtype) and their positions in
    the block (ties: the lower position first, `lax.top_k`'s order)."""
    blocks = _blocks(x)
    _, index = lax.top_k(jnp.abs(blocks), keep)
    return Encoded(jnp.take_along_axis(blocks, index, axis=1), index=index.astype(index_dtype))


def _scatter_top_k(encoded: Encoded) -> jax.Array:
    """`_top_k`'s blocks back: each kept value at its position, zeros elsewhere."""
    values, index = encoded.payload, encoded.index.astype(jnp.int32)
    rows = jnp.arange(values.shape[0])[:, None]
    return jnp.zeros((values.shape[0], BLOCK), values.dtype).at[rows, index].set(values)


CODECS: dict[str, Codec] = {c.name: c for c in (
    Codec("none"),
    Codec("bf16", "bfloat16"),
    Codec("fp8-e4m3", "float8_e4m3fn", largest=448.0),
    Codec("fp8-e5m2", "float8_e5m2", largest=57344.0),
    Codec("int8", "int8", largest=127.0, integer=True),
    Codec("int4", "uint8", largest=7.0, integer=True, packed=2),
    Codec("topk-1/8", keep=BLOCK // 8),
)}

# Config keys `compress.<kind>`, and the messages (`cdpjax.program.events.MESSAGES`) each covers.
KINDS = {"activations": ("activation",), "cotangents": ("cotangent",), "gradients": ("partial", "sum"),
         "parameters": ("parameters",)}


def lookup(name: str, key: str = "codec") -> Codec:
    """The codec named `name`; a ConfigError listing the codecs for any other name."""
    if not isinstance(name, str) or name not in CODECS:
        raise ConfigError(f"{key}={name!r} is not a codec; codecs: {', '.join(CODECS)}")
    return CODECS[name]


@dataclasses.dataclass(frozen=True)
class Codecs:
    """The codec of each message kind (`KINDS`), from the config's `compress` dict."""

    activations: Codec = CODECS["none"]
    cotangents: Codec = CODECS["none"]
    gradients: Codec = CODECS["none"]
    parameters: Codec = CODECS["none"]
    feedback: bool = False

    @classmethod
    def from_config(cls, config) -> "Codecs":
        given = dict(config.get("compress", {}) or {})
        for key in given:
            if key not in KINDS and key != "feedback":
                raise ConfigError(f"unknown config key 'compress.{key}'; known: {', '.join(KINDS)}, feedback")
        feedback = given.pop("feedback", False)
        if not isinstance(feedback, bool):
            raise ConfigError(f"compress.feedback must be True or False, got {feedback!r}")
        codecs = cls(**{k: lookup(v, f"compress.{k}") for k, v in given.items()}, feedback=feedback)
        if feedback and codecs.gradients.lossless:
            raise ConfigError("compress.feedback=True resends what a gradient codec drops, but compress.gradients="
                              "'none' drops nothing: set a lossy compress.gradients or compress.feedback=False")
        if codecs.gradients.sparse and not feedback:
            raise ConfigError(f"compress.gradients={codecs.gradients.name!r} drops {_dropped(codecs.gradients)} of "
                              f"every gradient message and, without compress.feedback=True, never sends it: set "
                              f"compress.feedback=True (the CDP ring; cdp-zero's pieces keep no feedback, so top-k "
                              f"cannot run there) or a block codec (bf16, fp8-*, int8, int4)")
        if codecs.parameters.sparse:
            raise ConfigError(f"compress.parameters={codecs.parameters.name!r} would zero {_dropped(codecs.parameters)}"
                              f" of each parameter piece (parameter messages keep no error feedback): set a block "
                              f"codec (bf16, fp8-*, int8, int4) or 'none'")
        return codecs

    def of(self, what: str) -> Codec:
        """The codec of a message carrying `what` (an events.MESSAGES name); `none` for messages
        no config key covers (the image beside an activation)."""
        for kind, messages in KINDS.items():
            if what in messages:
                return getattr(self, kind)
        return CODECS["none"]

    @property
    def lossless(self) -> bool:
        return all(getattr(self, k).lossless for k in KINDS)


def _dropped(codec: Codec) -> str:
    """The share of each block top-k `codec` drops, as a fraction ('7/8')."""
    g = math.gcd(BLOCK - codec.keep, BLOCK)
    return f"{(BLOCK - codec.keep) // g}/{BLOCK // g}"


def with_codecs(program, codecs: Codecs):
    """`program` (a lowered `cdpjax.program.Program`) with each message event's codec set by what
    it carries, so that its `sent_bytes` are the bytes on the wire."""
    from cdpjax.program.events import Receive, Send

    def coded(event):
        if not isinstance(event, (Send, Receive)):
            return event
        return dataclasses.replace(event, codec=codecs.of(event.what).name)
    return dataclasses.replace(program, events=tuple(coded(e) for e in program.events))


def check_method(name: str, program, codecs: Codecs) -> None:
    """A ConfigError where a kind's codec is set but method `name` encodes no message of that
    kind (its program, `with_codecs` applied by the engines that encode, has no such send in that
    codec: dp and e2e send none point to point, ppll no cotangents)."""
    for kind, messages in KINDS.items():
        codec = getattr(codecs, kind)
        sends = () if program is None else program.sends
        if not codec.lossless and not any(s.what in messages and s.codec == codec.name for s in sends):
            raise ConfigError(f"compress.{kind}={codec.name!r}: method {name!r} encodes no {kind} messages (codecs "
                              f"run on the pipelines' activations and cotangents, the CDP ring's gradient sums and "
                              f"cdp-zero's parameter and gradient pieces); "
                              f"set compress.{kind}='none'")


class Feedback(NamedTuple):
    """Error feedback on one route: `kept`, what the codec dropped from the sender's last
    message on it (zeros before the first)."""

    kept: jax.Array


def feedback_encode(codec: Codec, x: jax.Array, state: Feedback) -> tuple[Encoded, Feedback]:
    """`x` plus what the last message dropped, encoded; the new state keeps what this one drops:
    sent = x + kept, kept' = sent - decode(encode(sent))."""
    sent = x + state.kept
    encoded = codec.encode(sent)
    return encoded, Feedback(sent - codec.decode(encoded, sent))


__all__ = ["BLOCK", "CODECS", "Codec", "Codecs", "Encoded", "Feedback", "KINDS", "SCALE_BYTES", "check_method",
           "feedback_encode", "lookup", "with_codecs"]
