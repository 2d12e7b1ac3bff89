"""Every notebook in colab/ runs top to bottom on its tiny config in a real Jupyter kernel,
without touching the network, and writes and shows the figures it reproduces; what each figure
draws (read back from its artists in the kernel) is checked against rules written out here and
the runs' own files."""
import importlib.util
import json
import pathlib
import textwrap

import numpy as np
import pytest

from helpers import cdp_rule

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
    "cdp_delays.ipynb": ["cdp_delays.png"],
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
    """The repository in one variable at the top, printed; the install from it only where cdpjax is not
    importable, with the CUDA extra only where an NVIDIA device is (a CPU runtime would download
    gigabytes of CUDA wheels for nothing); then the check that no loaded module went stale."""
    gen = _generator()
    for name in FIGURES:
        first = next(c for c in nbformat.read(COLAB / name, as_version=4).cells if c.cell_type == "code")
        lines = [line.strip() for line in first.source.splitlines() if line and not line.startswith("#")]
        assert lines[0].startswith('REPOSITORY = "https://github.com/'), name
        assert lines[1] == 'print(f"cdpjax from {REPOSITORY}")', name
        assert 'find_spec("cdpjax") is None' in first.source, name
        pip = lines.index('%pip install -q "cdpjax{EXTRA} @ git+{REPOSITORY}"')
        assert lines[pip - 1] == 'EXTRA = "[cuda12]" if os.path.exists("/dev/nvidia0") else ""', name
        assert gen.RESTART_RULE in textwrap.dedent(first.source.split("%pip install", 1)[1].split("\n", 1)[1]), name


def _install_rule():
    namespace = {}
    exec(_generator().RESTART_RULE, namespace)
    return namespace["after_install"]


def test_install_restarts_where_pip_replaced_a_loaded_module():
    """Hand cases: a module imported before the install (Colab preloads numpy) whose version on disk is
    now another makes the cell restart Colab's runtime, or elsewhere stop with one line asking for the
    restart (a module loaded without a version counts as replaced); nothing loaded, the same versions,
    or a module pip does not know leave it going on."""
    after_install = _install_rule()
    said = "pip replaced modules this kernel had loaded (numpy 2.1.3 -> 2.2.6)"
    assert after_install({"numpy": "2.1.3"}, {"numpy": "2.2.6"}, in_colab=True) == \
        ("restart", f"{said}: restarting the runtime; then run all again")
    assert after_install({"numpy": "2.1.3"}, {"numpy": "2.2.6"}, in_colab=False) == \
        ("stop", f"{said}: restart the kernel, then run all")
    both = after_install({"numpy": "2.1.3", "jax": "0.7.2", "scipy": "1.16.1"},
                         {"numpy": "2.2.6", "jax": "0.10.2", "scipy": "1.16.1"}, in_colab=True)
    assert both == ("restart", "pip replaced modules this kernel had loaded (jax 0.7.2 -> 0.10.2, "
                               "numpy 2.1.3 -> 2.2.6): restarting the runtime; then run all again")
    # a module loaded without a version may be the old one: replaced, said so
    assert after_install({"scipy": None}, {"scipy": "1.16.1"}, in_colab=False) == \
        ("stop", "pip replaced modules this kernel had loaded (scipy (version unknown) -> 1.16.1): restart the "
                 "kernel, then run all")
    unchanged = (({}, {}), ({"numpy": "2.1.3"}, {"numpy": "2.1.3"}), ({"numpy": "2.1.3"}, {"numpy": None}))
    for loaded, installed in unchanged:
        for in_colab in (True, False):
            assert after_install(loaded, installed, in_colab) == ("go on", ""), (loaded, installed)


def test_install_cell_stops_outside_colab_on_a_stale_module(monkeypatch):
    """The install cell's code after pip, as the notebook holds it, with a numpy in memory older than the
    one on disk and no google.colab: one-line SystemExit, no restart."""
    import importlib.metadata
    import sys
    import types

    first = next(c for c in nbformat.read(COLAB / "cdp_accuracy.ipynb", as_version=4).cells if c.cell_type == "code")
    body = textwrap.dedent(first.source.split('find_spec("cdpjax") is None', 1)[1].split("\n", 1)[1])
    body = "\n".join(line for line in body.splitlines() if not line.startswith("%pip"))
    monkeypatch.setitem(sys.modules, "numpy", types.SimpleNamespace(__version__="1.0.0"))
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    monkeypatch.delenv("COLAB_RELEASE_TAG", raising=False)
    with pytest.raises(SystemExit) as stop:
        exec(body, {"REPOSITORY": "unused"})
    on_disk = importlib.metadata.version("numpy")
    assert str(stop.value) == (f"pip replaced modules this kernel had loaded (numpy 1.0.0 -> {on_disk}): "
                               f"restart the kernel, then run all")


