"""The foundation's claims: dp equals e2e, resume equals an uninterrupted run, the default trains,
and bad input fails early with a message naming the value."""
import json
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from cdpjax import data, methods, train
from cdpjax import setup as setup_lib
from cdpjax.cli import main
from cdpjax.config import ConfigError, default_config
from cdpjax.mesh import make_mesh
from metrics_lines import without_timing


def _run(config, name, steps, mesh_axes):
    config.method = name
    ds = data.build(config)
    mesh = make_mesh(mesh_axes)
    method = methods.build(methods.Context(config, mesh, ds.image_shape, ds.num_classes))
    state = method.init(jax.random.key(config.seed))
    losses = []
    for k in range(steps):
        state, metrics = method.train_step(state, ds.train_batch(k, config.global_batch_size, config.seed))
        losses.append(float(metrics["loss"]))
    return losses, jax.device_get(method.export(state))


@pytest.mark.parametrize("model,norm", [("mlp", "batch"), ("mlp", "none")])
def test_dp_equals_e2e(digits_config, model, norm):
    """dp on 8 devices: same losses and parameters as e2e on one device for the same global batch
    (cross-device BatchNorm statistics)."""
    c = digits_config
    c.model, c.norm, c.bn_cross_device = model, norm, True
    e2e_losses, e2e_params = _run(c, "e2e", 3, {"data": -1})
    dp_losses, dp_params = _run(c, "dp", 3, {"data": -1})
    np.testing.assert_allclose(dp_losses, e2e_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-5), dp_params, e2e_params)


def test_dp_gradient_is_mean_not_sum(digits_config):
    """One SGD step without momentum moves dp's parameters exactly as e2e's: a pmean after shard_map's
    own sum would move them 8 times as far."""
    c = digits_config
    c.momentum, c.weight_decay, c.schedule = 0.0, 0.0, "constant"
    _, e2e_params = _run(c, "e2e", 1, {"data": -1})
    _, dp_params = _run(c, "dp", 1, {"data": -1})
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), dp_params, e2e_params)


def _final_params(config, workdir):
    from cdpjax.checkpoint import Checkpointer

    _, _, method = setup_lib.setup(config)
    ckpt = Checkpointer(workdir)
    state, _ = ckpt.restore(ckpt.latest_step(), method.init(jax.random.key(config.seed)))
    ckpt.close()
    return jax.device_get(method.export(state)[0])


@pytest.mark.parametrize("method", ["dp"])
def test_resume_equals_uninterrupted(digits_config, tmp_path, method):
    c = digits_config
    c.method, c.num_steps, c.checkpoint_every, c.eval_every, c.norm = method, 12, 4, 4, "batch"
    full = train.train(c, str(tmp_path / "full"), progress=False)
    part = tmp_path / "part"
    assert train.train(c, str(part), progress=False, stop_after=6) == {"stopped_at": 6}  # killed after step 6
    resumed = train.train(c, str(part), progress=False)
    assert resumed["resumed_from"] == 4
    jax.tree.map(np.testing.assert_array_equal, _final_params(c, str(part)), _final_params(c, str(tmp_path / "full")))
    assert resumed["test_accuracy"] == full["test_accuracy"]
    read = lambda d: without_timing((d / "metrics.jsonl").read_text())  # noqa: E731
    assert read(part) == read(tmp_path / "full")


def test_summary_and_metrics_files(digits_config, tmp_path):
    """10 steps of dp, logging every 10 and evaluating every 5: summary.json says what ran, and
    metrics.jsonl has a train line at step 10 and test lines at steps 5 and 10, in that order (the
    test line of a step after its train line), each with a loss and an accuracy in [0, 1]; the
    summary's test accuracy is the last test line's."""
    c = digits_config
    c.method, c.num_steps, c.eval_every = "dp", 10, 5
    s = train.train(c, str(tmp_path), progress=False)
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in ("method", "model", "dataset", "devices", "steps", "test_accuracy", "images_per_second", "wall_seconds"):
        assert key in summary
    assert (summary["method"], summary["model"], summary["dataset"]) == ("dp", "mlp", "digits")
    assert summary["devices"] == 8 and summary["steps"] == s["steps"] == 10
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["split"]) for r in records] == [(5, "test"), (10, "train"), (10, "test")]
    for r in records:
        assert r["loss"] > 0 and 0 <= r["accuracy"] <= 1
    assert summary["test_accuracy"] == records[-1]["accuracy"]


