"""Multi-process runs: several processes (one per host, or one per GPU) drive one global mesh.

`initialize(config)` starts `jax.distributed` before any device is used. How a process
finds the others comes, in this order, from

1. `config.distributed.coordinator_address`, `.num_processes`, `.process_id`;
2. JAX's own variable for the coordinator, `JAX_COORDINATOR_ADDRESS`, with the process
   count and id where JAX has no variable for them: `CDPJAX_NUM_PROCESSES`,
   `CDPJAX_PROCESS_ID` (or the cluster, 3);
3. JAX's own cluster detection (`jax.distributed.initialize()` without arguments: SLURM job
   steps, Open MPI's `mpirun`, Kubernetes, Cloud TPU; `JAX_COORDINATOR_PORT` picks the
   port), used where it finds a cluster of more than one process (`distributed.auto_detect`).

Which GPUs a process drives (`local_device_ids`): under SLURM and `mpirun` JAX alone would
give each process one GPU, the one of its local rank, which is right for one process per GPU
(`srun --ntasks-per-node=8 --gpus-per-node=8`) and wrong for one process per host
(`--ntasks-per-node=1`): each would drive GPU 0 alone. So where the launcher says that this
process is its host's only one (SLURM_STEP_TASKS_PER_NODE, SLURM_NTASKS_PER_NODE or
SLURM_TASKS_PER_NODE; OMPI_COMM_WORLD_LOCAL_SIZE), cdpjax passes every GPU the host lets it
see (`local_gpus`); a process that sees one GPU (`srun --gpus-per-task=1`) gets that one;
elsewhere it leaves JAX's choice. `distributed.local_device_ids`, else JAX's own
JAX_LOCAL_DEVICE_IDS, overrides these.

With none of these, or a single process, nothing is started. On CPU the
cross-process collectives go through gloo. An address must be HOST:PORT (a port in
1..65535, a host name that resolves, an IPv6 address in brackets): anything else is a
ConfigError before JAX is asked. `distributed.timeout_s` bounds how long the processes
wait for each other at start-up and how long a silent process is waited for later (JAX's
heartbeat timeout, at most its default of 100 s), after which JAX's coordination service
ends every process; `cdpjax.supervisor` turns that end into one line naming the process
that vanished. Once started, the processes compare their configurations through the
coordinator's key-value store (`check_same_config`) and refuse a difference in one line on
every process. After initialisation `jax.devices()`
lists every process's devices and the mesh spans them all; each process reads its
own contiguous slice of every global batch (`cdpjax.data.base`), the trainer
assembles global arrays from these slices, every process takes part in each
checkpoint, and process 0 alone writes config.json, metrics.jsonl and summary.json.
"""
from __future__ import annotations

import inspect
import json
import os
import re
import socket
from typing import Mapping

from cdpjax.config import check_address, check_device_ids
from cdpjax.errors import ConfigError

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"  # JAX's own: jax.distributed.initialize reads it too
ENV_NUM_PROCESSES = "CDPJAX_NUM_PROCESSES"  # JAX has no variable for the count...
ENV_PROCESS_ID = "CDPJAX_PROCESS_ID"  # ... nor for the id: its cluster detection finds them
ENV_LOCAL_DEVICE_IDS = "JAX_LOCAL_DEVICE_IDS"  # JAX's own too ("0,1,2,3"), read where no ids are passed
# The clusters for which JAX restricts a process to the GPU of its local rank (their
# `get_local_process_id`); JAX's other cluster types leave every GPU visible.
ONE_GPU_CLUSTERS = ("slurm", "ompi")
DEV = "/dev"  # where NVIDIA's device files are (`local_gpus`)
_started: dict | None = None


