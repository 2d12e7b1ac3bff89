"""Bring your own head: an auxiliary head and its local loss in a module next to their config,
registered by the config (`experiments/own_head/`), trained under ppll (equal to local) from
Python and from the command line; the registry checks its name and options like the built-ins'."""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cdpjax import checks, models
from cdpjax import config as cfg_lib
from cdpjax.errors import ConfigError
from cdpjax.models import aux_heads
from helpers import assert_trees_close, build, digits_batches, random_batches, run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "experiments", "own_head")


@pytest.fixture
def own_head(monkeypatch):
    """The example's config loaded (registering "smooth_mlp"); afterwards sys.path, the module and the
    registry entry as they were."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield lambda arg="": cfg_lib.load_file(os.path.join(EXAMPLE, "config.py") + (f":{arg}" if arg else ""))
    sys.modules.pop("my_head", None)
    if "smooth_mlp" in aux_heads.REGISTRY:
        aux_heads.REGISTRY.remove("smooth_mlp")


def test_config_registers_the_head_with_its_options(own_head):
    assert "smooth_mlp" not in aux_heads.REGISTRY
    config = own_head()
    entry = aux_heads.REGISTRY["smooth_mlp"]
    assert config.aux_head == "smooth_mlp" and entry.options == ("hidden", "smoothing")
    checks.validate(config)  # the head's name and options, before anything is built
    config.aux_kwargs = {"smoothin": 0.2}
    with pytest.raises(ConfigError, match="aux_kwargs.smoothin is not an option of the 'smooth_mlp' head; "
                                          "accepted: hidden, smoothing, head_lr_scale"):
        checks.validate(config)


def test_the_heads_loss_is_the_users(own_head):
    """Module 0's local loss is label-smoothed cross-entropy of the head's logits, written out here:
    targets (1 - s) one_hot + s / C, loss -mean sum targets log softmax(logits)."""
    config = own_head("smoothing=0.3")
    net = models.build(config, (8, 8, 1), 10)
    heads = aux_heads.build(config.aux_head, net, 10, dict(config.aux_kwargs))
    params, state = heads.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    features = jnp.asarray(rng.normal(size=(6, *heads.feature_shapes[0])), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 10, 6))
    loss, (acc, _) = heads.loss(0, params[0], state[0], features, labels)
    logits = np.asarray(heads.modules[0].apply({"params": params[0]}, features), np.float64)
    log_p = logits - logits.max(1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(1, keepdims=True))
    targets = 0.7 * np.eye(10)[np.asarray(labels)] + 0.3 / 10
    np.testing.assert_allclose(loss, -(targets * log_p).sum(1).mean(), rtol=1e-5)
    np.testing.assert_allclose(acc, (logits.argmax(1) == np.asarray(labels)).mean())


def test_the_head_trains_under_ppll_as_under_local(own_head):
    """4 stages on 4 devices against local learning: the same bodies and heads after T batches, and
    every module's loss falls on digits."""
    batches = random_batches(6, 16)
    trained = {}
    for method, mesh in (("local", {"data": 1}), ("ppll", {"stage": 4})):
        config = own_head(f"method={method}")
        config.global_batch_size, config.model_kwargs = 16, {"width": 16}
        trained[method] = build(config, mesh)
    local, ppll = trained["local"], trained["ppll"]
    s_local, s_ppll = run(local, batches), run(ppll, batches)
    assert_trees_close(ppll.export(s_ppll), local.export(s_local))
    assert_trees_close(ppll.export_heads(s_ppll), local.export_heads(s_local))
    state, losses = local.init(jax.random.key(0)), []
    for b in digits_batches(40, 16):
        state, metrics = local.train_step(state, b)
        losses.append(np.asarray(metrics["stage_loss"]))
    assert np.all(np.mean(losses[-4:], 0) < 0.9 * np.mean(losses[:4], 0))


def test_the_head_trains_from_the_command_line(tmp_path):
    """`cdpjax train --config experiments/own_head/config.py` from another folder: ppll on the 4 stage
    devices its layout declares, 2 replicas on the 8, the user's head registered by the config."""
    work = tmp_path / "ppll"
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0")
    proc = subprocess.run([sys.executable, "-m", "cdpjax.cli", "train", "--config",
                           os.path.join(EXAMPLE, "config.py") + ":steps=3", "--workdir", str(work), "--no-progress"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((work / "summary.json").read_text())
    config = json.loads((work / "config.json").read_text())
    assert summary["mesh"] == {"stage": 4, "data": 2} and summary["steps"] == 3 and np.isfinite(summary["test_loss"])
    assert config["aux_head"] == "smooth_mlp"
