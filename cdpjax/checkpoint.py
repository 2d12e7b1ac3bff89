"""Orbax checkpoints of the whole train state (in-flight pipeline and CDP state included), each
with a checksum of every array, verified on restore.

Orbax writes each checkpoint to a temporary directory (`<step>.orbax-checkpoint-tmp*`)
and renames it when it is complete, so a checkpoint that was being written when
the process died is never listed, and resume takes the previous complete one.
Such leftovers are removed only by the run that owns the directory
(`cdpjax.workdir`) and only when no live writer can own them: the trainer passes
`remove_leftovers=True` when it holds WORKDIR's lock and the previous owner is gone
(not when `--force` took the lock from a live run); readers never remove. A save that
fails (a full disk) removes its own temporary directory.

Next to the state, each checkpoint holds a small JSON `meta` (method, mesh shape, skipped
steps, the partial logging window), which says whether the state fits a run before it is
restored, and what guards the bytes: `tree`, every array's path, shape and dtype (paths and
shapes must match the run's);
`checksums`, per array two sums of its bits taken on the devices (`array_checksums`: the
sum and the position-weighted sum of its 32-bit words, modulo 2**32, so a flipped bit
always shows and the figure does not depend on the sharding or the device count); and
`digest`, a SHA-256 of the rest of the meta; and `step`, the step it was written at (a folder
renamed or copied to another step's name is damaged). Orbax itself verifies none of this (the
arrays it writes through tensorstore carry no checksum of the data, only zarr3's shard
index has a crc32c: one flipped bit of a checkpoint restored silently), so `restore`
recomputes the checksums of what it read and raises `Damaged` when anything differs, and
`read_meta` does for the digest and the step. A meta without them (or without the checksums
or the tree) is damaged: what the digest guards cannot be taken on trust. `save` never
replaces a checkpoint that exists (orbax would: its manager saves with force=True), so that
a run that lost the directory while frozen cannot overwrite the new owner's. A writer names
its temporary directories after its run (`<step>.orbax-checkpoint-tmp-<owner>`, `owner` from
the token of WORKDIR's lock; orbax's own name is the same for every writer, and orbax removes
such a directory it finds), and a failed save removes only its own: a run frozen inside a
write and thawed after `--force` took the directory over finishes (or fails) in its own
directory, never in the new owner's.

With `async_save`, orbax writes the arrays in its own threads while training goes on: `save`
returns once the arrays are copied off the devices (their checksums taken before), and the
step's directory, meta and arrays together, is renamed to `<step>` only once every array is
committed, as for a synchronous save; so a process killed while such a write is in flight
leaves the previous checkpoint the newest complete one. `committed` names the newest step known
whole; `wait` finishes the write in flight (the next `save`, `close`, the run's end and a
preemption call it), raising the StorageError of a write that failed.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from cdpjax import files, shutdown
from cdpjax.errors import ConfigError, StorageError, storage_problem
from cdpjax.train_state import as_dicts, as_renamed, from_dicts, from_renamed

TMP_MARK = ".orbax-checkpoint-tmp"  # orbax writes checkpoint N to N.orbax-checkpoint-tmp*, then renames it
DAMAGED_MARK = ".damaged-"  # a damaged checkpoint set aside: N.damaged-<time> (orbax lists only N)
# Test hook: the write of this step's checkpoint waits, its arrays and meta written but not yet
# renamed into place, until the file named by CDPJAX_TEST_WAIT_FILE exists (an async save: in orbax's thread).
WAIT_IN_COMMIT_ENV = "CDPJAX_TEST_WAIT_IN_COMMIT"
DISCARD_WAIT_S = 2.0  # how long a save waits for a checkpoint at its step to be discarded by its writer


class Damaged(ConfigError):
    """A checkpoint whose bytes are not what was written (a checksum, the meta's digest, or
    files that cannot be read), or that vanished while it was read."""

    def __init__(self, step: int, directory: str, why: str):
        self.step, self.directory, self.why = step, directory, why
        super().__init__(f"checkpoint {step} in {directory} {why}")


def _first_line(e: BaseException, limit: int = 200) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:limit]}" if text else type(e).__name__


# ------------------------------------------------------------------------------------ checksums


def _words(x) -> jax.Array:
    """[sum, position-weighted sum] of the 32-bit words holding x's bits, modulo 2**32."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    size = jnp.dtype(x.dtype).itemsize
    if size == 4 or size == 8:  # an 8-byte value becomes its two words
        w = jax.lax.bitcast_convert_type(x, jnp.uint32)
    else:
        w = jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16}[size]).astype(jnp.uint32)
    w = w.reshape(-1)
    position = jnp.arange(1, w.size + 1, dtype=jnp.uint32)
    return jnp.stack([jnp.sum(w, dtype=jnp.uint32), jnp.sum(w * position, dtype=jnp.uint32)])


