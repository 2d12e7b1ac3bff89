"""`cdpjax schedule`: print, dump or draw a method's time table. No JAX: instant.

    cdpjax schedule --method cdp-v2 --workers 4 --stages 4            # text grid
    cdpjax schedule --method cdp-v2 --workers 8 --stages 4 --json     # the table as JSON
    cdpjax schedule --method gpipe --stages 4 --microbatches 4 --out gpipe.svg
    cdpjax schedule --method cdp-zero --workers 4 --stages 4 --rule cdp-v1  # shards, gathers, stored versions
    cdpjax schedule --method cdp-v2 --workers 8 --stages 4 --rule paper-code  # the authors' released rule
    cdpjax schedule --method cdp-v2 --stages 2 --json --stage-bytes 3e6,1e6  # activation and comm in bytes
    cdpjax schedule --from-json table.json --out table.png            # a table written by --json
    cdpjax schedule --method zb-h1 --stages 4 --microbatches 8        # F, B (input) and W (weight) ops
    cdpjax schedule --method 1f1b --stages 4 --costs F=1,B=2,W=1      # replayed in time units, step time
    cdpjax schedule --method cdp-random --delay model=geometric,p=0.4,tau_max=4 --steps 64 --staleness
                                                                      # each read's staleness, and its histogram

Sizes a method's table does not take (ppll has no workers) are refused, by name; a
size left out takes the table's own default (ppll lays out enough batches to reach
its steady state). Sizes are bounded so that the table is laid out and written in seconds
(each at most `BUILD_SIZE_LIMIT`, the ops they lay out at most `OP_LIMIT`), a `--from-json`
file is a regular file read with its limit (`cdpjax.files`) and checked field by field and
across fields (`cdpjax.table_json`), and `--out` must name a .png or .svg in a folder that
exists, created before any table is built. Then, before a line is written, what the table
is written as is bounded: the text grid, `--json` and `--costs` at most `OUTPUT_LIMIT` ops,
messages and grid cells in all; a drawing at most `DRAW_OP_LIMIT` ops, `DRAW_TICK_LIMIT`
ticks and `DRAW_STAGE_LIMIT` stages (matplotlib's images end at 2**16 pixels a side).
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import sys

from cdpjax import files, table_json
from cdpjax.commands.common import FIGURE_SUFFIXES, created_output
from cdpjax.config import default_config
from cdpjax.errors import ConfigError
from cdpjax.layouts import LAYOUTS

# The ops a table may lay out here: steps x stages x max(workers, micro-batches) x chunks x 3 (F, B,
# W), and each size: the table functions take time superlinear in the stages (cdp's delivery plan,
# a pipeline's device orders), so both are kept where a table is laid out in seconds.
OP_LIMIT = 100_000
BUILD_SIZE_LIMIT = 1024
# What a table is written as (module docstring): ops + messages + ticks x devices for the text grid,
# --json and --costs; the drawing's ops, ticks and stages (a side of at most 2**16 pixels at 120 dpi,
# 0.32 inch a tick and 0.55 a stage).
OUTPUT_LIMIT = 500_000
DRAW_OP_LIMIT = 2_048
DRAW_TICK_LIMIT = 1_500
DRAW_STAGE_LIMIT = 900


def _groups(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(g) for g in text.replace("[", "").replace("]", "").split(",") if g.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"module groups {text!r} must be integers, e.g. 8,3,2,2") from None


def _floats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(b) for b in text.replace("[", "").replace("]", "").split(",") if b.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"stage bytes {text!r} must be numbers, e.g. 3e6,1e6") from None
    if not all(math.isfinite(v) and v >= 0 for v in values) or len(values) > table_json.SIZE_LIMIT:
        raise argparse.ArgumentTypeError(f"stage bytes {text!r} must be finite numbers >= 0, one per stage")
    return values


def _costs(text: str) -> dict[str, float]:
    try:
        pairs = [item.split("=") for item in text.split(",") if item.strip()]
        return {key.strip(): float(value) for key, value in pairs}
    except ValueError:
        raise argparse.ArgumentTypeError(f"costs {text!r} must be KIND=TIME pairs, e.g. F=1,B=2,W=1") from None


def add_parser(subparsers) -> argparse.ArgumentParser:
    with_tables = [name for name, layout in LAYOUTS.items() if layout.table is not None]
    p = subparsers.add_parser(
        "schedule",
        help="print or draw a method's time table",
        description="Print (default), dump (--json) or draw (--out) the time table of a method. "
                    "Methods: " + "; ".join(f"{n}: {LAYOUTS[n].summary}" for n in with_tables),
    )
    p.add_argument("--method", choices=with_tables, default=default_config().method)
    p.add_argument("--workers", type=int, default=None, help="CDP workers N (2L must be a multiple of N)")
    p.add_argument("--stages", type=int, default=None, help="stages L (ppll: local modules K)")
    p.add_argument("--steps", type=int, default=None, help="training steps laid out (ppll: batches)")
    p.add_argument("--microbatches", type=int, default=None, help="micro-batches M per step (pipelines)")
    p.add_argument("--rule", default=None, help="staleness rule (cdp-v2: cdp-v2 or paper-code; cdp-zero, cdp-mp: "
                                                "cdp-v2 or cdp-v1)")
    p.add_argument("--stage-bytes", type=_floats, default=None, metavar="B0,B1,...",
                   help="each stage's output bytes (one micro-batch): --json adds the activation figures in bytes "
                        "and the bytes per tick")
    p.add_argument("--chunks", type=int, default=None, help="stages per device V (interleaved pipelines)")
    p.add_argument("--ticks", default=None, choices=("whole", "split", "paired"),
                   help="CDP's ops per tick: whole (F, B), split (F, B, W) or paired (two forwards a tick)")
    p.add_argument("--module-groups", type=_groups, default=None, metavar="G0,G1,...",
                   help="local modules per device (ppll), e.g. 8,3,2,2")
    p.add_argument("--costs", type=_costs, default=None, metavar="F=1,B=2,W=1",
                   help="each op kind's time: replay the table in lockstep (each tick as long as its slowest op) and "
                        "show it in time units with its step time; B is the whole backward, W its weight half (the "
                        "input half B - W where a W follows), every stage alike")
    p.add_argument("--delay", default=None, metavar="model=NAME,key=value,...",
                   help="cdp-random's delay model and its parameters (docs/delays.md), e.g. model=async,durations=3")
    p.add_argument("--staleness", action="store_true",
                   help="print (with --out: draw) the staleness of each read per worker and stage and its histogram "
                        "over steps instead of the grid")
    p.add_argument("--from-json", default=None, metavar="FILE", help="read the table from FILE (written by --json)")
    p.add_argument("--out", default=None, help="draw the timing diagram to FILE.png or FILE.svg")
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    p.set_defaults(func=run)
    return p


def _read_json(path: str) -> bytes:
    try:
        return files.read_bytes(path, table_json.JSON_LIMIT)
    except files.FileRefused as e:
        raise ConfigError(f"--from-json {e}") from None
    except OSError as e:
        raise ConfigError(f"--from-json {path!r}: {e.strerror or e}") from None


def check_sizes(layout, sizes: dict) -> None:
    """Sizes small enough for the table to be laid out in seconds (module docstring): each at most
    BUILD_SIZE_LIMIT, the ops they lay out at most OP_LIMIT; a size left out counts at the table
    function's default (steps without one: twice the stages, as ppll lays out). Sizes below 1
    are the layouts' to refuse, in their words."""
    for name, value in sizes.items():
        values = value if isinstance(value, tuple) else (value,)
        sized = name not in ("rule", "steps", "ticks", "delay") and value is not None
        if sized and (any(v > BUILD_SIZE_LIMIT for v in values) or len(values) > BUILD_SIZE_LIMIT):
            raise ConfigError(f"--{name.replace('_', '-')} {','.join(map(str, values))[:80]}: at most "
                              f"{BUILD_SIZE_LIMIT} here (the table would not be laid out in seconds)")
    defaults = {}
    if layout.table is not None:
        defaults = {p.name: p.default for p in inspect.signature(layout.table).parameters.values()
                    if isinstance(p.default, int) and not isinstance(p.default, bool)}

    def size(name, otherwise=1):
        v = sizes.get(name)
        v = sum(v) if isinstance(v, tuple) else v
        return max(v if v is not None else defaults.get(name, otherwise), 1)

    stages = size("stages")
    ops = size("steps", 2 * stages) * stages * max(size("workers"), size("microbatches")) * size("chunks") * 3
    if layout.messages_per_op:  # its messages outnumber its ops: counted with them
        ops *= 1 + size(layout.messages_per_op)
    if ops > OP_LIMIT:
        what = "ops and messages" if layout.messages_per_op else "ops"
        raise ConfigError(f"{layout.name} with those sizes lays out about {ops:.3g} {what}, more than "
                          f"{OP_LIMIT:.0e}: give fewer --steps, --stages, --workers or --microbatches")


