"""`cdpjax bench` and the speedup model: fields present, HLO parsed right, predictions match closed forms."""
import json

import numpy as np
import pytest

from cdpjax import bench, speedup, timetable
from cdpjax.errors import ConfigError
from cdpjax.layouts.cdp import cdp_table
from cdpjax.layouts.gpipe import gpipe_table
from cdpjax.layouts.ppll import ppll_table
from cdpjax.cli import main
from cdpjax.timetable import table


def test_collective_parser_reads_shapes_and_tuples():
    hlo = """
  %all-reduce.1 = f32[128,10]{1,0} all-reduce(f32[128,10]{1,0} %p), channel_id=1, to_apply=%sum
  %ar2 = (f32[4]{0}, bf16[8]{0}) all-reduce(f32[4]{0} %a, bf16[8]{0} %b), channel_id=2
  %collective-permute.3 = f32[2,3]{1,0} collective-permute(f32[2,3]{1,0} %x), source_target_pairs={{0,1}}
  %add = f32[2] add(f32[2] %a, f32[2] %b)
"""
    out = bench.collectives(hlo)
    assert out["all-reduce"] == {"count": 2, "bytes": 128 * 10 * 4 + 16 + 16, "max_bytes": 5120}
    assert out["collective-permute"] == {"count": 1, "bytes": 24, "max_bytes": 24}
    assert out["all-gather"]["count"] == 0


def test_traffic_counts_each_transfer_as_often_as_it_runs():
    """Bytes really sent: a permute once per source-target pair, times the trip counts of the
    loops around it (nested: multiplied); an all-reduce 2(n-1)/n of its buffer per device."""
    hlo = """
%inner_body (p: (s32[], f32[16])) -> (s32[], f32[16]) {
  %x = f32[16]{0} get-tuple-element(%p), index=1
  %cp.1 = f32[16]{0} collective-permute(f32[16]{0} %x), channel_id=1, source_target_pairs={{2,3}}
}
%outer_body (p.1: (s32[], f32[16])) -> (s32[], f32[16]) {
  %y = f32[16]{0} get-tuple-element(%p.1), index=1
  %cp.2 = f32[16]{0} collective-permute(f32[16]{0} %y), channel_id=2, source_target_pairs={{0,1},{1,2}}
  %w.1 = (s32[], f32[16]{0}) while(%t), condition=%c1, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
}
ENTRY %main (a: f32[16]) -> f32[16] {
  %w.2 = (s32[], f32[16]{0}) while(%t2), condition=%c2, body=%outer_body, backend_config={"known_trip_count":{"n":"5"}}
  %ar = f32[16]{0} all-reduce(f32[16]{0} %z), channel_id=3, replica_groups={{0,1,2,3}}, to_apply=%sum
  %cp.3 = f32[4]{0} collective-permute(f32[4]{0} %z2), channel_id=4, source_target_pairs={{3,0}}
}
"""
    out = bench.traffic(hlo, devices=4)
    permute = 64 * 2 * 5 + 64 * 1 * 5 * 3 + 16 * 1  # outer body 5 times, inner 15 times, entry once
    allreduce = 64 * 2 * 3 / 4 * 4  # every device sends 2(n-1)/n of it
    assert out["by_kind"]["collective-permute"] == permute and out["by_kind"]["all-reduce"] == allreduce
    assert out["per_device_bytes"] == (permute + allreduce) / 4 and out["largest_permute_bytes"] == 64


