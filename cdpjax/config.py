"""Configs: `ml_collections.ConfigDict`s built by Python files, overridden from the command line.

A config file defines `get_config()` returning a ConfigDict (the big_vision and
flax-examples convention). `load_config` starts from `default_config()`, applies
the file, then `--config.KEY=VALUE` overrides, then validates everything it can
without touching a device, so that a bad value fails before anything compiles.

This module imports nothing of cdpjax but its errors: names (method, model, dataset) and
the options that belong to them are checked by the registries that own them
(`cdpjax.checks.validate` runs both).
"""
from __future__ import annotations

import ast
import importlib.util
import inspect
import math
import os
import re
import sys
import traceback
from typing import Any, Iterable

import ml_collections

from cdpjax.errors import ConfigError  # noqa: F401 - re-exported: `from cdpjax.config import ConfigError`


def default_config() -> ml_collections.ConfigDict:
    """The no-argument run: CDP-v2 (ring realisation) on scikit-learn's digits, 8 workers.

    One flat list on purpose: every key a config may set, with its default and its meaning,
    in one place (validation, overrides and resume checks all read these keys)."""
    c = ml_collections.ConfigDict()
    c.method = "cdp-v2"
    c.model = "mlp"
    c.model_kwargs = ml_collections.ConfigDict()  # options of the model builder (mlp: width 128, depth 3)
    c.norm = "none"  # 'batch' | 'group' | 'none' (models that support it)
    # Computation dtype of the model's layers ('float32' | 'bfloat16'); parameters, optimizer
    # states and logits stay float32 (mixed precision): see COMPUTE_DTYPES.
    c.dtype = "float32"
    c.bn_cross_device = True  # BatchNorm statistics over the whole data axis, not per device
    c.dataset = "digits"
    c.data_dir = ""  # tensorflow-datasets data_dir ('' = tfds default)
    c.dataset_kwargs = ml_collections.ConfigDict()  # options of the dataset's loader (e.g. train_split)
    # The task (cdpjax.tasks: loss, labels, metrics): 'classification' | 'language_modelling';
    # '' = the dataset's own.
    c.task = ""
    c.augment = True
    c.global_batch_size = 128
    c.num_steps = 600
    c.eval_every = 200
    c.checkpoint_every = 200
    # Checkpoints: how many to keep (the newest; the final one counts), and whether a resume
    # refuses a checkpoint written with other hyperparameters that the train state allows
    # (learning rate, momentum, weight decay...) instead of saying the change and going on.
    # `async_save`: orbax writes a checkpoint in its own threads while training goes on (the
    # next save, the run's end and a preemption wait for it; a kill meanwhile leaves the previous one).
    c.checkpoint = ml_collections.ConfigDict({"keep": 2, "strict_resume": False, "async_save": False})
    c.log_every = 20
    c.seed = 0
    # Optimizer: optax; one state per stage for the staged methods.
    c.optimizer = "sgd"  # 'sgd' | 'adam' | 'adamw'
    c.learning_rate = 0.05
    c.momentum = 0.9
    c.nesterov = False
    c.weight_decay = 5e-4
    c.schedule = "cosine"  # 'constant' | 'cosine' | 'step'
    c.warmup_steps = 0
    c.decay_every = 0  # 'step' schedule: steps between decays
    c.decay_factor = 0.2
    # Mesh: axis sizes ('data', 'stage'); -1 takes the devices left over. Empty: the method's
    # own (cdpjax.layouts: data-parallel methods take every device on 'data', pipelines one
    # 'stage' device per stage or module group, one-device methods one device).
    c.mesh = ml_collections.ConfigDict()
    # Stages: a number of stages, or explicit split points (block indices where a stage starts).
    c.stages = ml_collections.FieldReference(4, field_type=object)  # an int or a list of split points
    # How `stages: int` is cut (cdpjax.models.partition): 'params' | 'flops' | 'blocks' | 'memory' | 'time'.
    c.partition = "params"
    # Cyclic data parallelism.
    c.workers = 0  # CDP workers; 0 = the size of the data axis
    c.cdp_impl = "ring"  # 'simulate' | 'ring' | 'zero' (cdp-random)
    # The staleness rule: for cdp-v2, 'cdp-v2' (the version each forward finds, from the ticks) or
    # 'paper-code' (the authors' released rule: current iff stage >= L-1-worker, for any N and L);
    # for cdp-mp and cdp-zero, 'cdp-v2' | 'cdp-v1'. cdp-v1 has one rule, its own.
    c.cdp_rule = "cdp-v2"
    # CDP's ops per tick (cdpjax.layouts.cdp): 'whole' (F, B: 2L ticks a step, the paper's figure),
    # 'split' (F, B, W: 3L ticks) or 'paired' (two forwards a tick, whole backwards: every tick costs
    # about one backward, so a lockstep tick does not wait on a backward while others run forwards).
    c.cdp_ticks = "whole"
    # cdp-zero's period (cdpjax.methods.cdp_zero): 'unrolled' (a cond per op: the least memory and bytes) or
    # 'scan' (one lax.scan over ticks, its ops and messages data: a program and compile time flat in N, its
    # messages padded slots, 2.7x the bytes on ResNet-18; docs/measured.md).
    c.zero_period = "unrolled"
    # cdp-random: the delay model and its parameters (cdpjax.layouts.delays.Delay; docs/delays.md), and the
    # delay correction the update applies (cdpjax.delay_corrections).
    c.delay = ml_collections.ConfigDict({
        "model": "uniform", "rule": "cdp-v2", "tau_max": 2, "p": 0.5, "taus": (), "jitter": 1, "durations": 2,
        "worker": 0, "slowdown": 2, "seed": 0, "correction": "none", "strength": 1.0,
    })
    # Local learning / PPLL.
    c.aux_head = "greedy"  # a registered head kind (cdpjax.models.aux_heads: greedy, dgl, infopro, man, vit, ...)
    c.aux_kwargs = ml_collections.ConfigDict()
    c.microbatches = 4  # micro-batches per step of the backprop pipelines (gpipe, 1f1b, interleaved-1f1b)
    c.chunks = 2  # interleaved-1f1b: stages per device (V); the stage axis has stages / chunks devices
    # ppll: local modules per device, e.g. [9, 3, 2, 2] for 16 modules on 4 devices; None: one per device.
    c.module_groups = ml_collections.FieldReference(None, field_type=object)
    c.residuals = "recompute"  # 'recompute' | 'carry' (pipeline backward residuals)
    c.nonfinite = "stop"  # 'stop' | 'skip'
    # Codecs of the point-to-point messages, per kind (cdpjax.compress: none, bf16, fp8-e4m3, fp8-e5m2, int8,
    # int4): pipeline activations and cotangents, the ring's gradient sums, cdp-zero's parameter pieces;
    # `feedback`: the ring's senders resend what the gradient codec dropped from their last message.
    c.compress = ml_collections.ConfigDict({"activations": "none", "cotangents": "none", "gradients": "none",
                                            "parameters": "none", "feedback": False})
    c.profile_steps = ()  # [first, last]: a jax.profiler trace of those steps in WORKDIR (steps from 1)
    # Multi-process runs (see cdpjax.distributed); empty: from the environment, or one process.
    c.distributed = ml_collections.ConfigDict({
        "coordinator_address": "",  # HOST:PORT of process 0 (or JAX's JAX_COORDINATOR_ADDRESS)
        "num_processes": 0,  # 0: from the cluster (JAX's detection) or CDPJAX_NUM_PROCESSES
        "process_id": -1,  # -1: from the cluster (JAX's detection) or CDPJAX_PROCESS_ID
        "auto_detect": True,  # JAX's cluster detection (SLURM, Open MPI, Kubernetes) starts a multi-process run
        "timeout_s": 300,  # how long processes wait for each other at start-up
        # The GPUs this process drives ([0, 1, ...], as JAX's JAX_LOCAL_DEVICE_IDS); empty: every GPU of the
        # host where the process is its host's only one, else JAX's one GPU per process (cdpjax.distributed)
        "local_device_ids": (),
    })
    return c


# Step counts fit the optimizers' int32 step counter (optax); seeds the 32 bits a JAX key takes
# without x64 (2**32 would be seed 0 again); sizes that lay out a time table stay small enough
# for it to fit in memory.
STEP_LIMIT = 2**31 - 1
SEED_LIMIT = 2**32 - 1
TABLE_SIZE_LIMIT = 4096
# Keys whose values must be numbers, and the range each accepts.
_NUMERIC = {
    "global_batch_size": (int, 1, STEP_LIMIT),
    "num_steps": (int, 1, STEP_LIMIT),
    "eval_every": (int, 0, STEP_LIMIT),
    "checkpoint_every": (int, 0, STEP_LIMIT),
    "log_every": (int, 1, STEP_LIMIT),
    "seed": (int, 0, SEED_LIMIT),
    "learning_rate": (float, 0.0, None),
    "momentum": (float, 0.0, 1.0),
    "weight_decay": (float, 0.0, None),
    "warmup_steps": (int, 0, STEP_LIMIT),
    "decay_every": (int, 0, STEP_LIMIT),
    "decay_factor": (float, 0.0, 1.0),
    "workers": (int, 0, TABLE_SIZE_LIMIT),
    "microbatches": (int, 1, TABLE_SIZE_LIMIT),
    "chunks": (int, 1, TABLE_SIZE_LIMIT),
}
# config.dtype: the Flax modules' `dtype` (the dtype they compute in), passed by
# `cdpjax.models.build` to every model factory that takes a `dtype` argument (mlp, the
# ResNets and ViTs here; for a factory without one, validation refuses 'bfloat16'). Every
# method honours it: each stage computes in bfloat16, while parameters, optimizer states,
# BatchNorm statistics, logits and losses stay float32, and so does what crosses a stage
# boundary (`cdpjax.models.staging.Chain`): the methods that store, stash and send
# activations in float32 carriers (the CDP `ring`, cdp-zero, cdp-mp, gpipe, ppll) keep doing
# so, and every method computes the same function (gpipe = e2e holds in bfloat16 too).
# Auxiliary heads (local, ppll) compute in float32.
COMPUTE_DTYPES = ("float32", "bfloat16")
_CHOICES = {
    "dtype": COMPUTE_DTYPES,
    "norm": ("batch", "group", "none"),
    "optimizer": ("sgd", "adam", "adamw"),
    "schedule": ("constant", "cosine", "step"),
    "partition": ("params", "flops", "blocks", "memory", "time"),
    "cdp_impl": ("simulate", "ring", "zero"),  # 'zero': cdp-random only (its tables with CDP's reads)
    "cdp_rule": ("cdp-v2", "cdp-v1", "paper-code"),
    "cdp_ticks": ("whole", "split", "paired"),
    "zero_period": ("unrolled", "scan"),
    "residuals": ("recompute", "carry"),
    "nonfinite": ("stop", "skip"),
}


