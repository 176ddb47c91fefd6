# The two commands a user needs: `make demo` and `make test`. Both set everything up first:
# a virtualenv at .venv/ with draplane installed, the real servers built from Go modules
# into ~/.cache/draplane/bin, and the kubelet's gRPC stubs generated into
# ~/.cache/draplane/kubelet-api (once; later runs reuse them).

PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: node-packages setup servers chromium test test-unit demo bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[test]'
	touch $(STAMP)

setup: $(STAMP) servers

servers: $(STAMP)
	$(VENV)/bin/python -m draplane.localenv.binaries
	$(VENV)/bin/python -m draplane_node_agent.kubelet_api

# Headless Chromium for the dashboard's browser test: Debian's package, installed when missing
# where we are root with apt (a CI machine); elsewhere install it, or set DRAPLANE_CHROMIUM. The
# test runs this target itself too, and fails (under CI) or skips with its output when it fails.
# The real node's runtime parts that come from Debian (draplane.localenv.realnode): runc, the CNI
# plugins, and busybox-static for its images. Installed the same way as Chromium.
NODE_PACKAGES := runc containernetworking-plugins busybox-static
node-packages:
	@if [ -x /usr/sbin/runc ] && [ -x /usr/lib/cni/bridge ] && [ -x /usr/bin/busybox ]; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then \
	  echo "the real node needs Debian's $(NODE_PACKAGES): install them as root" >&2; exit 1; fi; \
	export DEBIAN_FRONTEND=noninteractive; \
	apt-get install -y --no-install-recommends $(NODE_PACKAGES) \
	  || { apt-get update && apt-get install -y --no-install-recommends $(NODE_PACKAGES); }

CHROMIUM_PACKAGES := chromium fonts-dejavu-core
chromium:
	@if [ -n "$$DRAPLANE_CHROMIUM" ] || command -v chromium >/dev/null 2>&1; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then \
	  echo "chromium is missing: install Debian's chromium package, or set DRAPLANE_CHROMIUM" >&2; exit 1; fi; \
	export DEBIAN_FRONTEND=noninteractive; \
	apt-get install -y --no-install-recommends $(CHROMIUM_PACKAGES) \
	  || { apt-get update && apt-get install -y --no-install-recommends $(CHROMIUM_PACKAGES); }

# Three pytest processes side by side (tests/parallel_suite.py): the pure-core tests, the tests that
# run whole environments (up, the demo, chaos, the real node), and the other integration tests.
# Integration tests mostly wait on servers, so CI's wall time drops; each group's output is printed
# when all are done, and the run fails if any group fails.
test: setup
	-@$(MAKE) --no-print-directory chromium
	-@$(MAKE) --no-print-directory node-packages
	$(VENV)/bin/python -m draplane.localenv.binaries --with-test-servers
	$(VENV)/bin/python tests/parallel_suite.py $(PYTEST_ARGS)

# Pure-core tests only: no servers, about 2 minutes.
test-unit: $(STAMP)
	$(VENV)/bin/pytest -m "not integration" $(PYTEST_ARGS)

# The demo's last step runs its pod on the real node, which needs the node packages.
demo: setup
	-@$(MAKE) --no-print-directory node-packages
	$(VENV)/bin/draplane demo

bench: $(STAMP)
	for script in bench/*.py; do $(VENV)/bin/python $$script || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
