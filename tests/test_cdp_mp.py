"""cdp-mp, the cyclic pipeline: its table puts exactly one op on every device at every tick;
after S steps and a flush its parameters equal CDP `simulate` with N = L workers and the same
staleness (a ResNet with stages of different shapes, a ViT, both residual options, both rules);
one call scans over any number of steps with one program; no gradient crosses a device."""
import functools

import jax
import numpy as np
import pytest

from cdpjax import bench, methods, plotting
from cdpjax.commands import schedule
from cdpjax.config import ConfigError, validate
from cdpjax.mesh import make_mesh
from cdpjax.methods import cdp
from cdpjax.methods.common import Context
from cdpjax.layouts.cdp_mp import cdp_mp_table
from cdpjax.timetable import table
from helpers import (assert_trees_close, capture_figures, cdp_rule, digits_batches, max_diff, params, png_matches,
                     run, schedule_boxes, small_config, update_marks)

STEPS, BATCH = 3, 16
# Four blocks each, one per stage: a ResNet whose stages differ in shape (stem; a block at
# 8 channels, 8x8; a block to 16 channels, 4x4; head) and a ViT; small, so that compiling is cheap.
MODEL_KWARGS = {"mlp": {"width": 16}, "resnet_tiny": {"depths": (1, 1)}, "vit_tiny": {"depth": 2}}


# ---------------------------------------------------------------------- the table


@pytest.mark.parametrize("ticks", ["whole", "split"])
@pytest.mark.parametrize("rule", ["cdp-v2", "cdp-v1"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4, 6])
def test_one_op_per_device_per_tick(rule, stages, ticks):
    """N = L workers' ops on their stage's device: every device busy at every steady-state tick with
    exactly one op; with whole backwards a forward when tick - stage is even, a backward when odd;
    with split ones F, B, W as tick - stage is 0, 1, 2 modulo 3 (worker i's ops of stage j at phases
    j, 3L-2-2j, 3L-1-2j from tick 3i); every op, version, slot and update as CDP's timing written
    out (`helpers.cdp_rule`, with device = stage), and no gradient sent."""
    t = cdp_mp_table(stages, steps=4, rule=rule, ticks=ticks)
    T = 2 * stages if ticks == "whole" else 3 * stages
    assert t.devices == t.workers == stages and t.messages == ()
    assert t.busy_fraction()["overall"] == 1.0 and t.busy_fraction()["per_device"] == [1.0] * stages
    lo, hi = t.steady
    cells = {}
    for op in t.ops:
        assert op.device == op.stage
        assert (op.tick, op.device) not in cells
        cells[(op.tick, op.device)] = op
        if lo <= op.tick < hi:
            kinds = "FB" if ticks == "whole" else "FBW"
            assert op.kind == kinds[(op.tick - op.stage) % len(kinds)]
    assert hi - lo == T and all((tick, j) in cells for tick in range(lo, hi) for j in range(stages))
    ops, updates, stale = cdp_rule(rule, stages, stages, 4, ticks)
    assert {(o.tick, o.micro, o.stage, o.kind, o.step, o.version, o.slot, o.stale) for o in t.ops} == ops
    assert {(u.tick, u.stage, u.step) for u in t.updates} == updates
    np.testing.assert_array_equal(t.stale, stale)
    assert table("cdp-mp", stages=stages, steps=4, rule=rule, ticks=ticks) == t  # the registry's name


def test_device_memory_model():
    """Device j holds a stage input from its forward to its backward: 2(L-j)-1 ticks per worker,
    so device 0 holds the most (L micro-batches at once) and the last device one."""
    act = cdp_mp_table(4, steps=4).activation_per_worker()[8:16]
    assert act.max(0).tolist() == [4, 3, 2, 1]
    assert act.sum(1).tolist() == [8] * 8  # N*L/2 stage-activations in all, flat over the period


