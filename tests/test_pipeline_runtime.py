"""The tick runtime reads every stage-axis layout from its table: the program replays the table,
every buffer slot holds what the op that reads it expects, 1F1B keeps fewer micro-batches than
GPipe (its point), and a layout added from outside the package (a table and a registration) is
seen by `schedule`, `bench` and the speedup model with no other edit."""
import itertools
import json

import jax
import pytest

from cdpjax import bench, plotting, speedup
from cdpjax.cli import main
from cdpjax.config import default_config
from cdpjax.layouts import LAYOUTS, Layout
from cdpjax.program.stage_axis import IDLE, kind_codes, lower_stage_axis, program_ticks
from cdpjax.timetable import from_orders, table
from helpers import capture_figures, png_matches, schedule_boxes

KIND = {code: kind for kind, code in kind_codes().items()}


def compile_table(tbl, carry_residuals=False):
    """The lowered program's per-tick arrays (and its placement, period and lag)."""
    prog = lower_stage_axis(tbl, "carry" if carry_residuals else "recompute")
    return _Ticks(prog)


class _Ticks:
    def __init__(self, prog):
        self.program, self.placement, self.period, self.lag = prog, prog.placement, prog.period, prog.lag
        self.ticks = program_ticks(prog)  # what the engine compiles from the program's events

    def __getattr__(self, name):
        return getattr(self.ticks, name)

TABLES = {  # name -> (layout, sizes); laid out over enough steps for the program's window
    "gpipe-K4-M4": ("gpipe", dict(stages=4, microbatches=4)),
    "gpipe-K3-M1": ("gpipe", dict(stages=3, microbatches=1)),
    "1f1b-K4-M8": ("1f1b", dict(stages=4, microbatches=8)),
    "1f1b-K4-M2": ("1f1b", dict(stages=4, microbatches=2)),
    "interleaved-D2-V2-M4": ("interleaved-1f1b", dict(stages=4, chunks=2, microbatches=4)),
    "interleaved-D3-V2-M6": ("interleaved-1f1b", dict(stages=6, chunks=2, microbatches=6)),
    "cdp-mp-v2-L4": ("cdp-mp", dict(stages=4, rule="cdp-v2")),
    "cdp-mp-v1-L3": ("cdp-mp", dict(stages=3, rule="cdp-v1")),
    "ppll-K4": ("ppll", dict(stages=4)),
    "ppll-K8-on-3": ("ppll", dict(stages=8, module_groups=(4, 2, 2))),
    "zbv-D2-M4": ("zbv", dict(stages=4, microbatches=4)),
    "dualpipev-D2-M4": ("dualpipev", dict(stages=4, microbatches=4)),  # overlapped cells: several lanes a tick
    "dualpipev-D3-M6": ("dualpipev", dict(stages=6, microbatches=6)),
}


def laid_out(name, steps):
    layout, sizes = TABLES[name]
    return table(layout, steps=steps, **sizes)


def replay(prog, calls, fed_calls):
    """The ops and updates a runtime following `prog` runs over `calls` calls, of which the first
    `fed_calls` feed a batch (call k feeds step k): an op of step k - lag runs only where that
    step was fed, as the runtime masks it."""
    ops, updates = set(), set()
    fed = lambda step: 0 <= step < fed_calls  # noqa: E731
    for k in range(calls):
        for t in range(prog.period):
            for d in range(prog.placement.devices):
                for lane in range(prog.kind.shape[2]):
                    step = k - int(prog.ticks.lag[t, d, lane])
                    if prog.kind[t, d, lane] != IDLE and fed(step):
                        u = int(prog.unit[t, d, lane])
                        for j in prog.placement.units[u]:
                            ops.add((k * prog.period + t, d, j, KIND[int(prog.kind[t, d, lane])],
                                     int(prog.micro[t, d, lane]), step))
                for v in range(prog.placement.chunks):
                    if prog.update[t, d, v] and fed(k - int(prog.update_lag[t, d, v])):
                        u = [w for w in range(len(prog.placement.units))
                             if prog.placement.device[w] == d and prog.placement.chunk[w] == v][0]
                        for j in prog.placement.units[u]:
                            updates.add((k * prog.period + t, j, k - int(prog.update_lag[t, d, v])))
    return ops, updates


