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
from cdpjax import setup as setup_lib
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
    _, _, method = setup_lib.setup(_config())
    ckpt = Checkpointer(str(workdir))
    state, meta = ckpt.restore(ckpt.latest_step(), method.init(jax.random.key(0)))
    ckpt.close()
    return jax.device_get(method.export(state)[0]), meta


def _launch_env(launch: str, pid: int, port: int) -> dict:
    """The variables a launcher sets for process `pid` of 2: a SLURM job step as `srun` sets them
    (JAX's own detection finds the processes; JAX's JAX_COORDINATOR_PORT picks the port, as
    SLURM's job id would), or JAX's coordinator variable with the count and id cdpjax reads."""
    if launch == "slurm-job-step":
        return {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "localhost", "SLURM_NTASKS": "2",
                "SLURM_PROCID": str(pid), "SLURM_LOCALID": str(pid), "JAX_COORDINATOR_PORT": str(port)}
    return {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", distributed.ENV_NUM_PROCESSES: "2",
            distributed.ENV_PROCESS_ID: str(pid)}


@pytest.mark.parametrize("launch", ["slurm-job-step", pytest.param("coordinator-variable", marks=pytest.mark.heavy)])
def test_two_processes_train_dp_as_one_process(launch, tmp_path):
    """2 processes x 4 CPU devices (gloo collectives between them) against 1 process x 8 devices:
    the same losses, test accuracy and final parameters (to float tolerance: the all-reduce sums
    in another order); process 0 alone writes the run's files; the checkpoint written by both
    restores in one process. Launched as a SLURM job step, no CDPJAX_* variable is set: JAX's own
    detection starts the run."""
    port = _free_port()
    work = tmp_path / "two"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CDPJAX_", "SLURM_", "OMPI_", "JAX_COORD"))}
    # Each process sets its own device count (--cpu-devices); the test session's flag would clash.
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if not f.startswith("--xla_force_host_platform_device_count"))
    procs = []
    for pid in range(2):
        penv = {**env, **_launch_env(launch, pid, port)}
        if launch == "slurm-job-step":
            assert not [k for k in penv if k.startswith("CDPJAX_")]
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "cdpjax.cli", "train", "--no-progress", "--cpu-devices", "4",
             "--no-compilation-cache", "--workdir", str(work), *OVERRIDES], env=penv, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True))
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
ENV = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "CDPJAX_NUM_PROCESSES": "4", "CDPJAX_PROCESS_ID": "3"}


@pytest.mark.parametrize("config,environ,cluster,expected", [
    ({}, {}, None, None),
    ({}, ENV, None, {"coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 3,
                     "source": "environment"}),
    ({"coordinator_address": "h:9", "num_processes": 2, "process_id": 1}, ENV, None,
     {"coordinator_address": "h:9", "num_processes": 2, "process_id": 1, "source": "config"}),
    ({"coordinator_address": "h:9"}, {"CDPJAX_NUM_PROCESSES": "2", "CDPJAX_PROCESS_ID": "0"}, None,
     {"coordinator_address": "h:9", "num_processes": 2, "process_id": 0, "source": "config"}),
    ({"coordinator_address": "h:9", "num_processes": 1, "process_id": 0}, {}, None, None),
    ({}, {}, ("slurm", 2, 1), {"source": "slurm", "num_processes": 2, "process_id": 1}),
    ({}, {"JAX_COORDINATOR_ADDRESS": "h:9"}, ("ompi", 4, 0),
     {"source": "ompi", "num_processes": 4, "process_id": 0, "coordinator_address": "h:9"}),
    ({}, {}, ("slurm", 1, 0), None),
    ({"auto_detect": False}, {}, ("slurm", 2, 1), None),
    ({}, ENV, ("slurm", 2, 1), {"coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 3,
                                "source": "environment"}),  # what the user set beats what was detected
], ids=["single", "environment", "config-first", "mixed", "one-process", "cluster", "cluster-and-address",
        "cluster-of-one", "detection-off", "set-beats-detected"])
def test_settings(config, environ, cluster, expected):
    c = default_config()
    for k, v in config.items():
        c.distributed[k] = v
    got = distributed.settings(c, environ, cluster=lambda: cluster)
    if got is not None:
        got = {k: v for k, v in got.items() if k != "initialization_timeout"}
    assert got == expected


