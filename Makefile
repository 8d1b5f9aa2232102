# The one place commands live. `make demo` and `make test` are the two README commands.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: demo report-demo test lint format bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[test]'
	touch $@

# Train the demo model on the embedded corpus (CPU, ~10 minutes on 2 cores).
demo: $(VENV)/.installed
	$(BIN)/jaxtrain train --output_dir runs/demo --overwrite_output_dir true

# A short real run (~4 minutes on 2 CPU cores); its report is the README's docs/report.png.
report-demo: $(VENV)/.installed
	$(BIN)/jaxtrain train --output_dir runs/report-demo --overwrite_output_dir true \
		--max_steps 240 --eval_steps 60 --track_memory true --weight_distribution_log_steps 60
	mkdir -p docs && cp runs/report-demo/report.png docs/report.png

lint: $(VENV)/.installed-test
	$(BIN)/ruff check jaxtrain tests bench
	$(BIN)/ruff format --check jaxtrain tests bench

format: $(VENV)/.installed-test
	$(BIN)/ruff format jaxtrain tests bench
	$(BIN)/ruff check --fix jaxtrain tests bench

test: lint
	$(BIN)/pytest -q $(PYTEST_ARGS)

bench: $(VENV)/.installed
	$(BIN)/python bench/overhead.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
