# The README's two commands: `make demo` (the main job) and `make test` (the whole suite).
# Both create .venv on first use and install the pinned project into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# No model or dataset download, ever: everything runs on the bundled models under assets/.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export WANDB_MODE ?= disabled

.PHONY: install demo test lint format

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

demo: install
	$(PY) -m scripts.demo

test: install lint
	$(PY) -m pytest

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: install
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .
