"""Tasks: the per-token loss of a two-token window by hand, metric sums that add over split batches,
`finish` on hand-made sums, and the checks of labels and outputs."""
import math

import jax.numpy as jnp
import numpy as np
import pytest

from cdpjax import data, tasks
from cdpjax.config import default_config
from cdpjax.errors import ConfigError

LM, CLS = tasks.LANGUAGE_MODELLING, tasks.CLASSIFICATION


def nll(row, label):
    """-log softmax(row)[label], written out."""
    return -(row[label] - math.log(sum(math.exp(v) for v in row)))


def test_per_token_loss_of_a_two_token_window_by_hand():
    """One window of two tokens over three symbols: token 0 predicts symbol 0 (its largest logit),
    token 1 predicts symbol 2 (its largest logit is symbol 1's)."""
    logits = [[2.0, 0.0, -1.0], [0.5, 1.5, 0.0]]
    labels = [0, 2]
    token_0 = -(2.0 - math.log(math.exp(2.0) + math.exp(0.0) + math.exp(-1.0)))
    token_1 = -(0.0 - math.log(math.exp(0.5) + math.exp(1.5) + math.exp(0.0)))
    per_token = (token_0 + token_1) / 2
    outputs, ids = jnp.asarray([logits]), jnp.asarray([labels], jnp.int32)
    np.testing.assert_allclose(LM.example_losses(outputs, ids), [per_token], rtol=1e-6)
    np.testing.assert_allclose(LM.loss(outputs, ids), per_token, rtol=1e-6)
    sums = np.asarray(LM.metric_sums(outputs, ids), np.float64)
    np.testing.assert_allclose(sums, [token_0 + token_1, 1.0, 2.0], rtol=1e-6)
    reported = LM.finish(sums)
    assert list(reported) == ["loss", "perplexity", "token_accuracy"]
    np.testing.assert_allclose(reported["loss"], per_token, rtol=1e-6)
    np.testing.assert_allclose(reported["perplexity"], math.exp(per_token), rtol=1e-6)
    assert reported["token_accuracy"] == 0.5


def test_loss_is_the_mean_over_examples_of_their_token_means():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 4, 5))
    labels = rng.integers(0, 5, (3, 4))
    by_hand = [np.mean([nll(logits[b, t], labels[b, t]) for t in range(4)]) for b in range(3)]
    np.testing.assert_allclose(LM.example_losses(jnp.asarray(logits, jnp.float32), jnp.asarray(labels)), by_hand,
                               rtol=1e-5)
    np.testing.assert_allclose(LM.loss(jnp.asarray(logits, jnp.float32), jnp.asarray(labels)), np.mean(by_hand),
                               rtol=1e-5)
    flat = [nll(logits[b, t], labels[b, t]) for b in range(3) for t in range(4)]  # equal windows: per token
    np.testing.assert_allclose(np.mean(by_hand), np.mean(flat), rtol=1e-12)
    class_logits, classes = rng.normal(size=(4, 3)), rng.integers(0, 3, 4)
    np.testing.assert_allclose(CLS.loss(jnp.asarray(class_logits, jnp.float32), jnp.asarray(classes)),
                               np.mean([nll(r, c) for r, c in zip(class_logits, classes)]), rtol=1e-5)


