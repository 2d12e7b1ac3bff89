"""GPU readiness without a GPU: every registered method's programs lower for CUDA.

How (`cdpjax.lowering`): `jax.export.export(jitted, platforms=['cuda'])` applied to
abstract arguments, `jax.ShapeDtypeStruct(shape, dtype, sharding=...)` with the
shardings the method's state and batch have on a mesh of the 8 simulated CPU
devices. A CUDA export accepts shardings over CPU devices (it records the device
count and each argument's sharding, not the devices), so the module it checks is
the one a mesh of as many GPUs would run. Lowering only: nothing is compiled.

The methods come from the registry (`cdpjax.methods.REGISTRY`), each on its own
default mesh (`cdpjax.layouts.mesh_for`), so a method added later is checked with
no new test. A toy method registered inside the test shows that a CPU-only path
is caught, and the CPU-only convolution lowering of `cdpjax.xla_cpu` is shown
not to leak into the CUDA module.
"""
import jax
import numpy as np
import pytest
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec as P

from cdpjax import layouts, lowering, methods, models
from cdpjax import setup as setup_lib
from cdpjax.config import default_config
from cdpjax.layouts import LAYOUTS, Layout
from cdpjax.mesh import make_mesh
from cdpjax.methods.common import Method

METHODS = sorted(methods.REGISTRY)


def small_config(name, model="mlp"):
    """Digits, 4 stages, 32 images a step, the method's own mesh (none given)."""
    c = default_config()
    c.method, c.model, c.stages, c.global_batch_size = name, model, 4, 32
    if model == "resnet_tiny":
        c.norm = "batch"
    return c


def devices_for(config):
    n = layouts.devices_needed(config)
    return jax.devices()[:n] if n else None


def cheap_key():
    """A key whose initialisers compile several times faster on CPU than threefry's (the programs
    are the same: `lowering.programs` falls back to the trainer's key where the state holds keys)."""
    return jax.random.key(0, impl="rbg")


@pytest.mark.parametrize("name", METHODS)
def test_every_method_lowers_for_cuda(name):
    """The trainer's step (with its finite checks) and, for pipelines, the flush lower for CUDA."""
    config = small_config(name)
    assert lowering.cuda_problems(config, devices_for(config), cheap_key()) == []


# Options that take other code paths of a method (the data-parallel BatchNorm's cross-device
# statistics, bfloat16 compute, the CDP simulation, carried residuals, the trainer's skip select).
VARIANTS = [("dp", {"norm": "batch"}), ("cdp-v2", {"cdp_impl": "simulate"}), ("cdp-mp", {"residuals": "carry"}),
            ("cdp-v2", {"dtype": "bfloat16"}), ("ppll", {"dtype": "bfloat16", "nonfinite": "skip"})]


@pytest.mark.parametrize("name, options", VARIANTS, ids=lambda v: v if isinstance(v, str) else
                         ",".join(f"{k}={x}" for k, x in v.items()))
def test_method_options_lower_for_cuda(name, options):
    if name not in methods.REGISTRY:
        pytest.skip(f"method {name!r} is not registered")
    config = small_config(name)
    for key, value in options.items():
        config[key] = value
    assert lowering.cuda_problems(config, devices_for(config), cheap_key()) == []


# Weight gradient of an NHWC / HWIO convolution as JAX's transpose rule writes it: the input
# convolved with the output cotangent over the batch, so the input's batch dimension is the
# contracted feature `f` of the lhs and its channels its batch `b`; the cotangent is the kernel,
# its batch the input features `i`, its channels the outputs `o`; the result is the kernel's
# HWIO, i.e. spatial, then the lhs's `b` (the input channels), then `f`.
WEIGHT_GRADIENT = "[f, 0, 1, b]x[i, 0, 1, o]->[0, 1, b, f]"
CANONICAL = "[b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f]"  # NHWC x HWIO -> NHWC: what XLA:CPU is fast at


def test_cpu_convolution_lowering_does_not_leak_into_cuda():
    """`cdpjax.xla_cpu` (installed by every method build) rewrites every CPU convolution into
    NHWC / HWIO; the CUDA module of the same step keeps JAX's own layouts. A pipeline on a
    ResNet, whose convolutions sit inside `lax.switch` branches of a scan."""
    config = small_config("gpipe", "resnet_tiny")
    config.model_kwargs = {"depths": (1, 1), "widths": (4, 4)}  # stem, two residual blocks, head
    config.mesh = {"stage": 4}  # one pipeline: BatchNorm across pipeline replicas is refused
    step = lowering.programs(config, devices_for(config), cheap_key())["train_step"]
    on_cuda = lowering.convolution_layouts(lowering.export(step, "cuda"))
    on_cpu = lowering.convolution_layouts(lowering.export(step, "cpu"))
    assert on_cpu and set(on_cpu) == {CANONICAL}  # the CPU rule is in force in this process
    assert len(on_cuda) == len(on_cpu)
    assert WEIGHT_GRADIENT in on_cuda


