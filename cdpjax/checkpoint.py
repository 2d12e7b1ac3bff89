"""Orbax checkpoints of the whole train state (in-flight pipeline and CDP state included).

Orbax writes each checkpoint to a temporary directory (`<step>.orbax-checkpoint-tmp-*`)
and renames it when it is complete, so a checkpoint that was being written when
the process died is never listed, and resume takes the previous complete one.
Such leftovers are removed only by the run that owns the directory
(`cdpjax.workdir`) and only when no live writer can own them: the trainer passes
`remove_leftovers=True` when it holds WORKDIR's lock and the previous owner is gone
(not when `--force` took the lock from a live run); readers never remove. Next to the
state, each checkpoint holds a small JSON `meta` (method, mesh shape, skipped
steps, the partial logging window), which says whether the state fits a run
before it is restored.
"""
from __future__ import annotations

import json
import os
import shutil

import jax
import orbax.checkpoint as ocp

from cdpjax.errors import ConfigError

TMP_MARK = ".orbax-checkpoint-tmp"  # orbax names a checkpoint being written <step>.orbax-checkpoint-tmp-<time>


class Checkpointer:
    def __init__(self, workdir: str, max_to_keep: int = 2, remove_leftovers: bool = False):
        """WORKDIR/checkpoints. `remove_leftovers`: remove temporary checkpoint directories, which
        only the owner of WORKDIR's lock may ask for, when their writer is known to be dead."""
        self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise ConfigError(f"checkpoint path {self.directory!r} exists and is not a directory: "
                              f"move it away or use another --workdir")
        if remove_leftovers and jax.process_index() == 0 and os.path.isdir(self.directory):
            # What a writer that died left behind; orbax never lists it. Removed here, before the
            # manager exists (orbax's own clean-up runs in a thread and races with other readers).
            for name in os.listdir(self.directory):
                if TMP_MARK in name:
                    shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                                 enable_async_checkpointing=False),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state, meta: dict) -> None:
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
        self.manager.wait_until_finished()

    def _damaged(self, step: int, e: Exception, why: str) -> ConfigError:
        older = [s for s in self.all_steps() if s < step]
        hint = (f"remove {os.path.join(self.directory, str(step))} to resume from the previous complete "
                f"checkpoint (step {older[-1]}), or use a fresh --workdir" if older else "use a fresh --workdir")
        return ConfigError(f"checkpoint {step} in {self.directory} {why} "
                           f"({type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}); {hint}")

    def read_meta(self, step: int) -> dict:
        """The JSON meta saved with checkpoint `step` (ConfigError if unreadable)."""
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
            return dict(out["meta"] or {})
        except Exception as e:  # noqa: BLE001 - any failure to read is a damaged checkpoint
            raise self._damaged(step, e, "is damaged: its meta cannot be read") from None

    def restore(self, step: int, like, explain=None):
        """Restores into the structure, shapes and shardings of `like` -> (state, meta).

        `explain(error) -> ConfigError` words a failure for the caller's situation; by
        default the checkpoint is called damaged or from another run."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        except Exception as e:  # noqa: BLE001 - corrupt or from another layout: say so plainly
            raise (explain(e) if explain else self._damaged(step, e, (
                "cannot be restored into this run's state: it was written by another method, model "
                "or mesh, or it is damaged"))) from None
        return out["state"], dict(out["meta"] or {})

    def close(self):
        self.manager.close()


def read_meta(workdir: str) -> dict | None:
    path = os.path.join(workdir, "run.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return None
