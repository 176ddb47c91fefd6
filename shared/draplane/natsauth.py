"""NATS accounts and users for draplane: nkey credentials, and the nats-server auth config.

Every draplane process authenticates to NATS with its own nkey (an Ed25519 key pair): the server
config holds only public keys, and a private seed never leaves the process, or the node, that
uses it. The services share one account (DRAPLANE), each user with the least permissions its
role needs (`draplane.nats_roles`, the one definition `draplane up` uses too): the subjects it
publishes and reads, the JetStream API of its own streams and consumers, and the key-value
buckets it may write. Node agents are confined: the agent of node N may publish only N's
snapshot and heartbeat subjects and read only its own inbox, so a compromised node can neither
forge another node's inventory nor read anyone's traffic.

The frame of the text comes from the templates in deploy/nats/ (`auth.conf.tmpl`,
`node-agent-user.conf.tmpl`); the permissions are rendered into them from `draplane.nats_roles`.
Rendering is pure; generating keys uses the OS's random source.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import os
import re
import string
from collections.abc import Mapping

import msgspec
import nkeys
import yaml

from draplane.messages.inventory import InventoryNames
from draplane.nats_roles import node_agent_permissions, service_permissions

# Every deployment runs these; `reader` (draplane free and dashboard, read-only) is optional.
SERVICES = ("inventory", "allocator", "binder", "audit")
OPTIONAL_SERVICES = ("reader",)
KNOWN_SERVICES = (*SERVICES, *OPTIONAL_SERVICES)

# Kubernetes node names are lowercase RFC 1123 subdomains. They may contain dots, which NATS
# reads as token separators: InventoryNames puts the node last in the subject for that reason.
_NODE_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


class AuthConfigError(ValueError):
    """A key, node name or template that cannot make a valid config. The message names it."""


@dataclasses.dataclass(frozen=True, slots=True)
class UserKey:
    """A NATS user nkey. `seed` is the secret; `public_key` goes into the server config."""

    seed: bytes
    public_key: str

    def __repr__(self) -> str:  # never print a seed by accident
        return f"UserKey(public_key={self.public_key!r})"


def new_user_key() -> UserKey:
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    return UserKey(seed=seed, public_key=nkeys.from_seed(bytearray(seed)).public_key.decode())


def user_key_from_seed(seed: bytes | str, what: str) -> UserKey:
    raw = seed.strip().encode() if isinstance(seed, str) else seed.strip()
    try:
        pair = nkeys.from_seed(bytearray(raw))
    except (nkeys.NkeysError, ValueError) as exc:
        raise AuthConfigError(f"{what}: not an nkey seed ({exc.__class__.__name__})") from None
    public = pair.public_key.decode()
    if not public.startswith("U"):
        raise AuthConfigError(f"{what}: the seed is not a user key (public key starts with {public[:1]!r}, not 'U')")
    return UserKey(seed=bytes(raw), public_key=public)


def check_user_public_key(public_key: str, what: str) -> str:
    """The key, if it is a well-formed NATS user public key (checksum included)."""
    if not isinstance(public_key, str) or not public_key.startswith("U") or len(public_key) != 56:
        raise AuthConfigError(f"{what}: {public_key!r} is not a NATS user public key (56 characters starting with 'U')")
    try:
        raw = base64.b32decode(public_key)
    except (binascii.Error, ValueError):
        raise AuthConfigError(f"{what}: {public_key!r} is not base32, so not an nkey") from None
    body, checksum = raw[:-2], raw[-2:]
    if body[0] != nkeys.PREFIX_BYTE_USER or len(body) != 33 or nkeys.crc16_checksum(body) != checksum:
        raise AuthConfigError(f"{what}: {public_key!r} fails the nkey checksum (mistyped or truncated?)")
    return public_key


def check_node_name(node: str) -> str:
    if not isinstance(node, str) or len(node) > 253 or not _NODE_NAME.fullmatch(node):
        raise AuthConfigError(
            f"node name {node!r} is not a Kubernetes node name (a lowercase RFC 1123 subdomain, at most 253 characters)"
        )
    return node


def _substitute(template: str, values: Mapping[str, str], what: str) -> str:
    try:
        return string.Template(template).substitute(values)
    except KeyError as exc:
        raise AuthConfigError(f"{what}: the template uses ${{{exc.args[0]}}}, which is not one of {sorted(values)}") from None
    except ValueError as exc:
        raise AuthConfigError(f"{what}: malformed template: {exc}") from None


def render_node_agent_user(template: str, node: str, public_key: str, names: InventoryNames) -> str:
    check_node_name(node)
    check_user_public_key(public_key, f"node {node}")
    values = {
        "node": node,
        "nkey": public_key,
        "permissions": json.dumps(node_agent_permissions([node], names).config()),
        "snapshot_subject": names.snapshot_subject(node),
        "heartbeat_subject": names.heartbeat_subject(node),
        "inbox_prefix": names.agent_inbox_prefix(node),
    }
    return _substitute(template, values, "node-agent-user.conf.tmpl")


def render_service_user(service: str, public_key: str, names: InventoryNames) -> str:
    """One service's user: its key and its role's permissions (JSON, which nats-server reads)."""
    permissions = json.dumps(service_permissions(service, names.prefix).config(), indent=2)
    indented = permissions.replace("\n", "\n        ")
    return (f"      # {service}: draplane.nats_roles.service_permissions({service!r}, {names.prefix!r})\n"
            f"      {{\n        nkey: {public_key}\n        permissions: {indented}\n      }}")


def render_auth_config(
    auth_template: str,
    node_user_template: str,
    *,
    service_keys: Mapping[str, str],
    system_key: str,
    node_keys: Mapping[str, str],
    names: InventoryNames = InventoryNames(),
) -> str:
    """The nats-server `accounts` config: the services' users, and one confined user per node.

    `service_keys` maps each of SERVICES (and optionally OPTIONAL_SERVICES) to its public key,
    `node_keys` node name to public key.
    """
    missing = [s for s in SERVICES if s not in service_keys]
    if missing:
        raise AuthConfigError(f"no public key for the services {missing}")
    unknown = sorted(set(service_keys) - set(KNOWN_SERVICES))
    if unknown:
        raise AuthConfigError(f"public keys given for unknown services {unknown}; services are {list(KNOWN_SERVICES)}")
    every_key: dict[str, str] = {}
    for owner, key in [*((f"service {s}", k) for s, k in service_keys.items()), ("system account", system_key),
                       *((f"node {n}", k) for n, k in node_keys.items())]:
        check_user_public_key(key, owner)
        if key in every_key:
            # One key for two users would give one of them the other's permissions.
            raise AuthConfigError(f"{owner} and {every_key[key]} share the public key {key}; each needs its own")
        every_key[key] = owner
    node_users = "\n".join(
        render_node_agent_user(node_user_template, node, node_keys[node], names) for node in sorted(node_keys)
    )
    values = {f"{service}_nkey": service_keys[service] for service in SERVICES}
    values["service_users"] = "\n".join(
        render_service_user(service, service_keys[service], names) for service in KNOWN_SERVICES if service in service_keys
    )
    values["system_nkey"] = system_key
    values["node_agent_users"] = node_users.rstrip("\n")
    return _substitute(auth_template, values, "auth.conf.tmpl")


# --- the keys file: every public key the cluster's NATS accepts -----------------------------------


class KeyRegistry(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Public keys only (safe to commit or keep in a ConfigMap): what `render_auth_config` needs.

    Kept as YAML, e.g. deploy/nats/keys.yaml, and updated by `draplane nats-auth issue`.
    """

    services: dict[str, str] = msgspec.field(default_factory=dict)
    system: str | None = None
    nodes: dict[str, str] = msgspec.field(default_factory=dict)


