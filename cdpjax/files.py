"""Reading the files cdpjax reads (lock.json, config.json, summary.json, run.json, metrics.jsonl,
a table given to `schedule --from-json`): each must be a regular file, through symbolic links or
not, and no larger than a stated limit, and is read with that limit.

A symbolic link to /dev/zero or /dev/urandom, a FIFO, a socket, a directory or a file past its
limit is a `FileRefused` (a ConfigError: one line, exit 2) naming the path and what it is,
before a byte is read. The file is looked at with `stat` before it is opened (a device is never
opened) and opened without blocking (a FIFO made in between waits for no writer), then checked
again on the open descriptor; a regular file that grows while it is read is read up to its limit
and refused. Limits: `SMALL_LIMIT` for a run's JSON records, `METRICS_LIMIT` for metrics.jsonl,
`cdpjax.table_json.JSON_LIMIT` for a time table.

Writing the files a run writes: inside `writing(path)` a failure of the disk (full, a quota,
read-only, permission) is a StorageError naming the file; `write_atomic` replaces a file whole
(readers see the old file or the new one, never half).
"""
from __future__ import annotations

import contextlib
import os
import stat
from typing import BinaryIO, Iterator

from cdpjax import shutdown
from cdpjax.errors import ConfigError, StorageError, storage_problem

SMALL_LIMIT = 16 * 2**20  # lock.json, config.json, summary.json, run.json: a few kB when a run writes them
METRICS_LIMIT = 2**30  # metrics.jsonl: a million steps logged at a few hundred bytes a line, with room

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


class FileRefused(ConfigError):
    """A file cdpjax reads that is not a regular file, or is past its size limit."""


def kind(mode: int) -> str:
    """What a file of this `st_mode` is, in words ('a regular file', 'a FIFO (named pipe)'...)."""
    return next((words for test, words in _KINDS if test(mode)), "a regular file" if stat.S_ISREG(mode)
                else "not a regular file")


def check_regular(st: os.stat_result, path: str, limit: int) -> None:
    """FileRefused unless `st` is a regular file of at most `limit` bytes."""
    if not stat.S_ISREG(st.st_mode):
        shown = f"{path} (a link to {os.path.realpath(path)})" if os.path.islink(path) else path
        raise FileRefused(f"{shown} is {kind(st.st_mode)}, not a regular file (cdpjax reads "
                          f"only regular files)")
    if st.st_size > limit:
        raise FileRefused(f"{path} holds {st.st_size} bytes, more than the {limit} cdpjax reads from such a file")


@contextlib.contextmanager
def open_bounded(path: str, limit: int) -> Iterator[BinaryIO]:
    """The regular file at `path` opened for reading in binary (module docstring); OSError as
    `open` raises it (FileNotFoundError, PermissionError...). The reader stops at `limit` bytes."""
    check_regular(os.stat(path), path, limit)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        check_regular(os.fstat(fd), path, limit)  # what was opened, should the path have changed since
        os.set_blocking(fd, True)
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        yield f


def read_bytes(path: str, limit: int = SMALL_LIMIT) -> bytes:
    """The whole of the regular file at `path`, at most `limit` bytes (module docstring)."""
    with open_bounded(path, limit) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise FileRefused(f"{path} grew past the {limit} bytes cdpjax reads from such a file while it was read")
    return data


def read_text(path: str, limit: int = SMALL_LIMIT) -> str:
    """`read_bytes` decoded as UTF-8 (UnicodeDecodeError, a ValueError, for other bytes)."""
    return read_bytes(path, limit).decode("utf-8")


__all__ = ["METRICS_LIMIT", "SMALL_LIMIT", "FileRefused", "check_regular", "kind", "open_bounded", "read_bytes",
           "read_text"]


class writing:
    """Around a write: a failure of the disk (full, quota, read-only, permission) becomes a
    StorageError naming `path`, to which the trainer adds the last complete checkpoint."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if e is None or isinstance(e, ConfigError) or not isinstance(e, Exception):
            return False
        reason = storage_problem(e)
        if reason is None:
            return False
        raise StorageError(getattr(e, "filename", None) or self.path, reason) from None


def write_atomic(path: str, text: str) -> None:
    """Readers (other processes, a resumed run) see the old file or the new one, never half; a
    failure leaves neither a temporary file nor half a file."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with shutdown.critical(), writing(path):
        try:
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            if os.path.isfile(tmp):
                os.unlink(tmp)
            raise
