"""`Program.slots` (and the `slots` of `Program.summary`, which bench records and the README's
figures read) is derived from the buffers a program declares, whatever its engine."""
import pytest

from cdpjax.program import lower
from cdpjax.program.stage_axis import program_ticks
from cdpjax.timetable import table


@pytest.mark.parametrize("K,M", [(4, 8), (4, 2), (3, 6), (2, 5)])
def test_stash_rows_follow_the_schedules_rule(K, M):
    """GPipe keeps every micro-batch's input on stage 0 until the drain (M rows); 1F1B never more
    than min(M, K) (its warm-up forwards, then one retired per forward). With residuals carried
    the kept residuals follow that rule instead, and only the arriving input has a row."""
    for name, rows in (("gpipe", M), ("1f1b", min(M, K))):
        slots = lower(table(name, stages=K, microbatches=M, steps=3), "recompute").summary()["slots"]
        assert slots["acts"] == rows and "residuals" not in slots, (name, K, M, slots)
        slots = lower(table(name, stages=K, microbatches=M, steps=3), "carry").summary()["slots"]
        assert slots["residuals"] == rows and slots["acts"] == 1, (name, K, M, slots)


def test_stage_engine_slots_agree_with_its_own_ticks():
    """A second count: the engine's tick arrays number their rows themselves (`StageTicks.slots`);
    the declared buffers must say the same for each stash they declare."""
    for name in ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b"):
        program = lower(table(name, stages=4, microbatches=8, steps=3), "carry")
        declared = program.slots()
        assert declared, name
        for kind in ("acts", "cots", "residuals"):
            assert declared[kind] == program_ticks(program).slots[kind], (name, kind, declared)


def test_ring_and_zero_declare_no_slots():
    """The ring and cdp-zero keep each stage's input and cotangent in its own buffer: no slots (and
    no `slots` in their summary, as before it was derived)."""
    for name in ("cdp-v2", "cdp-zero"):
        program = lower(table(name, stages=4, workers=4, steps=3), "recompute")
        assert program.slots() == {} and "slots" not in program.summary(), name