@pytest.mark.parametrize("name", ["cdp_accuracy.ipynb", "ppll_vs_local_gpipe.ipynb"])
def test_cifar_is_prepared_in_a_process_without_the_gpu(name, monkeypatch):
    """The notebooks that train on CIFAR-10 prepare it in another Python process whose CUDA devices are
    hidden (TensorFlow's CUDA never loads into the kernel that runs jax on the GPU), only for the
    GPU-sized config, and stop with one line where that fails. subprocess.run is stood in for: an
    offline tensorflow-datasets call hangs."""
    import os
    import subprocess
    import sys

    gen = _generator()
    cells = [c.source for c in nbformat.read(COLAB / name, as_version=4).cells if c.cell_type == "code"]
    assert gen.PREPARE_CIFAR in cells
    calls = []

    def run(command, env=None, **kwargs):
        calls.append((command, env))
        return subprocess.CompletedProcess(command, returncode, "", stderr)

    monkeypatch.setattr(subprocess, "run", run)
    before = set(sys.modules)
    returncode, stderr = 0, ""
    exec(gen.PREPARE_CIFAR, {"TINY": True, "os": os})
    assert calls == []
    exec(gen.PREPARE_CIFAR, {"TINY": False, "os": os})
    ((command, env),) = calls
    assert command[:2] == [sys.executable, "-c"] and env["CUDA_VISIBLE_DEVICES"] == ""
    compile(command[2], "prepare", "exec")
    assert "tfds.builder('cifar10')" in command[2] and "download_and_prepare(file_format='array_record')" in command[2]
    assert not {m for m in set(sys.modules) - before if m.startswith(("tensorflow", "tensorflow_datasets"))}
    returncode, stderr = 1, "Traceback (most recent call last):\n...\nConnectionError: no route to host\n"
    with pytest.raises(SystemExit) as stop:
        exec(gen.PREPARE_CIFAR, {"TINY": False, "os": os})
    assert str(stop.value) == "CIFAR-10 could not be prepared (internet needed): ConnectionError: no route to host"


def test_notebooks_that_train_put_their_runs_where_the_runs_cell_says(tmp_path, monkeypatch):
    """The notebooks that train write and read their runs under RUNS, set in one cell after the set-up
    cell (runs/ by default, $CDPJAX_RUNS, or Google Drive where chosen: Colab wipes /content with the
    runtime); no other cell names a runs folder of its own."""
    import os

    gen = _generator()
    for name in ("cdp_accuracy.ipynb", "cdp_delays.ipynb", "ppll_vs_local_gpipe.ipynb"):
        cells = [c.source for c in nbformat.read(COLAB / name, as_version=4).cells if c.cell_type == "code"]
        assert cells.index(gen.RUNS_CELL) == cells.index(gen.SETUP) + 1, name
        others = [c for c in cells if c != gen.RUNS_CELL]
        assert not any('"runs"' in c for c in others), name
        assert any("os.path.join(RUNS, " in c and "train.train(" in c for c in others), name
    monkeypatch.setenv("CDPJAX_RUNS", str(tmp_path / "kept"))
    namespace = {"os": os}
    exec(gen.RUNS_CELL, namespace)
    assert namespace["RUNS"] == str(tmp_path / "kept") and (tmp_path / "kept").is_dir()


