"""experiments/compression.py: the tiny grid runs end to end, and int8 cuts each route's bytes by
the codec's ratio: 1 byte an element and a 4-byte scale per 128 for 4 bytes an element,
4 / (1 + 4/128) (padding to whole blocks: within 1%)."""
import json
import math
import pathlib

import pytest

from helpers import load_script

ROOT = pathlib.Path(__file__).resolve().parents[1]
compression = load_script(ROOT / "experiments" / "compression.py", "experiments_compression")


def test_tiny_grid(tmp_path):
    assert compression.main(["--tiny", "--out", str(tmp_path)]) == 0
    runs = json.loads((tmp_path / "compression.json").read_text())["runs"]
    assert {(r["route"], r["codec"]) for r in runs} == {(route, codec) for route in compression.ROUTES
                                                         for codec in ("none", "int8")}
    assert all(math.isfinite(r["test_loss"]) for r in runs)
    sent = {(r["route"], r["codec"]): r["sent_bytes"] for r in runs}
    for route in compression.ROUTES:
        assert sent[route, "none"] / sent[route, "int8"] == pytest.approx(4 / (1 + 4 / 128), rel=0.01)
    table = (tmp_path / "compression.md").read_text()
    assert table.count("\n") == 2 + len(runs) and "| ppll-activations | int8 | 1 |" in table
