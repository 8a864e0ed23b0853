# All set-up happens here: `make run` and `make test` install into .venv first when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/zoa-train run recipes/gpt2_tiny.yaml --overwrite

test: $(STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/zoa-train bench comm --sizes 1M,16M,64M --nproc 2 --repeats 10

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
