"""experiments/readme_figures.py regenerates the README's measured tables and checks their bounds:
its tiny run works end to end and its exact bounds hold (the timing ones are checked on the
README's sizes, by the script itself)."""
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_tiny_pipelines_figure(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "experiments" / "readme_figures.py"), "--tiny", "--only",
                           "pipelines", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((tmp_path / "pipelines.json").read_text())
    markdown = (tmp_path / "pipelines.md").read_text()
    assert markdown in done.stdout
    records = record["records"]
    assert set(records) == {"gpipe", "1f1b", "interleaved-1f1b"}
    # the slots column is the program's: GPipe keeps M = 8, 1F1B min(M, K) = 4 (rules, not outputs)
    slots_row = [line for line in markdown.splitlines() if line.startswith("| activation slots")][0]
    assert [c.strip() for c in slots_row.strip("|").split("|")][1:3] == ["8", "4"]
    assert all(b["holds"] for b in record["bounds"] if not b["timing"])