# Runs in a subprocess with DEVICES simulated CPU devices (the tests' own process has 8): each
# training notebook's config cells, as the notebook holds them, after a stand-in for its set-up cell
# (TINY chosen or not, an accelerator assumed); prints, per notebook and config size, the runs its
# PLAN holds with the devices each is given. With "setup", every planned run also goes through
# `setup.setup` (validation, mesh, method build; nothing compiled), CIFAR-10 swapped for random
# images of its shapes (an offline tensorflow-datasets load hangs).
PLAN_PROBE = """
import json, os, sys
import jax
import nbformat

jax.config.update("jax_num_cpu_devices", int(os.environ["DEVICES"]))
from cdpjax import setup as setup_lib

out = {}
for path in sys.argv[1:]:
    cells = [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    for size in ("tiny", "gpu"):
        ns = {"os": os, "jax": jax, "TINY": size == "tiny", "ACCELERATOR": True}
        for source in cells:
            if "def devices_for(" in source or "PLAN = " in source:
                exec(source, ns)
        runs = out.setdefault(os.path.basename(path), {})[size] = {}
        for name, config in ns["PLAN"].items():
            devices = ns["devices_for"](config)
            runs[name] = len(devices)
            if os.environ.get("SETUP") and devices:
                if config.dataset == "cifar10":
                    config.dataset = "synthetic"
                    config.dataset_kwargs = {"image_shape": (32, 32, 3), "num_classes": 10}
                    if config.get("aux_kwargs") and config.aux_kwargs.get("reconstruction"):
                        # random images carry no pixel statistics, which the decoder's target needs
                        config.aux_kwargs.update(pixel_mean=(0.5,) * 3, pixel_std=(0.25,) * 3)
                setup_lib.setup(config, devices)
print(json.dumps(out))
"""
TRAINING_NOTEBOOKS = ("cdp_memory_and_communication.ipynb", "cdp_accuracy.ipynb", "cdp_delays.ipynb",
                      "ppll_vs_local_gpipe.ipynb")


