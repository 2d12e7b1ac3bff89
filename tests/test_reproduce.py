"""experiments/reproduce.py: the tiny CDP table runs end to end, its numbers are the time
table's and the runs', a rerun resumes from what is there, and rows that cannot run say why."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from cdpjax import methods, plotting
from cdpjax.layouts.cdp import cdp_table
from cdpjax.config import ConfigError, validate
from helpers import capture_figures, line_data, load_script, png_matches, same_pixels

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "reproduce.py"


reproduce = load_script(SCRIPT, "experiments_reproduce")


def _run(*args):
    # No time limit: on a loaded 2-core machine these runs took over 600 s (they take a minute alone).
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT)


def _table(markdown: str) -> tuple[list[str], list[list[str]]]:
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    return cells[0], cells[2:]


@pytest.fixture(scope="module")
def tiny_cdp(tmp_path_factory):
    out = tmp_path_factory.mktemp("reproduce")
    result = _run("cdp-table", "--tiny", "--steps", "60", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result


def test_tiny_cdp_table_rows_and_columns(tiny_cdp):
    out, result = tiny_cdp
    markdown = (out / "cdp_table.md").read_text()
    assert markdown in result.stdout
    head, rows = _table(markdown)
    assert head == reproduce.CDP_HEAD
    assert [r[2] for r in rows] == ["dp", "cdp-v1", "cdp-v2"]
    col = {name: head.index(name) for name in head}
    for r in rows:
        assert len(r) == len(head)
        assert r[:2] == ["digits", "mlp"] and r[col["N x L"]] == "8 x 4" and r[col["steps"]] == "60"
        assert 10.0 < float(r[col["test acc"]].rstrip("%")) <= 100.0  # learnt something in 60 steps
    # Stage-activations held by all workers in steady state, N = 8, L = 4: dp's workers all reach
    # their peak of L together (N*L = 32), CDP's offsets keep the total flat; both hold N*L/2 = 16
    # on average (each of the 2L ticks of a step holds 1, 2, ..., L, L, ..., 1 stage-activations).
    acts = {r[2]: r[col["act. peak / mean (stage-acts)"]] for r in rows}
    assert acts == {"dp": "32 / 16.0", "cdp-v1": "16 / 16.0", "cdp-v2": "16 / 16.0"}
    balance = {r[2]: float(r[col["comm busiest / mean tick"]]) for r in rows}
    assert balance["dp"] == pytest.approx(8.0) and balance["cdp-v2"] < balance["dp"]
    # dp's gradients travel as an all-reduce; cdp's as collective-permutes.
    assert rows[0][col["HLO permute"]] == "0 B" and rows[2][col["HLO permute"]] != "0 B"


def test_tiny_cdp_rows_keep_their_runs(tiny_cdp):
    out, _ = tiny_cdp
    for method in ("dp", "cdp-v1", "cdp-v2"):
        workdir = out / f"cdp-digits-mlp-{method}"
        summary = json.loads((workdir / "summary.json").read_text())
        assert summary["method"] == method and summary["steps"] == 60
        record = json.loads((workdir / "row.json").read_text())
        assert record["summary"]["test_accuracy"] == summary["test_accuracy"]
        assert {"memory", "collectives"} <= set(record["bench"])
        tests = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
        assert sum(m["split"] == "test" for m in tests) >= 5  # points of the accuracy curve


def _records(out, names):
    """The rows' records (row.json) in the order of `names`, as the script drew them."""
    return [json.loads((out / name / "row.json").read_text()) for name in names if (out / name / "row.json").exists()]


def _metrics(workdir, split, key):
    lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in lines if r["split"] == split], [r[key] for r in lines if r["split"] == split]


