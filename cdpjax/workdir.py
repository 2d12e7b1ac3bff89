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

A live owner makes `acquire` refuse with a `ConfigError` naming the directory, the
owner and what to do; a stale one (SIGKILL, a lost node) is taken over, saying so
in one line. `force=True` takes over a live owner too: that run then stops at its
next step (its heartbeat finds the lock gone). Taking over renames the judged file
away and checks, by its inode and modification time, that it was the one judged, so
two restarts racing for one stale lock cannot both win.

In a multi-process run, process 0 takes the lock for the job and the other
processes check that the file names the token process 0 took (`check_token`).
"""
from __future__ import annotations

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

from cdpjax.errors import ConfigError

LOCK_NAME = "lock.json"
HEARTBEAT_S = 10.0
STALE_AFTER_S = 120.0
# How long an unreadable lock file (a writer that died between creating and writing it, on a
# file system without hard links) is given before it counts as stale.
UNREADABLE_GRACE_S = 3 * HEARTBEAT_S


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
        record = json.loads(text)
        fields = {f.name for f in dataclasses.fields(Owner)}
        return Owner(**{k: record[k] for k in fields})


def judge(owner: Owner, now: float | None = None) -> tuple[bool, str]:
    """(live, why) for the owner a lock file names, by the rules of the module docstring."""
    now = time.time() if now is None else now
    if owner.host == socket.gethostname() and owner.boot_id == _boot_id():
        if process_running(owner.pid, owner.pid_start):
            return True, f"process {owner.pid} is running on this host"
        return False, f"process {owner.pid} is gone from this host"
    age = now - owner.heartbeat
    where = "this host before it restarted" if owner.host == socket.gethostname() else f"host {owner.host}"
    if age > STALE_AFTER_S:
        return False, f"its heartbeat from {where} is {age:.0f} s old (stale after {STALE_AFTER_S:.0f} s)"
    return True, f"its heartbeat from {where} is {max(age, 0.0):.0f} s old (stale after {STALE_AFTER_S:.0f} s)"


def _identity(st: os.stat_result) -> tuple:
    return st.st_ino, st.st_mtime_ns, st.st_size


def _read(path: str) -> tuple[Owner | None, tuple | None, float]:
    """(owner or None if unreadable, file identity or None if absent, file age in seconds)."""
    try:
        with open(path) as f:
            st = os.fstat(f.fileno())
            text = f.read()
    except FileNotFoundError:
        return None, None, 0.0
    try:
        owner = Owner.from_json(text)
    except (ValueError, KeyError, TypeError):
        owner = None
    return owner, _identity(st), max(time.time() - st.st_mtime, 0.0)


def check_directory(workdir: str) -> str:
    """WORKDIR as an existing directory (created if missing); ConfigError if it cannot be one."""
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
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="cdpjax-lock-heartbeat", daemon=True)
        self._thread.start()

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
            return Lock._acquire(workdir, force, say)
        except OSError as e:
            raise ConfigError(f"WORKDIR {workdir}: its lock file cannot be written ({e.strerror}): give a "
                              f"directory you can write to") from None

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
                live = age <= UNREADABLE_GRACE_S
                why = f"unreadable, written {age:.0f} s ago"
            else:
                live, why = judge(owner)
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

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            owner, _, _ = _read(self.path)
            if owner is None or owner.token != self.owner.token:
                self.lost = (f"the lock of WORKDIR {self.workdir} was taken over by "
                             f"{owner.describe() if owner else 'another run'} (with --force); this run stops")
                return
            _write_replace(self.path, dataclasses.replace(self.owner, heartbeat=time.time()))

    def check(self) -> None:
        """Raises ConfigError if another run has taken the lock over (--force)."""
        if self.lost:
            raise ConfigError(self.lost)

    def release(self) -> None:
        """Stops the heartbeat and removes lock.json if it still names this process."""
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


def _tmp_path(path: str) -> str:
    return f"{path}.{os.getpid()}-{secrets.token_hex(4)}.tmp"


def _create(path: str, owner: Owner) -> bool:
    """Creates the lock file holding `owner`, atomically; False if it exists."""
    tmp = _tmp_path(path)
    with open(tmp, "w") as f:
        f.write(owner.to_json())
        f.flush()
        os.fsync(f.fileno())
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
        with os.fdopen(fd, "w") as f:
            f.write(owner.to_json())
        return True
    finally:
        os.unlink(tmp)


def _write_replace(path: str, owner: Owner) -> None:
    tmp = _tmp_path(path)
    with open(tmp, "w") as f:
        f.write(owner.to_json())
    os.replace(tmp, path)


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
    """While active (main thread only), SIGTERM raises `Terminated` so that the run unwinds,
    releasing its lock, instead of dying where it stands."""

    def __enter__(self):
        self.previous = None
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, self._raise)
        return self

    @staticmethod
    def _raise(signum, frame):
        raise Terminated("SIGTERM")

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


__all__ = ["HEARTBEAT_S", "LOCK_NAME", "Lock", "Owner", "STALE_AFTER_S", "Terminated", "check_directory",
           "check_token", "judge", "process_running", "sigterm_as_interrupt"]
