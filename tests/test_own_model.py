"""Bring your own model: a model module next to its config file, registered by the config,
trained with cdp-v2 and ppll from Python and from the command line (experiments/own_model/).

The config's folder must be importable for `import my_model` to work: `cdpjax.config.load_file`
puts it on `sys.path`. Both runs are a few steps in a fresh process, from another folder (the
example's accuracy is in its config's docstring).
"""
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from cdpjax import config as cfg_lib
from cdpjax import models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "experiments", "own_model")


@pytest.fixture
def clean_imports(monkeypatch):
    """sys.path as it was after the test, and the example's model module and name gone."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    for name in ("my_model", "helper_next_to_config"):
        sys.modules.pop(name, None)
    if "my_cnn" in models.REGISTRY:
        models.REGISTRY.remove("my_cnn")


def test_config_folder_is_importable_while_it_runs_and_after(tmp_path, clean_imports):
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "helper_next_to_config.py").write_text("LR = 0.125\n")
    (folder / "config.py").write_text(
        "import helper_next_to_config\n"
        "from cdpjax.config import default_config\n"
        "def get_config(arg=None):\n"
        "    c = default_config()\n"
        "    c.learning_rate = helper_next_to_config.LR\n"
        "    return c\n")
    assert str(folder) not in sys.path
    # Run as a plain module (what load_file did before), the import fails: the folder is not importable.
    spec = importlib.util.spec_from_file_location("plain", folder / "config.py")
    with pytest.raises(ModuleNotFoundError):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert cfg_lib.load_file(str(folder / "config.py")).learning_rate == 0.125
    # Still importable afterwards, at the end of sys.path, so that it shadows no installed package.
    assert sys.path.count(str(folder)) == 1 and sys.path[-1] == str(folder)


def test_example_config_registers_the_users_model(clean_imports):
    """Loading experiments/own_model/config.py imports my_model.py next to it, which registers the
    factory; its blocks are the user's, one stage each; the config names no mesh."""
    config = cfg_lib.load_file(os.path.join(EXAMPLE, "config.py") + ":method=ppll")
    assert config.model == "my_cnn" and config.method == "ppll" and not dict(config.mesh)
    blocks = models.REGISTRY["my_cnn"](10, (8, 8, 1))
    assert [type(b).__name__ for b in blocks] == ["ConvBlock", "ConvBlock", "ConvBlock", "Classify"]
    assert config.stages == len(blocks)


def _run(args, cwd):
    """A fresh process; XLA without LLVM optimisation (a few steps: compiling is the cost)."""
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0")
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.heavy  # CI: the same model through the command line under ppll (below); the ring compiles longest
def test_own_model_trains_with_cdp_v2_from_python(tmp_path):
    """`train_from_python.py`: every device on `data` (cdp-v2's layout: 8 simulated CPU devices)."""
    _run([os.path.join(EXAMPLE, "train_from_python.py"), "--steps", "3", "--methods", "cdp-v2", "--out",
          str(tmp_path)], tmp_path)
    summary = json.loads((tmp_path / "cdp-v2" / "summary.json").read_text())
    assert summary["model"] == "my_cnn" and summary["mesh"] == {"data": 8} and summary["steps"] == 3
    assert np.isfinite(summary["test_loss"])


def test_own_model_trains_with_ppll_from_the_command_line(tmp_path):
    """`cdpjax train --config experiments/own_model/config.py:method=ppll` from another folder: the
    command line fills 8 simulated devices: the 4 stage devices ppll's layout declares, 2 replicas."""
    work = tmp_path / "ppll"
    _run(["-m", "cdpjax.cli", "train", "--config", os.path.join(EXAMPLE, "config.py") + ":method=ppll,steps=3",
          "--workdir", str(work), "--no-progress"], tmp_path)
    summary = json.loads((work / "summary.json").read_text())
    assert summary["model"] == "my_cnn" and summary["mesh"] == {"stage": 4, "data": 2} and summary["steps"] == 3
    assert np.isfinite(summary["test_loss"])
