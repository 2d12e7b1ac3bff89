"""The backprop pipelines (GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZBV, DualPipeV, LoopedBFS): the same gradients
and updates as `e2e` on one device.

Claims: the gradient summed over M micro-batches flowing forward and backward
through K stages (of different shapes) on K devices (interleaved: K / V devices,
V stages each) is backprop's gradient of the mean loss over the batch, whatever
the order of the table; with M=1 GPipe is plain model parallelism, equal to e2e
even with BatchNorm; with a data axis the groups' gradients are averaged.
"""
import jax
import numpy as np
import pytest

from cdpjax.config import ConfigError
from cdpjax.kinds import KINDS, OpKind
from cdpjax.layouts import LAYOUTS, Layout
from cdpjax.methods.common import loss_and_metrics
from cdpjax.timetable import from_orders
from helpers import assert_trees_close, build, max_diff, random_batches, small_config

BATCH = 16


def _config(method, model="resnet_tiny", stages=4, microbatches=4, norm="none", **kw):
    return small_config(method, model, stages=stages, microbatches=microbatches, norm=norm, global_batch_size=BATCH,
                        **kw)


CASES = {  # layout, model, K stages, stage devices, data groups, M, residuals, check the gradient itself
    "gpipe-resnet-K4-M4": ("gpipe", "resnet_tiny", 4, 4, 1, 4, "recompute", True),
    "gpipe-vit-K2-M2-data2": ("gpipe", "vit_tiny", 2, 2, 2, 2, "recompute", False),
    "gpipe-resnet-K2-M2-carry": ("gpipe", "resnet_tiny", 2, 2, 1, 2, "carry", False),
    "1f1b-resnet-K4-M8": ("1f1b", "resnet_tiny", 4, 4, 1, 8, "recompute", True),
    "1f1b-mlp-K4-M2-data2": ("1f1b", "mlp", 4, 4, 2, 2, "recompute", False),
    "interleaved-resnet-K4-on-2-M4": ("interleaved-1f1b", "resnet_tiny", 4, 2, 1, 4, "recompute", True),
    "interleaved-mlp-K4-on-2-M2-data2": ("interleaved-1f1b", "mlp", 4, 2, 2, 2, "recompute", False),
    "zb-h1-resnet-K4-M4": ("zb-h1", "resnet_tiny", 4, 4, 1, 4, "recompute", True),
    "zb-h1-resnet-K2-M4-carry": ("zb-h1", "resnet_tiny", 2, 2, 1, 4, "carry", True),
    "zb-h1-mlp-K2-M2-data2": ("zb-h1", "mlp", 2, 2, 2, 2, "carry", False),
    "zbv-resnet-K4-on-2-M4-carry": ("zbv", "resnet_tiny", 4, 2, 1, 4, "carry", True),
    "zbv-mlp-K4-on-2-M2": ("zbv", "mlp", 4, 2, 1, 2, "recompute", True),
    "dualpipev-mlp-K4-on-2-M4": ("dualpipev", "mlp", 4, 2, 1, 4, "recompute", True),
    "dualpipev-resnet-K4-on-2-M4-carry-data2": ("dualpipev", "resnet_tiny", 4, 2, 2, 4, "carry", True),
    "looped-bfs-mlp-K4-on-2-M4": ("looped-bfs", "mlp", 4, 2, 1, 4, "recompute", True),
    "looped-bfs-resnet-K6-on-2-M2-carry": ("looped-bfs", "resnet_tiny", 6, 2, 1, 2, "carry", False),
}


# CI runs every layout, each with a ResNet or the MLP and both residual modes; these repeat a
# layout on the other model and run with `make test-heavy`.
HEAVY = {"gpipe-vit-K2-M2-data2", "gpipe-resnet-K2-M2-carry", "1f1b-resnet-K4-M8", "interleaved-resnet-K4-on-2-M4",
         "zb-h1-resnet-K4-M4", "zbv-resnet-K4-on-2-M4-carry", "looped-bfs-resnet-K6-on-2-M2-carry"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.heavy) if c in HEAVY else c for c in CASES])
