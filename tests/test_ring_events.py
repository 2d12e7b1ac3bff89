"""The ring engine runs the program's events: the period its scan reads (`program_period`) and the
routing and pool compiled from it are read from `Program.events` alone, and equal, for every ring
table of the registry (cdp-v1, cdp-v2, the paper code's rule, cdp-random's ring models; whole, split
and paired ticks; N != L), what the lowering's own `RingTicks` gave before the events came first
(that walk is kept here, as it was, as the second implementation); a program whose events are
changed by hand trains as the changed events say."""
import dataclasses

import jax
import numpy as np
import pytest

from cdpjax.errors import ConfigError
from cdpjax.layouts.cdp import cdp_table
from cdpjax.methods import ring
from cdpjax.program import Apply, Compute
from cdpjax.program.ring import lower_ring, op_order, program_period, ring_pool, ring_program_routing, ring_routing, \
    ring_ticks
from cdpjax.timetable import table
from helpers import assert_trees_close, assert_trees_equal, context, max_diff, random_batches, small_config

# ------------------------------------------ the routing straight from the lowering's RingTicks (the path before)


def _direct_op_arrays(ticks, routing):
    """(lag, read slot, write slot, start) per (tick, worker, position), walking the lowering's ticks
    as `ring_routing` did: each worker's ops in `op_order`; a gradient op starts a sum where its
    (worker, stage) starts a chain, else reads its partial; it writes the completed sum where it
    completes the stage's, else its partial."""
    shape = routing.op_branch.shape
    lag, read, write = (np.zeros(shape, np.int32) for _ in range(3))
    start = np.zeros(shape, bool)
    for t, tk in enumerate(ticks.ticks):
        done = {(c.worker, c.stage, c.lag) for c in tk.completes}
        k_of = [0] * ticks.workers
        for o in op_order(tk):
            k, k_of[o.worker] = k_of[o.worker], k_of[o.worker] + 1
            lag[t, o.worker, k] = o.lag
            if o.kind in tk.gradient_kinds:
                start[t, o.worker, k] = (o.worker, o.stage) in tk.chain_start
                if not start[t, o.worker, k]:
                    read[t, o.worker, k] = routing.slot(("partial", o.stage, o.lag))
                kind = "sum" if (o.worker, o.stage, o.lag) in done else "partial"
                write[t, o.worker, k] = routing.slot((kind, o.stage, o.lag))
    return lag, read, write, start


def _direct_pool_offsets(ticks, pool):
    """The pool offsets of every gradient op's read and write, re-walking the ticks' ops as
    `ring_pool` did (names placed by `pool.at`)."""
    read, write = np.zeros(pool.op_read.shape, np.int64), np.zeros(pool.op_write.shape, np.int64)
    for t, tk in enumerate(ticks.ticks):
        done = {(c.worker, c.stage, c.lag) for c in tk.completes}
        k_of = [0] * ticks.workers
        for o in op_order(tk):
            k, k_of[o.worker] = k_of[o.worker], k_of[o.worker] + 1
            if o.kind in tk.gradient_kinds:
                if (o.worker, o.stage) not in tk.chain_start:
                    read[t, o.worker, k] = pool.at[(t, ("partial", o.stage, o.lag))][o.worker]
                kind = "sum" if (o.worker, o.stage, o.lag) in done else "partial"
                write[t, o.worker, k] = pool.at[(t, (kind, o.stage, o.lag))][o.worker]
    return read, write


def _ring_tables():
    """Every ring table of the registry at a few sizes (N = L, N < L, N > L; every tick kind)."""
    out = []
    for name in ("cdp-v1", "cdp-v2"):
        for n, ticks in ((4, "whole"), (2, "whole"), (8, "whole"), (4, "split"), (2, "split"), (4, "paired"),
                         (2, "paired")):
            if (name, n, ticks) == ("cdp-v1", 8, "whole"):
                continue
            out.append((f"{name}-{n}x4-{ticks}", lambda name=name, n=n, ticks=ticks:
                        table(name, workers=n, stages=4, steps=3, ticks=ticks)))
    for n, l, ticks in ((8, 4, "whole"), (2, 4, "whole"), (4, 4, "split"), (2, 4, "paired")):
        out.append((f"paper-code-{n}x{l}-{ticks}", lambda n=n, l=l, ticks=ticks:
                    cdp_table("paper-code", n, l, 3, ticks=ticks)))
    out.append(("cdp-random-uniform", lambda: table("cdp-random", workers=4, stages=4, steps=3,
                                                    delay=dict(model="uniform", rule="cdp-v1"))))
    out.append(("cdp-random-per-stage", lambda: table("cdp-random", workers=4, stages=2, steps=6,
                                                      delay=dict(model="per-stage", taus=(2, 1)))))
    return out


