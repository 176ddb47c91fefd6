"""TLS and per-role credentials for a local nats-server, as deploy/ runs NATS: `draplane up`, tests.

`create` makes a CA and the server's certificate (`pki.create_nats_tls`), one nkey per identity
(each service role of `draplane.nats_roles`, and each node agent process with the nodes it
speaks for), and writes the seeds into the folder, one file each, readable by the owner only. The
server config it renders holds public keys and the permissions of `draplane.nats_roles`, the
same sets deploy/'s rendered auth config holds.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from draplane import natsauth
from draplane.localenv import pki
from draplane.messages.inventory import InventoryNames
from draplane.nats_roles import SERVICE_ROLES, Permissions, node_agent_permissions, service_permissions


@dataclasses.dataclass(frozen=True, slots=True)
class NodeAgentIdentity:
    """One node agent process: the nodes it publishes for, and the inbox prefix it connects with."""

    name: str
    nodes: tuple[str, ...]
    inbox_prefix: str | None = None  # None: the single node's own (InventoryNames.agent_inbox_prefix)


@dataclasses.dataclass(frozen=True, slots=True)
class NatsSecurity:
    directory: Path
    tls: pki.NatsTls
    seeds: dict[str, Path]  # identity (a role of SERVICE_ROLES, or a NodeAgentIdentity's name) -> seed file
    users: tuple[tuple[str, str, Permissions], ...]  # (identity, public key, permissions)

    def seed(self, identity: str) -> Path:
        try:
            return self.seeds[identity]
        except KeyError:
            raise KeyError(f"no NATS credentials for {identity!r}; made for {sorted(self.seeds)}") from None

    def server_config(self) -> str:
        """The `tls` and `authorization` blocks of nats-server's config (JSON is valid there)."""
        users = [{"nkey": key, "permissions": permissions.config()} for _, key, permissions in self.users]
        tls = {"cert_file": str(self.tls.server_cert), "key_file": str(self.tls.server_key), "timeout": 5}
        return f"tls {json.dumps(tls)}\nauthorization {json.dumps({'users': users}, indent=1)}\n"

    def environment(self, identity: str) -> dict[str, str]:
        """What a service process of `identity` needs in its environment to connect."""
        return {"DRAPLANE_NATS_NKEY_SEED": str(self.seed(identity)), "DRAPLANE_NATS_CA": str(self.tls.ca_cert)}


def create(directory: Path, *, prefix: str, agents: list[NodeAgentIdentity] = ()) -> NatsSecurity:
    """Certificates, keys and seed files in `directory` for every service role and `agents`."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    tls = pki.create_nats_tls(directory)
    names = InventoryNames(prefix)
    wanted: list[tuple[str, Permissions]] = [(role, service_permissions(role, prefix)) for role in SERVICE_ROLES]
    for agent in agents:
        if agent.name in SERVICE_ROLES or agent.name in dict(wanted):
            raise ValueError(f"node agent identity {agent.name!r} clashes with another identity's name")
        for node in agent.nodes:
            natsauth.check_node_name(node)
        wanted.append((agent.name, node_agent_permissions(list(agent.nodes), names, inbox_prefix=agent.inbox_prefix)))
    seeds: dict[str, Path] = {}
    users = []
    for identity, permissions in wanted:
        key = natsauth.new_user_key()
        path = directory / f"{identity}.seed"
        path.touch(mode=0o600)
        path.write_bytes(key.seed)
        seeds[identity] = path
        users.append((identity, key.public_key, permissions))
    return NatsSecurity(directory=directory, tls=tls, seeds=seeds, users=tuple(users))