def test_schedule_draws_it(tmp_path, capsys, monkeypatch):
    """`cdpjax schedule --method cdp-mp`: the grid's counts, and a diagram whose cells are the
    ops of CDP's timing with device = stage (one box per op at (tick, stage), labelled with the
    worker, hatched where the op reads the previous version), one update mark per update."""
    assert schedule.main(["--method", "cdp-mp", "--stages", "4"]) == 0
    text = capsys.readouterr().out
    assert "busy fraction (steady state): 1.000" in text and "stale (worker, stage) pairs: 6 of 16" in text
    figures = capture_figures(monkeypatch, plotting)
    out = tmp_path / "cdp_mp.png"
    assert schedule.main(["--method", "cdp-mp", "--stages", "4", "--out", str(out)]) == 0
    ((path, fig),) = figures
    ops, updates, _ = cdp_rule("cdp-v2", 4, 4, 3)  # the table's default: 3 steps
    boxes = schedule_boxes(fig)
    assert sorted((tick, stage, label, hatched) for tick, stage, label, hatched in boxes) == sorted(
        (tick, stage, f"{kind}w{worker}", stale) for tick, worker, stage, kind, _, _, _, stale in ops)
    assert sorted(update_marks(fig)) == sorted((tick + 1, stage) for tick, stage, _ in updates)
    assert path == str(out) and png_matches(out, fig)
    assert schedule.main(["--method", "cdp-mp", "--stages", "4", "--rule", "cdp-v1"]) == 0
    assert "stale (worker, stage) pairs: 16 of 16" in capsys.readouterr().out


# ------------------------------------------------------------------ the method


def config(**kw):
    return small_config(kw.pop("method", "e2e"), kw.pop("model", "mlp"),
                        **{"stages": 4, "global_batch_size": BATCH, "schedule": "constant", **kw})


def batches():
    return digits_batches(STEPS + 2, BATCH)


def context(mesh, devices, **kw):
    return Context(config(**kw), make_mesh(mesh, jax.devices()[:devices]), (8, 8, 1), 10)


@functools.lru_cache(maxsize=None)
def build_mp(model="mlp", residuals="recompute", rule="cdp-v2", norm="none", data_axis=1, ticks="whole"):
    mesh = {"stage": 4, "data": data_axis} if data_axis > 1 else {"stage": 4}
    return methods.build(context(mesh, 4 * data_axis, method="cdp-mp", model=model, model_kwargs=MODEL_KWARGS[model],
                                 residuals=residuals, cdp_rule=rule, norm=norm, cdp_ticks=ticks))


@functools.lru_cache(maxsize=None)
def simulated(model="mlp", rule="cdp-v2", norm="none", steps=STEPS, ticks="whole"):
    """CDP simulate with N = 4 workers on one device: parameters and model state after `steps`."""
    ctx = context({"data": 1}, 1, method=rule, cdp_impl="simulate", workers=4, model=model,
                  model_kwargs=MODEL_KWARGS[model], norm=norm, cdp_ticks=ticks)
    m = cdp.make(ctx, rule)
    state = run(m, batches()[:steps])
    return jax.device_get(m.export(state)), params(m, m.init(jax.random.key(0)))


def train(m, steps=STEPS, state=None, start=0):
    return run(m, batches()[start:start + steps], state)


CASES = [
    ("resnet_tiny", "recompute", "cdp-v2", "group", "whole"),  # stages of different shapes
    ("mlp", "carry", "cdp-v1", "none", "whole"),
    pytest.param("vit_tiny", "carry", "cdp-v2", "none", "whole", marks=pytest.mark.heavy),
    pytest.param("resnet_tiny", "carry", "cdp-v2", "group", "split", marks=pytest.mark.heavy),  # F, B, W
    ("mlp", "carry", "cdp-v1", "none", "split"),
    # paired forwards: each tick in two halves (a pair's second forward reads the first's output from
    # the device before); a forward beside the previous step's backward in one cell
    ("mlp", "carry", "cdp-v2", "none", "paired"),
    ("mlp", "recompute", "cdp-v1", "none", "paired"),
    pytest.param("mlp", "recompute", "cdp-v1", "none", "whole", marks=pytest.mark.heavy),
    pytest.param("resnet_tiny", "carry", "cdp-v2", "group", "whole", marks=pytest.mark.heavy),
    pytest.param("vit_tiny", "recompute", "cdp-v2", "none", "whole", marks=pytest.mark.heavy),
    pytest.param("vit_tiny", "recompute", "cdp-v2", "none", "split", marks=pytest.mark.heavy),
]


@pytest.mark.parametrize("model,residuals,rule,norm,ticks", CASES)
def test_equals_simulate(model, residuals, rule, norm, ticks):
    """FIRST: after S steps and a flush, cdp-mp's parameters are simulate's with the same
    staleness on one device, to float tolerance."""
    m = build_mp(model, residuals, rule, norm, ticks=ticks)
    if model == "resnet_tiny":
        carrier = m.carrier  # inputs 8x8x1, 8x8x8, 8x8x8, 4x4x16; no two parameter sizes alike
        assert len(set(carrier.params.sizes)) == 4 and len(set(carrier.acts.shapes)) == 3
    assert m.workers == 4 and m.devices == 4 and m.dp_mp_devices == 16
    (reference, _), initial = simulated(model, rule, norm, ticks=ticks)
    assert max_diff(reference, initial) > 1e-3  # it trained
    assert_trees_close(jax.device_get(m.export(train(m))[0]), reference)


