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

.PHONY: run test lint e2e bench clean lock mcp-servers test-newer-python

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

# The appliance runs nixpkgs' Python (3.12 or newer), where `nix flake check` runs the tests;
# this machine's may be 3.11. `make test` runs the whole suite again under the newest Python
# 3.12+ it finds (NEWER_PYTHON, else python3.12+ on PATH or among pyenv's versions), in an
# environment of its own: the IPC loop has a branch for it (mdclaw.outbox.EAGER_START), and
# whole runs under 3.13 found what 3.11 cannot (the web fetch's 6to4 rule, 2002::/16 being
# private there; stops that spun forever on 3.12's gather: tests/test_aio.py). NEWER_TESTS
# narrows it (`make test-newer-python NEWER_TESTS=tests/test_outbox.py`). Without such a
# Python the pass is skipped, with a notice; in CI (CI set) that is a failure.
NEWER_VENV := $(VENV)/newer
NEWER_TESTS ?=
find_newer_python = for p in $${NEWER_PYTHON:-} python3.14 python3.13 python3.12 \
	$$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.1[2-9]*/bin/python3 2>/dev/null \
	| sort -rV); do "$$p" -c 'import sys; sys.exit(sys.version_info < (3, 12))' \
	2>/dev/null && { command -v "$$p"; break; }; done

test-newer-python:
	@py="$$($(find_newer_python))"; \
	if [ -z "$$py" ]; then \
		echo "test-newer-python: no Python 3.12+ found (set NEWER_PYTHON): the appliance's Python is untested here"; \
		[ -z "$${CI:-}" ]; exit $$?; \
	fi; \
	if [ ! -f $(NEWER_VENV)/.installed ] || [ requirements.lock -nt $(NEWER_VENV)/.installed ] \
		|| [ "$$(cat $(NEWER_VENV)/.python 2>/dev/null)" != "$$py" ]; then \
		rm -rf $(NEWER_VENV) && "$$py" -m venv $(NEWER_VENV) && \
		$(NEWER_VENV)/bin/python -m pip install --quiet --require-hashes -r requirements.lock && \
		$(NEWER_VENV)/bin/python -m pip install --quiet --no-deps --no-build-isolation -e . && \
		echo "$$py" > $(NEWER_VENV)/.python && touch $(NEWER_VENV)/.installed || exit 1; \
	fi; \
	echo "test-newer-python: $$($(NEWER_VENV)/bin/python -V)"; \
	$(NEWER_VENV)/bin/python -m pytest $(NEWER_TESTS) $(PYTEST_ARGS)

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
	$(MAKE) --no-print-directory test-newer-python

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check mdclaw container tests bench
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache

e2e: $(VENV)/.installed $(MCP_VENV)/.installed
	$(PY) -m pytest -m e2e $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