def load_registry(text: str, source: str) -> KeyRegistry:
    try:
        raw = yaml.safe_load(text) or {}
        registry = msgspec.convert(raw, KeyRegistry)
    except (yaml.YAMLError, msgspec.ValidationError) as exc:
        raise AuthConfigError(f"{source}: not a NATS key registry: {exc}") from None
    for service, key in registry.services.items():
        if service not in KNOWN_SERVICES:
            raise AuthConfigError(f"{source}: services.{service}: unknown service; services are {list(KNOWN_SERVICES)}")
        check_user_public_key(key, f"{source}: services.{service}")
    if registry.system is not None:
        check_user_public_key(registry.system, f"{source}: system")
    for node, key in registry.nodes.items():
        check_node_name(node)
        check_user_public_key(key, f"{source}: nodes.{node}")
    return registry


def dump_registry(registry: KeyRegistry) -> str:
    return yaml.safe_dump(msgspec.to_builtins(registry), sort_keys=True)


def with_key(registry: KeyRegistry, role: str, name: str | None, public_key: str, *, replace: bool) -> KeyRegistry:
    """A copy of `registry` with `public_key` recorded for the role (service NAME, node NAME, system).

    Replacing an existing key is rotation: the old seed stops working at the next config reload,
    so it must be asked for explicitly.
    """
    who = f"{role} {name}" if role != "system" else "system account"
    check_user_public_key(public_key, who)
    services, nodes, system = dict(registry.services), dict(registry.nodes), registry.system
    if role == "service":
        if name not in KNOWN_SERVICES:
            raise AuthConfigError(f"unknown service {name!r}; services are {list(KNOWN_SERVICES)}")
        existing, services[name] = services.get(name), public_key
    elif role == "node":
        check_node_name(name)
        existing, nodes[name] = nodes.get(name), public_key
    elif role == "system":
        existing, system = system, public_key
    else:
        raise AuthConfigError(f"unknown role {role!r}; roles are service, node, system")
    if existing is not None and not replace:
        raise AuthConfigError(f"{who} already has the key {existing}; pass --rotate to replace it")
    return KeyRegistry(services=services, system=system, nodes=nodes)


def without_node(registry: KeyRegistry, node: str) -> KeyRegistry:
    if node not in registry.nodes:
        raise AuthConfigError(f"node {node!r} has no key in the registry; nodes with keys: {sorted(registry.nodes)}")
    return KeyRegistry(services=dict(registry.services), system=registry.system,
                       nodes={n: k for n, k in registry.nodes.items() if n != node})


def render_registry(registry: KeyRegistry, auth_template: str, node_user_template: str, names: InventoryNames) -> str:
    if registry.system is None:
        raise AuthConfigError("the registry has no system account key; issue one with `draplane nats-auth issue system`")
    return render_auth_config(
        auth_template, node_user_template, service_keys=registry.services, system_key=registry.system,
        node_keys=registry.nodes, names=names,
    )
