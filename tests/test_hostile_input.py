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


# 35.6: `schedule --from-json` validated by one schema layer before any use ---------------------------

def _cdp_table():
    from cdpjax.layouts import LAYOUTS

    return LAYOUTS.lookup("cdp-v2").make_table(workers=2, stages=2).to_json()


def _flip_a_stale_flag(d):
    forwards = [op for op in d["ops"] if op["kind"] == "F" and (op["micro"], op["stage"]) == (0, 0)]
    assert len(forwards) > 1 and forwards[0]["step"] != forwards[1]["step"]
    forwards[1]["stale"] = not forwards[1]["stale"]


TABLE_EDITS = {  # edit of cdp-v2's table (2 workers, 2 stages, 3 steps, 14 ticks), flags, words of the refusal
    "one-worker": (lambda d: d.update(workers=1, applies=[]), [], "micro=1 must be below max(workers, microbatches)=1"),
    "micro-past-the-workers": (lambda d: d["ops"][0].update(micro=2), [],
                               "micro=2 must be below max(workers, microbatches)=2"),
    "stale-flag-changes-between-steps": (_flip_a_stale_flag, [], "the rule is one per (worker, stage)"),
    "empty-ops-with-costs": (lambda d: d.update(ops=[]), ["--costs", "F=1,B=2"], "ops is empty"),
    "lone-surrogate-in-method": (lambda d: d.update(method="\ud800"), [], "method = '\\ud800' holds a lone surrogate"),
    "lone-surrogate-in-a-note": (lambda d: d.update(notes=["\udcff"]), [], "notes[0] = '\\udcff' holds a lone"),
    "terminal-escape-in-method": (lambda d: d.update(method="\x1b[2J"), [], "without control characters"),
    "op-step-past-steps": (lambda d: d["ops"][0].update(step=3), [], "step=3 must be below steps=3"),
    "update-step-past-steps": (lambda d: d["updates"][0].update(step=3), [], "its step must be below steps=3"),
    "message-half-all-reduce": (lambda d: d["messages"][0].update(src=-1), ["--json", "--stage-bytes", "1,1"],
                                "src and dst are both devices or both -1"),
    "offsets-not-one-per-worker": (lambda d: d.update(offsets=[0, 1, 2]), [], "offsets has 3 entries"),
    "period-past-the-ticks": (lambda d: d.update(period=15), ["--out", "{tmp}/t.png"], "period=15 must be"),
    "ticks-10**6-drawn": (lambda d: d.update(num_ticks=10**6), ["--out", "{tmp}/t.png"],
                          "1000000 ticks, more than the 1500 --out draws"),
    "ticks-10**6-printed": (lambda d: d.update(num_ticks=10**6), [], "1000000 ticks x 2 devices, more than 500000"),
}


@pytest.mark.parametrize("name", TABLE_EDITS, ids=list(TABLE_EDITS))
def test_a_table_that_would_crash_is_refused_before_any_use(name, tmp_path, capfd):
    """Each crashed, hung or drew for 18 s before (IndexError, AssertionError, max() of nothing,
    UnicodeEncodeError, matplotlib's image size): now one line, exit 2, and no figure left."""
    edit, flags, words = TABLE_EDITS[name]
    d = _cdp_table()
    edit(d)
    path = tmp_path / "table.json"
    path.write_text(json.dumps(d))
    line = one_line(["schedule", "--from-json", path, *[f.format(tmp=tmp_path) for f in flags]], capfd)
    assert words in line, line
    assert not (tmp_path / "t.png").exists()


def test_every_layouts_table_passes_the_schema():
    """The schema refuses no table a layout lays out (the registry's, at several sizes, with W
    ops, the paper-code rule's future reads, cdp-zero's pieces): each reads back equal."""
    from cdpjax.layouts import LAYOUTS
    from cdpjax.timetable import TimeTable

    sizes = [{}, {"stages": 2}, {"stages": 3}, {"stages": 4, "workers": 8}, {"stages": 4, "microbatches": 8},
             {"stages": 4, "ticks": "split"}, {"stages": 4, "workers": 8, "rule": "paper-code"},
             {"stages": 8, "chunks": 2}, {"module_groups": (2, 1, 1)}, {"stages": 4, "workers": 1}]
    read = 0
    for name, layout in LAYOUTS.items():
        if layout.table is None:
            continue
        for kw in sizes:
            try:
                t = layout.make_table(**kw)
            except Exception:  # noqa: BLE001 - sizes the layout does not take
                continue
            back = TimeTable.from_json(json.dumps(t.to_json()))
            assert (back.ops, back.updates, back.messages) == (t.ops, t.updates, t.messages), (name, kw)
            read += 1
    assert read > 40


