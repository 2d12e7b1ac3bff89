"""Every registered method equals the method its registration names (`Layout.reference`).

Claims: each registered layout declares its reference (the pipelines e2e, ppll local, dp e2e,
CDP's ring its own rule simulated on fewer devices, cdp-mp its rule simulated, cdp-zero its rule
on the ring), and after the same steps on the same batches (and a flush where the method has
one) it holds the reference's parameters. The cases come from the registry, so a new layout is
tested here with no test edited; one that declares no reference is refused. e2e and local are
the two references: they are checked against rules written out in their own tests (e2e's
gradient is `jax.grad` of the loss in test_gpipe.py and test_foundation.py; local's heads in
test_local_ppll.py), not against each other.

Every case runs at one size: the MLP in L = 4 stages, M = 4 micro-batches where the method takes
them, 2 stages per device where its table takes `chunks`, N = 4 CDP workers (cdp-mp's N = L = 4),
a batch of 16 and 2 steps; the family tests (test_gpipe.py, test_cdp.py, ...) vary the rest.
"""
import jax
import pytest

from cdpjax.config import ConfigError
from cdpjax.layouts import LAYOUTS, Layout
from helpers import assert_trees_close, build, max_diff, random_batches, run, small_config

BATCH, STEPS, STAGES, WORKERS = 16, 2, 4, 4
ROOTS = ("e2e", "local")  # the references themselves, written out here (see the docstring)


def case_config(name: str):
    """The config every case of `name` runs: the sizes of the module docstring, each set only
    where the method takes it (its table's sizes)."""
    layout = LAYOUTS.lookup(name)
    sizes = layout.table_sizes()
    c = small_config(name, "mlp", stages=STAGES, global_batch_size=BATCH, microbatches=4)
    if "chunks" in sizes:
        c.chunks = 2
    if "workers" in sizes:
        c.workers = WORKERS
    return c


def case_mesh(config) -> dict:
    """The mesh of `config` in these cases: one device for a one-device method, the devices its
    table places the stages on for a stage-axis method, a device per worker on the data axis."""
    layout = LAYOUTS.lookup(config.method)
    if layout.device_axis is None:
        return {"data": 1}
    if layout.device_axis == "stage":
        return {"stage": layout.default_mesh(config)["stage"]}
    return {layout.device_axis: WORKERS}


def reference_config(name: str):
    """The config of `name`'s reference, or ConfigError where its registration declares none."""
    layout = LAYOUTS.lookup(name)
    if layout.reference is None:
        raise ConfigError(f"method {name!r} declares no reference (Layout.reference): register it with the method "
                          f"its gradients and updates equal, e.g. reference=Reference('e2e') for a pipeline")
    return layout.reference.config_of(case_config(name))


def test_every_registered_method_declares_a_registered_reference():
    """Each method but the two roots names a reference, which is registered and is not itself."""
    for name in LAYOUTS:
        if name in ROOTS:
            assert LAYOUTS.lookup(name).reference is None, name
            continue
        ref = reference_config(name)
        assert ref.method in LAYOUTS and (ref.method, ref.get("cdp_impl")) != (name, case_config(name).cdp_impl), name


def test_a_method_without_a_reference_is_refused():
    toy = Layout("toy-unreferenced", "cdpjax.methods.gpipe:build", axes=("stage", "data"), device_axis="stage",
                 table=LAYOUTS.lookup("gpipe").table, microbatches=True)
    with LAYOUTS.temporarily(toy.name, toy):
        assert toy.name in LAYOUTS and toy.name not in ROOTS
        with pytest.raises(ConfigError, match="'toy-unreferenced' declares no reference"):
            reference_config(toy.name)


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n not in ROOTS])
def test_equals_its_reference(name):
    """After STEPS steps (and the flushes), the method's parameters are its reference's."""
    config, ref_config = case_config(name), reference_config(name)
    method, reference = build(config, case_mesh(config)), build(ref_config, case_mesh(ref_config))
    batches = random_batches(STEPS, BATCH)
    expected = reference.export(run(reference, batches))[0]
    assert_trees_close(method.export(run(method, batches))[0], expected)
    assert max_diff(expected, reference.export(reference.init(jax.random.key(0)))[0]) > 1e-3  # it trained
