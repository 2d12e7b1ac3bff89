"""`cdpjax`: the command line (train, schedule, bench, plot, describe, plan).

JAX's backends start only after `--cpu-devices` is applied, so that the simulated
device count takes effect. Bad input exits with status 2 and a one-line message,
without a traceback; so does a file that cannot be written (disk full, quota, read-only).
Ctrl-C and SIGTERM end any command at any moment with one line and status 130 or 143
(`cdpjax.shutdown`, installed first); a non-finite training step exits 3; in a
multi-process run, a process that vanished is named in one line, status 4, by each of
the others (`cdpjax.supervisor`).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

from cdpjax import shutdown
from cdpjax.errors import ConfigError, storage_problem

# Simulated CPU devices beyond this are refused (each is a thread pool and a client of XLA's).
MAX_CPU_DEVICES = 1024


def _split_config_overrides(argv):
    """(overrides as KEY=VALUE, the other arguments). `--config.KEY VALUE` is `--config.KEY=VALUE`
    (as ml_collections' config_flags take it) when VALUE is there and is not itself a flag."""
    overrides, rest = [], []
    args = iter(enumerate(argv))
    for i, a in args:
        if not a.startswith("--config."):
            rest.append(a)
        elif "=" in a or i + 1 == len(argv) or argv[i + 1].startswith("--"):
            overrides.append(a[len("--config."):])  # no "=" and no value: apply_overrides says so
        else:
            overrides.append(f"{a[len('--config.'):]}={argv[i + 1]}")
            next(args)
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


def _cpu_devices(args, config) -> tuple[int, str]:
    """Simulated CPU devices: --cpu-devices, else as many as the config's mesh names, else 8.
    Returns (count, why), which the trainer says on CPU."""
    from cdpjax import layouts
    from cdpjax.mesh import setup_devices

    count, why = args.cpu_devices, f"--cpu-devices {args.cpu_devices}"
    if count is None:
        mesh = layouts.mesh_for(config)
        count = layouts.devices_needed(config)
        why = f"what the mesh {mesh} needs"
        if count is None:
            count, why = 8, f"the default; the mesh {mesh} takes every device"
    check_cpu_devices(count, why)
    setup_devices(count)
    return count, why


def check_cpu_devices(count: int, why: str) -> None:
    if not 1 <= count <= MAX_CPU_DEVICES:
        raise ConfigError(f"{count} simulated CPU devices ({why}): cdpjax simulates 1 to {MAX_CPU_DEVICES}; "
                          f"give a smaller mesh or --cpu-devices")


def check_process_count(settings: dict | None) -> None:
    """The process count of a multi-process run, from any source (the config's own is range-checked
    with the other keys; the environment's and a cluster's are not), at most `config.PROCESS_LIMIT`.
    `distributed.settings` names the count for every source, JAX's cluster detection included."""
    from cdpjax import config as cfg_lib
    from cdpjax import distributed

    if settings is None:
        return
    count = settings["num_processes"]
    if count > cfg_lib.PROCESS_LIMIT:
        where = {"environment": distributed.ENV_NUM_PROCESSES, "slurm": "SLURM_NTASKS",
                 "ompi": "OMPI_COMM_WORLD_SIZE"}.get(settings["source"], "distributed.num_processes")
        raise ConfigError(f"{where}={count}: a run has at most {cfg_lib.PROCESS_LIMIT} processes")


def cmd_train(args, overrides) -> int:
    from cdpjax import supervisor

    if supervisor.supervised():
        supervisor.die_with_supervisor()
    config = _load(args, overrides)
    from cdpjax import config as cfg_lib
    from cdpjax import distributed

    cfg_lib.validate(config)
    settings = distributed.settings(config)
    check_process_count(settings)
    if settings is not None and not supervisor.supervised():
        # A multi-process run: this process watches the one that trains (cdpjax.supervisor).
        if not args.workdir:
            raise ConfigError("a multi-process run needs --workdir (the same shared directory for every process)")
        return supervisor.run(args.argv, settings, args.workdir, int(config.distributed.timeout_s))
    from cdpjax import checks

    checks.validate(config)  # every key and name, before devices are set up
    device_note = _cpu_devices(args, config)
    # Before anything asks JAX for devices: a multi-process run must start jax.distributed first.
    joined = distributed.initialize(config)
    if joined:
        distributed.check_same_config(config, int(config.distributed.timeout_s))
    from cdpjax import rundir, runlog, train
    from cdpjax.commands.common import enable_cache

    enable_cache(args)
    if joined and not args.workdir:
        raise ConfigError("a multi-process run needs --workdir (the same shared directory for every process)")
    if args.resume and not args.workdir:
        raise ConfigError("--resume needs --workdir (the directory of the run to resume)")
    workdir = args.workdir or rundir.default_workdir(config)
    import jax

    summary = train.train(config, workdir, progress=not args.no_progress, require_checkpoint=args.resume,
                          force=args.force, device_note=device_note)
    with shutdown.critical():  # a signal from now on finds the run completed: exit status 0
        shutdown.completed()
        if jax.process_index() == 0 and not summary.get("already_finished"):
            shutdown.write_line(f"{runlog.result_words(summary)} after {summary['steps']} steps, "
                                f"{runlog.throughput_words(summary)} on {summary['devices']} device(s); "
                                f"summary in {workdir}/summary.json")
    return 0


TRAIN_EPILOG = """\
Config: --config FILE is a Python file whose get_config() returns an ml_collections
ConfigDict, or the name of a config shipped with cdpjax (a file of cdpjax/configs/:
digits, charlm, ppll_resnet32, ...; a wrong name lists them); --config FILE:ARG calls
get_config(ARG) (e.g. --config digits:method=ppll). Any key is then overridden with
--config.KEY=VALUE (or --config.KEY VALUE), VALUE a Python literal, nested keys dotted:
--config.method=dp --config.num_steps=300 --config.mesh.data=4 --config.stages=[2,5,9]
--config.profile_steps=[10,12]. The keys and their defaults: cdpjax/config.py (default_config).

WORKDIR gets metrics.jsonl, TensorBoard events (tensorboard --logdir WORKDIR), checkpoints/,
config.json, summary.json and, while the run lives, lock.json (one run per work directory).
"""


def _subcommand(name):
    import importlib

    return importlib.import_module(f"cdpjax.commands.{name}")


def _runner(module):
    import inspect

    takes_overrides = len(inspect.signature(module.run).parameters) > 1
    return lambda args, overrides: module.run(args, overrides) if takes_overrides else module.run(args)


def main(argv=None) -> int:
    uninstall = shutdown.install()  # first: a signal at any later moment ends in one line
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except BrokenPipeError:
        # The reader of stdout left (`cdpjax schedule ... | head`): it has what it wanted. Nothing more to
        # say, and stdout goes to the null device so that the interpreter's last flush cannot fail either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE  # as a command the pipe's signal ended
    finally:
        uninstall()


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are one line, as every other refusal is (argparse
    prints the usage above the error); `--help` still prints the whole usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {_one_line(message)} (`{self.prog} --help` lists the arguments)\n")


def _version() -> str:
    """The installed distribution's version (pyproject.toml's, as pip installed it)."""
    from importlib import metadata

    try:
        return metadata.version("cdpjax")
    except metadata.PackageNotFoundError:  # imported from a checkout that pip never installed
        return "(not installed: run from a source tree)"


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split("\n"))


