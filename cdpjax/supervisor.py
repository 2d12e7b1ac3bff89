"""The supervisor of a process of a multi-process run: a process that vanishes is named in one line.

When a process of a multi-process run dies (SIGKILL, a lost node, a crash), JAX's
coordination service ends every other process from its C++ side: LOG(FATAL) once the dead
process's heartbeats have stopped for the heartbeat timeout (at most
`distributed.timeout_s`), or at once when the coordinator's socket closes, and the same
when the coordinator cannot be reached at start-up. No Python code runs there: the process
aborts (SIGABRT) with some hundred lines of C++ logs and stack. So `cdpjax train`, in a
multi-process run, runs its process as a child and watches it (`run`):

- the child's stderr passes through, less JAX's C++ log lines, their stack traces and
  gloo's connection notices (kept aside; `CDPJAX_RAW_STDERR=1` shows them); a Python
  traceback is held until the child ends: shown if it was a failure of the child's own,
  dropped if a vanished process caused it (a collective of orbax's that lost its peer);
- SIGINT and SIGTERM are handed on to the child (which is in its own process group, so a
  Ctrl-C reaches it once), whose own handling (`cdpjax.shutdown`) says where it stopped;
- when the child dies of a signal, the supervisor reads the lines kept aside to tell what
  happened (which process stopped sending heartbeats, the coordinator gone or never
  reached), and says it in one line with the last complete checkpoint and the command that
  resumes (the same command on every process), exit status `PEER_LOST_STATUS`; a lock the
  child held is released.

The child dies with its supervisor (Linux's PR_SET_PDEATHSIG), so a `kill -9` of the
process a scheduler started takes the training process with it, as the other processes
then see. The supervisor imports no JAX.
"""
from __future__ import annotations

import collections
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading

from cdpjax import files, shutdown

SUPERVISED_ENV = "CDPJAX_SUPERVISED"  # in the child: its supervisor's process id
RAW_ENV = "CDPJAX_RAW_STDERR"
PEER_LOST_STATUS = 4

# JAX's C++ (absl) log lines: "F1201 15:34:19.882189   12884 client.h:80] ...", and what follows
# them up to the next line of another kind; check-failure stacks; gloo's notices.
_ABSL = re.compile(rb"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+\s+\S+:\d+\]")
_NOISE = (b"*** Check failure stack trace", b"    @ ", b"[Gloo] ", b"terminate called after", b"  what():")
_NOT_CONTINUATION = (b"cdpjax", b"Traceback", b"\r")
_TRACEBACK = b"Traceback (most recent call last):"
_CHAINED = (b"During handling of the above exception", b"The above exception was the direct cause")
_KEEP = 256 * 1024  # bytes of C++ log kept to tell what happened


def supervised() -> bool:
    return SUPERVISED_ENV in os.environ


