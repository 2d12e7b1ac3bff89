"""Multi-process runs: two processes on this machine, 4 simulated CPU devices each, train dp as
one process with the same 8 devices does; how a process finds the others (config,
environment, SLURM), with a clear error for settings that cannot work; and which GPUs it drives
(a process per host or per GPU, the launchers' variables stood in)."""
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


# Which GPUs a process drives -----------------------------------------------------------------

GPUS = 8  # the GPUs of each host below


def _slurm_step(tasks_per_node: int, nodes: int, node: int, local: int, step_counts: str | None) -> dict:
    """A SLURM job step's variables for the process of local rank `local` on node `node` (what
    `srun --nodes=NODES --ntasks-per-node=TASKS --gpus-per-node=8` sets; `step_counts`: its
    SLURM_STEP_TASKS_PER_NODE, or None for a launch that only sets SLURM_NTASKS_PER_NODE)."""
    env = {"SLURM_JOB_ID": "42", "SLURM_STEP_NODELIST": f"node[1-{nodes}]", "SLURM_NTASKS": str(tasks_per_node * nodes),
           "SLURM_PROCID": str(node * tasks_per_node + local), "SLURM_LOCALID": str(local),
           "SLURM_NODEID": str(node), "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(GPUS)))}
    if step_counts is None:
        env["SLURM_NTASKS_PER_NODE"] = str(tasks_per_node)
    else:
        env["SLURM_STEP_TASKS_PER_NODE"] = step_counts
    return env


def _mpirun(per_host: int, hosts: int, host: int, local: int) -> dict:
    """Open MPI's variables under `mpirun -np N` (N = per_host * hosts) for one process; no
    CUDA_VISIBLE_DEVICES: the host's GPUs are its device files."""
    return {"OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1:34911",
            "OMPI_COMM_WORLD_SIZE": str(per_host * hosts), "OMPI_COMM_WORLD_RANK": str(host * per_host + local),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(local), "OMPI_COMM_WORLD_LOCAL_SIZE": str(per_host)}


# (the launcher's variables, the processes on this host, this process's local rank, the GPUs it sees)
LAUNCHES = {
    "srun-one-task-per-node": (_slurm_step(1, 4, 2, 0, "1(x4)"), 1, 0, GPUS),
    "srun-one-task-per-gpu": (_slurm_step(8, 4, 1, 5, "8(x4)"), 8, 5, GPUS),
    "srun-ntasks-per-node-1": (_slurm_step(1, 4, 3, 0, None), 1, 0, GPUS),
    "srun-uneven-alone-here": (_slurm_step(1, 2, 1, 0, "8,1"), 1, 0, GPUS),
    "srun-uneven-eight-here": ({**_slurm_step(8, 2, 0, 3, "8,1"), "SLURM_NTASKS": "9"}, 8, 3, GPUS),
    # --gpus-per-task=1: SLURM shows each task its own GPU alone
    "srun-gpus-per-task-1": ({**_slurm_step(8, 4, 1, 5, "8(x4)"), "CUDA_VISIBLE_DEVICES": "5"}, 8, 5, 1),
    "mpirun-one-per-host": (_mpirun(1, 4, 1, 0), 1, 0, GPUS),
    "mpirun-one-per-gpu": (_mpirun(8, 2, 1, 6), 8, 6, GPUS),
}


@pytest.fixture
def cluster_env(monkeypatch, tmp_path):
    """Sets a launch's variables in this process (JAX's detection reads os.environ) and a /dev
    with a host's NVIDIA device files (8 GPUs, the control files beside them)."""
    for key in list(os.environ):
        if key.startswith(("SLURM_", "OMPI_", "KUBERNETES_", "TPU_", "JAX_COORD", "CDPJAX_")) or key in (
                "JAX_LOCAL_DEVICE_IDS", "CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
            monkeypatch.delenv(key)
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in [*(f"nvidia{i}" for i in range(GPUS)), "nvidiactl", "nvidia-uvm", "nvidia-modeset"]:
        (dev / name).touch()
    monkeypatch.setattr(distributed, "DEV", str(dev))
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    monkeypatch.setattr(distributed, "_started", None)

    def launch(env):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        return calls

    return launch


def _visible_after(kwargs):
    """The GPUs JAX's initialize then makes visible (jax_cuda_visible_devices): JAX's own detection
    run on what cdpjax passed, as initialize runs it, without starting the distributed service."""
    import inspect

    from jax._src import clusters

    detect = clusters.ClusterEnv.auto_detect_unset_distributed_params
    given = {"coordinator_address": kwargs.get("coordinator_address"), "num_processes": kwargs.get("num_processes"),
             "process_id": kwargs.get("process_id"), "local_device_ids": kwargs.get("local_device_ids"),
             "initialization_timeout": kwargs["initialization_timeout"]}
    # Its arguments by name, as this JAX version has them (the detection method's name and the
    # timeout came and went across versions; None picks the method as initialize does).
    accepted = inspect.signature(detect).parameters
    return detect(**{k: given.get(k) for k in accepted})[3]


@pytest.mark.parametrize("launch", LAUNCHES)
def test_a_process_alone_on_its_host_drives_every_gpu_and_one_per_gpu_drives_its_own(launch, cluster_env):
    """The arguments jax.distributed.initialize receives: every GPU the process sees (0..7) where the
    launcher starts one process on its host (`srun --ntasks-per-node=1`, `mpirun` with one process
    per host); the one it sees where it sees one (numbered 0 then); none where it starts one per
    GPU, all seen, JAX then giving local rank r GPU r alone."""
    env, per_host, local, seen = LAUNCHES[launch]
    calls = cluster_env(env)
    distributed.initialize(default_config())
    [kwargs] = calls
    expected = list(range(seen)) if per_host == 1 or seen == 1 else None
    assert kwargs.get("local_device_ids") == expected
    assert list(_visible_after(kwargs)) == (expected or [local])
    assert "num_processes" not in kwargs and "process_id" not in kwargs  # JAX takes them from the cluster


@pytest.mark.parametrize("config_ids,variable,expected", [
    ([2, 3], "4,5", [2, 3]),  # the config first
    ((), "4,5", [4, 5]),  # JAX's own variable, passed on as JAX reads it
    ((), "", list(range(GPUS))),  # (empty: unset)
])
@pytest.mark.parametrize("launch", ["srun-one-task-per-node", "srun-one-task-per-gpu", "mpirun-one-per-gpu"])
def test_the_gpus_given_beat_what_the_launch_implies(launch, config_ids, variable, expected, cluster_env):
    env, per_host, _, _ = LAUNCHES[launch]
    calls = cluster_env({**env, "JAX_LOCAL_DEVICE_IDS": variable})
    c = default_config()
    c.distributed.local_device_ids = config_ids
    distributed.initialize(c)
    given = config_ids or variable
    assert calls[0].get("local_device_ids") == (expected if given or per_host == 1 else None)


def test_the_gpus_counted_without_jax(tmp_path):
    """What the host lets the process see, by the variables' own rules, else the device files."""
    empty = tmp_path / "empty"
    empty.mkdir()
    for environ, expected in [({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 4), ({"CUDA_VISIBLE_DEVICES": "GPU-a1,GPU-b2"}, 2),
                              ({"CUDA_VISIBLE_DEVICES": "1,-1,2"}, 1), ({"CUDA_VISIBLE_DEVICES": ""}, 0),
                              ({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, 0), ({"ROCR_VISIBLE_DEVICES": "0,1"}, 2),
                              ({"SLURM_GPUS_ON_NODE": "4"}, 4), ({}, None)]:
        assert distributed.local_gpus(environ, str(empty)) == expected, environ


def test_a_host_without_gpus_or_a_launch_that_does_not_say_is_left_to_jax(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    alone, _, _, _ = LAUNCHES["srun-one-task-per-node"]
    no_gpus = {k: v for k, v in alone.items() if k != "CUDA_VISIBLE_DEVICES"}
    assert distributed.local_device_ids(default_config(), no_gpus, "slurm", str(empty)) is None
    unsaid = {k: v for k, v in alone.items() if k != "SLURM_STEP_TASKS_PER_NODE"}
    assert distributed.local_device_ids(default_config(), unsaid, "slurm", str(empty)) is None
    # Kubernetes, Cloud TPU: JAX leaves every device visible itself
    assert distributed.local_device_ids(default_config(), alone, "tpu", str(empty)) is None


@pytest.mark.parametrize("config_ids,variable,message", [
    ([0, 0], "", "distributed.local_device_ids=[0, 0] must be a list of distinct device numbers"),
    ([-1], "", "distributed.local_device_ids=[-1] must be"),
    ((), "0,x", "JAX_LOCAL_DEVICE_IDS='0,x' must be"),
])
def test_gpus_that_cannot_be_refuse_in_one_line(config_ids, variable, message):
    c = default_config()
    c.distributed.local_device_ids = config_ids
    with pytest.raises(ConfigError, match=re.escape(message)):
        distributed.local_device_ids(c, {"JAX_LOCAL_DEVICE_IDS": variable}, "slurm")


def test_the_process_count_of_a_cluster_is_bounded_on_the_command_line(monkeypatch, tmp_path, capsys):
    """A count past config.PROCESS_LIMIT from SLURM refuses in one line naming the variable."""
    from cdpjax import cli
    from cdpjax import config as cfg_lib

    for key in list(os.environ):
        if key.startswith(("SLURM_", "OMPI_", "KUBERNETES_", "TPU_", "JAX_COORD", "CDPJAX_")):
            monkeypatch.delenv(key)
    too_many = cfg_lib.PROCESS_LIMIT + 1
    for k, v in {**SLURM, "SLURM_NTASKS": str(too_many)}.items():
        monkeypatch.setenv(k, v)
    code = cli.main(["train", "--config", "digits", "--workdir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code != 0 and f"SLURM_NTASKS={too_many}: a run has at most {cfg_lib.PROCESS_LIMIT} processes" in err, err
    cli.check_process_count({"source": "slurm", "num_processes": 2})  # within the bound: no error


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
