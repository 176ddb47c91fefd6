"""`draplane nats-auth`: issuing, rotating and revoking keys, and rendering the auth config."""

from __future__ import annotations

import json
import stat
import urllib.request
from pathlib import Path

import nats
import pytest
import yaml

from draplane import natsauth
from draplane.cli import main
from draplane.localenv import binaries
from draplane.localenv.processes import ServerProcess, free_port
from draplane.messages.inventory import InventoryNames

TEMPLATES = Path(__file__).resolve().parents[2] / "deploy" / "nats"


def issue(tmp_path: Path, capsys, *what: str, rotate: bool = False) -> tuple[int, str, str]:
    seed = tmp_path / f"{'-'.join(what)}.seed"
    argv = ["nats-auth", "issue", "--keys", str(tmp_path / "keys.yaml"), "--seed-out", str(seed), *what]
    if rotate:
        argv.insert(2, "--rotate")
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out.strip(), err


@pytest.fixture
def issued(tmp_path, capsys) -> dict[str, str]:
    public = {}
    for what in (("service", "inventory"), ("service", "allocator"), ("service", "binder"), ("service", "audit"), ("system",),
                 ("node", "gpu-1"), ("node", "gpu-2.rack-4")):
        code, out, err = issue(tmp_path, capsys, *what)
        assert code == 0, err
        public[what[-1]] = out
    return public


def test_issue_writes_a_private_seed_and_records_only_the_public_key(tmp_path, issued):
    seed_file = tmp_path / "node-gpu-1.seed"
    assert stat.S_IMODE(seed_file.stat().st_mode) == 0o600
    key = natsauth.user_key_from_seed(seed_file.read_bytes(), "seed")
    assert key.public_key == issued["gpu-1"]
    registry = yaml.safe_load((tmp_path / "keys.yaml").read_text())
    assert registry == {
        "services": {s: issued[s] for s in ("inventory", "allocator", "binder", "audit")},
        "system": issued["system"],
        "nodes": {"gpu-1": issued["gpu-1"], "gpu-2.rack-4": issued["gpu-2.rack-4"]},
    }
    assert key.seed.decode() not in (tmp_path / "keys.yaml").read_text()


def test_reissuing_needs_rotate_and_never_overwrites_a_seed(tmp_path, capsys, issued):
    code, _, err = issue(tmp_path, capsys, "node", "gpu-1")
    assert code == 2 and f"node gpu-1 already has the key {issued['gpu-1']}; pass --rotate" in err
    code, _, err = issue(tmp_path, capsys, "node", "gpu-1", rotate=True)
    assert code == 2 and "already exists; a seed is never overwritten" in err  # the seed path is taken
    assert yaml.safe_load((tmp_path / "keys.yaml").read_text())["nodes"]["gpu-1"] == issued["gpu-1"]
    (tmp_path / "node-gpu-1.seed").rename(tmp_path / "old.seed")
    code, new_key, err = issue(tmp_path, capsys, "node", "gpu-1", rotate=True)
    assert code == 0, err
    assert new_key != issued["gpu-1"]
    assert yaml.safe_load((tmp_path / "keys.yaml").read_text())["nodes"]["gpu-1"] == new_key


def test_bad_names_are_refused_with_the_reason(tmp_path, capsys):
    code, _, err = issue(tmp_path, capsys, "node", "GPU_1")
    assert code == 2 and "'GPU_1' is not a Kubernetes node name" in err
    code, _, err = issue(tmp_path, capsys, "service", "scheduler")
    assert code == 2 and "unknown service 'scheduler'" in err
    code, _, err = issue(tmp_path, capsys, "node")
    assert code == 2 and "issue node needs a name" in err
    assert not (tmp_path / "keys.yaml").exists()
    assert not list(tmp_path.glob("*.seed"))  # nothing half-issued


def test_render_writes_one_confined_user_per_node(tmp_path, capsys, issued):
    out = tmp_path / "auth.conf"
    code = main(["nats-auth", "render", "--keys", str(tmp_path / "keys.yaml"), "--templates", str(TEMPLATES),
                 "--prefix", "prod.", "-o", str(out)])
    assert code == 0, capsys.readouterr().err
    config = out.read_text()
    names = InventoryNames("prod.")
    for node in ("gpu-1", "gpu-2.rack-4"):
        assert f'"{names.snapshot_subject(node)}"' in config
        assert f'"{names.agent_inbox_prefix(node)}.>"' in config
    assert all(key in config for key in issued.values())