@pytest.mark.parametrize("make", [m for _, m in _ring_tables()], ids=[n for n, _ in _ring_tables()])
def test_routing_compiled_from_the_events_is_the_lowerings(make):
    tbl = make()
    program, lowered = lower_ring(tbl), ring_ticks(tbl)  # the program, and the period its lowering folded
    period = program_period(program)
    assert period == lowered  # every tick's ops, sums, hops, applies; live buffers, lags, newest
    routing, direct = ring_program_routing(program), ring_routing(lowered)
    for name in ("op_branch", "op_lag", "op_read", "op_write", "op_start", "op_depth", "apply_stage", "apply_lag",
                 "apply_slot"):
        np.testing.assert_array_equal(getattr(routing, name), getattr(direct, name), err_msg=name)
    assert routing.op_kinds == direct.op_kinds and routing.names == direct.names
    lag, read, write, start = _direct_op_arrays(lowered, routing)
    for got, want in ((routing.op_lag, lag), (routing.op_read, read), (routing.op_write, write),
                      (routing.op_start, start)):
        np.testing.assert_array_equal(got, want)
    sizes = [5 + 3 * j for j in range(period.stages)]
    pool = ring_pool(period, routing, sizes)
    read, write = _direct_pool_offsets(lowered, pool)
    np.testing.assert_array_equal(pool.op_read, read)
    np.testing.assert_array_equal(pool.op_write, write)


def test_every_gradient_op_names_the_sum_it_starts_or_completes():
    """cdp-v2 at N = L = 4: each stage's sum of a step is started by one worker and completed by
    another (the next workers in the ring add to it), so per stage and lag-shifted step one Compute
    starts it and one completes it; forwards name none."""
    program = lower_ring(table("cdp-v2", workers=4, stages=4, steps=3))
    computes = [e for e in program.events if isinstance(e, Compute)]
    assert not any(e.starts_sum or e.completes_sum for e in computes if e.kind == "F")
    T = program.period
    for flag in ("starts_sum", "completes_sum"):
        per_step = {}
        for e in computes:
            if getattr(e, flag):
                per_step.setdefault((e.stage, e.tick + e.lag * T - e.device * 2), []).append(e)  # worker w: 2w later
        assert len(per_step) == 4 and all(len(v) == 1 for v in per_step.values()), (flag, per_step)


# ------------------------------------------------------------- the events drive the engine

WORKERS, STAGES, BATCH = 4, 4, 16


def _ring(program_of=lambda p: p):
    """cdp-v2's ring at N = L = 4 (the MLP, SGD) running `program_of(its lowered program)`."""
    config = small_config("cdp-v2", stages=STAGES, workers=WORKERS, cdp_impl="ring", global_batch_size=BATCH)
    ctx = context(config, {"data": WORKERS})
    tbl = table("cdp-v2", workers=WORKERS, stages=STAGES)
    program = lower_ring(tbl)
    return ring.build(ctx, "cdp-v2", ctx.net(bn_axis_name=None), tbl, "recompute", program=program_of(program))


def _trained(method, steps=3):
    state = method.init(jax.random.key(0))
    for b in random_batches(steps, BATCH):
        state, _ = method.train_step(state, b)
    return method.flush(state)


def test_a_program_without_a_stages_applies_never_updates_it():
    """cdp-v2's program with every `Apply` of stage 2 taken out: after three steps and a flush every
    worker's stage 2 is its initial copy, while the whole program's moved (the control)."""
    whole = _ring()
    initial = whole.init(jax.random.key(0)).params
    trained = _trained(whole).params
    assert max_diff(trained[2], initial[2]) > 1e-4
    frozen = _ring(lambda p: dataclasses.replace(p, events=tuple(e for e in p.events
                                                                 if not (isinstance(e, Apply) and e.stage == 2))))
    got = _trained(frozen).params
    assert_trees_equal(got[2], initial[2])
    assert max_diff(got[0], initial[0]) > 1e-4  # the other stages trained