def test_traffic_counts_the_ring_sends_by_tick_once_a_period():
    """The scanned ring's sends: a switch over the loop's ticks (named `SENDS_BY_TICK`), branch t
    at tick t, so each branch runs once per pass of the loop (4 ticks: 4 branches), not 4 times;
    an ordinary conditional in the same loop counts each branch every tick (an upper bound)."""
    from cdpjax.program.ring import SENDS_BY_TICK

    branches = "\n".join(f"""%tick_{t} (p.{t}: f32[16]) -> f32[16] {{
  %cp.{t} = f32[16]{{0}} collective-permute(f32[16]{{0}} %p.{t}), channel_id={t}, source_target_pairs={pairs}
}}""" for t, pairs in enumerate(["{{0,1}}", "{{0,1},{1,2}}", "{{2,3}}", "{{3,0},{1,2},{0,1}}"]))
    by_tick = ("  %c = f32[16]{0} conditional(s32[] %t, f32[16]{0} %x, f32[16]{0} %x, f32[16]{0} %x, f32[16]{0} %x), "
               "branch_computations={%tick_0, %tick_1, %tick_2, %tick_3}, "
               f'metadata={{op_name="jit(f)/while/body/{SENDS_BY_TICK}/cond"}}')
    hlo = f"""{branches}
%other (q: f32[4]) -> f32[4] {{
  %cp.9 = f32[4]{{0}} collective-permute(f32[4]{{0}} %q), channel_id=9, source_target_pairs={{{{0,1}}}}
}}
%body (p: (s32[], f32[16])) -> (s32[], f32[16]) {{
{by_tick}
  %d = f32[4]{{0}} conditional(s32[] %i, f32[4]{{0}} %y), branch_computations={{%other}}
}}
ENTRY %main (a: f32[16]) -> f32[16] {{
  %w = (s32[], f32[16]{{0}}) while(%t2), condition=%cnd, body=%body, backend_config={{"known_trip_count":{{"n":"4"}}}}
}}
"""
    out = bench.traffic(hlo, devices=4)
    assert out["by_kind"]["collective-permute"] == 64 * (1 + 2 + 1 + 3) + 16 * 1 * 4


def test_bench_records_e2e_and_dp(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--methods", "e2e,dp", "--repeats", "2", "--json", str(out),
                 "--config.method=dp"]) == 0
    table = capsys.readouterr().out
    assert "x first" in table and "dp" in table
    e2e, dp = json.loads(out.read_text())
    for r in (e2e, dp):
        for key in ("compile_seconds", "step_seconds", "images_per_second", "memory", "collectives"):
            assert key in r
        assert {"temp_bytes", "argument_bytes", "output_bytes"} <= set(r["memory"])
    assert e2e["devices"] == 1 and dp["devices"] == 8
    # the default MLP counted by hand: 64 -> 128 -> 128 -> 128 -> 10, weights and biases, float32
    mlp_bytes = 4 * ((64 * 128 + 128) + 2 * (128 * 128 + 128) + (128 * 10 + 10))
    assert mlp_bytes == 170_536 and e2e["param_bytes"] == dp["param_bytes"] == mlp_bytes
    assert e2e["collectives"]["all-reduce"]["count"] == 0
    # dp all-reduces the whole model (plus two scalars) once per step.
    assert dp["collectives"]["all-reduce"]["bytes"] >= dp["param_bytes"]
    assert dp["collectives"]["all-reduce"]["max_bytes"] >= 0.9 * dp["param_bytes"]
    # Real-byte activation figures beside the unit ones, what is really sent, the memory model.
    for r in (e2e, dp):
        assert {"peak", "mean", "peak_bytes", "mean_bytes", "device_peak_bytes"} <= set(r["activation_total"])
        model = r["memory_model"]
        assert {"parameters", "optimizer_state", "gradients_in_flight", "activations_in_flight", "batch",
                "total"} <= set(model["arguments"])
        assert model["arguments"]["parameters"] == r["param_bytes"]
        # the model's arguments are XLA's within 10% (parameters, momentum, batch, BatchNorm state)
        assert abs(model["arguments"]["total"] - r["memory"]["argument_bytes"]) <= 0.1 * r["memory"]["argument_bytes"]
    assert e2e["sent_bytes_per_device_per_step"] == 0
    assert dp["sent_bytes_per_device_per_step"] == pytest.approx(2 * 7 / 8 * mlp_bytes, rel=0.05)


def test_bench_refuses_unknown_method(capsys):
    assert main(["bench", "--methods", "e2e,warp-drive"]) == 2
    assert "unknown method 'warp-drive'" in capsys.readouterr().err


UNIFORM = speedup.StageCosts((1.0,) * 4, (2.0,) * 4, (1.0,) * 4, (1.0,) * 4)


@pytest.mark.parametrize("microbatches", [1, 2, 4, 8])
def test_gpipe_prediction_is_the_bubble_formula(microbatches):
    """With free transfers and balanced stages GPipe's speedup is M*K/(M+K-1)."""
    for model in speedup.MODELS:  # a forward tick or a backward tick: lockstep loses nothing here
        r = speedup.simulate(gpipe_table(4, microbatches, 5), UNIFORM, 1e15, model=model)
        assert r["speedup"] == pytest.approx(microbatches * 4 / (microbatches + 3)) and r["model"] == model


