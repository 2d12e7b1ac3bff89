"""The errors cdpjax raises on purpose. A leaf module: it imports nothing of cdpjax, so every
module (the config among them) can import it without an import cycle.

- `ConfigError`: bad input (a config value, a command-line flag, a work directory, a
  checkpoint that does not fit). The command line prints its one-line message and exits 2.
- `StorageError`: a ConfigError for a file that cannot be written (no space left, a quota,
  a read-only file system, no permission): the message names the file (exit 2).
- `NonFiniteError`: a NaN or Inf in training (exit status 3).

`storage_problem(e)` says whether an exception (or one it was raised from) is such a
storage failure, in words, whatever library raised it (Python's OSError, tensorstore's
RESOURCE_EXHAUSTED inside orbax's errors).
"""
from __future__ import annotations

import errno

_ERRNO_WORDS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EFBIG: "the file is too large for the file system",
}
# How the same failures read in the messages of libraries that do not keep the errno
# (tensorstore's status text, inside orbax's exceptions).
_TEXT_WORDS = (("No space left on device", errno.ENOSPC), ("Disk quota exceeded", errno.EDQUOT),
               ("Read-only file system", errno.EROFS), ("Permission denied", errno.EACCES),
               ("File too large", errno.EFBIG))


class ConfigError(ValueError):
    """A bad configuration value; the message names the value and what is accepted."""


class StorageError(ConfigError):
    """A file of the run cannot be written (disk full, quota, read-only, permission)."""

    def __init__(self, path: str, reason: str, note: str = ""):
        self.path, self.reason = path, reason
        super().__init__(f"cannot write {path}: {reason}" + (f"; {note}" if note else ""))


class NonFiniteError(RuntimeError):
    """A NaN or Inf in a loss or gradient; training stopped, the last good checkpoint kept."""


def storage_problem(e: BaseException) -> str | None:
    """The storage failure behind `e` in words ('no space left on the device'...), or None."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _ERRNO_WORDS:
            return _ERRNO_WORDS[e.errno]
        text = str(e)
        for pattern, code in _TEXT_WORDS:
            if pattern in text:
                return _ERRNO_WORDS[code]
        e = e.__cause__ or e.__context__
    return None


__all__ = ["ConfigError", "NonFiniteError", "StorageError", "storage_problem"]
