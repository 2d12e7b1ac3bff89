"""Typed train states: checkpoints written when every method's state was a dict (keys read as
`state['params']`, arrays named `['params'][0]...` in the checkpoint's meta) restore bit for
bit into the typed state (`.params[0]...`).

The old checkpoint is written by hand here: a dict with the keys the methods used before,
saved by `Checkpointer.save` (which records whatever paths its tree has), then restored into
the method's own typed `init` state."""
from typing import NamedTuple

import jax
import numpy as np
import pytest

from cdpjax.checkpoint import Checkpointer
from cdpjax.train_state import as_dicts, from_dicts, is_typed_state, typed_state

from helpers import build, small_config


def _distinct(tree, seed):
    """`tree` with every array changed to other seeded values of its shape and dtype (so that a
    restore which dropped or swapped an array cannot pass)."""
    rng = np.random.default_rng(seed)

    def other(x):
        x = np.asarray(x)
        if x.dtype == bool:
            return rng.integers(0, 2, x.shape).astype(bool)
        if np.issubdtype(x.dtype, np.integer):
            return rng.integers(0, 100, x.shape).astype(x.dtype)
        return rng.normal(size=x.shape).astype(x.dtype)

    return jax.tree.map(other, tree)


def _fields(*names):
    """The old dict of a state whose keys were its field names, written out."""
    return lambda s: {name: getattr(s, name) for name in names if getattr(s, name) is not None}


def _stage_engine_dict(s):
    """The stage engine's train state as the dict it was: the rows by part, what is in flight by name."""
    parts = lambda r: {k: v for k, v in (("body", r.body), ("head", r.head)) if v is not None}  # noqa: E731
    out = {"rows": parts(s.rows), "opt_state": parts(s.opt_state), "model_state": s.model_state}
    out.update({k: getattr(s, k) for k in ("head_state", "previous", "state_sums", "fed", "labels")
                if getattr(s, k) is not None})
    if s.buffers is not None:  # under the names they had then (the fields are plural now)
        out["buffers"] = {old: getattr(s.buffers, new) for old, new in (("act", "acts"), ("input", "input"),
                                                                      ("image", "image"), ("cot", "cots"),
                                                                      ("residual", "residuals"))
                          if getattr(s.buffers, new) is not None}
    if s.grads is not None:
        out["grads"] = parts(s.grads)
    return out


def _ring_dict(s):
    """A ring worker's state as the dict it was: the kept residuals under `kept`."""
    out = {k: getattr(s, k) for k in ("params", "opt_state", "grads", "fed", "model_state", "acts", "cots", "labels",
                                      "older", "feedback") if getattr(s, k) is not None}
    if s.residuals is not None:
        out["kept"] = s.residuals
    return out


def _zero_dict(s):
    out = {k: getattr(s, k) for k in ("master", "opt_state", "sums", "relay", "fed", "model_state", "acts", "cots",
                                      "labels")}
    if s.residuals is not None:
        out["kept"] = s.residuals
    return out


# What each method's train state was as a dict (the keys read as `state['params']` before), written
# out from the typed state's fields.
OLD_FORM = {
    "e2e": _fields("params", "model_state", "opt_state"),
    "dp": _fields("params", "model_state", "opt_state"),
    "cdp-v2": _fields("params", "previous", "model_state", "opt_state"),
    "cdp-random": _fields("history", "model_state", "opt_state", "correction", "step"),
    "local": lambda s: {"params": {"body": s.params.body, "head": s.params.head}, "model_state": s.model_state,
                        "head_state": s.head_state, "opt_state": s.opt_state},
    "gpipe": _stage_engine_dict,
    "ppll": _stage_engine_dict,
    "cdp-mp": _stage_engine_dict,
    "cdp-v1": _ring_dict,
    "cdp-zero": _zero_dict,
}
MESHES = {"e2e": {"data": 1}, "dp": {"data": 4}, "cdp-v2": {"data": 2}, "cdp-random": {"data": 2}, "local": {"data": 1},
          "gpipe": {"stage": 2}, "ppll": {"stage": 4}, "cdp-mp": {"stage": 4},
          "cdp-v1": {"data": 4}, "cdp-zero": {"data": 4}}
SETTINGS = {"cdp-v2": {"cdp_impl": "simulate", "workers": 4}, "cdp-random": {"cdp_impl": "simulate", "workers": 4},
            "gpipe": {"stages": 2}, "ppll": {"stages": 4, "norm": "batch"},
            "cdp-mp": {"stages": 4, "norm": "batch", "residuals": "carry"},
            "cdp-v1": {"cdp_impl": "ring", "workers": 4, "stages": 4, "residuals": "carry"},
            "cdp-zero": {"workers": 4, "stages": 4, "residuals": "carry"}}


