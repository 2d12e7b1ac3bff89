"""The lowered program's typed events, read by every reader: each lowering's events are the table's
ops of one period, every message sent is received, nothing steps forward in time (lag >= 0); the
buffers a program declares between steps are the engine's real train state, category by category;
and the readers name no method and no op kind."""
import ast
import collections
import pathlib
import typing

import jax
import numpy as np
import pytest

from cdpjax import bench, cost, timetable
from cdpjax.kinds import KINDS
from cdpjax.layouts import LAYOUTS
from cdpjax.program import Apply, Compute, Gather, Receive, Send, Size, events, lower
from cdpjax.program.stage_axis import lower_stage_axis, period_window, program_ticks
from helpers import build, small_config

ROOT = pathlib.Path(__file__).resolve().parents[1]

TABLES = [("gpipe", dict(stages=4, microbatches=4)), ("1f1b", dict(stages=4, microbatches=8)),
          ("interleaved-1f1b", dict(stages=8, microbatches=8, chunks=2)), ("zb-h1", dict(stages=4, microbatches=8)),
          ("zbv", dict(stages=8, microbatches=8)), ("cdp-mp", dict(stages=4, steps=5)), ("ppll", dict(stages=4)),
          ("cdp-v2", dict(workers=4, stages=4)), ("cdp-v1", dict(workers=2, stages=4)),
          ("cdp-v2", dict(workers=8, stages=4)), ("cdp-zero", dict(workers=4, stages=4)),
          ("looped-bfs", dict(stages=8, microbatches=4, chunks=2)),
          ("cdp-v2", dict(workers=4, stages=4, ticks="split")),
          ("cdp-v2", dict(workers=3, stages=4, ticks="paired")), ("cdp-zero", dict(workers=2, stages=4, ticks="split"))]


def _program(name, kw):
    """The table and its program, lowered for the engine the layout runs on (cdp-mp's table is CDP's,
    placed on the stage axis)."""
    t = timetable.table(name, **kw)
    return t, (lower_stage_axis(t) if LAYOUTS[name].device_axis == "stage" else lower(t))


@pytest.mark.parametrize("name,kw", TABLES, ids=[f"{n}-{'-'.join(map(str, kw.values()))}" for n, kw in TABLES])
def test_every_lowering_emits_the_tables_ops_as_typed_events(name, kw):
    """One period's `Compute` events are the table's ops of one period (a steady one, counted by
    (device, kind, stage) straight from the table); every `Send` has its `Receive` (same tick, same
    message) and no other; every event is one of the five types, its lag >= 0 and its tick inside
    the period; `Program.sends` is the program's `Send` events."""
    t, program = _program(name, kw)
    # the table's steady period: the middle step's ticks (each op there belongs to some step's period)
    m = period_window(t)[0] if program.engine == "stage" else t.steps // 2
    lo, hi = m * t.period, (m + 1) * t.period
    want = collections.Counter((o.device, o.kind, o.stage) for o in t.ops if lo <= o.tick < hi)
    got = collections.Counter((e.device, e.kind, e.stage) for e in program.events if isinstance(e, Compute))
    assert got == want
    assert all(type(e) in (Compute, Send, Receive, Apply, Gather) for e in program.events)
    assert all(e.lag >= 0 and 0 <= e.tick < program.period for e in program.events)
    sends = [e for e in program.events if isinstance(e, Send)]
    receives = [e for e in program.events if isinstance(e, Receive)]
    fields = lambda e: (e.tick, e.what, e.size, e.src, e.dst, e.stage, e.lag)  # noqa: E731
    assert collections.Counter(map(fields, sends)) == collections.Counter(map(fields, receives))
    assert program.sends == tuple(sends)
    assert program.summary()["events"]["Send"] == len(sends) == program.summary()["sends_per_call"]
    # every update of a stage is applied once a period per device holding it (whole or in pieces)
    applies = collections.Counter(e.stage for e in program.events if isinstance(e, Apply))
    holders = program.devices if program.engine == "ring" else 1
    assert applies == {j: holders for j in range(t.stages)}


