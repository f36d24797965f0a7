# Two entry points for a fresh machine (see README.md): `make demo` and `make test`.
# Needs Python 3.11+, Java 17+ and Maven; everything else is installed into .venv from pyproject.toml.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: install tools demo test lint format unit integration docs clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

install: $(VENV)/.installed

# Servers and tools the tests drive that are not Python packages: Java and Maven (the Kafka broker),
# Prometheus and promtool (the ops checks). Installed from Debian's packages when missing and run as root;
# otherwise the script says what to install.
tools:
	deploy/local/ensure-tools

demo: install
	@command -v java >/dev/null && command -v mvn >/dev/null || deploy/local/ensure-tools
	$(BIN)/postbox dev demo

lint: install
	$(BIN)/ruff check relay inbox postbox tests examples
	$(BIN)/ruff format --check relay inbox postbox tests examples
	$(BIN)/mypy
	$(BIN)/lint-imports

format: install
	$(BIN)/ruff format relay inbox postbox tests examples
	$(BIN)/ruff check --fix relay inbox postbox tests examples

unit: install
	$(BIN)/pytest tests/unit

integration: install
	$(BIN)/pytest tests/integration

# The documentation site (docs/, mkdocs.yml) into site/. --strict: any warning fails it, a link to a page or a
# heading that does not exist included.
docs: install
	$(BIN)/mkdocs build --strict --site-dir site

# Quality gates and the docs build first, then every test (unit, then integration against real servers the
# fixtures start).
test: tools lint docs
	$(BIN)/pytest

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache site
