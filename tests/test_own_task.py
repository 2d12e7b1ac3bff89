"""Local learning follows the task: a regression task of one's own (`experiments/own_task/`: squared
error on one float output, float targets) trains under every method, ppll and local included, with
a falling MSE; its float targets reach every module's loss unchanged; a head whose own loss cannot
serve a task is refused in one line."""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from cdpjax import config as cfg_lib
from cdpjax import data, layouts, methods, models, tasks
from cdpjax import setup as setup_lib
from cdpjax.errors import ConfigError
from cdpjax.models import aux_heads
from helpers import assert_trees_close, max_diff

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "experiments", "own_task")
STEPS = 60
CI_METHODS = ("local", "ppll", "e2e", "cdp-v2", "gpipe")


@pytest.fixture(scope="module")
def own_task():
    """The example's config loader (registering the task "ink" and the dataset "digits_ink"); afterwards
    sys.path, the module and the registry entries as they were."""
    path = list(sys.path)
    yield lambda arg="": cfg_lib.load_file(os.path.join(EXAMPLE, "config.py") + (f":{arg}" if arg else ""))
    sys.path[:] = path
    sys.modules.pop("my_task", None)
    for registry, name in ((tasks.REGISTRY, "ink"), (data.REGISTRY, "digits_ink")):
        if name in registry:
            registry.remove(name)


def _train(config, steps: int = STEPS) -> tuple[list[float], list[np.ndarray]]:
    """`steps` steps of the config's method as `cdpjax.train` runs them: (train losses, per-module losses)."""
    needed = layouts.devices_needed(config) or len(jax.devices())
    dataset, mesh, method = setup_lib.setup(config, jax.devices()[:needed])
    state = method.init(jax.random.key(config.seed))
    losses, stage_losses = [], []
    for step in range(steps):
        batch = dataset.train_batch(step, config.global_batch_size, config.seed, augment=False)
        assert batch["label"].dtype == np.float32
        state, metrics = method.train_step(state, setup_lib.put_batch(batch, mesh, method.input_sharding))
        losses.append(float(metrics["loss"]))
        if "stage_loss" in metrics:
            stage_losses.append(np.asarray(metrics["stage_loss"]))
    return losses, stage_losses


def test_float_targets_reach_every_modules_loss_unchanged(own_task):
    """Each module's local loss under the task "ink" is the mean squared error of its head's single
    output against the float targets as given (0.25, 1.5, 2.75, 4.0: no integer cast), written out
    here; the last module's is the network's output's."""
    config = own_task("method=local")
    task = tasks.lookup("ink")
    net = models.build(config, (8, 8, 1), 1)
    heads = aux_heads.build("greedy", net, 1, {}, task=task)
    params, state = heads.init(jax.random.key(0))
    targets = np.asarray([0.25, 1.5, 2.75, 4.0], np.float32)
    x = np.random.default_rng(0).normal(size=(4, 8, 8, 1)).astype(np.float32)
    body, model_state = net.init(jax.random.key(1))
    for j in range(net.num_stages):
        y, _ = net.apply_stage(j, body[j], model_state[j], x, False)
        loss, _ = heads.loss(j, params[j], state[j], y, targets, train=False)
        outputs = y if heads.heads[j] is None else heads.heads[j].module.apply({"params": params[j]}, y)
        assert np.asarray(outputs).shape == (4, 1)
        np.testing.assert_allclose(float(loss), np.mean((np.asarray(outputs)[:, 0] - targets) ** 2), rtol=1e-6)
        x = y


@pytest.mark.parametrize("method", ["local", "ppll"])
def test_regression_trains_under_local_learning(own_task, method):
    """ppll and local on digits_ink (4 modules, greedy heads with one output): over 120 steps the network's
    MSE and every module's local MSE fall by half, and the network's ends below the targets' variance (the
    MSE of predicting their mean)."""
    losses, stage_losses = _train(own_task(f"method={method}"), 120)
    assert np.all(np.isfinite(losses))
    dataset = data.build(own_task())
    variance = float(np.var(dataset.read("train", np.arange(dataset.num_train))[1]))
    assert 0.05 < variance < 0.5  # the digits' ink varies (written out: 10 x the mean pixel)
    assert np.mean(losses[-10:]) < min(0.5 * np.mean(losses[:10]), variance), (losses, variance)
    stage_losses = np.asarray(stage_losses)
    if method == "ppll":  # the fill ticks finish no batch in the modules not reached yet
        stage_losses = stage_losses[4:]
    start, end = stage_losses[:10].mean(axis=0), stage_losses[-10:].mean(axis=0)
    assert np.all(end < 0.5 * start), (start, end)


def test_ppll_equals_local_on_the_regression_task(own_task):
    """ppll's pipeline carries the float targets down its stages with the activations: after the same 6
    steps and its flush it holds local's parameters (local's per-module losses are the squared errors
    checked above), so a cast of the targets in ppll's buffers would show here."""
    trained = []
    for method in ("local", "ppll"):
        config = own_task(f"method={method}")
        needed = layouts.devices_needed(config) or len(jax.devices())
        dataset, mesh, built = setup_lib.setup(config, jax.devices()[:needed])
        state = built.init(jax.random.key(config.seed))
        for step in range(6):
            batch = dataset.train_batch(step, config.global_batch_size, config.seed, augment=False)
            state, _ = built.train_step(state, setup_lib.put_batch(batch, mesh, built.input_sharding))
        if built.flush is not None:
            state = built.flush(state)
        trained.append(jax.device_get(built.export(state)[0]))
    assert_trees_close(trained[1], trained[0])
    assert max_diff(trained[0], jax.device_get(built.export(built.init(jax.random.key(config.seed)))[0])) > 1e-4


@pytest.mark.parametrize("method", [m if m in CI_METHODS else pytest.param(m, marks=pytest.mark.heavy)
                                    for m in sorted(methods.REGISTRY)])
def test_regression_runs_under_every_method(own_task, method):
    """Every registered method trains the regression task: a falling MSE over 60 steps."""
    losses, _ = _train(own_task(f"method={method}"))
    assert np.all(np.isfinite(losses)) and np.mean(losses[-10:]) < 0.7 * np.mean(losses[:10]), losses


def test_a_head_whose_loss_cannot_serve_the_task_is_refused(own_task):
    """InfoPro's heads train on their own cross-entropy (classification only); a head on the task's loss whose
    outputs are not the task's (per-token logits for one class per image) is refused as well."""
    config = own_task("method=local")
    net = models.build(config, (8, 8, 1), 1)
    with pytest.raises(ConfigError, match="aux_head='infopro' trains on its own loss, for task classification; "
                                          "this run's task is 'ink'"):
        aux_heads.build("infopro", net, 1, {}, task=tasks.lookup("ink"))
    gpt = cfg_lib.load_file(os.path.join(ROOT, "cdpjax", "configs", "charlm.py"))
    lm = models.build(gpt, (16,), 65, input_dtype="int32")
    with pytest.raises(ConfigError, match="aux_head='token_linear' gives module 0 outputs of shape \\(16, 65\\)"):
        aux_heads.build("token_linear", lm, 65, {}, task=tasks.CLASSIFICATION)


def test_a_regression_task_trains_from_the_command_line(tmp_path):
    """`cdpjax train --config experiments/own_task/config.py:method=local` from another folder: the
    trainer's batch check takes the task's float labels (it refused every label that was not an
    integer), and the run writes a finite test loss, the task's own metric."""
    work = tmp_path / "local"
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0")
    proc = subprocess.run([sys.executable, "-m", "cdpjax.cli", "train", "--config",
                           os.path.join(EXAMPLE, "config.py") + ":method=local,steps=3", "--workdir", str(work),
                           "--no-progress"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((work / "summary.json").read_text())
    assert summary["steps"] == 3 and np.isfinite(summary["test_loss"]), summary
