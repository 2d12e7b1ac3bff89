"""Rings side by side: CDP on more devices than its table takes workers.

Claims: on 8 devices, D rings of N workers (N * D = 8) each fed its share of every global batch,
their completed gradient sums added over the rings once per stage and step, end where CDP's
simulation of N workers ends when worker w's micro-batch is the union of worker w's
micro-batches in every ring (the same table; each ring's sum then is a share of the whole
batch's); a worker count the table does not take is refused naming the rings that fit, and with
no worker count the ring fills the host with the largest ring the table takes.
"""
import jax
import numpy as np
import pytest

from cdpjax.config import ConfigError
from cdpjax.methods import cdp
from helpers import assert_trees_close, max_diff, params
from test_cdp import BATCH, STEPS, batches, build, context


def simulate_batch(batch: dict, rings: int, workers: int) -> dict:
    """The batch as simulate's N workers must see it: the trainer's `data` sharding gives device k
    rows [k m, (k + 1) m) (m = B / (D N)), and device k is worker k mod N of ring k // N; simulate
    gives worker w rows [w B / N, (w + 1) B / N): so worker w's rows are those of devices w, N + w,
    2N + w, ... in that order."""
    m = BATCH // (rings * workers)
    order = [(d * workers + w) * m + r for w in range(workers) for d in range(rings) for r in range(m)]
    return {k: np.asarray(v)[np.asarray(order)] for k, v in batch.items()}


def train(m, feed):
    state = m.init(jax.random.key(0))
    for b in feed:
        state, metrics = m.train_step(state, b)
        assert np.isfinite(float(metrics["loss"]))
    return m.flush(state) if m.flush is not None else state


@pytest.mark.parametrize("rings,workers,method,rule,ticks,residuals", [
    (2, 4, "cdp-v2", "cdp-v2", "whole", "recompute"), (4, 2, "cdp-v2", "cdp-v2", "whole", "recompute"),
    pytest.param(2, 4, "cdp-v1", "cdp-v2", "whole", "recompute", marks=pytest.mark.heavy),
    pytest.param(2, 4, "cdp-v2", "paper-code", "whole", "recompute", marks=pytest.mark.heavy),
    pytest.param(2, 4, "cdp-v2", "cdp-v2", "split", "carry", marks=pytest.mark.heavy),
    pytest.param(2, 4, "cdp-v2", "cdp-v2", "paired", "carry", marks=pytest.mark.heavy)])
def test_rings_over_data_equal_simulate_of_the_union_batches(rings, workers, method, rule, ticks, residuals):
    assert jax.device_count() == 8 == rings * workers
    ring = cdp.make(context(8, method=method, cdp_impl="ring", workers=workers, stages=4, cdp_rule=rule,
                            cdp_ticks=ticks, residuals=residuals), method)
    assert (ring.workers, ring.devices, ring.report["rings"]) == (workers, 8, rings)
    sim = build(method, "simulate", workers=workers, devices=2, stages=4, rule=rule, ticks=ticks)
    np.testing.assert_array_equal(ring.stale, sim.stale)
    expected = params(sim, train(sim, [simulate_batch(b, rings, workers) for b in batches()[:STEPS]]))
    got = params(ring, train(ring, batches()[:STEPS]))
    assert_trees_close(got, expected)
    # Which rows a worker gets matters where workers read different versions (cdp-v2; under v1's rule
    # every worker reads the previous version, so only the whole batch's sum does): fed the rows
    # unpermuted, simulate ends elsewhere.
    if len({tuple(row) for row in np.asarray(sim.stale)}) > 1:
        alone = params(sim, train(sim, batches()[:STEPS]))
        assert max_diff(alone, expected) > 1e-6


def test_rings_add_each_stage_sum_once_per_step():
    """The compiled step of 2 rings of 4: beside the metric scalars' psum, each stage's completed sum
    all-reduced once, on its own, over the 2 rings (groups of 2 devices, worker w of ring 0 with
    worker w of ring 1); the ring's own messages unchanged (a ring's bytes)."""
    from cdpjax import bench
    from test_cdp import collective_sizes

    m = cdp.make(context(8, method="cdp-v2", cdp_impl="ring", workers=4, stages=4), "cdp-v2")
    state = m.init(jax.random.key(0))
    hlo = m.train_step.lower(state, batches()[0]).compile().as_text()
    stage = [sum(x.size for x in jax.tree.leaves(p)) for p in m.export(state)[0]]
    reduces = collective_sizes(hlo, "all-reduce")
    # each stage's sum once, each its own all-reduce at its tick (untied, XLA merged them into one
    # at the last, holding every sum until then); the rest: the metric scalars
    assert sorted(r for r in reduces if r > 8) == sorted(stage)
    groups = [line.split("replica_groups=", 1)[1].split("}}", 1)[0] for line in hlo.splitlines()
              if " all-reduce(" in line and "replica_groups=" in line]
    assert "{{0,4},{1,5},{2,6},{3,7" in groups, groups
    permuted = bench.traffic(hlo, 8)["by_kind"]["collective-permute"] / 8
    assert permuted == pytest.approx(2 * 3 / 4 * 4 * sum(stage))  # a ring all-reduce's bytes, 2(N-1)/N


def test_ring_worker_counts_fill_the_host_or_name_the_rings_that_fit():
    # L = 2, whole ticks: a step is 4 ticks, so 8 workers cannot be one ring; with no worker count
    # the ring takes the largest worker count dividing both 8 devices and the 4 ticks.
    m = cdp.make(context(8, method="cdp-v2", cdp_impl="ring", stages=2), "cdp-v2")
    assert (m.workers, m.devices, m.report["rings"]) == (4, 8, 2)
    with pytest.raises(ConfigError, match=r"workers=8 does not divide the 4 ticks.*"
                                          r"workers=4: \{'data': 2, 'worker': 4\}, workers=2: \{'data': 4, "
                                          r"'worker': 2\}"):
        cdp.make(context(8, method="cdp-v2", cdp_impl="ring", workers=8, stages=2), "cdp-v2")
    with pytest.raises(ConfigError, match="workers must divide mesh.data=8"):
        cdp.make(context(8, method="cdp-v2", cdp_impl="ring", workers=3, stages=3, global_batch_size=48), "cdp-v2")


def test_64_devices_at_8_stages_run_rings():
    """By hand: L = 8, whole ticks: a step is 16 ticks, so a ring takes 1, 2, 4, 8 or 16 workers, all
    dividing 64; the default is the largest (4 rings of 16); split ticks (24) take 2, 4 or 8 of them;
    one worker is dp, never the default."""
    assert cdp.ring_fits(64, 8, "whole") == [1, 2, 4, 8, 16]
    assert cdp.ring_workers(64, 8, "whole") == 16
    assert cdp.ring_workers(64, 8, "split") == 8
    assert cdp.ring_workers(8, 3, "split") == 8  # none of 2+ fits 9 ticks on 8 devices: all of them, refused
    with pytest.raises(ConfigError, match="workers=64 does not divide the 16 ticks.*workers=16: "
                                          r"\{'data': 4, 'worker': 16\}.*workers=8: \{'data': 8, 'worker': 8\}"):
        cdp.check_ring_workers(64, 64, 64, 8, "whole")
