# Two commands do all the set-up on a fresh machine with Python >= 3.11:
#   make train        creates .venv if missing, installs cdpjax (what training needs), trains the default
#   make test         creates .venv if missing, installs cdpjax[test], runs the test suite
#   make test-latest  the core of the suite on the newest jax and flax that PyPI serves, in .venv-latest
#                     (Python 3.13: PYTHON_LATEST), reinstalled from PyPI on every call
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTHON_LATEST ?= python3.13
VENV_LATEST ?= .venv-latest
ARGS ?=
# The core of the suite for the newest jax and flax: configs, the time tables, every engine against
# its reference, checkpoints and resume, the command line (the notebooks and the heavy runs stay out).
CORE_TESTS ?= tests/test_configs.py tests/test_timetable.py tests/test_foundation.py tests/test_cdp.py \
	tests/test_gpipe.py tests/test_local_ppll.py tests/test_models.py tests/test_user_experience.py

.PHONY: train test test-heavy test-latest install

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed-train: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@ $(VENV)/.installed-train

install: $(VENV)/.installed-train

train: $(VENV)/.installed-train
	$(BIN)/cdpjax train $(ARGS)

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -n 2 --dist loadfile $(ARGS)

test-heavy: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -m heavy $(ARGS)

test-latest:
	test -x $(VENV_LATEST)/bin/python || $(PYTHON_LATEST) -m venv $(VENV_LATEST)
	$(VENV_LATEST)/bin/python -m pip install --quiet --upgrade pip
	$(VENV_LATEST)/bin/python -m pip install --quiet --upgrade --upgrade-strategy eager -e '.[test]'
	$(VENV_LATEST)/bin/python -c "import jax, flax, sys; print('test-latest: Python', sys.version.split()[0], \
	'jax', jax.__version__, 'flax', flax.__version__)"
	$(VENV_LATEST)/bin/python -m pytest -q -n 2 --dist loadfile $(CORE_TESTS) $(ARGS)
