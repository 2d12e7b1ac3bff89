"""`cdpjax plan`: a memory budget and a device count in; the layouts that fit, ranked by predicted
step time, the top K compiled and checked against XLA before one is recommended (`cdpjax.plan`).

    cdpjax plan --config digits --devices 4 --memory-per-device 2e6
    cdpjax plan --config bench_resnet18 --devices 8 --memory-per-device 3e8 --top 3 --json plan.json

Its arguments are checked before anything is built: `--devices` in [1, cli.MAX_CPU_DEVICES],
`--memory-per-device` and `--bandwidth` finite numbers > 0, `--top` in [1, TOP_LIMIT], every name
of `--methods` registered and of `--partitions` a partition strategy, `--json` a writable file.
"""
from __future__ import annotations

import json
import math
import sys

from cdpjax.commands.common import add_cache_flags, check_output, config_on_devices, config_parser, created_output
from cdpjax.errors import ConfigError

# Candidates compiled to verify: each compile is seconds to minutes; more is a bench, not a plan.
TOP_LIMIT = 20

EPILOG = """\
Config: --config FILE[:ARG] as for `cdpjax train`, then any key overridden with --config.KEY=VALUE
(the model, the batch...). The plan sets method, mesh, stages, partition, microbatches, residuals
and cdp_ticks itself. Memory is per device, in bytes; step times are the lockstep model's, from
per-block op times measured once on this device (cached in $CDPJAX_PLAN_CACHE, else
~/.cache/cdpjax/plan). On simulated CPU devices the times say how the candidates compare, not
what a GPU would take.
"""


def add_parser(subparsers):
    p = config_parser(
        subparsers, "plan", help="rank the layouts that fit a memory budget, verified against XLA",
        description="Enumerate every registered method, mesh, stage count, partition, micro-batch count, residual "
                    "policy and tick kind that can train the config on --devices devices; predict each one's memory "
                    "per device (its program's declared buffers) and step time (the lockstep model); drop those "
                    "over --memory-per-device; rank the rest; compile the top K and recommend the best that fits.",
        epilog=EPILOG, usage="cdpjax plan [--config FILE[:ARG]] [--config.KEY=VALUE ...] --devices D "
                             "--memory-per-device BYTES [--bandwidth B] [--top K] [--methods a,b] "
                             "[--partitions p,q] [--json OUT]")
    p.add_argument("--devices", type=int, required=True, help="devices to plan for (simulated on CPU)")
    p.add_argument("--memory-per-device", type=float, required=True, metavar="BYTES",
                   help="the budget: bytes one device may hold (e.g. 8e9)")
    p.add_argument("--bandwidth", type=float, default=100e9, help="bytes/s between devices (default 100e9)")
    p.add_argument("--top", type=int, default=3, metavar="K", help="candidates compiled to verify (default 3)")
    p.add_argument("--methods", default="", help="comma-separated methods to consider (default: every registered)")
    p.add_argument("--partitions", default="params",
                   help="comma-separated partition strategies to try (params, flops, blocks, memory, time)")
    p.add_argument("--json", dest="json_out", help="write every prediction and the verdicts to this JSON file")
    add_cache_flags(p)
    return p


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def check_args(args) -> None:
    from cdpjax.cli import MAX_CPU_DEVICES
    from cdpjax.layouts import LAYOUTS
    from cdpjax.models.partition import STRATEGIES

    if not 1 <= args.devices <= MAX_CPU_DEVICES:
        raise ConfigError(f"--devices {args.devices} must be >= 1 and <= {MAX_CPU_DEVICES}")
    for flag, value in (("--memory-per-device", args.memory_per_device), ("--bandwidth", args.bandwidth)):
        if not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{flag} {value} must be a finite number > 0")
    if not 1 <= args.top <= TOP_LIMIT:
        raise ConfigError(f"--top {args.top} must be >= 1 and <= {TOP_LIMIT} (candidates compiled to verify)")
    for name in _names(args.methods):
        LAYOUTS.lookup(name)
    partitions = _names(args.partitions)
    if not partitions or any(p not in STRATEGIES for p in partitions):
        raise ConfigError(f"--partitions {args.partitions!r}: give one or more of {', '.join(STRATEGIES)}")
    if args.json_out:
        check_output(args.json_out, "--json")


def run(args, overrides=()) -> int:
    check_args(args)
    with created_output(args.json_out, "--json"):
        return _run(args, overrides)


def _run(args, overrides) -> int:
    base, _ = config_on_devices(args, overrides, args.devices)
    from cdpjax import checks, plan as plan_lib

    checks.validate(base)

    def say(line):
        print(f"cdpjax plan: {line}", file=sys.stderr, flush=True)

    plan = plan_lib.make_plan(base, args.devices, args.memory_per_device, args.bandwidth,
                              _names(args.methods) or None, tuple(_names(args.partitions)), say=say)
    plan_lib.check_budget(plan.predictions, args.memory_per_device)
    verified = plan_lib.verify(plan, base, args.devices, args.top, say=say)
    print(plan_lib.format_plan(plan, verified, args.top))
    over = [v for v in verified if v.compiled_bytes > args.memory_per_device]
    for v in over:
        print(f"dropped: {v.candidate.label()} compiles to {v.compiled_bytes:.0f} bytes per device, over the "
              f"budget of {args.memory_per_device:.0f} (predicted {v.memory:.0f})")
    fits = [v for v in verified if v.compiled_bytes <= args.memory_per_device]
    if fits:
        print(f"recommended: {fits[0].candidate.label()}\n  "
              f"{plan_lib.train_command(fits[0].candidate, args.config, overrides)}")
    else:
        print(f"none of the top {len(verified)} fits the budget once compiled: raise --top, or the budget")
    if args.json_out:
        record = {"devices": args.devices, "memory_per_device": args.memory_per_device, "bandwidth": args.bandwidth,
                  "refused": plan.refused, "predictions": [p.record() for p in plan.predictions],
                  "verified": [v.record() for v in verified],
                  "recommended": fits[0].record() if fits else None,
                  "command": plan_lib.train_command(fits[0].candidate, args.config, overrides) if fits else None}
        with open(args.json_out, "w") as f:
            json.dump(record, f, indent=2)
    return 0 if fits else 1


__all__ = ["TOP_LIMIT", "add_parser", "check_args", "run"]