def load_file(path: str) -> ml_collections.ConfigDict:
    """Runs a config file and returns its `get_config()`.

    `path` is a file's path or the name of a config shipped in the package (`digits` for
    cdpjax/configs/digits.py; `config_names()` lists them); an existing path wins over a name.
    It may end in `:ARG` (the big_vision convention): the file's `get_config(ARG)`
    is called with that string, for files that hold several variants.

    The file's folder is importable: first on `sys.path` while the file runs, as a
    script's own folder is, so that `import my_model` finds the `my_model.py` next to it
    (and registers its model); afterwards it stays on `sys.path`, moved to the end, so that
    what the model module imports later (in the trainer's later steps) is still found,
    without the folder's files shadowing installed packages of the same names.

    Anything that goes wrong in the file (a syntax error, an exception, a missing import, a
    get_config that returns something else than a ConfigDict) is a ConfigError naming the
    file and the line.
    """
    arg = None
    if not os.path.isfile(path) and ":" in path:
        path, arg = path.rsplit(":", 1)
    packaged = _packaged_path(path)
    if packaged is not None:
        path = packaged
    elif _NAME.fullmatch(path) and not os.path.exists(path):
        raise ConfigError(f"config {path!r} is neither a file nor a config shipped with cdpjax ("
                          f"{', '.join(config_names())}); give a name of these or the path of a Python file")
    if os.path.isdir(path):
        raise ConfigError(f"config file {path!r} is a directory: give the Python file in it that defines "
                          f"get_config()")
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    if packaged is not None:  # the package's own: imports only cdpjax, nothing from its folder
        config = _run_config_file(path, arg)
    else:
        config = _run_user_file(path, arg)
    if isinstance(config, ml_collections.FrozenConfigDict) or not isinstance(config, ml_collections.ConfigDict):
        kind = type(config).__name__ if config is not None else "None"
        raise ConfigError(f"config file {path!r}: get_config() returned {kind}; it must return an "
                          f"ml_collections.ConfigDict (not frozen: overrides change it), e.g. "
                          f"cdpjax.config.default_config() with its keys set")
    return config


