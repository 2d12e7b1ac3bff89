"""Typed train states, and the dict form in which checkpoints written before they were typed hold them.

Every method's train state is a NamedTuple with fixed fields, a part the method does not keep
`None` (as optax's states and MaxText's loop state do), read as attributes. `typed_state`
registers such a class. Checkpoints written before the states were typed hold each one as a
dict keyed by its field names (some under older names: `renamed`); orbax stores a NamedTuple's
fields under the same keys as a dict's, but the checkpoint's meta names every array by its
`jax.tree_util.keystr` path, `.params[0]` now and `['params'][0]` then. `as_dicts` gives a
state in that old form (its arrays' paths the old ones), and `from_dicts` takes a tree of that
form back into the typed one, so `cdpjax.checkpoint` restores an old checkpoint bit for bit.
A field renamed after its class was typed keeps its old name in `renamed` too: `as_renamed` /
`from_renamed` give and take the typed form checkpoints had before the rename (`.buffers.act`).
A leaf module: it imports nothing of cdpjax.
"""
from __future__ import annotations

import collections
from typing import NamedTuple

# {registered class: {field: the dict key checkpoints written before it was typed used}}
_SAVED_KEYS: dict[type, dict[str, str]] = {}


def typed_state(cls=None, *, renamed: dict[str, str] | None = None):
    """Registers a NamedTuple train state whose checkpoints used to be dicts keyed by its field
    names, `renamed` mapping a field to the key it had then (`@typed_state` or
    `@typed_state(renamed={'opt_state': 'opt'})`)."""

    def register(c):
        if not (isinstance(c, type) and issubclass(c, tuple) and hasattr(c, "_fields")):
            raise TypeError(f"typed_state registers NamedTuple classes, not {c!r}")
        unknown = sorted(set(renamed or {}) - set(c._fields))
        if unknown:
            raise TypeError(f"typed_state({c.__name__}) renames {unknown[0]!r}, which is not one of its fields "
                            f"{c._fields}")
        _SAVED_KEYS[c] = {name: (renamed or {}).get(name, name) for name in c._fields}
        return c

    return register if cls is None else register(cls)


def is_typed_state(x) -> bool:
    return type(x) in _SAVED_KEYS


def as_dicts(tree):
    """`tree` with every registered typed state turned into the dict that stood for it before:
    its fields that are not None, under their saved keys. Other nodes are kept (optax's own
    NamedTuple states were stored as such then too)."""
    if is_typed_state(tree):
        keys = _SAVED_KEYS[type(tree)]
        return {keys[name]: as_dicts(value) for name, value in zip(tree._fields, tree) if value is not None}
    if isinstance(tree, dict):
        return {k: as_dicts(v) for k, v in tree.items()}
    if type(tree) in (list, tuple):
        return type(tree)(as_dicts(v) for v in tree)
    return tree


# {registered class with renamed fields: a NamedTuple class of its fields under their saved names}
_RENAMED_TYPES: dict[type, type] = {}


def as_renamed(tree):
    """`tree` with every registered typed state whose fields were renamed turned into a NamedTuple
    of the same values under the fields' saved names: the form, and the paths (`.buffers.act`),
    of a checkpoint the typed state wrote before the rename."""
    if is_typed_state(tree):
        keys = _SAVED_KEYS[type(tree)]
        values = [as_renamed(v) for v in tree]
        if all(keys[name] == name for name in tree._fields):
            return type(tree)(*values)
        if type(tree) not in _RENAMED_TYPES:
            _RENAMED_TYPES[type(tree)] = collections.namedtuple(type(tree).__name__, [keys[n] for n in tree._fields])
        return _RENAMED_TYPES[type(tree)](*values)
    if isinstance(tree, dict):
        return {k: as_renamed(v) for k, v in tree.items()}
    if type(tree) in (list, tuple):
        return type(tree)(as_renamed(v) for v in tree)
    return tree


def from_renamed(like, tree):
    """`tree`, in `as_renamed(like)`'s form, back in `like`'s types (fields by position)."""
    if is_typed_state(like):
        return type(like)(*(None if value is None else from_renamed(value, old) for value, old in zip(like, tree)))
    if isinstance(like, dict):
        return {k: from_renamed(v, tree[k]) for k, v in like.items()}
    if type(like) in (list, tuple):
        return type(like)(from_renamed(a, b) for a, b in zip(like, tree))
    return tree


def from_dicts(like, tree):
    """`tree`, in `as_dicts(like)`'s form, back in `like`'s types (each value where `like` has it)."""
    if is_typed_state(like):
        keys = _SAVED_KEYS[type(like)]
        return type(like)(*(None if value is None else from_dicts(value, tree[keys[name]])
                            for name, value in zip(like._fields, like)))
    if isinstance(like, dict):
        return {k: from_dicts(v, tree[k]) for k, v in like.items()}
    if type(like) in (list, tuple):
        return type(like)(from_dicts(a, b) for a, b in zip(like, tree))
    return tree


@typed_state
class Dense(NamedTuple):
    """The train state of a method that keeps one copy of the parameters and steps them once per
    global batch (e2e, dp: interchangeable in a run directory, `Layout.state_as`).

    params, model_state: per-stage lists in `StagedNet`'s layout (model_state: BatchNorm's running
      statistics). opt_state: per-stage optax states, stepped once per global batch.
    """

    params: list
    model_state: list
    opt_state: list