# 35.7: sizes refused before the work ------------------------------------------------------------------

@pytest.mark.parametrize("argv,words", [
    (["--method", "1f1b", "--stages", "2048", "--microbatches", "80"], "--stages 2048: at most 1024"),
    (["--method", "cdp-v2", "--stages", "4096", "--workers", "8"], "--stages 4096: at most 1024"),
    (["--method", "ppll", "--stages", "512"], "ops, more than 1e+05"),
    (["--method", "cdp-zero", "--stages", "32", "--workers", "64"], "ops and messages, more than 1e+05"),
    (["--method", "zb-h1", "--stages", "4", "--microbatches", "4", "--steps", "200", "--out", "{tmp}/t.png"],
     "more than the 2048 --out draws"),
])
def test_schedule_sizes_past_the_limits_are_refused_at_once(argv, words, tmp_path, capfd):
    """Each laid out for minutes before (1f1b at 2048 stages: 536 s and 823 MB; cdp-v2 at 4096: 371 s;
    cdp-zero's pieces: a million messages), or drew for minutes: refused before the work."""
    line = one_line(["schedule", *[a.format(tmp=tmp_path) for a in argv]], capfd)
    assert words in line, line
    assert not (tmp_path / "t.png").exists()


@pytest.mark.parametrize("command,override,words", [
    ("train", "--config.model_kwargs.depth=100000", "model_kwargs.depth=100000: model 'mlp' takes at most 256"),
    ("describe", "--config.model_kwargs.depth=20000", "model_kwargs.depth=20000: model 'mlp' takes at most 256"),
    ("train", "--config.model_kwargs.width=10000000", "model_kwargs.width=10000000: model 'mlp' takes at most"),
    ("describe", "--config.model_kwargs.width=100000", "holds 2e+10 parameters and state values, more than 4.29e+09"),
])
def test_model_sizes_past_the_limits_are_refused_before_building(command, override, words, tmp_path, capfd,
                                                                  compiles):
    """Depth 100,000 validated for 900 s and more; describe at 20,000 ran past 120 s; a width of 10**5
    (mlp, 3 layers: about 2 x 10**10 parameters, 80 GB) would be built. One line, nothing compiled."""
    args = [command, override] + (["--workdir", tmp_path / "w", "--no-progress"] if command == "train" else [])
    line = one_line(args, capfd, compiles)
    assert words in line, line


def test_a_process_count_from_the_environment_is_bounded(tmp_path, capfd, compiles, monkeypatch):
    """CDPJAX_NUM_PROCESSES=99999999999 was a 25-line TypeError inside jax.distributed (the same value as
    a config override was refused): one line naming the variable."""
    monkeypatch.setenv("CDPJAX_NUM_PROCESSES", "99999999999")
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "localhost:1234")
    monkeypatch.setenv("CDPJAX_PROCESS_ID", "0")
    line = one_line(["train", "--workdir", tmp_path / "w", "--no-progress"], capfd, compiles)
    assert "CDPJAX_NUM_PROCESSES=99999999999: a run has at most 1048576 processes" in line, line


@pytest.mark.parametrize("args,words", [
    (["--repeats", "99999999999999999999999"], "--repeats 99999999999999999999999 must be >= 1 and <= 1000"),
    (["--predict", "99999999999"], "--predict 99999999999 must be >= 0 and <= 1024"),
    (["--json", "/proc/x.json"], "--json /proc/x.json cannot be created"),
])
def test_bench_arguments_past_their_limits_are_refused_before_compiling(args, words, capfd, compiles):
    """`bench --repeats 10**22` was accepted; `--json /proc/x.json` passed the writability check and
    failed after the work, the results lost. Both refused first, nothing compiled."""
    line = one_line(["bench", "--methods", "dp", *args], capfd, compiles)
    assert words in line, line