BAD_INPUT = [
    (["--config.method=sgd-magic"], "unknown method 'sgd-magic'"),
    (["--config.model=resnet9000"], "unknown model 'resnet9000'"),
    (["--config.dataset=mnist-ultra"], "unknown dataset 'mnist-ultra'"),
    (["--config.method=dp", "--config.global_batch_size=100"], "global_batch_size=100 is not divisible by mesh.data=8"),
    (["--config.mesh.data=16"], "needs 16 devices but only 8 exist"),
    (["--config.mesh.data=3"], "must multiply to 8"),
    (["--config.stages=9"], "stages=9 but mlp has only 4 blocks"),
    (["--config.learning_rate=fast"], "learning_rate must be a number, got 'fast'"),
    (["--config.num_steps=ten"], "num_steps must be a number, got 'ten'"),
    (["--config.nosuchkey=1"], "unknown config key 'nosuchkey'"),
]


class _Device:
    """A device of another backend as make_mesh sees it (its platform); the mesh is refused before
    any is used."""

    def __init__(self, platform):
        self.platform = platform


# (backend, mesh, devices there are, method, cdp_impl, what the hint must say): by hand, from what
# helps there: CPU devices are simulated (--cpu-devices); an accelerator's are the host's, so a data
# axis of -1 takes them (CDP's ring needs a device per worker, its `simulate` does not); a fixed
# stage axis larger than the host needs more hosts.
MESH_HINTS = [
    ("cpu", {"data": 8}, 4, "cdp-v2", "ring", "(on CPU, more can be simulated with --cpu-devices)"),
    ("gpu", {"data": 8}, 4, "cdp-v2", "ring", "(on GPUs, --config.mesh.data=-1 --config.cdp_impl=simulate runs "
                                              "on the 4 there are: cdp-v2's workers then share them)"),
    ("gpu", {"data": 8}, 4, "cdp-v1", "simulate", "(on GPUs, --config.mesh.data=-1 runs on the 4 there are, as "
                                                  "the mesh {'data': 4})"),
    ("gpu", {"data": 8}, 2, "dp", "ring", "(on GPUs, --config.mesh.data=-1 runs on the 2 there are, as the mesh "
                                          "{'data': 2})"),
    ("tpu", {"stage": 2, "data": 4}, 4, "gpipe", "ring", "(on TPUs, --config.mesh.data=-1 runs on the 4 there "
                                                         "are, as the mesh {'stage': 2, 'data': 2})"),
    ("gpu", {"stage": 4}, 2, "ppll", "ring", "(on GPUs, run on a host with more, or on several hosts: "
                                             "docs/guarantees.md, multi-process runs)"),
    ("cuda", {"data": 8}, 2, "dp", "ring", "(on GPUs, --config.mesh.data=-1 runs on the 2 there are, as the mesh "
                                           "{'data': 2})"),
    ("neuron", {"data": 8}, 2, "dp", "ring", "(on neuron devices, --config.mesh.data=-1 runs on the 2 there are, "
                                             "as the mesh {'data': 2})"),
]


@pytest.mark.parametrize("platform,mesh,count,method,impl,hint", MESH_HINTS,
                         ids=[f"{p}-{m}-{i}" for p, _, _, m, i, _ in MESH_HINTS])
def test_too_few_devices_hint_what_helps_on_that_backend(platform, mesh, count, method, impl, hint):
    total = int(np.prod(list(mesh.values())))
    with pytest.raises(ConfigError) as refused:
        make_mesh(mesh, [_Device(platform)] * count, method, impl)
    assert str(refused.value) == f"mesh {mesh} needs {total} devices but only {count} exist {hint}"
    if platform != "cpu":
        assert "--cpu-devices" not in str(refused.value)


GUARANTEES = pathlib.Path(__file__).resolve().parent.parent / "docs" / "guarantees.md"


