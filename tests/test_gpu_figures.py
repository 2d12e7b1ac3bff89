"""experiments/gpu_figures.sh runs end to end before a GPU ever sees it: `--tiny` (tiny models of
the same families) in a fresh process with ONE CPU device, as the GPU machine has one device; its
figures obey their definitions (a stage-axis method on every device of its own process among
them), its markdown table is made from its JSON, and what it imports is what the GPU image has
(JAX, flax, optax, orbax, chex and ml_collections)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "experiments", "gpu_figures.py")
SHELL = os.path.join(ROOT, "experiments", "gpu_figures.sh")
KINDS = {("step", "e2e"), ("step", "dp"), ("step", "cdp-v2"), ("prediction", "cdp-v2"), ("prediction", "ppll")}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """gpu_figures.sh --tiny, as the GPU machine runs it (from anywhere; files in $OUT)."""
    out = tmp_path_factory.mktemp("gpu_figures")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # no simulated devices: one, as on the GPU
    env.update(JAX_PLATFORMS="cpu", OUT=str(out), PYTHON=sys.executable)
    proc = subprocess.run(["bash", SHELL, "--tiny", "--repeats", "2"], env=env, cwd=out, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out / "gpu_figures.json") as f:
        return json.load(f), (out / "gpu_figures.md").read_text(), out / "gpu_figures.json"


def measured(doc, kind=None):
    return [r for r in doc["records"] if "step_seconds" in r and kind in (None, r["kind"])]


def test_every_kind_of_figure_is_measured_on_one_device(run):
    doc, _, _ = run
    assert doc["environment"]["device_count"] == 1 and doc["settings"]["tiny"]
    assert [r for r in doc["records"] if "error" in r or "skipped" in r] == []
    assert {(r["kind"], r["method"]) for r in measured(doc)} == KINDS
    assert {r["dtype"] for r in measured(doc)} == {"float32", "bfloat16"}
    assert {r["workload"] for r in measured(doc)} == {"resnet18", "vit_b"}
    for key in ("jax", "device", "date", "backend"):
        assert doc["environment"][key]


def test_step_figures_obey_their_definitions(run):
    doc, _, _ = run
    for r in measured(doc, "step"):
        assert r["devices"] == 1
        assert r["images_per_second"] == pytest.approx(r["global_batch_size"] / r["step_seconds"])
        # The step's arguments hold at least the float32 parameters (bench counts them apart).
        assert r["memory"]["argument_bytes"] >= r["param_bytes"] > 0


def test_predictions_obey_the_schedules(run):
    """The ring (N = L = devices workers): every worker runs each stage forward and backward on its
    micro-batch once a step, so a step takes at least the sum over stages, and the same work on one
    device is N micro-batches. ppll: one batch a tick, no bubble, so a step is the slowest stage,
    its auxiliary head included (plus at most one activation hop); on one device, every stage once."""
    doc, _, _ = run
    devices, bandwidth = doc["settings"]["devices"], doc["settings"]["bandwidth"]
    for r in measured(doc, "prediction"):
        stage = np.add(r["stage_forward"], r["stage_backward"])
        if r.get("stage_head"):  # local learning: each stage's auxiliary head too
            stage = stage + np.asarray(r["stage_head"])
        assert len(stage) == devices and r["devices"] == devices
        assert r["speedup"] == pytest.approx(r["sequential_step_seconds"] / r["step_seconds"])
        if r["method"] == "cdp-v2":
            assert r["micro_batch"] == r["global_batch_size"] // devices
            assert r["sequential_step_seconds"] == pytest.approx(devices * stage.sum())
            assert r["step_seconds"] >= stage.sum() * (1 - 1e-9) and r["speedup"] <= devices + 1e-9
        else:
            assert r["micro_batch"] == r["global_batch_size"]
            assert r["sequential_step_seconds"] == pytest.approx(stage.sum())
            hop = max(r["activation_bytes"]) / bandwidth
            assert stage.max() * (1 - 1e-9) <= r["step_seconds"] <= stage.max() + hop + 1e-12


def test_a_stage_axis_method_fills_every_device_and_says_its_input_wait(run):
    """The host task: gpipe's 2 tiny stages on the 4 simulated CPU devices its own process has,
    so 4 / 2 = 2 pipeline replicas on `data`; its input wait a fraction; its row in the table."""
    doc, markdown, _ = run
    (host,) = [r for r in doc["records"] if r["kind"] == "host"]
    assert host["method"] == "gpipe" and host["mesh"] == {"stage": 2, "data": 2} and host["devices"] == 4
    assert host["images_per_second"] > 0 and 0.0 <= host["input_wait_fraction"] <= 1.0
    assert (f"| gpipe | vit_b ({host['global_batch_size']}) | {{'stage': 2, 'data': 2}} | 4 | "
            f"{host['images_per_second']:.0f} | {host['input_wait_fraction']:.1%} |") in markdown


def test_the_plan_task_benches_its_top_three_in_its_own_order(run):
    """The plan task: the three candidates ranked first by the lockstep model (fastest predicted
    first, the plan's order), each benched on the one device; its rows in the table."""
    doc, markdown, _ = run
    (ranked,) = [r for r in doc["records"] if r["kind"] == "plan"]
    top = ranked["top"]
    assert len(top) == 3 and ranked["candidates"] >= 3
    assert [c["predicted_step_seconds"] for c in top] == sorted(c["predicted_step_seconds"] for c in top)
    assert {c["label"].split()[0] for c in top} <= {"e2e", "dp", "interleaved-1f1b"}  # --tiny's methods
    for c in top:
        assert c["measured_step_seconds"] > 0 and c["predicted_step_seconds"] > 0
        assert c["held_bytes"] > 0 and c["predicted_bytes"] > 0
        assert f"| {c['label']} | {c['predicted_step_seconds'] * 1e3:.2f} | {c['measured_step_seconds'] * 1e3:.2f} |" \
            in markdown


def test_markdown_table_is_made_from_the_json(run):
    doc, markdown, path = run
    text = subprocess.run([sys.executable, SCRIPT, "--table", str(path)], capture_output=True, text=True,
                          timeout=300, check=True).stdout
    assert text == markdown  # what the shell script wrote next to the JSON
    for r in measured(doc, "step"):
        if r["method"] == "e2e":
            batch = doc["settings"]["workloads"][r["workload"]]["batch"]
            assert (f"| {r['workload']} ({batch}) | {r['dtype']} | {r['step_seconds'] * 1e3:.1f} | "
                    f"{r['global_batch_size'] / r['step_seconds']:.0f} |") in text
    for r in measured(doc, "prediction"):
        assert f"| {r['workload']} | {r['dtype']} | {r['method']} | {r['micro_batch']} |" in text
        assert f"| {r['step_seconds'] * 1e3:.2f} | {r['speedup']:.2f} |" in text


def test_cdpjax_imports_without_the_packages_a_gpu_image_lacks():
    """tensorflow-datasets, PIL, scikit-learn, matplotlib and tqdm made unimportable: what the
    script uses still imports (the tfds loaders import tensorflow-datasets when they read)."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in {'tensorflow_datasets', 'PIL', 'sklearn', 'matplotlib', 'tqdm'}:\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import cdpjax.bench, cdpjax.train, cdpjax.speedup\n"
        "from cdpjax import data\n"
        "assert 'cifar10' in data.REGISTRY and 'tensorflow_datasets' not in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
