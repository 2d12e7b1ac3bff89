"""One run per work directory: the lock a run holds on its WORKDIR while it lives.

A run takes `WORKDIR/lock.json` before it reads or writes anything else there and
releases it on every exit it can see (a return, an exception, Ctrl-C, SIGTERM).
The file names its owner: host, boot id, process id and that process's start
time, the run's start time, a random token, and a heartbeat that a daemon thread
refreshes every `HEARTBEAT_S` seconds.

Taking the lock: the record is written to a private temporary file and hard-linked
to `lock.json`, which is atomic and fails when the name exists, also on NFS. When a
lock is there, its owner is judged:

- on this host (same host name and boot id): live while its process exists (and is
  not a zombie) with the start time recorded, so a reused process id does not count;
- on another host, or this one before a reboot, where process ids cannot be checked:
  live while its heartbeat is younger than `STALE_AFTER_S` seconds (the hosts' clocks
  are assumed to agree to well under that, as NTP keeps them).

A record that is not what a run writes (a process id that is not a positive integer
below 2**31, a heartbeat that is not a number or lies more than `STALE_AFTER_S` in the
future) counts as unreadable: it is judged by the file's own age, like a lock file cut
short. A live owner makes `acquire` refuse with a `ConfigError` naming the directory, the
owner and what to do; a stale one (SIGKILL, a lost node) is taken over, saying so
in one line. `force=True` takes over a live owner too: that run finds out at its next
step (`Lock.check`, a `stat` of the file, every step) and stops before writing anything
more, and the forcing run waits for it to be gone (`wait_for_previous`) before it reads
the checkpoints. Taking over renames the judged file away and checks, by its inode and
modification time, that it was the one judged, so two restarts racing for one stale lock
cannot both win. A failed write (a full disk) leaves no temporary file behind.

In a multi-process run, process 0 takes the lock for the job and the other
processes check that the file names the token process 0 took (`check_token`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import signal
import socket
import sys
import threading
import time
from typing import Callable

from cdpjax import files, shutdown
from cdpjax.errors import ConfigError, StorageError, storage_problem

LOCK_NAME = "lock.json"
HEARTBEAT_S = 10.0
STALE_AFTER_S = 120.0
# How long an unreadable lock file (a writer that died between creating and writing it, on a
# file system without hard links) is given before it counts as stale.
UNREADABLE_GRACE_S = 3 * HEARTBEAT_S
# How long a run that took a live owner's lock (--force) waits for that run to stop.
FORCE_WAIT_S = 120.0
# A takeover moves the judged lock file away and then creates its own: a run that finds no
# file looks again for this long, so that the line saying it lost the lock names the taker.
TAKEOVER_GAP_S = 2.0
PID_LIMIT = 2**31  # process ids are positive and below this (Linux: at most 2**22)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that `finally` blocks (the lock's release) run."""


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state first), or None off Linux."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()


def process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), which a reused id changes."""
    fields = _proc_stat(pid)
    return fields[19] if fields and len(fields) > 19 else None


def process_running(pid: int, start: str | None) -> bool:
    """Whether process `pid` of this host is alive, not a zombie and (when `start` is known)
    the same process that recorded `start`."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    fields = _proc_stat(pid)
    if fields is None:
        return True  # no /proc: existence is all there is to go on
    if fields[0] in ("Z", "X"):
        return False
    return start is None or len(fields) <= 19 or fields[19] == start


@dataclasses.dataclass(frozen=True)
class Owner:
    """The record in lock.json."""

    host: str
    boot_id: str
    pid: int
    pid_start: str | None
    started: float
    heartbeat: float
    token: int

    @staticmethod
    def here(token: int, started: float | None = None) -> "Owner":
        now = time.time()
        return Owner(socket.gethostname(), _boot_id(), os.getpid(), process_start(os.getpid()),
                     now if started is None else started, now, token)

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"process {self.pid} on host {self.host}, started {started}"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1) + "\n"

    @staticmethod
    def from_json(text: str) -> "Owner":
        """The record, or ValueError when it is not what a run writes (`_RULES`)."""
        record = json.loads(text)
        if not isinstance(record, dict):
            raise ValueError("not a JSON object")
        for name, ok in _RULES.items():
            if name not in record or not ok(record[name]):
                raise ValueError(f"{name}={record.get(name)!r}")
        return Owner(**{k: record[k] for k in _RULES})


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) < 1e12


_RULES = {
    "host": lambda v: isinstance(v, str),
    "boot_id": lambda v: isinstance(v, str),
    "pid": lambda v: isinstance(v, int) and not isinstance(v, bool) and 1 <= v < PID_LIMIT,
    "pid_start": lambda v: v is None or isinstance(v, str),
    "started": _finite,
    "heartbeat": _finite,
    "token": lambda v: isinstance(v, int) and not isinstance(v, bool),
}


