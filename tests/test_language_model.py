"""Training a language model: `cdpjax train --config charlm:method=M` trains
for M in e2e, dp, cdp-v2, ppll, local, 1f1b, cdp-mp (the per-token test loss falls by more than 30%
from its start; gpt's embedding refuses anything but integer token ids, so every method hands its
first stage the integers); its metrics are the task's; dp and 1f1b take e2e's steps on token
windows, the cdp-v2 ring its simulation's, ppll local's; bad input fails before compiling, and
`plot` draws the task's curves."""
import json
import math
import os

import jax
import numpy as np
import pytest
from helpers import context

from cdpjax import loop, methods, tasks, train
from cdpjax import setup as setup_lib
from cdpjax.cli import main
from cdpjax.commands import plot as plot_cmd
from cdpjax.config import load_file

CHARLM = os.path.join(os.path.dirname(__file__), "..", "cdpjax", "configs", "charlm.py")
STEPS = 100  # of the config's 300: the fall is already well past 30% (test loss 4.12 -> 2.52)


def start_loss(config) -> float:
    """The per-token test loss of the initial parameters (the trainer's own evaluation)."""
    dataset, _, method = setup_lib.setup(config)
    task = tasks.resolve(config, dataset)
    params, state = method.export(method.init(jax.random.key(config.seed)))
    return loop.evaluate(loop.make_eval_fn(method.net, task), params, state, dataset, 512, task)["loss"]


PIPELINE_MESH = ("--config.mesh.stage=4", "--config.mesh.data=2")  # 4 stage devices x 2 data groups: the 8 here


@pytest.mark.parametrize("method,steps,extra", [
    pytest.param("e2e", STEPS, (), marks=pytest.mark.heavy), pytest.param("dp", STEPS, (), marks=pytest.mark.heavy),
    pytest.param("local", STEPS, (), marks=pytest.mark.heavy),
    pytest.param("1f1b", STEPS, PIPELINE_MESH, marks=pytest.mark.heavy),
    pytest.param("ppll", STEPS, PIPELINE_MESH, marks=pytest.mark.heavy),
    # the delayed updates of CDP (8 workers on the ring; 4 on the cyclic pipeline) take longer; in CI,
    # the methods' equality with their references on token windows stands for them (below), and the
    # trainer runs the language model in the resume test here and in tests/test_faults.py
    pytest.param("cdp-v2", 2 * STEPS, (), marks=pytest.mark.heavy),
    pytest.param("cdp-mp", 2 * STEPS, PIPELINE_MESH, marks=pytest.mark.heavy)])
def test_charlm_trains_and_logs_the_tasks_metrics(method, steps, extra, tmp_path, capsys):
    work = tmp_path / method
    args = ["train", "--no-progress", "--workdir", str(work), "--config", f"{CHARLM}:method={method}",
            f"--config.num_steps={steps}", f"--config.eval_every={steps // 2}", "--config.checkpoint_every=0", *extra]
    assert main(args) == 0
    err = capsys.readouterr().err.strip().splitlines()
    records = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    tests_ = [r for r in records if r["split"] == "test"]
    trains = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in tests_] == [steps // 2, steps] and len(trains) == steps // 20
    module_lines = [r for r in trains if any(k.startswith("loss_module_") for k in r)]
    if method in ("local", "ppll"):  # every local module's loss is logged
        assert module_lines and all({f"loss_module_{k}" for k in range(4)} <= set(r) for r in module_lines)
        trains = [{k: v for k, v in r.items() if not k.startswith("loss_module_")} for r in trains]
    for r in tests_:
        assert set(r) == {"step", "split", "loss", "perplexity", "token_accuracy", "time"}
        assert r["perplexity"] == pytest.approx(math.exp(r["loss"]), rel=1e-9)
    for r in trains:
        assert set(r) == {"step", "split", "loss", "perplexity", "token_accuracy", "lr", "tokens_per_second", "time"}
    start = start_loss(load_file(f"{CHARLM}:method=e2e"))  # every method starts from the same network
    assert start == pytest.approx(math.log(61), abs=0.2)  # untrained: about uniform over the 61 symbols
    assert tests_[-1]["loss"] < 0.7 * start, (start, tests_)
    summary = json.loads((work / "summary.json").read_text())
    assert summary["task"] == "language_modelling" and summary["test_loss"] == tests_[-1]["loss"]
    assert summary["test_token_accuracy"] == tests_[-1]["token_accuracy"] > 0.2
    assert summary["tokens_per_second"] > 0 and "test_accuracy" not in summary
    assert err[-1].startswith(f"cdpjax: test loss {tests_[-1]['loss']:.4f} (perplexity ")
    assert "tokens/s on" in err[-1]


def test_dp_takes_e2es_steps_on_token_windows():
    """Three steps of dp on 4 devices and of e2e on one, from the same start, on the same token
    windows: the same parameters and the same per-token metrics (dp's update rule is e2e's)."""
    from cdpjax import data

    c = load_file(f"{CHARLM}:method=e2e")
    c.model_kwargs = {"width": 16, "depth": 2, "heads": 2}
    # SGD: Adam divides by the gradient's size, which turns the rounding noise of gradients that are
    # zero in exact arithmetic (attention's key biases) into steps of the full learning rate.
    c.optimizer, c.learning_rate = "sgd", 0.1
    ds = data.build(c)
    built = {}
    for name, axes in (("e2e", {"data": 1}), ("dp", {"data": 4})):
        c.method = name
        ctx = context(c, axes, ds.input_shape, ds.num_classes)
        ctx = methods.Context(ctx.config, ctx.mesh, ctx.input_shape, ctx.num_classes, "int32", tasks.LANGUAGE_MODELLING)
        built[name] = methods.build(ctx)
    states = {k: m.init(jax.random.key(0)) for k, m in built.items()}
    for step in range(3):
        batch = ds.train_batch(step, 16, 0)
        out = {}
        for k, m in built.items():
            states[k], out[k] = m.train_step(states[k], batch)
        for key in ("loss", "perplexity", "token_accuracy"):
            np.testing.assert_allclose(out["dp"][key], out["e2e"][key], rtol=1e-5)
        np.testing.assert_allclose(out["dp"]["metric_sums"], out["e2e"]["metric_sums"], rtol=1e-5)
        assert out["e2e"]["metric_sums"][2] == 16 * 32  # tokens counted
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 built["dp"].export(states["dp"])[0], built["e2e"].export(states["e2e"])[0])


