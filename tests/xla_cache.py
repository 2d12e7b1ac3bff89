"""A test module's own persistent XLA compilation cache: `from xla_cache import compilation_cache`
makes every program of the module compile once (its runs differ in their state, not in their
programs). In a temporary directory, for that module only."""
import jax
import pytest


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
    from jax.experimental.compilation_cache import compilation_cache as cc

    keys = {"jax_compilation_cache_dir": str(tmp_path_factory.mktemp("xla-cache")),
            "jax_persistent_cache_min_compile_time_secs": 0.0,
            "jax_persistent_cache_min_entry_size_bytes": 0}
    old = {k: getattr(jax.config, k) for k in keys}
    cc.reset_cache()
    for k, v in keys.items():
        jax.config.update(k, v)
    yield
    for k, v in old.items():
        jax.config.update(k, v)
    cc.reset_cache()
