# The two commands a user needs: `make demo` and `make test`. Both set everything up first:
# a virtualenv at .venv/ with draplane installed, and the real servers built from Go modules
# into ~/.cache/draplane/bin (once; later runs reuse them).

PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: setup servers test test-unit demo bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[test]'
	touch $(STAMP)

setup: $(STAMP) servers

servers: $(STAMP)
	$(VENV)/bin/python -m draplane.localenv.binaries

test: setup
	$(VENV)/bin/pytest $(PYTEST_ARGS)

# Pure-core tests only: no servers, a few seconds.
test-unit: $(STAMP)
	$(VENV)/bin/pytest -m "not integration" $(PYTEST_ARGS)

demo: setup
	$(VENV)/bin/draplane demo

bench: $(STAMP)
	for script in bench/*.py; do $(VENV)/bin/python $$script || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