def test_tick_convolutions_use_the_fast_cpu_layout():
    """Inside the tick (a switch branch in a scan in `shard_map`) every convolution, the
    gradients' included, is in the layout of XLA:CPU's fast kernels (`carrier.use_canonical_cpu_
    convolutions`); the naive fallback made a ResNet step several times slower."""
    m = build_mp("resnet_tiny", "recompute", "cdp-v2", "group")
    images = np.zeros((1, BATCH, 8, 8, 1), np.float32)
    lowered = m.periods.lower(m.init(jax.random.key(0)), images, np.zeros((1, BATCH), np.int32),
                                  np.ones((1,), bool))
    hlo = lowered.compile().as_text()
    labels = {line.split("dim_labels=")[1].split(",")[0] for line in hlo.splitlines() if " convolution(" in line}
    assert labels == {"b01f_01io->b01f"}, labels


def test_forward_writes_its_residuals_into_the_row_once():
    """With residuals='carry' each F branch writes its kept residuals into the tick's row in one
    update, and the row goes back into the slot buffer once per tick: in the lowered program, one
    [1, width] update per unit (4) and one [slots, width] update. One update per residual leaf
    (84 updates here: about twenty leaves a stage) made XLA:CPU copy the whole row per leaf, and
    ResNet-18's full-width cdp-mp step 13x dp's, which the quarter-width memory bound above
    did not see."""
    import re

    m = build_mp("resnet_tiny", "carry", "cdp-v2", "group")
    state = m.init(jax.random.key(0))
    _, slots, _, width = state.buffers.residuals.shape
    text = m.periods.lower(state, np.zeros((1, BATCH, 8, 8, 1), np.float32), np.zeros((1, BATCH), np.int32),
                           np.ones((1,), bool)).as_text()
    updates = re.findall(r"stablehlo.dynamic_update_slice.*?-> tensor<([^>]*)>", text)
    assert updates.count(f"1x{width}xf32") == m.devices == 4, updates
    assert updates.count(f"{slots}x{width}xf32") == 1, updates


def test_staleness_is_the_rules():
    """The equality above is not blind to the rule: cdp-v1's run is not cdp-v2's simulate."""
    (v2, _), _ = simulated("mlp", "cdp-v2")
    m = build_mp("mlp", "carry", "cdp-v1")
    assert max_diff(jax.device_get(m.export(train(m))[0]), v2) > 1e-4


def test_batchnorm_parameters_equal_simulate():
    """norm='batch': statistics per micro-batch and running averages averaged over the step's
    micro-batches, as in simulate: parameters and running averages agree."""
    m = build_mp("mlp", "carry", "cdp-v2", "batch")
    (reference, reference_state), _ = simulated("mlp", "cdp-v2", "batch")
    got, model_state = jax.device_get(m.export(train(m)))
    assert_trees_close(got, reference)
    assert_trees_close(model_state, reference_state)
    initial_state = jax.device_get(m.export(m.init(jax.random.key(0)))[1])
    assert max_diff(model_state, initial_state) > 1e-3


def test_flush_then_train_on():
    """A flush completes the fed steps; training on restarts the cycle from the flushed
    parameters, which then stand in both slots (as at step 0)."""
    m = build_mp()
    state = train(m, steps=2)
    state = train(m, steps=2, state=state, start=2)
    ref = cdp.make(context({"data": 1}, 1, method="cdp-v2", cdp_impl="simulate", workers=4), "cdp-v2")
    s = ref.init(jax.random.key(0))
    for k, b in enumerate(batches()[:4]):
        if k == 2:
            s = s._replace(previous=s.params)
        s, _ = ref.train_step(s, b)
    assert_trees_close(jax.device_get(m.export(state)[0]), jax.device_get(ref.export(s)[0]))


