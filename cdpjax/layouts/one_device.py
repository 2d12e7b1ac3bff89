"""e2e and local: the one-device references (no time table)."""
from __future__ import annotations

from cdpjax.layouts import Layout, register

register(Layout("e2e", "cdpjax.methods.e2e:build",
                summary="one device, plain backprop: the reference for accuracy and correctness"))
register(Layout("local", "cdpjax.methods.local:build",
                summary="sequential local learning: auxiliary heads, one optimizer per stage, one device"))