# Three ways a step can be CPU-only. `cpu_only_double` is a primitive with a lowering for CPU
# and none for any other platform (as a CPU-only custom kernel would be).
cpu_only_double = Primitive("cpu_only_double")
cpu_only_double.def_impl(lambda x: x * 2)
cpu_only_double.def_abstract_eval(lambda x: x)
mlir.register_lowering(cpu_only_double, mlir.lower_fun(lambda x: x * 2, multiple_results=False), platform="cpu")

CPU_ONLY = {  # kind: (op, what the report says, whether the step runs here)
    "cpu-only lowering": (cpu_only_double.bind, "not found for platform cuda", True),
    "platform_dependent without a cuda branch": (
        lambda x: lax.platform_dependent(x, cpu=lambda y: y * 2), "not found for platform cuda", True),
    "host callback": (
        lambda x: jax.pure_callback(lambda a: np.asarray(a) * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x),
        "calls back to the host (pure_callback)", True),
    "custom call of no known target": (
        lambda x: jax.ffi.ffi_call("my_cpu_kernel", jax.ShapeDtypeStruct(x.shape, x.dtype))(x),
        "custom calls whose targets have no compatibility guarantees", False),
}


def toy_builder(op):
    """A one-device-per-worker toy method whose step feeds its images through `op`."""

    def build(ctx):
        net = ctx.net()
        replicated = NamedSharding(ctx.mesh, P())

        def init(rng):
            params, model_state = net.init(rng)
            return jax.device_put({"params": params, "model_state": model_state}, replicated)

        @jax.jit
        def train_step(state, batch):
            logits, _ = net.apply(state["params"], state["model_state"], op(batch["image"]), True)
            return state, {"loss": models.cross_entropy(logits, batch["label"])}

        return Method("cpu-only-toy", net, init, train_step, lambda s: (s["params"], s["model_state"]))

    return build


@pytest.mark.parametrize("kind", sorted(CPU_ONLY))
def test_a_cpu_only_method_is_reported(kind):
    """A method whose step runs on CPU but has a CPU-only path is reported, naming it."""
    op, words, runs_here = CPU_ONLY[kind]
    layout = Layout("cpu-only-toy", toy_builder(op), axes=("data",), device_axis="data")
    with LAYOUTS.temporarily("cpu-only-toy", layout):
        config = small_config("cpu-only-toy")
        if runs_here:  # the path is CPU-only, not broken
            dataset, mesh, method = setup_lib.setup(config)
            batch = setup_lib.put_batch(dataset.train_batch(0, 32, 0, False), mesh)
            _, metrics = method.train_step(method.init(cheap_key()), batch)
            assert np.isfinite(float(metrics["loss"]))
        problems = lowering.cuda_problems(config, rng=cheap_key())
    assert len(problems) == 1
    assert "'cpu-only-toy': train_step does not lower for CUDA" in problems[0] and words in problems[0]


def test_a_state_holding_keys_keeps_the_trainers_key_implementation():
    """Where the state holds a PRNG key, the exported programs take the trainer's key, not the
    cheaper one the tests offer (the keys' implementation is part of the programs)."""

    def build(ctx):
        method = toy_builder(lambda x: x)(ctx)

        def init(rng):  # zeros of the parameters' shapes (no initialiser to compile) and the key
            params, model_state = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype),
                                               jax.eval_shape(method.net.init, jax.random.key(0)))
            state = {"params": params, "model_state": model_state, "rng": rng}
            return jax.device_put(state, NamedSharding(ctx.mesh, P()))

        return Method("keyed-toy", method.net, init, method.train_step, method.export)

    layout = Layout("keyed-toy", build, axes=("data",), device_axis="data")
    with LAYOUTS.temporarily("keyed-toy", layout):
        config = small_config("keyed-toy")
        state, _ = lowering.programs(config, rng=cheap_key())["train_step"][1]
    assert state["rng"].dtype == jax.random.key(0).dtype != cheap_key().dtype


def test_exported_step_has_the_trainers_shardings():
    """What is exported is what the trainer runs, read back from the exported module: dp on 8
    devices replicates its state and splits the batch over `data` (dp's docstring)."""
    config = small_config("dp")
    exported = lowering.export(lowering.programs(config)["train_step"], "cuda")
    assert exported.nr_devices == 8 and exported.platforms == ("cuda",)
    image, label = exported.in_avals[-2:]
    assert image.shape == (32, 8, 8, 1) and label.shape == (32,)
    shardings = exported.in_shardings_jax(make_mesh({"data": 8}))
    assert [s.spec for s in shardings[-2:]] == [P("data"), P("data")]
    assert all(s.spec == P() for s in shardings[:-2])


def test_bench_and_the_lowering_set_a_method_up_without_the_trainer():
    """`cdpjax bench`'s set-up and the lowering's programs come from `cdpjax.setup`: in a fresh
    process, neither imports the trainer's loop, its run directory or its logging."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from cdpjax import bench, lowering\n"
            "from cdpjax.config import default_config\n"
            "c = default_config()\n"
            "c.method, c.model, c.stages, c.global_batch_size = 'gpipe', 'mlp', 2, 32\n"
            "bench.setup_all([c])\n"
            "assert 'train_step' in lowering.programs(c)\n"
            "print(sorted(m for m in sys.modules if m in ('cdpjax.train', 'cdpjax.loop', 'cdpjax.rundir', "
            "'cdpjax.runlog')))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