def test_run_steps_is_one_program():
    """`run_steps` scans over steps: it equals the same steps one call each, and its compiled
    program is the same whatever the number of steps (compile time does not grow with it)."""
    m = build_mp()
    stacked = {k: np.stack([b[k] for b in batches()[:STEPS]]) for k in ("image", "label")}
    state, metrics = m.run_steps(m.init(jax.random.key(0)), stacked)
    assert metrics["loss"].shape == (STEPS,)
    assert_trees_close(jax.device_get(m.export(m.flush(state))[0]), jax.device_get(m.export(train(m))[0]), atol=1e-6)

    def program(steps):
        images, labels = (np.zeros((steps, *stacked[k].shape[1:]), stacked[k].dtype) for k in ("image", "label"))
        lowered = m.periods.lower(m.init(jax.random.key(0)), images, labels, np.ones((steps,), bool))
        text = lowered.compile().as_text()
        return [line for line in text.splitlines() if "=" in line and "constant(" not in line]

    two, eight = program(2), program(8)
    assert len(two) == len(eight)


@pytest.mark.parametrize("residuals,rule", [("recompute", "cdp-v2"), ("carry", "cdp-v1")])
def test_no_gradient_communication(residuals, rule):
    """The compiled step (traced inside an outer jit, as the trainer does) sends activations and
    cotangents one hop, each boundary at its own size (one collective-permute per boundary and
    direction: 3 boundaries of 4 stages, 2 directions), and all-reduces only the three metric scalars."""
    m = build_mp("mlp", residuals, rule)
    state = m.init(jax.random.key(0))
    coll = bench.collectives(jax.jit(m.train_step).lower(state, batches()[0]).compile().as_text())
    # Every boundary of the MLP carries a 16-wide hidden layer for a micro-batch of BATCH / 4 examples,
    # float32; the carrier's padded buffer would be the 8x8x1 image's 64 floats wide.
    boundary = BATCH // 4 * 16 * 4
    assert coll["collective-permute"]["count"] == 2 * 3
    assert coll["collective-permute"]["max_bytes"] == boundary
    assert coll["all-reduce"]["bytes"] <= 16
    assert coll["all-gather"]["count"] == coll["reduce-scatter"]["count"] == 0


def test_data_axis_runs_a_pipeline_per_group():
    """On stage x data = 4 x 2 each data group runs its own cyclic pipeline on its half of the
    batch and the stage gradients are summed over data at the update: the same parameters as
    one pipeline fed a batch whose micro-batch i is the two groups' micro-batches i."""
    m2 = build_mp(data_axis=2)
    assert m2.devices == 8
    m1 = build_mp()
    half, micro = BATCH // 2, BATCH // 8
    order = np.array([d * half + i * micro + r for i in range(4) for d in range(2) for r in range(micro)])
    s1, s2 = m1.init(jax.random.key(0)), m2.init(jax.random.key(0))
    for b in batches()[:STEPS]:
        s1, _ = m1.train_step(s1, {k: v[order] for k, v in b.items()})
        s2, _ = m2.train_step(s2, b)
    assert_trees_close(jax.device_get(m2.export(m2.flush(s2))[0]), jax.device_get(m1.export(m1.flush(s1))[0]))


@pytest.mark.parametrize("overrides,mesh,message", [
    ({"cdp_rule": "cdp-v3"}, {"stage": 4}, "cdp_rule='cdp-v3' is not one of cdp-v2, cdp-v1"),
    ({"workers": 2}, {"stage": 4}, "cdp-mp runs N = L workers"),
    ({"stages": 2}, {"stage": 4}, "cdp-mp's table runs on 2 stage devices but mesh.stage=4 (mesh {'stage': 4})"),
    ({"global_batch_size": 18}, {"stage": 4}, "global_batch_size / mesh.data=18 is not divisible"),
    ({}, {"data": 4}, "needs a 'stage' mesh axis"),
])
def test_bad_config_refused_before_compiling(overrides, mesh, message):
    c = config(method="cdp-mp", mesh=mesh, **overrides)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(c)
        methods.build(Context(c, make_mesh(mesh, jax.devices()[:4]), (8, 8, 1), 10))