def test_gradients_and_updates_equal_e2e(case):
    """The gradient, then two updates with SGD momentum and weight decay, as e2e's."""
    method, model, stages, devices, groups, micro, residuals, check_gradient = CASES[case]
    e2e = build(_config("e2e", model, stages, micro), {"data": 1})
    gpipe = build(_config(method, model, stages, micro, residuals=residuals, chunks=stages // devices),
                  {"stage": devices, "data": groups})
    batches = random_batches(2, BATCH)
    s_e2e, s_gp = e2e.init(jax.random.key(0)), gpipe.init(jax.random.key(0))
    if check_gradient:
        b = batches[0]
        reference = jax.grad(lambda p: loss_and_metrics(e2e.net, p, s_e2e.model_state, b["image"],
                                                        b["label"])[0])(s_e2e.params)
        assert_trees_close(gpipe.gradients(s_gp, b), reference)
    for b in batches:
        s_e2e, m_e2e = e2e.train_step(s_e2e, b)
        s_gp, m_gp = gpipe.train_step(s_gp, b)
        np.testing.assert_allclose(m_gp["loss"], m_e2e["loss"], rtol=1e-5)
        np.testing.assert_allclose(m_gp["accuracy"], m_e2e["accuracy"], atol=1e-6)
    assert_trees_close(gpipe.export(s_gp), e2e.export(s_e2e))
    assert max_diff(e2e.export(s_e2e)[0], e2e.export(e2e.init(jax.random.key(0)))[0]) > 1e-3  # it trained


def test_one_microbatch_is_model_parallel_e2e_with_batchnorm():
    """M=1: PPLL's "conventional pipeline"; BatchNorm statistics are the whole batch's, as in e2e."""
    e2e = build(_config("e2e", stages=2, microbatches=1, norm="batch"), {"data": 1})
    gpipe = build(_config("gpipe", stages=2, microbatches=1, norm="batch"), {"stage": 2})
    s_e2e, s_gp = e2e.init(jax.random.key(0)), gpipe.init(jax.random.key(0))
    for b in random_batches(2, BATCH):
        s_e2e, _ = e2e.train_step(s_e2e, b)
        s_gp, _ = gpipe.train_step(s_gp, b)
    assert_trees_close(gpipe.export(s_gp), e2e.export(s_e2e))


def test_pipeline_shape_is_reported():
    gpipe = build(_config("gpipe", stages=4, microbatches=4), {"stage": 4})
    assert gpipe.program.period == 2 * (4 + 4 - 1)  # a step: M forwards, M backwards, 2(K-1) idle per device
    np.testing.assert_allclose(1 - gpipe.table.busy_fraction()["devices"], 3 / 7)
    assert gpipe.padding["params"] > 1.0


@pytest.mark.parametrize("changes,match", [
    ({"residuals": "keep"}, "residuals='keep' is not one of"),
    ({"microbatches": 3}, "micro-batches per step=3"),
    ({"stages": 2}, "mesh.stage=4"),
])
def test_bad_config_fails_early(changes, match, compiles):
    with pytest.raises(ConfigError, match=match):
        build(_config("gpipe", **changes), {"stage": 4})
    assert not [e for e in compiles if e[0] == "backend"], compiles  # refused before compiling anything


def test_trains_in_the_training_loop(digits_config, tmp_path):
    from cdpjax import train

    c = digits_config
    c.method, c.model, c.stages, c.microbatches, c.num_steps, c.eval_every = "gpipe", "mlp", 2, 2, 30, 0
    c.mesh = {"stage": 2, "data": -1}
    summary = train.train(c, str(tmp_path), progress=False)
    assert summary["test_accuracy"] > 0.5  # digits: chance is 0.1


# --------------------------------------------------------------- an op kind from outside


def whole_backward_table(stages=3, microbatches=2, steps=2):
    """1F1B's orders with each backward written as the test's own kind 'BWX' (one op: input cotangent
    and weight gradient)."""
    def order(j):
        w = min(stages - 1 - j, microbatches)
        kinds = ["F"] * w + ["F", "BWX"] * (microbatches - w) + ["BWX"] * w
        seen = {"F": 0, "BWX": 0}
        out = []
        for k in kinds:
            out.append((k, j, seen[k]))
            seen[k] += 1
        return out
    return from_orders("toy-bwx", [order(j) for j in range(stages)], stages, microbatches, steps)


WHOLE_BACKWARD = OpKind("BWX", "a whole backward in one op (a test's kind)",
                        after=lambda j, L: ("BWX", j + 1) if j + 1 < L else ("F", j), cost="backward",
                        backward=True, weight_gradient=True, cotangent=True, shade="backward")


def test_an_op_kind_from_outside_is_its_registration_and_its_piece(monkeypatch):
    """A kind registered from here, with its piece (the backward piece: what it computes follows its
    flags), runs on the stage engine with no other edit and gives e2e's gradient; without the piece
    the engine refuses it, naming it."""
    from cdpjax.methods import pipeline

    def toy_build(ctx):
        return pipeline.build(ctx, "toy-bwx", whole_backward_table(3, int(ctx.config.microbatches), 3))

    toy = Layout("toy-bwx", toy_build, axes=("stage", "data"), device_axis="stage", table=whole_backward_table,
                 microbatches=True)
    config = _config("toy-bwx", "mlp", stages=3, microbatches=2)
    with KINDS.temporarily("BWX", WHOLE_BACKWARD), LAYOUTS.temporarily("toy-bwx", toy):
        with pytest.raises(ConfigError, match="the stage-axis engine has no piece for op kind 'BWX'"):
            build(config, {"stage": 3})
        monkeypatch.setitem(pipeline.PIECES, "BWX", pipeline.backward_piece)
        method = build(config, {"stage": 3})
        e2e = build(_config("e2e", "mlp", stages=3, microbatches=2), {"data": 1})
        b = random_batches(1, BATCH)[0]
        s_e2e = e2e.init(jax.random.key(0))
        reference = jax.grad(lambda p: loss_and_metrics(e2e.net, p, s_e2e.model_state, b["image"],
                                                        b["label"])[0])(s_e2e.params)
        assert_trees_close(method.gradients(method.init(jax.random.key(0)), b), reference)