@pytest.mark.parametrize("name", list(TABLES))
def test_program_replays_the_table(name):
    """S fed calls, then the calls a flush runs, give back exactly the table's ops and updates
    (the window the program reads is shifted back to tick 0 of step 0)."""
    prog = compile_table(laid_out(name, 9))
    S = 3
    ops, updates = replay(prog, S + prog.lag, S)
    want = laid_out(name, S)
    assert ops == {(o.tick, o.device, o.stage, o.kind, o.micro, o.step) for o in want.ops}
    assert updates == {(u.tick, u.stage, u.step) for u in want.updates}


@pytest.mark.parametrize("carry", [False, True])
@pytest.mark.parametrize("name", list(TABLES))
def test_slots_hold_what_each_op_reads(name, carry):
    """Symbolic run of the program's buffers: each boundary's message goes to the slot `recv_*`
    names on the next (or previous) unit's device, a forward keeps its residuals where it says,
    the first unit's input is kept where a later call's backward needs it, and every op finds in
    the slots it reads the micro-batch, step and unit it works on (never another one's)."""
    tbl = laid_out(name, 9)
    if carry and any(o.kind == "FB" for o in tbl.ops):
        pytest.skip("local learning has no backward to carry residuals to")
    prog = compile_table(tbl, carry_residuals=carry)
    place, D = prog.placement, prog.placement.devices
    act = [[None] * prog.act_slots for _ in range(D)]
    cot = [[None] * prog.cot_slots for _ in range(D)]
    res = [[None] * prog.residual_slots for _ in range(D)]
    kept_input = [[None] * prog.input_slots for _ in range(D)]
    last = len(place.units) - 1
    S = 4
    for k in range(S + prog.lag):
        for t in range(prog.period):
            arriving = []
            for d, lane in itertools.product(range(D), range(prog.kind.shape[2])):
                at = (t, d, lane)
                kind, u, m = KIND.get(int(prog.kind[at])), int(prog.unit[at]), int(prog.micro[at])
                step = k - int(prog.ticks.lag[at])
                if kind is None or not 0 <= step < S:
                    continue
                key = (u, m, step)
                a, r, c, i = (int(prog.act_slot[at]), int(prog.residual_slot[at]), int(prog.cot_slot[at]),
                              int(prog.input_slot[at]))
                if kind in ("F", "FB"):
                    if u > 0:
                        assert act[d][a] == key, (t, d, key, act[d][a])
                    elif i >= 0:
                        kept_input[d][i] = key  # the first unit keeps the batch's micro-batch for later
                    if kind == "F" and carry:
                        res[d][r] = key
                    if u < last:
                        assert prog.send_act[t, u] == 1
                        arriving.append((place.device[u + 1], "act", int(prog.recv_act[t, u]), (u + 1, m, step)))
                else:
                    if carry:
                        assert res[d][r] == key, (t, d, key, res[d][r])
                    elif u > 0:
                        assert act[d][a] == key, (t, d, key, act[d][a])
                    elif prog.lag:  # the first unit's batch of an earlier call
                        assert kept_input[d][i] == key, (t, d, key, kept_input[d][i])
                    if u < last:
                        assert cot[d][c] == key, (t, d, key, cot[d][c])
                    if u > 0 and kind == "B":  # B sends its input's cotangent; W sends nothing
                        assert prog.send_cot[t, u - 1] == 1
                        arriving.append((place.device[u - 1], "cot", int(prog.recv_cot[t, u - 1]), (u - 1, m, step)))
            for d, what, slot, key in arriving:  # at the end of the tick
                assert slot >= 0
                (act if what == "act" else cot)[d][slot] = key


def test_1f1b_keeps_fewer_micro_batches_than_gpipe():
    """GPipe keeps every micro-batch's input on stage 0 until the drain (M slots); 1F1B's stage j
    runs K-1-j warm-up forwards and then retires one micro-batch per forward, so it never holds
    more than min(M, K) (the rule written out; the program's interval colouring must find it)."""
    for K, M in [(4, 8), (4, 2), (3, 6), (2, 5)]:
        g = compile_table(table("gpipe", stages=K, microbatches=M, steps=3))
        f = compile_table(table("1f1b", stages=K, microbatches=M, steps=3))
        assert g.act_slots == M, (K, M)
        assert f.act_slots == min(M, K), (K, M)
        # the same bubble: 2(K-1) idle ticks of each device's 2(M+K-1)
        for t in (table("gpipe", stages=K, microbatches=M, steps=1), table("1f1b", stages=K, microbatches=M, steps=1)):
            assert t.period == 2 * (M + K - 1) and t.busy_fraction()["devices"] == pytest.approx(M / (M + K - 1))


