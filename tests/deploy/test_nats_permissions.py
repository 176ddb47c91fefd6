"""deploy/nats auth templates: rendered for two nodes and every service role, and enforced by a
real nats-server over TLS.

Node agent A must reach its own subjects and nothing else: not node B's subjects, not B's inbox,
not the JetStream API, not the reservation bucket. A shard's credentials must not write what only
the binder writes (pending pods, releases, the binder's audit events) nor the inventory feed. The
reader (draplane free, the dashboard) writes nothing. The permissions are draplane.nats_roles'.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import subprocess
import urllib.request
from pathlib import Path

import nats
import nats.errors
import pytest
from nats.js.api import KeyValueConfig, StreamConfig

from draplane import nats_roles, natsauth
from draplane.audit_publisher import ensure_audit_stream
from draplane.entrypoints import nats_tls_context
from draplane.localenv import binaries, pki
from draplane.localenv.processes import ServerProcess, free_port
from draplane.messages.audit import AuditNames
from draplane.messages.inventory import InventoryNames
from draplane.natsauth import AuthConfigError
from draplane.jetstream import streams
from draplane.scheduling.messages import Subjects

TEMPLATES = Path(__file__).resolve().parents[2] / "deploy" / "nats"
NODE_A = "gpu-node-a"
NODE_B = "gpu-node-b.zone-1.example.com"  # dots: node names are DNS subdomains


def _templates() -> tuple[str, str]:
    return (TEMPLATES / "auth.conf.tmpl").read_text(), (TEMPLATES / "node-agent-user.conf.tmpl").read_text()


@pytest.fixture(scope="module")
def keys() -> dict[str, natsauth.UserKey]:
    return {name: natsauth.new_user_key() for name in (*natsauth.KNOWN_SERVICES, "system", NODE_A, NODE_B)}


def _render(keys, names=InventoryNames(), nodes=(NODE_A, NODE_B)) -> str:
    auth, user = _templates()
    return natsauth.render_auth_config(
        auth, user,
        service_keys={s: keys[s].public_key for s in natsauth.KNOWN_SERVICES},
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
    """nats-server with deploy/'s rendered accounts and TLS from a CA of its own, as deployed."""
    binary = binaries.require(binaries.NATS_SERVER)
    port, monitor = free_port(), free_port()
    tls = pki.create_nats_tls(tmp_path / "tls")
    (tmp_path / "auth.conf").write_text(_render(keys))
    config = tmp_path / "nats.conf"
    config.write_text(
        f"listen: 127.0.0.1:{port}\nhttp: 127.0.0.1:{monitor}\n"
        f"jetstream {{ store_dir: {json.dumps(str(tmp_path / 'js'))} }}\n"
        f"tls {json.dumps({'cert_file': str(tls.server_cert), 'key_file': str(tls.server_key)})}\n"
        "include ./auth.conf\n"
    )
    server = ServerProcess("nats-server (auth)", [str(binary), "-c", str(config)], tmp_path / "nats.log")
    server.start()
    try:
        server.wait_ready(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{monitor}/healthz?js-enabled-only=true", timeout=2).status == 200,
            30,
        )
        yield NatsServer(f"nats://127.0.0.1:{port}", tls.ca_cert)
    finally:
        server.stop()


@dataclasses.dataclass(frozen=True)
class NatsServer:
    url: str
    ca_cert: Path


async def _connect(server: NatsServer, key: natsauth.UserKey, errors: list[str] | None = None,
                   inbox_prefix: str | None = None, role: str | None = None):
    """A client as the services connect: TLS verified against the CA, the key, the role's inbox."""
    async def on_error(exc):
        if errors is not None:
            errors.append(str(exc))

    inbox_prefix = inbox_prefix or (nats_roles.service_inbox_prefix(role) if role else None)
    options = {"inbox_prefix": inbox_prefix} if inbox_prefix else {}
    return await nats.connect(server.url, nkeys_seed_str=key.seed.decode(), error_cb=on_error,
                              tls=nats_tls_context(str(server.ca_cert)), allow_reconnect=False, **options)


async def _violation(errors: list[str], subject: str, operation: str) -> None:
    for _ in range(50):
        # nats-py lowercases the server's -ERR text; the subject is quoted in it, so no prefix matches.
        if any(f"permissions violation for {operation.lower()} to \"{subject.lower()}\"" in e.lower() for e in errors):
            return
        await asyncio.sleep(0.05)
    pytest.fail(f"no permissions violation for {operation} to {subject!r}; errors seen: {errors}")


async def _refused_publish(client, errors: list[str], subject: str) -> None:
    """`subject` is refused to `client`: the server says so, and a JetStream publish gets no ack."""
    with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
        await client.request(subject, b"forged", timeout=0.5)
    await _violation(errors, subject, "Publish")


