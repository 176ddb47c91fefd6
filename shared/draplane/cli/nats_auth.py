"""`draplane nats-auth`: issue NATS credentials and render the nats-server auth config.

    draplane nats-auth issue --keys keys.yaml service inventory --seed-out inventory.seed
    draplane nats-auth issue --keys keys.yaml node gpu-node-1 --seed-out gpu-node-1.seed
    draplane nats-auth render --keys keys.yaml --templates deploy/nats -o auth.conf
    draplane nats-auth revoke --keys keys.yaml node gpu-node-1
    draplane nats-auth tls --out nats-tls/      # ca.crt, tls.crt, tls.key for the Secret draplane-nats-tls

`issue` makes a new nkey, writes its private seed to --seed-out (mode 0600, never overwritten)
and records only the public key in the keys file. deploy/README.md says where each seed goes.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("nats-auth", help="issue NATS nkeys for services and node agents; render auth.conf")
    commands = parser.add_subparsers(dest="nats_auth_command", metavar="ACTION", required=True)

    issue = commands.add_parser("issue", help="new key pair: seed to a file, public key into the keys file")
    issue.add_argument("--keys", type=Path, required=True, help="YAML file of public keys (created if missing)")
    issue.add_argument("--seed-out", type=Path, required=True, help="where to write the private seed (must not exist)")
    issue.add_argument("--rotate", action="store_true", help="replace an existing key for the same service or node")
    issue.add_argument("role", choices=("service", "node", "system"))
    issue.add_argument("name", nargs="?", help="the service (inventory|allocator|binder|audit|reader) or the node name")
    issue.set_defaults(handler=run_issue)

    render = commands.add_parser("render", help="the nats-server accounts config for every key in the keys file")
    render.add_argument("--keys", type=Path, required=True)
    render.add_argument("--templates", type=Path, default=Path("deploy/nats"),
                        help="folder with auth.conf.tmpl and node-agent-user.conf.tmpl (default: deploy/nats)")
    render.add_argument("--prefix", default=None, help="NATS subject prefix (default: draplane.)")
    render.add_argument("-o", "--output", type=Path, help="write here instead of stdout")
    render.set_defaults(handler=run_render)

    revoke = commands.add_parser("revoke", help="remove a node's key (its agent is refused after the next reload)")
    revoke.add_argument("--keys", type=Path, required=True)
    revoke.add_argument("role", choices=("node",))
    revoke.add_argument("name")
    revoke.set_defaults(handler=run_revoke)

    tls = commands.add_parser("tls", help="a new CA and the NATS servers' certificate, for the Secret draplane-nats-tls")
    tls.add_argument("--out", type=Path, required=True, help="folder for ca.crt, tls.crt and tls.key (none may exist)")
    tls.add_argument("--dns", action="append", default=None,
                     help="a name the servers are reached by (repeatable; default: deploy/'s Services in "
                          "namespace draplane)")
    tls.add_argument("--days", type=int, default=365, help="validity (default %(default)s)")
    tls.set_defaults(handler=run_tls)


def _fail(message: str) -> int:
    print(f"draplane nats-auth: error: {message}", file=sys.stderr)
    return 2


def _load(path: Path, *, missing_ok: bool):
    from draplane import natsauth

    if not path.exists():
        if missing_ok:
            return natsauth.KeyRegistry()
        raise natsauth.AuthConfigError(f"{path}: no such keys file; create it with `draplane nats-auth issue`")
    return natsauth.load_registry(path.read_text(), str(path))


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def run_issue(args: argparse.Namespace) -> int:
    from draplane import natsauth

    if args.role != "system" and not args.name:
        return _fail(f"issue {args.role} needs a name")
    if args.role == "system" and args.name:
        return _fail("issue system takes no name")
    try:
        registry = _load(args.keys, missing_ok=True)
        key = natsauth.new_user_key()
        updated = natsauth.with_key(registry, args.role, args.name, key.public_key, replace=args.rotate)
        # The seed first, exclusively: a crash leaves an unused seed, never a key with no seed.
        try:
            fd = os.open(args.seed_out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return _fail(f"{args.seed_out} already exists; a seed is never overwritten (remove it or choose another path)")
        with os.fdopen(fd, "wb") as out:
            out.write(key.seed + b"\n")
        _write_atomically(args.keys, natsauth.dump_registry(updated))
    except (natsauth.AuthConfigError, OSError) as exc:
        return _fail(str(exc))
    print(key.public_key)
    return 0


def run_render(args: argparse.Namespace) -> int:
    from draplane import natsauth
    from draplane.messages.inventory import InventoryNames

    try:
        registry = _load(args.keys, missing_ok=False)
        templates = {}
        for name in ("auth.conf.tmpl", "node-agent-user.conf.tmpl"):
            path = args.templates / name
            if not path.is_file():
                raise natsauth.AuthConfigError(f"{path}: template not found; pass --templates DIR (deploy/nats in the repo)")
            templates[name] = path.read_text()
        names = InventoryNames(args.prefix) if args.prefix else InventoryNames()
        text = natsauth.render_registry(registry, templates["auth.conf.tmpl"], templates["node-agent-user.conf.tmpl"], names)
    except (natsauth.AuthConfigError, ValueError, OSError) as exc:
        return _fail(str(exc))
    if args.output:
        _write_atomically(args.output, text)
    else:
        sys.stdout.write(text)
    return 0


def run_revoke(args: argparse.Namespace) -> int:
    from draplane import natsauth

    try:
        registry = _load(args.keys, missing_ok=False)
        _write_atomically(args.keys, natsauth.dump_registry(natsauth.without_node(registry, args.name)))
    except (natsauth.AuthConfigError, OSError) as exc:
        return _fail(str(exc))
    return 0


# deploy/nats/nats.yaml's client Service and the servers' names behind the headless one.
DEPLOY_NATS_NAMES = ("draplane-nats", "draplane-nats.draplane", "draplane-nats.draplane.svc",
                     "draplane-nats.draplane.svc.cluster.local", "*.draplane-nats-headless",
                     "*.draplane-nats-headless.draplane.svc.cluster.local")


def run_tls(args: argparse.Namespace) -> int:
    from draplane.localenv import pki

    files = ("ca.crt", "tls.crt", "tls.key")
    taken = [str(args.out / name) for name in files if (args.out / name).exists()]
    if taken:
        return _fail(f"{', '.join(taken)} already exist; certificates are never overwritten (use another --out)")
    if args.days < 1:
        return _fail("--days must be at least 1")
    try:
        tls = pki.create_nats_tls(args.out, dns_names=tuple(args.dns or DEPLOY_NATS_NAMES), loopback=False,
                                  days=args.days, file_names=files)
    except (OSError, ValueError) as exc:
        return _fail(str(exc))
    print(f"CA {tls.ca_cert}, server certificate {tls.server_cert} and key {tls.server_key}; then:\n"
          f"  kubectl -n draplane create secret generic draplane-nats-tls --from-file={args.out}/")
    return 0
