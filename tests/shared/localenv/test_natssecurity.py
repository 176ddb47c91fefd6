"""draplane up's NATS security: a CA, the server's certificate, one key per identity, the server config."""

from __future__ import annotations

import json
import stat
import subprocess

import pytest

from draplane import natsauth
from draplane.localenv import binaries, natssecurity
from draplane.localenv.controlplane import Ports, nats_config
from draplane.nats_roles import SERVICE_ROLES, fleet_inbox_prefix, node_agent_permissions, service_permissions
from draplane.messages.inventory import InventoryNames

PREFIX = "draplane."


def _create(tmp_path):
    return natssecurity.create(tmp_path / "nats-auth", prefix=PREFIX, agents=[
        natssecurity.NodeAgentIdentity("node-agent-l4", ("l4-0000", "l4-0001"), fleet_inbox_prefix("l4")),
        natssecurity.NodeAgentIdentity("gpu-1", ("gpu-1",)),
    ])


def test_one_private_seed_per_identity_and_only_public_keys_in_the_config(tmp_path):
    security = _create(tmp_path)
    assert set(security.seeds) == {*SERVICE_ROLES, "node-agent-l4", "gpu-1"}
    config = security.server_config()
    for identity, path in security.seeds.items():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, identity
        key = natsauth.user_key_from_seed(path.read_bytes(), identity)
        assert key.public_key in config and key.seed.decode() not in config
    assert stat.S_IMODE((tmp_path / "nats-auth").stat().st_mode) == 0o700
    assert security.environment("binder") == {"DRAPLANE_NATS_NKEY_SEED": str(security.seeds["binder"]),
                                              "DRAPLANE_NATS_CA": str(security.tls.ca_cert)}


def test_each_user_has_its_roles_permissions(tmp_path):
    security = _create(tmp_path)
    users = json.loads(security.server_config().split("authorization ", 1)[1])["users"]
    by_key = {u["nkey"]: u["permissions"] for u in users}
    keys = {identity: key for identity, key, _ in security.users}
    names = InventoryNames(PREFIX)
    for role in SERVICE_ROLES:
        assert by_key[keys[role]] == service_permissions(role, PREFIX).config(), role
    assert by_key[keys["node-agent-l4"]] == node_agent_permissions(
        ["l4-0000", "l4-0001"], names, inbox_prefix="_INBOX_fleet_l4").config()
    assert by_key[keys["gpu-1"]]["subscribe"] == {"allow": ["_INBOX_gpu-1.>"]}


def test_bad_identities_are_refused(tmp_path):
    with pytest.raises(ValueError, match="'binder' clashes"):
        natssecurity.create(tmp_path / "a", prefix=PREFIX, agents=[natssecurity.NodeAgentIdentity("binder", ("n1",))])
    with pytest.raises(natsauth.AuthConfigError, match="'N_1' is not a Kubernetes node name"):
        natssecurity.create(tmp_path / "b", prefix=PREFIX, agents=[natssecurity.NodeAgentIdentity("x", ("N_1",))])
    with pytest.raises(KeyError, match="no NATS credentials for 'dashboard'"):
        _create(tmp_path).seed("dashboard")


@pytest.mark.integration
def test_nats_server_accepts_the_config(tmp_path):
    security = _create(tmp_path)
    config = tmp_path / "nats.conf"
    config.write_text(nats_config(Ports(nats=4222, nats_monitor=8222), tmp_path / "js", security.server_config()))
    result = subprocess.run([str(binaries.require(binaries.NATS_SERVER)), "-t", "-c", str(config)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and "is valid" in result.stdout + result.stderr, result.stdout + result.stderr
