"""Orbax checkpoints of the whole train state (in-flight pipeline and CDP state included).

Orbax writes each checkpoint to a temporary directory and renames it when it is
complete, so a checkpoint that was being written when the process died is never
listed, and resume takes the previous complete one.
"""
from __future__ import annotations

import json
import os

import jax
import orbax.checkpoint as ocp

from cdpjax.config import ConfigError


class Checkpointer:
    def __init__(self, workdir: str, max_to_keep: int = 2):
        self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise ConfigError(f"checkpoint path {self.directory!r} exists and is not a directory")
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                                 enable_async_checkpointing=False),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, meta: dict) -> None:
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
        self.manager.wait_until_finished()

    def restore(self, step: int, like):
        """Restores into the structure, shapes and shardings of `like`."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        except Exception as e:  # corrupt or from another layout: say so plainly
            raise ConfigError(
                f"checkpoint {step} in {self.directory} cannot be restored into this run's state "
                f"({type(e).__name__}: {str(e).splitlines()[0][:300]}); it was written by another "
                f"method, model or mesh, or it is damaged: use a fresh --workdir or remove it"
            ) from None
        return out["state"], dict(out["meta"])

    def close(self):
        self.manager.close()


def read_meta(workdir: str) -> dict | None:
    path = os.path.join(workdir, "run.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return None
