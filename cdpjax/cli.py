"""`cdpjax`: the command line (train, schedule, bench).

JAX is imported only after `--cpu-devices` is applied, so that the simulated
device count takes effect. Bad input exits with status 2 and a one-line message,
without a traceback.
"""
from __future__ import annotations

import argparse
import sys

from cdpjax.errors import ConfigError


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
        # The file's config, completed with the defaults it leaves out; a key the defaults do
        # not know (a misspelling) stays, for `validate` to name.
        file_config = cfg_lib.load_file(args.config)
        for key in c.keys():
            if key not in file_config:
                file_config[key] = c[key]
        c = file_config
    cfg_lib.apply_overrides(c, overrides)
    return c


def _cpu_devices(args, config=None):
    """Simulated CPU devices: --cpu-devices, else as many as the config's mesh names, else 8."""
    from cdpjax.mesh import setup_devices

    from cdpjax import layouts

    count = args.cpu_devices
    if count is None:
        count = (layouts.devices_needed(config) if config is not None else None) or 8
    setup_devices(count)


def cmd_train(args, overrides) -> int:
    config = _load(args, overrides)
    _cpu_devices(args, config)
    from cdpjax import distributed

    # Before anything asks JAX for devices: a multi-process run must start jax.distributed first.
    joined = distributed.initialize(config)
    from cdpjax import train

    if joined and not args.workdir:
        raise ConfigError("a multi-process run needs --workdir (the same shared directory for every process)")
    workdir = args.workdir or train.default_workdir(config)
    if args.resume and not args.workdir:
        raise ConfigError("--resume needs --workdir (the directory of the run to resume)")
    import jax

    if jax.process_index() == 0:
        print(f"cdpjax: training {config.method} / {config.model} / {config.dataset} in {workdir}"
              + (f" ({jax.process_count()} processes)" if jax.process_count() > 1 else ""), file=sys.stderr)
    summary = train.train(config, workdir, progress=not args.no_progress, require_checkpoint=args.resume)
    if jax.process_index() == 0:
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
    p.add_argument("--cpu-devices", type=int, default=None,
                   help="simulated CPU devices where no accelerator is present (default: what the config's "
                        "mesh names when all its axis sizes are given, else 8)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--resume", action="store_true",
                   help="fail unless --workdir holds a checkpoint to resume from (without it, a workdir with "
                        "a checkpoint resumes and one without starts afresh)")
    commands = {"train": cmd_train}
    for name in ("schedule", "bench", "reproduce", "describe"):
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
        from cdpjax.errors import NonFiniteError

        if isinstance(e, NonFiniteError):
            print(f"cdpjax: error: {e}", file=sys.stderr)
            return 3
        raise


if __name__ == "__main__":
    sys.exit(main())