def _table(args):
    if args.from_json:
        from cdpjax.timetable import TimeTable

        return TimeTable.from_json(_read_json(args.from_json))
    sizes = {"workers": args.workers, "stages": args.stages, "steps": args.steps,
             "microbatches": args.microbatches, "rule": args.rule, "chunks": args.chunks,
             "module_groups": args.module_groups, "ticks": args.ticks, "delay": args.delay}
    layout = LAYOUTS.lookup(args.method)
    check_sizes(layout, sizes)
    return layout.make_table(**sizes)


def check_output_size(t, drawing: bool, written: bool) -> None:
    """The table small enough to be written (`written`: as text or JSON) and drawn (`drawing`) in
    seconds (module docstring); ConfigError naming the size past its limit."""
    cells = t.num_ticks * t.devices
    if written and len(t.ops) + len(t.messages) + cells > OUTPUT_LIMIT:
        raise ConfigError(f"{t.method}'s table has {len(t.ops)} ops, {len(t.messages)} messages and {t.num_ticks} "
                          f"ticks x {t.devices} devices, more than {OUTPUT_LIMIT} in all to write: lay out fewer "
                          f"steps, stages, workers or micro-batches")
    if drawing:
        for what, value, limit in (("ops", len(t.ops), DRAW_OP_LIMIT), ("ticks", t.num_ticks, DRAW_TICK_LIMIT),
                                   ("stages", t.stages, DRAW_STAGE_LIMIT)):
            if value > limit:
                raise ConfigError(f"{t.method}'s table has {value} {what}, more than the {limit} --out draws: lay out "
                                  f"fewer (--json and the text grid take larger tables)")