# A shipped config's name: what `--config NAME[:ARG]` gives in place of a path.
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
CONFIGS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def config_names() -> list[str]:
    """The configs shipped in the package (cdpjax/configs/NAME.py), by name."""
    return sorted(f[:-3] for f in os.listdir(CONFIGS_DIR) if f.endswith(".py") and not f.startswith("_"))


def _packaged_path(spec: str) -> str | None:
    """The shipped config file `spec` names, or None: a path that exists (a file of the user's
    called `digits`, say) is the user's, and names only what `config_names` lists."""
    if os.path.exists(spec) or not _NAME.fullmatch(spec) or spec not in config_names():
        return None
    return os.path.join(CONFIGS_DIR, f"{spec}.py")


def _run_user_file(path: str, arg: str | None):
    """`_run_config_file` with the file's folder importable, as `load_file` says."""
    folder = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, folder)
    try:
        return _run_config_file(path, arg)
    finally:
        sys.path.remove(folder)  # the first occurrence: the one inserted above
        if folder not in sys.path:
            sys.path.append(folder)


def _run_config_file(path: str, arg: str | None):
    """The file's get_config() (or get_config(arg)); ConfigError, with the line, for any failure."""
    try:
        spec = importlib.util.spec_from_file_location("_cdpjax_config", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        get_config = getattr(module, "get_config", None)
        if not callable(get_config):
            raise ConfigError(f"config file {path!r} defines no get_config()")
        if arg is not None and not _takes_an_argument(get_config):
            raise ConfigError(f"config file {path!r}: its get_config() takes no argument, but {path}:{arg} "
                              f"gives it {arg!r}; leave out ':{arg}'")
        return get_config() if arg is None else get_config(arg)
    except ConfigError:
        raise
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's file: one line with where it broke
        raise ConfigError(f"config file {path!r}{_where(e, path)}: {type(e).__name__}: "
                          f"{_short(e)}") from None


def _takes_an_argument(fn) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params)


def _where(e: BaseException, path: str) -> str:
    """' line N' where the error arose in the file `path` (its last frame there), or ''."""
    if isinstance(e, SyntaxError) and e.lineno and os.path.abspath(e.filename or "") == os.path.abspath(path):
        return f" line {e.lineno}"
    frames = [f for f in traceback.extract_tb(e.__traceback__) if os.path.abspath(f.filename) == os.path.abspath(path)]
    return f" line {frames[-1].lineno}" if frames else ""


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split()) or "(no message)"
    return text if len(text) <= 300 else text[:300] + "..."


def parse_arg(arg: str | None, **defaults) -> dict:
    """`"a=1,b=x"` -> {'a': 1, 'b': 'x'} over `defaults`; unknown keys are refused, and so is a
    value of another kind than its default (an integer default takes integers only)."""
    out = dict(defaults)
    for item in filter(None, (arg or "").split(",")):
        key, _, text = item.partition("=")
        if key not in defaults:
            raise ConfigError(f"config argument {key!r} is not one of {', '.join(defaults)}")
        value, default = _parse_value(text), defaults[key]
        kind = kind_of(default)
        if kind is not None and not is_kind(value, kind):
            raise ConfigError(f"config argument {key}={text!r} must be {KIND_WORDS[kind]} (its default is "
                              f"{default!r})")
        out[key] = value
    return out


def kind_of(default) -> str | None:
    """What a value must be, read off a default of that place: 'bool', 'int', 'number', 'str',
    'sequence', or None where the default says nothing (None, a dict...)."""
    if isinstance(default, bool):
        return "bool"
    if isinstance(default, int):
        return "int"
    if isinstance(default, float):
        return "number"
    if isinstance(default, str):
        return "str"
    if isinstance(default, (list, tuple)):
        return "sequence"
    return None