@pytest.mark.heavy  # a wall-clock ratio: run on a quiet machine (`pytest -m heavy`), not in CI
def test_step_time_against_one_device():
    """The framework-overhead figure for cdp-mp: a step on 4 simulated devices against the
    same step (N = 4 workers, the same staleness) simulated on one device. Measured 1.06x at most
    (vit_tiny, global batch 256, idle machine); CI holds it on a cheaper case with room for shared,
    loaded cores: vit_tiny of 2 blocks at global batch 64, at most 1.5x, the ratio of the medians
    of 15 steps of each, timed interleaved after two warm-up steps."""
    import statistics
    import time

    batch = digits_batches(1, 64)[0]
    kw = dict(model="vit_tiny", model_kwargs=MODEL_KWARGS["vit_tiny"], global_batch_size=64)
    mp = methods.build(context({"stage": 4}, 4, method="cdp-mp", **kw))
    sim = cdp.make(context({"data": 1}, 1, method="cdp-v2", cdp_impl="simulate", workers=4, **kw), "cdp-v2")
    steps = {"mp": jax.jit(mp.train_step), "sim": sim.train_step}
    states = {"mp": mp.init(jax.random.key(0)), "sim": sim.init(jax.random.key(0))}
    times = {k: [] for k in steps}
    for r in range(17):
        for k, step in steps.items():
            t0 = time.perf_counter()
            states[k] = jax.block_until_ready(step(states[k], batch)[0])
            if r >= 2:  # compile and warm up first
                times[k].append(time.perf_counter() - t0)
    ratio = statistics.median(times["mp"]) / statistics.median(times["sim"])
    print(f"cdp-mp / simulate on one device: {ratio:.2f}")
    assert ratio <= 1.5, times


@pytest.mark.parametrize("name,bound", [("cdp-mp", 1.8), ("1f1b", 2.9)])
def test_carried_residuals_are_not_copied_per_tick(name, bound):
    """A regression bound, from XLA's buffer assignment: the stage-axis engine once read a tick's
    residual row out of its buffer, had every branch return a zero row of the buffer's width, and
    wrote the row back through a select, so XLA kept row-sized copies alive across the switch
    (ResNet-18 of CIFAR shape, quarter width, cut [5], 2 devices, residuals='carry': XLA's
    temporaries 2.28x what the program declares for cdp-mp, 3.39x for 1F1B). Now the op's row
    goes through the switch as an operand (F writes it, the others give it back) and is put back
    where it was read: 1.51x and 2.57x (against the buffers declared then; 1.70x and 2.79x on
    2026-12-04 against the program's gradient sums and in-flight buffers, which since include its
    step temporaries: received messages, the micro-batch split). Writing into the whole buffer
    inside the F branch instead copies the buffer per F op (gpipe's step 1.5x slower). Compiled only."""
    import pathlib

    from cdpjax.config import load_file

    path = pathlib.Path(__file__).resolve().parents[1] / "cdpjax" / "configs" / "bench_resnet18.py"
    c = load_file(f"{path}:stages=[5]")
    c.method, c.residuals, c.mesh = name, "carry", {"stage": 2, "data": 1}
    c.model_kwargs = {"stem": "cifar", "width": 0.25}
    run = bench._prepare(c, jax.devices()[:2])
    method = run["method"]
    micro = bench.micro_batch(method, c, run["mesh"])
    model = bench.memory_model(method, c, method.table, bench.stage_sizes(method.net, micro), 2,
                               bench.program_sizes(method, micro, run["task"]))["temporaries"]
    declared = model["gradients_in_flight"] + model["activations"]  # the program's buffers (no op's workspace)
    temp = bench.memory(run["compiled"])["temp_bytes"]
    assert temp <= bound * declared, (temp / 2**20, declared / 2**20)


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_paired_forwards_in_two_half_ticks(stages):
    """Paired ticks on the stage axis: a worker's forward of stage 2a+1 runs one half-tick after its
    forward of stage 2a (on the next device, which needs its output), every other op of the CDP paired
    table keeps its order in the first halves (tick 2t), each update lands at the end of its tick's
    second half (2t + 1); a device runs at most a forward and a backward of different workers in one
    half, and some device runs both (an overlapped cell)."""
    t = cdp_mp_table(stages, steps=4, ticks="paired")
    base = table("cdp-v2", workers=stages, stages=stages, steps=4, ticks="paired")
    second = lambda o: o.kind == "F" and o.stage % 2 == 1  # noqa: E731 - the pair (2a, 2a+1)'s second
    want = {(2 * o.tick + second(o), o.stage, o.kind, o.device, o.step, o.version) for o in base.ops}
    assert {(o.tick, o.device, o.kind, o.micro, o.step, o.version) for o in t.ops} == want
    assert {(u.tick, u.stage, u.step) for u in t.updates} == {(2 * u.tick + 1, u.stage, u.step) for u in base.updates}
    cells = {}
    for o in t.ops:
        cells.setdefault((o.tick, o.device), []).append(o)
    assert all(len(c) == 1 or (sorted(o.kind for o in c) == ["B", "F"] and len({o.micro for o in c}) == 2)
               for c in cells.values())
    assert any(len(c) == 2 for c in cells.values())
