"""The errors cdpjax raises on purpose. A leaf module: it imports nothing of cdpjax, so every
module (the config among them) can import it without an import cycle.

- `ConfigError`: bad input (a config value, a command-line flag, a work directory, a
  checkpoint that does not fit). The command line prints its one-line message and exits 2.
- `NonFiniteError`: a NaN or Inf in training (exit status 3).
"""
from __future__ import annotations


class ConfigError(ValueError):
    """A bad configuration value; the message names the value and what is accepted."""


class NonFiniteError(RuntimeError):
    """A NaN or Inf in a loss or gradient; training stopped, the last good checkpoint kept."""


__all__ = ["ConfigError", "NonFiniteError"]