def test_interleaved_bubble_shrinks_with_chunks():
    """Megatron's interleaved schedule: with V chunks the idle time of a step falls from GPipe's
    2(D-1) ticks of stage-work to about 2(D-1)/V (each tick here is a chunk, 1/V of a device's
    stages): busy fraction over device time at least GPipe's, and every stage's F and B once."""
    D, M = 4, 8
    for V in (2, 4):
        t = table("interleaved-1f1b", stages=V * D, chunks=V, microbatches=M, steps=1)
        work = 2 * M * V  # ticks of work per device per step
        assert t.period - work <= 2 * (D - 1) + (V - 1) * D  # idle ticks of the slowest device
        gpipe = table("gpipe", stages=D, microbatches=M, steps=1)
        assert t.busy_fraction()["devices"] > gpipe.busy_fraction()["devices"]
        assert len(t.ops) == 2 * M * V * D


# ------------------------------------------------------------------ a layout from outside


def toy_table(stages: int = 3, microbatches: int = 2, steps: int = 2):
    """A toy layout: GPipe whose backwards drain the micro-batches last-in first-out."""
    orders = [[("F", j, m) for m in range(microbatches)] + [("B", j, m) for m in reversed(range(microbatches))]
              for j in range(stages)]
    return from_orders("toy-lifo", orders, stages, microbatches, steps)


def toy_build(ctx):
    from cdpjax.layouts import stage_devices
    from cdpjax.methods import pipeline

    return pipeline.build(ctx, "toy-lifo", toy_table(stage_devices(ctx.config), int(ctx.config.microbatches), 3))


TOY = Layout("toy-lifo", toy_build, axes=("stage", "data"), device_axis="stage", table=toy_table, microbatches=True,
             colour="micro", label="{kind}{micro}", legend="F<m>/B<m>: micro-batch m, drained last-in first-out",
             title="{method}: {stages} stages, M={microbatches}", summary="a toy layout defined in a test")


def test_a_layout_from_outside_needs_no_other_edit(tmp_path, capsys, monkeypatch):
    """The toy's diagram, drawn by `schedule --out`, has its boxes where its rule puts them: K = 3
    stages, M = 2 micro-batches, 2 steps of 2(M+K-1) = 8 ticks; forward of micro-batch m on stage
    j at tick j + m; the last stage's backwards after its forwards, micro-batch M-1 first, each
    earlier stage's one tick after the stage above: B(j, m) at K-1+M + (M-1-m) + (K-1-j)."""
    K, M, period = 3, 2, 8
    lifo = [(period * k + j + m, j, f"F{m}", False) for k in range(2) for j in range(K) for m in range(M)]
    lifo += [(period * k + K - 1 + M + (M - 1 - m) + (K - 1 - j), j, f"B{m}", False)
             for k in range(2) for j in range(K) for m in range(M)]
    with LAYOUTS.temporarily("toy-lifo", TOY):
        assert main(["schedule", "--method", "toy-lifo", "--stages", "3", "--microbatches", "2", "--json"]) == 0
        d = json.loads(capsys.readouterr().out)
        assert d["method"] == "toy-lifo" and [row[0] for row in d["ticks"][:2]] == ["F0", "F1"]  # device 0
        figures = capture_figures(monkeypatch, plotting)
        assert main(["schedule", "--method", "toy-lifo", "--stages", "3", "--out", str(tmp_path / "t.png")]) == 0
        ((_, fig),) = figures
        assert sorted(schedule_boxes(fig)) == sorted(lifo)
        assert png_matches(tmp_path / "t.png", fig)
        c = default_config()
        c.method, c.model, c.model_kwargs, c.norm = "toy-lifo", "mlp", {"width": 16}, "none"
        c.stages, c.microbatches = 3, 2
        c.global_batch_size = 16
        record = bench.bench_method(c, devices=jax.devices()[:3], warmup=1, repeats=1)
        assert record["method"] == "toy-lifo" and record["devices"] == 3
        assert record["busy_fraction"] == pytest.approx(2 / 4)  # M / (M + K - 1)
        # Memory and bytes from the toy's lowered program alone, counted by hand: the mlp of width 16
        # (64 -> 16 -> 16 -> 16 -> 10) cut into 3 stages, micro-batches of 16 / 2 = 8 examples.
        # Wherever the 3 stages are cut, the model's blocks are these and both boundaries are 16 wide.
        blocks = [4 * (64 * 16 + 16), 4 * (16 * 16 + 16), 4 * (16 * 16 + 16), 4 * (16 * 10 + 10)]
        assert sum(record["stage_param_bytes"]) == sum(blocks)
        model = record["memory_model"]["arguments"]
        # each device holds one row as long as the largest stage, and its momentum (and step counts)
        assert model["parameters"] == max(record["stage_param_bytes"])
        assert model["optimizer_state"] == pytest.approx(model["parameters"], rel=0.01)
        assert model["gradients_in_flight"] == 0  # flushed every step
        # per step: 2 boundaries x M = 2 micro-batches x (the activation forward, its cotangent back)
        # of 8 x 16 float32, over 3 devices
        assert record["sent_bytes_per_device_per_step"] == pytest.approx(2 * 2 * 2 * 8 * 16 * 4 / 3)
        predicted = speedup.predict_for_config(c, 3, 1e15)
        assert "error" not in predicted and predicted["devices"] == 3
    assert "toy-lifo" not in LAYOUTS