def test_ppll_and_cdp_predictions():
    ppll = speedup.simulate(ppll_table(4, 24), UNIFORM, 1e15, model="async")
    assert ppll["speedup"] == pytest.approx(4.0)  # no bubble in steady state
    # an imbalanced stage sets the pace of the pipeline
    slow = speedup.StageCosts((1.0, 1.0, 3.0, 1.0), (2.0,) * 4, (1.0,) * 4, (1.0,) * 4)
    assert speedup.simulate(ppll_table(4, 24), slow, 1e15, model="async")["step_seconds"] == pytest.approx(5.0)
    # dp pays its all-reduce on the critical path; cdp-v1 hides the relay behind the delay
    dp = speedup.simulate(cdp_table("dp", 4, 4, 6), UNIFORM, 1.0, model="async")
    v1 = speedup.simulate(cdp_table("cdp-v1", 4, 4, 6), UNIFORM, 1.0, model="async")
    assert dp["step_seconds"] == pytest.approx(12.0 + 2 * 3 / 4 * 4)
    assert v1["step_seconds"] == pytest.approx(12.0)


def test_lockstep_model_on_a_two_worker_cdp_table():
    """cdp-v2, N = L = 2: worker 1 starts 2L/N = 2 ticks after worker 0, so every steady tick
    pairs one worker's forward with the other's backward, and the tick lasts as long as the
    slower of the two plus the largest gradient message sent at its end. Stage costs F = (1, 2),
    B = (3, 5), gradient bytes (2, 2) at 4 bytes/s (0.5 s a message). One period, by hand:
      tick 0: w0 F0, w1 B1, w1's completed sum of stage 1 to w0  -> max(1, 5) + 0.5 = 5.5
      tick 1: w0 F1, w1 B0, the sum of stage 0                   -> max(2, 3) + 0.5 = 3.5
      tick 2: w0 B1, w1 F0, w0's partial of stage 1 to w1        -> max(5, 1) + 0.5 = 5.5
      tick 3: w0 B0, w1 F1, the partial of stage 0               -> max(3, 2) + 0.5 = 3.5
    18 s a step, where the asynchronous model lets each worker run its 11 s of ops back to back.
    dp in lockstep: F0, F1, B1, B0 on both workers at once (1 + 2 + 5 + 3 = 11) and a ring
    all-reduce of both stages, 2(N-1)/N x 4 bytes / 4 = 1 s: 12 s. One device runs both
    workers' ops, 2 x 11 = 22 s."""
    costs = speedup.StageCosts((1.0, 2.0), (3.0, 5.0), (1.0, 1.0), (2.0, 2.0))
    ring = speedup.simulate(cdp_table("cdp-v2", 2, 2, 6), costs, 4.0, model="lockstep")
    assert ring["step_seconds"] == pytest.approx(5.5 + 3.5 + 5.5 + 3.5) and ring["model"] == "lockstep"
    assert ring["sequential_step_seconds"] == pytest.approx(22.0) and ring["speedup"] == pytest.approx(22 / 18)
    assert speedup.simulate(cdp_table("cdp-v2", 2, 2, 6), costs, 1e15, model="async")["step_seconds"] == \
        pytest.approx(11.0)
    assert speedup.simulate(cdp_table("dp", 2, 2, 6), costs, 4.0)["step_seconds"] == pytest.approx(12.0)