def test_a_program_without_a_workers_computes_trains_otherwise():
    """cdp-v2's program without worker 1's computes of the current step (lag 0): the parameters after
    three steps differ from the whole program's, which equal the registry's own ring build."""
    whole = _trained(_ring())
    missing = _trained(_ring(lambda p: dataclasses.replace(p, events=tuple(
        e for e in p.events if not (isinstance(e, Compute) and e.device == 1 and e.lag == 0)))))
    assert max_diff(missing.params, whole.params) > 1e-4
    from helpers import build
    registry = build(small_config("cdp-v2", stages=STAGES, workers=WORKERS, cdp_impl="ring",
                                  global_batch_size=BATCH), {"data": WORKERS})
    assert_trees_close(_trained(registry).params, whole.params)


# ------------------------------------------------------- reads of versions before the previous one


def two_behind_table(steps: int):
    """A cyclic table no layout defines, written out here: N = 2 workers, L = 2 stages, whole
    backwards (a step is F0 F1 B1 B0, T = 4 ticks), worker 1 two ticks after worker 0. Stage 0 is
    read two versions behind by every worker (step k reads theta_0^(k-2), theta_0^0 before step 2),
    stage 1 fresh (version k). Stage j's running sum hops from worker 0 to worker 1 (a 'partial'
    after worker 0's B_j), worker 1 completes it (the update) and sends it to worker 0 in the same
    tick, and both apply it at once (tick 4k+4 for stage 1, 4k+5 for stage 0): by its step-k reads
    of theta_0^(k-2) a worker has applied up to two later updates of stage 0, so it keeps three
    versions of it."""
    from cdpjax.timetable import Apply as TableApply, Message, Op, TimeTable, Update

    phases = [("F", 0), ("F", 1), ("B", 1), ("B", 0)]
    ops, updates, messages, applies = [], [], [], []
    for k in range(steps):
        for w, offset in ((0, 0), (1, 2)):
            for p, (kind, j) in enumerate(phases):
                version = max(k - 2, 0) if j == 0 else k
                ops.append(Op(4 * k + offset + p, w, j, kind, k, micro=w, version=version, stale=j == 0))
        updates += [Update(4 * k + 4, 1, k), Update(4 * k + 5, 0, k)]
        messages += [Message(4 * k + 2, 0, 1, 1, "partial", k), Message(4 * k + 3, 0, 1, 0, "partial", k),
                     Message(4 * k + 4, 1, 0, 1, "sum", k), Message(4 * k + 5, 1, 0, 0, "sum", k)]
        applies += [TableApply(4 * k + 4, w, 1, k) for w in (0, 1)] + [TableApply(4 * k + 5, w, 0, k) for w in (0, 1)]
    num_ticks = max(o.tick for o in ops) + 1
    keep = lambda rows: tuple(r for r in rows if r.tick < num_ticks)  # noqa: E731
    ops.sort(key=lambda o: (o.tick, o.device))
    return TimeTable("two-behind", 2, 2, steps, num_ticks, 2, 4, tuple(ops), tuple(updates), keep(messages), (0, 2),
                     1, (4, 8), applies=keep(applies), axis="data")


