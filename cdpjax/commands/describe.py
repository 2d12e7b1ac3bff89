"""`cdpjax describe`: the model as a run of the config cuts it, without compiling anything.

    cdpjax describe --config ppll_resnet32:K=16      # PPLL's 15 modules on 4 GPUs
    cdpjax describe --config ppll_resnet32:K=16,recipe=infopro --config.module_groups=[9,3,2,2]
    cdpjax describe --config ppll_vit --json

Per stage (local module): its blocks, parameter count, output shape, activation
bytes per example (its output, what it hands on), forward FLOPs at batch 1, the
device it lands on, and, for methods that train auxiliary heads (local learning:
`local`, `ppll`), its head's trained parameter count (`head_params`; InfoPro's
decoder apart, `decoder_params`), the parameters it keeps as a moving average of
the next module's instead of training them (`ema_params`, `aux_head='man'` where
the next module shares the device; heads are built for `config.module_groups`)
and its forward FLOPs. Other methods have no heads: `aux_head` is None and the
head figures are 0. Users check a split before spending GPU hours on it.

Nothing is computed on a device: shapes and parameter counts come from abstract
evaluation (`jax.eval_shape`) and FLOPs from XLA's cost analysis of lowered,
never compiled, programs (`cdpjax.models.partition`). The dataset is not read:
its image shape and class count come from its tensorflow-datasets spec, or from
building the embedded ones (digits, synthetic).

The device of stage j: on `stage`-axis layouts, device j, or with
`config.module_groups` (layouts whose table takes it, ppll) the device of its
group (`cdpjax.layouts.ppll.module_devices`); 0 on data-axis and one-device layouts
(every device holds every stage).
"""
from __future__ import annotations

import json
import math

from cdpjax.kinds import KINDS

JSON_STAGE_KEYS = ("blocks", "params", "output_shape", "activation_bytes", "flops", "device", "head_params",
                   "decoder_params", "ema_params", "head_flops")
LOCAL_BUILDER = "cdpjax.methods.local:build"  # the one-device method that trains heads (no time table)


def _input_spec(config) -> tuple[tuple[int, ...], int, str]:
    """(input shape, classes, input dtype) of the config's dataset, without reading it."""
    from cdpjax import data
    from cdpjax.data import tfds_data

    spec = tfds_data.SPECS.get(config.dataset)
    if spec is not None:  # building a tfds dataset would require it to be prepared here
        return tuple(spec.image_shape), spec.num_classes, "float32"
    dataset = data.build(config)
    return tuple(dataset.image_shape), dataset.num_classes, dataset.input_dtype


def _task(config):
    """The config's task (`config.task`, else its dataset's), without reading a tfds dataset."""
    from cdpjax import data, tasks
    from cdpjax.data import tfds_data

    if config.get("task", ""):
        return tasks.lookup(config.task)
    if config.dataset in tfds_data.SPECS:
        return tasks.CLASSIFICATION
    return tasks.lookup(getattr(data.build(config), "task", "classification"))


def stage_devices(config, num_stages: int) -> list[int]:
    """The device of each stage as the config's method places it (module docstring)."""
    from cdpjax.layouts import LAYOUTS
    from cdpjax.layouts.ppll import module_devices

    layout = LAYOUTS.lookup(config.method)
    if layout.device_axis != "stage":
        return [0] * num_stages
    groups = config.get("module_groups", None)
    if groups and "module_groups" in layout.table_sizes():
        return list(module_devices(num_stages, groups))
    return list(range(num_stages))


def has_heads(config) -> bool:
    """Whether the config's method trains auxiliary heads: its time table has local-learning
    ('FB') ops, or it is sequential local learning (`LOCAL_BUILDER`, no table)."""
    from cdpjax.layouts import LAYOUTS

    layout = LAYOUTS.lookup(config.method)
    if layout.table is None:
        return layout.builder == LOCAL_BUILDER
    return any(KINDS[op.kind].forward and KINDS[op.kind].backward for op in layout.make_table().ops)


def _count(tree) -> int:
    import jax

    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


def _stages(net, heads) -> list[dict]:
    """Per stage: blocks, parameters, output, activation bytes, FLOPs, head sizes (no device)."""
    import jax

    from cdpjax.models import partition

    params, _ = jax.eval_shape(lambda: net.init(jax.random.key(0), 1))
    outputs = [jax.ShapeDtypeStruct(s, "float32") for s in net.stage_output_shapes(1)]
    block_flops = partition.block_costs(net.blocks, net.input_shape, "flops", net.input_dtype)
    stages = []
    counts_of = heads.param_counts() if heads is not None else [{}] * net.num_stages
    for j, ((a, b), out, counts) in enumerate(zip(net.bounds, outputs, counts_of)):
        module = heads.modules[j] if heads is not None else None
        # Cost analysis of the head's lowered forward at batch 1, like the blocks' (no compile).
        head_flops = partition._flops(module, (1, *heads.feature_shapes[j])) if module is not None else 0.0
        stages.append({
            "stage": j,
            "blocks": [a, b],
            "params": _count(params[j]),
            "output_shape": list(out.shape[1:]),
            "activation_bytes": math.prod(out.shape[1:]) * out.dtype.itemsize,
            "flops": int(sum(block_flops[a:b])),
            "head_params": counts.get("head_params", 0),
            "decoder_params": counts.get("decoder_params", 0),
            "ema_params": counts.get("ema_params", 0),
            "head_flops": int(head_flops),
        })
    return stages