def test_gpipe_events_by_hand():
    """GPipe, L = 2 stages on 2 devices, M = 2 micro-batches: device 0 runs F0 of micro-batches 0, 1
    in ticks 0, 1 and sends each stage-1 input at its tick's end; device 1 runs F1, F1, B1, B1 in ticks
    1-4 and sends each cotangent back at the end of ticks 3, 4; device 0 runs B0, B0 in ticks 4, 5; every
    stage applies its update at the end of the step (tick 5: GPipe flushes)."""
    t = timetable.table("gpipe", stages=2, microbatches=2)
    program = lower(t)
    act, cot = Size.stage("input", 1), Size.stage("input", 1)
    assert program.period == 6
    assert [e for e in program.events if isinstance(e, Compute)] == [
        Compute(0, 0, "F", 0, 0), Compute(1, 0, "F", 0, 1), Compute(1, 1, "F", 1, 0), Compute(2, 1, "F", 1, 1),
        Compute(3, 1, "B", 1, 0), Compute(4, 0, "B", 0, 0), Compute(4, 1, "B", 1, 1), Compute(5, 0, "B", 0, 1)]
    assert program.sends == (Send(0, "activation", act, 0, 1, 1), Send(1, "activation", act, 0, 1, 1),
                             Send(3, "cotangent", cot, 1, 0, 1), Send(4, "cotangent", cot, 1, 0, 1))
    assert [e for e in program.events if isinstance(e, Apply)] == [Apply(5, 0, 0), Apply(5, 1, 1)]


def test_events_refuse_what_cannot_be():
    """An event's fields fail early, naming the bad value: an unregistered kind, a negative lag, a
    message that does not say what it carries or goes nowhere."""
    with pytest.raises(ValueError, match=r"Compute.kind='X' is not a registered op kind"):
        Compute(0, 0, "X", 0)
    with pytest.raises(ValueError, match=r"Compute.lag=-1 is negative"):
        Compute(0, 0, "F", 0, lag=-1)
    with pytest.raises(ValueError, match=r"Send.what='grads' is not one of activation, cotangent"):
        Send(0, "grads", Size.stage("param", 0), 0, 1, 0)
    with pytest.raises(ValueError, match=r"Receive from device 1 to itself"):
        Receive(0, "sum", Size.stage("param", 0), 1, 1, 0)


def test_program_has_no_any():
    """The program's types are its own: no `Any` in cdpjax/program/ (annotations or imports)."""
    for path in (ROOT / "cdpjax" / "program").glob("*.py"):
        tree = ast.parse(path.read_text())
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
            n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert "Any" not in names, path
    assert typing.get_args(events.Event) == (Compute, Send, Receive, Apply, Gather)


# --------------------------------------------------------- declared buffers = the engine's state

# What each entry of an engine's train state holds (the program's categories), written out from the
# engines' `init`s: the stage engine's carrier rows and slot buffers, the ring's natural per-stage
# buffers, cdp-zero's pieces and relay rows.
CATEGORY_OF = {
    "rows": "parameters", "params": "parameters", "master": "parameters", "previous": "previous_parameters",
    "opt": "optimizer_state", "opt_state": "optimizer_state", "model_state": "model_state",
    "state_sums": "model_state", "head_state": "model_state", "grads": "gradients", "sums": "gradients",
    "relay": "relayed_parameters", "fed": "flags", "labels": "labels", "acts": "activations",
    "cots": "cotangents", "residuals": "residuals",
    ("buffers", "acts"): "activations", ("buffers", "cots"): "cotangents", ("buffers", "residuals"): "residuals",
    ("buffers", "input"): "images", ("buffers", "image"): "images",
}


