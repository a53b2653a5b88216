# The two set-up commands of the README: `make run` and `make test`. Both create .venv and install what they need.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
export HF_HUB_OFFLINE := 1
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_AUTH_MODE := disabled
export NO_MKDOCS_2_WARNING := 1  # Material 9.x's banner about MkDocs 2

.PHONY: install system-tools run lint test test-fast test-integration test-e2e bench docs docs-build

$(STAMP): pyproject.toml
	@echo "make install: creating $(VENV) (Python 3.11) and installing kvgrid with its test tools into it"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install --quiet --upgrade pip
	@echo "  pip install -e '.[test]': torch 2.13 (CPU), Ray 2.60, transformers, FastAPI, Redis, the OpenAI, Anthropic"
	@echo "  and Gemini SDKs, pytest, ruff, mypy, MkDocs (a few minutes the first time; pip's own log follows)"
	@bash -o pipefail -c "$(PY) -m pip install --progress-bar off -e '.[test]' 2>&1 | tee $(VENV)/pip-install.log \
		| sed -nu -E 's/^(Collecting|Successfully installed)(.{0,96}).*/  \\1\\2/p'" \
		|| (echo "make install: pip failed; its log:"; tail -30 $(VENV)/pip-install.log; exit 1)
	@touch $(STAMP)
	@echo "make install: done ($(VENV)/bin/kvgrid --version: `$(VENV)/bin/kvgrid --version`)"

install: $(STAMP)

run: install
	$(VENV)/bin/kvgrid serve --config router/demo.yaml

# Lint and type checks (configured in pyproject.toml): ruff's linter, its formatter in check mode, mypy.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# tests/e2e/test_ray_up.py runs Ray's cluster launcher, which copies files to the nodes with rsync (Debian: apt-get, as
# root). Best effort: without rsync (offline, not root) that one test is skipped, saying why.
system-tools:
	@command -v rsync >/dev/null || (apt-get update -qq && apt-get install -y -qq rsync) || \
		echo "rsync could not be installed: tests/e2e/test_ray_up.py will be skipped"
	@command -v cc >/dev/null || command -v gcc >/dev/null || (apt-get update -qq && apt-get install -y -qq gcc) || \
		echo "no C compiler could be installed: the CPU decode kernel's tests will be skipped"

test: install lint system-tools
	$(PY) -m pytest -q --durations=25

# The tests come in three tiers: tests/unit (no Redis, Ray or server: the quick loop, under 2 minutes),
# tests/integration (a real Redis or Ray, in-process gateways, subprocesses) and tests/e2e (a real `kvgrid serve`
# over HTTP). `make test` runs all three (CI); `make test-fast` the unit tier.
test-fast: install
	$(PY) -m pytest -q tests/unit

test-integration: install
	$(PY) -m pytest -q tests/integration

test-e2e: install
	$(PY) -m pytest -q tests/e2e

bench: install
	$(VENV)/bin/kvgrid bench engine

# The documentation site (docs/, mkdocs.yml): served with live reload on 127.0.0.1:8001, or built strictly into site/.
docs: install
	$(VENV)/bin/mkdocs serve --dev-addr 127.0.0.1:8001

docs-build: install
	$(PY) docs/gen_config_reference.py
	$(VENV)/bin/mkdocs build --strict
