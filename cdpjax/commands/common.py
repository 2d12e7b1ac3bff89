"""What the commands share: the parser of a command that reads a config (`config_parser`), and
the files they write (figures, JSON) checked and created before any work (`check_output`,
`created_output`)."""
from __future__ import annotations

import argparse
import contextlib
import os
import stat
import textwrap

from cdpjax.errors import ConfigError, storage_problem

FIGURE_SUFFIXES = (".png", ".svg")


def check_output(path: str, flag: str, suffixes: tuple[str, ...] | None = None) -> str:
    """`path` as a file this process can write: its folder exists (no folder is created
    elsewhere on the way), it is not a directory, it is writable, and it ends in one of
    `suffixes` when given. ConfigError naming the flag and what is wrong."""
    if suffixes and os.path.splitext(path)[1].lower() not in suffixes:
        raise ConfigError(f"{flag} {path!r} must end in {' or '.join(suffixes)}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"{flag} {path}: the folder {folder} does not exist: create it first, or write elsewhere")
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a directory: give a file name")
    if os.path.exists(path) and not stat.S_ISREG(os.stat(path).st_mode):
        raise ConfigError(f"{flag} {path} exists and is not a regular file (a FIFO, a device): give a file name")
    target = path if os.path.exists(path) else folder
    if not os.access(target, os.W_OK):
        raise ConfigError(f"{flag} {path}: {'the file' if target == path else 'its folder'} is not writable")
    return path


@contextlib.contextmanager
def created_output(path: str | None, flag: str, suffixes: tuple[str, ...] | None = None):
    """`check_output`, then the file created (empty where there was none) before the work the
    `with` block does, so that a path the system refuses although it looks writable (/proc/x.png,
    a full disk) ends the command before the work, not after it; if the block fails, a file it
    created and left empty is removed. Nothing for `path` None."""
    if path is None:
        yield None
        return
    check_output(path, flag, suffixes)
    existed = os.path.lexists(path)
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), 0o644))
    except OSError as e:
        raise ConfigError(f"{flag} {path} cannot be created: {storage_problem(e) or e.strerror or e}") from None
    try:
        yield path
    except BaseException:
        with contextlib.suppress(OSError):
            if not existed and os.path.getsize(path) == 0:
                os.unlink(path)
        raise


def config_parser(subparsers, name: str, help: str, description: str, epilog: str, usage: str):
    """The sub-command `name`, taking `--config FILE[:ARG]` (then --config.KEY=VALUE overrides, which
    the command line sets apart), its help saying so."""
    p = subparsers.add_parser(name, help=help, description=textwrap.fill(description, 96), epilog=epilog,
                              formatter_class=argparse.RawDescriptionHelpFormatter, usage=usage)
    p.add_argument("--config", help="Python config file[:ARG] (default: the digits default); then "
                                    "--config.KEY=VALUE overrides any key")
    return p


def add_cache_flags(p) -> None:
    """--compilation-cache DIR and --no-compilation-cache (`cdpjax.compilation`)."""
    p.add_argument("--compilation-cache", metavar="DIR", default=None,
                   help="keep compiled programs in DIR (default: $CDPJAX_COMPILATION_CACHE, else "
                        "~/.cache/cdpjax/xla; a directory JAX already has, JAX_COMPILATION_CACHE_DIR, is kept)")
    p.add_argument("--no-compilation-cache", action="store_true", help="compile every program afresh")


def enable_cache(args):
    """The persistent compilation cache as the command's flags say; returns the choice."""
    from cdpjax import compilation

    return compilation.enable(getattr(args, "compilation_cache", None), getattr(args, "no_compilation_cache", False))


def config_on_devices(args, overrides, devices: int):
    """What `plan` and `bench` set up before they build anything: the config their flags name (the
    file completed with the defaults, then the overrides), `devices` simulated CPU devices, and
    the compilation cache as their flags say; returns (the config, the cache's choice)."""
    from cdpjax.cli import _load
    from cdpjax.mesh import setup_devices

    config = _load(args, overrides)
    setup_devices(devices)
    return config, enable_cache(args)


__all__ = ["FIGURE_SUFFIXES", "add_cache_flags", "check_output", "config_on_devices", "config_parser",
           "created_output", "enable_cache"]
