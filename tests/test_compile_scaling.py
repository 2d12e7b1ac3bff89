"""experiments/compile_scaling.py: a method's time ratios are to dp measured right after its own point
(the same moment's load), not to the dp row's points measured minutes before."""
import json
import pathlib

from helpers import load_script

ROOT = pathlib.Path(__file__).resolve().parents[1]
compile_scaling = load_script(ROOT / "experiments" / "compile_scaling.py", "experiments_compile_scaling")


def test_ratios_are_to_dp_measured_beside_each_point(tmp_path, monkeypatch, capsys):
    # dp's first points ran on a quiet machine (1 s), the load then doubled every time
    calls = []

    def fake_point(method, devices, stages, timeout):
        calls.append(method)
        seconds = 2.0 ** (len(calls) - 1)
        return {"lowering_s": seconds, "compile_s": seconds, "hlo": 100 if method == "dp" else 300}

    monkeypatch.setattr(compile_scaling, "run_point", fake_point)
    compile_scaling.main(["--methods", "dp,ring", "--devices", "2", "--stages", "4", "--json",
                          str(tmp_path / "r.json")])
    # dp 1 s, ring 2 s, dp beside it 4 s: the ring's ratio is 2 / 4, not 2 / 1
    assert calls == ["dp", "ring", "dp"]
    assert "| ring | 300 / 0.5x / 0.5x |" in capsys.readouterr().out
    ring = [r for r in json.loads((tmp_path / "r.json").read_text()) if r["method"] == "ring"][0]
    assert ring["dp_beside"]["compile_s"] == 4.0
    calls.clear()
    compile_scaling.main(["--methods", "dp,ring", "--devices", "2", "--stages", "4", "--dp-once"])
    assert calls == ["dp", "ring"] and "| ring | 300 / 2.0x / 2.0x |" in capsys.readouterr().out
