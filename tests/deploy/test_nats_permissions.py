"""deploy/nats auth templates: rendered for two nodes and enforced by a real nats-server.

Node agent A must reach its own subjects and nothing else: not node B's subjects, not B's inbox,
not the JetStream API. Subjects come from draplane.messages.inventory, the inventory contract.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import urllib.request
from pathlib import Path

import nats
import nats.errors
import pytest
from nats.js.api import StreamConfig

from draplane import natsauth
from draplane.localenv import binaries
from draplane.localenv.processes import ServerProcess, free_port
from draplane.messages.inventory import InventoryNames
from draplane.natsauth import AuthConfigError

TEMPLATES = Path(__file__).resolve().parents[2] / "deploy" / "nats"
NODE_A = "gpu-node-a"
NODE_B = "gpu-node-b.zone-1.example.com"  # dots: node names are DNS subdomains


def _templates() -> tuple[str, str]:
    return (TEMPLATES / "auth.conf.tmpl").read_text(), (TEMPLATES / "node-agent-user.conf.tmpl").read_text()


@pytest.fixture(scope="module")
def keys() -> dict[str, natsauth.UserKey]:
    return {name: natsauth.new_user_key() for name in (*natsauth.SERVICES, "system", NODE_A, NODE_B)}


def _render(keys, names=InventoryNames(), nodes=(NODE_A, NODE_B)) -> str:
    auth, user = _templates()
    return natsauth.render_auth_config(
        auth, user,
        service_keys={s: keys[s].public_key for s in natsauth.SERVICES},
        system_key=keys["system"].public_key,
        node_keys={n: keys[n].public_key for n in nodes},
        names=names,
    )


# --- pure ---------------------------------------------------------------------------------------


def test_rendered_config_holds_public_keys_only(keys):
    config = _render(keys)
    for key in keys.values():
        assert key.public_key in config
        assert key.seed.decode() not in config
    assert keys[NODE_A].seed.decode() not in repr(keys[NODE_A])


def test_each_node_gets_exactly_its_own_subjects(keys):
    names = InventoryNames("prod.draplane.")
    config = _render(keys, names)
    block_a = config[config.index(keys[NODE_A].public_key):config.index(keys[NODE_B].public_key)]
    assert f'"{names.snapshot_subject(NODE_A)}"' in block_a
    assert f'"{names.heartbeat_subject(NODE_A)}"' in block_a
    assert f'"{names.agent_inbox_prefix(NODE_A)}.>"' in block_a
    assert NODE_B not in block_a and ">" not in block_a.replace(f"{names.agent_inbox_prefix(NODE_A)}.>", "")


def test_node_name_that_is_not_a_kubernetes_name_is_refused(keys):
    auth, user = _templates()
    for bad in ("Node-A", "node_a", "node a", "node.>", "*", "", "-a", "a" * 254):
        with pytest.raises(AuthConfigError, match="is not a Kubernetes node name"):
            natsauth.render_node_agent_user(user, bad, keys[NODE_A].public_key, InventoryNames())


def test_mistyped_public_key_is_refused_with_its_owner(keys):
    key = keys[NODE_A].public_key
    broken = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
    with pytest.raises(AuthConfigError, match=f"node {NODE_A}: .* fails the nkey checksum"):
        _render({**keys, NODE_A: natsauth.UserKey(b"", broken)})
    with pytest.raises(AuthConfigError, match="not a NATS user public key"):
        natsauth.check_user_public_key("A" + key[1:], "account key")


def test_a_key_shared_by_two_users_is_refused(keys):
    with pytest.raises(AuthConfigError, match=f"node {NODE_B} and node {NODE_A} share the public key"):
        _render({**keys, NODE_B: keys[NODE_A]})


def test_missing_service_key_and_unknown_template_variable_are_named(keys):
    auth, user = _templates()
    with pytest.raises(AuthConfigError, match=r"no public key for the services \['binder', 'audit'\]"):
        natsauth.render_auth_config(
            auth, user, service_keys={"inventory": keys["inventory"].public_key, "allocator": keys["allocator"].public_key},
            system_key=keys["system"].public_key, node_keys={},
        )
    with pytest.raises(AuthConfigError, match=r"uses \$\{rack\}"):
        natsauth.render_node_agent_user(user + "${rack}", NODE_A, keys[NODE_A].public_key, InventoryNames())


def test_seed_round_trips_and_garbage_is_refused(keys):
    assert natsauth.user_key_from_seed(keys[NODE_A].seed.decode() + "\n", "seed file") == keys[NODE_A]
    with pytest.raises(AuthConfigError, match="seed file: not an nkey seed"):
        natsauth.user_key_from_seed("SUNOTASEED", "seed file")


# --- a real nats-server -------------------------------------------------------------------------


@pytest.fixture
def nats_server(tmp_path: Path, keys):
    binary = binaries.require(binaries.NATS_SERVER)
    port, monitor = free_port(), free_port()
    (tmp_path / "auth.conf").write_text(_render(keys))
    config = tmp_path / "nats.conf"
    config.write_text(
        f"listen: 127.0.0.1:{port}\nhttp: 127.0.0.1:{monitor}\n"
        f"jetstream {{ store_dir: {json.dumps(str(tmp_path / 'js'))} }}\n"
        "include ./auth.conf\n"
    )
    server = ServerProcess("nats-server (auth)", [str(binary), "-c", str(config)], tmp_path / "nats.log")
    server.start()
    try:
        server.wait_ready(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{monitor}/healthz?js-enabled-only=true", timeout=2).status == 200,
            30,
        )
        yield f"nats://127.0.0.1:{port}"
    finally:
        server.stop()


async def _connect(url: str, key: natsauth.UserKey, errors: list[str] | None = None, inbox_prefix: str | None = None):
    async def on_error(exc):
        if errors is not None:
            errors.append(str(exc))

    options = {"inbox_prefix": inbox_prefix} if inbox_prefix else {}
    return await nats.connect(url, nkeys_seed_str=key.seed.decode(), error_cb=on_error,
                              allow_reconnect=False, **options)


async def _violation(errors: list[str], subject: str, operation: str) -> None:
    for _ in range(50):
        # nats-py lowercases the server's -ERR text; the subject is quoted in it, so no prefix matches.
        if any(f"permissions violation for {operation.lower()} to \"{subject.lower()}\"" in e.lower() for e in errors):
            return
        await asyncio.sleep(0.05)
    pytest.fail(f"no permissions violation for {operation} to {subject!r}; errors seen: {errors}")


@pytest.mark.integration
async def test_node_agent_cannot_publish_or_read_as_another_node(nats_server, keys):
    names = InventoryNames()
    inventory = await _connect(nats_server, keys["inventory"])
    errors_a: list[str] = []
    agent_a = await _connect(nats_server, keys[NODE_A], errors_a, names.agent_inbox_prefix(NODE_A))
    agent_b = await _connect(nats_server, keys[NODE_B], [], names.agent_inbox_prefix(NODE_B))
    try:
        js = inventory.jetstream()
        await js.add_stream(StreamConfig(name=names.stream, subjects=[names.snapshot_wildcard], max_msgs_per_subject=1))
        heartbeats = await inventory.subscribe(names.heartbeat_wildcard)

        # Each agent can do its own job: a JetStream-acknowledged snapshot, and a heartbeat.
        ack_a = await agent_a.jetstream().publish(names.snapshot_subject(NODE_A), b"snapshot A")
        ack_b = await agent_b.jetstream().publish(names.snapshot_subject(NODE_B), b"snapshot B")
        assert (ack_a.stream, ack_a.seq, ack_b.seq) == (names.stream, 1, 2)
        await agent_a.publish(names.heartbeat_subject(NODE_A), b"beat A")
        assert (await heartbeats.next_msg(timeout=5)).subject == names.heartbeat_subject(NODE_A)

        # A forging B's inventory: refused by the server, nothing reaches the stream or inventory.
        await agent_a.publish(names.snapshot_subject(NODE_B), b"forged by A")
        await agent_a.publish(names.heartbeat_subject(NODE_B), b"forged by A")
        await agent_a.flush()
        await _violation(errors_a, names.snapshot_subject(NODE_B), "Publish")
        await _violation(errors_a, names.heartbeat_subject(NODE_B), "Publish")
        last_b = await js.get_last_msg(names.stream, names.snapshot_subject(NODE_B))
        assert last_b.data == b"snapshot B"
        assert (await js.stream_info(names.stream)).state.messages == 2
        with pytest.raises(nats.errors.TimeoutError):
            await heartbeats.next_msg(timeout=0.5)

        # A reading others' traffic: B's inbox, every snapshot, everything.
        for subject in (f"{names.agent_inbox_prefix(NODE_B)}.>", names.snapshot_wildcard, ">"):
            await agent_a.subscribe(subject)
            await agent_a.flush()
            await _violation(errors_a, subject, "Subscription")

        # A going around the subjects through the JetStream API (here: deleting the stream).
        delete = f"$JS.API.STREAM.DELETE.{names.stream}"
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await agent_a.request(delete, b"", timeout=0.5)
        await _violation(errors_a, delete, "Publish")
        assert (await js.stream_info(names.stream)).state.messages == 2

        # And a key the config does not list cannot connect at all.
        with pytest.raises(nats.errors.Error):
            await nats.connect(nats_server, nkeys_seed_str=natsauth.new_user_key().seed.decode(),
                               allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
    finally:
        for client in (agent_a, agent_b, inventory):
            await client.close()


@pytest.mark.integration
def test_shipped_nats_conf_with_rendered_auth_passes_nats_server_config_check(tmp_path: Path, keys):
    """The ConfigMap's nats.conf, including the rendered auth.conf, as nats-server itself reads it."""
    from draplane.localenv import kustomize

    binary = binaries.require(binaries.NATS_SERVER)
    (config_map,) = [o for o in kustomize.build(TEMPLATES.parent) if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "draplane-nats-config"]
    (tmp_path / "nats.conf").write_text(config_map["data"]["nats.conf"])
    (tmp_path / "auth").mkdir()
    (tmp_path / "auth" / "auth.conf").write_text(_render(keys))

    def check() -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(binary), "-t", "-c", "nats.conf"], cwd=tmp_path, capture_output=True, text=True, timeout=30,
            env={"POD_NAME": "draplane-nats-0", "PATH": "/usr/bin:/bin"},
        )

    result = check()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "is valid" in result.stdout + result.stderr
    # The same check refuses a broken include, so the pass above means something.
    (tmp_path / "auth" / "auth.conf").write_text(_render(keys).replace("users: [", "users: [[", 1))
    assert check().returncode != 0
