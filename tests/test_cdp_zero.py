"""cdp-zero: the plan feeds every op the version CDP's timing names and gives every owner every
worker's gradient (played on version numbers and sets of contributions, for many sizes, rules and
both backwards); the SPMD run ends with the ring's parameters; its compiled step sends only
point-to-point messages of a stage's real size, the bytes its program declares, ZeRO-3's share
of the model; each worker stores only the rows of the stages it owns."""
import functools
import json

import jax
import numpy as np
import pytest

from cdpjax import bench, data, methods
from cdpjax.commands import schedule
from cdpjax.config import ConfigError, default_config
from cdpjax.layouts.cdp_zero import cdp_zero_table, owners_of
from cdpjax.mesh import make_mesh
from cdpjax.methods import cdp
from cdpjax.methods.common import Context
from cdpjax.program.zero import zero_ticks
from cdpjax.timetable import table
from helpers import assert_trees_close as assert_close, cdp_rule, max_diff, params

BATCH, STEPS = 32, 3


def config(**kw):
    c = default_config()
    c.model_kwargs.width = 16  # mlp: 4 blocks, so up to 4 stages
    c.global_batch_size = BATCH
    c.num_steps = 20
    c.eval_every = c.checkpoint_every = 0
    c.norm = "none"  # exact equality
    for k, v in kw.items():
        c[k] = v
    return c


@functools.lru_cache(maxsize=None)
def batches():
    ds = data.build(config())
    return [ds.train_batch(k, BATCH, 0, augment=False) for k in range(STEPS + 2)]


def context(devices, **kw):
    ds = data.build(config())
    return Context(config(**kw), make_mesh({"data": devices}, jax.devices()[:devices]), ds.image_shape, ds.num_classes)


@functools.lru_cache(maxsize=None)
def build(impl, rule, workers, stages=4, ticks="whole", residuals="recompute"):
    kw = dict(stages=stages, cdp_ticks=ticks, residuals=residuals)
    if impl == "ring":
        return cdp.make(context(workers, method=rule, cdp_impl="ring", **kw), rule)
    return methods.build(context(workers, method="cdp-zero", cdp_rule=rule, **kw))


def train(m, steps=STEPS, state=None, start=0):
    state = m.init(jax.random.key(0)) if state is None else state
    for b in batches()[start:start + steps]:
        state, metrics = m.train_step(state, b)
        assert np.isfinite(float(metrics["loss"]))
    return state


# ------------------------------------------------------------------ the plan, played


def play(rule, N, L, ticks="whole", calls=5, program=None):
    """Plays cdp-zero's period on version numbers and sets of gradient contributions as the SPMD
    tick does (refreshes, ops, sends all read before any lands, updates; a gradient row outside
    the train state, `kept_grad_rows`, lost at every call's end); each op must read the
    version CDP's timing names (`helpers.cdp_rule`, not the table code), each update must sum
    every worker's gradient of its step, and every update must be applied in the end."""
    z = program or zero_ticks(rule, N, L, ticks)
    want = {(w, j, k, kind): v for _, w, j, kind, k, v, _, _ in cdp_rule(rule, N, L, calls + 3, ticks)[0]}
    master = {w: [[0] * z.versions for _ in range(z.owned)] for w in range(N)}
    relay = {w: [None] * z.relay_rows for w in range(N)}
    grad = {w: [frozenset()] * z.grad_rows for w in range(N)}
    checked = 0
    for call in range(calls + z.max_lag):
        def valid(lag):
            return 0 <= call - lag < calls

        for w in range(N):  # a row outside the train state starts each call empty: what it held is gone
            for g in range(z.grad_rows):
                if g not in z.kept_grad_rows:
                    grad[w][g] = frozenset({("lost", call)})

        for tk in z.ticks:
            for j, owner, w, k, row, r in tk.refreshes:
                relay[w][r] = (j, master[owner][k][row])
            for op in tk.ops:
                step = call - op.lag
                if valid(op.lag):
                    v = want[(op.worker, op.stage, step, op.kind)]
                    if op.params[0] == "relay":
                        assert relay[op.worker][op.params[1]] == (op.stage, v), (call, op, relay[op.worker], v)
                    else:
                        _, k, row = op.params
                        assert z.owners[op.stage] == op.worker and master[op.worker][k][row] == v, (call, op)
                    checked += 1
                if op.grad_out >= 0:
                    mine = frozenset({(op.worker, step)}) if valid(op.lag) else frozenset()
                    before = grad[op.worker][op.grad_in] if op.grad_in >= 0 else frozenset()
                    grad[op.worker][op.grad_out] = before | mine
            landed = [(dst, dr, grad[src][sr]) for _, src, dst, sr, dr in tk.sends]
            for dst, dr, value in landed:
                grad[dst][dr] = value
            for j, owner, lag, k, rows in tk.applies:
                if valid(lag):
                    total = frozenset().union(*(grad[owner][r] for r in rows))
                    assert total == {(i, call - lag) for i in range(N)}, (rule, N, L, call, j, total)
                    m = master[owner][k]
                    m[:] = [m[0] + 1] + m[:-1]
    for j in range(L):
        assert master[z.owners[j]][z.local[j]][0] == calls  # every update applied once
    return checked