@pytest.mark.parametrize("task,output_shape,label_shape", [(CLS, (7,), ()), (LM, (5, 7), (5,))])
def test_metric_sums_add_over_split_batches(task, output_shape, label_shape):
    """Sums of a batch cut 3 + 5 (padded examples masked out) add up to the whole batch's, so
    micro-batches and devices can be added with one psum, and `finish` of the total is the
    whole batch's metrics."""
    rng = np.random.default_rng(1)
    outputs = jnp.asarray(rng.normal(size=(8, *output_shape)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, output_shape[-1], (8, *label_shape)), jnp.int32)
    mask = jnp.asarray([1, 1, 0, 1, 1, 1, 0, 1], jnp.float32)
    whole = np.asarray(task.metric_sums(outputs, labels, mask), np.float64)
    parts = sum(np.asarray(task.metric_sums(outputs[a:b], labels[a:b], mask[a:b]), np.float64)
                for a, b in ((0, 3), (3, 8)))
    np.testing.assert_allclose(parts, whole, rtol=1e-6)
    assert len(whole) == len(task.sum_names)
    tokens = math.prod(label_shape)
    assert whole[2] == 6 * tokens  # the count: 6 examples kept, each with its predictions
    kept = np.asarray(mask, bool)
    unmasked = np.asarray(task.metric_sums(outputs[kept], labels[kept]), np.float64)
    np.testing.assert_allclose(unmasked, whole, rtol=1e-6)
    np.testing.assert_allclose(task.finish(whole)["loss"], task.loss(outputs[kept], labels[kept]), rtol=1e-6)


def test_finish_on_hand_made_sums():
    cls = CLS.finish(np.array([6.0, 3.0, 4.0]))
    assert cls == {"loss": 1.5, "accuracy": 0.75}
    lm = LM.finish(np.array([10.0, 3.0, 5.0]))
    assert lm["loss"] == 2.0 and lm["token_accuracy"] == 0.6
    assert lm["perplexity"] == pytest.approx(math.exp(2.0), rel=1e-12)
    on_device = LM.finish(jnp.array([10.0, 3.0, 5.0]))  # the same function inside a train step
    np.testing.assert_allclose([on_device[k] for k in lm], [lm[k] for k in lm], rtol=1e-6)


def test_label_shapes_units_and_output_checks():
    assert CLS.label_shape((8, 8, 1)) == () and LM.label_shape((32,)) == (32,)
    assert (CLS.unit, CLS.items_per_example((8, 8, 1))) == ("images", 1)
    assert (LM.unit, LM.items_per_example((32,))) == ("tokens", 32)
    CLS.check_outputs((10,), (), 10, "mlp")
    LM.check_outputs((32, 70), (32,), 61, "gpt")  # a larger vocabulary than the symbols is fine
    with pytest.raises(ConfigError, match=r"needs outputs of shape \(32, 61\).*model 'mlp' gives \(61,\)"):
        LM.check_outputs((61,), (32,), 61, "mlp")
    with pytest.raises(ConfigError, match=r"needs outputs of shape \(10,\)"):
        CLS.check_outputs((32, 10), (), 10, "gpt")
    with pytest.raises(ConfigError, match="needs outputs"):
        LM.check_outputs((32, 40), (32,), 61, "gpt")


def test_config_task_defaults_to_the_datasets_and_refuses_other_labels():
    c = default_config()
    text, digits = data.REGISTRY["coriolanus"](), data.REGISTRY["digits"]()
    assert tasks.resolve(c, text) is LM and tasks.resolve(c, digits) is CLS
    c.task = "language_modelling"
    assert tasks.resolve(c, text) is LM
    with pytest.raises(ConfigError, match=r"labels of shape \(8, 8, 1\) per example .* gives labels of shape \(\)"):
        tasks.resolve(c, digits)
    c.task = "classification"
    with pytest.raises(ConfigError, match=r"task 'classification' reads labels of shape \(\)"):
        tasks.resolve(c, text)
    c.task = "translation"
    with pytest.raises(ConfigError, match="unknown task 'translation'; registered: classification, language"):
        tasks.resolve(c, text)


def test_a_task_registered_by_name():
    own = tasks.Task("own", CLS.example_losses, CLS.metric_sums, CLS.sum_names, CLS.finish, CLS.metric_names,
                     CLS.label_shape, "images", "accuracy")
    with tasks.REGISTRY.temporarily("own", own):
        c = default_config()
        c.task = "own"
        assert tasks.resolve(c, data.REGISTRY["digits"]()) is own
    assert "own" not in tasks.REGISTRY
