"""Every experiment config loads, says what it reproduces and what it should reach, and validates."""
import glob
import os

import pytest

from cdpjax.config import ConfigError, load_file, parse_arg

CONFIGS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "experiments", "configs", "*.py")))


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
