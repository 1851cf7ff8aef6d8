# Every target sets itself up: a .venv with torch 2.13.0 (CPU) and the project.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.zeroshard-installed

.PHONY: demo test test-fast coverage faults bench docs lint clean

$(STAMP): pyproject.toml
	@echo "== setting up $(VENV): torch 2.13.0 (CPU), JAX, CuPy and the test tools (a few minutes the first time)"
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install --progress-bar on torch==2.13.0
	$(PY) -m pip install --progress-bar on -e '.[dev,cuda]'
	touch $(STAMP)
	@echo "== $(VENV) is ready"

# mypy on two processes: a fresh clone's first check (no cache) 22.8 s against 28.3 s.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	MYPY_NUM_WORKERS=2 $(VENV)/bin/mypy

# Two workers, one per core: torch's OpenMP pool takes one thread in each worker,
# notebook kernel and launched rank (its default, a thread per core in every
# process, oversubscribes the cores: 26.4 against 23.9 CPU minutes for the suite).
# Bytecode is written even where the environment says not to: every process the
# suite starts (workers, kernels, launched ranks) would otherwise compile the
# library's modules again, and each worker rewrite every test module's asserts
# (collecting the suite: 12.2-13.6 CPU s each time against 7.6-8.1 once cached).
TEST_ENV := OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=

# Every test on two workers (each idle one takes the next test), the slowest 50
# listed at the end.
test: lint
	$(TEST_ENV) $(PY) -m pytest -n 2 --dist worksteal --durations=50

# The edit loop: no process launches, network namespaces, notebooks or slow
# cases (see the markers in pyproject.toml and tests/conftest.py), on two
# workers; `make test` stays CI's command. No persistent JAX compile cache: the
# first run, which fills it, took 3:42 against 2:16 without one, and a warm one
# saved 15 s (2:03).
FAST := not multiprocess and not netns and not notebook and not slow
test-fast: lint
	$(TEST_ENV) $(PY) -m pytest -n 2 -m "$(FAST)" --durations=20

# Line coverage of the library by the fast tier (the full suite: COVER="").
COVER ?= -m "$(FAST)"
coverage: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest -n 2 -q $(COVER) --cov=shard --cov=ops --cov=interop --cov-report=term

# Bugs planted one at a time in copies of the tree, each of which the tests
# that cover its code must catch (tests/planted_faults.py).
faults: $(STAMP)
	$(PY) tests/planted_faults.py

# The docs site in site/, built strict (a broken link or reference, or a public
# name without a docstring, fails it), the notebooks executed into their pages.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -f docs/mkdocs.yml

# A real ZeRO-3 run: a GPT on Python's standard library sources, 2 CPU ranks (gloo),
# stopped at step 1000 with a checkpoint, resumed from it to step 1500, then sampled.
DEMO_DIR ?= runs/demo
demo: $(STAMP)
	rm -rf $(DEMO_DIR)
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --nproc-per-node 2 examples/gpt.py --stage 3 \
		--steps 1000 --save $(DEMO_DIR) --sample 0
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --nproc-per-node 2 examples/gpt.py --stage 3 \
		--steps 1500 --save $(DEMO_DIR) --resume

bench: $(STAMP)
	$(PY) -m pip install -q deepspeed -c constraints-bench.txt
	$(PY) benchmarks/overhead.py --threads --jax
	$(PY) benchmarks/adam.py
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --nproc-per-node 2 benchmarks/collectives.py gloo
	$(PY) benchmarks/collectives.py threads --world 2
	$(PY) benchmarks/e2e.py --profile
	$(PY) benchmarks/offload.py
	$(PY) benchmarks/pipeline.py
	$(PY) benchmarks/convergence.py

clean:
	rm -rf $(VENV) .pytest_cache site