@pytest.mark.parametrize("name", sorted(OLD_FORM))
def test_a_checkpoint_of_the_dict_state_restores_into_the_typed_state(name, tmp_path):
    method = build(small_config(name, global_batch_size=16, **SETTINGS.get(name, {})), MESHES[name])
    typed = method.init(jax.random.key(0))
    assert not isinstance(typed, dict)
    old = OLD_FORM[name](_distinct(jax.device_get(typed), seed=1))
    assert isinstance(old, dict) and all(isinstance(k, str) for k in old)
    ckpt = Checkpointer(str(tmp_path))
    try:
        ckpt.save(3, old, {})
        assert all(path.startswith("['") for path, _, _ in ckpt.read_meta(3)["tree"])  # dict paths
        restored, _ = ckpt.restore(3, typed)
    finally:
        ckpt.close()
    assert type(restored) is type(typed) and jax.tree.structure(restored) == jax.tree.structure(typed)
    got = OLD_FORM[name](restored)
    assert jax.tree.structure(got) == jax.tree.structure(old)
    for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
        assert np.asarray(b).dtype == np.asarray(a).dtype


def test_a_typed_checkpoint_restores_as_itself(tmp_path):
    """A checkpoint written from the typed state (paths `.params[0]`) restores without translation."""
    method = build(small_config("e2e", global_batch_size=16), {"data": 1})
    typed = method.init(jax.random.key(0))
    saved = jax.tree.map(np.asarray, _distinct(jax.device_get(typed), seed=2))
    ckpt = Checkpointer(str(tmp_path))
    try:
        ckpt.save(1, saved, {})
        assert any(path.startswith(".params") for path, _, _ in ckpt.read_meta(1)["tree"])
        restored, _ = ckpt.restore(1, typed)
    finally:
        ckpt.close()
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(b), a)


class _BuffersBeforeTheRename(NamedTuple):
    """The stage engine's slot buffers as the typed state named them before they took the program's
    plural names (its checkpoints' paths `.buffers.act`...), written out."""

    act: object
    input: object = None
    image: object = None
    cot: object = None
    residual: object = None


@pytest.mark.parametrize("name", ["cdp-mp", "ppll"])
def test_a_typed_checkpoint_from_before_a_field_rename_restores(name, tmp_path):
    """A checkpoint the typed stage state wrote while its buffers were `act` / `cot` / `residual`
    (paths `.buffers.act`) restores bit for bit into the state whose fields are `acts` / `cots` /
    `residuals`."""
    method = build(small_config(name, global_batch_size=16, **SETTINGS[name]), MESHES[name])
    typed = method.init(jax.random.key(0))
    assert typed.buffers is not None
    saved = jax.tree.map(np.asarray, _distinct(jax.device_get(typed), seed=3))
    b = saved.buffers
    old = saved._replace(buffers=_BuffersBeforeTheRename(b.acts, b.input, b.image, b.cots, b.residuals))
    ckpt = Checkpointer(str(tmp_path))
    try:
        ckpt.save(2, old, {})
        assert any(path.startswith(".buffers.act[") or path == ".buffers.act"
                   for path, _, _ in ckpt.read_meta(2)["tree"])
        restored, _ = ckpt.restore(2, typed)
    finally:
        ckpt.close()
    assert type(restored) is type(typed) and jax.tree.structure(restored) == jax.tree.structure(typed)
    for a, c in zip(jax.tree.leaves(saved), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(c), a)
        assert np.asarray(c).dtype == a.dtype


def test_renamed_fields_go_back_to_their_old_keys():
    @typed_state(renamed={"residuals": "kept"})
    class Held(NamedTuple):
        params: list
        residuals: list | None = None
        grads: object = None

    state = Held([np.ones(2)], [np.zeros(3)])
    assert as_dicts(state).keys() == {"params", "kept"}  # grads None: absent, as the dict had it
    back = from_dicts(state, {"params": [np.full(2, 5.0)], "kept": [np.full(3, 7.0)]})
    assert isinstance(back, Held) and back.grads is None
    np.testing.assert_array_equal(back.residuals[0], np.full(3, 7.0))
    with pytest.raises(TypeError, match="'kept', which is not one of its fields"):
        typed_state(renamed={"kept": "x"})(Held)


def test_every_registered_methods_state_is_typed():
    """No method's `init` returns a dict: every registered method's train state is a registered
    NamedTuple (its shape only: nothing is computed)."""
    from cdpjax import methods
    from cdpjax import setup as setup_lib

    from test_reliability import layout, small_config as run_config

    names = sorted(methods.REGISTRY)
    assert {"e2e", "dp", "cdp-v2", "cdp-zero", "ppll", "gpipe"} <= set(names)
    for name in names:
        config = run_config(name)
        _, _, method = setup_lib.setup(config, layout(name)[1])
        shape = jax.eval_shape(method.init, jax.random.key(0))
        assert is_typed_state(shape), (name, type(shape))