def test_a_table_reading_two_versions_back_runs_on_the_ring():
    """The table above on the ring (no engine change: the program says each worker stores 3 versions
    of a stage, its events the depth each op reads) equals a plain loop applying the same delayed
    gradients: step k's gradient, of the batch's mean loss, taken at (theta_0^(k-2), theta_1^k)
    (theta^0 before), updates both stages (SGD per stage)."""
    from cdpjax import optim
    from cdpjax.methods import cdp
    from cdpjax.models import cross_entropy
    from cdpjax.optim import apply_per_stage

    steps = 4
    program = lower_ring(two_behind_table(steps + 3))
    assert program.versions == 3 and max(e.version for e in program.events if isinstance(e, Compute)) == 2
    config = small_config("cdp-v2", stages=2, workers=2, cdp_impl="ring", global_batch_size=BATCH)
    method = cdp.make(context(config, {"data": 2}), "cdp-v2", two_behind_table(steps + 3))
    batches = random_batches(steps, BATCH)
    state = method.init(jax.random.key(0))
    for b in batches:
        state, _ = method.train_step(state, b)
    got = method.export(method.flush(state))[0]
    net, tx = method.net, optim.make(config)
    theta, _ = net.init(jax.random.key(0))
    opt = [tx.init(p) for p in theta]
    grad = jax.jit(jax.grad(lambda p, x, y: cross_entropy(net.apply(p, [{}] * 2, x, True)[0], y)))
    history = [theta]
    for k, b in enumerate(batches):
        read = [history[max(k - 2, 0)][0], history[k][1]]
        theta, opt = apply_per_stage(tx, theta, opt, grad(read, b["image"], b["label"]))
        history.append(theta)
    assert_trees_close(got, history[steps])
    one_behind, opt = [history[0]], [tx.init(p) for p in history[0]]  # two behind is not one behind
    for k, b in enumerate(batches):
        read = [one_behind[max(k - 1, 0)][0], one_behind[k][1]]
        one_behind.append(apply_per_stage(tx, one_behind[k], opt, grad(read, b["image"], b["label"])))
        opt = one_behind[-1][1]
        one_behind[-1] = one_behind[-1][0]
    assert max_diff(got, one_behind[steps]) > 1e-5


@pytest.mark.parametrize("step", [0, 3, 9])
def test_a_step_that_reads_differently_is_refused(step):
    """One op of one step (the first, a middle one, the last: every step of this table is whole)
    reading a version the other steps' same op does not (stage 0 three behind where the rest read
    two; at step 0, version 1, a read ahead of what the worker has applied) is refused in one line
    naming an op that differs (the period takes its depths from the last step, so where that is the
    odd one, another is named)."""
    table = two_behind_table(10)
    ops = list(table.ops)
    i = next(i for i, o in enumerate(ops) if o.step == step and o.device == 0 and o.kind == "F" and o.stage == 0)
    wrong = max(step - 3, 0) if step >= 3 else 1
    ops[i] = dataclasses.replace(ops[i], version=wrong)
    with pytest.raises(ConfigError, match=r"worker 0's F0 of step \d+ at tick \d+ reads version \d+") as refused:
        lower_ring(dataclasses.replace(table, ops=tuple(ops)))
    assert "\n" not in str(refused.value)
    lower_ring(table)  # the table as written lowers


# ------------------------------------------------------------- op kinds by their flags


def test_the_ring_runs_op_kinds_by_their_flags_not_their_letters():
    """cdp-v2's table with every forward renamed to a kind registered here under another name (the
    forward's flags): the ring lowers it to the same period but for the kind's name, and trains to
    the same parameters as the table with 'F' (the lowering and the engine read `OpKind`'s flags)."""
    from cdpjax import kinds as op_kinds
    from cdpjax.methods import cdp

    config = small_config("cdp-v2", stages=2, workers=2, cdp_impl="ring", global_batch_size=BATCH)
    own = table("cdp-v2", workers=2, stages=2)
    renamed = dataclasses.replace(own, ops=tuple(dataclasses.replace(o, kind="Fwd") if o.kind == "F" else o
                                                 for o in own.ops))
    fwd = dataclasses.replace(op_kinds.FORWARD, name="Fwd", after=lambda j, L: ("Fwd", j - 1) if j > 0 else None)
    batches = random_batches(3, BATCH)

    def trained(tbl):
        method = cdp.make(context(config, {"data": 2}), "cdp-v2", tbl)
        state = method.init(jax.random.key(0))
        for b in batches:
            state, _ = method.train_step(state, b)
        return method.export(method.flush(state))[0]

    with op_kinds.KINDS.temporarily("Fwd", fwd):
        period = ring_ticks(renamed)
        got = trained(renamed)
    want = ring_ticks(own)
    assert period == dataclasses.replace(want, ticks=tuple(
        dataclasses.replace(tk, ops=tuple(sorted(o._replace(kind="Fwd") if o.kind == "F" else o for o in tk.ops)))
        for tk in want.ticks))
    assert_trees_equal(got, trained(own))