@jax.jit
def _checksum_leaves(leaves):
    return [_words(x) for x in leaves]


def _paths(tree) -> list[tuple[str, object]]:
    return [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def array_checksums(tree) -> dict[str, list[int]]:
    """{array path: [sum, weighted sum]} of every array of `tree` (one small program on the
    devices; in a multi-process run every process calls it and gets the same figures)."""
    pairs = _paths(tree)
    if not pairs:
        return {}
    outs = _checksum_leaves([x for _, x in pairs])
    return {path: [int(v) for v in np.asarray(out.addressable_data(0))] for (path, _), out in zip(pairs, outs)}


def tree_signature(tree) -> list[list]:
    """[path, shape, dtype] of every array: what the state must look like to be restored."""
    return [[path, [int(d) for d in np.shape(x)], str(x.dtype)] for path, x in _paths(tree)]


def _digest(meta: dict) -> str:
    body = {k: v for k, v in meta.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# What each meta field must be (a damaged or hand-edited meta is refused, not half used).
_META_RULES = {
    "method": lambda v: isinstance(v, str),
    "mesh": lambda v: isinstance(v, dict) and all(isinstance(k, str) and _int(n) and n >= 1 for k, n in v.items()),
    "devices": lambda v: _int(v) and v >= 1,
    "processes": lambda v: _int(v) and v >= 1,
    "workers": lambda v: v is None or (_int(v) and v >= 1),
    "stale": lambda v: isinstance(v, list) and all(isinstance(r, list) and all(_int(x) for x in r) for r in v),
    "skipped_steps": lambda v: _int(v) and v >= 0,
    "log_window": lambda v: isinstance(v, list) and (
        all(isinstance(r, list) and len(r) == len(v[0]) and all(map(_number, r)) for r in v)
        or all(isinstance(r, dict) and r and all(map(_number, r.values())) for r in v)),
    "time": lambda v: _number(v) and v >= 0,
    "flushed": lambda v: isinstance(v, bool),
    "checksums": lambda v: isinstance(v, dict) and all(
        isinstance(c, list) and len(c) == 2 and all(_int(x) for x in c) for c in v.values()),
    "tree": lambda v: isinstance(v, list) and all(isinstance(r, list) and len(r) == 3 for r in v),
    "digest": lambda v: isinstance(v, str),
    "step": lambda v: _int(v) and v >= 0,
    "run": lambda v: isinstance(v, dict),
    "hyper": lambda v: isinstance(v, dict),
    "metrics": lambda v: v is None or isinstance(v, str),
}
# What every checkpoint's meta holds (`save` writes them): without them nothing guards the bytes.
REQUIRED = ("step", "tree", "checksums", "digest")


def check_meta(meta) -> str | None:
    """What is wrong with a checkpoint's meta, in words, or None."""
    if not isinstance(meta, dict):
        return f"its meta is a {type(meta).__name__}, not a JSON object"
    missing = [key for key in REQUIRED if key not in meta]
    if missing:
        return f"its meta has no {missing[0]!r} field, which every checkpoint's has"
    for key, ok in _META_RULES.items():
        if key in meta and not ok(meta[key]):
            return f"its meta field {key!r} is {json.dumps(meta[key])[:80]}, not what a run writes"
    if "digest" in meta and meta["digest"] != _digest(meta):
        return "its meta does not match its digest"
    return None


class _HeldErrors(logging.Filter):
    """Orbax's own error logs (with their tracebacks, from its threads) while a save or restore
    runs: held, and logged after all only if it succeeds; a failure is said in one line by the
    caller instead."""

    def __init__(self, active: bool = True):
        super().__init__()
        self.held = []
        self.active = active  # holding now (a save's filter: from the save until it is waited for)
        self.passing = False  # while held records are logged after all

    def filter(self, record: logging.LogRecord) -> bool:
        if self.passing or not self.active:
            return True
        if record.levelno >= logging.ERROR and f"{os.sep}orbax{os.sep}" in record.pathname:
            self.held.append(record)
            return False
        return True


class _MissingMetadataNotices(logging.Filter):
    """Orbax's warning that a step directory has no metadata file: such a directory is a
    checkpoint this module reads and judges itself (named damaged in one line and set aside),
    so orbax's notice, once per look at it, is left out."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.WARNING and f"{os.sep}orbax{os.sep}" in record.pathname
                    and record.getMessage().startswith("Metadata file does not exist"))


_MISSING_METADATA = _MissingMetadataNotices()


@contextlib.contextmanager
def _errors_held():
    logger, held = logging.getLogger("absl"), _HeldErrors()
    logger.addFilter(held)
    ok = False
    try:
        yield
        ok = True
    finally:
        logger.removeFilter(held)
        for record in held.held if ok else ():
            logger.handle(record)


def _check_directory(directory: str) -> None:
    if os.path.islink(directory) and not os.path.exists(directory):
        raise ConfigError(f"checkpoint path {directory!r} is a symbolic link that leads nowhere (a loop, or a "
                          f"target that does not exist): remove it, or use another --workdir")
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ConfigError(f"checkpoint path {directory!r} exists and is not a directory: "
                          f"move it away or use another --workdir")


def _temporary_path_class(owner: str):
    """Orbax's atomic-rename temporary path, named `<step>.orbax-checkpoint-tmp-<owner>`."""
    from orbax.checkpoint._src.path import atomicity

    class OwnTemporaryPath(atomicity.AtomicRenameTemporaryPath):
        @classmethod
        def from_final(cls, final_path, **kwargs):
            return cls(final_path.parent / f"{final_path.name}{TMP_MARK}-{owner}", final_path, **kwargs)

        async def finalize(self, *args, **kwargs):
            if os.environ.get(WAIT_IN_COMMIT_ENV) == self.get_final().name:
                import asyncio

                release = os.environ["CDPJAX_TEST_WAIT_FILE"]
                open(release + ".waiting", "w").close()
                while not os.path.exists(release):
                    await asyncio.sleep(0.05)
            return await super().finalize(*args, **kwargs)

    return OwnTemporaryPath


class Checkpointer:
    def __init__(self, workdir: str, max_to_keep: int = 2, remove_leftovers: bool = False, owner: str | None = None,
                 async_save: bool = False):
        """WORKDIR/checkpoints. `remove_leftovers`: remove temporary checkpoint directories, which
        only the owner of WORKDIR's lock may ask for, when their writer is known to be dead.
        `owner`: the writer's own name for its temporary directories (the same in every process
        of a run); None: orbax's (a reader's). `async_save`: orbax writes in its own threads
        (`wait` finishes a write)."""
        self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
        self.owner = owner
        self.async_save = async_save
        self.committed: int | None = None  # the newest checkpoint this object wrote and saw committed
        self.in_flight: int | None = None  # an asynchronous save not yet waited for
        # Orbax's error logs from a save until it is waited for, and after a save failed for as long as
        # this object lives: its threads log a failed write with a traceback, some of them after the
        # caller has heard of the failure (and said it in one line).
        self._held = _HeldErrors(active=False)
        _check_directory(self.directory)
        if remove_leftovers and jax.process_index() == 0 and os.path.isdir(self.directory):
            # What a writer that died left behind; orbax never lists it. Removed here, before the
            # manager exists (orbax's own clean-up runs in a thread and races with other readers).
            for name in os.listdir(self.directory):
                if TMP_MARK in name:
                    shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        logging.getLogger("absl").addFilter(_MISSING_METADATA)  # once: a filter is added only if absent
        logging.getLogger("absl").addFilter(self._held)
        try:
            self.manager = ocp.CheckpointManager(
                self.directory,
                options=ocp.CheckpointManagerOptions(
                    max_to_keep=max_to_keep, create=True, enable_async_checkpointing=async_save,
                    temporary_path_class=_temporary_path_class(owner) if owner else None),
            )
        except Exception as e:  # noqa: BLE001 - a directory that cannot be made: say which and why
            reason = storage_problem(e)
            if reason is None:
                raise
            raise StorageError(self.directory, reason) from None

    def path(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def steps(self) -> list[int]:
        """The complete checkpoints on disk now (re-read: another process may have changed them)."""
        self.manager.reload()
        return self.all_steps()

    def save(self, step: int, state, meta: dict) -> None:
        """Writes checkpoint `step` (a signal waits for it: `shutdown.critical`; with `async_save`
        only for the copy off the devices, the write in flight after it until `wait`). A failure
        removes what it wrote; one of the disk (full, quota, read-only) is a StorageError naming
        the path. The save before it is waited for first."""
        self.wait()
        meta = {**meta, "step": step, "tree": tree_signature(state), "checksums": array_checksums(state)}
        meta["digest"] = _digest(meta)
        with shutdown.critical():
            # A run thawed after losing the directory removes a checkpoint it finished meanwhile
            # (`discard`): a moment is given for that before this one is refused.
            deadline = time.monotonic() + DISCARD_WAIT_S
            while os.path.lexists(self.path(step)) and time.monotonic() < deadline:
                time.sleep(0.05)
            if os.path.lexists(self.path(step)):  # orbax would replace it (force=True): never another's
                raise ConfigError(f"checkpoint {step} exists already in {self.directory}, which this run did not "
                                  f"write (another run writes into this directory); it is left as it is")
            self._hold()
            try:
                saved = self.manager.save(step, args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
            except Exception as e:  # noqa: BLE001 - cleaned up, then said in one line if it is the disk
                self._failed(step, e)
            if saved:
                self.in_flight = step
            if not self.async_save:
                self.wait()
            elif not saved:
                self._release(True)
        if not saved:
            newer = [s for s in self.steps() if s >= step]
            raise ConfigError(f"checkpoint {step} was not written: {self.directory} holds checkpoint "
                              f"{newer[-1] if newer else '?'}, which this run did not write (another run wrote "
                              f"into this directory): move it away and run the same command again")

    def wait(self) -> int | None:
        """Finishes the save in flight (if any): `committed` names it once it is whole; a write
        that failed is removed and raised (a StorageError for the disk). Returns `committed`."""
        step, self.in_flight = self.in_flight, None
        if step is None:
            return self.committed
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - cleaned up, then said in one line if it is the disk
            self._failed(step, e)
        self._release(True)
        self.committed = step
        return step

    def _hold(self) -> None:
        """Orbax's error logs held from the start of a save until it is waited for (its threads
        log a failed write with a traceback before, and after, the save's caller hears of it)."""
        self._held.active = True

    def _release(self, ok: bool) -> None:
        """A save waited for: its held logs logged after all if it succeeded; dropped if it failed,
        and the logs of its threads that come later dropped too."""
        records, self._held.held = self._held.held, []
        if not ok:
            return
        self._held.active, self._held.passing = False, True
        try:
            for record in records:
                logging.getLogger("absl").handle(record)
        finally:
            self._held.passing = False

    def _failed(self, step: int, e: Exception):
        self.in_flight = None
        self.remove_unfinished(step)
        self._release(False)
        reason = storage_problem(e)
        if reason is None:
            raise e
        raise StorageError(self.path(step), reason) from None

    def remove_unfinished(self, step: int) -> None:
        """Removes this process's temporary directory of checkpoint `step` (a save that failed),
        once orbax's own threads of that save are done (they may still make directories)."""
        with contextlib.suppress(Exception), _errors_held():
            self.manager.wait_until_finished()
        if jax.process_index() != 0 or not os.path.isdir(self.directory):
            return
        for _ in range(5):
            mine = f"{step}{TMP_MARK}" + (f"-{self.owner}" if self.owner else "")
            left = [n for n in os.listdir(self.directory) if n == mine or (not self.owner and n.startswith(mine))]
            if not left:
                return
            for name in left:
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
            time.sleep(0.1)

    def discard(self, step: int) -> None:
        """Removes checkpoint `step`, which this process has just written (a run that lost the
        directory to another while writing it: the directory is no longer its to write)."""
        with contextlib.suppress(Exception):
            self.wait()  # an asynchronous write of it is finished first (then removed)
        if jax.process_index() == 0:
            shutil.rmtree(self.path(step), ignore_errors=True)
        self.manager.reload()

    def set_aside(self, step: int) -> str | None:
        """Renames damaged checkpoint `step` to `<step>.damaged-<time>` (kept for inspection, never
        listed again, so that the run can write that step anew); returns the new path."""
        target = f"{self.path(step)}{DAMAGED_MARK}{time.strftime('%Y%m%d-%H%M%S')}"
        if jax.process_index() == 0:
            try:
                os.rename(self.path(step), target)
            except FileNotFoundError:
                target = None  # gone already
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"cdpjax set aside checkpoint {step}")
        self.manager.reload()
        return target

    def _damaged(self, step: int, e: Exception, why: str) -> ConfigError:
        older = [s for s in self.all_steps() if s < step]
        hint = (f"remove {self.path(step)} to resume from the previous complete checkpoint (step {older[-1]}), "
                f"or use a fresh --workdir" if older else "use a fresh --workdir")
        return ConfigError(f"checkpoint {step} in {self.directory} {why} ({_first_line(e, 300)}); {hint}")

    def read_meta(self, step: int) -> dict:
        """The JSON meta saved with checkpoint `step`; `Damaged` if it cannot be read or is not
        what was written."""
        try:
            with _errors_held():
                out = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
            meta = out["meta"] if out["meta"] is not None else {}
        except Exception as e:  # noqa: BLE001 - any failure to read is a damaged (or vanished) checkpoint
            if not os.path.isdir(self.path(step)):
                raise Damaged(step, self.directory, "was removed while it was read") from None
            raise Damaged(step, self.directory, f"is damaged: its meta cannot be read ({_first_line(e)})") from None
        problem = check_meta(meta)
        if problem:
            raise Damaged(step, self.directory, f"is damaged: {problem}")
        if meta["step"] != step:
            raise Damaged(step, self.directory, f"is damaged: its meta says it is checkpoint {meta['step']} (a "
                                                f"folder copied or renamed to another step's name)")
        return dict(meta)

    def restore(self, step: int, like, explain=None):
        """Restores into the structure, shapes and shardings of `like` -> (state, meta), every
        array checked against its checksum. A checkpoint written when train states were dicts
        (`cdpjax.train_state.as_dicts`: its arrays' paths `['params'][0]`, not `.params[0]`), or
        by a typed state before some of its fields were renamed (`as_renamed`: `.buffers.act`, not
        `.buffers.acts`), is restored in that form and returned in `like`'s types.

        A state of another layout (another model, method or mesh: the meta's `tree` differs
        from `like`'s) is a ConfigError, worded by `explain(error)` when given; bytes that are
        not what was written are `Damaged`."""
        meta = self.read_meta(step)
        tree = meta.get("tree")
        typed, back = like, None
        if tree is not None:  # paths and shapes must agree (orbax casts dtypes, as it restores them)
            here = {path: shape for path, shape, _ in tree_signature(like)}
            there = {r[0]: r[1] for r in tree}
            # written when train states were dicts, or before a typed state's fields were renamed:
            # restored in that form, checked against its paths, then put back into the typed state
            for form, unform in ((as_dicts, from_dicts), (as_renamed, from_renamed)):
                if here != there and there == {path: shape for path, shape, _ in tree_signature(form(like))}:
                    like, back, here = form(like), unform, there
            if here != there:
                diff = next((p for p in here if there.get(p) != here[p]), None)
                what = (f"array {diff} has shape {there[diff]} there, {here[diff]} here" if diff in there
                        else f"array {diff} is not there" if diff
                        else f"{len(there)} arrays there, {len(here)} here")
                e = ValueError(f"the checkpoint's train state does not match this run's: {what}")
                raise (explain(e) if explain else ConfigError(
                    f"checkpoint {step} in {self.directory} holds another train state ({what}): it was written "
                    f"by another method, model or mesh; use a fresh --workdir")) from None
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        try:
            with _errors_held():
                out = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        except Exception as e:  # noqa: BLE001 - corrupt, vanished, or (unverified checkpoints) another layout
            if not os.path.isdir(self.path(step)):
                raise Damaged(step, self.directory, "was removed while it was read") from None
            if tree is not None:
                raise Damaged(step, self.directory, f"is damaged: its arrays cannot be read ({_first_line(e)})") \
                    from None
            raise (explain(e) if explain else self._damaged(step, e, (
                "cannot be restored into this run's state: it was written by another method, model "
                "or mesh, or it is damaged"))) from None
        state = out["state"]
        expected = meta.get("checksums")
        if expected is not None:
            got = array_checksums(state)
            bad = [p for p in got if expected.get(p) != got[p]] + [p for p in expected if p not in got]
            if bad:
                raise Damaged(step, self.directory, f"is damaged: array {bad[0]} does not match its checksum"
                              + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))
        return (back(typed, state) if back is not None else state), meta

    def close(self):
        """Waits for a save in flight (errors held: the run has said its line already), then closes."""
        with contextlib.suppress(Exception):
            self.wait()
        self._hold()
        try:
            with contextlib.suppress(Exception):
                self.manager.close()
        finally:
            self._release(False)
            logging.getLogger("absl").removeFilter(self._held)


def read_meta(workdir: str) -> dict | None:
    path = os.path.join(workdir, "run.json")
    if os.path.exists(path):
        return json.loads(files.read_bytes(path))
    return None
