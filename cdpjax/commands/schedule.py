"""`cdpjax schedule`: print, dump or draw a method's time table. No JAX: instant.

    cdpjax schedule --method cdp-v2 --workers 4 --stages 4            # text grid
    cdpjax schedule --method cdp-v2 --workers 8 --stages 4 --json     # the table as JSON
    cdpjax schedule --method gpipe --stages 4 --microbatches 4 --out gpipe.svg
    cdpjax schedule --method cdp-zero --workers 4 --stages 4 --rule cdp-v1  # owners, relayed versions
"""
from __future__ import annotations

import argparse
import json
import sys

from cdpjax.config import ConfigError
from cdpjax.timetable import METHODS, table


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "schedule",
        help="print or draw a method's time table",
        description="Print (default), dump (--json) or draw (--out) the time table of a method.",
    )
    p.add_argument("--method", choices=METHODS, default="cdp-v2")
    p.add_argument("--workers", type=int, default=4, help="CDP workers N (2L must be a multiple of N)")
    p.add_argument("--stages", type=int, default=4, help="stages L")
    p.add_argument("--steps", type=int, default=3, help="training steps laid out (ppll: batches)")
    p.add_argument("--microbatches", type=int, default=4, help="gpipe micro-batches M (1: plain model parallelism)")
    p.add_argument("--rule", choices=("cdp-v2", "cdp-v1"), default="cdp-v2", help="staleness rule of cdp-zero and cdp-mp")
    p.add_argument("--out", default=None, help="draw the timing diagram to FILE.png or FILE.svg")
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    """Returns 0, or 2 after a one-line message for bad sizes."""
    try:
        t = table(args.method, workers=args.workers, stages=args.stages, steps=args.steps,
                  microbatches=args.microbatches, rule=getattr(args, "rule", "cdp-v2"))
        if args.out:
            from cdpjax.plotting import plot_schedule  # matplotlib only when drawing

            plot_schedule(t, args.out)
    except ConfigError as e:
        print(f"cdpjax schedule: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(t.to_json()))
    elif args.out:
        print(f"wrote {args.out}")
    else:
        print(t.format_grid())
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="cdpjax")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(["schedule", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
