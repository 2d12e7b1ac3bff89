"""One run per work directory (`cdpjax.workdir`): the lock's rules, each on a lock file written
by hand as the situation would leave it. No JAX here; the runs of `cdpjax train` against a live,
a killed and a finished run are in test_reliability.py."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from cdpjax import workdir as workdir_lib
from cdpjax.errors import ConfigError
from cdpjax.workdir import Lock

HOST = socket.gethostname()


def boot_id():
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


def dead_pid():
    """The id of a process that has exited and been reaped."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def start_ticks(pid):
    """Field 22 of /proc/PID/stat (start time in clock ticks), read here independently."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[19]


def write_lock(workdir, **fields):
    """lock.json as a run would leave it; `age_s` sets how old its heartbeat is."""
    age = fields.pop("age_s", 0.0)
    now = time.time()
    record = {"host": HOST, "boot_id": boot_id(), "pid": os.getpid(), "pid_start": start_ticks(os.getpid()),
              "started": now - age - 60, "heartbeat": now - age, "token": 12345}
    record.update(fields)
    (workdir / "lock.json").write_text(json.dumps(record))
    return record


def owner_of(workdir):
    return json.loads((workdir / "lock.json").read_text())


@pytest.fixture
def notices():
    """The one-line notices of takeovers, as `cdpjax train` would print them."""
    return []


def acquire(workdir, notices, force=False):
    return Lock.acquire(str(workdir), force=force, say=notices.append)


def test_a_live_run_on_this_host_is_refused_naming_it(tmp_path, notices):
    """While a run holds WORKDIR, a second one is refused: one message naming the directory, the
    owner (host, process id, start time) and what to do; released, the directory is free."""
    first = acquire(tmp_path, notices)
    assert owner_of(tmp_path)["pid"] == os.getpid() and owner_of(tmp_path)["host"] == HOST
    with pytest.raises(ConfigError) as err:
        acquire(tmp_path, notices)
    message = str(err.value)
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(first.owner.started))
    assert f"WORKDIR {tmp_path} is in use" in message
    assert f"process {os.getpid()} on host {HOST}, started {started}" in message
    assert "--force" in message and "\n" not in message
    first.release()
    assert not (tmp_path / "lock.json").exists()
    acquire(tmp_path, notices).release()
    assert notices == []  # nothing was taken over


@pytest.mark.parametrize("situation", ["process-gone", "process-id-reused", "zombie"])
def test_a_run_whose_process_is_gone_is_taken_over(situation, tmp_path, notices):
    """On this host a lock is stale when its process is gone, even with a fresh heartbeat (a
    SIGKILLed run restarted at once): no such process, the id now another process's (another
    start time), or a zombie that was never reaped."""
    zombie = None
    if situation == "process-gone":
        record = write_lock(tmp_path, pid=dead_pid())
    elif situation == "process-id-reused":
        record = write_lock(tmp_path, pid_start=str(int(start_ticks(os.getpid())) + 1))
    else:
        zombie = subprocess.Popen(["true"])
        while open(f"/proc/{zombie.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.01)
        record = write_lock(tmp_path, pid=zombie.pid, pid_start=start_ticks(zombie.pid))
    lock = acquire(tmp_path, notices)
    assert owner_of(tmp_path)["token"] == lock.owner.token != record["token"]
    assert len(notices) == 1 and f"process {record['pid']} is gone from this host" in notices[0]
    assert lock.may_clean  # its checkpoint leftovers have no live writer
    lock.release()
    if zombie is not None:
        zombie.wait()


@pytest.mark.parametrize("age_s,live", [(5, True), (110, True), (130, False), (86400, False)])
def test_another_hosts_lock_is_judged_by_its_heartbeat(age_s, live, tmp_path, notices):
    """A lock of another host (a shared file system, where its process id means nothing here) is
    live while its heartbeat is younger than the stated 120 s, and taken over after."""
    record = write_lock(tmp_path, host="node-17.cluster", boot_id="another-kernel", age_s=age_s)
    if live:
        with pytest.raises(ConfigError, match=f"host node-17.cluster.*heartbeat from host node-17.cluster is "
                                              f"{age_s} s old"):
            acquire(tmp_path, notices)
        assert owner_of(tmp_path) == record
    else:
        lock = acquire(tmp_path, notices)
        assert len(notices) == 1 and f"heartbeat from host node-17.cluster is {age_s} s old" in notices[0]
        lock.release()


def test_this_host_before_a_reboot_is_judged_by_its_heartbeat(tmp_path, notices):
    """Same host name, another boot: the process ids of before the reboot mean nothing."""
    write_lock(tmp_path, boot_id="before-the-reboot", age_s=200)
    lock = acquire(tmp_path, notices)
    assert "this host before it restarted" in notices[0]
    lock.release()


def test_heartbeat_is_refreshed_and_a_forced_takeover_stops_the_old_run(tmp_path, notices, monkeypatch):
    """The owner refreshes its heartbeat; `force` takes a live lock over (saying so), after which
    the old owner finds out at its next heartbeat, stops, and its release leaves the new lock."""
    monkeypatch.setattr(workdir_lib, "HEARTBEAT_S", 0.05)
    old = acquire(tmp_path, notices)
    first_beat = owner_of(tmp_path)["heartbeat"]
    deadline = time.time() + 5
    while owner_of(tmp_path)["heartbeat"] == first_beat and time.time() < deadline:
        time.sleep(0.02)
    assert owner_of(tmp_path)["heartbeat"] > first_beat
    new = acquire(tmp_path, notices, force=True)
    assert len(notices) == 1 and "forced (--force)" in notices[0] and "is running on this host" in notices[0]
    assert not new.may_clean  # the forced-out run may be writing a checkpoint
    while old.lost is None and time.time() < deadline:
        time.sleep(0.02)
    with pytest.raises(ConfigError, match="was taken over by process .* this run stops"):
        old.check()
    old.release()
    assert owner_of(tmp_path)["token"] == new.owner.token
    new.release()
    assert not (tmp_path / "lock.json").exists()


def test_an_unreadable_lock_is_given_time_then_taken_over(tmp_path, notices):
    (tmp_path / "lock.json").write_text("")
    with pytest.raises(ConfigError, match="an unreadable lock file"):
        acquire(tmp_path, notices)
    old = time.time() - 600
    os.utime(tmp_path / "lock.json", (old, old))
    acquire(tmp_path, notices).release()
    assert "from an unreadable lock file" in notices[0]


def _age_file(workdir, seconds):
    then = time.time() - seconds
    os.utime(workdir / "lock.json", (then, then))


def test_a_heartbeat_from_the_future_is_judged_by_the_file_age(tmp_path, notices):
    """Another host's heartbeat a year ahead (a clock far off, or a damaged file) is not "0 s
    old": it is said to lie in the future and the file's own age decides, as for an unreadable
    lock: refused while the file is fresh, taken over once it is old."""
    write_lock(tmp_path, host="node-17.cluster", boot_id="another-kernel", age_s=-365 * 86400)
    with pytest.raises(ConfigError) as err:
        acquire(tmp_path, notices)
    assert "heartbeat from host node-17.cluster lies 31536000 s in the future" in str(err.value), err.value
    _age_file(tmp_path, 600)
    lock = acquire(tmp_path, notices)
    assert len(notices) == 1 and "in the future" in notices[0] and "written 600 s ago" in notices[0], notices
    lock.release()


@pytest.mark.parametrize("fields", [{"pid": 0}, {"pid": -1}, {"pid": "abc"}, {"pid": 2**70}, {"pid": True},
                                    {"heartbeat": "now"}, {"started": float("inf")}, {"token": None},
                                    {"host": 5}], ids=lambda f: f"{next(iter(f))}={next(iter(f.values()))!r}")
def test_a_lock_record_that_no_run_writes_is_unreadable(fields, tmp_path, notices):
    """A lock whose record is not what a run writes (process id 0, which os.kill would read as
    this process group, a negative, text, 2**70; a heartbeat or start time that is not a finite
    number; ...) is an unreadable lock: given time while fresh, then taken over; never judged
    "running" and never a traceback."""
    write_lock(tmp_path, **fields)
    with pytest.raises(ConfigError, match="an unreadable lock file"):
        acquire(tmp_path, notices)
    _age_file(tmp_path, 600)
    acquire(tmp_path, notices).release()
    assert len(notices) == 1 and "from an unreadable lock file" in notices[0], notices


def test_a_failed_lock_write_leaves_no_temporary_file(tmp_path, notices, monkeypatch):
    """Writing the lock's record fails (a full disk): a one-line error naming lock.json, and no
    lock.json.<pid>-<hex>.tmp left behind."""
    import builtins
    import errno

    real_open = builtins.open

    def full(path, mode="r", *args, **kwargs):
        handle = real_open(path, mode, *args, **kwargs)
        if "w" in mode and str(path).endswith(".tmp"):
            handle.close()
            raise OSError(errno.ENOSPC, "No space left on device")
        return handle

    monkeypatch.setattr(builtins, "open", full)
    with pytest.raises(ConfigError, match=f"cannot write {tmp_path}/lock.json: no space left on the device"):
        acquire(tmp_path, notices)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_the_old_run_finds_a_forced_takeover_at_its_next_check(tmp_path, notices):
    """`Lock.check`, run at every step, sees a takeover at once (one stat of the file), not at the
    next heartbeat."""
    old = acquire(tmp_path, notices)
    old.check()
    new = acquire(tmp_path, notices, force=True)
    with pytest.raises(ConfigError, match=f"was taken over by process {os.getpid()} on host {HOST}"):
        old.check()
    old.release()
    assert owner_of(tmp_path)["token"] == new.owner.token
    new.release()


def test_a_check_between_the_takeover_moving_the_file_and_creating_its_own_names_the_taker(
        tmp_path, notices, monkeypatch):
    """A forced takeover renames the old lock file away, then creates its own: a check that lands
    in between finds no file. It looks again rather than reporting an anonymous loss, so the
    line names the taking run (the failure CI once saw, made certain here by pausing in the gap)."""
    old = acquire(tmp_path, notices)
    in_gap = threading.Event()
    checked = {}
    real_create = workdir_lib._create

    def slow_create(path, owner):
        if not os.path.exists(path):  # the takeover's own create, after the rename
            in_gap.set()
            time.sleep(0.3)
        return real_create(path, owner)

    def check_in_gap():
        in_gap.wait(5)
        try:
            old.check()
        except ConfigError as e:
            checked["error"] = str(e)

    monkeypatch.setattr(workdir_lib, "_create", slow_create)
    checker = threading.Thread(target=check_in_gap)
    checker.start()
    new = acquire(tmp_path, notices, force=True)
    checker.join()
    assert f"was taken over by process {os.getpid()} on host {HOST}" in checked["error"]
    old.release()
    new.release()


def test_two_restarts_racing_for_one_stale_lock(tmp_path, notices):
    """Both judged the same stale lock; the first takes it over; the second's takeover, which
    checks that the file it moves aside is the one it judged, puts the winner's lock back."""
    write_lock(tmp_path, pid=dead_pid())
    _, judged, _ = workdir_lib._read(str(tmp_path / "lock.json"))
    winner = acquire(tmp_path, notices)
    assert not workdir_lib._take_over(str(tmp_path / "lock.json"), judged)
    assert owner_of(tmp_path)["token"] == winner.owner.token
    with pytest.raises(ConfigError, match="is in use"):
        acquire(tmp_path, notices)
    winner.release()


def test_other_processes_check_process_0s_token(tmp_path, notices):
    lock = acquire(tmp_path, notices)
    workdir_lib.check_token(str(tmp_path), lock.owner.token)
    with pytest.raises(ConfigError, match="does not see the lock its process 0 took"):
        workdir_lib.check_token(str(tmp_path), lock.owner.token + 1, wait_s=0.2)
    lock.release()


def test_a_workdir_that_is_a_file(tmp_path, notices):
    (tmp_path / "w").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        acquire(tmp_path / "w", notices)


HOLDER = """
import sys, time
from cdpjax.workdir import Lock, sigterm_as_interrupt
with sigterm_as_interrupt(), Lock.acquire(sys.argv[1]):
    print("held", flush=True)
    time.sleep(120)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_the_lock_is_released_on_sigint_and_sigterm(sig, tmp_path):
    """A process holding the lock and stopped by Ctrl-C or SIGTERM removes lock.json on its way out."""
    # SIGINT's handler set explicitly: a shell that starts the tests in the background ignores it.
    code = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n" + HOLDER
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held", holder.stderr.read()
    assert owner_of(tmp_path)["pid"] == holder.pid
    holder.send_signal(sig)
    _, err = holder.communicate()
    assert ("Terminated: SIGTERM" if sig == signal.SIGTERM else "KeyboardInterrupt") in err
    assert not (tmp_path / "lock.json").exists()