def _plans(devices: int, setup: bool = False) -> dict:
    import os
    import subprocess
    import sys

    env = {**os.environ, "DEVICES": str(devices), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "PYTHONPATH": str(ROOT)}
    env.pop("SETUP", None)
    if setup:
        env["SETUP"] = "1"
    proc = subprocess.run([sys.executable, "-c", PLAN_PROBE, *(str(COLAB / n) for n in TRAINING_NOTEBOOKS)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def _expected_plan(name: str, size: str, n: int) -> dict:
    """The runs a notebook trains (or, for the memory notebook, compiles) on n devices, and the devices
    each gets, by the notebooks' rules: a data-parallel mesh with a -1 axis takes every device; a
    method run as `cdp_impl='simulate'` on `{'data': 1}` takes one; gpipe needs its K = 4 stage devices
    (skipped below 4); ppll's GPU-sized config groups its K = 4 modules on min(K, n) devices, the tiny
    one does not (4 stage devices, skipped below 4)."""
    K = 4
    if name == "cdp_memory_and_communication.ipynb":  # the ring of 8 workers is simulated below 8 devices
        return {"dp": n, "cdp-v2": n if size == "tiny" or n >= 8 else 1}
    if name == "cdp_accuracy.ipynb":
        return {m: n for m in ("dp", "cdp-v1", "cdp-v2")}
    if name == "cdp_delays.ipynb":  # 4 workers on 4 stages simulated on one device, every run
        models, taus, corrections = ((("uniform-tau",), (0, 2), ("none", "staleness-lr")) if size == "tiny" else
                                     (("uniform-tau", "geometric"), (0, 1, 2, 4, 8),
                                      ("none", "staleness-lr", "dc-asgd", "pipenag")))
        return {f"{m}-tau{t}-{c}": 1 for m in models for t in taus for c in corrections}
    plan = {"e2e": n, "local": n}
    if size == "gpu":
        plan["ppll"] = min(K, n) * (n // min(K, n))
    elif n >= K:
        plan["ppll"] = n // K * K
    if n >= K:
        plan["gpipe"] = n // K * K
    return plan


@pytest.mark.parametrize("devices", [1, pytest.param(2, marks=pytest.mark.heavy)])  # 1: Colab's one GPU
def test_notebooks_train_only_what_fits_the_devices_there_are(devices):
    """Colab's GPU runtime has one GPU: each training notebook, on its GPU-sized and its tiny config,
    trains exactly the runs that fit 1 (and 2) devices and skips the rest (gpipe's 4 stage devices)
    before any training starts; on 1 device every run it keeps passes set-up (validation, mesh,
    method build), so none fails after the runs before it have trained."""
    plans = _plans(devices, setup=devices == 1)
    for name in TRAINING_NOTEBOOKS:
        for size in ("tiny", "gpu"):
            assert plans[name][size] == _expected_plan(name, size, devices), (name, size)


def test_devices_to_use_says_whether_a_mesh_fits():
    """Hand cases: a fixed mesh takes its size or does not fit; a -1 axis takes the most devices the
    fixed axes divide, and nothing below their product."""
    import ml_collections

    from cdpjax.layouts import devices_needed, devices_to_use

    def config(method, mesh):
        return ml_collections.ConfigDict({"method": method, "mesh": mesh, "stages": 4})

    cases = [({"data": 8}, 8, 8), ({"data": 8}, 4, 0), ({"data": 1}, 1, 1), ({"data": -1}, 3, 3),
             ({"stage": 4, "data": -1}, 1, 0), ({"stage": 4, "data": -1}, 2, 0), ({"stage": 4, "data": -1}, 4, 4),
             ({"stage": 4, "data": -1}, 6, 4), ({"stage": 4, "data": -1}, 8, 8), ({"stage": 2, "data": 2}, 3, 0)]
    for mesh, available, expected in cases:
        assert devices_to_use(config("gpipe", mesh), available) == expected, (mesh, available)
    assert devices_needed(config("gpipe", {"stage": 4, "data": -1})) is None  # its callers' "every device"
    # a malformed mesh (two -1 axes, a size 0): every device, so that validation, run on them, names the fault
    for method, mesh in (("dp", {"data": -1, "model": -1}), ("dp", {"data": 0}), ("dp", {"data": "8"})):
        assert devices_to_use(config(method, mesh), 5) == 5 and devices_needed(config(method, mesh)) is None, mesh


FAKE_GPU = """
import os as _os
_exists = _os.path.exists
_os.path.exists = lambda p: p == "/dev/nvidia0" or _exists(p)
"""


@pytest.mark.parametrize("gpu,message", [
    (False, "no GPU: choose Runtime > Change runtime type > a GPU, or set TINY = True in this cell"),
    (True, "a GPU is here but jax runs on the CPU: rerun the install cell, then Runtime > Restart session"),
])
def test_set_up_without_a_gpu_stops_unless_tiny_is_chosen(gpu, message, tmp_path, monkeypatch):
    """The set-up cell on a CPU backend, the tiny config not chosen: it stops (SystemExit, so Run all
    goes no further) with one line saying what to change; where an NVIDIA device is there (Colab's
    GPU runtime whose jax has no CUDA plugin) the line says so. No silent fall-back to the tiny config."""
    monkeypatch.delenv("CDPJAX_TINY", raising=False)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    gen = _generator()
    cells = [gen.INSTALL, *([FAKE_GPU] if gpu else []), gen.SETUP]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    with pytest.raises(nbclient.exceptions.CellExecutionError):
        client.execute()
    (error,) = [o for o in nb.cells[-1].outputs if o.output_type == "error"]
    assert error.ename == "SystemExit" and error.evalue.startswith(message) and "\n" not in error.evalue
    assert not (tmp_path / "figures").exists()


# Those that train are heavy; CI runs the diagrams and the memory notebook.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.heavy)
                                  if n in ("cdp_accuracy.ipynb", "cdp_delays.ipynb", "ppll_vs_local_gpipe.ipynb") else n
                                  for n in sorted(FIGURES)])
def test_notebook_runs_on_tiny_config(name, tmp_path, monkeypatch):
    figures = tmp_path / "figures"
    monkeypatch.setenv("CDPJAX_TINY", "1")
    monkeypatch.setenv("CDPJAX_FIGURES", str(figures))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # a pip install that should not happen cannot download either
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(COLAB / name, as_version=4)
    setup = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"][1]
    artists = tmp_path / "artists.json"
    nb.cells.insert(setup + 1, nbformat.v4.new_code_cell(RECORDER.replace("ARTISTS_PATH", repr(str(artists)))))
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError naming the cell that failed

    code = [c for c in nb.cells if c.cell_type == "code"]
    printed = "".join(o.get("text", "") for o in code[0].outputs)
    assert printed.startswith("cdpjax from https://github.com/") and printed.count("\n") == 1, \
        f"the install cell installed: cdpjax was not importable in the kernel ({printed!r})"
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors
    setup = "".join(o.get("text", "") for o in code[1].outputs)
    assert "the tiny config" in setup and "8 cpu device(s)" in setup
    expected = list(FIGURES[name])
    from cdpjax import methods

    if name == "cdp_timing_diagrams.ipynb" and "cdp-mp" in methods.REGISTRY:
        expected.append("timing_cdp-mp_N4_L4.png")
    drawn = json.loads(artists.read_text())
    for f in expected:
        path = figures / f
        assert path.is_file() and f in drawn, f"{name} did not write {f}"
        assert _png_with_content(path), f"{f} is not a PNG with lines and text on it"
    shown = sum("image/png" in o.get("data", {}) for c in code for o in c.outputs)
    assert shown >= len(expected), f"{name} showed {shown} figures"
    CONTENT[name](drawn, tmp_path)


# Put after the notebook's set-up cell (in the executed copy only): every figure saved records what
# its axes draw, by file name, into ARTISTS_PATH.
RECORDER = """
import json as _json, os as _os
import matplotlib.figure as _mf
from matplotlib.patches import Rectangle as _Rectangle

_drawn, _savefig = {}, _mf.Figure.savefig


def _floats(values):
    return [float(v) for v in values]


def _recording_savefig(self, fname, *args, **kwargs):
    out = _savefig(self, fname, *args, **kwargs)
    _drawn[_os.path.basename(str(fname))] = [{
        "title": ax.get_title(),
        "lines": [[line.get_label(), _floats(line.get_xdata()), _floats(line.get_ydata())] for line in ax.get_lines()],
        "boxes": [[*_floats((r.get_x(), r.get_y(), r.get_width(), r.get_height())), bool(r.get_hatch())]
                  for r in ax.patches if isinstance(r, _Rectangle)],
        "texts": [[*_floats(t.get_position()), t.get_text()] for t in ax.texts],
        "ticklabels": [t.get_text() for t in ax.get_xticklabels()],
        "images": [im.get_array().astype(float).tolist() for im in ax.get_images()],
    } for ax in self.axes]
    with open(ARTISTS_PATH, "w") as f:
        _json.dump(_drawn, f)
    return out


_mf.Figure.savefig = _recording_savefig
"""


def _png_with_content(path) -> bool:
    from PIL import Image

    image = Image.open(path)
    rgb = np.asarray(image.convert("RGB")).reshape(-1, 3).astype(np.int64)
    return image.format == "PNG" and min(image.size) > 100 and len(np.unique(rgb @ [1 << 16, 1 << 8, 1])) > 10


def _boxes(axes: dict) -> list:
    """(tick, stage, label, hatched) of each box of a timing diagram (a rectangle and the text at its centre)."""
    texts = {(round(x, 6), round(y, 6)): t for x, y, t in axes["texts"]}
    return sorted((int(round(x)), int(round(y + h / 2)), texts[(round(x + w / 2, 6), round(y + h / 2, 6))], hatched)
                  for x, y, w, h, hatched in axes["boxes"])


def _lines(axes: dict) -> dict:
    return {label: (x, y) for label, x, y in axes["lines"]}


def _metrics(workdir, split, key):
    lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    lines = [r for r in lines if r["split"] == split]
    return [float(r["step"]) for r in lines], [float(r[key]) for r in lines]


def _timing_content(drawn, _):
    """The tiny config draws 2 steps of each table. CDP's boxes and hatching as the paper's timing
    (`helpers.cdp_rule`), labelled with the worker; the staleness images as the rules (i + 2j < 7 for
    N = 8, L = 4; the reference code's j < L-1-i); ppll's batch t-j on stage j at tick t; GPipe's fill
    (tick j + m) and drain (tick 2(K-1) + M + m - j)."""
    for method in ("dp", "cdp-v1", "cdp-v2"):
        for n in (4, 8):
            ops, _, _ = cdp_rule(method, n, 4, 2)
            (axes,) = drawn[f"timing_{method}_N{n}_L4.png"]
            assert _boxes(axes) == sorted((tick, stage, f"{kind}w{worker}", stale)
                                          for tick, worker, stage, kind, _, _, _, stale in ops), (method, n)
    table_image, reference_image = (axes["images"][0] for axes in drawn["staleness_cdp-v2_N8_L4.png"])
    assert np.array_equal(np.asarray(table_image) > 0, [[i + 2 * j < 7 for j in range(4)] for i in range(8)])
    assert np.array_equal(np.asarray(reference_image) > 0, [[j < 3 - i for j in range(4)] for i in range(8)])
    (axes,) = drawn["timing_ppll_K4.png"]
    assert _boxes(axes) == sorted((t, j, f"FB{t - j}", False) for t in range(9) for j in range(4) if 0 <= t - j < 6)
    (axes,) = drawn["timing_gpipe_K4_M4.png"]
    gpipe = [(14 * k + j + m, j, f"F{m}", False) for k in range(2) for j in range(4) for m in range(4)]
    gpipe += [(14 * k + 6 + 4 + m - j, j, f"B{m}", False) for k in range(2) for j in range(4) for m in range(4)]
    assert _boxes(axes) == sorted(gpipe)
    if "timing_cdp-mp_N4_L4.png" in drawn:
        ops, _, _ = cdp_rule("cdp-v2", 4, 4, 2)
        (axes,) = drawn["timing_cdp-mp_N4_L4.png"]
        assert _boxes(axes) == sorted((tick, stage, f"{kind}w{worker}", stale)
                                      for tick, worker, stage, kind, _, _, _, stale in ops)


def _memory_content(drawn, _):
    """The digits MLP, N = 8 workers, L = 4 stages, 16 images a worker: stage-activations held and
    gradient bytes per tick are the tables' (dp's all workers at their peak of L together, N*L = 32;
    cdp-v2's flat at N*L/2 = 16 in steady state; dp's traffic a burst in the step's last tick); the
    bytes held, which the notebook adds up with its own loop, are the table's activation model at the
    stages' output bytes; dp's gradients are an all-reduce, cdp-v2's collective-permutes."""
    from cdpjax import bench, data, models
    from cdpjax.config import load_file
    from cdpjax.layouts.cdp import cdp_table

    base = load_file(str(ROOT / "cdpjax" / "configs" / "digits.py") + ":method=cdp-v2")
    dataset = data.build(base)
    sizes = bench.stage_sizes(models.build(base, dataset.image_shape, dataset.num_classes), base.global_batch_size // 8)
    tables = [cdp_table(m, 8, 4, steps=4) for m in ("dp", "cdp-v2")]
    (act,), (held,), (comm,) = (drawn[f] for f in ("activation_over_time.png", "activation_bytes_over_time.png",
                                                   "comm_per_tick.png"))
    assert [y for _, _, y in act["lines"]] == [list(map(float, t.activation_total())) for t in tables]
    dp_held, cdp_held = (y for _, _, y in act["lines"])
    assert max(dp_held[8:16]) == 32 and cdp_held[8:16] == [16.0] * 8  # steady state: step 1 of worker 0
    for (_, _, y), t in zip(held["lines"], tables):
        np.testing.assert_allclose(y, t.activation_bytes(sizes["activation_bytes"]).sum(1) / 2**20, rtol=1e-6)
    assert [y for _, _, y in comm["lines"]] == [[float(b) for b in t.bytes_per_tick(sizes["param_bytes"])]
                                                for t in tables]
    assert [b > 0 for b in comm["lines"][0][2][8:16]] == [False] * 7 + [True]
    collectives, memory = drawn["measured_memory_and_collectives.png"]
    assert collectives["ticklabels"] == ["all-reduce", "collective-permute"]
    heights = [h for _, _, _, h, _ in collectives["boxes"]]  # dp's two bars, then cdp-v2's
    (dp_reduce, dp_permute), (cdp_reduce, cdp_permute) = heights[:2], heights[2:4]
    assert dp_reduce > 100 * cdp_reduce and dp_permute == 0 and cdp_permute > 0
    assert len(memory["boxes"]) == 2 and all(h > 0 for *_, h, _ in memory["boxes"])


def _accuracy_content(drawn, tmp_path):
    """Each method's test accuracy and train loss at their steps, as its metrics.jsonl has them."""
    test, loss = drawn["cdp_accuracy.png"]
    for method in ("dp", "cdp-v1", "cdp-v2"):
        assert _lines(test)[method] == _metrics(tmp_path / "runs" / method, "test", "accuracy")
        assert _lines(loss)[method] == _metrics(tmp_path / "runs" / method, "train", "loss")


def _ppll_content(drawn, tmp_path):
    """Predicted speedups on K = 4 devices: ppll at most K and above plain model parallelism, which is
    at most 1 (one stage at a time), K drawn as a line; each method's accuracy bar is its run's
    summary and its curve its metrics; ppll's bar is local's (the same parameters)."""
    predicted, measured = drawn["ppll_speedup.png"]
    bars = dict(zip(predicted["ticklabels"], (h for *_, h, _ in predicted["boxes"])))
    assert set(bars) == {"ppll", "gpipe M=4", "model parallel"}
    assert bars["model parallel"] <= 1.02 and bars["model parallel"] < bars["ppll"] <= 4 + 1e-6
    assert [y for label, _, y in predicted["lines"] if label == "K = 4"] == [[4.0, 4.0]]
    bars, curves = drawn["ppll_accuracy.png"]
    heights = dict(zip(bars["ticklabels"], (h for *_, h, _ in bars["boxes"])))
    summaries = {m: json.loads((tmp_path / "runs" / m / "summary.json").read_text()) for m in heights}
    assert heights == {m: s["test_accuracy"] for m, s in summaries.items()} and {"local", "ppll"} <= set(heights)
    assert heights["ppll"] == heights["local"]
    for method in heights:
        assert _lines(curves)[method] == _metrics(tmp_path / "runs" / method, "test", "accuracy")
    assert sorted(measured["ticklabels"]) == sorted(heights)  # measured here: every method that ran


def _delays_content(drawn, tmp_path):
    """One panel (uniform-tau), one line per correction: each point the test accuracy its run's
    summary holds, at tau 0 and 2; at tau = 0 every read is fresh, so the staleness-scaled rate is
    the plain one and the two runs (dp) end equal."""
    (panel,) = drawn["cdp_delays.png"]
    lines = _lines(panel)
    assert set(lines) == {"none", "staleness-lr"}
    for correction, (x, y) in lines.items():
        summaries = [json.loads((tmp_path / "runs" / f"uniform-tau-tau{tau}-{correction}" / "summary.json").read_text())
                     for tau in (0, 2)]
        assert x == [0.0, 2.0] and y == [s["test_accuracy"] for s in summaries]
    assert lines["none"][1][0] == lines["staleness-lr"][1][0]


CONTENT = {
    "cdp_timing_diagrams.ipynb": _timing_content,
    "cdp_memory_and_communication.ipynb": _memory_content,
    "cdp_accuracy.ipynb": _accuracy_content,
    "cdp_delays.ipynb": _delays_content,
    "ppll_vs_local_gpipe.ipynb": _ppll_content,
}


# As on Colab: its packages, then the notebook's own install cell ------------------------------------

COLAB_PACKAGES = pathlib.Path(__file__).with_name("colab_gpu_packages.txt")  # dated: see its first lines
# What a notebook's install meets on Colab: the packages cdpjax and its dependencies share with Colab's
# image, and the kernel's. Installed at Colab's versions (its pip freeze as constraints).
COLAB_SEED = ("pip", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "chex", "numpy", "scipy",
              "tensorflow-datasets", "matplotlib", "scikit-learn", "pillow", "tqdm", "tensorboard", "ipykernel",
              "nbclient", "nbformat")
COLAB_PYTHON = ("python3.13", {"PYENV_VERSION": "3.13.0"})  # Colab's GPU image runs Python 3.13


def _colab_venv(path: pathlib.Path) -> pathlib.Path:
    """A fresh venv on Python 3.13 holding COLAB_SEED at Colab's versions; its python."""
    import os
    import shutil
    import subprocess

    command, extra = COLAB_PYTHON
    if shutil.which(command) is None:
        pytest.skip(f"{command} is not on this machine")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_NO_INDEX")} | extra
    if subprocess.run([command, "-m", "venv", str(path)], env=env).returncode != 0:
        pytest.skip(f"{command} cannot make a venv here")
    pins = path / "colab-pins.txt"
    pins.write_text("".join(line + "\n" for line in COLAB_PACKAGES.read_text().splitlines()
                            if "==" in line and not line.startswith("#")))
    python = path / "bin" / "python"
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", "-c", str(pins), *COLAB_SEED],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return python


COLAB_RUN = """
import json, pathlib, sys
import nbclient, nbformat

nb = nbformat.read(sys.argv[1], as_version=4)
client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": sys.argv[2]}})
try:
    client.execute()
finally:
    nbformat.write(nb, sys.argv[3])
"""


@pytest.mark.heavy
def test_the_ppll_notebook_runs_on_colabs_packages(tmp_path):
    """Colab as it is (tests/colab_gpu_packages.txt: jax 0.7.2, flax 0.11.2, Python 3.13): the PPLL
    notebook's own install cell, with this checkout in place of the repository, upgrades jax and flax
    to what cdpjax needs, and the notebook's tiny path then runs top to bottom (every method of the
    notebook trains: on Colab's own jax, or on a newer jax beside Colab's flax, none does). The install
    with the CUDA extra resolves too (pip's dry run: the CUDA plugin at jax's version). Downloads from
    PyPI: heavy (`make test-heavy`)."""
    import os
    import subprocess

    python = _colab_venv(tmp_path / "venv")
    versions = subprocess.run([str(python), "-c", "import jax, flax; print(jax.__version__, flax.__version__)"],
                              capture_output=True, text=True).stdout.split()
    assert versions == ["0.7.2", "0.11.2"], versions  # Colab's, before the notebook installs anything
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_NO_INDEX")}
    dry = subprocess.run([str(python), "-m", "pip", "install", "--dry-run", "--report", "-", "-q",
                          f"cdpjax[cuda12] @ {ROOT.as_uri()}"], capture_output=True, text=True, env=env)
    assert dry.returncode == 0, dry.stderr[-3000:]
    chosen = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(dry.stdout)["install"]}
    assert chosen["jax-cuda12-plugin"] == chosen["jax"] == chosen["jaxlib"], chosen

    nb = nbformat.read(COLAB / "ppll_vs_local_gpipe.ipynb", as_version=4)
    install = next(c for c in nb.cells if c.cell_type == "code")
    pip_line = '%pip install -q "cdpjax{EXTRA} @ git+{REPOSITORY}"'
    assert pip_line in install.source
    install.source = install.source.replace(pip_line, f'%pip install -q "cdpjax @ {ROOT.as_uri()}"')  # no CUDA here
    nb.cells.insert(nb.cells.index(install) + 1, nbformat.v4.new_code_cell(
        "import importlib.metadata as _m\nprint('installed', _m.version('jax'), _m.version('flax'))"))
    source, out = tmp_path / "in.ipynb", tmp_path / "out.ipynb"
    nbformat.write(nb, source)
    script = tmp_path / "run.py"
    script.write_text(COLAB_RUN)
    env |= {"CDPJAX_TINY": "1", "CDPJAX_FIGURES": str(tmp_path / "figures"), "MPLBACKEND": "Agg",
            "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    proc = subprocess.run([str(python), str(script), str(source), str(tmp_path), str(out)], capture_output=True,
                          text=True, env=env, cwd=tmp_path)
    executed = nbformat.read(out, as_version=4)
    code = [c for c in executed.cells if c.cell_type == "code"]
    errors = [f"{o.ename}: {o.evalue}" for c in code for o in c.outputs if o.output_type == "error"]
    assert proc.returncode == 0 and not errors, (errors, proc.stderr[-3000:])
    printed = ["".join(o.get("text", "") for o in c.outputs) for c in code]
    assert printed[0].startswith("cdpjax from https://github.com/")
    jax_version, flax_version = printed[1].split()[1:]
    assert tuple(map(int, jax_version.split(".")[:2])) >= (0, 10), jax_version
    assert tuple(map(int, flax_version.split(".")[:3])) >= (0, 12, 8), flax_version
    assert "the tiny config" in printed[2] and "8 cpu device(s)" in printed[2]
    summaries = {m: json.loads((tmp_path / "runs" / m / "summary.json").read_text()) for m in ("local", "ppll")}
    assert summaries["ppll"]["test_accuracy"] == summaries["local"]["test_accuracy"] > 0.5