def test_lockstep_model_costs_b_and_w_apart():
    """zb-h1 (K = 2, M = 4) costs B at the input backward and W at the weight gradient, 1F1B's B
    at the whole backward. Its ticks, from ZB-H1's orders (device 0: F0 F1 . B0 W0 F2 B1 W1 F3 B2
    W2 B3 W3; device 1: . F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3) with F = 1, B = 0.5, W = 1.5, by
    hand: 1, 1, .5, 1, 1.5, 1.5, 1, 1.5, 1.5, 1, 1.5, 1.5, 1.5 = 16; 1F1B's (device 0: F0 F1 . B0
    F2 B1 F3 B2 . B3) with the whole backward, 2: 1, 1, then eight ticks holding a B, 18. The work
    of one step is the same, 2 x 4 x (1 + 2) = 24, whichever way the backward is cut."""
    costs = speedup.StageCosts((1.0,) * 2, (2.0,) * 2, (1.0,) * 2, (1.0,) * 2, (), (0.5,) * 2, (1.5,) * 2)
    zb = speedup.simulate(table("zb-h1", stages=2, microbatches=4, steps=1), costs, 1e15)
    ofob = speedup.simulate(table("1f1b", stages=2, microbatches=4, steps=1), costs, 1e15)
    assert zb["step_seconds"] == pytest.approx(16.0) and ofob["step_seconds"] == pytest.approx(18.0)
    assert zb["sequential_step_seconds"] == ofob["sequential_step_seconds"] == pytest.approx(24.0)
    starts = speedup.lockstep_starts(table("zb-h1", stages=2, microbatches=4, steps=1), costs)
    assert list(starts[:6]) == pytest.approx([0, 1, 2, 2.5, 3.5, 5])
    without = speedup.StageCosts((1.0,) * 2, (2.0,) * 2, (1.0,) * 2, (1.0,) * 2)  # no B/W measured apart
    with pytest.raises(ConfigError, match="backward_input"):
        speedup.simulate(table("zb-h1", stages=2, microbatches=4, steps=1), without, 1e15)
    with pytest.raises(ConfigError, match="lockstep or async"):
        speedup.simulate(table("zb-h1", stages=2, microbatches=4, steps=1), costs, 1e15, model="eager")


def test_uniform_costs_by_kind():
    """`F=1,B=2,W=1`: the whole backward 2, its weight half 1 and so its input half 1; W left out:
    half the backward each; B and W from their fields where given."""
    c = speedup.uniform_costs({"F": 1, "B": 2, "W": 0.5}, 3)
    assert (c.forward, c.backward, c.backward_input, c.backward_weight) == ((1.0,) * 3, (2.0,) * 3, (1.5,) * 3,
                                                                            (0.5,) * 3)
    c = speedup.uniform_costs({"F": 1, "B": 3}, 1)
    assert (c.backward_input, c.backward_weight) == ((1.5,), (1.5,))
    c = speedup.uniform_costs({"forward": 1, "backward_input": 1, "backward_weight": 2}, 1)
    assert c.backward == (3.0,)
    with pytest.raises(ConfigError, match="give F, B, W"):
        speedup.uniform_costs({"F": 1, "X": 2}, 1)


def test_measured_costs_split_the_backward():
    """measure_stage_costs times the backward whole and in its halves, recomputing the forward or
    from kept residuals, and says which: every field is there for every stage, each a positive time."""
    from cdpjax import config as cfg_lib, data, models

    c = cfg_lib.default_config()
    c.model, c.model_kwargs, c.stages = "mlp", {"width": 16}, 2
    ds = data.build(c)
    net = models.build(c, ds.image_shape, ds.num_classes)
    for residuals in ("recompute", "carry"):
        costs = speedup.measure_stage_costs(net, 8, repeats=1, residuals=residuals)
        assert costs.residuals == residuals
        for field in ("forward", "backward", "backward_input", "backward_weight"):
            assert len(getattr(costs, field)) == 2 and min(getattr(costs, field)) > 0, field
    with pytest.raises(ConfigError, match="residuals"):
        speedup.measure_stage_costs(net, 8, repeats=1, residuals="keep")


def test_ops_timed_together_run_on_every_device_at_once():
    """calibrate='together' times an op on K devices at once, each on its own copy of the inputs: the
    result has one row per device, lies on K devices, and each row is the op on one device."""
    import jax.numpy as jnp

    run, stack = speedup._on_devices(lambda a, b: a @ b + 1.0, 2)
    a, b = jnp.arange(6.0).reshape(2, 3), jnp.ones((3, 4))
    out = run(*stack(a, b))
    assert out.shape == (2, 2, 4) and len(out.sharding.device_set) == 2
    np.testing.assert_allclose(out[1], np.arange(6.0).reshape(2, 3) @ np.ones((3, 4)) + 1.0)
    with pytest.raises(ConfigError, match="needs 99 devices"):
        speedup._on_devices(lambda a: a, 99)

    from cdpjax import config as cfg_lib, data, models

    c = cfg_lib.default_config()
    c.model, c.model_kwargs, c.stages = "mlp", {"width": 16}, 2
    ds = data.build(c)
    net = models.build(c, ds.image_shape, ds.num_classes)
    for residuals in ("recompute", "carry"):
        costs = speedup.measure_stage_costs(net, 8, repeats=1, residuals=residuals, together=2)
        for field in ("forward", "backward", "backward_input", "backward_weight"):
            assert len(getattr(costs, field)) == 2 and min(getattr(costs, field)) > 0, field
    c.method, c.mesh = "gpipe", {"stage": 2}
    p = speedup.predict_for_config(c, 2, 1e15, calibrate="together")
    assert p["calibrate"] == "together" and p["step_seconds"] > 0
    with pytest.raises(ConfigError, match="calibrate"):
        speedup.predict_for_config(c, 2, 1e15, calibrate="apart")


