"""How a command-line run ends on Ctrl-C or SIGTERM (or SIGHUP, SIGQUIT, SIGUSR1, taken as SIGTERM): one
line and exit status 130 or 128 + the signal's number (143 for SIGTERM, 129 for SIGHUP), at any moment.

`install()`, the first thing `cdpjax.cli.main` does, blocks these signals in the main
thread, hence in every thread started after it (JAX's, orbax's, the lock's heartbeat), and
starts a watcher thread that takes them with `sigtimedwait`. No exception is ever raised
asynchronously: a KeyboardInterrupt raised inside an import, a garbage-collection callback
or an atexit hook is swallowed or becomes a traceback, and a process unwinding through
XLA's teardown on SIGTERM can crash. The watcher decides instead:

- while a run loop takes requests at its step boundaries (`Boundary`, from the end of the
  process's first step to its last), a SIGTERM-like signal is handed to it: the run saves a
  checkpoint at the next step boundary and ends itself naming it (a preemption keeps its work);
  if the loop has not taken the request within `GRACE_S`, or stops taking requests first, the
  watcher goes on as below. A Ctrl-C is not handed over: it ends the run as below;
- it waits until no critical section is open (`critical()`: a checkpoint, a metrics line,
  a file replaced atomically being written), at most `GRACE_S` seconds, so that a
  preemption keeps the checkpoint being written; a second Ctrl-C ends the wait (a second
  SIGTERM does not: schedulers send it to every process of a job, and to the job too);
- it runs the clean-ups registered with `on_exit` (the lock released, the progress bar
  closed), newest first;
- it writes the one line that the run's `set_message` function gives for its situation
  (where the run stands, the last complete checkpoint, what to do) and ends the process
  with `os._exit` (status 130 for SIGINT, 128 + its number for the others), so that nothing
  else runs;
- once the command has said its last line of a completed run (`completed()`), a signal ends
  the process with status 0 and no other line: the run's work is whole.

A signal whose disposition was SIG_IGN when `install` ran (a job started with nohup, or in
the background of a shell) stays ignored. `forward_to(pid)` turns the watcher into a relay
(the multi-process supervisor of `cdpjax.supervisor` hands the signals to its child). Used
as a library (`cdpjax.train.train` from Python), none of this is installed and Ctrl-C is
Python's KeyboardInterrupt; `train.train` sets a SIGTERM handler of its own for the call
(`cdpjax.workdir.sigterm_as_interrupt`, main thread only) that hands the signal to an open
`Boundary` as the watcher does (`hand_to_boundary`): the run saves at its next step boundary
and raises `Interrupted` naming the checkpoint; outside the boundaries the signal unwinds the
run as an exception.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
import threading
import time
import traceback
import warnings
from typing import Callable

from cdpjax.errors import storage_problem

# The longest a signal waits for a critical section (a checkpoint write) to end.
GRACE_S = 120.0
# Signals that end a run as SIGTERM does (a closed ssh session, Ctrl-\ in a terminal, a scheduler's warning).
AS_SIGTERM = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)
EXIT_STATUS = {signal.SIGINT: 130, **{s: 128 + int(s) for s in AS_SIGTERM}}
HOW = {signal.SIGINT: "interrupted", **{s: f"terminated ({signal.Signals(s).name})" for s in AS_SIGTERM}}

_critical = threading.RLock()
_cleanups: list[Callable[[], None]] = []
_state: dict = {"message": None, "forward": None, "received": None, "boundary": None, "completed": False}


def default_message(how: str, abandoned: float | None) -> str:
    return f"{how}; nothing was left half written: run the same command to start again"


class Boundary:
    """A run loop's step boundaries, where a SIGTERM-like signal is taken as a request to save and
    stop (a preemption). `open()` after the process's first step (before it nothing has trained
    since the checkpoint the run started from), `close()` before the run's final phase; `asked()`
    at each boundary; `take()` once the loop acts on it: the watcher then leaves the ending to
    the loop (unless GRACE_S passes first). Single-process state: agreeing across processes is
    the loop's."""

    def __init__(self):
        self.signum: int | None = None  # the signal that asked, once one has
        self.asked_at = 0.0
        self.taken = False

    def open(self) -> None:
        # Without the watcher, a loop of the main thread too: train.train's SIGTERM handler, which
        # Python runs in that thread, hands the signal over (hand_to_boundary); a loop in another
        # thread has no handler and must not take the main thread's requests.
        library = threading.current_thread() is threading.main_thread()
        if _state["forward"] is None and (_Watcher.current is not None or library):
            _state["boundary"] = self

    def close(self) -> None:
        if _state["boundary"] is self:
            _state["boundary"] = None

    def asked(self) -> bool:
        return self.signum is not None

    def take(self) -> int:
        """The signal that asked (the loop now saves and ends the process itself)."""
        self.taken = True
        return self.signum

    def _ask(self, signum: int) -> None:
        self.signum, self.asked_at = signum, time.monotonic()

    def _left_waiting(self) -> bool:
        """Whether the watcher must end the process itself: the loop did not act in time, or
        stopped taking requests before it acted."""
        if self.signum is None:
            return False
        return time.monotonic() - self.asked_at > GRACE_S or (_state["boundary"] is not self and not self.taken)