def test_revoke_removes_the_node_and_unknown_nodes_are_named(tmp_path, capsys, issued):
    keys = str(tmp_path / "keys.yaml")
    assert main(["nats-auth", "revoke", "--keys", keys, "node", "gpu-1"]) == 0
    assert "gpu-1" not in yaml.safe_load((tmp_path / "keys.yaml").read_text())["nodes"]
    assert main(["nats-auth", "revoke", "--keys", keys, "node", "gpu-1"]) == 2
    assert "node 'gpu-1' has no key in the registry" in capsys.readouterr().err


def test_a_damaged_keys_file_is_reported_by_name_and_field(tmp_path, capsys, issued):
    keys = tmp_path / "keys.yaml"
    registry = yaml.safe_load(keys.read_text())
    key = registry["nodes"]["gpu-1"]
    # a different last character breaks the checksum (a key that already ended in "A" was left intact 1 time in 32)
    registry["nodes"]["gpu-1"] = key[:-1] + ("B" if key.endswith("A") else "A")
    keys.write_text(yaml.safe_dump(registry))
    assert main(["nats-auth", "render", "--keys", str(keys), "--templates", str(TEMPLATES)]) == 2
    err = capsys.readouterr().err
    assert f"{keys}: nodes.gpu-1" in err
    keys.write_text("services: {}\nextra: 1\n")
    assert main(["nats-auth", "render", "--keys", str(keys), "--templates", str(TEMPLATES)]) == 2
    assert "not a NATS key registry" in capsys.readouterr().err


@pytest.mark.integration
async def test_issued_node_seed_connects_to_a_server_running_the_rendered_config(tmp_path, capsys, issued):
    assert main(["nats-auth", "render", "--keys", str(tmp_path / "keys.yaml"), "--templates", str(TEMPLATES),
                 "-o", str(tmp_path / "auth.conf")]) == 0
    port, monitor = free_port(), free_port()
    config = tmp_path / "nats.conf"
    config.write_text(f"listen: 127.0.0.1:{port}\nhttp: 127.0.0.1:{monitor}\n"
                      f"jetstream {{ store_dir: {json.dumps(str(tmp_path / 'js'))} }}\ninclude ./auth.conf\n")
    server = ServerProcess("nats-server", [str(binaries.require(binaries.NATS_SERVER)), "-c", str(config)], tmp_path / "nats.log")
    server.start()
    try:
        server.wait_ready(lambda: urllib.request.urlopen(f"http://127.0.0.1:{monitor}/healthz", timeout=2).status == 200, 30)
        names = InventoryNames()
        client = await nats.connect(f"nats://127.0.0.1:{port}", nkeys_seed=str(tmp_path / "node-gpu-2.rack-4.seed"),
                                    inbox_prefix=names.agent_inbox_prefix("gpu-2.rack-4"), allow_reconnect=False)
        try:
            await client.publish(names.heartbeat_subject("gpu-2.rack-4"), b"beat")
            await client.flush(timeout=5)
        finally:
            await client.close()
    finally:
        server.stop()


def test_tls_makes_the_servers_secret_and_never_overwrites_it(tmp_path, capsys):
    from cryptography import x509

    out = tmp_path / "nats-tls"
    assert main(["nats-auth", "tls", "--out", str(out)]) == 0
    assert "create secret generic draplane-nats-tls" in capsys.readouterr().out
    assert stat.S_IMODE((out / "tls.key").stat().st_mode) == 0o600
    server = x509.load_pem_x509_certificate((out / "tls.crt").read_bytes())
    ca = x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())
    server.verify_directly_issued_by(ca)
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    # the client Service deploy/ points every service at, and each server behind the headless one
    assert {"draplane-nats", "*.draplane-nats-headless"} <= set(names)
    before = (out / "tls.key").read_bytes()
    assert main(["nats-auth", "tls", "--out", str(out)]) == 2
    assert "already exist; certificates are never overwritten" in capsys.readouterr().err
    assert (out / "tls.key").read_bytes() == before
