"""The import layers of pyproject.toml's [tool.importlinter] contracts (the README's layout, as an
import-linter contract, as kopf keeps its own): kept by the code, and broken by a deliberately bad
import, so the check is known to bite."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "draplane": ROOT / "shared" / "draplane",
    "draplane_allocator": ROOT / "services" / "allocator" / "draplane_allocator",
    "draplane_binder": ROOT / "services" / "binder" / "draplane_binder",
    "draplane_inventory": ROOT / "services" / "inventory" / "draplane_inventory",
    "draplane_node_agent": ROOT / "services" / "node-agent" / "draplane_node_agent",
    "draplane_audit": ROOT / "services" / "audit" / "draplane_audit",
}


def lint_imports(python_path: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if python_path is not None:
        env["PYTHONPATH"] = str(python_path)  # ahead of the editable install
    return subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                           "sys.exit(lint_imports_command())", "--config", str(ROOT / "pyproject.toml"),
                           "--no-cache"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def test_the_code_keeps_every_import_contract():
    result = lint_imports()
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


@pytest.mark.parametrize("module, bad_import, contract", [
    ("draplane/api/core.py", "from draplane.scheduling import placing", "The common library's layers"),
    ("draplane/component_helpers/resource.py", "import nats", "The pure cores do no I/O"),
    # the gang search is handed the framework's node fit; it does not reach up for it
    ("draplane/allocation/gang.py", "from draplane.scheduling.framework import runtime", "The common library's layers"),
    ("draplane/scheduling/framework/plugins/node_ports.py", "from draplane.scheduling.framework import runtime",
     "The framework's plugins stand alone"),
    # the pod-level core hands its decisions to the NATS edges; it never calls them
    ("draplane/scheduling/placing.py", "from draplane.jetstream import reservation_store", "The pure cores do no I/O"),
    ("draplane/allocation/scoring.py", "from draplane.allocation.allocator import NodeView",
     "The scoring policies sit below the search"),
    ("draplane/messages/__init__.py", "import draplane_binder.service", "The common library imports no service"),
    ("draplane_allocator/shard.py", "from draplane_binder import volumes", "The services do not import each other"),
])
def test_a_bad_import_breaks_its_contract(tmp_path, module, bad_import, contract):
    for name, source in PACKAGES.items():
        shutil.copytree(source, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n\ndef _deliberately_bad():\n    {bad_import}\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0, result.stdout[-3000:]
    broken = [line for line in result.stdout.splitlines() if " BROKEN" in line]
    assert any(line.startswith(contract) for line in broken), result.stdout[-3000:]
