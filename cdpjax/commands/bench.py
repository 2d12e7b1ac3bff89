"""`cdpjax bench`: several methods on the same model and batch, side by side in one process."""
from __future__ import annotations

import json
import sys

def add_parser(subparsers):
    p = subparsers.add_parser("bench", help="compare methods: compile/step time, memory, collectives, tables")
    p.add_argument("--config", help="Python config file (default: the digits default)")
    p.add_argument("--methods", default="e2e,dp,cdp-v1,cdp-v2",
                   help="comma-separated method names; NAME@KEY=VALUE[@...] benches a variant "
                        "(e.g. cdp-v2@residuals=carry) beside the others")
    p.add_argument("--cpu-devices", type=int, default=8, help="simulated CPU devices where no accelerator is present")
    p.add_argument("--json", dest="json_out", help="write the records to this JSON file")
    p.add_argument("--keep-mesh", action="store_true", help="use the config's mesh for every method")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per method (median reported)")
    p.add_argument("--predict", type=int, default=0, metavar="K",
                   help="also predict step time and speedup on K real devices (see cdpjax.speedup)")
    p.add_argument("--bandwidth", type=float, default=100e9, help="bytes/s between devices for --predict")
    p.add_argument("--speedup-model", choices=("lockstep", "async"), default="lockstep",
                   help="--predict's model: lockstep ticks, as cdpjax's SPMD programs run (default), or async, each "
                        "op as soon as its inputs are there (MPMD host queues); see cdpjax.speedup")
    p.add_argument("--no-heads", action="store_true",
                   help="--predict without the auxiliary heads' time (local learning times them by default)")
    return p


def _devices_for(config):
    """The first devices the config's mesh needs (all of them where an axis is -1)."""
    import jax

    from cdpjax.layouts import devices_needed

    n = devices_needed(config)
    return jax.devices()[:n] if n else None


def run(args, overrides=()) -> int:
    from cdpjax.cli import _load
    from cdpjax.mesh import setup_devices

    base = _load(args, overrides)
    setup_devices(args.cpu_devices)
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
    print(f"cdpjax bench: {', '.join(names)} (compiled first, then timed in interleaved rounds) ...",
          file=sys.stderr, flush=True)
    records = bench.bench_methods(configs, [_devices_for(c) for c in configs], repeats=args.repeats)
    for spec, r in zip(specs, records):
        r["label"] = spec
    if args.predict:
        from cdpjax import speedup

        for r, spec in zip(records, specs):
            r["prediction"] = speedup.predict_for_config(bench.variant_config(base, spec), args.predict,
                                                         args.bandwidth, heads=not args.no_heads,
                                                         model=args.speedup_model)
    print(bench.format_table(records))
    if args.predict:
        from cdpjax import speedup

        print(speedup.format_predictions(records))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(records, f, indent=2)
        print(f"cdpjax bench: records in {args.json_out}", file=sys.stderr)
    return 0
