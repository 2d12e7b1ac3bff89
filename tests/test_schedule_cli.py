"""`cdpjax schedule`: the text grid, --json, --out figures, and bad sizes (exit 2, one line)."""
import json
import subprocess
import sys

import pytest

from cdpjax.commands import schedule


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
    assert sum(map(sum, d["stale"])) == 16
    assert d["busy_fraction"]["overall"] == 1.0


@pytest.mark.parametrize("suffix,magic", [(".png", b"\x89PNG"), (".svg", b"<svg")])
def test_out_writes_figure(tmp_path, capsys, suffix, magic):
    for method, sizes in (("cdp-v2", ["--workers", "8"]), ("dp", ["--workers", "8"]), ("gpipe", [])):
        path = tmp_path / f"{method}{suffix}"
        rc, out, _ = run(["--method", method, *sizes, "--stages", "4", "--out", str(path)], capsys)
        assert rc == 0 and str(path) in out
        data = path.read_bytes()
        assert len(data) > 1000 and magic in data[:400]


def test_activation_and_comm_figures(tmp_path):
    from cdpjax.plotting import plot_activation, plot_comm
    from cdpjax.layouts.cdp import cdp_table

    tables = [cdp_table("dp", 4, 4), cdp_table("cdp-v2", 4, 4)]
    for path in (plot_activation(tables, str(tmp_path / "act.png")),
                 plot_comm(tables, [1e6] * 4, str(tmp_path / "comm.svg"))):
        assert (tmp_path / path.split("/")[-1]).stat().st_size > 1000


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
