"""experiments/lm_heads.py: the tiny comparison of language-model heads runs end to end; its table has
one row per method and head, every final loss beats the corpus' unigram entropy, e2e's beats the
uniform guess, the heads' FLOPs are those of their layers, and the equal-FLOPs reading interpolates."""
import collections
import json
import math
import pathlib

import pytest

from helpers import load_script

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "lm_heads.py"
CORPUS = ROOT / "cdpjax" / "data" / "coriolanus.txt"
ROWS = ["e2e", "1f1b", "ppll token_linear", "ppll token_output", "ppll token_output depth 1"]
# charlm's sizes, written out: batch 64 windows of 32 tokens, 64 wide, 4 stages (3 local heads), 61 symbols
BATCH, WINDOW, WIDTH, LOCAL_HEADS, VOCAB = 64, 32, 64, 3, 61


lm_heads = load_script(SCRIPT, "experiments_lm_heads")


def unigram_entropy(text: str) -> float:
    """Nats per character of the best model that ignores context: the characters' own frequencies."""
    n = len(text)
    return -sum(c / n * math.log(c / n) for c in collections.Counter(text).values())


def _table(markdown: str) -> tuple[list[str], list[list[str]]]:
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in markdown.splitlines() if line.startswith("|")]
    return cells[0], cells[2:]


def test_loss_at_step_interpolates_between_evaluations():
    run = lm_heads.Run("x", 0, (10, 20, 30), (3.0, 2.0, 1.5), 1.0)
    assert lm_heads.loss_at_step(run, 15) == pytest.approx(2.5)  # halfway from 3.0 to 2.0
    assert lm_heads.loss_at_step(run, 26) == pytest.approx(2.0 - 0.5 * 0.6)
    assert lm_heads.loss_at_step(run, 30) == 1.5 and lm_heads.loss_at_step(run, 5) == 3.0


@pytest.mark.heavy  # five programs compiled and trained: about 7 minutes on 2 busy cores
def test_tiny_comparison_runs_and_its_numbers_hold(tmp_path, capsys):
    figure = tmp_path / "copy.png"
    assert lm_heads.main(["--tiny", "--out", str(tmp_path), "--figure", str(figure)]) == 0
    markdown = (tmp_path / "lm_heads.md").read_text()
    assert markdown in capsys.readouterr().out
    header, body = _table(markdown)
    assert len(header) == 8 and header[0] == "method (head)"
    assert [r[0] for r in body] == ROWS and all(r[1] == "1" for r in body)
    assert (tmp_path / "lm_heads.png").stat().st_size > 0 and figure.stat().st_size > 0

    result = json.loads((tmp_path / "lm_heads.json").read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    steps = lm_heads.TINY["steps"]
    assert result["steps"] == steps and len(result["runs"]) == len(ROWS)
    # every run ends below the unigram entropy of the text (about 3.29 nats): it learnt context
    bound = unigram_entropy(CORPUS.read_text())
    assert 3.0 < bound < math.log(VOCAB)
    assert all(r["final"][0] < bound for r in rows.values()), (bound, markdown)
    assert rows["e2e"]["final"][0] < math.log(VOCAB)  # the untrained network's loss is about uniform's
    # 1f1b is e2e's update rule: the same losses; neither has heads
    assert rows["1f1b"]["final"][0] == pytest.approx(rows["e2e"]["final"][0], abs=1e-4)
    assert rows["e2e"]["flops_ratio"] == 1.0 and rows["1f1b"]["flops_ratio"] == pytest.approx(1.0)
    # token_linear's FLOPs: each of the 3 heads is one [T, D] x [D, V] product and a bias per token,
    # forward and backward (3x) on every example of the batch
    head = 2 * WINDOW * WIDTH * VOCAB + WINDOW * VOCAB
    extra = rows["ppll token_linear"]["flops_per_step"] - rows["e2e"]["flops_per_step"]
    assert extra == pytest.approx(3 * BATCH * LOCAL_HEADS * head, rel=0.02)
    # heads cost: the private block makes a head dearer than the bare output head, itself dearer than a Dense
    ratios = [rows[name]["flops_ratio"] for name in ROWS[2:]]
    assert 1.0 < ratios[0] < ratios[1] < ratios[2]
    for r in rows.values():  # the equal-FLOPs reading is taken where the row's FLOPs reach e2e's total
        assert r["step_at_equal_flops"] == pytest.approx(steps / r["flops_ratio"])
        assert r["gap_steps"] == pytest.approx(r["final"][0] - rows["e2e"]["final"][0])