def _state_bytes(state) -> dict[str, float]:
    """Bytes per category that device 0 holds of the real train state (its shard of each array)."""
    out: dict[str, float] = collections.defaultdict(float)
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        keys = [p.key if isinstance(p, jax.tree_util.DictKey) else p.name for p in path
                if isinstance(p, (jax.tree_util.DictKey, jax.tree_util.GetAttrKey))]  # typed states' fields too
        holds = CATEGORY_OF.get(tuple(keys[:2]), CATEGORY_OF.get(keys[0]))
        if keys == ["master"] and path[2].idx == 1:  # cdp-zero's master[j] = [current, previous] pieces
            holds = "previous_parameters"
        assert holds is not None, f"a train-state entry no category names: {keys}"
        out[holds] += leaf.addressable_shards[0].data.nbytes
    return dict(out)


ENGINES = {  # one method of each engine, small, with every optional buffer it has
    "stage (cdp-mp)": (dict(method="cdp-mp", stages=4, global_batch_size=32, norm="batch"), {"stage": 4}),
    "stage (ppll)": (dict(method="ppll", stages=4, global_batch_size=32, norm="batch"), {"stage": 4}),
    "ring (cdp-v2)": (dict(method="cdp-v2", cdp_impl="ring", workers=4, stages=4, global_batch_size=32,
                           residuals="carry"), {"data": 4}),
    "zero (cdp-zero)": (dict(method="cdp-zero", workers=4, stages=4, global_batch_size=32), {"data": 4}),
}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_declared_buffers_are_the_engines_train_state(engine):
    """The bytes per category a program declares between steps (`Program.arguments`, priced with the
    method's per-stage sizes) are the bytes of the engine's real train state on one device, derived
    from its arrays (each leaf's shard on device 0, by what `CATEGORY_OF` says it holds). The optimizer
    state is declared in parameter units: sgd with momentum keeps one trace as large as them. Within 8
    bytes per unit the program holds: a step count optax keeps per state, a scalar among the last stage's
    residuals and cdp-zero's pieces rounded up to whole elements are not worth a `Size`."""
    overrides, mesh = ENGINES[engine]
    config = small_config(overrides.pop("method"), **overrides)
    method = build(config, mesh)
    program = method.program
    micro = config.global_batch_size // int(mesh.get("data", 1)) // program.microbatches
    declared = program.arguments(bench.program_sizes(method, micro))
    real = _state_bytes(method.init(jax.random.key(0)))
    # every entry of the state is declared, and every buffer declared with bytes is in the state
    assert set(real) <= set(declared) and {h for h, b in declared.items() if b} <= set(real), (engine, real, declared)
    slack = 8 * len(program.placement.units)
    for holds in declared:
        assert abs(real.get(holds, 0) - declared[holds]) <= slack, (engine, holds, real.get(holds), declared[holds])


# --------------------------------------------------------- readers: no method names, no kind letters

# Where a method's name appears outside cdpjax/layouts/ and the methods' own builders, and why: a name
# that is also a value of something else (CDP's staleness rules are named like the methods that use
# them; FB ops are shaded and costed as 'local'), or a follow-up.
NAMES_ELSEWHERE = {
    "cdpjax/config.py": {"cdp-v2", "cdp-v1"},  # the default method, and the values of cdp_rule
    "cdpjax/models/partition.py": {"cdp-v2", "dp"},  # the staleness rules whose tables it compares
    "cdpjax/kinds.py": {"local"},  # FB's shade and cost field
}
READERS = ["cdpjax/cost.py", "cdpjax/bench.py", "cdpjax/speedup.py", "cdpjax/plotting.py", "cdpjax/commands",
           "cdpjax/program/__init__.py", "cdpjax/program/events.py"]