BAD_INPUT = [
    (["--config.task=classification"], "task 'classification' reads labels of shape () per example"),
    (["--config.model=mlp", "--config.model_kwargs={'width': 16}"],
     "task 'language_modelling' needs outputs of shape (32, 61) per example"),
    (["--config.model_kwargs.vocab_size=40"], "vocab_size=40 is smaller than the dataset's 61 symbols"),
    (["--config.model_kwargs.max_len=16"], "windows of 32 tokens are longer than gpt's position table"),
    (["--config.model_kwargs.tied=True"], "tied=True reads its logits off the token embedding"),
    (["--config.task=translation"], "unknown task 'translation'"),
]


@pytest.mark.parametrize("args,message", BAD_INPUT, ids=[m for _, m in BAD_INPUT])
def test_bad_input_fails_in_one_line_before_compiling(args, message, capsys, tmp_path, compiles):
    code = main(["train", "--no-progress", "--workdir", str(tmp_path), "--config", f"{CHARLM}:method=e2e", *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert not [c for c in compiles if c[0] == "backend"], compiles


def test_tied_embeddings_train_in_one_stage(tmp_path):
    c = load_file(f"{CHARLM}:method=e2e,stages=1,steps=2")
    c.model_kwargs.tied = True
    c.eval_every = c.checkpoint_every = 0
    summary = train.train(c, str(tmp_path), progress=False)
    assert summary["stages"] == 1 and np.isfinite(summary["test_loss"])


def test_plot_draws_the_language_models_curves(tmp_path, monkeypatch):
    """A run whose lines carry loss, perplexity and token_accuracy: a train and a test panel for
    each, in that order, with the lines' points."""
    lines = [{"step": s, "split": split, "loss": 4.0 / s, "perplexity": math.exp(4.0 / s), "token_accuracy": s / 40,
              **({"lr": 0.1, "tokens_per_second": 1e4} if split == "train" else {})}
             for s in (5, 10) for split in ("train", "test")]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    fig = plot_cmd.plot_curves([str(tmp_path / "run")], str(tmp_path / "curves.png"))
    panels = [(split, key) for key in ("loss", "perplexity", "token_accuracy") for split in ("train", "test")]
    assert [ax.get_ylabel() for ax in fig.axes] == [f"{split} {key}" for split, key in panels]
    for ax, (split, key) in zip(fig.axes, panels):
        (line,) = ax.get_lines()
        assert line.get_xydata().tolist() == [[r["step"], r[key]] for r in lines if r["split"] == split]
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_lm_shakespeare_config_builds_nanogpts_baby_gpt():
    """The GPU config validates and builds, abstractly: 4 stages of nanoGPT's 6 x 384 baby GPT on
    windows of 256 of the 65 characters, computing in bfloat16; its parameters counted by hand
    (a block as nanoGPT's: attention and MLP with biases, two LayerNorms; an untied head)."""
    from cdpjax import checks, models

    c = load_file(os.path.join(os.path.dirname(CHARLM), "lm_shakespeare.py") + ":method=e2e")
    checks.validate(c)
    net = models.build(c, (256,), 65, input_dtype="int32")
    assert net.num_stages == 4 and net.stage_output_shapes(1)[-1] == (1, 256, 65)
    params, _ = jax.eval_shape(lambda: net.init(jax.random.key(0)))
    d, mlp = 384, 1536
    block = 4 * (d * d + d) + 2 * 2 * d + d * mlp + mlp + mlp * d + d
    embedding, head = 65 * d + 256 * d, 2 * d + d * 65 + 65
    assert sum(x.size for x in jax.tree.leaves(params)) == embedding + 6 * block + head
    assert c.dtype == "bfloat16" and c.dataset == "tiny_shakespeare"


def test_resumed_language_model_run_equals_uninterrupted(tmp_path):
    """Killed after step 6 (checkpoints every 4, train lines every 5: a logging window's sums travel
    in the checkpoint) and resumed: the same parameters and metrics.jsonl, timing fields aside."""
    from metrics_lines import without_timing

    c = load_file(f"{CHARLM}:method=e2e,stages=2,steps=10")
    c.model_kwargs = {"width": 16, "depth": 2, "heads": 2}
    c.global_batch_size, c.checkpoint_every, c.eval_every, c.log_every = 16, 4, 0, 5
    full = train.train(c, str(tmp_path / "full"), progress=False)
    assert train.train(c, str(tmp_path / "part"), progress=False, stop_after=6) == {"stopped_at": 6}
    resumed = train.train(c, str(tmp_path / "part"), progress=False)
    assert resumed["resumed_from"] == 4 and resumed["test_loss"] == full["test_loss"]
    read = lambda d: without_timing((tmp_path / d / "metrics.jsonl").read_text())  # noqa: E731
    assert read("part") == read("full") and '"tokens_per_second"' not in read("full")


def test_describe_cuts_the_charlm_gpt_without_compiling(compiles):
    """`cdpjax describe` of charlm: 4 stages of the 6 blocks, traced with token ids (the embedding
    refuses floats), each stage's output the [T, width] tokens, the last [T, vocabulary] logits."""
    from cdpjax.commands.describe import describe

    d = describe(load_file(f"{CHARLM}:method=e2e"))
    assert d["input_shape"] == [32] and d["num_classes"] == 61 and d["num_blocks"] == 6
    assert [s["blocks"] for s in d["stages"]] == [[0, 2], [2, 3], [3, 4], [4, 6]]
    assert [s["output_shape"] for s in d["stages"]] == [[32, 64]] * 3 + [[32, 61]]
    assert all(s["flops"] > 0 for s in d["stages"])
    assert not [e for e in compiles if e[0] == "backend"], compiles


def _small_lm(method, axes, **over):
    """A 4-stage gpt of 16 wide on the corpus, built for `method` on `axes`, and the dataset."""
    from cdpjax import data

    c = load_file(f"{CHARLM}:method={method}")
    c.model_kwargs = {"width": 16, "depth": 2, "heads": 2}
    c.optimizer, c.learning_rate = "sgd", 0.1
    c.global_batch_size = 16
    for k, v in over.items():
        c[k] = v
    ds = data.build(c)
    ctx = context(c, axes, ds.input_shape, ds.num_classes)
    ctx = methods.Context(ctx.config, ctx.mesh, ctx.input_shape, ctx.num_classes, "int32", tasks.LANGUAGE_MODELLING)
    return methods.build(ctx), ds


@pytest.mark.parametrize("method,axes,reference,reference_axes,over", [
    ("1f1b", {"stage": 4}, "e2e", {"data": 1}, {"microbatches": 2}),  # backprop's update rule
    ("cdp-v2", {"data": 4}, "cdp-v2", {"data": 1}, {"cdp_impl": "ring", "workers": 4}),  # against simulate below
    ("ppll", {"stage": 4}, "local", {"data": 1}, {}),
])
def test_methods_equal_their_references_on_token_windows(method, axes, reference, reference_axes, over):
    """Three steps on token windows: 1f1b equals e2e, the cdp-v2 ring its simulation, ppll local
    (per-token local losses through `token_linear` heads), after each one's flush."""
    m, ds = _small_lm(method, axes, **over)
    ref_over = dict(over, cdp_impl="simulate") if method == "cdp-v2" else {}
    ref, _ = _small_lm(reference, reference_axes, **ref_over)
    states = [m.init(jax.random.key(0)), ref.init(jax.random.key(0))]
    for step in range(3):
        batch = ds.train_batch(step, 16, 0, False)
        states = [mm.train_step(s, batch)[0] for mm, s in zip((m, ref), states)]
    got, want = (jax.device_get(mm.export(mm.flush(s) if mm.flush else s)[0]) for mm, s in zip((m, ref), states))
    assert max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))) < 2e-5
    start = jax.device_get(m.export(m.init(jax.random.key(0)))[0])
    assert max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(start))) > 1e-3
