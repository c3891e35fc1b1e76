# Fresh-machine entry points: `make demo` (main job) and `make test` (test suite).
VENV := .venv
PY := $(VENV)/bin/python
# Debian's interpreter: the Triton Python-backend stub links its libpython.
BASE_PYTHON := /usr/bin/python3

.PHONY: install demo test test-deps test-fast test-slow lint

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(BASE_PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e ".[dev]"
	touch $@

demo: install
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH bash scripts/demo.sh

# What the slow tests need once per machine, kept outside (the tests also call these, and
# they return at once when done): the load tools (test_perf) and, where podman is, the
# compose test's image, built from this checkout.
test-deps: install
	bash scripts/perf_tools.sh >/dev/null
	if command -v podman >/dev/null; then bash scripts/build_image.sh; fi

test: lint test-deps
	$(VENV)/bin/pytest -q -rs --durations=15

# Everyday tier: unit and in-process tests, no tritonserver.
test-fast: lint
	$(VENV)/bin/pytest -q -rs -m "not slow"

# The tier that starts real tritonservers and processes (a SIGTERM, e.g. from `timeout`,
# tears its clusters down: scripts/check_run_teardown.sh checks that none is left).
test-slow: install
	$(VENV)/bin/pytest -q -rs -m slow

lint: install
	$(VENV)/bin/ruff check .
	bash scripts/lint_repo.sh
