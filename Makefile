# Every target sets itself up: a .venv with torch 2.13.0 (CPU) and the project.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.zeroshard-installed

.PHONY: test bench lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,cuda]'
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

test: lint
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) benchmarks/adam.py

clean:
	rm -rf $(VENV) .pytest_cache
