"""The planner behind `cdpjax plan`: a config, a device count and a memory budget in; the layouts
that fit, ranked by predicted step time, the best ones checked against XLA.

1. Enumerate (`enumerate_candidates`): every registered method, on the mesh its layout declares
   (data-axis methods: every device on `data`; stage-axis methods: the stage devices their
   table places the stages on, pipeline replicas on `data` over the devices left), every stage
   count the model can be cut into (powers of two up to its blocks, and the config's own), every
   partition asked for (`cdpjax.models.partition`), micro-batch counts S, 2S and 4S for the
   methods that read them (S: stage devices), both residual policies and every tick kind of the
   tables that take one. A candidate the method refuses (`setup.setup` raises) cannot train the
   config: it is left out and counted.
2. Predict (`predict`): memory per device is `bench.memory_model`, the buffers the candidate's
   lowered program declares (or, for dp and the one-device methods, its structure) priced with
   the per-stage byte counts `bench.program_sizes` measures by abstract evaluation (nothing
   compiled; once per cut, micro-batch and heads, shared by the candidates that have them:
   `stage_bytes`); arguments plus temporaries. Step time is the lockstep model (`cdpjax.speedup`)
   replaying the candidate's table with per-stage op times summed from per-block times measured
   once on this device (`block_costs`, cached under the user's cache dir, keyed by the model and
   the device), scaled linearly from the micro-batch they were measured at, plus transfers at the
   given bandwidth, plus, for a pipeline with replicas, one ring all-reduce of a device's
   parameters over its data group. The auxiliary heads of local learning are not timed.
3. Rank (`rank`): candidates over the budget dropped, the rest by predicted step time (then
   memory). An empty ranking is one line naming the smallest memory any candidate needs.
4. Verify (`verify`): the top K compiled as the trainer runs the step (state donated); XLA's
   held bytes per device (`bench.memory`) beside the prediction; one over the budget is dropped
   and reported; the recommendation is the best that fits, with its `cdpjax train` command.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from typing import Iterable, Sequence

from cdpjax.errors import ConfigError

RESIDUAL_POLICIES = ("recompute", "carry")
TICK_KINDS = ("whole", "split", "paired")
MICROBATCH_FACTORS = (1, 2, 4)  # micro-batches per step, in units of the stage devices
DEFAULT_PARTITIONS = ("params",)
CACHE_ENV = "CDPJAX_PLAN_CACHE"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way to run the config: a method and the keys that set it (None: the layout does not read
    that key, so it stays the config's)."""

    method: str
    mesh: tuple[tuple[str, int], ...]  # () for a one-device method
    stages: int
    partition: str
    microbatches: int | None = None
    residuals: str = "recompute"
    ticks: str | None = None

    def overrides(self) -> tuple[str, ...]:
        """The `--config.KEY=VALUE` settings (without `--config.`) that make a config this candidate."""
        out = [f"method={self.method}"] + [f"mesh.{axis}={size}" for axis, size in self.mesh]
        out += [f"stages={self.stages}", f"partition={self.partition}", f"residuals={self.residuals}"]
        if self.microbatches is not None:
            out.append(f"microbatches={self.microbatches}")
        if self.ticks is not None:
            out.append(f"cdp_ticks={self.ticks}")
        return tuple(out)

    def config(self, base):
        """A copy of `base` set to this candidate (an empty mesh: the one-device method's own)."""
        from cdpjax import config as cfg_lib

        c = config_with(base, mesh={}, stages=self.stages)
        cfg_lib.apply_overrides(c, [o for o in self.overrides() if not o.startswith("stages=")])
        return c

    @property
    def devices(self) -> int:
        return math.prod(size for _, size in self.mesh) if self.mesh else 1

    def label(self) -> str:
        mesh = "x".join(f"{axis}{size}" for axis, size in self.mesh) or "one device"
        words = [self.method, mesh, f"L={self.stages}", self.partition]
        if self.microbatches is not None:
            words.append(f"M={self.microbatches}")
        if self.residuals != "recompute":
            words.append(self.residuals)
        if self.ticks not in (None, "whole"):
            words.append(f"ticks={self.ticks}")
        return " ".join(words)


