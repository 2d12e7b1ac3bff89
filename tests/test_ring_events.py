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

from cdpjax.layouts.cdp import cdp_table
from cdpjax.methods import ring
from cdpjax.program import Apply, Compute
from cdpjax.program.ring import lower_ring, op_order, program_period, ring_pool, ring_program_routing, ring_routing
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
    program = lower_ring(make())
    period = program_period(program)
    assert period == program.ticks  # every tick's ops, sums, hops, applies; live buffers, lags, newest
    routing, direct = ring_program_routing(program), ring_routing(program.ticks)
    for name in ("op_branch", "op_lag", "op_read", "op_write", "op_start", "apply_stage", "apply_lag", "apply_slot"):
        np.testing.assert_array_equal(getattr(routing, name), getattr(direct, name), err_msg=name)
    assert routing.op_kinds == direct.op_kinds and routing.names == direct.names
    lag, read, write, start = _direct_op_arrays(program.ticks, routing)
    for got, want in ((routing.op_lag, lag), (routing.op_read, read), (routing.op_write, write),
                      (routing.op_start, start)):
        np.testing.assert_array_equal(got, want)
    sizes = [5 + 3 * j for j in range(period.stages)]
    pool = ring_pool(period, routing, sizes)
    read, write = _direct_pool_offsets(program.ticks, pool)
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
    initial = whole.init(jax.random.key(0))["params"]
    trained = _trained(whole)["params"]
    assert max_diff(trained[2], initial[2]) > 1e-4
    frozen = _ring(lambda p: dataclasses.replace(p, events=tuple(e for e in p.events
                                                                 if not (isinstance(e, Apply) and e.stage == 2))))
    got = _trained(frozen)["params"]
    assert_trees_equal(got[2], initial[2])
    assert max_diff(got[0], initial[0]) > 1e-4  # the other stages trained


def test_a_program_without_a_workers_computes_trains_otherwise():
    """cdp-v2's program without worker 1's computes of the current step (lag 0): the parameters after
    three steps differ from the whole program's, which equal the registry's own ring build."""
    whole = _trained(_ring())
    missing = _trained(_ring(lambda p: dataclasses.replace(p, events=tuple(
        e for e in p.events if not (isinstance(e, Compute) and e.device == 1 and e.lag == 0)))))
    assert max_diff(missing["params"], whole["params"]) > 1e-4
    from helpers import build
    registry = build(small_config("cdp-v2", stages=STAGES, workers=WORKERS, cdp_impl="ring",
                                  global_batch_size=BATCH), {"data": WORKERS})
    assert_trees_close(_trained(registry)["params"], whole["params"])
