"""experiments/compression.py: the tiny grid runs end to end on digits and the character language
model, and int4 cuts each route's bytes by the codec's ratio: half a byte an element and a 4-byte
scale per 128 for 4 bytes an element, 4 / (1/2 + 4/128) (padding to whole blocks: within 1%).
The grid runs as docs/compression.md is regenerated (`--doc`): into a small doc with markers, its
tables written between them from the stored results and the prose left alone."""
import json
import math
import pathlib

import pytest

from helpers import load_script

ROOT = pathlib.Path(__file__).resolve().parents[1]
compression = load_script(ROOT / "experiments" / "compression.py", "experiments_compression")

PROSE_BEFORE = "# A doc\n\nProse before the table, left as it is.\n\n"
PROSE_BETWEEN = "\nProse between the tables.\n\n"
PROSE_AFTER = "\nProse after, with a marker-like `<!-- compression -->` that is no marker.\n"
DOC = (PROSE_BEFORE + "<!-- compression:tiny -->\nan old table\n<!-- /compression -->\n" + PROSE_BETWEEN
       + "<!-- compression-steps:tiny -->\n<!-- /compression -->\n" + PROSE_AFTER)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny grid trained through `--doc` (its results in OUT/tiny), and the doc it wrote."""
    tmp = tmp_path_factory.mktemp("compression")
    doc = tmp / "doc.md"
    doc.write_text(DOC)
    argv = ["--doc", str(doc), "--out", str(tmp / "out"), "--bandwidth", "1e9", "--repeats", "1"]
    assert compression.main(argv) == 0
    return tmp / "out" / "tiny", doc, argv


def test_tiny_grid(tiny):
    out = tiny[0]
    runs = json.loads((out / "compression.json").read_text())["runs"]
    assert {(r["task"], r["route"], r["codec"]) for r in runs} == {
        (task, route, codec) for task in ("digits", "charlm") for route in compression.ROUTES
        for codec in ("none", "int4")}
    assert all(math.isfinite(r["test_loss"]) for r in runs)
    sent = {(r["task"], r["route"], r["codec"]): r["sent_bytes"] for r in runs}
    for task in ("digits", "charlm"):
        for route in compression.ROUTES:
            assert sent[task, route, "none"] / sent[task, route, "int4"] == pytest.approx(4 / (1 / 2 + 4 / 128),
                                                                                          rel=0.01)
    table = (out / "compression.md").read_text()
    assert table.count("\n") == 2 + len(runs) and "| charlm | ppll-activations | int4 | 1 |" in table
    # the target is read off charlm's ppll rows: int4 sends >= 4x fewer bytes
    assert "| charlm | ppll-activations | int4 | 1 |" in table and "(7.5" in table
    # the step times: every (task, route, codec) once; no codec is the uncompressed step itself
    steps = json.loads((out / "steps.json").read_text())
    assert {(t["task"], t["route"], t["codec"]) for t in steps} == {(r["task"], r["route"], r["codec"]) for r in runs}
    for t in steps:
        assert t["bandwidths"] == [1e9] and t["step_ratio"][0] > 0
        if t["codec"] == "none":
            assert t["step_ratio"] == [1.0]
    assert (out / "steps.md").read_text().count("\n") == 2 + len(steps)


def test_the_doc_gets_its_tables_between_the_markers_and_keeps_its_prose(tiny):
    out, doc, _ = tiny
    text = doc.read_text()
    losses, steps = (out / "compression.md").read_text(), (out / "steps.md").read_text()
    assert text == (PROSE_BEFORE + "<!-- compression:tiny -->\n\n" + losses + "\n<!-- /compression -->\n"
                    + PROSE_BETWEEN + "<!-- compression-steps:tiny -->\n\n" + steps + "\n<!-- /compression -->\n"
                    + PROSE_AFTER)
    # a row's figures are the stored runs' (one seed: its own values, no spread), written out here
    runs = json.loads((out / "compression.json").read_text())["runs"]
    (none,) = [r for r in runs if (r["task"], r["route"], r["codec"]) == ("digits", "ring-gradients", "none")]
    (int4,) = [r for r in runs if (r["task"], r["route"], r["codec"]) == ("digits", "ring-gradients", "int4")]
    row = (f"| digits | ring-gradients | int4 | 1 | {round(int4['sent_bytes']):,} | "
           f"{none['sent_bytes'] / int4['sent_bytes']:.2f} | {int4['test_loss']:.4f} ± 0.0000 | "
           f"{int4['test_accuracy']:.4f} ± 0.0000 | - |")
    assert row in text.splitlines()
    (step,) = [t for t in json.loads((out / "steps.json").read_text())
               if (t["task"], t["route"], t["codec"]) == ("charlm", "ppll-activations", "int4")]
    assert f"| charlm | ppll-activations | int4 | {step['step_ratio'][0]:.3f} |" in text


def test_a_second_doc_run_trains_nothing_and_leaves_the_doc_byte_equal(tiny, monkeypatch):
    _, doc, argv = tiny
    before = doc.read_bytes()

    def refuse(*args):
        raise AssertionError(f"trained or measured again: {args}")

    monkeypatch.setattr(compression, "train_one", refuse)
    monkeypatch.setattr(compression, "step_times", refuse)
    assert compression.main(argv) == 0
    assert doc.read_bytes() == before


def test_a_doc_marker_naming_no_grid_is_refused(tmp_path, capsys):
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- compression:nonesuch -->\n<!-- /compression -->\n")
    with pytest.raises(SystemExit):
        compression.main(["--doc", str(doc), "--out", str(tmp_path)])
    assert "marker grid 'nonesuch' is not one of charlm, digits, tiny" in capsys.readouterr().err


def test_a_grid_named_beside_a_doc_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        compression.main(["--doc", str(tmp_path / "doc.md"), "--grid", "digits", "--out", str(tmp_path)])
    assert "--doc with --grid digits: the doc's markers name its grids" in capsys.readouterr().err


def test_a_bad_bandwidth_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        compression.main(["--tiny", "--out", str(tmp_path), "--bandwidth", "0"])
    assert "--bandwidth 0.0 must be a positive number of bytes/s" in capsys.readouterr().err


def test_a_codec_outside_the_grid_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        compression.main(["--tiny", "--out", str(tmp_path), "--codecs", "int8"])
    assert "--codecs 'int8' is not a codec of this grid; its codecs: int4, none" in capsys.readouterr().err