KIND_WORDS = {"bool": "True or False", "int": "an integer", "number": "a finite number", "str": "a string",
              "sequence": "a list of numbers"}


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def is_kind(value, kind: str) -> bool:
    """Whether `value` is of `kind` (`kind_of`): an int is a number, a bool is not an int."""
    return {
        "bool": lambda v: isinstance(v, bool),
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": _finite,
        "str": lambda v: isinstance(v, str),
        "sequence": lambda v: isinstance(v, (list, tuple)) and all(_finite(x) or isinstance(x, str) for x in v),
    }[kind](value)


def _parse_value(text: str) -> Any:
    """A Python literal, else the text itself (a bare word is a string)."""
    if len(text) > 100_000:
        raise ConfigError(f"override value of {len(text)} characters: too long for a config value")
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


def apply_overrides(config: ml_collections.ConfigDict, overrides: Iterable[str]) -> None:
    """Applies `KEY=VALUE` strings (dotted keys, values parsed as Python literals)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} has no value: give --config.{item}=VALUE or --config.{item} VALUE")
        key, text = item.split("=", 1)
        set_value(config, key, _parse_value(text))


def set_value(config: ml_collections.ConfigDict, key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = config
    for depth, p in enumerate(parents):
        if p not in node:
            raise ConfigError(f"unknown config key {key!r}")
        node = node[p]
        if not isinstance(node, (ml_collections.ConfigDict, dict)):
            where = ".".join(parents[:depth + 1])
            raise ConfigError(f"{key}: {where} is {node!r}, not a dict of options, so it has no key "
                              f"{'.'.join(parents[depth + 1:] + [leaf])!r}; set {where} itself "
                              f"(--config.{where}=VALUE)")
    if leaf not in node and not isinstance(node, ml_collections.ConfigDict):
        raise ConfigError(f"unknown config key {key!r}")
    if leaf not in node and node is config:
        raise ConfigError(f"unknown config key {key!r}; known keys: {', '.join(sorted(config.keys()))}")
    old = node[leaf] if leaf in node else None
    top = parents[0] if parents else leaf
    if key == "mesh":
        raise ConfigError(f"mesh={value!r}: the mesh is set an axis at a time, --config.mesh.data=2 "
                          f"--config.mesh.stage=4 (each an integer; -1: the devices left over)")
    if top == "mesh" and not isinstance(value, int):
        raise ConfigError(f"mesh axis size {key}={value!r} must be an integer (-1: the devices left over)")
    if old is not None and isinstance(old, (int, float)) and not isinstance(old, bool):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            if not (leaf == "stages" and isinstance(value, (list, tuple))):
                raise ConfigError(f"{key} must be a number, got {value!r}")
        if isinstance(old, float):
            value = float(value)
    with node.ignore_type():
        node[leaf] = value


# Keys of other kinds: booleans, names, nested option dicts (checked against their consumer).
_BOOLS = ("bn_cross_device", "augment", "nesterov")
_STRINGS = ("method", "model", "dataset", "data_dir", "task")
_DICTS = ("model_kwargs", "aux_kwargs", "dataset_kwargs", "mesh", "distributed", "checkpoint", "compress")
_CHECKPOINT = {"keep": (int, 1, 2**20), "strict_resume": bool, "async_save": bool}
# Processes of one run, from any source (the config, CDPJAX_NUM_PROCESSES, SLURM's task count).
PROCESS_LIMIT = 2**20
_DISTRIBUTED = {
    "coordinator_address": str,
    "num_processes": (int, 0, PROCESS_LIMIT),
    "process_id": (int, -1, PROCESS_LIMIT),
    "auto_detect": bool,
    "timeout_s": (int, 1, 7 * 24 * 3600),
    "local_device_ids": list,
}
LOCAL_DEVICE_LIMIT = 4096  # far above the accelerators of one host
# HOST:PORT: a host name or IPv4 address, or an IPv6 address in brackets, and a port number.
_ADDRESS = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>\d{1,5})$")


def check_address(address, name: str = "distributed.coordinator_address") -> tuple[str, int]:
    """(host, port) of a HOST:PORT address; ConfigError naming what is wrong with it."""
    m = _ADDRESS.match(address) if isinstance(address, str) else None
    if m is None:
        raise ConfigError(f"{name}={address!r} must be HOST:PORT (process 0's host name or address, an IPv6 "
                          f"address in brackets, and a free port), e.g. node1:12355")
    port = int(m.group("port"))
    if not 1 <= port <= 65535:
        raise ConfigError(f"{name}={address!r}: port {port} is not in 1..65535")
    return m.group("host"), port


def _check_number(key: str, v, kind, lo, hi) -> None:
    """An integer (not 6.0: counts and sizes are integers) or a finite number, in [lo, hi]."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
        raise ConfigError(f"{key} must be {'an integer' if kind is int else 'a number'}, got {v!r}")
    if not math.isfinite(v):
        raise ConfigError(f"{key}={v!r} must be a finite number")
    if lo is not None and v < lo or hi is not None and v > hi:
        if kind is int:  # an integer's upper bound is a limit of the implementation, said apart
            rng = f">= {lo}" if v < lo else f"<= {hi}"
        else:
            rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ConfigError(f"{key}={v!r} is out of range: must be {rng}")


