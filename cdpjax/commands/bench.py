"""`cdpjax bench`: several methods on the same model and batch, side by side in one process.

Its arguments are checked before anything is compiled: every method's config (`cdpjax.setup.setup`),
`--repeats` in [1, REPEATS_LIMIT], `--bandwidth` a finite number > 0, `--predict` in [0,
PREDICT_LIMIT], `--cpu-devices` in range, and `--json` a file in a folder that exists, created
before the work (so that a bench's results are never lost at the end; removed again, empty, if
the bench fails).
"""
from __future__ import annotations

import json
import math
import sys

from cdpjax.commands.common import add_cache_flags, check_output, config_on_devices, config_parser, created_output
from cdpjax.errors import ConfigError

# Timed steps per method: the median of a thousand is as good as of more, and a bench stays minutes long.
REPEATS_LIMIT = 1000
# Devices --predict models: a table is laid out for them (`cdpjax.commands.schedule.BUILD_SIZE_LIMIT`).
PREDICT_LIMIT = 1024

EPILOG = """\
Every method is compiled first, then timed in interleaved rounds (medians), so that load on a
shared machine falls on all alike. Config: --config FILE[:ARG] as for `cdpjax train`, then any
key overridden with --config.KEY=VALUE (e.g. --config.model=resnet_tiny --config.global_batch_size=64);
a method may be NAME@KEY=VALUE[@...], a variant benched beside the others (cdp-v2@residuals=carry).
"""


def add_parser(subparsers):
    p = config_parser(
        subparsers, "bench", help="compare methods: compile/step time, memory, collectives, tables",
        description="Compare methods on the same model and batch, side by side in one process: compile and step "
                    "time, XLA memory, the collectives in the compiled HLO, bytes sent, and the time tables' "
                    "figures; --predict models real devices.",
        epilog=EPILOG, usage="cdpjax bench [--config FILE[:ARG]] [--config.KEY=VALUE ...] --methods a,b,... "
                             "[--cpu-devices N] [--json OUT] [--repeats R] "
                             "[--predict K [--bandwidth B] [--calibrate alone|together] [--no-heads]] "
                             "[--keep-mesh] [--compilation-cache DIR | --no-compilation-cache]")
    p.add_argument("--methods", default="e2e,dp,cdp-v1,cdp-v2",
                   help="comma-separated method names; NAME@KEY=VALUE[@...] benches a variant "
                        "(e.g. cdp-v2@residuals=carry) beside the others")
    p.add_argument("--cpu-devices", type=int, default=8, help="simulated CPU devices where no accelerator is present")
    p.add_argument("--json", dest="json_out", help="write the records to this JSON file")
    p.add_argument("--keep-mesh", action="store_true", help="use the config's mesh for every method")
    add_cache_flags(p)
    p.add_argument("--repeats", type=int, default=5, help="timed steps per method (median reported)")
    p.add_argument("--predict", type=int, default=0, metavar="K",
                   help="also predict step time and speedup on K real devices (see cdpjax.speedup)")
    p.add_argument("--bandwidth", type=float, default=100e9, help="bytes/s between devices for --predict")
    p.add_argument("--speedup-model", choices=("lockstep", "async"), default="lockstep",
                   help="--predict's model: lockstep ticks, as cdpjax's SPMD programs run (default), or async, each "
                        "op as soon as its inputs are there (MPMD host queues); see cdpjax.speedup")
    p.add_argument("--calibrate", choices=("alone", "together"), default="alone",
                   help="--predict's op times: each op on one device with the others idle (default), or on K devices "
                        "at once, as a lockstep tick runs them (devices that share cores); see cdpjax.speedup")
    p.add_argument("--no-heads", action="store_true",
                   help="--predict without the auxiliary heads' time (local learning times them by default)")
    return p


def _devices_for(config):
    """The first devices the config's mesh needs (all of them where an axis is -1)."""
    import jax

    from cdpjax.layouts import devices_needed

    n = devices_needed(config)
    return jax.devices()[:n] if n else None


def check_args(args) -> None:
    """The arguments that would otherwise fail after the work (module docstring)."""
    from cdpjax.cli import check_cpu_devices

    if not 1 <= args.repeats <= REPEATS_LIMIT:
        raise ConfigError(f"--repeats {args.repeats} must be >= 1 and <= {REPEATS_LIMIT} (timed steps per method, "
                          f"median reported)")
    if not math.isfinite(args.bandwidth) or args.bandwidth <= 0:
        raise ConfigError(f"--bandwidth {args.bandwidth} must be a finite number of bytes/s > 0")
    if not 0 <= args.predict <= PREDICT_LIMIT:
        raise ConfigError(f"--predict {args.predict} must be >= 0 and <= {PREDICT_LIMIT} (the devices to predict for; "
                          f"0: none)")
    check_cpu_devices(args.cpu_devices, f"--cpu-devices {args.cpu_devices}")
    if not [m for m in args.methods.split(",") if m.strip()]:
        raise ConfigError(f"--methods {args.methods!r} names no method")
    if args.json_out:
        check_output(args.json_out, "--json")


def run(args, overrides=()) -> int:
    check_args(args)
    with created_output(args.json_out, "--json"):
        return _run(args, overrides)


def _run(args, overrides) -> int:
    base, cache = config_on_devices(args, overrides, args.cpu_devices)
    from cdpjax import bench, config as cfg_lib

    specs = [m.strip() for m in args.methods.split(",") if m.strip()]
    names = [spec.split("@")[0] for spec in specs]
    from cdpjax.layouts import LAYOUTS

    for name in names:
        LAYOUTS.lookup(name)  # an unknown name fails here, with the registered ones
    configs = []
    for spec, name in zip(specs, names):
        c = bench.variant_config(base, spec)
        cfg_lib.validate(c)
        if not args.keep_mesh:  # every device on the axis the method declares (its layout)
            c.mesh = LAYOUTS[name].default_mesh(c)
        configs.append(c)
    devices = [_devices_for(c) for c in configs]
    built = bench.setup_all(configs, devices)  # every method checked before this line and before any compiles
    print(f"cdpjax bench: {', '.join(names)} (compiled first, then timed in interleaved rounds; "
          f"{cache.words()}) ...", file=sys.stderr, flush=True)
    records = bench.bench_methods(configs, devices, repeats=args.repeats, built=built)
    for spec, r in zip(specs, records):
        r["label"] = spec
    if args.predict:
        from cdpjax import speedup

        for r, spec in zip(records, specs):
            r["prediction"] = speedup.predict_for_config(bench.variant_config(base, spec), args.predict,
                                                         args.bandwidth, heads=not args.no_heads,
                                                         model=args.speedup_model, calibrate=args.calibrate)
    print(bench.format_table(records))
    if args.predict:
        from cdpjax import speedup

        print(speedup.format_predictions(records))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(records, f, indent=2)
        print(f"cdpjax bench: records in {args.json_out}", file=sys.stderr)
    return 0
