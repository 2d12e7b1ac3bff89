"""The stage engine runs the program's events: the arrays its scan reads are compiled from the
events (`stage_axis.stage_ticks`) and equal, for every stage-axis layout of the registry, the
arrays the lowering built straight from the table before the events came first (that path is kept
here, as it was, as the second implementation); a program whose events are changed by hand trains
as the changed events say (backprop's values, derived here); an event the engine cannot run is
refused, naming it."""
import dataclasses
from collections import defaultdict

import jax
import numpy as np
import pytest

from cdpjax import kinds as op_kinds
from cdpjax.errors import ConfigError
from cdpjax.layouts import LAYOUTS
from cdpjax.methods import pipeline
from cdpjax.methods.common import loss_and_metrics
from cdpjax.program import Apply, Compute, Receive, Send
from cdpjax.program.stage_axis import kind_codes, lower_stage_axis, period_window, placement, program_ticks
from cdpjax.timetable import table
from helpers import assert_trees_close, build, context, max_diff, random_batches, small_config

# ----------------------------------------------- the arrays straight from the table (the path before)


def _direct_cells(tbl, ops, place, lo, hi):
    cells = defaultdict(list)
    for o in ops:
        if lo <= o.tick < hi:
            cells[(o.tick - lo, o.device)].append(o)
    return cells


def _direct_lifetimes(ops, unit_of, sends, last_backward, U, carry, periodic):
    lives = {name: defaultdict(list) for name in ("act", "input", "residual", "cot")}
    for o in ops:
        u = unit_of[o.stage]
        key = (u, o.micro, o.step)
        done = last_backward.get(key)
        kind = op_kinds.lookup(o.kind)
        if kind.forward:
            arrival = o.tick if u == 0 else sends["forward"][(u - 1, o.micro, o.step)] + 1
            if u > 0:
                lives["act"][o.device].append((arrival, o.tick if (carry or done is None) else done, key))
            elif done is not None and not carry and periodic:
                lives["input"][o.device].append((arrival, done, key))
            if carry and done is not None:
                lives["residual"][o.device].append((o.tick, done, key))
        elif kind.cotangent and u + 1 < U:
            lives["cot"][o.device].append((sends["cotangent"][(u + 1, o.micro, o.step)] + 1, done, key))
    return lives


def _direct_slots(lives, periodic):
    out, most = {}, 0
    for d, items in lives.items():
        if not periodic:
            ends = []
            for first, last, key in sorted(items):
                free = [s for s, end in enumerate(ends) if end < first]
                s = free[0] if free else len(ends)
                if s == len(ends):
                    ends.append(last)
                ends[s] = last
                out[(d, key)] = s
            most = max(most, len(ends))
            continue
        by_key = defaultdict(list)
        for first, last, (u, micro, step) in items:
            by_key[(u, micro)].append((step, first, last))
        H = 1
        for spans in by_key.values():
            spans.sort()
            for i, (_, first, last) in enumerate(spans):
                H = max(H, 1 + sum(1 for _, f2, _ in spans[i + 1:] if f2 <= last))
        keys = sorted({(u, micro, step % H) for (u, micro) in by_key for step, _, _ in by_key[(u, micro)]})
        index = {k: i for i, k in enumerate(keys)}
        for first, last, (u, micro, step) in items:
            out[(d, (u, micro, step))] = index[(u, micro, step % H)]
        most = max(most, len(keys))
    return out, most


