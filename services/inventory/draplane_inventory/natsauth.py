"""nats-server `authorization` for the inventory flow: each node agent may publish only its own node's
snapshot and heartbeat subjects and read only its own reply inbox; the inventory service may do
everything. Rendered as JSON, which nats-server's configuration format accepts as is. Pure.
"""

from __future__ import annotations

import json

from draplane.messages.inventory import InventoryNames


def authorization_block(
    names: InventoryNames, agent_passwords: dict[str, str], *, service_user: str, service_password: str
) -> str:
    users = [{"user": service_user, "password": service_password}]
    for node, password in sorted(agent_passwords.items()):
        if not node or any(c in node for c in " *>\t"):
            raise ValueError(f"node name {node!r} cannot be used in a NATS subject")
        users.append({"user": f"node-agent-{node}", "password": password, "permissions": names.agent_permissions(node)})
    return "authorization " + json.dumps({"users": users}, indent=2)


def agent_user(node: str) -> str:
    return f"node-agent-{node}"
