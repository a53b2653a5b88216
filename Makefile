# The two set-up commands of the README: `make run` and `make test`. Both create .venv and install what they need.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
export HF_HUB_OFFLINE := 1
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_AUTH_MODE := disabled

.PHONY: install system-tools run lint test test-fast bench

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

run: install
	$(VENV)/bin/kvgrid serve --config router/demo.yaml

# Lint and type checks (configured in pyproject.toml): ruff's linter, its formatter in check mode, mypy.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# tests/test_ray_up.py runs Ray's cluster launcher, which copies files to the nodes with rsync (Debian: apt-get, as
# root). Best effort: without rsync (offline, not root) that one test is skipped, saying why.
system-tools:
	@command -v rsync >/dev/null || (apt-get update -qq && apt-get install -y -qq rsync) || \
		echo "rsync could not be installed: tests/test_ray_up.py will be skipped"
	@command -v cc >/dev/null || command -v gcc >/dev/null || (apt-get update -qq && apt-get install -y -qq gcc) || \
		echo "no C compiler could be installed: the CPU decode kernel's tests will be skipped"

test: install lint system-tools
	$(PY) -m pytest -q --durations=25

# The quick loop: every test but the slow ones (Ray, kvgrid serve, anything over a few seconds). CI runs `make test`.
test-fast: install
	$(PY) -m pytest -q -m "not slow"

bench: install
	$(VENV)/bin/kvgrid bench engine
