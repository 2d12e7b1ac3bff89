"""Multi-process runs: two processes on this machine, 4 simulated CPU devices each, train dp as
one process with the same 8 devices does; and how a process finds the others (config,
environment, SLURM), with a clear error for settings that cannot work."""
import json
import os
import re
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from cdpjax import distributed, train
from cdpjax.checkpoint import Checkpointer
from cdpjax.config import ConfigError, default_config

STEPS = 6


def _config():
    c = default_config()
    c.method = "dp"
    c.global_batch_size = 64
    c.num_steps = STEPS
    c.checkpoint_every = 3
    c.eval_every = 3
    c.log_every = 2
    # With augmentation each process draws the random crops of its own slice, so only the
    # un-augmented stream is the same whatever the process count (docs/guarantees.md).
    c.augment = False
    return c


OVERRIDES = ["--config.method=dp", "--config.global_batch_size=64", f"--config.num_steps={STEPS}",
             "--config.checkpoint_every=3", "--config.eval_every=3", "--config.log_every=2",
             "--config.augment=False"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _params(workdir):
    _, _, method = train.setup(_config())
    ckpt = Checkpointer(str(workdir))
    state, meta = ckpt.restore(ckpt.latest_step(), method.init(jax.random.key(0)))
    ckpt.close()
    return jax.device_get(method.export(state)[0]), meta


def test_two_processes_train_dp_as_one_process(tmp_path):
    """2 processes x 4 CPU devices (gloo collectives between them) against 1 process x 8 devices:
    the same losses, test accuracy and final parameters (to float tolerance: the all-reduce sums
    in another order); process 0 alone writes the run's files; the checkpoint written by both
    restores in one process."""
    port = _free_port()
    work = tmp_path / "two"
    env = dict(os.environ)
    # Each process sets its own device count (--cpu-devices); the test session's flag would clash.
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if not f.startswith("--xla_force_host_platform_device_count"))
    procs = []
    for pid in range(2):
        penv = {**env, distributed.ENV_COORDINATOR: f"127.0.0.1:{port}", distributed.ENV_NUM_PROCESSES: "2",
                distributed.ENV_PROCESS_ID: str(pid)}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "cdpjax.cli", "train", "--no-progress", "--cpu-devices", "4",
             "--workdir", str(work), *OVERRIDES], env=penv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    assert "test accuracy" in outs[0][1] and "test accuracy" not in outs[1][1]

    single = train.train(_config(), str(tmp_path / "one"), progress=False)
    two = json.loads((work / "summary.json").read_text())
    assert two["processes"] == 2 and two["devices"] == 8 and single["devices"] == 8
    assert two["test_accuracy"] == pytest.approx(single["test_accuracy"], abs=1e-9)
    lines = [[json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (work, tmp_path / "one")]
    assert [(r["step"], r["split"]) for r in lines[0]] == [(r["step"], r["split"]) for r in lines[1]]
    for a, b in zip(*lines):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5)
        assert a["accuracy"] == b["accuracy"]
    params_two, meta = _params(work)
    params_one, _ = _params(tmp_path / "one")
    assert meta["processes"] == 2
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5), params_two, params_one)


# How a process finds the others ---------------------------------------------------------------

SLURM = {"SLURM_JOB_ID": "42", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
         "SLURM_LOCALID": "0"}


@pytest.mark.parametrize("config,environ,expected", [
    ({}, {}, None),
    ({}, {"CDPJAX_COORDINATOR": "10.0.0.1:1234", "CDPJAX_NUM_PROCESSES": "4", "CDPJAX_PROCESS_ID": "3"},
     {"coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 3, "source": "environment"}),
    ({"coordinator_address": "h:9", "num_processes": 2, "process_id": 1},
     {"CDPJAX_COORDINATOR": "10.0.0.1:1234", "CDPJAX_NUM_PROCESSES": "4", "CDPJAX_PROCESS_ID": "3"},
     {"coordinator_address": "h:9", "num_processes": 2, "process_id": 1, "source": "config"}),
    ({"coordinator_address": "h:9"}, {"CDPJAX_NUM_PROCESSES": "2", "CDPJAX_PROCESS_ID": "0"},
     {"coordinator_address": "h:9", "num_processes": 2, "process_id": 0, "source": "config"}),
    ({"coordinator_address": "h:9", "num_processes": 1, "process_id": 0}, {}, None),
    ({}, SLURM, {"source": "slurm"}),
    ({}, {**SLURM, "SLURM_NTASKS": "1"}, None),
    ({"auto_detect": False}, SLURM, None),
    ({}, {k: v for k, v in SLURM.items() if k != "SLURM_STEP_NODELIST"}, None),  # an allocation, not a step
], ids=["single", "environment", "config-first", "mixed", "one-process", "slurm", "slurm-one-task",
        "slurm-off", "slurm-no-step"])
def test_settings(config, environ, expected):
    c = default_config()
    for k, v in config.items():
        c.distributed[k] = v
    got = distributed.settings(c, environ)
    if got is not None:
        got = {k: v for k, v in got.items() if k != "initialization_timeout"}
    assert got == expected


@pytest.mark.parametrize("config,environ,message", [
    ({"coordinator_address": "host"}, {}, "must be HOST:PORT"),
    ({"coordinator_address": "h:9"}, {}, "needs the process count"),
    ({"coordinator_address": "h:9", "num_processes": 2}, {}, "process_id=-1 must be in [0, 2)"),
    ({}, {"CDPJAX_COORDINATOR": "h:9", "CDPJAX_NUM_PROCESSES": "two", "CDPJAX_PROCESS_ID": "0"},
     "num_processes='two' must be an integer"),
    ({}, {"CDPJAX_NUM_PROCESSES": "2", "CDPJAX_PROCESS_ID": "1"}, "without a coordinator address"),
])
def test_settings_that_cannot_work(config, environ, message):
    c = default_config()
    for k, v in config.items():
        c.distributed[k] = v
    with pytest.raises(ConfigError, match=re.escape(message)):
        distributed.settings(c, environ)


def test_initialize_passes_the_settings_to_jax(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    monkeypatch.setattr(distributed, "_started", None)
    assert distributed.initialize(default_config(), {}) is None and not calls  # one process: nothing
    env = {"CDPJAX_COORDINATOR": "127.0.0.1:5", "CDPJAX_NUM_PROCESSES": "2", "CDPJAX_PROCESS_ID": "1"}
    distributed.initialize(default_config(), env)
    # timeout_s bounds the start-up and the heartbeats (a silent process is dead after at most
    # min(timeout_s, JAX's default 100 s)) and the wait for the others at exit.
    assert calls == [{"coordinator_address": "127.0.0.1:5", "num_processes": 2, "process_id": 1,
                      "initialization_timeout": 300, "heartbeat_timeout_seconds": 100,
                      "shutdown_timeout_seconds": 300}]
    distributed.initialize(default_config(), env)
    assert len(calls) == 1  # once per process
    monkeypatch.setattr(distributed, "_started", None)
    distributed.initialize(default_config(), SLURM)
    assert calls[-1] == {"initialization_timeout": 300, "heartbeat_timeout_seconds": 100,
                         "shutdown_timeout_seconds": 300}  # JAX reads the rest from SLURM