# 35.8: plot draws names as plain text, survives any metrics line, bounds its keys -----------------------

def _drawn_texts(fig) -> list[str]:
    texts = [t.get_text() for ax in fig.axes for t in (ax.title, ax.xaxis.label, ax.yaxis.label)]
    for ax in fig.axes:
        legend = ax.get_legend()
        texts += [t.get_text() for t in legend.get_texts()] if legend else []
    return texts


@pytest.mark.parametrize("name", ["run$x^{$", "$\\sqrt{$", "a$b"])
def test_plot_draws_names_with_tex_characters_as_plain_text(name, tmp_path, capfd, monkeypatch):
    """A run folder named with TeX's characters (a traceback from mathtext before), with TeX turned
    on in matplotlib's settings: exit 0, the figure written, the name drawn as it is spelled (each
    `$` escaped for mathtext: the text matplotlib shows is the name)."""
    import matplotlib

    from cdpjax.commands import plot
    from helpers import capture_figures

    figures = capture_figures(monkeypatch, __import__("cdpjax.plotting", fromlist=["_save"]))
    work = _run_folder(tmp_path, name)
    with matplotlib.rc_context({"text.usetex": True}):
        one_line(["plot", work, "--out", tmp_path / "c.png"], capfd, code=0)
    assert (tmp_path / "c.png").stat().st_size > 0
    assert name.replace("$", "\\$") in _drawn_texts(figures[0][1]), _drawn_texts(figures[0][1])
    assert plot.plain(name).replace("\\$", "$") == name


HOSTILE_METRICS = {  # a line added to a run's three train lines, and what the figure then shows
    "step-10**400": '{"step": ' + "1" + "0" * 400 + ', "split": "train", "loss": 0.5}',
    "loss-10**400": '{"step": 4, "split": "train", "loss": ' + "1" + "0" * 400 + '}',
    "lone-surrogate-key": '{"step": 4, "split": "train", "\\ud800": 0.5}',
    "3000-keys": json.dumps({"step": 4, "split": "train", **{f"k{i}": 1.0 for i in range(3000)}}),
}


@pytest.mark.parametrize("name", HOSTILE_METRICS, ids=list(HOSTILE_METRICS))
def test_plot_survives_any_metrics_line(name, tmp_path, capfd):
    """Each was a traceback (an integer past a float, a key that is no text) or a hang (3,000 keys: 6,000
    panels): the figure is drawn within the time bound, exit 0; past METRIC_LIMIT metrics, one line says
    how many are left out."""
    work = _run_folder(tmp_path)
    with open(work / "metrics.jsonl", "a") as f:
        f.write(HOSTILE_METRICS[name] + "\n")
    line = one_line(["plot", work, "--out", tmp_path / "c.png"], capfd, code=0)
    assert (tmp_path / "c.png").stat().st_size > 0
    if name == "3000-keys":  # loss (the first lines' key), then k0..k2999: the first 6 end at k4
        assert "3001 metrics; drawing the first 6, leaving out 2995: k5, k6, k7, ..." in line, line


def test_plot_out_that_cannot_be_created_is_refused_before_reading(tmp_path, capfd):
    """`plot --out /proc/x.png` passed the writability check (root may write /proc's folder) and failed
    after the work: now refused first, the run folder not even read (it does not exist)."""
    line = one_line(["plot", tmp_path / "no-such-run", "--out", "/proc/x.png"], capfd)
    assert "--out /proc/x.png cannot be created" in line, line


def test_a_figure_that_fails_leaves_no_empty_file(tmp_path, capfd):
    """The output is created before the work; when the work then fails, the empty file made for it
    is removed (no file that looks like a result)."""
    line = one_line(["plot", tmp_path / "no-such-run", "--out", tmp_path / "c.png"], capfd)
    assert "holds no metrics.jsonl" in line, line
    assert not (tmp_path / "c.png").exists()
