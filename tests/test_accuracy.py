"""The papers' accuracy claims in miniature, on digits (seeded, 600 steps of the default config)."""
import pytest

from cdpjax import train
from cdpjax.config import default_config


def _accuracy(tmp_path, method, **overrides):
    c = default_config()
    c.method, c.eval_every, c.checkpoint_every = method, 0, 0
    for k, v in overrides.items():
        c[k] = v
    return train.train(c, str(tmp_path / method), progress=False)["test_accuracy"]


def test_cdp_matches_dp_on_digits(tmp_path):
    """CDP-v1 and CDP-v2 reach test accuracy within 1 point of DP after the same steps."""
    dp = _accuracy(tmp_path, "dp")
    v1 = _accuracy(tmp_path, "cdp-v1", cdp_impl="simulate")
    v2 = _accuracy(tmp_path, "cdp-v2", cdp_impl="simulate")
    assert dp >= 0.97
    assert abs(v1 - dp) <= 0.01 + 1e-9, (dp, v1)
    assert abs(v2 - dp) <= 0.01 + 1e-9, (dp, v2)


def test_local_and_ppll_match_each_other_and_come_close_to_e2e(tmp_path):
    """PPLL's claims on digits: ppll reaches exactly local learning's accuracy (it computes the same
    parameters), and both are within 2 points of end-to-end backprop."""
    import jax

    e2e = _accuracy(tmp_path, "e2e")
    local = _accuracy(tmp_path, "local")
    c = default_config()
    c.method, c.eval_every, c.checkpoint_every, c.mesh = "ppll", 0, 0, {"stage": 4}
    ppll = train.train(c, str(tmp_path / "ppll"), progress=False, devices=jax.devices()[:4])["test_accuracy"]
    assert ppll == pytest.approx(local, abs=1e-9)
    assert abs(local - e2e) <= 0.02 + 1e-9, (e2e, local)
