# All set-up happens here: `make run` and `make test` install into .venv first when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test lint format quick bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,hf,lightning]'
	# megatron-core's indexed-dataset writer, for the tests that read its files (docs/data.md); without its
	# dependencies (numpy and torch are there), and where it cannot install (no wheel) those tests skip.
	-$(BIN)/pip install --quiet --no-deps megatron-core==0.16.1
	# The native 1-bit kernels, built once now rather than at the first run (where they cannot be
	# built, the torch path runs, and this says why).
	-$(BIN)/python -m zoa_train.comm.kernels.native
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/zoa-train run recipes/gpt2_tiny.yaml --overwrite

test: lint
	$(BIN)/python -m pytest

# For iterating: the format and lint checks, then every test not marked slow (a slow one starts a training
# run or a multi-process group of more than a few seconds; the marker is in pyproject.toml). `make test` runs everything.
quick: lint
	$(BIN)/python -m pytest -m "not slow"

# The formatter and the linter (ruff, settings in pyproject.toml): part of `make test`; `make format` applies both.
LINTED := zoa_train tests scripts examples
lint: $(STAMP)
	$(BIN)/ruff format --check --quiet $(LINTED)
	$(BIN)/ruff check --quiet $(LINTED)

format: $(STAMP)
	$(BIN)/ruff format --quiet $(LINTED)
	$(BIN)/ruff check --quiet --fix $(LINTED)

bench: $(STAMP)
	$(BIN)/zoa-train bench comm --sizes 1M,16M,64M --nproc 2 --repeats 10

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
