"""experiments/delays.py: the tiny grid runs end to end; a correction that is the identity at tau = 0
(staleness-lr: every factor 1 / (1 + 0)) gives dp's row exactly, and the delay is felt."""
import json
import pathlib

import pytest
from helpers import load_script

ROOT = pathlib.Path(__file__).resolve().parents[1]
delays = load_script(ROOT / "experiments" / "delays.py", "experiments_delays")


def test_delay_for_sets_the_nominal_mean():
    # uniform on {0..2 tau}: mean tau; geometric p = 1 / (1 + tau): mean (1 - p) / p = tau before the bound
    assert delays.delay_for("uniform-tau", 4) == {"model": "uniform-tau", "tau_max": 8}
    assert delays.delay_for("geometric", 1)["p"] == 0.5
    assert delays.delay_for("per-stage", 2)["taus"] == (2,) * delays.STAGES
    assert all(delays.delay_for(m, 0).get("tau_max", 0) == 0 for m in delays.MODELS)


def test_tiny_grid_runs(tmp_path):
    figure = tmp_path / "d.png"
    assert delays.main(["--tiny", "--out", str(tmp_path), "--figure", str(figure)]) == 0
    runs = json.loads((tmp_path / "delays.json").read_text())["runs"]
    assert len(runs) == 4 and figure.stat().st_size > 1000
    by = {(r["tau"], r["correction"]): r for r in runs}
    assert by[(0, "none")]["test_loss"] == by[(0, "staleness-lr")]["test_loss"]
    assert by[(0, "none")]["mean_tau"] == 0 and 1.5 < by[(2, "none")]["mean_tau"] < 2.5
    assert by[(2, "none")]["test_loss"] != by[(0, "none")]["test_loss"]
    table = (tmp_path / "delays.md").read_text()
    assert table.count("| digits |") == 4 and "dp (tau = 0)" in table


def test_docs_writes_each_figure_from_its_grids_runs_and_retrains_nothing_stored(tmp_path, monkeypatch):
    """`--docs`: each (grid, figure) of DOC_FIGURES from OUT/GRID's runs; called again, every row is
    stored, so nothing trains (train_one made to fail) and the runs are the same."""
    figure = tmp_path / "fig.png"
    monkeypatch.setattr(delays, "DOC_FIGURES", (("tiny", str(figure)),))
    assert delays.main(["--docs", "--out", str(tmp_path)]) == 0
    first = json.loads((tmp_path / "tiny" / "delays.json").read_text())["runs"]
    assert len(first) == 4 and figure.stat().st_size > 1000
    figure.unlink()

    def no_training(*args):
        raise AssertionError(f"trained {args} again")

    monkeypatch.setattr(delays, "train_one", no_training)
    assert delays.main(["--docs", "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "tiny" / "delays.json").read_text())["runs"] == first
    assert figure.stat().st_size > 1000


def test_docs_starts_from_the_runs_kept_beside_a_figure(tmp_path, monkeypatch):
    """`--docs` where OUT/GRID holds no runs but the figure's runs are kept beside it
    (`FIGURE.runs.jsonl`): it trains nothing (train_one made to fail) and writes the figure and the
    table from exactly the kept runs; rows it lacks are trained (one dropped: trained once)."""
    made = tmp_path / "made"
    figure = tmp_path / "figures" / "tiny.png"
    figure.parent.mkdir()
    monkeypatch.setattr(delays, "DOC_FIGURES", (("tiny", str(figure)),))
    assert delays.main(["--docs", "--out", str(made)]) == 0
    kept = figure.parent / "tiny.runs.jsonl"
    assert delays.kept_runs(figure) == kept
    lines = (made / "tiny" / "runs.jsonl").read_text().splitlines()
    kept.write_text("\n".join(lines[:-1]) + "\n")
    trained = []
    real = delays.train_one
    monkeypatch.setattr(delays, "train_one", lambda *row: trained.append(row) or real(*row))
    again = tmp_path / "again"
    assert delays.main(["--docs", "--out", str(again)]) == 0
    assert len(trained) == 1 and trained[0][:5] == tuple(json.loads(lines[-1])[k] for k in (
        "task", "model", "tau", "correction", "seed"))
    runs = json.loads((again / "tiny" / "delays.json").read_text())["runs"]
    assert runs == json.loads((made / "tiny" / "delays.json").read_text())["runs"]


def test_parts_share_one_out_and_train_each_row_once(tmp_path, monkeypatch):
    """`--part I/N`: part I trains rows I, I + N, ... of the grid's order (counted here from the
    grid's own loops: tau = 0 rows first, then model by model) into one OUT; the whole grid's
    --resume call afterwards trains nothing and holds every row once."""
    trained = []

    def fake(task, model, tau, correction, seed, steps):
        trained.append((task, model, tau, correction, seed))
        return delays.Run(task, model, tau, correction, seed, float(tau), 1.0 + tau, 0.5, 0, 0)

    monkeypatch.setattr(delays, "train_one", fake)
    grid = ["--tiny", "--out", str(tmp_path), "--resume"]
    # tiny: digits, uniform-tau, taus (0, 2), corrections (none, staleness-lr), seed 0
    order = [("digits", "uniform-tau", 0, "none", 0), ("digits", "uniform-tau", 0, "staleness-lr", 0),
             ("digits", "uniform-tau", 2, "none", 0), ("digits", "uniform-tau", 2, "staleness-lr", 0)]
    assert delays.main(grid + ["--part", "1/2"]) == 0
    assert trained == order[1::2] and not (tmp_path / "delays.json").exists()
    assert delays.main(grid + ["--part", "0/2"]) == 0
    assert trained == order[1::2] + order[0::2]
    assert delays.main(grid) == 0
    assert len(trained) == 4
    runs = json.loads((tmp_path / "delays.json").read_text())["runs"]
    assert sorted(tuple(r[k] for k in ("task", "model", "tau", "correction", "seed")) for r in runs) == sorted(order)


def test_part_refuses_a_bad_share(tmp_path, capsys):
    for flags in (["--part", "2/2", "--resume"], ["--part", "x", "--resume"], ["--part", "0/2"]):
        with pytest.raises(SystemExit):
            delays.main(["--tiny", "--out", str(tmp_path)] + flags)
        assert "--part" in capsys.readouterr().err
    assert not (tmp_path / "runs.jsonl").exists()