def config_with(base, **values):
    """A copy of `base` with `values` set, whatever type they had there (a config's `stages` may be a
    list of split points, which a ConfigDict would not let an integer replace)."""
    from cdpjax import config as cfg_lib

    d = base.to_dict()
    d.update(values)
    return cfg_lib.ml_collections.ConfigDict(d)


@dataclasses.dataclass(frozen=True)
class Prediction:
    """A candidate's predicted bytes per device (`arguments` between steps, `temporaries` within a
    step) and step seconds under the lockstep model; `compiled_bytes`: XLA's held bytes, once verified."""

    candidate: Candidate
    arguments: float
    temporaries: float
    step_seconds: float
    compiled_bytes: float | None = None

    @property
    def memory(self) -> float:
        return self.arguments + self.temporaries

    def record(self) -> dict:
        return {"label": self.candidate.label(), **dataclasses.asdict(self.candidate),
                "predicted_bytes": self.memory, "predicted_arguments_bytes": self.arguments,
                "predicted_temporaries_bytes": self.temporaries, "step_seconds": self.step_seconds,
                "compiled_bytes": self.compiled_bytes}


# ---------------------------------------------------------------------------- enumeration


def stage_options(num_blocks: int, config_stages: int) -> list[int]:
    """Stage counts to try: powers of two from 2 up to the model's blocks, and the config's own."""
    out = {config_stages} if 1 <= config_stages <= num_blocks else set()
    s = 2
    while s <= num_blocks:
        out.add(s)
        s *= 2
    return sorted(out)


