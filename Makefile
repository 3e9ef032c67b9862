# Two commands for a fresh Linux machine with Python 3.11+:
#   make run    run mdclaw on embedded defaults (SQLite, local HTTP channel) with config.example.yaml
#   make test   lint (ruff, mypy, the import contract), then run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: run test lint e2e bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[test,lint,claude,whatsapp]'
	touch $@

run: $(VENV)/.installed
	$(if $(DATA_DIR),MDCLAW_DATA_DIR=$(DATA_DIR) )$(VENV)/bin/mdclaw run --config config.example.yaml

test: lint $(VENV)/.installed
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check mdclaw container tests bench
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache

e2e: $(VENV)/.installed
	$(PY) -m pytest -m e2e $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
