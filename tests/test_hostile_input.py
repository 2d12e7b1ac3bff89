"""Hostile input and limits (issue 35, items 5 to 8): every file cdpjax reads is a regular file read
with a size limit; `schedule --from-json` is validated before any use; sizes past what a command can
do in a stated time or memory are refused before the work; `plot` draws any names and survives any
metrics line; outputs are created before the work. Each case ends with exit 2 (0 where the input is
drawn as it is), one line, no traceback, within 10 seconds, nothing compiled."""
import contextlib
import json
import os
import signal
import time

import pytest

from cdpjax.cli import main

LIMIT_S = 10  # the acceptance's bound on each case
HANG_S = 120  # a case still running past this is a hang: the test fails rather than waits forever


@contextlib.contextmanager
def hang_guard():
    def hung(signum, frame):
        raise TimeoutError(f"still running after {HANG_S} s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(HANG_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def one_line(args, capfd, compiles=None, code=2) -> str:
    """`cdpjax ARGS` in this process: exit `code`, within LIMIT_S, no traceback, and (code 2) one line
    on stderr, returned; nothing compiled where `compiles` is given."""
    capfd.readouterr()
    t0 = time.monotonic()
    with hang_guard():
        got = main([str(a) for a in args])
    took = time.monotonic() - t0
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert got == code, err
    assert took < LIMIT_S, f"{took:.1f} s"
    if compiles is not None:
        assert not [c for c in compiles if c[0] == "backend"], compiles
    lines = err.strip().splitlines()
    if code == 2:
        assert len(lines) == 1 and lines[0].startswith("cdpjax"), err
    return lines[0] if lines else ""


# 35.5: every file read is a regular file, read with a size limit --------------------------------------

def _not_a_file(path, what: str) -> str:
    """Makes `path` what the case names; returns the words the refusal uses for it."""
    if what == "dev-zero":
        os.symlink("/dev/zero", path)
        return "is a character device, not a regular file"
    if what == "dev-urandom":
        os.symlink("/dev/urandom", path)
        return "is a character device, not a regular file"
    if what == "fifo":
        os.mkfifo(path)
        return "is a FIFO (named pipe), not a regular file"
    if what == "directory":
        os.mkdir(path)
        return "is a directory"
    raise AssertionError(what)


@pytest.mark.parametrize("what", ["dev-zero", "fifo"])
def test_a_lock_that_is_not_a_file_ends_in_one_line(what, tmp_path, capfd, compiles):
    """lock.json a link to /dev/zero (read 21 GB before) or a FIFO (hung): refused in one line
    naming it, before anything is compiled."""
    work = tmp_path / "w"
    work.mkdir()
    words = _not_a_file(work / "lock.json", what)
    line = one_line(["train", "--workdir", work, "--config.num_steps=2", "--no-progress"], capfd, compiles)
    assert f"{work / 'lock.json'}" in line and words in line and "remove it" in line, line


@pytest.mark.parametrize("what", ["dev-zero", "dev-urandom", "fifo", "directory"])
def test_a_table_file_that_is_not_a_file_ends_in_one_line(what, tmp_path, capfd):
    path = tmp_path / "table.json"
    words = _not_a_file(path, what)
    line = one_line(["schedule", "--from-json", path], capfd)
    assert line.startswith(f"cdpjax schedule: error: --from-json {path}") and words in line, line


def test_a_table_file_past_its_limit_is_refused_by_its_size(tmp_path, capfd, monkeypatch):
    from cdpjax import table_json

    monkeypatch.setattr(table_json, "JSON_LIMIT", 100)
    path = tmp_path / "table.json"
    path.write_bytes(b" " * 101)
    line = one_line(["schedule", "--from-json", path], capfd)
    assert "holds 101 bytes, more than the 100" in line, line


def _run_folder(tmp_path, name="run"):
    work = tmp_path / name
    work.mkdir()
    lines = [{"step": s, "split": "train", "loss": 1.0 / s} for s in (1, 2, 3)]
    (work / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return work


@pytest.mark.parametrize("what", ["dev-zero", "fifo"])
def test_plot_of_a_config_that_is_not_a_file_labels_by_the_name(what, tmp_path, capfd):
    """config.json (read only for the label) not a file: the figure is drawn, labelled by the folder."""
    work = _run_folder(tmp_path)
    _not_a_file(work / "config.json", what)
    one_line(["plot", work, "--out", tmp_path / "c.png"], capfd, code=0)
    assert (tmp_path / "c.png").stat().st_size > 0


@pytest.mark.parametrize("what", ["dev-zero", "fifo"])
def test_plot_of_metrics_that_are_not_a_file_ends_in_one_line(what, tmp_path, capfd):
    work = _run_folder(tmp_path)
    (work / "metrics.jsonl").unlink()
    _not_a_file(work / "metrics.jsonl", what)
    line = one_line(["plot", work, "--out", tmp_path / "c.png"], capfd)
    assert "metrics.jsonl is not a file" in line, line


def test_the_files_helper_reads_a_file_and_refuses_past_its_limit(tmp_path):
    from cdpjax import files

    path = tmp_path / "a.json"
    path.write_bytes(b"0123456789")
    assert files.read_bytes(str(path), 10) == b"0123456789"
    with pytest.raises(files.FileRefused, match="holds 10 bytes, more than the 9"):
        files.read_bytes(str(path), 9)