@pytest.mark.integration
async def test_node_agent_cannot_publish_or_read_as_another_node(nats_server, keys):
    names = InventoryNames()
    inventory = await _connect(nats_server, keys["inventory"], role="inventory")
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
        await _refused_publish(agent_a, errors_a, delete)
        assert (await js.stream_info(names.stream)).state.messages == 2

        # And a key the config does not list cannot connect at all, nor can a client without TLS.
        with pytest.raises(nats.errors.Error):
            await nats.connect(nats_server.url, nkeys_seed_str=natsauth.new_user_key().seed.decode(),
                               tls=nats_tls_context(str(nats_server.ca_cert)),
                               allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
        with pytest.raises((nats.errors.Error, OSError)):
            await nats.connect(nats_server.url, nkeys_seed_str=keys[NODE_A].seed.decode(),
                               allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
    finally:
        for client in (agent_a, agent_b, inventory):
            await client.close()


@pytest.mark.integration
async def test_node_agent_cannot_touch_the_reservation_bucket(nats_server, keys):
    """Node A's credentials neither write nor read the reservations, whose entries decide which
    devices are free: not through $KV.<bucket>, not through the JetStream API."""
    subjects = Subjects()
    binder = await _connect(nats_server, keys["binder"], role="binder")
    errors_a: list[str] = []
    agent_a = await _connect(nats_server, keys[NODE_A], errors_a, InventoryNames().agent_inbox_prefix(NODE_A))
    try:
        bucket = await streams.reservation_bucket(binder.jetstream(), subjects)
        revision = await bucket.put(f"node.{NODE_A}", b"held by the binder")
        for subject in (f"$KV.{subjects.reservations_bucket}.node.{NODE_A}",
                        f"$JS.API.STREAM.INFO.KV_{subjects.reservations_bucket}",
                        f"$JS.API.DIRECT.GET.KV_{subjects.reservations_bucket}.$KV.{subjects.reservations_bucket}.node.{NODE_A}",
                        f"$JS.API.STREAM.PURGE.KV_{subjects.reservations_bucket}"):
            await _refused_publish(agent_a, errors_a, subject)
        entry = await bucket.get(f"node.{NODE_A}")
        assert (entry.value, entry.revision) == (b"held by the binder", revision)
    finally:
        for client in (agent_a, binder):
            await client.close()


@pytest.mark.integration
async def test_a_shard_cannot_write_what_only_the_binder_and_the_inventory_write(nats_server, keys):
    """Claim status is the binder's: on NATS, the binder alone sends pods to shards (pending),
    writes the cluster bucket (the shards' view of Kubernetes), announces releases and publishes
    placed/released/rejected audit events; the inventory alone writes the feed. The shard's credentials do its own job and none of that. (In Kubernetes,
    deploy/'s RBAC gives the shard no rights at all: tests/deploy/test_deploy_apiserver.py has the
    apiserver refuse its claims list and its claim status update.)"""
    subjects, names, audit = Subjects(), InventoryNames(), AuditNames()
    binder = await _connect(nats_server, keys["binder"], role="binder")
    inventory = await _connect(nats_server, keys["inventory"], role="inventory")
    errors: list[str] = []
    shard = await _connect(nats_server, keys["allocator"], errors, role="allocator")
    try:
        await streams.ensure_streams(binder.jetstream(), subjects)
        reservations = await streams.reservation_bucket(binder.jetstream(), subjects)
        await ensure_audit_stream(binder.jetstream(), audit)
        feed = await inventory.jetstream().create_key_value(KeyValueConfig(bucket=names.feed_bucket, history=1))
        await feed.put(f"node.{NODE_A}", b"the inventory's")
        cluster = await streams.cluster_bucket(binder.jetstream(), subjects)
        await cluster.put(f"node.{NODE_A}", b"the binder's")
        await cluster.put("pod.gone", b"a pod")
        await cluster.purge("pod.gone", msg_ttl=600)  # as ClusterPublisher deletes

        # Its own job: the streams exist (idempotent ensure), a reservation by compare-and-set, a
        # placement for the binder, a taint audit event, and the feed read.
        js = shard.jetstream()
        await streams.ensure_streams(js, subjects)
        own = await streams.reservation_bucket(js, subjects)
        assert await own.create(f"node.{NODE_B}", b"reserved by the shard") > 0
        assert (await js.publish(subjects.results, b"placement")).stream == subjects.results_stream
        assert (await js.publish(audit.subject("tainted"), b"{}")).stream == audit.stream
        assert (await (await js.key_value(names.feed_bucket)).get(f"node.{NODE_A}")).value == b"the inventory's"
        cluster_kv = await js.key_value(subjects.cluster_bucket)
        seen = {e.key: (e.operation, e.value) for e in await streams.bucket_snapshot(cluster_kv)}  # as a shard reads it
        assert seen[f"node.{NODE_A}"] == (None, b"the binder's") and seen["pod.gone"][0] == "PURGE"

        # The binder's and the inventory's: refused, and nothing arrived.
        for subject in (subjects.pending(0), subjects.pending(1), subjects.released,
                        audit.subject("placed"), audit.subject("released"), audit.subject("rejected"),
                        f"$KV.{names.feed_bucket}.node.{NODE_A}", f"$KV.{subjects.cluster_bucket}.node.{NODE_A}",
                        f"$JS.API.STREAM.DELETE.{subjects.pending_stream}",
                        f"$JS.API.CONSUMER.MSG.NEXT.{subjects.results_stream}.binder"):
            await _refused_publish(shard, errors, subject)
        binder_js = binder.jetstream()
        # a PendingPod whose pod went: the binder withdraws it from the queue, a shard may not
        sequence = (await binder_js.publish(subjects.pending(0), b"pending")).seq
        await _refused_publish(shard, errors, f"$JS.API.STREAM.MSG.DELETE.{subjects.pending_stream}")
        assert (await binder_js.stream_info(subjects.pending_stream)).state.messages == 1
        assert await binder_js.delete_msg(subjects.pending_stream, sequence)
        assert (await binder_js.stream_info(subjects.pending_stream)).state.messages == 0
        assert (await binder_js.stream_info(subjects.released_stream)).state.messages == 0
        assert (await binder_js.stream_info(audit.stream)).state.messages == 1  # the shard's taint event only
        assert (await feed.get(f"node.{NODE_A}")).value == b"the inventory's"
        assert (await cluster.get(f"node.{NODE_A}")).value == b"the binder's"
        assert (await reservations.get(f"node.{NODE_B}")).value == b"reserved by the shard"
    finally:
        for client in (shard, inventory, binder):
            await client.close()


@pytest.mark.integration
async def test_the_reader_reads_the_feed_and_reservations_and_writes_nothing(nats_server, keys):
    """`draplane free` and the dashboard's identity: every bucket it shows, and no write anywhere,
    not even an acknowledgement that would take work from the audit subscriber."""
    subjects, names, audit = Subjects(), InventoryNames(), AuditNames()
    binder = await _connect(nats_server, keys["binder"], role="binder")
    errors: list[str] = []
    reader = await _connect(nats_server, keys["reader"], errors, role="reader")
    try:
        reservations = await streams.reservation_bucket(binder.jetstream(), subjects)
        await reservations.put(f"node.{NODE_A}", b"held")
        view = await (reader.jetstream()).key_value(subjects.reservations_bucket)
        assert (await view.get(f"node.{NODE_A}")).value == b"held"
        # Through the services' own watch: nats-py's watchall may say "nothing" before the
        # replayed entry arrives (the CI run that failed here read that None).
        async with contextlib.aclosing(streams.bucket_entries(view)) as entries:
            first = await asyncio.wait_for(anext(entries), 5)
        assert first is not None and first.value == b"held"
        # the DeviceTaintRules of the binder's cluster bucket, read as `draplane free` reads them
        cluster = await streams.cluster_bucket(binder.jetstream(), subjects)
        await cluster.put("taintrule.maintenance", b"a rule")
        await cluster.put(f"node.{NODE_A}", b"a node")
        device_view = await (reader.jetstream()).key_value(subjects.cluster_bucket)
        rules = await streams.bucket_snapshot(device_view, keys="taintrule.>")
        assert [(e.key, e.value) for e in rules] == [("taintrule.maintenance", b"a rule")]
        for subject in (f"$KV.{subjects.reservations_bucket}.node.{NODE_A}", subjects.results, subjects.pending(0),
                        f"$KV.{subjects.cluster_bucket}.taintrule.maintenance",
                        names.snapshot_subject(NODE_A), f"$JS.API.STREAM.CREATE.{audit.stream}",
                        f"$JS.API.CONSUMER.MSG.NEXT.{audit.stream}.{audit.consumer}"):
            await _refused_publish(reader, errors, subject)
        assert (await reservations.get(f"node.{NODE_A}")).value == b"held"
        assert (await cluster.get("taintrule.maintenance")).value == b"a rule"
    finally:
        for client in (reader, binder):
            await client.close()


@pytest.mark.integration
def test_shipped_nats_conf_with_rendered_auth_passes_nats_server_config_check(tmp_path: Path, keys):
    """The ConfigMap's nats.conf, including the rendered auth.conf, as nats-server itself reads it."""
    from draplane.localenv import kustomize

    binary = binaries.require(binaries.NATS_SERVER)
    (config_map,) = [o for o in kustomize.build(TEMPLATES.parent) if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "draplane-nats-config"]
    # The Secret draplane-nats-tls as `draplane nats-auth tls` makes it, where the test can put it.
    tls = pki.create_nats_tls(tmp_path / "tls", file_names=("ca.crt", "tls.crt", "tls.key"))
    (tmp_path / "nats.conf").write_text(config_map["data"]["nats.conf"].replace("/etc/nats/tls/", f"{tls.ca_cert.parent}/"))
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
