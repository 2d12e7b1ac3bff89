"""Every test runs on 8 simulated CPU devices, set before JAX initialises, with XLA:CPU's LLVM
backend unoptimised: the tests compile far more than they compute (a few steps of small
models), and LLVM's optimisation of the kernels cost more than it saved (`tests/test_gpipe.py`
and `tests/test_heads.py`: 137 s -> 99 s, 2026-12-02). The flag is XLA_FLAGS', so the runs the
tests start in subprocesses compile the same way; it changes how fast a kernel runs, not the
HLO (buffers, collectives, costs) the tests read."""
import os

os.environ.setdefault("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_threefry_partitionable", True)

import shutil  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402

# One persistent compilation cache per test process: the tests build the same small programs
# over and over from fresh closures (each `train` call, each reference run), which jit's
# in-memory cache cannot see are equal; XLA's cache keys on the program. Per process (no two
# writers share it) and never exported to the subprocesses the tests start.
_XLA_CACHE = tempfile.mkdtemp(prefix="cdpjax-tests-xla-")
jax.config.update("jax_compilation_cache_dir", _XLA_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
# The commands the tests start in subprocesses would otherwise share the user's cache
# (`cdpjax.compilation`: ~/.cache/cdpjax/xla); a test that wants one gives --compilation-cache.
os.environ["CDPJAX_COMPILATION_CACHE"] = "off"


@pytest.fixture(scope="session", autouse=True)
def _remove_compilation_cache():
    yield
    shutil.rmtree(_XLA_CACHE, ignore_errors=True)


# The files that take longest (measured: `pytest --durations=0`, 2026-12-03), run first: xdist's
# `--dist loadfile` hands a worker the next file when it is free, in collection order, so a long
# file collected last (alphabetically, test_reliability.py) left the other worker idle for minutes.
SLOW_FILES = ("test_reliability.py", "test_readme_figures.py", "test_faults.py", "test_cdp_zero.py",
              "test_language_model.py", "test_cdp_mp.py", "test_references.py", "test_gpipe.py", "test_cdp.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES)))  # stable: order within a file kept


@pytest.fixture
def no_compilation_cache():
    """For a test that times compilation: every program compiles for real."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    jax.config.update("jax_enable_compilation_cache", False)
    cc.reset_cache()
    yield
    jax.config.update("jax_enable_compilation_cache", True)
    cc.reset_cache()


@pytest.fixture
def digits_config():
    """A small, fast config on digits (override per test)."""
    from cdpjax.config import default_config

    c = default_config()
    c.num_steps = 20
    c.eval_every = 0
    c.checkpoint_every = 0
    c.global_batch_size = 64
    c.log_every = 10
    return c


@pytest.fixture
def compiles():
    """(event, function) of every program traced or compiled while the test runs (tracing shows
    even where the module's compilation cache then spares the compile)."""
    names = []

    def listener(event, duration, **kwargs):
        if event in ("/jax/core/compile/backend_compile_duration", "/jax/core/compile/jaxpr_trace_duration"):
            names.append((event.split("/")[-1].split("_")[0], kwargs.get("fun_name", "?")))

    jax.monitoring.register_event_duration_secs_listener(listener)
    yield names
    jax.monitoring.unregister_event_duration_listener(listener)