def enumerate_candidates(base, devices: int, num_blocks: int, methods: Sequence[str] | None = None,
                         partitions: Sequence[str] = DEFAULT_PARTITIONS) -> list[Candidate]:
    """Every candidate of the space the module docstring describes (pure: nothing built). A stage-
    axis method whose table needs more stage devices than `devices`, or a number that does not
    divide it, has no candidate at that stage count."""
    from cdpjax.layouts import LAYOUTS, stage_count, table_for_config

    names = list(methods) if methods else list(LAYOUTS)
    for name in names:
        LAYOUTS.lookup(name)  # an unknown name: one line with the registered ones
    batch = int(base.global_batch_size)
    out = []
    for name in names:
        layout = LAYOUTS[name]
        sizes = layout.table_sizes()
        ticks = TICK_KINDS if "ticks" in sizes else (None,)
        for stages in stage_options(num_blocks, stage_count(base)):
            cuts = partitions if stages > 1 else partitions[:1]
            if layout.device_axis is None:
                meshes, stage_devices = [()], 1
            elif layout.device_axis == "data":
                meshes, stage_devices = [(("data", devices),)], 1
            else:
                try:
                    stage_devices = table_for_config(config_with(base, method=name), devices=1, stages=stages,
                                                     steps=2).devices
                except (ConfigError, AssertionError, ValueError):
                    continue
                if stage_devices > devices or devices % stage_devices:
                    continue
                meshes = [(("stage", stage_devices), ("data", devices // stage_devices))]
            replicas = devices // stage_devices if layout.device_axis == "stage" else 1
            micro_counts = [None]
            if layout.microbatches:
                micro_counts = [f * stage_devices for f in MICROBATCH_FACTORS
                                if (batch // replicas) % (f * stage_devices) == 0]
            for mesh in meshes:
                for partition in cuts:
                    for m in micro_counts:
                        for residuals in RESIDUAL_POLICIES:
                            for tick in ticks:
                                out.append(Candidate(name, mesh, stages, partition, m, residuals, tick))
    return out


# ---------------------------------------------------------------------------- op times, measured once


@dataclasses.dataclass(frozen=True)
class BlockCosts:
    """Seconds per block at `micro_batch` examples (forward, whole backward, its input and weight
    halves) for both residual policies, each block's output bytes per example and parameter bytes."""

    micro_batch: int
    forward: tuple[float, ...]
    backward: dict  # residual policy -> per-block seconds
    backward_input: dict
    backward_weight: dict
    output_bytes_per_example: tuple[float, ...]
    param_bytes: tuple[float, ...]

    def stage_costs(self, points: Sequence[int], micro: int, residuals: str):
        """`speedup.StageCosts` of the stages that `points` cut, at `micro` examples (times scaled
        linearly from `micro_batch`; a stage's time the sum of its blocks')."""
        from cdpjax.speedup import StageCosts

        bounds = list(zip((0, *points), (*points, len(self.forward))))
        scale = micro / self.micro_batch
        add = lambda values: tuple(scale * sum(values[a:b]) for a, b in bounds)  # noqa: E731
        return StageCosts(add(self.forward), add(self.backward[residuals]),
                          tuple(micro * self.output_bytes_per_example[b - 1] for _, b in bounds),
                          tuple(sum(self.param_bytes[a:b]) for a, b in bounds), (),
                          add(self.backward_input[residuals]), add(self.backward_weight[residuals]), residuals)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "BlockCosts":
        return cls(int(d["micro_batch"]), tuple(d["forward"]), d["backward"], d["backward_input"],
                   d["backward_weight"], tuple(d["output_bytes_per_example"]), tuple(d["param_bytes"]))


def cache_dir(environ=os.environ) -> str:
    """`$CDPJAX_PLAN_CACHE`, else `$XDG_CACHE_HOME/cdpjax/plan` (`~/.cache/cdpjax/plan`)."""
    if environ.get(CACHE_ENV):
        return os.path.expanduser(environ[CACHE_ENV])
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cdpjax", "plan")


def cost_key(config, micro_batch: int) -> str:
    """What the block times depend on: the model and its input, the micro-batch, the device kind."""
    import jax

    device = jax.devices()[0]
    what = {k: config.get(k) for k in ("model", "norm", "dtype", "dataset")}
    what.update(model_kwargs=dict(config.get("model_kwargs", {}) or {}), micro_batch=int(micro_batch),
                device=f"{device.platform}:{getattr(device, 'device_kind', '')}", jax=jax.__version__)
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:20]


def block_costs(config, micro_batch: int, repeats: int = 3, directory: str | None = None) -> BlockCosts:
    """Per-block op times of `config`'s model at `micro_batch` examples, measured once on this
    device (every block a stage: `speedup.measure_stage_costs`) and kept in `directory`
    (`cache_dir()`); a later plan of the same model on the same kind of device reads them."""
    directory = directory or cache_dir()
    path = os.path.join(directory, cost_key(config, micro_batch) + ".json")
    if os.path.exists(path):
        with open(path) as f:
            return BlockCosts.from_json(json.load(f))
    costs = measure_block_costs(config, micro_batch, repeats)
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(costs.to_json(), f)
    os.replace(tmp, path)
    return costs


def measure_block_costs(config, micro_batch: int, repeats: int = 3) -> BlockCosts:
    from cdpjax import data, models
    from cdpjax.speedup import measure_stage_costs

    ds = data.build(config)
    blocks = len(models.build(config_with(config, stages=1), ds.image_shape, ds.num_classes).blocks)
    net = models.build(config_with(config, stages=blocks, partition="blocks"), ds.image_shape, ds.num_classes)
    timed = {r: measure_stage_costs(net, micro_batch, repeats, residuals=r) for r in RESIDUAL_POLICIES}
    first = timed["recompute"]
    return BlockCosts(micro_batch, first.forward, {r: c.backward for r, c in timed.items()},
                      {r: c.backward_input for r, c in timed.items()},
                      {r: c.backward_weight for r, c in timed.items()},
                      tuple(a / micro_batch for a in first.activation_bytes), first.gradient_bytes)


# ---------------------------------------------------------------------------- prediction


@dataclasses.dataclass(frozen=True)
class StageBytes:
    """The per-stage byte counts a prediction prices a program with: `bench.stage_sizes`,
    `bench.program_sizes` and the optimizer state's bytes per parameter byte."""

    sizes: dict
    priced: dict
    opt_ratio: float


def stage_bytes(method, config, micro: int, task, memo: dict | None = None) -> StageBytes:
    """`StageBytes` of `method`'s net at `micro` examples. Abstract evaluation of the model (each
    stage's shapes, its `jax.vjp` residuals), the slow part of a prediction, depends only on where
    the stages are cut, the micro-batch and the auxiliary heads: with `memo`, candidates that share
    those (other tick kinds, residual policies, meshes) read the first one's."""
    from cdpjax import bench

    heads = config.method if method.heads is not None else None  # local learning's heads are its method's
    key = (tuple(method.net.bounds), int(micro), heads)
    if memo is not None and key in memo:
        return memo[key]
    out = StageBytes(bench.stage_sizes(method.net, micro), bench.program_sizes(method, micro, task),
                     bench.optimizer_ratio(config, method.net))
    if memo is not None:
        memo[key] = out
    return out


def predict(candidate: Candidate, config, built, costs: BlockCosts, bandwidth: float,
            memo: dict | None = None) -> Prediction:
    """`candidate`'s memory per device and step time (module docstring), from its `config` and
    `built`: `setup.setup`'s (dataset, mesh, method) for it (nothing compiled). `memo`: the
    `stage_bytes` of the candidates predicted before, shared."""
    from cdpjax import bench, speedup, tasks

    dataset, mesh, method = built
    devices = int(mesh.devices.size)
    table = method.table
    if table is None and dict(candidate.mesh):  # dp keeps no table: laid out from its layout
        try:
            table = speedup.table_for(config, _table_devices(candidate, devices), method.net.num_stages)
        except ConfigError:  # sizes its table cannot lay out (dp's: N workers over L ticks): priced as one device
            table = None
    micro = bench.micro_batch(method, config, mesh)
    measured = stage_bytes(method, config, micro, tasks.resolve(config, dataset), memo)
    model = bench.memory_model(method, config, table, measured.sizes, devices, measured.priced, measured.opt_ratio)
    points = _points(method.net)
    if table is None:  # every op in sequence on a device's share of the batch, then dp's all-reduce
        share = costs.stage_costs(points, micro if candidate.mesh else int(config.global_batch_size), "recompute")
        step = float(sum(share.forward) + sum(share.backward))
        if devices > 1:
            step += 2 * (devices - 1) / devices * float(sum(share.gradient_bytes)) / bandwidth
    else:
        residuals = candidate.residuals if method.program is not None else "recompute"
        step = float(speedup.simulate(table, costs.stage_costs(points, micro, residuals), bandwidth,
                                      "lockstep")["step_seconds"])
        step += _replica_allreduce(candidate, model, bandwidth)
    return Prediction(candidate, float(model["arguments"]["total"]), float(model["temporaries"]["total"]), step)


def _table_devices(candidate: Candidate, devices: int) -> int:
    return dict(candidate.mesh).get("stage", devices)


def _points(net) -> tuple[int, ...]:
    """Where the net's stages start, as block indices (its `bounds`)."""
    return tuple(a for a, _ in net.bounds[1:])


def _replica_allreduce(candidate: Candidate, model: dict, bandwidth: float) -> float:
    """A stage-axis pipeline with R > 1 replicas averages each device's parameter gradients over its
    data group once a step: a ring all-reduce, 2(R-1)/R of the bytes, after the pipeline drains."""
    mesh = dict(candidate.mesh)
    replicas = mesh.get("data", 1) if "stage" in mesh else 1
    if replicas <= 1:
        return 0.0
    params = model["arguments"]["parameters"] / max(model["arguments"].get("versions", 1), 1)
    return 2 * (replicas - 1) / replicas * params / bandwidth


def build(candidate: Candidate, base, devices):
    """(the candidate's config, its `setup.setup` on `devices`); ConfigError where the method refuses it."""
    from cdpjax import setup

    config = candidate.config(base)
    return config, setup.setup(config, devices[:candidate.devices])


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every prediction, the ones within the budget ranked, and how many candidates were refused."""

    predictions: tuple[Prediction, ...]
    ranked: tuple[Prediction, ...]
    refused: int
    budget: float


def rank(predictions: Iterable[Prediction], budget: float) -> tuple[Prediction, ...]:
    """Those whose predicted memory is within `budget`, fastest first (then the least memory)."""
    fits = [p for p in predictions if p.memory <= budget]
    return tuple(sorted(fits, key=lambda p: (p.step_seconds, p.memory, p.candidate.label())))


def check_budget(predictions: Sequence[Prediction], budget: float) -> None:
    """A ConfigError naming the smallest memory any candidate needs, where none fits `budget`."""
    if predictions and not any(p.memory <= budget for p in predictions):
        least = min(predictions, key=lambda p: p.memory)
        raise ConfigError(f"--memory-per-device {budget:.0f}: no candidate fits; the smallest any needs is "
                          f"{least.memory:.0f} bytes per device ({least.candidate.label()})")


def make_plan(base, devices: int, budget: float, bandwidth: float, methods=None,
              partitions: Sequence[str] = DEFAULT_PARTITIONS, costs: BlockCosts | None = None,
              say=lambda line: None, cache: str | None = None) -> Plan:
    """Enumerate, build (no compile), predict and rank (module docstring, steps 1-3). `costs`: the
    block times (default: `block_costs`, measured once and cached in `cache`, else `cache_dir()`)."""
    import jax

    from cdpjax import data, models

    ds = data.build(base)
    num_blocks = len(models.build(config_with(base, stages=1), ds.image_shape, ds.num_classes).blocks)
    candidates = enumerate_candidates(base, devices, num_blocks, methods, partitions)
    pool = jax.devices()[:devices]
    if costs is None:
        costs = block_costs(base, max(int(base.global_batch_size) // devices, 1), directory=cache)
    predictions, refused, seen, memo = [], 0, set(), {}
    without_program = set()  # methods that lower no program: their 'carry' twin is their 'recompute' run
    for i, c in enumerate(candidates):
        if i and i % 50 == 0:
            say(f"{i} of {len(candidates)} candidates built, {len(predictions)} predicted")
        if c.residuals == "carry" and c.method in without_program:
            continue  # known before building it (the 'recompute' twin is enumerated first)
        try:
            config, built = build(c, base, pool)
        except (ConfigError, AssertionError):  # a table that refuses the sizes asserts
            refused += 1
            continue
        method = built[2]
        if method.program is None:
            without_program.add(c.method)
            if c.residuals == "carry":
                continue
        key = (c.method, c.mesh, _points(method.net), c.microbatches, c.residuals, c.ticks)
        if key in seen:  # two partitions that cut the same: one run
            continue
        seen.add(key)
        predictions.append(predict(c, config, built, costs, bandwidth, memo))
    say(f"{len(predictions)} candidates predicted, {refused} refused by their method")
    return Plan(tuple(predictions), rank(predictions, budget), refused, budget)


def verify(plan: Plan, base, devices: int, top: int, say=lambda line: None) -> tuple[Prediction, ...]:
    """The top `top` of the ranking compiled (step 4): each with XLA's held bytes per device."""
    import jax

    from cdpjax import bench

    out = []
    for p in plan.ranked[:top]:
        config = p.candidate.config(base)
        say(f"compiling {p.candidate.label()} ...")
        run = bench._prepare(config, jax.devices()[:p.candidate.devices])
        out.append(dataclasses.replace(p, compiled_bytes=float(bench.memory(run["compiled"])["held_bytes"])))
    return tuple(out)


def train_command(candidate: Candidate, config_arg: str | None, user_overrides: Sequence[str]) -> str:
    """The `cdpjax train` command that runs `candidate` (the user's overrides first, then its own)."""
    words = ["cdpjax", "train"] + (["--config", config_arg] if config_arg else [])
    own = {o.split("=", 1)[0] for o in candidate.overrides()}
    words += [f"--config.{o}" for o in user_overrides if o.split("=", 1)[0] not in own]
    words += [f"--config.{o}" for o in candidate.overrides()]
    return " ".join(words)


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**20:.2f}"


def format_plan(plan: Plan, verified: Sequence[Prediction], top: int) -> str:
    """The ranking (up to `top` rows past the verified ones), predicted and compiled memory side by side."""
    checked = {p.candidate: p for p in verified}
    head = ["rank", "candidate", "step s (model)", "predicted MiB", "compiled MiB", "verdict"]
    rows = []
    for i, p in enumerate(plan.ranked[:max(top, len(verified))], 1):
        v = checked.get(p.candidate)
        verdict = "not compiled" if v is None else ("fits" if v.compiled_bytes <= plan.budget else "over budget")
        rows.append([str(i), p.candidate.label(), f"{p.step_seconds:.4g}", _mib(p.memory),
                     _mib(v.compiled_bytes if v else None), verdict])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)] if rows else [len(h) for h in head]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, rows)])