def test_local_learning_predictions_time_the_heads():
    """An 'FB' op is the stage's body forward and backward plus its head (PPLL's heads are much of
    its work): the pipeline's step is its slowest device, now with heads; modules grouped on a
    device (K = 8 on 4, two each) add up there. Rules written out, not the model's output."""
    f, b, h = (1.0,) * 4, (2.0,) * 4, (0.0, 4.0, 0.5, 0.0)
    costs = speedup.StageCosts(f, b, (1.0,) * 4, (1.0,) * 4, h)
    r = speedup.simulate(ppll_table(4, 24), costs, 1e15, model="async")
    assert r["step_seconds"] == pytest.approx(max(fi + bi + hi for fi, bi, hi in zip(f, b, h)))  # 7
    assert r["sequential_step_seconds"] == pytest.approx(sum(f) + sum(b) + sum(h))  # 16.5
    eight = speedup.StageCosts((1.0,) * 8, (2.0,) * 8, (1.0,) * 8, (1.0,) * 8, (1.0,) * 8)
    grouped = speedup.simulate(ppll_table(8, 24, module_groups=(2, 2, 2, 2)), eight, 1e15, model="async")
    assert grouped["step_seconds"] == pytest.approx(2 * (1 + 2 + 1)) and grouped["speedup"] == pytest.approx(4.0)
    assert speedup.simulate(ppll_table(4, 24), speedup.StageCosts(f, b, (1.0,) * 4, (1.0,) * 4), 1e15,
                            model="async")["step_seconds"] == pytest.approx(3.0)  # without heads: the bodies only


def test_balance_by_time_beats_even_split():
    from cdpjax.models.mlp import mlp

    blocks = mlp(10, (8, 8, 1), width=64, depth=5)
    points, report = speedup.balance_by_time(blocks, (8, 8, 1), 3, batch_size=32, repeats=3)
    assert report["by_time"]["imbalance"] <= report["even"]["imbalance"] + 1e-9
    assert len(points) == 2


def test_cdp_figures_for_resnet18_cifar():
    """N = L = 4, ResNet-18 of CIFAR shape: the table figures `cdpjax bench` reports (no compile needed).
    The comm balance depends on the stage cut (gradient sizes): the bench's split [3, 6, 8]
    (docs/measured.md) keeps it under 2."""
    from cdpjax import models
    from cdpjax.config import default_config

    c = default_config()
    c.model, c.model_kwargs, c.norm, c.stages = "resnet18", {"stem": "cifar"}, "batch", [3, 6, 8]
    net = models.build(c, (32, 32, 3), 10)
    sizes = bench.stage_sizes(net, 8)
    dp = bench.table_figures(cdp_table("dp", 4, 4, 6), sizes)
    cdp = bench.table_figures(cdp_table("cdp-v2", 4, 4, 6), sizes)
    assert cdp["activation_total"]["peak"] <= 0.55 * dp["activation_total"]["peak"]
    assert dp["comm_balance"] == pytest.approx(8.0)
    assert cdp["comm_balance"] <= 2.0
    # the same gradients, in small messages: each worker receives every stage's partial sum or its
    # completed sum once a step, 2(N-1)/N of the model as DP's ring all-reduce sends; the model counted
    # from ResNet-18's layers (CIFAR stem, 10 classes: 11,173,962 parameters, torchvision's count)
    model_bytes = 4 * 11_173_962
    assert sum(sizes["param_bytes"]) == model_bytes
    for figures in (dp, cdp):
        assert figures["table_bytes_per_device_per_step"] == pytest.approx(2 * 3 / 4 * model_bytes, rel=1e-6)


