"""Typed train states: checkpoints written when every method's state was a dict (keys read as
`state['params']`, arrays named `['params'][0]...` in the checkpoint's meta) restore bit for
bit into the typed state (`.params[0]...`).

The old checkpoint is written by hand here: a dict with the keys the methods used before,
saved by `Checkpointer.save` (which records whatever paths its tree has), then restored into
the method's own typed `init` state."""
import jax
import numpy as np
import pytest

from cdpjax.checkpoint import Checkpointer
from cdpjax.train_state import as_dicts, from_dicts, typed_state

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


# What each method's train state was as a dict, written out from its fields: {old key: field}.
OLD_KEYS = {
    "e2e": {"params": "params", "model_state": "model_state", "opt_state": "opt_state"},
    "dp": {"params": "params", "model_state": "model_state", "opt_state": "opt_state"},
    "cdp-v2": {"params": "params", "previous": "previous", "model_state": "model_state", "opt_state": "opt_state"},
}
MESHES = {"e2e": {"data": 1}, "dp": {"data": 4}, "cdp-v2": {"data": 2}}
SETTINGS = {"cdp-v2": {"cdp_impl": "simulate", "workers": 4}}


@pytest.mark.parametrize("name", sorted(OLD_KEYS))
def test_a_checkpoint_of_the_dict_state_restores_into_the_typed_state(name, tmp_path):
    method = build(small_config(name, global_batch_size=16, **SETTINGS.get(name, {})), MESHES[name])
    typed = method.init(jax.random.key(0))
    assert not isinstance(typed, dict)
    fields = {old: getattr(typed, field) for old, field in OLD_KEYS[name].items()
              if getattr(typed, field) is not None}
    old = _distinct(jax.device_get(fields), seed=1)
    ckpt = Checkpointer(str(tmp_path))
    try:
        ckpt.save(3, old, {})
        assert any(path.startswith("['params']") for path, _, _ in ckpt.read_meta(3)["tree"])
        restored, _ = ckpt.restore(3, typed)
    finally:
        ckpt.close()
    assert type(restored) is type(typed)
    for key, field in OLD_KEYS[name].items():
        want, got = old.get(key), getattr(restored, field)
        assert jax.tree.structure(got) == jax.tree.structure(getattr(typed, field))
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
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


def test_renamed_fields_go_back_to_their_old_keys():
    from typing import NamedTuple

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
