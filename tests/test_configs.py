"""Every experiment config loads, says what it reproduces and what it should reach, and validates."""
import glob
import os

import pytest

from cdpjax.config import ConfigError, load_file, parse_arg

CONFIGS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "cdpjax", "configs", "[a-z]*.py")))


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_loads_and_documents_itself(path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("cfg", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    doc = module.__doc__ or ""
    assert ("cdpjax train --config" in doc or "cdpjax bench --config" in doc) and "Expected" in doc, \
        "docstring must give the command and the target"
    c = load_file(path)
    for key in ("method", "model", "dataset", "global_batch_size", "num_steps", "mesh", "stages", "learning_rate"):
        assert key in c


def test_config_argument_syntax(tmp_path):
    path = CONFIGS[0]
    assert parse_arg("a=1,b=x", a=0, b="y") == {"a": 1, "b": "x"}
    with pytest.raises(ConfigError, match="'zz' is not one of"):
        parse_arg("zz=1", a=0)
    c = load_file(os.path.join(os.path.dirname(path), "digits.py") + ":method=dp")
    assert c.method == "dp"


# The configs shipped in the package, by name ------------------------------------------------------

SHIPPED = ["bench_resnet18", "bench_resnet32", "cdp_cifar10", "cdp_imagenet", "charlm", "digits", "lm_shakespeare",
           "ppll_resnet32", "ppll_vit"]  # the files of cdpjax/configs/, written out


def test_every_config_file_is_named():
    from cdpjax.config import config_names

    assert config_names() == SHIPPED == [os.path.basename(p)[:-3] for p in CONFIGS]


def test_a_name_loads_the_shipped_file(tmp_path, monkeypatch):
    """`digits:method=ppll` is cdpjax/configs/digits.py's get_config("method=ppll"), from any
    working directory; a path names the user's file, even one called digits.py."""
    folder = os.path.dirname(CONFIGS[0])
    monkeypatch.chdir(tmp_path)
    by_name, by_path = load_file("digits:method=ppll"), load_file(os.path.join(folder, "digits.py") + ":method=ppll")
    assert by_name.method == "ppll" and by_name.to_dict() == by_path.to_dict()
    resnet = load_file(os.path.join(folder, "ppll_resnet32.py:K=16"))
    assert load_file("ppll_resnet32:K=16").to_dict() == resnet.to_dict()
    (tmp_path / "digits.py").write_text("from cdpjax.config import default_config\n\n"
                                     "def get_config():\n    c = default_config()\n    c.num_steps = 7\n    return c\n")
    assert load_file("digits.py").num_steps == 7 and load_file("digits").num_steps == by_path.num_steps != 7


def test_an_unknown_name_is_one_line_listing_the_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        load_file("digit:method=dp")
    message = str(e.value)
    assert "\n" not in message and message.startswith("config 'digit' is neither a file nor")
    assert all(name in message for name in SHIPPED)