def test_pipeline_busy_fractions_from_their_tables():
    """What `cdpjax bench` reports as busy fraction: ppll and cdp-mp 1.0 in steady state, gpipe M/(M+K-1)."""
    sizes = {"param_bytes": [4] * 4, "activation_bytes": [4] * 4}
    assert bench.table_figures(timetable.table("ppll", stages=4), sizes)["busy_fraction"] == pytest.approx(1.0)
    assert bench.table_figures(gpipe_table(4, 4), sizes)["busy_fraction"] == pytest.approx(4 / 7)
    cdp_mp = timetable.table("cdp-mp", stages=4, steps=4)
    assert bench.table_figures(cdp_mp, sizes)["busy_fraction"] == pytest.approx(1.0)
    # beside it, in lockstep with B = 2F: GPipe's forward and backward phases are each M+K-1 ticks
    # alike (4/7 again); 1F1B at K = 8, M = 32 runs K forward-only ticks of 1, then 2(M+K-1) - K
    # ticks of 2 (some device runs a backward), each device working M(1 + 2)
    assert bench.table_figures(gpipe_table(4, 4), sizes)["busy_fraction_lockstep"] == pytest.approx(4 / 7)
    one_f_one_b = bench.table_figures(timetable.table("1f1b", stages=8, microbatches=32),
                                      {"param_bytes": [4] * 8, "activation_bytes": [4] * 8})
    assert one_f_one_b["busy_fraction_lockstep"] == pytest.approx(32 * 3 / (8 + (2 * 39 - 8) * 2))
    row = bench.format_table([{"method": "1f1b", "devices": 8, "compile_seconds": 1.0, "step_seconds": 1.0,
                               "images_per_second": 1.0, **one_f_one_b}]).splitlines()
    assert row[0].split().index("lockstep") and row[2].split()[9:12] == ["-", "0.82", "0.65"]


def test_memory_partition_holds_the_fewest_bytes():
    """partition='memory' on blocks whose outputs are 6, 2 and 1 floats: with two stages, cut 1
    gives stage outputs (24, 4) bytes and cut 2 (8, 4); the two-stage CDP table holds max(2 o0,
    o0 + o1) at its busiest tick (tests/test_timetable.py's example): 48 against 16, so cut 2.
    The bench's ResNet-18 cut [3, 6, 8] (docs/measured.md) holds 0.86 of DP's bytes where the unit model says 0.5."""
    import flax.linen as nn

    from cdpjax.models import partition

    class Block(nn.Module):
        width: int

        @nn.compact
        def __call__(self, x, train=False):
            return nn.Dense(self.width)(x.reshape(x.shape[0], -1))

    blocks = [Block(6), Block(2), Block(1)]
    assert partition.split_points(blocks, 2, "memory", (3,)) == (2,)
    report = partition.memory_report(blocks, (1,), (3,))
    assert report["stage_output_bytes"] == [24.0, 4.0] and report["cdp_peak_bytes"] == 48.0
    assert report["dp_peak_bytes"] == 2 * 24 + 2 * 4

    from cdpjax import models
    from cdpjax.config import default_config

    c = default_config()
    c.model, c.model_kwargs, c.norm, c.stages = "resnet18", {"stem": "cifar"}, "batch", [3, 6, 8]
    net = models.build(c, (32, 32, 3), 10)
    assert partition.memory_report(net.blocks, [3, 6, 8], (32, 32, 3))["ratio"] == pytest.approx(0.864, abs=1e-3)


def test_memory_model_counts_a_pipelines_gradient_sums(tmp_path):
    """On the tick runtime each stage sums its micro-batches' gradients where it lives: the model
    counts one gradient of the busiest device's stage within the step, and between steps where
    the sums outlive it (cdp-mp updates a stage when its N micro-batches are in, across steps;
    gpipe at the step's end). For one stage per device that is the largest stage's parameter
    bytes (the MLP by hand: a 128 -> 128 layer is the largest, 4 x (128*128 + 128) bytes)."""
    path = tmp_path / "b.json"
    assert main(["bench", "--methods", "cdp-mp,gpipe", "--cpu-devices", "4", "--repeats", "1",
                 "--config.stages=4", "--json", str(path)]) == 0
    largest = 4 * (128 * 128 + 128)
    cdp_mp, gpipe = json.loads(path.read_text())
    for r, between in ((cdp_mp, largest), (gpipe, 0)):
        assert max(r["stage_param_bytes"]) == largest
        model = r["memory_model"]
        assert model["temporaries"]["gradients_in_flight"] == largest
        assert model["arguments"]["gradients_in_flight"] == between