def _main(argv: list[str]) -> int:
    """Parses and runs a command, every failure that is the input's or the machine's one line.
    (Over 60 lines: the parser's flags and the exit statuses belong together, in one place.)"""
    original = list(argv)
    overrides, argv = _split_config_overrides(argv)
    parser = OneLineParser(prog="cdpjax", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"cdpjax {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train a config (default: CDP-v2 on digits)", epilog=TRAIN_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       usage="cdpjax train [--config FILE[:ARG]] [--config.KEY=VALUE ...] [--workdir DIR] "
                             "[--cpu-devices N] [--resume] [--force] [--no-progress] "
                             "[--compilation-cache DIR | --no-compilation-cache]")
    p.add_argument("--config", metavar="FILE[:ARG]",
                   help="Python file whose get_config() returns a ConfigDict (FILE:ARG calls get_config(ARG)); "
                        "then --config.KEY=VALUE overrides any key")
    p.add_argument("--workdir", metavar="DIR",
                   help="where checkpoints, metrics.jsonl, TensorBoard events and summary.json go "
                        "(resumes if it has a checkpoint; default: a new workdirs/... directory)")
    p.add_argument("--cpu-devices", type=int, default=None, metavar="N",
                   help="simulated CPU devices where no accelerator is present (default: what the config's "
                        "mesh names when all its axis sizes are given, else 8)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--resume", action="store_true",
                   help="fail unless --workdir holds a checkpoint to resume from (without it, a workdir with "
                        "a checkpoint resumes and one without starts afresh)")
    p.add_argument("--force", action="store_true",
                   help="take WORKDIR over even while another live run holds its lock (that run stops at its "
                        "next step); a lock whose run is gone is taken over without it")
    from cdpjax.commands.common import add_cache_flags

    add_cache_flags(p)
    commands = {"train": cmd_train}
    for name in ("schedule", "bench", "plot", "describe", "plan", "reproduce"):
        try:
            module = _subcommand(name)
        except ModuleNotFoundError as e:
            if e.name != f"cdpjax.commands.{name}":
                raise
            continue
        module.add_parser(sub)
        commands[name] = _runner(module)
    args = parser.parse_args(argv)
    args.argv = original
    try:
        return int(commands[args.command](args, overrides) or 0)
    except ConfigError as e:
        shutdown.write_line(f"error: {_one_line(e)}")
        shutdown.quiet_from_now()
        return 2
    except KeyboardInterrupt as e:
        from cdpjax.loop import Interrupted
        from cdpjax.workdir import Terminated

        if isinstance(e, Interrupted):  # during training: where the run stands, on its own line
            shutdown.write_line(str(e))
            return e.exit_status
        shutdown.write_line("interrupted before training began; run the same command to start it")
        return 143 if isinstance(e, Terminated) else 130
    except Exception as e:  # noqa: BLE001 - a training failure: one line, not a traceback
        from cdpjax.errors import NonFiniteError

        if isinstance(e, NonFiniteError):
            shutdown.write_line(f"error: {_one_line(e)}")
            shutdown.quiet_from_now()
            return 3
        reason = storage_problem(e)
        if reason is not None:  # a write the command made itself (a figure, a JSON file)
            shutdown.write_line(f"error: cannot write {getattr(e, 'filename', None) or 'a file'}: {reason}")
            shutdown.quiet_from_now()
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
