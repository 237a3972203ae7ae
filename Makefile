# trl-statelens: `make install`, `make test`, `make demo`, `make lint`, `make bench`.
# `make test` and `make demo` do the install first when needed (a stamp file), so each works on a fresh clone.

VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install test lint demo bench lab clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	@# With no CUDA, take the CPU build of torch that is on local disk first; a bare `torch` requirement
	@# would otherwise pull a multi-GB CUDA build.
	@if command -v nvidia-smi >/dev/null 2>&1; then \
		echo "CUDA found: pip resolves torch itself"; \
	else \
		echo "no CUDA: installing torch==2.13.0 (CPU build)"; \
		$(BIN)/pip install --quiet torch==2.13.0; \
	fi
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/pytest -q

lint: $(STAMP)
	$(BIN)/ruff check trl_statelens tests
	$(BIN)/ruff format --check trl_statelens tests

lab: $(STAMP)
	$(BIN)/statelens lab build

# Completed by the recipes issue: the main job is `accelerate launch recipes/opd.py` on the lab default.
demo: $(STAMP)
	@echo "make demo: the OPD recipe is not built yet; for now it builds the lab and prints its scores"
	$(BIN)/statelens lab build
	$(BIN)/statelens lab info

# Completed by the benchmarks issue.
bench: $(STAMP)
	@echo "make bench: no benchmarks yet (see the benchmarks issue)"

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
