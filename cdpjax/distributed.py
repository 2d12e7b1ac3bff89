"""Multi-process runs: several processes (one per host, or one per GPU) drive one global mesh.

`initialize(config)` starts `jax.distributed` before any device is used. The
coordinator address, process count and process id come, in this order, from

1. `config.distributed.coordinator_address`, `.num_processes`, `.process_id`;
2. the environment: `CDPJAX_COORDINATOR`, `CDPJAX_NUM_PROCESSES`, `CDPJAX_PROCESS_ID`;
3. a SLURM job step with more than one task (detected by the variables JAX's own
   SLURM detection reads), for which `jax.distributed.initialize()` is called
   without arguments and JAX takes them from SLURM (`distributed.auto_detect`).

With none of these, or a single process, nothing is started. On CPU the
cross-process collectives go through gloo. An address must be HOST:PORT (a port in
1..65535, a host name that resolves, an IPv6 address in brackets): anything else is a
ConfigError before JAX is asked. `distributed.timeout_s` bounds how long the processes
wait for each other at start-up and how long a silent process is waited for later (JAX's
heartbeat timeout, at most its default of 100 s), after which JAX's coordination service
ends every process; `cdpjax.supervisor` turns that end into one line naming the process
that vanished. After initialisation `jax.devices()`
lists every process's devices and the mesh spans them all; each process reads its
own contiguous slice of every global batch (`cdpjax.data.base`), the trainer
assembles global arrays from these slices, every process takes part in each
checkpoint, and process 0 alone writes config.json, metrics.jsonl and summary.json.
"""
from __future__ import annotations

import inspect
import os
import socket
from typing import Mapping

from cdpjax.config import check_address
from cdpjax.errors import ConfigError

ENV_COORDINATOR = "CDPJAX_COORDINATOR"
ENV_NUM_PROCESSES = "CDPJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "CDPJAX_PROCESS_ID"
# What JAX's SLURM cluster detection requires (jax._src.clusters.slurm_cluster).
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")

_started: dict | None = None


def slurm_tasks(environ: Mapping[str, str]) -> int:
    """The task count of the SLURM job step this process belongs to (0 outside SLURM)."""
    if not all(v in environ for v in SLURM_VARS):
        return 0
    try:
        return int(environ["SLURM_NTASKS"])
    except ValueError:
        return 0


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


def settings(config, environ: Mapping[str, str] | None = None) -> dict | None:
    """How this process joins a multi-process run: a dict of `jax.distributed.initialize`
    arguments plus `source`, or None for a single process. Raises ConfigError when the
    settings are incomplete or inconsistent."""
    environ = os.environ if environ is None else environ
    d = config.get("distributed", None) or {}
    address = d.get("coordinator_address", "") or environ.get(ENV_COORDINATOR, "")
    count = d.get("num_processes", 0) or environ.get(ENV_NUM_PROCESSES, 0)
    pid = d.get("process_id", -1)
    if pid is None or _int(pid, "distributed.process_id") < 0:
        pid = environ.get(ENV_PROCESS_ID, -1)
    source = "config" if d.get("coordinator_address", "") else "environment"
    count = _int(count, "distributed.num_processes")
    pid = _int(pid, "distributed.process_id")
    timeout = _int(d.get("timeout_s", 300), "distributed.timeout_s")
    if address:
        check_address(address, "distributed.coordinator_address" if source == "config" else ENV_COORDINATOR)
        if count < 1:
            raise ConfigError(f"a coordinator address ({address}) needs the process count: set "
                              f"distributed.num_processes or {ENV_NUM_PROCESSES}")
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
    if d.get("auto_detect", True) and slurm_tasks(environ) > 1:
        return {"initialization_timeout": timeout, "source": "slurm"}
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
    kwargs = {k: v for k, v in args.items() if k != "source"}
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


def is_primary() -> bool:
    """Whether this process writes the run's files (process 0)."""
    import jax

    return jax.process_index() == 0
