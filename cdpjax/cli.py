"""`cdpjax`: the command line (train, schedule, bench).

JAX is imported only after `--cpu-devices` is applied, so that the simulated
device count takes effect. Bad input exits with status 2 and a one-line message,
without a traceback.
"""
from __future__ import annotations

import argparse
import sys

from cdpjax.config import ConfigError


def _split_config_overrides(argv):
    overrides, rest = [], []
    for a in argv:
        if a.startswith("--config."):
            overrides.append(a[len("--config."):])
        else:
            rest.append(a)
    return overrides, rest


def _load(args, overrides):
    from cdpjax import config as cfg_lib

    c = cfg_lib.default_config()
    if args.config:
        file_config = cfg_lib.load_file(args.config)
        for key in file_config.keys():
            cfg_lib.set_value(c, key, file_config[key]) if key in c else c.__setitem__(key, file_config[key])
    cfg_lib.apply_overrides(c, overrides)
    return c


def _cpu_devices(args):
    from cdpjax.mesh import setup_devices

    setup_devices(args.cpu_devices)


def cmd_train(args, overrides) -> int:
    config = _load(args, overrides)
    _cpu_devices(args)
    from cdpjax import train

    workdir = args.workdir or train.default_workdir(config)
    print(f"cdpjax: training {config.method} / {config.model} / {config.dataset} in {workdir}", file=sys.stderr)
    summary = train.train(config, workdir, progress=not args.no_progress)
    print(f"cdpjax: test accuracy {summary['test_accuracy']:.4f} after {summary['steps']} steps, "
          f"{summary['images_per_second']:.0f} images/s on {summary['devices']} device(s); "
          f"summary in {workdir}/summary.json", file=sys.stderr)
    return 0


def _subcommand(name):
    import importlib

    return importlib.import_module(f"cdpjax.commands.{name}")


def _runner(module):
    import inspect

    takes_overrides = len(inspect.signature(module.run).parameters) > 1
    return lambda args, overrides: module.run(args, overrides) if takes_overrides else module.run(args)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides, argv = _split_config_overrides(argv)
    parser = argparse.ArgumentParser(prog="cdpjax", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train a config (default: CDP-v2 on digits)")
    p.add_argument("--config", help="Python file whose get_config() returns a ConfigDict")
    p.add_argument("--workdir", help="where checkpoints, metrics.jsonl and summary.json go (resumes if it has a checkpoint)")
    p.add_argument("--cpu-devices", type=int, default=8, help="simulated CPU devices where no accelerator is present (default 8)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    commands = {"train": cmd_train}
    for name in ("schedule", "bench", "reproduce"):
        try:
            module = _subcommand(name)
        except ModuleNotFoundError as e:
            if e.name != f"cdpjax.commands.{name}":
                raise
            continue
        module.add_parser(sub)
        commands[name] = _runner(module)
    args = parser.parse_args(argv)
    try:
        return int(commands[args.command](args, overrides) or 0)
    except ConfigError as e:
        print(f"cdpjax: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("cdpjax: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - a training failure: one line, not a traceback
        from cdpjax.train import NonFiniteError

        if isinstance(e, NonFiniteError):
            print(f"cdpjax: error: {e}", file=sys.stderr)
            return 3
        raise


if __name__ == "__main__":
    sys.exit(main())
