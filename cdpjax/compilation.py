"""Compiles cached across runs and announced while they happen.

The persistent compilation cache (JAX's: XLA executables keyed on the program, the devices
and the compiler options) is on for `cdpjax train` and `bench`, in the first of

1. `--no-compilation-cache`: off;
2. a directory JAX already has (`JAX_COMPILATION_CACHE_DIR`, or set by a program that
   embeds cdpjax, such as the test suite's per-process cache): kept as it is;
3. `--compilation-cache DIR`, else `CDPJAX_COMPILATION_CACHE` (a directory, or `off`);
4. `$XDG_CACHE_HOME/cdpjax/xla`, i.e. `~/.cache/cdpjax/xla` by default.

Where cdpjax chose the directory, every program is cached whatever its compile time
(JAX's default skips those under a second: a digits run's are). A second identical run
reads its programs from there instead of compiling them (docs/measured.md has the figure).

`CompileWatch` counts, while a first step runs, the seconds XLA spent compiling and the
programs the cache answered (JAX's monitoring events), so that the trainer and bench say
"compiling METHOD ..." and then how long it took and what came from the cache.
"""
from __future__ import annotations

import os
import time
from typing import Mapping, NamedTuple

from cdpjax.errors import ConfigError

ENV_CACHE = "CDPJAX_COMPILATION_CACHE"
OFF = "off"


class CacheChoice(NamedTuple):
    """Where compiled programs are kept (None: not kept) and what chose it."""

    directory: str | None
    source: str  # 'flag', 'JAX', 'environment', 'default' or 'off'

    def words(self) -> str:
        if self.directory is None:
            return "compilation cache off"
        return f"compilation cache {self.directory}"


def default_directory(environ: Mapping[str, str]) -> str:
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cdpjax", "xla")


def choose(flag_dir: str | None, disabled: bool, jax_dir: str | None,
           environ: Mapping[str, str] | None = None) -> CacheChoice:
    """The cache directory by the rule of the module docstring (pure: nothing is changed)."""
    environ = os.environ if environ is None else environ
    if disabled:
        return CacheChoice(None, "off")
    if jax_dir:
        return CacheChoice(str(jax_dir), "JAX")
    if flag_dir:
        return CacheChoice(os.path.abspath(os.path.expanduser(flag_dir)), "flag")
    env = environ.get(ENV_CACHE, "")
    if env.strip().lower() == OFF:
        return CacheChoice(None, "off")
    if env:
        return CacheChoice(os.path.abspath(os.path.expanduser(env)), "environment")
    return CacheChoice(default_directory(environ), "default")


def enable(flag_dir: str | None = None, disabled: bool = False) -> CacheChoice:
    """Turns the persistent compilation cache on (or off) for this process as `choose` says.
    A directory that cannot be created or written is refused in one line naming it."""
    import jax

    choice = choose(flag_dir, disabled, jax.config.jax_compilation_cache_dir)
    if choice.directory is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return choice
    if choice.source != "JAX":
        try:
            os.makedirs(choice.directory, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"compilation cache {choice.directory!r} cannot be created ({e.strerror}): give "
                              f"--compilation-cache DIR, or --no-compilation-cache") from None
        if not os.access(choice.directory, os.W_OK | os.X_OK):
            raise ConfigError(f"compilation cache {choice.directory!r} is not writable: give --compilation-cache "
                              f"DIR, or --no-compilation-cache")
        jax.config.update("jax_compilation_cache_dir", choice.directory)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_enable_compilation_cache", True)
    return choice


class CompileWatch:
    """While open, the XLA compile seconds and the programs read from the persistent cache (JAX's
    monitoring events); `words()` says them after the watched work ('3.1 s, 2 programs compiled,
    1 from the compilation cache')."""

    def __init__(self):
        self.compile_seconds, self.compiled, self.cache_hits, self.wall = 0.0, 0, 0, 0.0

    def _duration(self, event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.compile_seconds += duration
            self.compiled += 1

    def _event(self, event: str, **kwargs) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            self.cache_hits += 1

    def __enter__(self):
        import jax

        jax.monitoring.register_event_duration_secs_listener(self._duration)
        jax.monitoring.register_event_listener(self._event)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        import jax

        self.wall = time.perf_counter() - self._t0
        jax.monitoring.unregister_event_duration_listener(self._duration)
        jax.monitoring.unregister_event_listener(self._event)
        return False

    def words(self) -> str:
        """What the watched work took: its wall time and where its programs came from. A program
        the cache answered is counted by JAX as compiled too (its lookup is inside the compile)."""
        fresh = self.compiled - self.cache_hits
        parts = [f"{fresh} program{'s' if fresh != 1 else ''} compiled"]
        if self.cache_hits:
            parts.append(f"{self.cache_hits} read from the compilation cache")
        return f"{self.wall:.1f} s ({', '.join(parts)})"


__all__ = ["CacheChoice", "CompileWatch", "ENV_CACHE", "choose", "default_directory", "enable"]