def hand_to_boundary(signum: int) -> bool:
    """A signal taken by a Python handler (`train.train` used as a library, no watcher) handed to
    the open boundary: True if the run loop will save and stop at its next step boundary (or
    already was asked and GRACE_S has not passed: the same request again), False if no loop
    takes requests now and the handler must end the run itself."""
    boundary = _state["boundary"]
    if _Watcher.current is not None or boundary is None:
        return False
    if not boundary.asked():
        boundary._ask(signum)
        return True
    return not boundary._left_waiting()


def completed() -> None:
    """The command has said the last line of a completed run: a signal from now on exits 0."""
    _state["completed"] = True


@contextlib.contextmanager
def critical():
    """A section that a signal lets finish (up to GRACE_S): a checkpoint, a line, a file replaced."""
    with _critical:
        yield


def on_exit(fn: Callable[[], None]) -> Callable[[], None]:
    """Registers a clean-up that the watcher runs before the process ends on a signal; returns it
    (to pass to `forget`)."""
    _cleanups.append(fn)
    return fn


def forget(fn: Callable[[], None]) -> None:
    with contextlib.suppress(ValueError):
        _cleanups.remove(fn)


def set_message(fn: Callable[[str, float | None], str] | None) -> None:
    """`fn(how, abandoned) -> line`: what the run says when a signal ends it (`how` is
    'interrupted' or 'terminated (SIGTERM)'...; `abandoned`: the seconds after which a critical
    section being written was given up (a second Ctrl-C, or GRACE_S), None if none was)."""
    _state["message"] = fn


def forward_to(pid: int | None) -> None:
    """Signals are sent on to process `pid` (and recorded in `received()`) instead of ending this one."""
    _state["forward"] = pid


def received() -> int | None:
    """The signal the watcher relayed last (forwarding mode), or None."""
    return _state["received"]


def active() -> bool:
    return _Watcher.current is not None