def direct_arrays(tbl, residuals):
    """The per-tick arrays, slot counts and cells as the lowering built them from the table's ops."""
    carry = residuals == "carry"
    place = placement(tbl)
    unit_of = place.unit_of
    P, D, U = tbl.period, place.devices, len(place.units)
    m, lag = period_window(tbl)
    lo, hi = m * P, (m + 1) * P
    ops = [o for o in tbl.ops if o.stage == place.units[unit_of[o.stage]][0]]
    sends = {flag: {(unit_of[o.stage], o.micro, o.step): o.tick for o in ops if getattr(op_kinds.lookup(o.kind), flag)}
             for flag in ("forward", "cotangent")}
    last_backward = {}
    for o in ops:
        if op_kinds.lookup(o.kind).reads_cotangent:
            key = (unit_of[o.stage], o.micro, o.step)
            last_backward[key] = max(last_backward.get(key, -1), o.tick)
    lives = _direct_lifetimes(ops, unit_of, sends, last_backward, U, carry, lag > 0)
    slots = {name: _direct_slots(life, lag > 0) for name, life in lives.items()}
    slot_of = {name: s[0] for name, s in slots.items()}
    codes = kind_codes()
    cells = _direct_cells(tbl, ops, place, lo, hi)
    K = max((len(c) for c in cells.values()), default=1)
    arrays = {k: np.full((P, D, K), -1, np.int32) for k in ("act_slot", "input_slot", "residual_slot", "cot_slot")}
    arrays.update({k: np.zeros((P, D, K), np.int32) for k in ("kind", "unit", "micro", "lag", "version")})
    arrays["cell"] = np.zeros((P, D), np.int32)
    arrays.update({k: np.zeros((P, U - 1), np.int32) for k in ("send_act", "send_cot")})
    arrays.update({k: np.full((P, U - 1), -1, np.int32) for k in ("recv_act", "recv_cot")})
    index = {(): 0}
    for (t, d), cell in sorted(cells.items()):
        # a cell's lanes in the kinds' order, then by unit: the table's order in every layout but
        # cdp-mp's paired halves (which list a backward before the forward beside it)
        cell = sorted(cell, key=lambda o: (codes[o.kind], unit_of[o.stage]))
        lanes = tuple((o.kind, unit_of[o.stage]) for o in cell)
        arrays["cell"][t, d] = index.setdefault(lanes, len(index))
        for k, o in enumerate(cell):
            u = unit_of[o.stage]
            kind = op_kinds.lookup(o.kind)
            key = (d, (u, o.micro, o.step))
            for name, value in (("kind", codes[o.kind]), ("unit", u), ("micro", o.micro), ("lag", m - o.step),
                                ("version", int(o.slot == "previous"))):
                arrays[name][t, d, k] = value
            for name in ("act", "input", "residual"):
                arrays[f"{name}_slot"][t, d, k] = slot_of[name].get(key, -1)
            if kind.reads_cotangent:
                arrays["cot_slot"][t, d, k] = slot_of["cot"].get(key, -1)
            if kind.forward and u + 1 < U:
                arrays["send_act"][t, u] = 1
                arrays["recv_act"][t, u] = slot_of["act"][(place.device[u + 1], (u + 1, o.micro, o.step))]
            if kind.cotangent and u > 0:
                arrays["send_cot"][t, u - 1] = 1
                arrays["recv_cot"][t, u - 1] = slot_of["cot"][(place.device[u - 1], (u - 1, o.micro, o.step))]
    arrays["update"] = np.zeros((P, D, place.chunks), bool)
    arrays["update_lag"] = np.zeros((P, D, place.chunks), np.int32)
    for up in tbl.updates:
        if lo <= up.tick < hi and up.stage == place.units[unit_of[up.stage]][0]:
            u = unit_of[up.stage]
            arrays["update"][up.tick - lo, place.device[u], place.chunk[u]] = True
            arrays["update_lag"][up.tick - lo, place.device[u], place.chunk[u]] = m - up.step
    arrays["any_update"] = arrays["update"].any(axis=(1, 2)).astype(np.int32)
    buffer = {"act": "acts", "input": "input", "cot": "cots", "residual": "residuals"}  # the program's buffer names
    counts = {buffer[name]: max(s[1], 1) for name, s in slots.items()}
    return arrays, counts, tuple(sorted(index, key=index.get))


# ------------------------------------------------------------------ every stage-axis layout


STAGE_LAYOUTS = sorted(name for name, layout in LAYOUTS.items() if layout.device_axis == "stage")
# sizes beside each layout's defaults (its table's own defaults always run): several devices per
# stage, overlapped cells, one micro-batch, local modules grouped, CDP's rules on the stage axis
SIZES = {"gpipe": [dict(stages=3, microbatches=1)], "1f1b": [dict(stages=4, microbatches=8)],
         "interleaved-1f1b": [dict(stages=6, chunks=2, microbatches=6)], "zb-h1": [dict(stages=4, microbatches=8)],
         "zbv": [dict(stages=8, microbatches=8)], "dualpipev": [dict(stages=6, microbatches=6),
                                                                dict(stages=8, microbatches=12)],
         "looped-bfs": [dict(stages=8, microbatches=4, chunks=2)], "ppll": [dict(stages=8, module_groups=(4, 2, 2))],
         "cdp-mp": [dict(stages=3, rule="cdp-v1"), dict(stages=4, ticks="split"),
                    dict(stages=4, ticks="paired")]}
ENOUGH_STEPS = {"cdp-mp": 6}  # its builder lays its table over more steps than the table's default
CASES = [(name, sizes) for name in STAGE_LAYOUTS for sizes in [{}] + SIZES.get(name, [])]


@pytest.mark.parametrize("name,sizes", CASES, ids=[f"{n}-{'-'.join(map(str, s.values())) or 'defaults'}"
                                                   for n, s in CASES])
@pytest.mark.parametrize("residuals", ["recompute", "carry"])
def test_arrays_compiled_from_the_events_are_the_tables(name, sizes, residuals):
    """Every array, slot count and cell the scan reads, compiled from the program's events alone
    (`program_ticks`, as the engine compiles them from the program it is given), equals the one
    built straight from the table."""
    if residuals == "carry" and not any(op_kinds.lookup(k).reads_cotangent for k in op_kinds.KINDS
                                        if k in {o.kind for o in table(name, **sizes).ops}):
        pytest.skip("no backward to carry residuals to (local learning)")
    steps = ENOUGH_STEPS.get(name)
    tbl = table(name, **sizes, **({"steps": steps} if steps else {}))
    program = lower_stage_axis(tbl, residuals)
    arrays, counts, cells = direct_arrays(tbl, residuals)
    ticks = program_ticks(program)
    compiled = ticks.arrays()
    assert sorted(compiled) == sorted(arrays)
    for key, want in arrays.items():
        np.testing.assert_array_equal(compiled[key], want, err_msg=key)
    assert ticks.slots == counts
    assert ticks.cells == cells


