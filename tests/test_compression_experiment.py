"""experiments/compression.py: the tiny grid runs end to end on digits and the character language
model, and int4 cuts each route's bytes by the codec's ratio: half a byte an element and a 4-byte
scale per 128 for 4 bytes an element, 4 / (1/2 + 4/128) (padding to whole blocks: within 1%)."""
import json
import math
import pathlib

import pytest

from helpers import load_script

ROOT = pathlib.Path(__file__).resolve().parents[1]
compression = load_script(ROOT / "experiments" / "compression.py", "experiments_compression")


def test_tiny_grid(tmp_path):
    assert compression.main(["--tiny", "--out", str(tmp_path), "--bandwidth", "1e9", "--repeats", "1"]) == 0
    runs = json.loads((tmp_path / "compression.json").read_text())["runs"]
    assert {(r["task"], r["route"], r["codec"]) for r in runs} == {
        (task, route, codec) for task in ("digits", "charlm") for route in compression.ROUTES
        for codec in ("none", "int4")}
    assert all(math.isfinite(r["test_loss"]) for r in runs)
    sent = {(r["task"], r["route"], r["codec"]): r["sent_bytes"] for r in runs}
    for task in ("digits", "charlm"):
        for route in compression.ROUTES:
            assert sent[task, route, "none"] / sent[task, route, "int4"] == pytest.approx(4 / (1 / 2 + 4 / 128),
                                                                                          rel=0.01)
    table = (tmp_path / "compression.md").read_text()
    assert table.count("\n") == 2 + len(runs) and "| charlm | ppll-activations | int4 | 1 |" in table
    # the target is read off charlm's ppll rows: int4 sends >= 4x fewer bytes
    assert "| charlm | ppll-activations | int4 | 1 |" in table and "(7.5" in table
    # the step times: every (task, route, codec) once; no codec is the uncompressed step itself
    steps = json.loads((tmp_path / "steps.json").read_text())
    assert {(t["task"], t["route"], t["codec"]) for t in steps} == {(r["task"], r["route"], r["codec"]) for r in runs}
    for t in steps:
        assert t["bandwidths"] == [1e9] and t["step_ratio"][0] > 0
        if t["codec"] == "none":
            assert t["step_ratio"] == [1.0]
    assert (tmp_path / "steps.md").read_text().count("\n") == 2 + len(steps)


def test_a_bad_bandwidth_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        compression.main(["--tiny", "--out", str(tmp_path), "--bandwidth", "0"])
    assert "--bandwidth 0.0 must be a positive number of bytes/s" in capsys.readouterr().err


def test_a_codec_outside_the_grid_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        compression.main(["--tiny", "--out", str(tmp_path), "--codecs", "int8"])
    assert "--codecs 'int8' is not a codec of this grid; its codecs: int4, none" in capsys.readouterr().err