def detect_cluster() -> tuple[str, int, int] | None:
    """(name, process count, process id) of the cluster JAX's own detection finds in this
    process's environment (the first present of its cluster types, in JAX's order, less the
    opt-in ones such as mpi4py), or None. What it reads is JAX's: SLURM_* of a job step,
    OMPI_* under mpirun, Kubernetes' and Cloud TPU's own."""
    try:
        from jax._src import clusters  # JAX's cluster detection, as jax.distributed.initialize() runs it
        types = list(clusters.ClusterEnv._cluster_types)
    except (ImportError, AttributeError):
        return None
    for env in types:
        try:
            if getattr(env, "opt_in_only_method", False) or not env.is_env_present():
                continue
            return str(getattr(env, "name", env.__name__)), int(env.get_process_count()), int(env.get_process_id())
        except Exception:  # noqa: BLE001 - a cluster type that cannot tell: as JAX, try the next
            continue
    return None


def _slurm_counts(text: str) -> list[int]:
    """SLURM's compressed per-node task counts ('8(x2),4' -> [8, 8, 4]); [] if unreadable."""
    counts = []
    for part in text.split(",") if text.strip() else []:
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            return []
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def tasks_on_this_host(source: str | None, environ: Mapping[str, str]) -> int | None:
    """How many processes of the run the launcher starts on this process's host, or None where it
    does not say. SLURM: the job step's per-node counts (this node's: SLURM_NODEID), else the
    --ntasks-per-node asked for, else the job's per-node counts; Open MPI: the local size."""
    if source == "slurm":
        for var in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
            counts = _slurm_counts(environ.get(var, ""))
            if not counts:
                continue
            if len(set(counts)) == 1:
                return counts[0]
            node = environ.get("SLURM_NODEID", "")
            return counts[int(node)] if node.isdigit() and int(node) < len(counts) else None
        return None
    if source == "ompi":
        size = environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "")
        return int(size) if size.strip().isdigit() else None
    return None


def _visible(text: str) -> int:
    """The devices a CUDA_VISIBLE_DEVICES-like list shows: its entries up to the first invalid one
    (CUDA's rule: '-1' or an empty list hides every device; SLURM writes 'NoDevFiles' for none)."""
    count = 0
    for entry in (e.strip() for e in text.split(",")):
        if not entry or entry.startswith("-") or entry == "NoDevFiles":
            break
        count += 1
    return count


def local_gpus(environ: Mapping[str, str], dev: str | None = None) -> int | None:
    """The GPUs this host lets this process see, counted without JAX (whose backends must not
    start before `jax.distributed`): CUDA_VISIBLE_DEVICES (ROCR_VISIBLE_DEVICES,
    HIP_VISIBLE_DEVICES on AMD) where set, else SLURM_GPUS_ON_NODE, else NVIDIA's device files
    (`dev`/nvidia0, nvidia1...; `dev` defaults to DEV); None where nothing says."""
    for var in ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
        if var in environ:
            return _visible(environ[var])
    on_node = environ.get("SLURM_GPUS_ON_NODE", "").strip()
    if on_node.isdigit():
        return int(on_node)
    try:
        found = sum(1 for name in os.listdir(DEV if dev is None else dev) if re.fullmatch(r"nvidia\d+", name))
    except OSError:
        return None
    return found or None


def local_device_ids(config, environ: Mapping[str, str], cluster_name: str | None,
                     dev: str | None = None) -> list[int] | None:
    """The `local_device_ids` this process passes to `jax.distributed.initialize`, or None to leave
    them to JAX (see the module's docstring): the config's, else JAX_LOCAL_DEVICE_IDS', else, in a
    cluster where JAX would give the process the GPU of its local rank, every visible GPU where the
    process is alone on its host, and the one it sees where it sees one."""
    d = config.get("distributed", None) or {}
    given = d.get("local_device_ids", ()) or ()
    if given:
        return check_device_ids(list(given))
    text = environ.get(ENV_LOCAL_DEVICE_IDS, "").strip()
    if text:
        try:
            ids = [int(x) for x in text.split(",")]
        except ValueError:
            ids = text
        return check_device_ids(ids, ENV_LOCAL_DEVICE_IDS)
    if cluster_name not in ONE_GPU_CLUSTERS:
        return None
    gpus = local_gpus(environ, dev)
    if not gpus:
        return None  # no GPU found: nothing for JAX's choice to hide
    if tasks_on_this_host(cluster_name, environ) == 1:
        return list(range(gpus))
    if gpus == 1:
        # Bound to one GPU (srun --gpus-per-task=1), or every process shares the one: JAX's local rank
        # would name a GPU this process cannot see (jax#28194).
        return [0]
    return None  # one process per GPU (JAX's local rank), or a launch that does not say


