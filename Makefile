# Two commands do all the set-up on a fresh machine with Python >= 3.10:
#   make train   creates .venv if missing, installs cdpjax, trains the default (CDP-v2 on digits)
#   make test    creates .venv if missing, installs cdpjax[test], runs the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=

.PHONY: train test test-heavy install

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed

train: $(VENV)/.installed
	$(BIN)/cdpjax train $(ARGS)

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q -n 2 --dist loadfile $(ARGS)

test-heavy: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m heavy $(ARGS)