SIZES = [(n, l, ticks) for ticks, T in (("whole", 2), ("split", 3)) for l in range(1, 6)
         for n in range(1, T * l + 1) if (T * l) % n == 0 and n <= 8]
SIZES += [(n, l, "paired") for l in range(1, 6) for n in range(1, -(-l // 2) + l + 1)]


@pytest.mark.parametrize("rule", ["cdp-v2", "cdp-v1"])
def test_plan_feeds_every_op_its_version_and_every_owner_every_gradient(rule):
    for N, L, ticks in SIZES:
        assert play(rule, N, L, ticks) > 0
        z = zero_ticks(rule, N, L, ticks)
        counts = np.bincount(np.asarray(z.owners), minlength=N)
        assert counts.max() == z.owned == -(-L // N), (N, L, z.owners)  # at most ceil(L/N) stages each
        # the rule: the last stages on the last workers, the last stage on the last worker
        assert z.owners == tuple((N - L + j) % N for j in range(L)) == owners_of(N, L)


def test_play_can_fail():
    """A refresh of the wrong row, a gradient op writing the wrong row, a send that lands in the
    wrong row, or a gradient row left out of the train state while a sum spans the call's end in
    it is caught by the same player."""
    import dataclasses

    good = zero_ticks("cdp-v2", 4, 4)
    t = next(i for i, tk in enumerate(good.ticks) if tk.refreshes and tk.sends)
    tk = good.ticks[t]
    bad_refresh = dataclasses.replace(tk, refreshes=tuple((j, o, w, k, 1 - row, r) for j, o, w, k, row, r in tk.refreshes))
    bad_send = dataclasses.replace(tk, sends=tuple((j, s, d, sr, (dr + 1) % good.grad_rows)
                                                   for j, s, d, sr, dr in tk.sends))
    for bad in (bad_refresh, bad_send):
        program = dataclasses.replace(good, ticks=good.ticks[:t] + (bad,) + good.ticks[t + 1:])
        with pytest.raises(AssertionError):
            play("cdp-v2", 4, 4, program=program)
    # a row some sum spans the period's end in, taken out of the train state: that sum is lost
    for g in good.kept_grad_rows:
        short = dataclasses.replace(good, kept_grad_rows=tuple(r for r in good.kept_grad_rows if r != g))
        with pytest.raises(AssertionError):
            play("cdp-v2", 4, 4, program=short)


# ------------------------------------------------------------------ equal to the ring


@pytest.mark.parametrize("rule,workers,ticks,residuals", [
    ("cdp-v2", 4, "whole", "recompute"), pytest.param("cdp-v1", 4, "whole", "recompute", marks=pytest.mark.heavy),
    ("cdp-v2", 8, "whole", "recompute"), pytest.param("cdp-v2", 4, "split", "carry", marks=pytest.mark.heavy),
    ("cdp-v2", 2, "whole", "recompute"), ("cdp-v2", 4, "paired", "carry")])
def test_equals_ring(rule, workers, ticks, residuals):
    stages = 4
    zero = build("zero", rule, workers, stages, ticks, residuals)
    ring = build("ring", rule, workers, stages, ticks, residuals)
    assert zero.report["owners"] == [(workers - stages + j) % workers for j in range(stages)]
    state = train(zero)
    unflushed = params(zero, state)
    state = zero.flush(state)
    got = params(zero, state)
    assert_close(got, params(ring, ring.flush(train(ring))))
    assert max_diff(got, params(zero, zero.init(jax.random.key(0)))) > 1e-3  # it trained
    assert max_diff(unflushed, got) > 1e-6  # the flush finished the last step's updates
    if workers == 4 and rule == "cdp-v2" and ticks == "whole":  # training on after a flush, as the ring does
        assert_close(params(zero, zero.flush(train(zero, 2, state, STEPS))),
                     params(ring, ring.flush(train(ring, 2, ring.flush(train(ring)), STEPS))))


# ------------------------------------------------------------------ messages and memory


def permute_sizes(hlo: str) -> dict:
    out = {}
    for line in hlo.splitlines():
        if "=" in line:
            rhs = line.split("=", 1)[1]
            for kind in bench.COLLECTIVES:
                if f" {kind}(" in rhs or f" {kind}-start(" in rhs:
                    out.setdefault(kind, []).append(bench._shape_bytes(rhs.split(kind)[0]) // 4)  # f32 elements
    return out


@pytest.mark.parametrize("rule", ["cdp-v2", "cdp-v1"])
def test_messages_are_stage_sized_and_zero3_share(rule):
    """The compiled step sends no all-gather, reduce-scatter or model-sized all-reduce; every
    collective-permute carries exactly one stage (never a padded row); the bytes it really sends
    are what the program declares: per worker and step 2(N-1)/N of the model in parameters (each
    visit that is not the owner's, counted by rule below) and (N-1)/N in gradient sums."""
    zero = build("zero", rule, 4)
    state = zero.init(jax.random.key(0))
    hlo = zero.train_step.lower(state, batches()[0]).compile().as_text()
    sizes = permute_sizes(hlo)
    stage = [sum(x.size for x in jax.tree.leaves(p)) for p in zero.export(state)[0]]
    model = sum(stage)
    assert not sizes.get("all-gather") and not sizes.get("reduce-scatter") and not sizes.get("all-to-all")
    assert max(sizes["all-reduce"]) < 0.01 * model  # the metric scalars
    assert set(sizes["collective-permute"]) <= set(stage)  # one stage each, at its own size
    sent = bench.traffic(hlo, 4)["by_kind"]["collective-permute"] / 4  # per worker
    assert zero.program.sent_bytes({"param": [4 * s for s in stage]}).mean() == pytest.approx(sent, rel=1e-6)
    # By rule, N = L = 4, whole backwards: worker i visits stage j twice a step (its F, its B), the
    # last stage once (F and B back to back); the owner's visits read its own rows. Each other visit
    # is one message of the stage: 2 (N - 1) of stages 0..2 and N - 1 of stage 3; each stage's sum
    # hops N - 1 times.
    params_sent = sum(2 * 3 * s for s in stage[:3]) + 3 * stage[3]  # elements, over all workers
    sums_sent = 3 * model
    assert 4 * sent == pytest.approx(4 * (params_sent + sums_sent), rel=1e-6)  # bytes over the 4 workers, float32
    # ZeRO-3's share: at most 2(N-1)/N of the model in parameters and (N-1)/N in gradients per worker
    assert sent <= 4 * (2 * 3 / 4 + 3 / 4) * model


def test_each_worker_stores_only_its_stages():
    """Persistent parameter and optimizer storage per device: K owned stage rows x (stored versions
    + momentum), each row the largest stage (one shape on every device), against the ring's whole
    model in its own shapes (one version + momentum)."""
    zero, ring = build("zero", "cdp-v2", 4), build("ring", "cdp-v2", 4)
    state, ring_state = zero.init(jax.random.key(0)), ring.init(jax.random.key(0))
    stage = [sum(x.size for x in jax.tree.leaves(p)) for p in zero.export(state)[0]]

    def per_device(tree):
        return sum(x.nbytes for x in jax.tree.leaves(tree)) / 4  # the leading axis is the 4 workers

    z = zero.program.ticks
    assert (z.owned, z.versions) == (1, 2)  # one stage each; stale reads after an update read the previous
    rows = per_device([state["master"], state["opt_state"]])
    assert abs(rows - (2 + 1) * max(stage) * 4) < 64  # + the optimizer's step count
    assert abs(per_device([ring_state["params"], ring_state["opt_state"]]) - 2 * sum(stage) * 4) < 64


def test_no_row_sized_copy_per_op_survives_compilation():
    """A regression bound, from the buffers traced in XLA's assignment (docs/measured.md, cdp-zero):
    a stage's row unpacked into its leaves outside the op's conditional, its gradient packed outside
    it, and every message padded to a row before landing were row-sized copies that XLA kept alive
    across the conditionals: XLA's temporaries were 3.2x what the program declares within a step on
    this ResNet-18 (quarter width, N = L = 4), and 2.37x with the rows unpacked, packed and landed
    inside the branches (the gradient rows no sum spans a call's end in declared as temporaries).
    XLA then still sent the refreshes of the first ticks at the first tick and held the messages;
    with each refresh tied to the previous tick (`ring.zero_of`) they are 2.17x. Bound: 2.3x."""
    import pathlib

    from cdpjax.config import load_file

    c = load_file(str(pathlib.Path(__file__).resolve().parents[1] / "experiments" / "configs" / "bench_resnet18.py"))
    c.method, c.model_kwargs = "cdp-zero", {"stem": "cifar", "width": 0.25}
    run = bench._prepare(c, jax.devices()[:4])
    method = run["method"]
    micro = bench.micro_batch(method, c, run["mesh"])
    declared = bench.memory_model(method, c, method.table, bench.stage_sizes(method.net, micro), 4,
                                  bench.program_sizes(method, micro, run["task"]))["temporaries"]["total"]
    temp = bench.memory(run["compiled"])["temp_bytes"]
    assert temp <= 2.3 * declared, (temp / 2**20, declared / 2**20)


# ------------------------------------------------------------------ table, schedule, errors


def test_table_and_schedule(capsys):
    """The table: CDP's ops as the paper states them, with the plan's messages: one 'param' from
    the owner before each visit that is not the owner's, N - 1 'partial' hops a stage ending at its
    owner; `cdpjax schedule --method cdp-zero` prints them."""
    t = cdp_zero_table(4, 4, steps=3)
    ops, updates, stale = cdp_rule("cdp-v2", 4, 4, 3)
    assert t.method == "cdp-zero"
    assert {(o.tick, o.device, o.stage, o.kind, o.step, o.version, o.slot, o.stale) for o in t.ops} == ops
    assert updates == {(u.tick, u.stage, u.step) for u in t.updates}
    np.testing.assert_array_equal(t.stale, stale)
    step1 = [m for m in t.messages if m.step == 1]
    owners = t.meta["owners"]
    assert owners == [0, 1, 2, 3]
    assert sum(m.kind == "param" for m in step1) == 3 * (2 * 3 + 1)  # 3 other workers, 7 visits each
    assert all(m.src == owners[m.stage] for m in step1 if m.kind == "param")
    partials = [m for m in step1 if m.kind == "partial"]
    assert len(partials) == 4 * 3 and all(m.dst == owners[m.stage] for m in partials if m.src == 3 - (m.stage == 3))
    assert table("cdp-zero", workers=4, stages=4, rule="cdp-v1").meta["stored_versions"] == 2
    assert schedule.main(["--method", "cdp-zero", "--workers", "4", "--stages", "4", "--rule", "cdp-v1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("cdp-zero: N=4 workers") and "stage 0: w0" in out
    assert schedule.main(["--method", "cdp-zero", "--workers", "8", "--stages", "4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["owners"] == [4, 5, 6, 7]
    assert schedule.main(["--method", "cdp-zero", "--workers", "3", "--stages", "4"]) == 2
    assert "choose workers in" in capsys.readouterr().err


def test_config_errors():
    assert "cdp-zero" in methods.REGISTRY
    bad = [
        (dict(workers=3), 3, "choose workers in"),
        (dict(workers=2), 4, "must equal mesh.data=4"),
        (dict(global_batch_size=30), 4, "global_batch_size=30"),
        (dict(cdp_rule="dp"), 4, "cdp_rule"),
    ]
    for kw, devices, match in bad:
        with pytest.raises(ConfigError, match=match):
            methods.build(context(devices, method="cdp-zero", **kw))
    ds = data.build(config())
    mesh = make_mesh({"stage": 2, "data": 2}, jax.devices()[:4])
    with pytest.raises(ConfigError, match="mesh"):
        methods.build(Context(config(method="cdp-zero"), mesh, ds.image_shape, ds.num_classes))