def die_with_supervisor() -> None:
    """In the child: end when the supervisor ends (Linux), or now if it is gone already."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if str(os.getppid()) != os.environ.get(SUPERVISED_ENV):
        os._exit(PEER_LOST_STATUS)


class _Filter(threading.Thread):
    """Copies the child's stderr to ours, setting JAX's C++ log lines aside."""

    def __init__(self, source, raw: bool):
        super().__init__(name="cdpjax-supervisor-stderr", daemon=True)
        self.source, self.raw = source, raw
        self.noise = collections.deque()
        self.noise_bytes = 0
        self.in_block = False
        self.tracebacks: list[bytes] = []  # held until the child ends
        self.in_traceback = False

    def _keep(self, line: bytes) -> None:
        self.noise.append(line)
        self.noise_bytes += len(line)
        while self.noise_bytes > _KEEP:
            self.noise_bytes -= len(self.noise.popleft())

    def _is_noise(self, line: bytes) -> bool:
        if _ABSL.match(line):
            self.in_block = True
            return True
        if line.startswith(_NOISE):
            return True
        if self.in_block and not line.startswith(_NOT_CONTINUATION):
            return True
        self.in_block = False
        return False

    def _is_traceback(self, line: bytes) -> bool:
        """Whether `line` belongs to a Python traceback (from its first line to the exception's)."""
        if line.startswith(_TRACEBACK) or line.startswith(_CHAINED):
            self.in_traceback = True
            return True
        if self.in_traceback:
            self.in_traceback = line.startswith(b" ") or not line.strip()
            return True
        return False

    def release_tracebacks(self) -> None:
        """Shows the held tracebacks (the child's own failure)."""
        if self.tracebacks:
            sys.stderr.buffer.write(b"".join(self.tracebacks))
            sys.stderr.buffer.flush()
            self.tracebacks = []

    def run(self) -> None:
        out = sys.stderr.buffer
        pending = b""
        while True:
            chunk = os.read(self.source.fileno(), 65536)
            if not chunk:
                break
            pending += chunk
            # Whole lines (ended by \n, or \r for a progress bar) are judged; the rest waits.
            cut = max(pending.rfind(b"\n"), pending.rfind(b"\r"))
            if cut < 0:
                continue
            lines, pending = re.split(rb"(?<=[\n\r])", pending[:cut + 1]), pending[cut + 1:]
            for line in filter(None, lines):
                if self.raw:
                    out.write(line)
                elif self._is_noise(line):
                    self._keep(line)
                elif self._is_traceback(line):
                    self.tracebacks.append(line)
                else:
                    out.write(line)
            out.flush()
        if pending:
            out.write(pending)
            out.flush()

    def text(self) -> str:
        return b"".join(self.noise).decode("utf-8", "replace")


def _reachable(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
            return True
    except (OSError, ValueError):
        return False


def diagnose(noise: str, settings: dict, timeout_s: int) -> str | None:
    """What JAX's C++ logs say happened to the run, in words, or None if they do not say."""
    address = settings.get("coordinator_address") or "the coordinator"
    n, me = settings.get("num_processes"), settings.get("process_id")
    m = re.search(r"unhealthy \(stopped sending heartbeats\):\s*((?:\d+[,\s]*)+)", noise)
    if m:
        ids = sorted({int(x) for x in re.findall(r"\d+", m.group(1))})
        who = ", ".join(map(str, ids))
        return (f"process{'es' if len(ids) > 1 else ''} {who} of the run vanished (no heartbeat for "
                f"distributed.timeout_s={timeout_s} s)")
    if "RegisterTask" in noise or "Barrier" in noise:
        if me not in (None, 0) and address != "the coordinator" and not _reachable(address):
            return (f"the coordinator {address} (process 0) could not be reached within distributed.timeout_s="
                    f"{timeout_s} s: start process 0 (the same command with process id 0), or correct the address")
        return (f"not every process of the run ({n or '?'}) joined within distributed.timeout_s={timeout_s} s "
                f"(coordinator {address}): start them all with the same command")
    coordinator = f"process 0 (the coordinator, {address}) vanished"
    if "leader task" in noise or "Failed to send RPC to coordination service" in noise or (
            "coordination" in noise.lower() and ("Socket closed" in noise or "UNAVAILABLE" in noise)):
        return coordinator
    if "gloo" in noise.lower():  # a collective broke before the heartbeats told who stopped
        if n == 2 and me in (0, 1):  # of two, the other one
            return f"{coordinator if me == 1 else 'process 1 of the run vanished'} (a collective with it broke)"
        return "another process of the run vanished (a collective with it broke)"
    return None


def _last_checkpoint(workdir: str) -> str:
    directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    try:
        steps = [int(n) for n in os.listdir(directory) if n.isdigit()]
    except OSError:
        steps = []
    if not steps:
        return "no complete checkpoint yet (the same commands start again from step 0)"
    return f"last complete checkpoint: step {max(steps)} in {directory}"


def _release_lock(workdir: str, pid: int) -> None:
    """Removes WORKDIR/lock.json if it names the child that died (no heartbeat will ever do it)."""
    path = os.path.join(workdir, "lock.json")
    try:
        if json.loads(files.read_bytes(path)).get("pid") == pid:
            os.unlink(path)
    except (OSError, ValueError, AttributeError):
        pass


def run(argv: list[str], settings: dict, workdir: str, timeout_s: int) -> int:
    """Runs `cdpjax <argv>` as this process's child, watched (module docstring); its exit status."""
    env = {**os.environ, SUPERVISED_ENV: str(os.getpid())}
    group = {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}
    child = subprocess.Popen([sys.executable, "-m", "cdpjax.cli", *argv], env=env, stderr=subprocess.PIPE, **group)
    shutdown.forward_to(child.pid)
    relay = _Filter(child.stderr, raw=bool(os.environ.get(RAW_ENV)))
    relay.start()
    try:
        status = child.wait()
    finally:
        relay.join()
        shutdown.forward_to(None)
    what = diagnose(relay.text(), settings, timeout_s)
    # The child's own ends: done, bad input, non-finite, a signal it said; or a failure of its own.
    if status in (0, 2, 3, 130, 143) or (status > 0 and what is None):
        relay.release_tracebacks()
        return status
    n, me = settings.get("num_processes"), settings.get("process_id")
    this = f"process {me} of {n}" if me is not None and n else "this process"
    asked = shutdown.received()
    _release_lock(workdir, child.pid)
    if asked is not None:
        shutdown.write_line(f"{shutdown.HOW.get(asked, 'stopped')}: {this} ended ({_signal_name(-status)}); "
                            f"{_last_checkpoint(workdir)}; run the same command on every process to resume")
        return shutdown.EXIT_STATUS.get(asked, 128 + asked)
    if what is None:
        relay.release_tracebacks()
        what = f"{this} ended by {_signal_name(-status)} (JAX's own report is hidden: {RAW_ENV}=1 shows it)"
    shutdown.write_line(f"error: {what}; {this} stopped too; {_last_checkpoint(workdir)}; run the same command "
                        f"on every process to resume")
    return PEER_LOST_STATUS


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


__all__ = ["PEER_LOST_STATUS", "RAW_ENV", "SUPERVISED_ENV", "diagnose", "die_with_supervisor", "run",
           "supervised"]