def _lockstep_costs(args, t):
    """The `--costs` as `StageCosts` for the table's stages, or None without them."""
    if not args.costs:
        return None
    from cdpjax.speedup import uniform_costs

    return uniform_costs(args.costs, t.stages)


def run(args) -> int:
    """Returns 0, or 2 after a one-line message for bad sizes."""
    try:
        with created_output(args.out, "--out", FIGURE_SUFFIXES):
            t = _table(args)
            check_output_size(t, drawing=bool(args.out), written=args.json or not args.out)
            costs = _lockstep_costs(args, t)
            if args.out and args.staleness:
                from cdpjax.staleness import plot_staleness  # matplotlib only when drawing

                plot_staleness(t, args.out)
            elif args.out:
                from cdpjax.plotting import plot_schedule  # matplotlib only when drawing

                plot_schedule(t, args.out, costs=costs)
    except ConfigError as e:
        print(f"cdpjax schedule: error: {e}", file=sys.stderr)
        return 2
    described = ",".join(f"{k}={v:g}" for k, v in (args.costs or {}).items())
    if args.json:
        try:
            d = t.to_json(args.stage_bytes)
        except ConfigError as e:  # stage bytes that do not fit the table
            print(f"cdpjax schedule: error: {e}", file=sys.stderr)
            return 2
        if costs is not None:
            from cdpjax.speedup import lockstep_summary

            d["lockstep"] = {"costs": dict(args.costs), **lockstep_summary(t, costs)}
        print(json.dumps(d))
    elif args.out:
        print(f"wrote {args.out}")
    elif args.staleness:
        from cdpjax.staleness import format_staleness

        print(format_staleness(t))
    elif costs is not None:
        from cdpjax.speedup import format_lockstep

        print(format_lockstep(t, costs, described=described))
    else:
        print(t.format_grid())
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="cdpjax")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(["schedule", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