def validate(config: ml_collections.ConfigDict) -> None:
    """Checks every key's type and range and the combinations that cannot work, with no
    device touched and no registry read; raises ConfigError naming the value and what is
    accepted. Names and their options are `cdpjax.checks.validate`'s; checks that need the
    model or the mesh follow in the method builders, still before anything compiles.
    docs/guarantees.md lists them all."""
    unknown = sorted(set(config.keys()) - set(default_config().keys()))
    if unknown:
        known = ", ".join(sorted(default_config().keys()))
        raise ConfigError(f"unknown config key {unknown[0]!r}; known keys: {known}")
    for key, (kind, lo, hi) in _NUMERIC.items():
        if key in config:
            _check_number(key, config[key], kind, lo, hi)
    for key in _BOOLS:
        if key in config and not isinstance(config[key], bool):
            raise ConfigError(f"{key} must be True or False, got {config[key]!r}")
    for key in _STRINGS:
        if key in config and not isinstance(config[key], str):
            raise ConfigError(f"{key} must be a string, got {config[key]!r}")
    for key in _DICTS:
        if key in config and not isinstance(config[key], (dict, ml_collections.ConfigDict)):
            raise ConfigError(f"{key} must be a dict of options, got {config[key]!r}")
    for key, choices in _CHOICES.items():
        if key in config and config[key] not in choices:
            raise ConfigError(f"{key}={config[key]!r} is not one of {', '.join(choices)}")
    data_dir = config.get("data_dir", "")
    if data_dir and "://" not in data_dir and not os.path.isdir(os.path.expanduser(data_dir)):
        raise ConfigError(f"data_dir={data_dir!r} is not a directory (prepared tensorflow-datasets go there; "
                          f"'' means tfds's default)")
    mesh = dict(config.mesh)
    for axis, size in mesh.items():
        if axis not in ("data", "stage"):
            raise ConfigError(f"unknown mesh axis {axis!r}; axes are 'data' and 'stage'")
        if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
            raise ConfigError(f"mesh.{axis}={size!r} must be a positive integer or -1")
    if list(mesh.values()).count(-1) > 1:
        raise ConfigError(f"mesh {mesh} has more than one axis of size -1")
    stages = config.stages
    if isinstance(stages, bool) or not isinstance(stages, (int, list, tuple)):
        raise ConfigError(f"stages must be a number of stages or a list of split points, got {stages!r}")
    if isinstance(stages, int) and stages < 1:
        raise ConfigError(f"stages={stages} must be >= 1")
    if isinstance(stages, int) and stages > TABLE_SIZE_LIMIT or \
            isinstance(stages, (list, tuple)) and len(stages) >= TABLE_SIZE_LIMIT:
        count = stages if isinstance(stages, int) else len(stages) + 1
        raise ConfigError(f"stages: {count} stages, more than the {TABLE_SIZE_LIMIT} a time table can lay out here")
    if isinstance(stages, (list, tuple)):
        if any(isinstance(p, bool) or not isinstance(p, int) for p in stages):
            raise ConfigError(f"stages={list(stages)!r}: split points must be integers (block indices)")
        if any(b <= a for a, b in zip((0, *stages), stages)):
            raise ConfigError(f"stages={list(stages)!r}: split points must be strictly increasing and >= 1")
    groups = config.get("module_groups", None)
    if groups is not None and (not isinstance(groups, (list, tuple)) or not groups or len(groups) > TABLE_SIZE_LIMIT
                               or any(isinstance(g, bool) or not isinstance(g, int) or not 1 <= g <= TABLE_SIZE_LIMIT
                                      for g in groups)):
        raise ConfigError(f"module_groups={groups!r} must be a list of positive integers (local modules per "
                          f"device, adding up to the stages) or None")
    _check_combinations(config)
    _check_profile_steps(config)
    _check_distributed(config.get("distributed", {}) or {})
    _check_checkpoint(config.get("checkpoint", {}) or {})


