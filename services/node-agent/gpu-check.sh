#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: run the nvml discovery backend, print the devices the node agent
# would publish, and assert the H200 expectations (tests/services/node-agent/test_nvml_discovery.py).
# Needs only msgspec, pyyaml, nvidia-ml-py and pytest: PYTHON may name any interpreter that has them.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-.venv/bin/python}"
export PYTHONPATH="shared:services/node-agent:services/inventory${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,compute_cap,driver_version,pci.bus_id --format=csv || true
"$PYTHON" -m draplane_node_agent --backend nvml --node "$(hostname)" --print
"$PYTHON" -m pytest -p no:cacheprovider -o addopts= -q -s -m gpu tests/services/node-agent/test_nvml_discovery.py -k real_h200 \
  --confcutdir=tests/services/node-agent
