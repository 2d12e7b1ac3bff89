"""What `pip install cdpjax` gives a researcher: a wheel that holds the configs (named on the command
line without a checkout), the data it embeds and `python -m cdpjax`; and install bounds that pip
can satisfy."""
import os
import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The configs the README and the notebooks name, and the embedded corpus: written out, not globbed.
SHIPPED = ["bench_resnet18", "bench_resnet32", "cdp_cifar10", "cdp_imagenet", "charlm", "digits", "lm_shakespeare",
           "ppll_resnet32", "ppll_vit"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    """The wheel pip builds from this checkout (its build requirements from PyPI or pip's cache)."""
    out = tmp_path_factory.mktemp("wheel")
    env = {k: v for k, v in os.environ.items() if k != "PIP_NO_INDEX"}
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
                          capture_output=True, text=True, env=env, cwd=out)
    if proc.returncode != 0 and "Could not find a version that satisfies the requirement setuptools" in proc.stderr:
        pytest.skip("no PyPI and no setuptools >= 77 in pip's cache: the wheel cannot be built here")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = out.glob("cdpjax-*.whl")
    return path


def test_the_wheel_holds_the_configs_the_corpus_and_main(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"cdpjax/configs/{n}.py" for n in SHIPPED} <= names
    assert {"cdpjax/configs/__init__.py", "cdpjax/__main__.py", "cdpjax/data/coriolanus.txt"} <= names
    assert not [n for n in names if n.startswith(("tests/", "experiments/", "colab/"))]


def test_the_installed_wheel_trains_configs_by_name(wheel, tmp_path):
    """The wheel installed on its own (its dependencies those of this environment), run from a folder
    with no checkout: `python -m cdpjax train --config digits:method=ppll` and `--config charlm` train
    from the configs the wheel holds."""
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                           str(wheel)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": str(site)}
    where = subprocess.run([sys.executable, "-c", "import cdpjax; print(cdpjax.__file__)"], capture_output=True,
                           text=True, env=env, cwd=tmp_path)
    assert where.stdout.strip() == str(site / "cdpjax" / "__init__.py"), where.stderr
    for config in ("digits:method=ppll", "charlm:steps=2,stages=1,window=8"):
        work = tmp_path / config.split(":")[0]
        run = subprocess.run([sys.executable, "-m", "cdpjax", "train", "--config", config, "--config.num_steps", "2",
                              "--config.eval_every", "0", "--workdir", str(work), "--no-progress"],
                             capture_output=True, text=True, env=env, cwd=tmp_path)
        assert run.returncode == 0, run.stderr[-3000:]
        assert (work / "summary.json").is_file() and "after 2 steps" in run.stdout + run.stderr, run.stderr


def test_install_bounds_are_what_works():
    """requires-python and the lower bounds of jax and flax, as measured (pyproject.toml's comments):
    jax 0.10 and flax 0.12 need Python 3.11; flax before 0.12.8 calls jax.core.get_opaque_trace_state,
    gone in jax 0.12; chex is the tests' alone and importlib_resources is imported by nothing."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.11"
    deps = {d.split(">=")[0].split("[")[0]: d for d in project["dependencies"]}
    assert deps["jax"] == "jax>=0.10" and deps["flax"] == "flax>=0.12.8"
    assert "chex" not in deps and "importlib_resources" not in deps
    assert any(d.startswith("chex") for d in project["optional-dependencies"]["test"])
    for package in ("chex", "importlib_resources"):
        used = [p for p in (ROOT / "cdpjax").rglob("*.py") if f"import {package}" in p.read_text()]
        assert not used, used


@pytest.mark.heavy
def test_python_3_10_is_refused_up_front(tmp_path):
    """pip on Python 3.10 refuses cdpjax at once (requires-python), not after a failed resolution.
    Needs python3.10 and PyPI (the build requirements)."""
    import glob

    pyenv = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.10*/bin/python3.10")))
    python = pyenv[-1] if pyenv else "python3.10"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_NO_INDEX")}
    try:
        proc = subprocess.run([python, "-m", "pip", "install", "--dry-run", "--no-deps", str(ROOT)],
                              capture_output=True, text=True, env=env, cwd=tmp_path)
    except FileNotFoundError:
        pytest.skip("no python3.10 here")
    if proc.returncode != 0 and "requires a different Python" not in proc.stderr and "python3.10" in proc.stderr:
        pytest.skip(f"python3.10 does not run here: {proc.stderr.strip()[:200]}")
    assert proc.returncode != 0 and "requires a different Python" in proc.stderr and "'>=3.11'" in proc.stderr
