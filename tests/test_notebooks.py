"""Every notebook in colab/ runs top to bottom on its tiny config in a real Jupyter kernel,
without touching the network, and writes and shows the figures it reproduces."""
import importlib.util
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = pathlib.Path(__file__).resolve().parents[1]
COLAB = ROOT / "colab"
CELL_TIMEOUT_S = 240

# The figure files each notebook must write (its paper figures).
FIGURES = {
    "cdp_timing_diagrams.ipynb": [
        *(f"timing_{m}_N{n}_L4.png" for m in ("dp", "cdp-v1", "cdp-v2") for n in (4, 8)),
        "staleness_cdp-v2_N8_L4.png", "timing_ppll_K4.png", "timing_gpipe_K4_M4.png",
    ],
    "cdp_memory_and_communication.ipynb": [
        "activation_over_time.png", "activation_bytes_over_time.png", "comm_per_tick.png",
        "measured_memory_and_collectives.png",
    ],
    "cdp_accuracy.ipynb": ["cdp_accuracy.png"],
    "ppll_vs_local_gpipe.ipynb": ["ppll_speedup.png", "ppll_accuracy.png"],
}


def _generator():
    spec = importlib.util.spec_from_file_location("make_notebooks", COLAB / "make_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_notebook_is_checked():
    assert sorted(p.name for p in COLAB.glob("*.ipynb")) == sorted(FIGURES)


def test_notebooks_match_their_generator():
    """The committed notebooks are what colab/make_notebooks.py writes (no hand edits, no outputs)."""
    gen = _generator()
    for make in gen.NOTEBOOKS:
        name, expected = gen.build(make)
        on_disk = nbformat.read(COLAB / name, as_version=4)
        assert [c.source for c in on_disk.cells] == [c.source for c in expected.cells], name
        assert all(not c.get("outputs") for c in on_disk.cells if c.cell_type == "code"), name


def test_first_cell_installs_only_where_cdpjax_is_missing():
    for name in FIGURES:
        first = next(c for c in nbformat.read(COLAB / name, as_version=4).cells if c.cell_type == "code")
        assert 'find_spec("cdpjax") is None' in first.source, name
        assert '%pip install -q "cdpjax @ git+https://github.com/' in first.source, name


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_notebook_runs_on_tiny_config(name, tmp_path, monkeypatch):
    figures = tmp_path / "figures"
    monkeypatch.setenv("CDPJAX_TINY", "1")
    monkeypatch.setenv("CDPJAX_FIGURES", str(figures))
    monkeypatch.setenv("CDPJAX_REPO", str(ROOT))  # configs from this checkout, not from GitHub
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # a pip install that should not happen cannot download either
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(COLAB / name, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError naming the cell that failed

    code = [c for c in nb.cells if c.cell_type == "code"]
    assert not code[0].outputs, "the install cell ran: cdpjax was not importable in the kernel"
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors
    setup = "".join(o.get("text", "") for o in code[1].outputs)
    assert "the tiny config" in setup and "8 cpu device(s)" in setup
    expected = list(FIGURES[name])
    from cdpjax import methods

    if name == "cdp_timing_diagrams.ipynb" and "cdp-mp" in methods.REGISTRY:
        expected.append("timing_cdp-mp_N4_L4.png")
    for f in expected:
        path = figures / f
        assert path.is_file() and path.stat().st_size > 1000, f"{name} did not write {f}"
    shown = sum("image/png" in o.get("data", {}) for c in code for o in c.outputs)
    assert shown >= len(expected), f"{name} showed {shown} figures"