def _strings(tree):
    """String constants that are values in the code (not docstrings, not f-string text)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            skip.add(id(node.value))
        if isinstance(node, ast.JoinedStr):
            skip.update(id(v) for v in node.values)
    return [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip]


def test_no_module_but_the_layouts_and_builders_names_a_method():
    own = {layout.builder.split(":")[0].replace(".", "/") + ".py" for layout in LAYOUTS.values()
           if isinstance(layout.builder, str)}
    found = {}
    for path in sorted((ROOT / "cdpjax").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(("cdpjax/layouts/", "cdpjax/configs/")) or rel in own:
            continue
        named = {n.value for n in _strings(ast.parse(path.read_text()))} & set(LAYOUTS)
        if named - NAMES_ELSEWHERE.get(rel, set()):
            found[rel] = sorted(named - NAMES_ELSEWHERE.get(rel, set()))
    assert not found


def test_no_module_dispatches_on_op_kind_letters():
    """No module but the kinds' registry and the layouts (which write tables, and so spell the kinds)
    compares an op kind's letters ('F', 'B', 'W', 'FB'): the engines, the lowerings and the readers
    read `OpKind`'s flags."""
    found = []
    for path in sorted((ROOT / "cdpjax").rglob("*.py")):
        if path.relative_to(ROOT).as_posix().startswith("cdpjax/layouts/") or path.name == "kinds.py":
            continue
        tree = ast.parse(path.read_text())
        compared = set()
        for node in ast.walk(tree):
            operands = []
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
            elif isinstance(node, ast.Dict):
                operands = [k for k in node.keys if k is not None]
            for op in operands:
                compared |= {id(n) for n in ast.walk(op)}
        found += [f"{path.relative_to(ROOT)}:{n.lineno} {n.value!r}" for n in _strings(tree)
                  if n.value in KINDS and id(n) in compared]
    assert not found


def test_readers_ask_no_engine_and_no_method():
    """The readers compare no program's or table's `engine` or `method` with a value: what they read
    does not depend on which engine or method made it."""
    found = []
    for entry in READERS:
        paths = sorted((ROOT / entry).rglob("*.py")) if (ROOT / entry).is_dir() else [ROOT / entry]
        for path in paths:
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Compare):
                    sides = [node.left, *node.comparators]
                    if any(isinstance(n, ast.Attribute) and n.attr in ("engine", "method") for n in sides) and \
                            any(isinstance(n, ast.Constant) for n in sides):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found


def test_cost_reads_the_events():
    """The cost model's per-device ops are the program's `Compute` (kind, stage) and `Apply` events."""
    _, program = _program("cdp-zero", dict(workers=2, stages=2))
    per = cost.program_ops(program)
    for d in range(program.devices):
        want = [(e.kind, e.stage) if isinstance(e, Compute) else ("update-piece", e.stage)
                for e in program.device_events(d) if isinstance(e, (Compute, Apply))]
        assert sorted(per[d]) == sorted(want)
    assert np.all([sum(k == "update-piece" for k, _ in ops) == 2 for ops in per])


@pytest.mark.parametrize("name,kw", [("gpipe", dict(stages=4, microbatches=4)), ("zbv", dict(stages=8, microbatches=8)),
                                     ("dualpipev", dict(stages=8, microbatches=8)),
                                     ("cdp-mp", dict(stages=4, steps=5, ticks="paired")),
                                     ("interleaved-1f1b", dict(stages=8, microbatches=8, chunks=2))])
def test_the_memory_models_lanes_are_the_lowerings_from_the_events_alone(name, kw):
    """bench's `lanes` counts a cell's ops from the `Compute` events only; the stage lowering counts
    them as it lays the cells out (`StageTicks.lanes`): DualPipeV's cells hold three, CDP's paired
    forwards two, the rest one."""
    from cdpjax import bench
    _, program = _program(name, kw)
    assert bench.lanes(program) == program_ticks(program).lanes
    assert bench.lanes(program) == {"dualpipev": 3, "cdp-mp": 2}.get(name, 1)
