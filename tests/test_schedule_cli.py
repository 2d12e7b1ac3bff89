"""`cdpjax schedule`: the text grid, --json, --out figures, and bad sizes (exit 2, one line)."""
import collections
import json
import re
import subprocess
import sys

import pytest

from cdpjax import plotting
from cdpjax.commands import schedule
from helpers import capture_figures, cdp_rule, line_data, png_matches, schedule_boxes, update_marks


def run(argv, capsys):
    rc = schedule.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_text_grid(capsys):
    rc, out, err = run(["--method", "cdp-v2", "--workers", "4", "--stages", "4", "--steps", "2"], capsys)
    assert rc == 0 and err == ""
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line[:1] == "w"}
    assert rows["w0"][:8] == ["F0*", "F1*", "F2*", "F3", "B3", "B2*", "B1*", "B0*"]
    assert rows["w3"][:8] == [".", ".", ".", ".", ".", ".", "F0", "F1"]
    rc, out, _ = run(["--method", "gpipe", "--stages", "3", "--microbatches", "2"], capsys)
    assert rc == 0 and "M=2 micro-batches" in out
    rc, out, _ = run(["--method", "ppll", "--stages", "3", "--steps", "4"], capsys)
    assert rc == 0 and "FB3" in out


def test_json(capsys):
    rc, out, _ = run(["--method", "cdp-v2", "--workers", "8", "--stages", "4", "--json"], capsys)
    assert rc == 0
    d = json.loads(out)
    for key in ("method", "workers", "stages", "stale", "busy_fraction", "ticks"):
        assert key in d
    assert (d["method"], d["workers"], d["stages"]) == ("cdp-v2", 8, 4)
    # cdp-v2, N = 8, L = 4: worker i starts at tick i, stage j's update lands at 14 - j, so worker
    # i's forward of stage j (tick i + j) comes first iff i + 2j < 7: half the pairs.
    assert d["stale"] == [[i + 2 * j < 7 for j in range(4)] for i in range(8)]
    assert d["busy_fraction"]["overall"] == 1.0


def gpipe_rule(K, M, steps):
    """GPipe as its paper draws it, written out: stage j runs micro-batch m's forward at tick j + m
    (fill); the last stage's backwards follow its forwards (tick K-1+M+m), each earlier stage's one
    tick after the stage above it (drain); a step is 2(M+K-1) ticks and every stage updates at
    its end. Boxes (tick, stage, 'F<m>'/'B<m>', not hatched) and update marks (tick + 1, stage)."""
    period = 2 * (M + K - 1)
    boxes, marks = [], []
    for k in range(steps):
        for j in range(K):
            for m in range(M):
                boxes.append((period * k + j + m, j, f"F{m}", False))
                boxes.append((period * k + 2 * (K - 1) + M + m - j, j, f"B{m}", False))
            marks.append((period * (k + 1), j))
    return boxes, marks


def cdp_boxes(method, N, L, steps):
    """CDP's boxes (labelled with the worker, as the diagram's rows are stages) and update marks."""
    ops, updates, _ = cdp_rule(method, N, L, steps)
    return ([(tick, stage, f"{kind}w{worker}", stale) for tick, worker, stage, kind, _, _, _, stale in ops],
            [(tick + 1, stage) for tick, stage, _ in updates])


FIGURE_CASES = {  # method, sizes given, what the diagram must hold (the tables' default steps: 3, gpipe 2)
    "cdp-v2": (["--workers", "8"], cdp_boxes("cdp-v2", 8, 4, 3)),
    "dp": (["--workers", "8"], cdp_boxes("dp", 8, 4, 3)),
    "gpipe": ([], gpipe_rule(4, 4, 2)),
}


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_out_draws_the_table(tmp_path, capsys, monkeypatch, suffix):
    """`--out` draws one box per op at (tick, stage), labelled as the layout labels it and hatched
    where the op reads the previous version, and one mark per update: for cdp-v2 and dp against
    CDP's timing written out (`helpers.cdp_rule`), for gpipe against GPipe's fill and drain
    written out above. The file is that figure: a PNG of its size with lines and text, or an SVG
    with a drawn patch per box and each box's text."""
    figures = capture_figures(monkeypatch, plotting)
    for method, (sizes, (boxes, marks)) in FIGURE_CASES.items():
        path = tmp_path / f"{method}{suffix}"
        rc, out, _ = run(["--method", method, *sizes, "--stages", "4", "--out", str(path)], capsys)
        assert rc == 0 and str(path) in out
        saved, fig = figures[-1]
        assert saved == str(path)
        assert sorted(schedule_boxes(fig)) == sorted(boxes), method
        assert sorted(update_marks(fig)) == sorted(marks), method
        assert any(b[3] for b in boxes) == (method == "cdp-v2")  # the rule hatches only cdp-v2 here
        if suffix == ".png":
            assert png_matches(path, fig), method
        else:
            svg = path.read_text()
            assert svg.lstrip().startswith("<?xml") and "<svg" in svg[:400]
            assert svg.count('id="patch_') >= len(boxes)
            texts = collections.Counter(re.findall(r"<!-- (.*?) -->", svg))
            assert not collections.Counter(label for _, _, label, _ in boxes) - texts, method