def test_a_variant_is_predicted_with_its_own_keys(tmp_path, capsys):
    """`--methods gpipe,gpipe@microbatches=8 --predict`: each prediction is of its own config,
    micro-batches of 64/4 = 16 and 64/8 = 8 examples, and named by its label."""
    path = tmp_path / "b.json"
    assert main(["bench", "--methods", "gpipe,gpipe@microbatches=8", "--predict", "4", "--cpu-devices", "4",
                 "--repeats", "1", "--config.stages=4", "--config.global_batch_size=64",
                 "--config.microbatches=4", "--json", str(path)]) == 0
    base, variant = json.loads(path.read_text())
    assert (base["prediction"]["micro_batch"], variant["prediction"]["micro_batch"]) == (16, 8)
    assert base["prediction"]["model"] == variant["prediction"]["model"] == "lockstep"  # the default
    out = capsys.readouterr().out
    assert "gpipe@microbatches=8: step" in out
    assert sum("(lockstep model, ops timed alone)" in line for line in out.splitlines() if ": step" in line) == 2
    assert 0 < base["prediction"]["busy_fraction_lockstep"] <= 1
    assert sum("of the time in lockstep with these op times" in line for line in out.splitlines()) == 2


def test_predict_for_config_says_its_model():
    """predict_for_config names the model it replayed, and times the backward as the config runs it."""
    from cdpjax import config as cfg_lib

    c = cfg_lib.default_config()
    c.method, c.model, c.model_kwargs, c.stages, c.microbatches = "gpipe", "mlp", {"width": 16}, 2, 2
    c.residuals = "carry"
    p = speedup.predict_for_config(c, 2, 1e15, model="async")
    assert (p["model"], p["backward_from"], p["devices"]) == ("async", "carry", 2)
    assert len(p["stage_backward_input"]) == len(p["stage_backward_weight"]) == 2
    wrong = speedup.predict_for_config(c, 3, 1e15)  # two stages on two devices, not three
    assert "error" in wrong and wrong["model"] == "lockstep"
    with pytest.raises(ConfigError, match="lockstep or async"):
        speedup.predict_for_config(c, 2, 1e15, model="eager")


def test_pipeline_sends_each_boundarys_real_bytes(tmp_path):
    """gpipe on a two-stage MLP (64 -> 16 -> 16 -> 16 -> 10, cut after two blocks), M = 4 micro-batches
    of 16: each micro-batch's forward sends its 16-wide hidden layer to device 1 once and its
    backward sends the same-sized cotangent back once, 2 x 4 x 16 x 16 x 4 bytes a step over the two
    devices (counted by hand); the same messages padded to the carrier's rows would be as wide as
    the 8x8x1 image (64 floats)."""
    path = tmp_path / "b.json"
    assert main(["bench", "--methods", "gpipe", "--cpu-devices", "2", "--repeats", "1", "--config.stages=[2]",
                 "--config.model_kwargs.width=16", "--config.microbatches=4", "--config.global_batch_size=64",
                 "--json", str(path)]) == 0
    (r,) = json.loads(path.read_text())
    by_hand = 2 * 4 * 16 * 16 * 4 / 2  # per device: the mean over the two
    assert r["sent_bytes_per_device_per_step"] == by_hand
    assert r["sent_bytes_padded_per_device_per_step"] == by_hand * 64 / 16
    assert r["sent_bytes_per_device_per_step"] <= 1.05 * by_hand


def test_bench_warns_when_simulated_devices_outnumber_cores(monkeypatch):
    import os
    import types

    fake = types.SimpleNamespace(devices=np.array([types.SimpleNamespace(platform="cpu")] * 4))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert "4 simulated CPU devices on 2 cores" in bench.oversubscribed(fake)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert bench.oversubscribed(fake) is None