# ---------------------------------------------------------------------------- the model against XLA

CHECK_MODELS = ("mlp", "resnet_tiny")
CHECK_DEVICES = (2, 4, 8)
CHECK_STAGES = 4


@dataclasses.dataclass(frozen=True)
class MemoryCase:
    """One case of the memory model's check against XLA: `method` training `model` (digits, the
    default config, `CHECK_STAGES` stages) on `devices` devices, every one on the axis its layout
    declares; `left_out` says why the grid skips it (None: it is measured); `overrides`
    (KEY=VALUE, as `--config.KEY=VALUE`) a variant the plan also enumerates (a tick kind)."""

    model: str
    devices: int
    method: str
    left_out: str | None = None
    overrides: tuple[str, ...] = ()

    def config(self):
        from cdpjax.config import apply_overrides, default_config
        from cdpjax.layouts import LAYOUTS

        c = default_config()
        c.method, c.model, c.stages = self.method, self.model, CHECK_STAGES
        apply_overrides(c, list(self.overrides))
        layout = LAYOUTS[self.method]
        if layout.device_axis == "data":
            c.mesh.data = self.devices
        elif layout.device_axis == "stage":
            s = layout.default_mesh(c)["stage"]
            c.mesh.stage, c.mesh.data = s, self.devices // s
        return c


