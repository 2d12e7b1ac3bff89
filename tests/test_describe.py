"""`cdpjax describe`: the model as the run cuts it, for every registered model and every paper
config, without compiling; its figures against ResNet-32's layer list written out here."""
import glob
import json
import os

import pytest

from cdpjax import cli, models
from cdpjax.commands.describe import JSON_STAGE_KEYS, describe
from cdpjax.config import default_config, load_file

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "cdpjax", "configs")
PAPER_CONFIGS = sorted(glob.glob(os.path.join(CONFIGS, "ppll_*.py")) + glob.glob(os.path.join(CONFIGS, "cdp_*.py")))


def _cli(argv, capsys):
    rc = cli.main(["describe", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _check_stages(d, last_head: int = 0):
    """`last_head`: the last module's head parameters (0: it has none; PPLL's ViT: LayerNorm and linear)."""
    assert d["stages"], d
    for j, s in enumerate(d["stages"]):
        assert set(JSON_STAGE_KEYS) <= set(s) and s["stage"] == j
        a, b = s["blocks"]
        assert a < b and s["params"] >= 0 and s["flops"] > 0 and s["activation_bytes"] == 4 * _prod(s["output_shape"])
    assert [s["blocks"][1] for s in d["stages"]][-1] == d["num_blocks"]
    assert all(x["blocks"][1] == y["blocks"][0] for x, y in zip(d["stages"], d["stages"][1:]))  # contiguous
    assert d["stages"][-1]["output_shape"] == [d["num_classes"]] and d["stages"][-1]["head_params"] == last_head


def _prod(shape):
    out = 1
    for n in shape:
        out *= n
    return out


# Every image model (gpt reads token windows: tests/test_language_model.py describes it on text).
@pytest.mark.parametrize("model", sorted(set(models.REGISTRY) - {"gpt"}))
def test_every_registered_model(model, compiles):
    c = default_config()
    c.method, c.model, c.stages = "local", model, 2
    d = describe(c)
    _check_stages(d)
    assert d["model"] == model and d["input_shape"] == [8, 8, 1] and len(d["stages"]) == 2
    assert not [e for e in compiles if e[0] == "backend"], compiles  # abstract evaluation and lowering only


@pytest.mark.parametrize("path", PAPER_CONFIGS, ids=os.path.basename)
def test_every_paper_config(path, capsys, compiles):
    rc, out, err = _cli(["--config", path, "--json"], capsys)
    assert rc == 0, err
    d = json.loads(out)
    c = load_file(path)
    width = (c.get("model_kwargs", {}) or {}).get("dim", 0)  # ViT: LayerNorm (2 x width) + linear, last_head
    _check_stages(d, (2 * width + (width + 1) * d["num_classes"]) if c.aux_kwargs.get("last_head") else 0)
    assert (d["model"], d["method"], d["dataset"]) == (c.model, c.method, c.dataset)
    assert not [e for e in compiles if e[0] == "backend"], compiles


def _resnet32_params():
    """PyTorch's ResNet-32 of InfoPro (projection shortcuts): conv k*k*cin*cout, BN 2c, linear (in+1)*out."""
    def conv(k, cin, cout):
        return k * k * cin * cout

    def block(cin, cout):  # conv-BN-ReLU-conv-BN (+ 1x1 conv-BN shortcut where the shape changes)
        own = conv(3, cin, cout) + 2 * cout + conv(3, cout, cout) + 2 * cout
        return own + (conv(1, cin, cout) + 2 * cout if cin != cout else 0)

    blocks = [conv(3, 3, 16) + 2 * 16]  # the stem
    for cin, cout in ((16, 16), (16, 32), (32, 64)):
        blocks += [block(cin, cout)] + [block(cout, cout)] * 4
    return blocks + [(64 + 1) * 10]


def test_ppll_resnet32_k4_as_infopro_cuts_it(capsys):
    """K = 4: InfoPro's cuts after [stage 1, block 2], [stage 2, block 1], [stage 3, block 0];
    module parameters from the layer list; InfoPro's 1c2f heads and decoders (widths 32/64/64,
    FC 128) in its recipe; one module per device."""
    rc, out, err = _cli(["--config", os.path.join(CONFIGS, "ppll_resnet32.py") + ":K=4,recipe=infopro", "--json"],
                        capsys)
    assert rc == 0, err
    d = json.loads(out)
    per_block = _resnet32_params()
    assert [s["blocks"] for s in d["stages"]] == [[0, 4], [4, 8], [8, 12], [12, 17]]
    assert [s["params"] for s in d["stages"]] == [sum(per_block[a:b]) for a, b in ((0, 4), (4, 8), (8, 12), (12, 17))]
    assert d["totals"]["params"] == 466_906
    assert [s["output_shape"] for s in d["stages"]] == [[32, 32, 16], [16, 16, 32], [8, 8, 64], [10]]
    assert [s["activation_bytes"] for s in d["stages"]] == [4 * 32 * 32 * 16, 4 * 16 * 16 * 32, 4 * 8 * 8 * 64, 40]
    head = [9 * c * w + 2 * w + (w + 1) * 128 + 129 * 10 for c, w in ((16, 32), (32, 64), (64, 64))]
    decoder = [9 * c * 12 + 12 + 2 * 12 + 9 * 12 * 3 + 3 for c in (16, 32, 64)]
    assert [s["head_params"] for s in d["stages"]] == head + [0]
    assert [s["decoder_params"] for s in d["stages"]] == decoder + [0]
    assert [s["device"] for s in d["stages"]] == [0, 1, 2, 3]
    rc, out, _ = _cli(["--config", os.path.join(CONFIGS, "ppll_resnet32.py") + ":K=4,recipe=infopro"], capsys)
    assert rc == 0 and "466,906" in out and "decoder" in out


def _infopro_2c2f(c, classes=10):
    """InfoPro's AuxClassifier(c, '2c2f'): conv3x3 c -> w (stride 2 below 64 channels), BN, conv3x3
    w -> w, BN, pool, Linear(w, 128), Linear(128, classes); w = 32, 64, 64 for c = 16, 32, 64."""
    w = {16: 32, 32: 64, 64: 64}[c]
    return 9 * c * w + 2 * w + 9 * w * w + 2 * w + (w + 1) * 128 + 129 * classes


def _decoder(c):
    return 9 * c * 12 + 12 + 2 * 12 + 9 * 12 * 3 + 3


def test_infopro_2c2f_heads_on_the_ppll_recipe(capsys):
    """`describe --config ppll_resnet32.py:K=4,head=infopro --config.aux_kwargs.arch=2c2f`: the released
    configs' classifier on every module's output, InfoPro's layer list (the config's `head` argument: the
    recipe's `man` options stay out of an `infopro` head's aux_kwargs)."""
    rc, out, err = _cli(["--config", os.path.join(CONFIGS, "ppll_resnet32.py") + ":K=4,head=infopro",
                         "--config.aux_kwargs.arch=2c2f", "--json"], capsys)
    assert rc == 0, err
    d = json.loads(out)
    assert [s["head_params"] for s in d["stages"]] == [_infopro_2c2f(c) for c in (16, 32, 64)] + [0]
    assert [s["decoder_params"] for s in d["stages"]] == [_decoder(c) for c in (16, 32, 64)] + [0]
    assert [s["ema_params"] for s in d["stages"]] == [0, 0, 0, 0] and d["aux_head"] == "infopro"


def test_momentum_heads_show_trained_and_ema_parameters_apart(capsys):
    """PPLL's K = 16 recipe: 15 modules grouped [8, 3, 2, 2]. Module j's head copies module j+1's first
    block twice: within a group one copy is trained and one follows by EMA (state), at a group's end
    (modules 7, 10, 12) both are trained. Then 2c2f on the copy's channels. Figures from the layer list."""
    path = os.path.join(CONFIGS, "ppll_resnet32.py") + ":K=16"
    rc, out, err = _cli(["--config", path, "--json"], capsys)
    assert rc == 0, err
    d = json.loads(out)
    per_block = _resnet32_params()
    assert d["aux_head"] == "man" and d["module_groups"] == [8, 3, 2, 2] and len(d["stages"]) == 15
    ends = {7, 10, 12}
    for j, s in enumerate(d["stages"][:-1]):
        first = d["stages"][j + 1]["blocks"][0]  # the block the head copies
        block, channels = per_block[first], (16, 32, 64)[(first - 1) // 5]
        assert s["ema_params"] == (0 if j in ends else block), j
        assert s["head_params"] == (2 if j in ends else 1) * block + _infopro_2c2f(channels), j
        assert s["decoder_params"] == _decoder(channels)
    rc, text, _ = _cli(["--config", path], capsys)
    header = text.splitlines()[1].split()
    assert rc == 0 and header[-5:] == ["head", "decoder", "EMA", "head", "FLOPs"]


def test_methods_without_heads_report_none():
    """cdp-v2 (the default) trains no auxiliary head: none reported, no head columns in the text."""
    from cdpjax.commands.describe import format_text

    d = describe(default_config())
    assert d["method"] == "cdp-v2" and d["aux_head"] is None
    assert all(s[k] == 0 for s in d["stages"] for k in ("head_params", "decoder_params", "ema_params", "head_flops"))
    text = format_text(d)
    assert "no auxiliary heads" in text and "head" not in text.splitlines()[1]
    c = default_config()
    c.method = "local"
    assert describe(c)["aux_head"] == "greedy" and describe(c)["stages"][0]["head_params"] > 0


def test_module_groups_place_several_modules_on_a_device(capsys):
    path = os.path.join(CONFIGS, "ppll_resnet32.py") + ":K=16,recipe=infopro"  # 16 modules, the stem alone
    rc, out, err = _cli(["--config", path, "--config.module_groups=[9,3,2,2]", "--json"], capsys)
    assert rc == 0, err
    d = json.loads(out)
    assert [s["device"] for s in d["stages"]] == [0] * 9 + [1] * 3 + [2] * 2 + [3] * 2
    assert d["mesh"] == {"stage": 4, "data": -1} and [e["stages"] for e in d["devices"]][1] == [9, 10, 11]
    assert d["devices"][0]["params"] == sum(s["params"] for s in d["stages"][:9])


def test_data_axis_and_one_device_methods_put_every_stage_on_device_0():
    for method in ("dp", "cdp-v2", "e2e"):
        c = default_config()
        c.method = method
        assert {s["device"] for s in describe(c)["stages"]} == {0}
    c.method = "gpipe"
    assert [s["device"] for s in describe(c)["stages"]] == [0, 1, 2, 3]


@pytest.mark.parametrize("argv,match", [
    (["--config.module_groups=[2,1]"], "module_groups=\\[2, 1\\] must be positive and add up to the 4"),
    (["--config.module_groups=[0,4]"], "module_groups=\\[0, 4\\] must be a list of positive integers"),
    (["--config.model=resnet9"], "resnet9"),
    (["--config.aux_head=vit", "--config.method=ppll"], "token outputs"),
    (["--config.aux_head=man", "--config.aux_kwargs.ema_decay=1.0"], "ema_decay=1.0 must be in \\[0, 1\\)"),
    (["--config.aux_head=man", "--config.aux_kwargs.copy_depth=2"], "copy_depth=2 copies past local module 1"),
    (["--config.aux_head=infopro", "--config.aux_kwargs.loss='contrast'"], "give aux_kwargs.feature_dim"),
    (["--config.aux_head=mine"], "unknown auxiliary head 'mine'; registered: dgl, greedy, infopro, man"),
])
def test_bad_input_exits_2_with_one_line(argv, match, capsys, compiles):
    rc, out, err = _cli(["--config.method=ppll", *argv], capsys)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    import re

    assert re.search(match, err), err
    assert not [e for e in compiles if e[0] == "backend"], compiles


@pytest.mark.parametrize("argv,mesh", [
    # gpipe's default mesh: its 4 stages, `data` taking the rest; on 8 devices 8 / 4 = 2 replicas
    ([], "mesh {'stage': 4, 'data': -1} (data takes the devices the other axes leave: on 8 devices "
         "{'stage': 4, 'data': 2}, 2 pipeline replicas of 4 stage devices)"),
    # a mesh given whole: 4 replicas of a 2-stage pipeline
    (["--config.stages=2", "--config.mesh.stage=2", "--config.mesh.data=4"],
     "mesh {'data': 4, 'stage': 2} (4 pipeline replicas of 2 stage devices)"),  # the config's key order
])
def test_a_stage_axis_method_says_its_pipeline_replicas(argv, mesh, capsys):
    rc, out, err = _cli(["--config.method=gpipe", *argv], capsys)
    assert rc == 0, err
    assert f"for method gpipe, {mesh}, no auxiliary heads" in out.splitlines()[0], out
