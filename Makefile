# The two commands: `make run` (install into .venv, serve http://localhost:8080) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# VOICE_AGENT_HOST / VOICE_AGENT_PORT as for `voice-agent serve` (the flags below would
# override them): `VOICE_AGENT_HOST=127.0.0.1 make run` listened on every interface.
HOST ?= $(or $(VOICE_AGENT_HOST),0.0.0.0)
PORT ?= $(or $(VOICE_AGENT_PORT),8080)
ARGS ?=
TINY_MODEL := models/tiny

.PHONY: install run run-tiny test lint typecheck unit bench clean

# A .venv whose scripts cannot start (the Python they name removed, the checkout moved) is
# removed and built again: the stamp alone kept it, and `make run` failed until `make clean`.
# The script itself is run (0.3 s): in a path with a space pip writes a "#!/bin/sh" shebang
# and an exec line, and reading the shebang for the Python deleted a working .venv each time.
VENV_STARTS := $(shell $(BIN)/voice-agent --help >/dev/null 2>&1 && echo yes)
ifneq ($(VENV_STARTS),yes)
$(shell rm -rf $(VENV))
endif

$(STAMP): pyproject.toml
	$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), "Python 3.11 is required"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# Serves the browser client; the first start downloads ChatTTS (~1 GB) with progress output.
run: install
	$(BIN)/voice-agent serve --host $(HOST) --port $(PORT) $(ARGS)

# Offline smoke test of the whole path on a tiny random-weight ChatTTS (speaks noise-like audio).
run-tiny: install
	test -f $(TINY_MODEL)/manifest.json || $(BIN)/voice-agent tiny-model $(TINY_MODEL)
	$(BIN)/voice-agent serve --host $(HOST) --port $(PORT) --model-dir $(TINY_MODEL) $(ARGS)

lint: install
	$(BIN)/ruff check .

typecheck: install
	$(BIN)/mypy

# Two passes. Most tests wait on real-time audio rather than compute, so they run in parallel
# (one worker per logical CPU or PYTEST_XDIST_AUTO_NUM_WORKERS, at most 4; a file's tests stay
# on one worker, which keeps module-scoped servers and Ray to one instance). Tests marked
# `serial` measure real-time figures (packet rate, gaps, concealment) that a busy neighbour
# would skew: they run after, alone. Both passes always run; either failing fails the target,
# as does pytest's exit 5 (nothing collected). Each pass lists its slowest tests, to keep the
# suite inside CI's 15-minute budget.
test: lint typecheck
	$(BIN)/pytest -q -n logical --maxprocesses 4 --dist loadfile -m "not serial" --durations=30; parallel=$$?; \
	$(BIN)/pytest -q -m serial --durations=15; serial=$$?; \
	test $$parallel -eq 0 && test $$serial -eq 0

bench: install
	$(BIN)/python bench/streams.py --quick
	$(BIN)/python bench/latency.py --quick

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