OMPI = {"OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1:34911", "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}


@pytest.mark.parametrize("environ,expected", [
    ({}, None),
    (SLURM, ("slurm", 2, 1)),
    ({k: v for k, v in SLURM.items() if k != "SLURM_STEP_NODELIST"}, None),  # an allocation, not a job step
    (OMPI, ("ompi", 2, 0)),
])
def test_the_cluster_is_what_jaxs_own_detection_finds(environ, expected, monkeypatch):
    """SLURM's and Open MPI's variables as their launchers set them (JAX's documented cases)."""
    for key in list(os.environ):
        if key.startswith(("SLURM_", "OMPI_", "KUBERNETES_", "TPU_")):
            monkeypatch.delenv(key)
    for k, v in environ.items():
        monkeypatch.setenv(k, v)
    assert distributed.detect_cluster() == expected


@pytest.mark.parametrize("config,environ,message", [
    ({"coordinator_address": "host"}, {}, "must be HOST:PORT"),
    ({"coordinator_address": "h:9"}, {}, "needs the process count"),
    ({"coordinator_address": "h:9", "num_processes": 2}, {}, "process_id=-1 must be in [0, 2)"),
    ({}, {"JAX_COORDINATOR_ADDRESS": "h:9", "CDPJAX_NUM_PROCESSES": "two", "CDPJAX_PROCESS_ID": "0"},
     "num_processes='two' must be an integer"),
    ({}, {"CDPJAX_NUM_PROCESSES": "2", "CDPJAX_PROCESS_ID": "1"}, "without a coordinator address"),
])
def test_settings_that_cannot_work(config, environ, message):
    c = default_config()
    for k, v in config.items():
        c.distributed[k] = v
    with pytest.raises(ConfigError, match=re.escape(message)):
        distributed.settings(c, environ, cluster=lambda: None)


def test_initialize_passes_the_settings_to_jax(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    monkeypatch.setattr(distributed, "_started", None)
    assert distributed.initialize(default_config(), {}) is None and not calls  # one process: nothing
    env = {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:5", "CDPJAX_NUM_PROCESSES": "2", "CDPJAX_PROCESS_ID": "1"}
    distributed.initialize(default_config(), env)
    # timeout_s bounds the start-up and the heartbeats (a silent process is dead after at most
    # min(timeout_s, JAX's default 100 s)) and the wait for the others at exit.
    assert calls == [{"coordinator_address": "127.0.0.1:5", "num_processes": 2, "process_id": 1,
                      "initialization_timeout": 300, "heartbeat_timeout_seconds": 100,
                      "shutdown_timeout_seconds": 300}]
    distributed.initialize(default_config(), env)
    assert len(calls) == 1  # once per process
    monkeypatch.setattr(distributed, "_started", None)
    for k, v in SLURM.items():
        monkeypatch.setenv(k, v)
    distributed.initialize(default_config(), {})
    assert calls[-1] == {"initialization_timeout": 300, "heartbeat_timeout_seconds": 100,
                         "shutdown_timeout_seconds": 300}  # JAX reads the rest from SLURM


def test_processes_with_different_configs_refuse_in_one_line_each(tmp_path):
    """num_steps 100 on process 0 and 50 on process 1 (they would wait for each other forever):
    each compares the configs through the coordinator and ends with one line naming the key and
    both values, exit 2, before any device work."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CDPJAX_", "SLURM_", "OMPI_", "JAX_COORD"))}
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if not f.startswith("--xla_force_host_platform_device_count"))
    procs = [subprocess.Popen(
        [sys.executable, "-m", "cdpjax.cli", "train", "--no-progress", "--cpu-devices", "4", "--no-compilation-cache",
         "--workdir", str(tmp_path / "two"), "--config.method=dp", f"--config.num_steps={steps}",
         "--config.distributed.timeout_s=60"],
        env={**env, **_launch_env("coordinator-variable", pid, port)}, stderr=subprocess.PIPE, text=True)
        for pid, steps in ((0, 100), (1, 50))]
    try:
        errs = [p.communicate(timeout=3600)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for me, (p, err) in enumerate(zip(procs, errs)):
        ours = [x for x in err.splitlines() if x.startswith("cdpjax: ")]
        assert p.returncode == 2 and "Traceback" not in err, err[-3000:]
        values = ("100 here, 50 there") if me == 0 else ("50 here, 100 there")
        assert ours == [f"cdpjax: error: process {me} and process {1 - me} of this run have different configs "
                        f"(num_steps={values}): start every process with the same command and config"], err[-3000:]
    assert not (tmp_path / "two" / "checkpoints").exists() or not list((tmp_path / "two" / "checkpoints").iterdir())