def write_line(line: str) -> None:
    """`cdpjax: line` on stderr, for the last word of a process. (From the main thread it waits
    for a signal being handled to end the process first: its line is the last word then.)"""
    if threading.current_thread() is threading.main_thread():
        _critical.acquire()  # held by the watcher once it ends the process: then this never returns
        _critical.release()
    try:
        sys.stderr.write(f"cdpjax: {line}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _end(signum: int, signals: set[int]) -> None:
    """Ends the process as the module docstring says."""
    start = time.monotonic()
    abandoned = None
    while not _critical.acquire(timeout=0.2):
        again = signal.sigtimedwait(signals, 0)
        if (again is not None and again.si_signo == signal.SIGINT and signum == signal.SIGINT) or \
                time.monotonic() - start > GRACE_S:
            abandoned = time.monotonic() - start
            break
    if _state["completed"]:
        os._exit(0)
    how = HOW.get(signum, f"stopped by signal {signum}")
    try:
        line = (_state["message"] or default_message)(how, abandoned)
    except Exception:  # noqa: BLE001 - the line must come, whatever the run's state
        line = default_message(how, abandoned)
    for fn in reversed(list(_cleanups)):
        with contextlib.suppress(BaseException):
            fn()
    write_line(line)
    os._exit(EXIT_STATUS.get(signum, 128 + signum))


class _Watcher:
    current: "_Watcher | None" = None
    asked: Boundary | None = None  # the boundary a signal was handed to (kept once the loop closes it)

    def __init__(self, signals: set[int]):
        self.signals, self.stop = signals, threading.Event()
        self.previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
        self.thread = threading.Thread(target=self._watch, name="cdpjax-signals", daemon=True)
        self.thread.start()
        # A thread started before `install` may still take a signal: Python then runs its
        # handler in the main thread, which hands the signal to the watcher.
        self.previous_handlers = {s: signal.signal(s, self._relay) for s in signals}

    def _relay(self, signum, frame):
        signal.pthread_kill(self.thread.ident, signum)

    def _watch(self) -> None:
        while not self.stop.is_set():
            try:
                info = signal.sigtimedwait(self.signals, 0.05)  # also how soon `close` returns
            except InterruptedError:
                continue
            boundary = _state["boundary"] if _state["boundary"] is not None else _Watcher.asked
            if boundary is not None and boundary._left_waiting():
                _end(boundary.signum, self.signals)
            if info is None or info.si_signo not in self.signals:  # (a stopped process continued: signo 0)
                continue
            pid = _state["forward"]
            if pid is not None:
                _state["received"] = info.si_signo
                with contextlib.suppress(OSError):
                    os.kill(pid, info.si_signo)
                continue
            boundary = _state["boundary"]
            if info.si_signo in AS_SIGTERM and boundary is not None and not boundary.asked():
                boundary._ask(info.si_signo)  # the loop saves at its next step boundary
                _Watcher.asked = boundary
                continue
            if boundary is not None and boundary.asked() and info.si_signo != signal.SIGINT:
                continue  # the same request again (a scheduler signals every process of a job, and the job)
            _end(info.si_signo, self.signals)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        for s, h in self.previous_handlers.items():
            signal.signal(s, h)
        signal.pthread_sigmask(signal.SIG_SETMASK, self.previous_mask)
        _Watcher.current = None


def _closed_loop(kind, value) -> bool:
    """A RuntimeError('Event loop is closed'): tensorstore handing a result to orbax's event loop
    after a failed save closed it, from a C++ thread; noise after the one line that says why."""
    return kind is RuntimeError and str(value) == "Event loop is closed"


class _OrbaxTasks(logging.Filter):
    """asyncio's "Task (or Future) exception was never retrieved" for orbax's write tasks of a
    failed save (logged when they are collected, after the save's one line)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not re.match(r"\w+ exception was never retrieved", message):  # Task, Future, _GatheringFuture...
            return True
        error = record.exc_info[1] if record.exc_info else None
        text = message + ("".join(traceback.format_exception(error)) if error is not None else "")
        return not ("orbax" in text or (error is not None and storage_problem(error)))


_ORBAX_TASKS = _OrbaxTasks()


def quiet_closed_loops() -> Callable[[], None]:
    """Drops those errors wherever Python would print them (sys.excepthook, threading.excepthook,
    sys.unraisablehook), and orbax's unretrieved task errors; returns the function that puts the
    hooks back. The asyncio filter stays: the futures of a failed save may be collected after
    `main` has returned, as the interpreter exits (and it drops only those)."""
    previous = sys.excepthook, threading.excepthook, sys.unraisablehook
    logging.getLogger("asyncio").addFilter(_ORBAX_TASKS)  # once: a filter already there is not added again

    def excepthook(kind, value, tb):
        if not _closed_loop(kind, value):
            previous[0](kind, value, tb)

    def thread_hook(args):
        if not _closed_loop(args.exc_type, args.exc_value):
            previous[1](args)

    def unraisable(args):
        if not _closed_loop(args.exc_type, args.exc_value):
            previous[2](args)

    sys.excepthook, threading.excepthook, sys.unraisablehook = excepthook, thread_hook, unraisable

    def restore() -> None:
        sys.excepthook, threading.excepthook, sys.unraisablehook = previous

    return restore


def quiet_from_now() -> None:
    """After the process's last word (a failure said in one line): the errors its libraries log
    while it unwinds (asyncio's unretrieved futures of a failed save, orbax's threads) are not
    printed, nor Python's warning, at exit, for a coroutine of that save never awaited. Undone by
    `install`'s undo."""
    for name in ("asyncio", "absl"):
        logging.getLogger(name).disabled = True
    warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)


def install() -> Callable[[], None]:
    """Blocks SIGINT and the AS_SIGTERM signals and starts the watcher (main thread only; once); returns the
    function that undoes it (for `main` called in-process, as the tests do)."""
    if _Watcher.current is not None or threading.current_thread() is not threading.main_thread():
        return lambda: None
    signals = {s for s in (signal.SIGINT, *AS_SIGTERM) if signal.getsignal(s) is not signal.SIG_IGN}
    if not signals:
        return lambda: None
    _Watcher.current = _Watcher(signals)
    watcher = _Watcher.current
    hooks = quiet_closed_loops()

    kept_filters = warnings.catch_warnings()  # quiet_from_now's filter is undone with the rest
    kept_filters.__enter__()

    def uninstall() -> None:
        watcher.close()
        hooks()
        for name in ("asyncio", "absl"):
            logging.getLogger(name).disabled = False
        kept_filters.__exit__(None, None, None)
        _cleanups.clear()
        _state.update(message=None, forward=None, received=None, boundary=None, completed=False)
        _Watcher.asked = None

    return uninstall


__all__ = ["AS_SIGTERM", "EXIT_STATUS", "GRACE_S", "HOW", "Boundary", "active", "completed", "critical", "forget",
           "forward_to", "hand_to_boundary", "install", "on_exit", "received", "set_message", "write_line"]