def _int(value, name: str) -> int:
    try:
        if isinstance(value, float) and value != int(value):
            raise ValueError
        return int(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{name}={value!r} must be an integer") from None


HEARTBEAT_LIMIT_S = 100  # JAX's own default heartbeat timeout, kept when timeout_s is longer


def resolve(address: str, name: str = "distributed.coordinator_address") -> None:
    """ConfigError if the host of `address` does not resolve (a typo, a name of another network)."""
    host, port = check_address(address, name)
    try:
        socket.getaddrinfo(host.strip("[]"), port)
    except (socket.gaierror, UnicodeError) as e:
        raise ConfigError(f"{name}={address!r}: host {host!r} cannot be resolved ({e}): give process 0's "
                          f"host name or address") from None


def settings(config, environ: Mapping[str, str] | None = None, cluster=detect_cluster,
             dev: str | None = None) -> dict | None:
    """How this process joins a multi-process run: a dict of `jax.distributed.initialize`
    arguments plus `source`, or None for a single process. Raises ConfigError when the
    settings are incomplete or inconsistent. `cluster`: JAX's detection (`detect_cluster`);
    `dev`: where NVIDIA's device files are (`local_gpus`)."""
    environ = os.environ if environ is None else environ
    detected = cluster()  # asked once: it names the processes (auto_detect) and which GPUs JAX would pick
    args = _settings(config, environ, detected)
    if args is not None:
        # JAX's detection runs inside initialize whatever the source, as long as local_device_ids is
        # unset: the cluster is asked even where it does not name the processes.
        ids = local_device_ids(config, environ, detected[0] if detected else None, dev)
        if ids is not None:
            args["local_device_ids"] = ids
    return args


def _settings(config, environ: Mapping[str, str], detected: tuple[str, int, int] | None) -> dict | None:
    d = config.get("distributed", None) or {}
    timeout = _int(d.get("timeout_s", 300), "distributed.timeout_s")
    found = detected if d.get("auto_detect", True) else None
    address = d.get("coordinator_address", "") or environ.get(ENV_COORDINATOR, "")
    source = "config" if d.get("coordinator_address", "") else "environment"
    count = _int(d.get("num_processes", 0) or environ.get(ENV_NUM_PROCESSES, 0), "distributed.num_processes")
    pid = d.get("process_id", -1)
    if pid is None or _int(pid, "distributed.process_id") < 0:
        pid = environ.get(ENV_PROCESS_ID, -1)
    pid = _int(pid, "distributed.process_id")
    if found is not None and found[1] > 1 and count < 1 and pid < 0:
        # JAX's detection names the processes (and, without an address, the coordinator too).
        name, count, pid = found
        args = {"initialization_timeout": timeout, "source": name, "num_processes": count, "process_id": pid}
        if address:
            check_address(address, ENV_COORDINATOR if source == "environment" else "distributed.coordinator_address")
            args["coordinator_address"] = address
        return args
    if address:
        check_address(address, "distributed.coordinator_address" if source == "config" else ENV_COORDINATOR)
        if count < 1:
            raise ConfigError(f"a coordinator address ({address}) needs the process count: set "
                              f"distributed.num_processes or {ENV_NUM_PROCESSES} (JAX has no variable for it), "
                              f"or launch where JAX detects the cluster (SLURM, mpirun, Kubernetes)")
        if not 0 <= pid < count:
            raise ConfigError(f"distributed.process_id={pid} must be in [0, {count}) with "
                              f"num_processes={count}: set distributed.process_id or {ENV_PROCESS_ID}")
        if count == 1:
            return None
        return {"coordinator_address": address, "num_processes": count, "process_id": pid,
                "initialization_timeout": timeout, "source": source}
    if count > 1 or pid > 0:
        raise ConfigError(f"num_processes={count}, process_id={pid} given without a coordinator address: set "
                          f"distributed.coordinator_address or {ENV_COORDINATOR} (HOST:PORT of process 0)")
    return None


def initialize(config, environ: Mapping[str, str] | None = None) -> dict | None:
    """Starts `jax.distributed` as `settings` says (once per process); returns the settings used.

    Must run before JAX initialises its backends (before the first `jax.devices()`).
    """
    global _started
    args = settings(config, environ)
    if args is None or _started is not None:
        return _started if args is not None else None
    import jax

    if jax.config.jax_cpu_collectives_implementation in (None, "", "none"):
        # Cross-process collectives on CPU devices (the simulated ones included) need gloo.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if "coordinator_address" in args:
        resolve(args["coordinator_address"])
    # Where JAX's detection found the cluster, JAX takes the processes from it itself.
    kwargs = {k: v for k, v in args.items()
              if k != "source" and (args["source"] in ("config", "environment")
                                    or k in ("initialization_timeout", "coordinator_address", "local_device_ids"))}
    timeout = int(args["initialization_timeout"])
    extra = {"heartbeat_timeout_seconds": min(timeout, HEARTBEAT_LIMIT_S), "shutdown_timeout_seconds": timeout}
    accepted = inspect.signature(jax.distributed.initialize).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
    kwargs.update({k: v for k, v in extra.items() if takes_any or k in accepted})
    try:
        jax.distributed.initialize(**kwargs)
    except RuntimeError as e:
        raise ConfigError(f"jax.distributed.initialize({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}) "
                          f"failed: {str(e).splitlines()[0][:300]} (JAX's backends must not be in use yet, "
                          f"and every process must reach the coordinator)") from None
    _started = args
    return args


# Keys that differ between the processes of one run by design.
PER_PROCESS_KEYS = ("distributed.process_id", "distributed.local_device_ids")  # a host's own GPUs


def flat_config(config) -> dict:
    """The config as {'dotted.key': value}, JSON values (what `check_same_config` compares)."""
    out = {}

    def walk(prefix, node):
        for key, value in node.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                walk(f"{name}.", value)
            elif name not in PER_PROCESS_KEYS:
                out[name] = value

    walk("", json.loads(json.dumps(config.to_dict(), default=repr)))
    return out


def config_difference(mine: dict, theirs: dict) -> str | None:
    """'num_steps=100 here, 50 there' for the first key (in sorted order) whose values differ, or None."""
    for key in sorted(set(mine) | set(theirs)):
        if mine.get(key, "(unset)") != theirs.get(key, "(unset)"):
            return f"{key}={mine.get(key, '(unset)')!r} here, {theirs.get(key, '(unset)')!r} there"
    return None


def check_same_config(config, timeout_s: int) -> None:
    """Every process of a multi-process run compares its config with every other's, each published
    under its process id in the coordinator's key-value store (its SHA-256 digest first, the keys
    only where the digests differ), before any device work: a difference is a ConfigError on every
    process, naming the first key that differs and the other process. Processes with different
    configs would otherwise wait forever for each other (another num_steps) or fail deep in JAX
    (another seed). Nothing is done in a single process."""
    import hashlib

    import jax

    if jax.process_count() == 1:
        return
    from jax._src.distributed import global_state  # the coordinator's key-value store (as multihost_utils)

    client = global_state.client
    if client is None:
        return
    mine = flat_config(config)
    text = json.dumps(mine, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()
    me = jax.process_index()
    client.key_value_set(f"cdpjax/config/{me}", json.dumps({"digest": digest, "config": mine}))
    for other in range(jax.process_count()):
        if other == me:
            continue
        theirs = json.loads(client.blocking_key_value_get(f"cdpjax/config/{other}", int(timeout_s) * 1000))
        if theirs["digest"] != digest:
            what = config_difference(mine, theirs["config"]) or "their configs differ"
            raise ConfigError(f"process {me} and process {other} of this run have different configs ({what}): "
                              f"start every process with the same command and config")