def describe(config) -> dict:
    """The config's model as its run cuts it: `{'model', 'method', ..., 'stages': [...], 'devices':
    [...], 'totals': {...}}` (module docstring; `blocks` is the half-open range [first, last + 1)
    of block indices, as `StagedNet.bounds`). Validates the config first (ConfigError)."""
    from cdpjax import checks, layouts, models
    from cdpjax.models import aux_heads

    checks.validate(config)
    input_shape, num_classes, input_dtype = _input_spec(config)
    net = models.build(config, input_shape, num_classes, input_dtype=input_dtype)
    heads = None
    if has_heads(config):
        heads = aux_heads.build(config.aux_head, net, num_classes, dict(config.get("aux_kwargs", {}) or {}),
                                groups=config.get("module_groups", None), task=_task(config))
    stages = _stages(net, heads)
    for stage, device in zip(stages, stage_devices(config, net.num_stages)):
        stage["device"] = device
    summed = ("params", "flops", "head_params", "decoder_params", "ema_params", "head_flops")
    per_device = []
    for d in sorted({s["device"] for s in stages}):
        mine = [s for s in stages if s["device"] == d]
        per_device.append({"device": d, "stages": [s["stage"] for s in mine],
                           **{k: sum(s[k] for s in mine) for k in summed}})
    groups = config.get("module_groups", None)
    return {
        "model": config.model,
        "method": config.method,
        "dataset": config.dataset,
        "input_shape": list(input_shape),
        "num_classes": num_classes,
        "mesh": layouts.mesh_for(config),
        "devices_needed": layouts.devices_needed(config),
        "partition": config.get("partition", "params"),
        "aux_head": config.aux_head if heads is not None else None,
        "module_groups": list(groups) if groups else None,
        "num_blocks": len(net.blocks),
        "stages": stages,
        "devices": per_device,
        "totals": {k: sum(s[k] for s in stages) for k in summed},
    }


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:g}"


def format_text(d: dict) -> str:
    """The description as a table, one row a stage, then the totals (head columns only for
    methods with auxiliary heads, the EMA column only where a head has EMA parameters)."""
    from cdpjax.mesh import mesh_words

    shape = "x".join(map(str, d["input_shape"]))
    heads, ema = d["aux_head"] is not None, any(s["ema_params"] for s in d["stages"])
    lines = [f"{d['model']} on {d['dataset']} ({shape}, {d['num_classes']} classes): {len(d['stages'])} stages "
             f"of {d['num_blocks']} blocks for method {d['method']}, mesh {mesh_words(d['mesh'])}, "
             + (f"aux head {d['aux_head']}" if heads else "no auxiliary heads")
             + (f", module groups {d['module_groups']}" if d["module_groups"] else "")]
    head_cols = [("head", "head_params"), ("decoder", "decoder_params")] + ([("EMA", "ema_params")] if ema else [])

    def row(label, blocks, device, s, output, act):
        text = f"{label:>5} {blocks:>7} {device:>6} {s['params']:>9,} {output:>12} {act:>11} {_si(s['flops']):>9}"
        if heads:
            text += "".join(f" {s[key]:>9,}" for _, key in head_cols) + f" {_si(s['head_flops']):>10}"
        return text

    lines.append(f"{'stage':>5} {'blocks':>7} {'device':>6} {'params':>9} {'output':>12} {'act/example':>11} "
                 f"{'FLOPs':>9}" + ("".join(f" {name:>9}" for name, _ in head_cols) + f" {'head FLOPs':>10}"
                                    if heads else ""))
    for s in d["stages"]:
        a, b = s["blocks"]
        lines.append(row(s["stage"], f"{a}-{b - 1}", s["device"], s, "x".join(map(str, s["output_shape"])),
                         f"{_si(s['activation_bytes'])}B"))
    lines.append(row("total", "", "", d["totals"], "", ""))
    if len(d["devices"]) > 1:
        lines.append("per device: " + "; ".join(
            f"{e['device']}: stages {e['stages']}, {_si(e['flops'] + e['head_flops'])} FLOPs"
            + (" with heads" if heads else "") for e in d["devices"]))
    lines.append("blocks: first-last block index; FLOPs: forward at batch 1 (XLA cost analysis); "
                 "act/example: the stage's output for one example"
                 + ("; head: trained head parameters (decoder apart)" if heads else "")
                 + ("; EMA: head parameters that follow the next module by EMA, not trained" if ema else ""))
    return "\n".join(lines)


DESCRIBE_EPILOG = """\
Config: --config FILE[:ARG] as for `cdpjax train` (e.g. ppll_resnet32:K=4),
then any key overridden with --config.KEY=VALUE (e.g. --config.module_groups=[9,3,2,2]
--config.stages=[2,5,9]). Nothing is compiled and no device is used.
"""


def add_parser(subparsers):
    from cdpjax.commands.common import config_parser

    p = config_parser(
        subparsers, "describe", help="the model as the config's run cuts it (no compile, no device)",
        description="Print the model as the config's run cuts it: per stage (local module) its blocks, "
                    "parameters, output shape, activation bytes per example, forward FLOPs, device and auxiliary "
                    "head; then per-device and total sums.",
        epilog=DESCRIBE_EPILOG, usage="cdpjax describe [--config FILE[:ARG]] [--config.KEY=VALUE ...] [--json]")
    p.add_argument("--json", action="store_true", help="print the description as JSON")
    return p


def run(args, overrides=()) -> int:
    from cdpjax.cli import _load

    from cdpjax import checks

    config = _load(args, overrides)
    checks.validate(config)
    checks.try_model(config, *_input_spec(config))  # options the model cannot take: one line, not a traceback
    d = describe(config)
    print(json.dumps(d) if args.json else format_text(d))
    return 0


__all__ = ["JSON_STAGE_KEYS", "add_parser", "describe", "format_text", "has_heads", "run", "stage_devices"]
