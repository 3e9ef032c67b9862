# Two commands for a fresh Linux machine with Python 3.11+:
#   make run    run mdclaw on embedded defaults (SQLite, local HTTP channel) with config.example.yaml
#   make test   lint (ruff, mypy, the import contract), then run the test suite
#   make lock   refresh requirements.lock (on purpose: then run make test and commit it)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The extras `make` installs. requirements.lock pins them, the dependencies and the build
# backend, with hashes; tests/test_lock.py checks it covers pyproject.toml.
EXTRAS := test lint claude whatsapp email slack discord matrix age push
UV_VERSION := 0.13.9
LOCK_ARGS ?= --upgrade

# The MCP servers the tests run (tests/mcp_servers/requirements.lock), in an environment of
# their own: the host never imports them, it runs them.
MCP_VENV := $(VENV)/mcp-servers

.PHONY: run test lint e2e bench clean lock mcp-servers

$(VENV)/.installed: requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --require-hashes -r requirements.lock
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

$(MCP_VENV)/.installed: tests/mcp_servers/requirements.lock
	$(PYTHON) -m venv $(MCP_VENV)
	$(MCP_VENV)/bin/python -m pip install --quiet --require-hashes \
		-r tests/mcp_servers/requirements.lock
	touch $@

mcp-servers: $(MCP_VENV)/.installed

# Every version the newest pyproject.toml allows (LOCK_ARGS= keeps the pins that still fit).
lock:
	test -x $(VENV)/bin/uv || { $(PYTHON) -m venv $(VENV) && \
		$(PY) -m pip install --quiet 'uv==$(UV_VERSION)'; }
	$(PY) -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"], sep="\n")' \
		| $(VENV)/bin/uv pip compile pyproject.toml - $(addprefix --extra ,$(EXTRAS)) \
		--universal --python-version 3.11 --generate-hashes --quiet \
		--custom-compile-command 'make lock' $(LOCK_ARGS) -o requirements.lock
	$(VENV)/bin/uv pip compile tests/mcp_servers/requirements.in --universal \
		--python-version 3.11 --generate-hashes --quiet --custom-compile-command 'make lock' \
		$(LOCK_ARGS) -o tests/mcp_servers/requirements.lock

run: $(VENV)/.installed
	$(if $(DATA_DIR),MDCLAW_DATA_DIR=$(DATA_DIR) )$(VENV)/bin/mdclaw run --config config.example.yaml

test: lint $(VENV)/.installed $(MCP_VENV)/.installed
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check mdclaw container tests bench
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache

e2e: $(VENV)/.installed $(MCP_VENV)/.installed
	$(PY) -m pytest -m e2e $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