def _gpu_commands() -> list[tuple[int, str]]:
    """(devices, command) for each `cdpjax train` of the bash blocks of docs/guarantees.md's one-host
    and cluster sections: the devices the comment above it names (`on 8 GPUs`, `a mesh of 32
    devices`; a comment without a count keeps the one before), the command from `cdpjax` on (a
    launcher's prefix dropped, continued lines joined). The simulated-CPU recipe is not one."""
    text = GUARANTEES.read_text()
    sections = text[text.index("## One host, several GPUs"):]
    after = sections.find("\n## ", sections.index("## Multi-host"))
    sections = sections if after < 0 else sections[:after]
    found, count = [], None
    for block in re.findall(r"```bash\n(.*?)```", sections, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.startswith("#"):
                counts = re.findall(r"(\d+) (?:GPUs|devices)\b", line)
                count = int(counts[-1]) if counts else count
            elif "cdpjax train" in line and "--cpu-devices" not in line:
                found.append((count, line[line.index("cdpjax train"):].split("  #")[0].strip()))
    return found


BUILD_SCRIPT = """
import json, shlex, sys
import jax
jax.config.update("jax_num_cpu_devices", max(n for n, _ in json.loads(sys.argv[1])))
from cdpjax import checks, cli, layouts, methods
from cdpjax import config as cfg_lib
from cdpjax.mesh import make_mesh
out = []
for n, command in json.loads(sys.argv[1]):
    parsed = {}
    cli.cmd_train = lambda args, overrides: parsed.update(args=args, overrides=overrides) or 0
    assert cli.main(shlex.split(command)[1:]) == 0, command
    c = cli._load(parsed["args"], parsed["overrides"])
    cfg_lib.validate(c)
    checks.validate(c)
    mesh = make_mesh(layouts.mesh_for(c), jax.devices()[:n], c.method, c.cdp_impl)
    methods.build(methods.Context(c, mesh, (32, 32, 3), 10))  # CIFAR-10's images and classes
    out.append({k: int(v) for k, v in mesh.shape.items()})
print(json.dumps(out))
"""


def test_the_commands_for_one_host_and_for_a_cluster_build_on_their_devices():
    """Each GPU command of docs/guarantees.md parses, its config and overrides load and validate, and
    its method builds (CDP's ring or simulate, DP) on the devices its comment names (simulated CPU
    devices stand in for the GPUs; a cluster's processes together hold them): every one a data
    mesh over all of them ({'data': N})."""
    commands = _gpu_commands()
    assert len(commands) >= 8 and {n for n, _ in commands} == {4, 8, 32}, commands
    done = subprocess.run([sys.executable, "-c", BUILD_SCRIPT, json.dumps(commands)], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [{"data": n} for n, _ in commands]


@pytest.mark.parametrize("args,message", BAD_INPUT, ids=[m for _, m in BAD_INPUT])
def test_bad_input_fails_before_compiling(args, message, capsys, tmp_path, compiles):
    """Exit status 2 and one line (no "training ... in DIR" line before it: the checks that need
    the model or the mesh run before the trainer says what it will do)."""
    code = main(["train", "--no-progress", "--workdir", str(tmp_path), "--config.method=dp", *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert not [c for c in compiles if c[0] == "backend"], compiles
    assert not (tmp_path / "summary.json").exists()


def test_bad_input_subprocess_exits_nonzero_without_traceback(tmp_path):
    command = [sys.executable, "-m", "cdpjax.cli", "train", "--config.method=nope", "--workdir", str(tmp_path)]
    proc = subprocess.run(command, capture_output=True, text=True)
    assert proc.returncode == 2
    assert "unknown method 'nope'" in proc.stderr and "Traceback" not in proc.stderr


def test_config_file_and_overrides(tmp_path):
    from cdpjax.config import apply_overrides, load_file

    path = tmp_path / "c.py"
    path.write_text('"""doc"""\nfrom cdpjax.config import default_config\n\ndef get_config():\n'
                    '    c = default_config()\n    c.method = "dp"\n    return c\n')
    c = load_file(str(path))
    apply_overrides(c, ["mesh.data=4", "mesh.stage=2", "learning_rate=0.5", "stages=[1, 3]"])
    assert c.method == "dp" and c.mesh.data == 4 and c.mesh.stage == 2 and c.learning_rate == 0.5
    assert list(c.stages) == [1, 3]
    with pytest.raises(ConfigError, match="mesh axis size mesh.data='x'"):
        apply_overrides(c, ["mesh.data='x'"])
    with pytest.raises(ConfigError, match=r"^mesh=\{'data': 2\}: the mesh is set an axis at a time"):
        apply_overrides(c, ['mesh={"data": 2}'])


def test_default_command_trains_digits(tmp_path):
    """`cdpjax train` with no arguments: at least 97% on digits (here: in a subprocess, as a user
    runs it; well under a minute on a quiet 2-core machine, which a test under load cannot hold
    it to)."""
    proc = subprocess.run([sys.executable, "-m", "cdpjax.cli", "train", "--no-progress"], cwd=tmp_path,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (workdir,) = (tmp_path / "workdirs").iterdir()
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["method"] == default_config().method and summary["dataset"] == "digits"
    assert summary["test_accuracy"] >= 0.97, summary
    assert str(workdir.name) in proc.stderr
