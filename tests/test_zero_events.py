"""cdp-zero's period read back from its program's events (`zero_program_period`, what its runtimes run)
is the period its lowering folded from the table (`zero_ticks`), for every rule and tick kind, unrolled
and scanned; on a program written by hand, the period worked out by hand; and a program whose events are
changed trains as the changed events say."""
import dataclasses

import jax
import pytest

from cdpjax.layouts.cdp_zero import ZERO_RULES, cdp_zero_table
from cdpjax.methods import cdp_zero
from cdpjax.program import Placement, Program
from cdpjax.program.events import Apply, Compute, Gather
from cdpjax.program.zero import PERIODS, ZeroApply, ZeroOp, ZeroTick, ZeroTicks, lower_zero, zero_program_period, \
    zero_ticks
from cdpjax.program.zero import Gather as ZeroGather
from helpers import assert_trees_equal, build, max_diff, params, random_batches, run, small_config

# every size whose table exists up to 8 workers and 5 stages (N = 2, 4, 8; N < L, N = L, N > L), and
# N = L = 8 and N = 8, L = 16 / N = 16, L = 8 for each tick kind
SIZES = [(n, l, ticks) for ticks, T in (("whole", 2), ("split", 3)) for l in range(1, 6)
         for n in range(1, T * l + 1) if (T * l) % n == 0 and n <= 8]
SIZES += [(n, l, "paired") for l in range(1, 6) for n in range(1, -(-l // 2) + l + 1)]
SIZES += [(8, 8, ticks) for ticks in ("whole", "split", "paired")] + [(8, 16, "whole"), (16, 8, "whole")]


@pytest.mark.parametrize("rule", ZERO_RULES)
@pytest.mark.parametrize("period", PERIODS)
def test_period_from_events_is_the_lowerings(rule, period):
    for N, L, ticks in SIZES:
        table = cdp_zero_table(N, L, rule=rule, ticks=ticks)
        assert zero_program_period(lower_zero(table, period=period)) == zero_ticks(table), (N, L, ticks)


def _program(events, versions=2, lag=1) -> Program:
    return Program(method="hand", engine="ring", period=4, lag=lag, devices=2, microbatches=1, kinds=("F", "B"),
                   split_backward=False, residuals="recompute", versions=versions, grads_in_flight=True,
                   placement=Placement(((0,), (1,)), (0, 0), (0, 1), 2, 2), buffers=(), events=tuple(events))


# Two workers, two stages, four ticks; worker 1 runs worker 0's step two ticks later (its backward of stage 0
# in the next call: lag 1). Worker 0: tick 0 gathers both stages and runs F0 and F1 (paired), tick 1 B1 (the
# last stage's F and B one visit), tick 2 gathers stage 0 and runs B0. Each gradient op (B) sends its pieces;
# worker 0's are its stage's first of the step (it starts the sums). Stage 1 applies after worker 1's B1
# (tick 3), stage 0 after its B0 (tick 0 of the next call).
HAND = [Gather(0, 0, 0, 2, 0, 0), Gather(0, 0, 1, 2, 0, 0), Compute(0, 0, "F", 0), Compute(0, 0, "F", 1),
        Compute(1, 0, "B", 1, starts_sum=True),
        Gather(2, 0, 0, 2, 0, 0), Compute(2, 0, "B", 0, starts_sum=True),
        Gather(2, 1, 0, 2, 0, 0), Gather(2, 1, 1, 2, 0, 0), Compute(2, 1, "F", 0), Compute(2, 1, "F", 1),
        Compute(3, 1, "B", 1), Apply(3, 0, 1, 2), Apply(3, 1, 1, 2),
        Gather(0, 1, 0, 2, 1, 1), Compute(0, 1, "B", 0, version=1, lag=1), Apply(0, 0, 0, 2, 1), Apply(0, 1, 0, 2, 1)]


def test_period_of_a_program_written_by_hand():
    """Relay rows by hand: each worker's F1 visit (two ticks) overlaps its F0 visit (one tick, the same
    start): stage 0's visit takes row 0, stage 1's row 1; the B0 visit, alone in its tick, row 0. Worker 1's
    B0 visit starts at tick 0 of the next call (4 on its step's timeline), so its gather comes last in tick 0."""
    want = ZeroTicks(workers=2, stages=2, versions=2, relay_rows=2, max_lag=1, ticks=(
        ZeroTick(gathers=(ZeroGather(0, 0, 0, 0), ZeroGather(1, 0, 0, 1), ZeroGather(0, 1, 1, 0)),
                 ops=(ZeroOp(0, "F", 0, 0, 0), ZeroOp(0, "F", 1, 0, 1), ZeroOp(1, "B", 0, 1, 0, gradient=True)),
                 applies=(ZeroApply(0, 1),)),
        ZeroTick(ops=(ZeroOp(0, "B", 1, 0, 1, gradient=True, starts=True),)),
        ZeroTick(gathers=(ZeroGather(0, 0, 0, 0), ZeroGather(0, 1, 0, 0), ZeroGather(1, 1, 0, 1)),
                 ops=(ZeroOp(0, "B", 0, 0, 0, gradient=True, starts=True), ZeroOp(1, "F", 0, 0, 0),
                      ZeroOp(1, "F", 1, 0, 1))),
        ZeroTick(ops=(ZeroOp(1, "B", 1, 0, 1, gradient=True),), applies=(ZeroApply(1, 0),))))
    assert zero_program_period(_program(HAND)) == want
    # the event order does not matter; what the events say does
    assert zero_program_period(_program(reversed(HAND))) == want
    unstarted = [dataclasses.replace(e, starts_sum=False) if isinstance(e, Compute) else e for e in HAND]
    assert zero_program_period(_program(unstarted)) != want



def test_a_compute_without_its_gather_or_a_gather_without_its_compute_is_refused():
    ungathered = [e for e in HAND if e != Gather(0, 0, 0, 2, 0, 0)]  # worker 0's F0 at tick 0
    with pytest.raises(ValueError, match=r"^hand: Compute\(tick=0, device=0, kind='F', stage=0.* reads a stage its "
                                         r"worker never gathered before it"):
        zero_program_period(_program(ungathered))
    idle = [e for e in HAND if e != Compute(2, 0, "B", 0, starts_sum=True)]  # worker 0's B0 at tick 2
    with pytest.raises(ValueError, match=r"^hand: Gather\(tick=2, device=0, stage=0.* starts a visit with no Compute"):
        zero_program_period(_program(idle))


@pytest.mark.parametrize("period", PERIODS)
def test_a_program_without_a_stages_applies_never_updates_it(period, monkeypatch):
    """cdp-zero's program (N = 2, L = 4) with every `Apply` of stage 2 taken out: after three steps and a
    flush stage 2 is its initial value, while the other stages trained: the engine runs the events."""
    def without_stage_2s_applies(*args, **kw):
        p = lower_zero(*args, **kw)
        return dataclasses.replace(p, events=tuple(e for e in p.events if not (isinstance(e, Apply) and e.stage == 2)))

    monkeypatch.setattr(cdp_zero, "lower_zero", without_stage_2s_applies)
    config = small_config("cdp-zero", stages=4, workers=2, zero_period=period, global_batch_size=16)
    m = build(config, {"data": 2})
    initial = params(m, m.init(jax.random.key(0)))
    got = params(m, run(m, random_batches(3, 16)))
    assert_trees_equal(got[2], initial[2])
    assert min(max_diff(got[j], initial[j]) for j in (0, 1, 3)) > 1e-4