def test_tiny_cdp_figures(tiny_cdp, tmp_path, monkeypatch):
    """The CDP figures by content: drawn again here from the rows' records (figures recorded), the
    accuracy figure plots each run's test accuracy and train loss at their steps as its
    metrics.jsonl has them; the activation and comm figures plot dp's and cdp-v2's tables for the
    run's 8 workers and 4 stages (stage-activations held, gradient bytes per tick at the stages'
    parameter bytes), cdp's line flat at N*L/2 = 16 in steady state where dp's reaches N*L = 32;
    and the files the script wrote have exactly these figures' pixels."""
    out, _ = tiny_cdp
    names = [f"cdp-digits-mlp-{m}" for m in ("dp", "cdp-v1", "cdp-v2")]
    records = _records(out, names)
    figures = capture_figures(monkeypatch, reproduce, plotting, into=str(tmp_path))
    reproduce.cdp_figures(records, str(out))
    (acc_path, acc), (act_path, act), (bytes_path, act_bytes), (comm_path, comm) = figures
    assert [os.path.basename(p) for p in (acc_path, act_path, bytes_path, comm_path)] == [
        f"cdp_{kind}_digits_mlp.png" for kind in ("accuracy", "activation", "activation_bytes", "comm")]
    test_panel, loss_panel = acc.axes
    assert line_data(test_panel) == [_metrics(out / name, "test", "accuracy") for name in names]
    assert line_data(loss_panel) == [_metrics(out / name, "train", "loss") for name in names]
    assert [t.get_text() for t in test_panel.get_legend().get_texts()] == ["dp", "cdp-v1", "cdp-v2"]
    tables = [cdp_table(m, 8, 4, steps=4) for m in ("dp", "cdp-v2")]
    sizes = records[0]["stage_param_bytes"]
    assert len(sizes) == 4 and min(sizes) > 0
    assert [y for _, y in line_data(act.axes[0])] == [list(t.activation_total()) for t in tables]
    assert [y for _, y in line_data(comm.axes[0])] == [list(t.bytes_per_tick(sizes)) for t in tables]
    dp_held, cdp_held = (y for _, y in line_data(act.axes[0]))
    assert max(dp_held[8:16]) == 32 and cdp_held[8:16] == [16] * 8
    # in bytes: dp's peak is every worker holding every stage's output, N x (the stages' bytes)
    dp_bytes, cdp_bytes = (y for _, y in line_data(act_bytes.axes[0]))
    per_worker = sum(records[0]["stage_activation_bytes"]) / 2**20
    assert max(dp_bytes) == pytest.approx(8 * per_worker) and max(cdp_bytes) < max(dp_bytes)
    for path, fig in figures:
        written = out / "figures" / os.path.basename(path)
        assert png_matches(written, fig) and same_pixels(written, tmp_path / os.path.basename(path)), path