def test_activation_and_comm_figures(tmp_path, monkeypatch):
    """The activation figure plots each table's stage-activations held per tick, the comm figure its
    gradient bytes per tick, one line per table, labelled with the method; in steady state (ticks
    8-15 for N = L = 4) the plotted cdp-v2 line is flat at N*L/2 = 8 while dp's climbs to N*L = 16,
    and dp sends its whole step's traffic, 2(N-1) x the model, in the step's last tick (15) where
    cdp-v2 spreads the same total over the period (rules written out here)."""
    from cdpjax.plotting import plot_activation, plot_comm
    from cdpjax.layouts.cdp import cdp_table

    figures = capture_figures(monkeypatch, plotting)
    tables = [cdp_table("dp", 4, 4), cdp_table("cdp-v2", 4, 4)]
    sizes = [1e6, 2e6, 3e6, 4e6]
    plot_activation(tables, str(tmp_path / "act.png"))
    plot_comm(tables, sizes, str(tmp_path / "comm.svg"))
    (_, act), (_, comm) = figures
    (dp_act, cdp_act), (dp_comm, cdp_comm) = line_data(act.axes[0]), line_data(comm.axes[0])
    for (x, y), t in zip((dp_act, cdp_act), tables):
        assert x == list(range(t.num_ticks)) and y == list(t.activation_total())
    for (x, y), t in zip((dp_comm, cdp_comm), tables):
        assert x == list(range(t.num_ticks)) and y == list(t.bytes_per_tick(sizes))
    assert cdp_act[1][8:16] == [8] * 8 and max(dp_act[1][8:16]) == 16
    total = 2 * (4 - 1) * sum(sizes)
    assert dp_comm[1][8:16] == [0.0] * 7 + [total]
    assert sum(cdp_comm[1][8:16]) == pytest.approx(total) and max(cdp_comm[1][8:16]) < total / 2
    labels = [t.get_text() for t in act.axes[0].get_legend().get_texts()]
    assert labels == ["dp (peak 16)", "cdp-v2 (peak 8)"]
    assert [t.get_text().split(" (")[0] for t in comm.axes[0].get_legend().get_texts()] == ["dp", "cdp-v2"]
    assert png_matches(tmp_path / "act.png", act)
    assert (tmp_path / "comm.svg").read_text().count("<path") > 2


@pytest.mark.parametrize("argv,match", [
    (["--workers", "3", "--stages", "4"], "choose workers in [1, 2, 4, 8]"),
    (["--workers", "0"], "workers=0"),
    (["--method", "gpipe", "--microbatches", "0"], "microbatches=0"),
    (["--out", "figure.pdf"], "must end in .png or .svg"),
])
def test_bad_sizes_exit_2(capsys, argv, match):
    rc, out, err = run(argv, capsys)
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and match in err and "Traceback" not in err


def test_entry_point_without_jax():
    """Through the `cdpjax` entry point, in a fresh process: instant, JAX never imported."""
    code = ("import sys; from cdpjax import cli; rc = cli.main(['schedule', '--workers', '2', '--stages', '2']); "
            "assert 'jax' not in sys.modules, 'schedule imported jax'; "
            "rc2 = cli.main(['schedule', '--workers', '3', '--stages', '2']); print('RC', rc, rc2)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "RC 0 2" in p.stdout and "F1" in p.stdout
    assert p.stderr.strip().count("\n") == 0 and "workers=3" in p.stderr