def judge(owner: Owner, now: float | None = None, file_age: float = 0.0) -> tuple[bool, str]:
    """(live, why) for the owner a lock file names, by the rules of the module docstring
    (`file_age`: seconds since the file was last written, for a heartbeat from the future)."""
    now = time.time() if now is None else now
    if owner.host == socket.gethostname() and owner.boot_id == _boot_id():
        if process_running(owner.pid, owner.pid_start):
            return True, f"process {owner.pid} is running on this host"
        return False, f"process {owner.pid} is gone from this host"
    age = now - owner.heartbeat
    where = "this host before it restarted" if owner.host == socket.gethostname() else f"host {owner.host}"
    if -age > STALE_AFTER_S:  # a clock far ahead, or a damaged file: the file's own age decides
        live = file_age <= UNREADABLE_GRACE_S
        return live, (f"its heartbeat from {where} lies {-age:.0f} s in the future (clocks that disagree, or a "
                      f"damaged file); the file was written {file_age:.0f} s ago")
    if age > STALE_AFTER_S:
        return False, f"its heartbeat from {where} is {age:.0f} s old (stale after {STALE_AFTER_S:.0f} s)"
    return True, f"its heartbeat from {where} is {max(age, 0.0):.0f} s old (stale after {STALE_AFTER_S:.0f} s)"


def _identity(st: os.stat_result) -> tuple:
    return st.st_ino, st.st_mtime_ns, st.st_size


