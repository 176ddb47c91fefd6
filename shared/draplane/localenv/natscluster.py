"""A 3-server NATS JetStream cluster on loopback: the production shape, in one process tree.

One local nats-server is the embedded default (`controlplane`). This is the path for users who
outgrow it, and the one that tests use to show that R3 streams survive losing a server: three
nats-server processes with cluster routes to each other and JetStream on each, every one with its
own store directory so that a killed server can be started again on its own data.

`render_server_config` is pure; `NatsCluster` is the thin process shell around it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import urllib.request
from pathlib import Path

from draplane.localenv import binaries
from draplane.localenv.processes import ServerProcess, StartupError, ensure_port_free, free_port

log = logging.getLogger(__name__)

CLUSTER_NAME = "draplane-local"
LOOPBACK = "127.0.0.1"


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterMember:
    """One server of the cluster: its name and the three ports it listens on."""

    name: str
    client_port: int
    cluster_port: int
    monitor_port: int

    @property
    def client_url(self) -> str:
        return f"nats://{LOOPBACK}:{self.client_port}"

    @property
    def route_url(self) -> str:
        return f"nats-route://{LOOPBACK}:{self.cluster_port}"

    @property
    def monitor_url(self) -> str:
        return f"http://{LOOPBACK}:{self.monitor_port}"


def plan_members(size: int, name_prefix: str = "nats") -> list[ClusterMember]:
    """Members with free loopback ports. JetStream needs a quorum, so fewer than 3 is refused."""
    if size < 3:
        raise ValueError(f"a JetStream cluster needs at least 3 servers for R3 streams, got size={size}")
    return [
        ClusterMember(f"{name_prefix}-{i}", free_port(LOOPBACK), free_port(LOOPBACK), free_port(LOOPBACK))
        for i in range(size)
    ]


def render_server_config(
    member: ClusterMember,
    members: list[ClusterMember],
    store_dir: Path,
    *,
    cluster_name: str = CLUSTER_NAME,
    extra: str = "",
) -> str:
    """The nats-server configuration of one member.

    Every member lists every other member's route: with an explicit full mesh no server depends on
    one seed being up, which is what lets any one of them be killed and restarted.
    """
    if member not in members:
        raise ValueError(f"server {member.name!r} is not one of the cluster's members")
    names = [m.name for m in members]
    if len(set(names)) != len(names):
        raise ValueError(f"cluster member names must be unique (JetStream's meta group keys on them): {names}")
    routes = ",\n".join(f"    {m.route_url}" for m in members if m is not member)
    return "\n".join(
        [
            f"server_name: {member.name}",
            f"listen: {LOOPBACK}:{member.client_port}",
            f"http: {LOOPBACK}:{member.monitor_port}",
            "jetstream {",
            f"  store_dir: {json.dumps(str(store_dir))}",
            "  max_memory_store: 256MB",
            "  max_file_store: 2GB",
            "}",
            "cluster {",
            f"  name: {cluster_name}",
            f"  listen: {LOOPBACK}:{member.cluster_port}",
            "  routes: [",
            routes,
            "  ]",
            "}",
            "max_payload: 8MB",
            extra,
            "",
        ]
    )


def _healthy(member: ClusterMember) -> bool:
    # Plain /healthz (not js-enabled-only) is 200 only once this server's JetStream meta layer is
    # current, i.e. the cluster has elected a meta leader and this member has caught up with it.
    with urllib.request.urlopen(f"{member.monitor_url}/healthz", timeout=2) as response:
        return response.status == 200


class NatsCluster:
    """Three (or more) nats-server processes forming one JetStream cluster on loopback.

    Use as a context manager, or call `start()` and `stop()`. `kill(i)` is SIGKILL, for crash tests;
    `restart(i)` brings the same server back on its own ports and store.
    """

    def __init__(
        self,
        workdir: Path,
        size: int = 3,
        *,
        binary: Path | None = None,
        extra_config: str = "",
        startup_timeout: float = 60.0,
    ):
        self.workdir = Path(workdir)
        self.binary = binary
        self.extra_config = extra_config
        self.startup_timeout = startup_timeout
        self.members = plan_members(size)
        self.processes: list[ServerProcess | None] = [None] * size

    @property
    def urls(self) -> list[str]:
        """Client URLs of all members: a client given all of them fails over between them."""
        return [m.client_url for m in self.members]

    def config_path(self, index: int) -> Path:
        return self.workdir / f"{self.members[index].name}.conf"

    def start(self) -> "NatsCluster":
        binary = self.binary or binaries.require(binaries.NATS_SERVER)
        self.binary = binary
        try:
            for index in range(len(self.members)):
                self._launch(index)
            # All servers must be running before any can become healthy (quorum), so wait after.
            for index in range(len(self.members)):
                self.wait_healthy(index)
        except BaseException:
            self.stop()
            raise
        log.info("NATS cluster up: %s", ", ".join(self.urls))
        return self

    def _launch(self, index: int) -> None:
        member = self.members[index]
        for port, what in (
            (member.client_port, "client"),
            (member.cluster_port, "cluster route"),
            (member.monitor_port, "monitoring"),
        ):
            ensure_port_free(port, f"nats-server {member.name} {what}")
        store = self.workdir / member.name / "jetstream"
        store.mkdir(parents=True, exist_ok=True)
        config = self.config_path(index)
        config.write_text(render_server_config(member, self.members, store, extra=self.extra_config))
        process = ServerProcess(
            f"nats-server {member.name}",
            [str(self.binary), "-c", str(config)],
            self.workdir / "logs" / f"{member.name}.log",
        )
        process.start()
        self.processes[index] = process

    def wait_healthy(self, index: int, timeout: float | None = None) -> None:
        process = self.processes[index]
        if process is None:
            raise StartupError(f"nats-server {self.members[index].name} was never started")
        member = self.members[index]
        process.wait_ready(lambda: _healthy(member), self.startup_timeout if timeout is None else timeout)

    def kill(self, index: int) -> None:
        """SIGKILL one server: no lame-duck mode, no flush, as in a node crash."""
        process = self.processes[index]
        if process is None or not process.alive():
            raise StartupError(f"nats-server {self.members[index].name} is not running; cannot kill it")
        process.kill()

    def restart(self, index: int) -> None:
        process = self.processes[index]
        if process is not None and process.alive():
            process.stop()
        self._launch(index)
        self.wait_healthy(index)

    def index_of(self, server_name: str) -> int:
        for index, member in enumerate(self.members):
            if member.name == server_name:
                return index
        raise KeyError(f"no member named {server_name!r} in cluster {[m.name for m in self.members]}")

    def stop(self) -> None:
        for process in self.processes:
            if process is not None:
                process.stop()

    def __enter__(self) -> "NatsCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

