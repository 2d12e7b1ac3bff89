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
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "RC 0 2" in p.stdout and "F1" in p.stdout
    assert p.stderr.strip().count("\n") == 0 and "workers=3" in p.stderr


# ------------------------------------------------------- W ops, placements, costs


def test_zb_h1_shows_w_ops(capsys):
    """`cdpjax schedule --method zb-h1 --stages 4 --microbatches 8`: every device row holds the W of
    each micro-batch once, after its B; --json says `kind: "W"` for K x M x steps ops."""
    rc, out, _ = run(["--method", "zb-h1", "--stages", "4", "--microbatches", "8"], capsys)
    assert rc == 0 and "W<m>" in out.splitlines()[1]
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line[:1] == "d"}
    for d in range(4):
        cells = [c for c in rows[f"d{d}"] if c != "."][:24]  # step 0
        assert sorted(c for c in cells if c[0] == "W") == sorted(f"W{m}" for m in range(8))
        assert all(cells.index(f"B{m}") < cells.index(f"W{m}") for m in range(8))
    # a device keeps a micro-batch's activation until its W: 1F1B's K - j on device j, ZB-H1's K on each
    assert "activation slots (stage-activations held, steady-state peak) per device: 4 4 4 4" in out
    assert "per device: 4 3 2 1" in run(["--method", "1f1b", "--stages", "4"], capsys)[1]
    rc, out, _ = run(["--method", "zb-h1", "--stages", "4", "--microbatches", "8", "--json"], capsys)
    d = json.loads(out)
    assert rc == 0 and sum(o["kind"] == "W" for o in d["ops"]) == 4 * 8 * d["steps"]


def _luminance(rgb):
    return 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]


def test_w_has_its_own_shade(tmp_path, capsys, monkeypatch):
    """In the diagram a micro-batch's F, B and W boxes share its hue in three shades, forward
    lightest, backward darkest, W between, and the legend says which shade is which."""
    from matplotlib.patches import Rectangle

    figures = capture_figures(monkeypatch, plotting)
    rc, _, _ = run(["--method", "zb-h1", "--stages", "2", "--microbatches", "4", "--steps", "1", "--out",
                    str(tmp_path / "zb.png")], capsys)
    (_, fig), = figures
    (ax,) = fig.axes
    texts = {(round(t.get_position()[0], 6), round(t.get_position()[1], 6)): t.get_text() for t in ax.texts}
    shade = collections.defaultdict(set)
    for r in ax.patches:
        if isinstance(r, Rectangle):
            label = texts[(round(r.get_x() + r.get_width() / 2, 6), round(r.get_y() + r.get_height() / 2, 6))]
            shade[label].add(tuple(round(c, 6) for c in r.get_facecolor()[:3]))
    for m in range(4):
        (f,), (b,), (w,) = shade[f"F{m}"], shade[f"B{m}"], shade[f"W{m}"]
        assert _luminance(f) > _luminance(w) > _luminance(b)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert {"forward (light)", "backward (dark)", "weight gradient (W)"} <= set(legend)
    assert rc == 0 and png_matches(tmp_path / "zb.png", fig)


@pytest.mark.parametrize("argv,labels", [
    (["--method", "zbv", "--stages", "4"], [(0, 0), (1, 1), (2, 1), (3, 0)]),  # the V: r and 2D-1-r
    (["--method", "interleaved-1f1b", "--stages", "4", "--chunks", "2"], [(0, 0), (1, 1), (2, 0), (3, 1)]),
    (["--method", "looped-bfs", "--stages", "6", "--chunks", "2"], [(0, 0), (1, 1), (2, 2), (3, 0), (4, 1), (5, 2)]),
    (["--method", "gpipe", "--stages", "3"], [(0, None), (1, None), (2, None)]),  # one stage a device, in order
])
def test_diagrams_say_which_device_holds_each_stage(tmp_path, capsys, monkeypatch, argv, labels):
    figures = capture_figures(monkeypatch, plotting)
    assert run([*argv, "--out", str(tmp_path / "t.svg")], capsys)[0] == 0
    (_, fig), = figures
    want = [f"stage {j}" + (f" (device {d})" if d is not None else "") for j, d in labels]
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == want


# 1F1B, K = 2, M = 4 (device 0: F0 F1 . B0 F2 B1 F3 B2 . B3; device 1: . F0 B0 F1 B1 F2 B2 F3 B3 .)
# with F = 1 and B = 2, by hand: ticks 0-1 hold forwards only (1 each), every later tick a
# backward (2 each): the ticks start at 0, 1, 2, 4, ..., 16 and the step ends at 18. One
# column a time unit, an op's cell then '-' while it runs, '.' idle:
ONE_F_ONE_B_IN_TIME = {
    "d0": "F0 F1 . . B0 - F2 . B1 - F3 . B2 - . . B3 -",
    "d1": ". F0 B0 - F1 . B1 - F2 . B2 - F3 . B3 - . .",
}


def test_costs_replay_the_table_in_time(tmp_path, capsys, monkeypatch):
    """`--costs F=1,B=2,W=1`: the table in time units under the lockstep model, and its step time:
    1F1B's 18 (written out above) against ZB-H1's 13, whose ticks all last 1 (B = 2 - W = 1), for
    the same work, 2 x 4 x 3 = 24 on one device."""
    sizes = ["--stages", "2", "--microbatches", "4", "--steps", "1", "--costs", "F=1,B=2,W=1"]
    rc, out, _ = run(["--method", "1f1b", *sizes], capsys)
    rows = {line.split()[0]: " ".join(line.split()[1:]) for line in out.splitlines() if line[:2] in ("d0", "d1")}
    assert rc == 0 and rows == ONE_F_ONE_B_IN_TIME
    assert "step time 18 " in out and "one device 24 " in out and "F=1,B=2,W=1" in out.splitlines()[0]
    rc, out, _ = run(["--method", "zb-h1", *sizes], capsys)
    assert rc == 0 and "step time 13 " in out and "devices busy 0.923" in out
    rc, out, _ = run(["--method", "1f1b", *sizes, "--json"], capsys)
    lockstep = json.loads(out)["lockstep"]
    assert lockstep["step_time"] == 18 and lockstep["model"] == "lockstep"
    assert lockstep["tick_starts"] == [0, 1, 2, 4, 6, 8, 10, 12, 14, 16, 18]
    figures = capture_figures(monkeypatch, plotting)
    assert run(["--method", "1f1b", *sizes, "--out", str(tmp_path / "t.png")], capsys)[0] == 0
    (_, fig), = figures
    from matplotlib.patches import Rectangle

    stage0 = sorted((r.get_x(), r.get_width()) for r in fig.axes[0].patches
                    if isinstance(r, Rectangle) and round(r.get_y() + r.get_height() / 2) == 0)
    assert stage0 == [(0, 1), (1, 1), (4, 2), (6, 1), (8, 2), (10, 1), (12, 2), (16, 2)]  # device 0's row above
    assert "time" in fig.axes[0].get_xlabel() and png_matches(tmp_path / "t.png", fig)


def test_pipeline_tables_default_to_the_configs_microbatches(capsys):
    """`cdpjax schedule --method 1f1b` lays out the config's default M (4), as does every layout that
    reads `config.microbatches`."""
    from cdpjax.config import default_config
    from cdpjax.layouts import LAYOUTS

    rc, out, _ = run(["--method", "1f1b"], capsys)
    assert rc == 0 and "M=4 micro-batches" in out
    for name, layout in LAYOUTS.items():
        if layout.microbatches:
            assert layout.table_sizes()["microbatches"] == default_config().microbatches, name