def test_pipeline_names_appear_only_where_their_layouts_are_defined():
    """Layout metadata lives in one place: outside its layout module and its builder's module,
    nothing in cdpjax/ names a stage-axis layout (schedule, bench, speedup, plots read LAYOUTS)."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1] / "cdpjax"
    for name in ("gpipe", "ppll", "cdp-mp", "1f1b", "interleaved-1f1b"):
        builder = pathlib.Path(*LAYOUTS[name].builder.split(":")[0].split("."))
        allowed = {root.parent / builder.with_suffix(".py")}
        allowed |= {p for p in (root / "layouts").glob("*.py") if f'Layout(\n    "{name}"' in p.read_text()
                    or f'Layout("{name}"' in p.read_text()}
        # (the experiment configs shipped in cdpjax/configs/ choose methods by name, as a user does)
        naming = {p for p in root.rglob("*.py") if f'"{name}"' in p.read_text() and p.parent != root / "configs"}
        assert naming <= allowed, (name, sorted(str(p) for p in naming - allowed))
        assert len(allowed) == 2, (name, allowed)  # its layout module was found


@pytest.mark.parametrize("name", sorted(n for n, layout in LAYOUTS.items() if layout.table is not None))
def test_a_table_survives_json(name, tmp_path, capsys):
    """`TimeTable.to_json` / `from_json` give back the same table (ops, updates, messages, sizes,
    layout facts), and `cdpjax schedule --from-json` prints the grid the table itself prints."""
    from cdpjax.timetable import TimeTable

    t = LAYOUTS[name].make_table()
    back = TimeTable.from_json(json.dumps(t.to_json()))
    assert back == t and back.meta == t.meta and back.notes == t.notes
    path = tmp_path / "t.json"
    path.write_text(t.dumps())
    assert main(["schedule", "--from-json", str(path)]) == 0
    assert capsys.readouterr().out.strip() == t.format_grid().strip()


@pytest.mark.parametrize("name", [pytest.param("1f1b", marks=pytest.mark.heavy),
                                  pytest.param("interleaved-1f1b", marks=pytest.mark.heavy),
                                  "zb-h1", "zbv", "dualpipev", "looped-bfs"])
def test_new_layouts_train_from_the_digits_config(name, tmp_path):
    """`cdpjax train --config digits:method=NAME` trains (a short run): the
    config names no mesh, the layout's own is taken."""
    import pathlib

    import subprocess
    import sys

    config = pathlib.Path(__file__).resolve().parents[1] / "cdpjax" / "configs" / "digits.py"
    done = subprocess.run([sys.executable, "-m", "cdpjax.cli", "train", "--no-progress", "--workdir", str(tmp_path),
                           "--config", f"{config}:method={name}", "--config.num_steps=30", "--config.eval_every=0",
                           "--config.checkpoint_every=0"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["method"] == name and summary["test_accuracy"] > 0.3  # digits: chance is 0.1
    # 4 stages: one per device, or two per device (V chunks, the V placement); replicas on the 8 left
    stage = 4 if name in ("1f1b", "zb-h1") else 2
    assert summary["mesh"] == {"stage": stage, "data": 8 // stage}