def _check_combinations(config) -> None:
    if config.get("nesterov", False) and (config.optimizer != "sgd" or not config.momentum):
        raise ConfigError(f"nesterov=True needs optimizer='sgd' with momentum > 0, got "
                          f"optimizer={config.optimizer!r}, momentum={config.momentum!r}")
    if config.warmup_steps and config.warmup_steps >= config.num_steps:
        raise ConfigError(f"warmup_steps={config.warmup_steps} must be < num_steps={config.num_steps}")
    if config.schedule == "step" and config.decay_every > config.num_steps:
        raise ConfigError(f"schedule='step' with decay_every={config.decay_every} > num_steps="
                          f"{config.num_steps} never decays: lower decay_every or use schedule='constant'")


def _check_profile_steps(config) -> None:
    steps = config.get("profile_steps", ())
    ok = isinstance(steps, (list, tuple)) and (
        not steps or (len(steps) == 2 and all(isinstance(s, int) and not isinstance(s, bool) for s in steps)
                      and 1 <= steps[0] <= steps[1] <= config.num_steps))
    if not ok:
        shown = list(steps) if isinstance(steps, (list, tuple)) else steps
        raise ConfigError(f"profile_steps={shown!r} must be [first, last] with 1 <= first <= last <= "
                          f"num_steps={config.num_steps} (steps are numbered from 1), or [] for no profile")


def _check_checkpoint(d) -> None:
    for key in dict(d):
        if key not in _CHECKPOINT:
            raise ConfigError(f"unknown config key 'checkpoint.{key}'; known: {', '.join(_CHECKPOINT)}")
    if "keep" in d:
        _check_number("checkpoint.keep", d["keep"], *_CHECKPOINT["keep"])
    for key in ("strict_resume", "async_save"):
        if key in d and not isinstance(d[key], bool):
            raise ConfigError(f"checkpoint.{key} must be True or False, got {d[key]!r}")


def _check_distributed(d) -> None:
    for key in dict(d):
        if key not in _DISTRIBUTED:
            raise ConfigError(f"unknown config key 'distributed.{key}'; known: {', '.join(_DISTRIBUTED)}")
    for key, rule in _DISTRIBUTED.items():
        if key not in d:
            continue
        v = d[key]
        if isinstance(rule, tuple):
            _check_number(f"distributed.{key}", v, *rule)
        elif rule is bool and not isinstance(v, bool):
            raise ConfigError(f"distributed.{key} must be True or False, got {v!r}")
        elif rule is str and not isinstance(v, str):
            raise ConfigError(f"distributed.{key} must be a string (HOST:PORT), got {v!r}")
        elif rule is str and v:
            check_address(v, f"distributed.{key}")
        elif rule is list:
            check_device_ids(v, f"distributed.{key}")


def check_device_ids(ids, name: str = "distributed.local_device_ids") -> list[int]:
    """`ids` as a list of distinct device numbers (each in [0, LOCAL_DEVICE_LIMIT)), or ConfigError."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < LOCAL_DEVICE_LIMIT for i in ids) \
            or len(set(ids)) != len(ids):
        raise ConfigError(f"{name}={ids!r} must be a list of distinct device numbers in [0, {LOCAL_DEVICE_LIMIT}), "
                          f"e.g. [0, 1, 2, 3]")
    return list(ids)