# ------------------------------------------------------------- the events drive the engine

BATCH, MICRO = 16, 2


def _gpipe(ctx_mesh=None, **changes):
    """GPipe on 2 stages and 2 devices, M = 2, the MLP, SGD (the config's optimizer): its config,
    table and program."""
    config = small_config("gpipe", stages=2, microbatches=MICRO, global_batch_size=BATCH, **changes)
    tbl = table("gpipe", stages=2, microbatches=MICRO, steps=3)
    return config, tbl, lower_stage_axis(tbl)


def _run_program(config, tbl, program):
    return pipeline.build(context(config, {"stage": 2}), "gpipe", tbl, program=program)


def _mean_loss_grad(e2e, state, images, labels):
    return jax.grad(lambda p: loss_and_metrics(e2e.net, p, state.model_state, images, labels)[0])(state.params)


def test_a_program_without_a_microbatchs_events_trains_on_the_others():
    """GPipe's program with micro-batch 1's computes and messages taken out: the engine runs micro-batch
    0 alone, each op's gradient scaled by 1/M as before, so the step's gradient is half of backprop's
    gradient of the mean loss over micro-batch 0's examples (the first half of the batch); the whole
    program's is backprop's over the batch (the control)."""
    config, tbl, program = _gpipe()

    def micro(e):
        if isinstance(e, Compute):
            return e.microbatch
        sender = next(c for c in program.events if isinstance(c, Compute) and c.tick == e.tick
                      and c.device == e.src)  # a message carries the output of its sender's op of that tick
        return sender.microbatch

    kept = tuple(e for e in program.events if not (isinstance(e, (Compute, Send, Receive)) and micro(e) == 1))
    assert len(kept) < len(program.events) and any(isinstance(e, Compute) for e in kept)
    e2e = build(small_config("e2e", stages=2, microbatches=MICRO, global_batch_size=BATCH), {"data": 1})
    s_e2e = e2e.init(jax.random.key(0))
    b = random_batches(1, BATCH)[0]
    half = BATCH // MICRO
    whole = _run_program(config, tbl, program)
    assert_trees_close(whole.gradients(whole.init(jax.random.key(0)), b),
                       _mean_loss_grad(e2e, s_e2e, b["image"], b["label"]))
    alone = _run_program(config, tbl, dataclasses.replace(program, events=kept))
    want = jax.tree.map(lambda g: 0.5 * g, _mean_loss_grad(e2e, s_e2e, b["image"][:half], b["label"][:half]))
    assert_trees_close(alone.gradients(alone.init(jax.random.key(0)), b), want)


def test_a_program_without_a_stages_apply_leaves_it_as_it_was():
    """GPipe's program without stage 1's `Apply`: after a step stage 1 keeps its initial parameters
    and stage 0 has e2e's update (its own gradient and optimizer, whatever stage 1 does)."""
    config, tbl, program = _gpipe()
    kept = tuple(e for e in program.events if not (isinstance(e, Apply) and e.stage == 1))
    method = _run_program(config, tbl, dataclasses.replace(program, events=kept))
    e2e = build(small_config("e2e", stages=2, microbatches=MICRO, global_batch_size=BATCH), {"data": 1})
    b = random_batches(1, BATCH)[0]
    state, _ = method.train_step(method.init(jax.random.key(0)), b)
    s_e2e, _ = e2e.train_step(e2e.init(jax.random.key(0)), b)
    got, initial, want = method.export(state)[0], e2e.export(e2e.init(jax.random.key(0)))[0], e2e.export(s_e2e)[0]
    assert_trees_close(got[1], initial[1])
    assert_trees_close(got[0], want[0])
    assert max_diff(want[0], initial[0]) > 1e-4  # stage 0 trained


def test_events_the_engine_cannot_run_are_refused_naming_them():
    """A Send to a device that holds no unit past the boundary, a Compute of a stage off its
    device, and a forward whose input no op sends: one ConfigError each, naming the event."""
    _, _, program = _gpipe()
    send = next(e for e in program.events if isinstance(e, Send))
    moved = tuple(dataclasses.replace(e, dst=0, src=1) if e == send else e for e in program.events)
    with pytest.raises(ConfigError, match=r"gpipe: Send\(tick=0.*crosses no boundary"):
        program_ticks(dataclasses.replace(program, events=moved))
    compute = next(e for e in program.events if isinstance(e, Compute) and e.stage == 1)
    astray = tuple(dataclasses.replace(e, device=0) if e == compute else e for e in program.events)
    with pytest.raises(ConfigError, match=r"gpipe: Compute\(tick=1, device=0, kind='F', stage=1.* lives on device 1"):
        program_ticks(dataclasses.replace(program, events=astray))
    first = tuple(e for e in program.events if not (isinstance(e, Compute) and e.stage == 0 and e.kind == "F"
                                                     and e.microbatch == 0))
    with pytest.raises(ConfigError, match=r"F of unit 1, micro-batch 0 .* has no input"):
        program_ticks(dataclasses.replace(program, events=first))