def memory_cases(models=CHECK_MODELS, devices=CHECK_DEVICES, methods=None) -> list[MemoryCase]:
    """The grid of `MemoryCase`s (every registered method by default): a one-device method is
    measured at 2 devices only; a stage-axis one where its stage devices divide the count."""
    from cdpjax.config import default_config
    from cdpjax.layouts import LAYOUTS

    out = []
    for model in models:
        for n in devices:
            for method in methods or list(LAYOUTS):
                layout, why = LAYOUTS[method], None
                if layout.device_axis is None and n != 2:
                    why = f"{method} runs on one device whatever the count: measured at devices=2"
                elif layout.device_axis == "stage":
                    c = default_config()
                    c.method, c.model, c.stages = method, model, CHECK_STAGES
                    s = layout.default_mesh(c)["stage"]
                    if n % s:
                        why = f"{method}'s {CHECK_STAGES} stages take {s} stage devices, which do not divide {n}"
                out.append(MemoryCase(model, n, method, why))
    return out


def held_and_predicted(case: MemoryCase, say=lambda line: None) -> tuple[float, float]:
    """(XLA's held bytes per device of `case`'s compiled, donated step, the memory model's
    prediction: arguments + temporaries)."""
    import jax

    from cdpjax import bench, speedup
    from cdpjax.layouts import LAYOUTS

    c = case.config()
    n = math.prod(dict(c.mesh).values()) if dict(c.mesh) else 1
    say(f"compiling {case.method} on {case.model}, {case.devices} devices ...")
    run = bench._prepare(c, jax.devices()[:n])
    m = run["method"]
    table = m.table
    if table is None and LAYOUTS[case.method].table is not None:  # dp keeps no table: laid out from its layout
        table = speedup.table_for(c, n, m.net.num_stages)
    micro = bench.micro_batch(m, c, run["mesh"])
    model = bench.memory_model(m, c, table, bench.stage_sizes(m.net, micro), n,
                               bench.program_sizes(m, micro, run["task"]))
    return (float(bench.memory(run["compiled"])["held_bytes"]),
            float(model["arguments"]["total"] + model["temporaries"]["total"]))


__all__ = ["BlockCosts", "Candidate", "MemoryCase", "Plan", "Prediction", "StageBytes", "block_costs", "build",
           "cache_dir", "check_budget", "enumerate_candidates", "format_plan", "held_and_predicted", "make_plan",
           "memory_cases", "predict", "rank", "stage_bytes", "stage_options", "train_command", "verify"]