def test_rerun_reuses_finished_rows(tiny_cdp):
    out, _ = tiny_cdp
    before = (out / "cdp_table.md").read_text()
    result = _run("cdp-table", "--tiny", "--steps", "60", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("reusing") == 3
    assert (out / "cdp_table.md").read_text() == before


def test_rerun_with_other_steps_is_refused(tiny_cdp):
    out, _ = tiny_cdp
    row = reproduce.cdp_rows(True)[0]
    with pytest.raises(ConfigError, match="holds a 60-step run, not 30"):
        reproduce.run_row(row, str(out), 30, log=lambda _: None)


def test_unregistered_method_is_a_visible_row(tmp_path):
    rows = [reproduce.Row("cdp", "x-warp", ("digits", "mlp"), "warp-drive", "digits.py:method=dp"),
            reproduce.Row("ppll", "y-warp", ("mlp", 4), "warp-drive", "digits.py:method=dp")]
    records = [reproduce.run_row(r, str(tmp_path), 10, log=lambda _: None) for r in rows]
    assert [r["status"] for r in records] == ["not registered"] * 2
    assert not os.listdir(tmp_path)  # nothing trained
    for markdown in (reproduce.cdp_markdown(records[:1]), reproduce.ppll_markdown(records[1:])):
        head, (row,) = _table(markdown)
        assert len(row) == len(head) and "warp-drive" in row and "not registered" in row


def test_rows_that_cannot_run_here_say_why(tmp_path):
    row = reproduce.Row("ppll", "too-big", ("mlp", 16), "ppll", "digits.py:method=ppll,stages=4")
    record = reproduce.run_row(row, str(tmp_path), 10, ["mesh.stage=16"], log=lambda _: None)
    assert record["status"] == "skipped" and "needs 16 devices" in record["note"]


def test_row_lists_cover_the_paper_tables():
    cdp = reproduce.cdp_rows(False)
    groups = {(d, m) for d in ("cifar10", "imagenet2012") for m in ("resnet18", "resnet50")}
    assert {tuple(r.group) for r in cdp} == groups
    assert {r.method for r in cdp} == {"dp", "cdp-v1", "cdp-v2"}
    ppll = reproduce.ppll_rows(False)
    groups = {("resnet32", k) for k in (2, 4, 8, 16)} | {("vit", 12)}
    assert {tuple(r.group) for r in ppll if r.method == "ppll"} == groups
    assert {r.method for r in ppll} == {"e2e", "local", "ppll", "gpipe"}
    assert len({r.name for r in cdp + ppll}) == len(cdp + ppll)  # one directory per row


@pytest.mark.parametrize("row", reproduce.cdp_rows(False) + reproduce.ppll_rows(False), ids=lambda r: r.name)
def test_shortened_paper_configs_stay_valid(row):
    """--steps on the paper configs scales their schedules so that they still validate."""
    config = reproduce.row_config(row, 20)
    if config.method not in methods.REGISTRY:
        pytest.skip(f"{config.method} not registered")
    validate(config)
    assert config.num_steps == 20 and config.warmup_steps < 20 and config.eval_every == 2


@pytest.fixture(scope="module")
def tiny_ppll(tmp_path_factory):
    out = tmp_path_factory.mktemp("reproduce_ppll")
    result = _run("ppll-table", "--tiny", "--steps", "20", "--only", "ppll-mlp-e2e", "--only", "ppll-mlp-K2-*",
                  "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result


@pytest.mark.heavy  # the PPLL table trains every K=2 row; CI: the CDP table
def test_tiny_ppll_table_has_the_baselines_heads_and_memory(tiny_ppll):
    """The PPLL table's rows for K = 2: local learning, ppll, and both of the paper's baselines
    named as what they are; predictions with the heads timed; memory per device against local."""
    out, result = tiny_ppll
    head, rows = _table((out / "ppll_table.md").read_text())
    assert head == reproduce.PPLL_HEAD
    col = {name: head.index(name) for name in head}
    assert [r[col["method"]] for r in rows] == ["e2e", "local", "ppll", "gpipe M=1 (plain model parallelism)",
                                                "gpipe M=4"]
    by = {r[col["method"]]: r for r in rows}
    assert by["ppll"][col["test acc"]] == by["local"][col["test acc"]]  # ppll's parameters are local's
    for name in ("ppll", "gpipe M=1 (plain model parallelism)", "gpipe M=4"):
        assert by[name][col["predicted speedup on K devices"]].endswith("x")
        assert float(by[name][col["x local's memory"]]) > 0
    assert by["local"][col["x local's memory"]] == "1.00"
    records = {json.loads((out / d / "row.json").read_text())["label"]: json.loads((out / d / "row.json").read_text())
               for d in os.listdir(out) if (out / d / "row.json").exists()}
    ppll = records["ppll"]["prediction"]
    assert ppll["heads_timed"] and ppll["stage_head"][0] > 0 and len(ppll["stage_head"]) == 2
    # plain model parallelism runs one stage at a time: no faster than one device (rule, not a measurement)
    plain = records["gpipe M=1 (plain model parallelism)"]["prediction"]["speedup"]
    assert plain == pytest.approx(1.0, abs=0.02)
    assert 1.0 < ppll["speedup"] <= 2.0 + 1e-6  # at most K, less by the stage imbalance


@pytest.mark.heavy  # the PPLL table trains every K=2 row; CI: the CDP table
def test_tiny_ppll_figures(tiny_ppll, tmp_path, monkeypatch):
    """The PPLL figures by content: drawn again from the rows' records (figures recorded), the
    speedup figure plots each pipeline's predicted speedup at K = 2 and the line y = K; the
    accuracy figure has one bar per variant at its run's test accuracy and e2e's as a line; the
    files the script wrote have exactly these figures' pixels."""
    out, _ = tiny_ppll
    names = [r.name for r in reproduce.ppll_rows(True)]
    records = _records(out, names)
    assert [r["label"] or r["method"] for r in records] == [
        "e2e", "local", "ppll", "gpipe M=1 (plain model parallelism)", "gpipe M=4"]
    by_label = {r["label"] or r["method"]: r for r in records}
    figures = capture_figures(monkeypatch, reproduce, into=str(tmp_path))
    reproduce.ppll_figures(records, str(out))
    (speed_path, speed), (acc_path, acc) = figures
    assert [os.path.basename(p) for p in (speed_path, acc_path)] == ["ppll_speedup_mlp.png", "ppll_accuracy_mlp.png"]
    predicted = {label: r["prediction"]["speedup"] for label, r in by_label.items()
                 if "speedup" in r.get("prediction", {})}
    assert set(predicted) == {"ppll", "gpipe M=1 (plain model parallelism)", "gpipe M=4"}
    lines = {line.get_label(): line.get_xydata().tolist() for line in speed.axes[0].get_lines()}
    for label, value in predicted.items():
        assert lines[f"{label}, predicted on K devices"] == [[2.0, value]]
    assert lines["K (no bubble, free transfers)"] == [[2.0, 2.0]]
    bars = {c.get_label(): [p.get_height() for p in c.patches] for c in acc.axes[0].containers}
    for label in ("local", "ppll", "gpipe M=1 (plain model parallelism)", "gpipe M=4"):
        assert bars[label] == [by_label[label]["summary"]["test_accuracy"]]
    (e2e_line,) = [line for line in acc.axes[0].get_lines() if line.get_label() == "e2e"]
    assert set(e2e_line.get_ydata()) == {by_label["e2e"]["summary"]["test_accuracy"]}
    for path, fig in figures:
        written = out / "figures" / os.path.basename(path)
        assert png_matches(written, fig) and same_pixels(written, tmp_path / os.path.basename(path)), path
