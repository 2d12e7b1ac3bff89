"""Python's cycle collector paused while a table or a program is built.

Building CDP's table at N = L = 128 and lowering it to the ring's program makes hundreds of
thousands of small records (ops, messages, events, tuples; some 250,000 alive at once) that
hold no reference cycles; each allocation threshold the build crosses starts a collection, and
every full one walks all of them and frees nothing: 13 full collections, about a third of the
build's time (2026-12-04). Reference counting still frees everything as usual while the
collector is paused.
"""
from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def gc_paused():
    """The collector off for the block (also as a decorator), on again after it if it was on
    before (nested blocks leave it to the outermost)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()
