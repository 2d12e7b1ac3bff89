"""The papers' accuracy claims in miniature, on digits (seeded, 600 steps of the default config),
CDP run as users run it (the `ring`, 8 workers on 8 devices); and, since an accuracy within a point
of DP's would also be reached with no delay at all, the delay those runs have, shown on parameters."""
import jax
import pytest

from cdpjax import train
from cdpjax.config import default_config
from cdpjax.layouts.cdp import cdp_table
from cdpjax.methods import cdp
from helpers import assert_trees_close, build, context, digits_batches, max_diff, params, run


def _accuracy(tmp_path, method, **overrides):
    c = default_config()
    c.method, c.eval_every, c.checkpoint_every = method, 0, 0
    for k, v in overrides.items():
        c[k] = v
    return train.train(c, str(tmp_path / method), progress=False)["test_accuracy"]


@pytest.mark.heavy  # CI: the ring equals simulate (tests/test_cdp.py), which equals dp with the delay removed
def test_cdp_matches_dp_on_digits(tmp_path):
    """CDP-v1 and CDP-v2 on the ring reach test accuracy within 1 point of DP after the same steps."""
    dp = _accuracy(tmp_path, "dp")
    v1 = _accuracy(tmp_path, "cdp-v1", cdp_impl="ring")
    v2 = _accuracy(tmp_path, "cdp-v2", cdp_impl="ring")
    assert dp >= 0.97
    assert abs(v1 - dp) <= 0.01 + 1e-9, (dp, v1)
    assert abs(v2 - dp) <= 0.01 + 1e-9, (dp, v2)


def test_cdp_v1_delay_is_real_on_the_ring():
    """With the accuracy runs' sizes (the default config: 8 workers, 4 stages, batch 128), 5 steps
    of CDP-v1 on the ring (then its flush) leave parameters that differ from DP's far beyond float
    noise, by a few percent of how far DP's moved, while the same CDP-v1 with the delay-free table
    (dp's timing: every pair reads the current version; `simulate`, the ring realising only
    point-to-point tables) gives DP's. The noise floor is that second difference."""
    c = default_config()
    c.eval_every = c.checkpoint_every = 0
    batches = digits_batches(5, c.global_batch_size)

    def configured(method, **kw):
        out = c.copy_and_resolve_references()
        out.method = method
        for k, v in kw.items():
            out[k] = v
        return out

    dp = build(configured("dp"), {"data": 8})
    ring = build(configured("cdp-v1", cdp_impl="ring"), {"data": 8})
    assert ring.table.stale.all()  # v1: every (worker, stage) reads the previous version
    free_config = configured("cdp-v1", cdp_impl="simulate")
    free = cdp.make(context(free_config, {"data": 8}), "cdp-v1", cdp_table("dp", 8, 4))
    assert not free.table.stale.any()
    reference = params(dp, run(dp, batches))
    delay_free = params(free, run(free, batches))
    assert_trees_close(delay_free, reference)
    noise = max_diff(delay_free, reference)
    delayed = max_diff(params(ring, run(ring, batches)), reference)
    moved = max_diff(reference, params(dp, dp.init(jax.random.key(0))))
    print(f"after 5 steps, dp moved {moved:.2e}; cdp-v1 on the ring differs from dp by {delayed:.2e}, "
          f"the delay-free table by {noise:.2e}")
    assert delayed > 0.01 * moved and delayed > 1e-3 and delayed > 100 * noise, (delayed, moved, noise)


@pytest.mark.heavy  # CI: ppll equals local (tests/test_local_ppll.py)
def test_local_and_ppll_match_each_other_and_come_close_to_e2e(tmp_path):
    """PPLL's claims on digits: ppll reaches exactly local learning's accuracy (it computes the same
    parameters), and both are within 2 points of end-to-end backprop."""
    e2e = _accuracy(tmp_path, "e2e")
    local = _accuracy(tmp_path, "local")
    c = default_config()
    c.method, c.eval_every, c.checkpoint_every, c.mesh = "ppll", 0, 0, {"stage": 4}
    ppll = train.train(c, str(tmp_path / "ppll"), progress=False, devices=jax.devices()[:4])["test_accuracy"]
    assert ppll == pytest.approx(local, abs=1e-9)
    assert abs(local - e2e) <= 0.02 + 1e-9, (e2e, local)