def _refuse_other_than_a_file(path: str) -> None:
    """FileRefused for a lock.json that no run wrote: a FIFO, a device (a link to /dev/zero), a
    socket, a directory, or a file past `files.SMALL_LIMIT`; nothing if it vanished meanwhile."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    except OSError:  # a link that leads nowhere, a loop: unreadable, judged by its age
        return
    try:
        files.check_regular(st, path, files.SMALL_LIMIT)
    except files.FileRefused as e:
        raise files.FileRefused(f"{e}: no run wrote this lock; remove it") from None


def _read(path: str) -> tuple[Owner | None, tuple | None, float]:
    """(owner or None if unreadable, file identity or None if absent, file age in seconds)."""
    try:
        with files.open_bounded(path, files.SMALL_LIMIT) as f:
            st = os.fstat(f.fileno())
            text = f.read(files.SMALL_LIMIT).decode("utf-8")
    except FileNotFoundError:
        return None, None, 0.0
    except (OSError, UnicodeDecodeError, files.FileRefused):  # unreadable bytes, not a file: judged by its age
        try:
            st = os.lstat(path)
        except OSError:
            return None, None, 0.0
        return None, _identity(st), max(time.time() - st.st_mtime, 0.0)
    try:
        owner = Owner.from_json(text)
    except (ValueError, KeyError, TypeError, RecursionError):
        owner = None
    return owner, _identity(st), max(time.time() - st.st_mtime, 0.0)


def check_directory(workdir: str) -> str:
    """WORKDIR as an existing directory (created if missing); ConfigError if it cannot be one."""
    try:  # tensorstore (orbax's checkpoints) cannot open a path that is not UTF-8 text
        os.path.abspath(workdir).encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"--workdir {os.path.abspath(workdir)!r} is not UTF-8 text (it holds bytes that are no "
                          f"character), and the checkpoints' library (tensorstore) takes UTF-8 paths only: give "
                          f"another --workdir") from None
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ConfigError(f"--workdir {workdir} is a file, not a directory: give a directory (it is created "
                          f"if missing), or move the file away")
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--workdir {workdir} cannot be created ({e.strerror}): give a directory "
                          f"you can write to") from None
    return workdir


def _refusal(workdir: str, owner: Owner | None, why: str) -> ConfigError:
    who = owner.describe() if owner else "an unreadable lock file"
    return ConfigError(
        f"WORKDIR {workdir} is in use by another run ({who}; {why}): wait for it to end or stop it, "
        f"use another --workdir, or, if that run is gone, take the directory over with --force")


class Lock:
    """The lock on one WORKDIR, held by this process. Use `Lock.acquire`."""

    def __init__(self, workdir: str, owner: Owner, previous: Owner | None, previous_live: bool):
        self.workdir, self.owner = workdir, owner
        self.path = os.path.join(workdir, LOCK_NAME)
        self.previous, self.previous_live = previous, previous_live
        self.lost: str | None = None  # why this process no longer holds the lock, once it does not
        self.write_error: str | None = None  # the heartbeat's last failure to write, if any
        self._seen = _stat_identity(self.path)  # the file as this process last wrote it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="cdpjax-lock-heartbeat", daemon=True)
        self._thread.start()
        shutdown.on_exit(self.release)  # a signal ends the process: the lock goes with it

    @property
    def may_clean(self) -> bool:
        """Whether leftovers of earlier writers (orbax's temporary checkpoint directories) may be
        removed: no live writer can own them unless the lock was forced from a live owner."""
        return not self.previous_live

    @staticmethod
    def acquire(workdir: str, force: bool = False, say: Callable[[str], None] | None = None) -> "Lock":
        """Takes WORKDIR's lock (see the module docstring); ConfigError when a live run holds it
        and `force` is not given. `say` receives the one-line notice of a takeover."""
        say = say or (lambda line: print(f"cdpjax: {line}", file=sys.stderr))
        check_directory(workdir)
        try:
            with shutdown.critical():  # no temporary lock file left half made by a signal
                return Lock._acquire(workdir, force, say)
        except OSError as e:
            path = os.path.join(workdir, LOCK_NAME)
            reason = storage_problem(e) or e.strerror or type(e).__name__
            raise StorageError(path, reason, f"WORKDIR {workdir} must be a directory this run can write "
                                             f"to: give another --workdir, or free space") from None

    @staticmethod
    def _acquire(workdir: str, force: bool, say: Callable[[str], None]) -> "Lock":
        path = os.path.join(workdir, LOCK_NAME)
        token = secrets.randbelow(2**31 - 1) + 1
        for _ in range(5):
            mine = Owner.here(token)
            if _create(path, mine):
                return Lock(workdir, mine, None, False)
            owner, identity, age = _read(path)
            if identity is None:
                continue  # released between our two looks: try again
            if owner is None:
                _refuse_other_than_a_file(path)
                live = age <= UNREADABLE_GRACE_S
                why = f"unreadable, written {age:.0f} s ago"
            else:
                live, why = judge(owner, file_age=age)
            if live and not force:
                raise _refusal(workdir, owner, why)
            if not _take_over(path, identity):
                continue  # it changed hands while we looked: judge the new owner
            mine = Owner.here(token)
            if _create(path, mine):
                who = owner.describe() if owner else "an unreadable lock file"
                say(f"took over the lock of {workdir} from {who}: "
                    + (f"forced (--force) although {why}" if live else why))
                return Lock(workdir, mine, owner, live)
        raise ConfigError(f"the lock of WORKDIR {workdir} kept changing hands while this run tried to take "
                          f"it ({path}): another run is starting there; try again, or use another --workdir")

    def _lose(self, owner: Owner | None) -> None:
        who = owner.describe() if owner else "another run (lock.json was removed or replaced)"
        self.lost = (f"the lock of WORKDIR {self.workdir} was taken over by {who} (with --force, or because this "
                     f"run's heartbeat looked stale); this run stops")

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            owner, _, _ = _read_through_takeover(self.path)
            if owner is None or owner.token != self.owner.token:
                self._lose(owner)
                return
            try:  # a full disk must not end the run from this thread: the next checkpoint says it
                self._seen = _write_replace(self.path, dataclasses.replace(self.owner, heartbeat=time.time()))
                self.write_error = None
            except OSError as e:
                self.write_error = storage_problem(e) or str(e)

    def check(self) -> None:
        """Raises ConfigError if another run has taken the lock over (--force, or a heartbeat that
        looked stale). Cheap enough for every step: one `stat` of lock.json, and a read only
        when the file is not the one this process last wrote."""
        if self.lost is None:
            identity = _stat_identity(self.path)
            if identity is None or identity != self._seen:
                owner, identity, _ = _read_through_takeover(self.path)
                if owner is not None and owner.token == self.owner.token:
                    self._seen = identity
                else:
                    self._lose(owner)
        if self.lost:
            raise ConfigError(self.lost)

    def wait_for_previous(self, settled: Callable[[], bool] = lambda: True, timeout: float | None = None,
                          say: Callable[[str], None] | None = None) -> None:
        """After taking a live owner's lock (--force): waits until that run has stopped, so that
        it writes nothing more (a checkpoint it was writing is finished first): on this host until
        its process is gone, on another until `settled()` (no checkpoint being written) holds,
        at least two of its steps' worth of time; at most `timeout` seconds (FORCE_WAIT_S)."""
        previous = self.previous
        if previous is None or not self.previous_live:
            return
        timeout = FORCE_WAIT_S if timeout is None else timeout
        deadline = time.time() + timeout
        here = previous.host == socket.gethostname() and previous.boot_id == _boot_id()
        earliest = time.time() + (0.0 if here else 2.0)
        while time.time() < deadline:
            if here and not process_running(previous.pid, previous.pid_start):
                return
            if not here and time.time() >= earliest and settled():
                return
            time.sleep(0.1)
        if say is not None:
            say(f"the run that held the lock ({previous.describe()}) has not stopped after {timeout:.0f} s; "
                f"going on")

    def release(self) -> None:
        """Stops the heartbeat and removes lock.json if it still names this process."""
        shutdown.forget(self.release)
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        owner, _, _ = _read(self.path)
        if owner is not None and owner.token == self.owner.token:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> "Lock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _read_through_takeover(path: str) -> tuple[Owner | None, tuple | None, float]:
    """`_read`, looking again for up to TAKEOVER_GAP_S while the file is absent."""
    deadline = time.monotonic() + TAKEOVER_GAP_S
    while True:
        found = _read(path)
        if found[1] is not None or time.monotonic() >= deadline:
            return found
        time.sleep(0.02)


def _tmp_path(path: str) -> str:
    return f"{path}.{os.getpid()}-{secrets.token_hex(4)}.tmp"


def _stat_identity(path: str) -> tuple | None:
    try:
        return _identity(os.stat(path))
    except OSError:
        return None


def _write_tmp(path: str, owner: Owner, sync: bool = False) -> str:
    """A temporary file beside `path` holding `owner`; removed again if writing it fails."""
    tmp = _tmp_path(path)
    try:
        with open(tmp, "w") as f:
            f.write(owner.to_json())
            f.flush()
            if sync:
                os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


def _create(path: str, owner: Owner) -> bool:
    """Creates the lock file holding `owner`, atomically; False if it exists."""
    tmp = _write_tmp(path, owner, sync=True)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError:
        # A file system without hard links: exclusive creation (a reader may see it empty
        # for a moment, which `acquire` allows for).
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        try:
            with os.fdopen(fd, "w") as f:
                f.write(owner.to_json())
        except BaseException:
            os.unlink(path)  # ours, just made: not a lock half written
            raise
        return True
    finally:
        os.unlink(tmp)


def _write_replace(path: str, owner: Owner) -> tuple | None:
    """Replaces the file at `path` with one holding `owner`; returns the new file's identity."""
    tmp = _write_tmp(path, owner)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return _stat_identity(path)


def _take_over(path: str, identity: tuple) -> bool:
    """Moves the judged lock file away; False (and the file put back) if the file there was
    no longer the one judged."""
    aside = _tmp_path(path) + ".stale"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    try:
        if _identity(os.stat(aside)) == identity:
            return True
        try:
            os.link(aside, path)  # someone else's fresh lock: put it back
        except FileExistsError:
            pass
        return False
    finally:
        os.unlink(aside)


def check_token(workdir: str, token: int, wait_s: float = 10.0) -> None:
    """For processes other than 0: WORKDIR's lock must name the token process 0 took (a shared
    file system may show the file a little late)."""
    path = os.path.join(workdir, LOCK_NAME)
    deadline = time.time() + wait_s
    while True:
        owner, _, _ = _read(path)
        if owner is not None and owner.token == token:
            return
        if time.time() > deadline:
            seen = owner.describe() if owner else "no lock file"
            raise ConfigError(f"WORKDIR {workdir}: this process does not see the lock its process 0 took "
                              f"(it sees {seen}); every process must use the same --workdir on a shared "
                              f"file system")
        time.sleep(0.2)


class sigterm_as_interrupt:
    """While active (main thread only), SIGTERM asks the run loop to save at its next step boundary
    where one takes requests (`shutdown.hand_to_boundary`: a preemption keeps its work, as under
    the command line); anywhere else it raises `Terminated` so that the run unwinds, releasing its
    lock, instead of dying where it stands. The previous handler is put back on exit."""

    def __enter__(self):
        self.previous = None
        # Under the command line's signal watcher (`cdpjax.shutdown`) SIGTERM never reaches Python.
        if threading.current_thread() is threading.main_thread() and not shutdown.active():
            self.previous = signal.signal(signal.SIGTERM, self._raise)
        return self

    @staticmethod
    def _raise(signum, frame):
        if shutdown.hand_to_boundary(signum):
            return
        raise Terminated("SIGTERM")

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


__all__ = ["HEARTBEAT_S", "LOCK_NAME", "Lock", "Owner", "STALE_AFTER_S", "Terminated", "check_directory",
           "check_token", "judge", "process_running", "sigterm_as_interrupt"]
