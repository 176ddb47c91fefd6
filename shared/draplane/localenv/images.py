"""The local cluster's container images, made from Debian's busybox-static, and a registry that
serves them.

No image registry is reachable from this machine, so the real node pulls from one of ours: the
containerd of the real node mirrors docker.io and draplane.local to it (`realnode.py`). A
manifest that says `image: busybox` (pull policy Always, as `latest` implies) pulls our busybox
as written, and the sandbox ("pause") image is busybox that sleeps.

The images are an OCI layout on disk (`build_layout`); the registry serves the read half of the
OCI distribution API from it (`python -m draplane.localenv.images --layout DIR --listen H:P`).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

BUSYBOX = Path("/usr/bin/busybox")  # Debian's busybox-static: one static binary, no libraries
# repository -> tags, as a manifest names them. docker.io/library/busybox is what `image: busybox`
# means; the pause image is the node's sandbox image.
BUSYBOX_REPOSITORY = "library/busybox"
BUSYBOX_TAGS = ("latest", "1.35", "stable")
PAUSE_REPOSITORY = "pause"
PAUSE_TAG = "3.10"
PAUSE_IMAGE = f"draplane.local/{PAUSE_REPOSITORY}:{PAUSE_TAG}"
MIRRORED_REGISTRIES = ("docker.io", "draplane.local")

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar+gzip"
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class ImageError(RuntimeError):
    pass


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _applets(busybox: Path) -> list[str]:
    out = subprocess.run([str(busybox), "--list"], capture_output=True, text=True, check=True).stdout
    return sorted({name for name in out.split() if name and "/" not in name and name != "busybox"})


def _layer(busybox: Path) -> bytes:
    """An uncompressed tar: /bin/busybox, a link per applet, and the folders a container expects."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        def folder(name: str, mode: int = 0o755) -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, mode, 0
            tar.addfile(info)

        def text(name: str, content: str) -> None:
            data = content.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))

        for name in ("bin", "etc", "proc", "sys", "dev", "root", "var", "var/run", "home"):
            folder(name, 0o700 if name == "root" else 0o755)
        folder("tmp", 0o1777)
        data = busybox.read_bytes()
        info = tarfile.TarInfo("bin/busybox")
        info.size, info.mode, info.mtime = len(data), 0o755, 0
        tar.addfile(info, io.BytesIO(data))
        for applet in _applets(busybox):
            link = tarfile.TarInfo(f"bin/{applet}")
            link.type, link.linkname, link.mode, link.mtime = tarfile.SYMTYPE, "busybox", 0o777, 0
            tar.addfile(link)
        text("etc/passwd", "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/home:/bin/false\n")
        text("etc/group", "root:x:0:\nnobody:x:65534:\n")
    return buffer.getvalue()


def build_layout(target: Path, *, busybox: Path = BUSYBOX) -> Path:
    """Write the OCI layout of the busybox and pause images into `target`; returns it. Rebuilt only
    when busybox changed (its digest is recorded)."""
    if not busybox.is_file():
        raise ImageError(f"{busybox} is missing: install Debian's busybox-static package (apt-get install busybox-static)")
    stamp = target / "busybox.sha256"
    source_digest = _digest(busybox.read_bytes())
    if stamp.is_file() and stamp.read_text() == source_digest and (target / "index.json").is_file():
        return target
    blobs = target / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)

    def put(data: bytes) -> str:
        digest = _digest(data)
        path = blobs / digest.split(":", 1)[1]
        if not path.exists():
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        return digest

    tar = _layer(busybox)
    compressed = gzip.compress(tar, mtime=0)
    layer_digest = put(compressed)
    manifests = []
    for repository, tags, config in (
        (BUSYBOX_REPOSITORY, BUSYBOX_TAGS, {"Env": [PATH_ENV], "Cmd": ["sh"]}),
        # The sandbox holds the pod's namespaces and does nothing; a pause that sleeps.
        (PAUSE_REPOSITORY, (PAUSE_TAG,), {"Env": [PATH_ENV], "Entrypoint": ["/bin/sleep", "2147483647"]}),
    ):
        image_config = json.dumps({
            "architecture": "amd64", "os": "linux", "config": config,
            "rootfs": {"type": "layers", "diff_ids": [_digest(tar)]},
            "history": [{"created_by": f"draplane: Debian busybox-static ({busybox})"}],
        }, sort_keys=True).encode()
        config_digest = put(image_config)
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": MANIFEST_TYPE,
            "config": {"mediaType": CONFIG_TYPE, "digest": config_digest, "size": len(image_config)},
            "layers": [{"mediaType": LAYER_TYPE, "digest": layer_digest, "size": len(compressed)}],
        }, sort_keys=True).encode()
        manifest_digest = put(manifest)
        for tag in tags:
            manifests.append({"mediaType": MANIFEST_TYPE, "digest": manifest_digest, "size": len(manifest),
                              "platform": {"architecture": "amd64", "os": "linux"},
                              "annotations": {"org.opencontainers.image.ref.name": f"{repository}:{tag}"}})
    (target / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    (target / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": manifests}, indent=1))
    stamp.write_text(source_digest)
    return target


class Layout:
    """The layout, read for serving: tags, and blobs by digest."""

    def __init__(self, root: Path):
        self.root = root
        index = json.loads((root / "index.json").read_text())
        self.tags: dict[tuple[str, str], dict] = {}
        for entry in index["manifests"]:
            repository, tag = entry["annotations"]["org.opencontainers.image.ref.name"].rsplit(":", 1)
            self.tags[(repository, tag)] = entry

    def blob(self, digest: str) -> Path | None:
        algorithm, _, hexdigest = digest.partition(":")
        if algorithm != "sha256" or len(hexdigest) != 64 or not all(c in "0123456789abcdef" for c in hexdigest):
            return None
        path = self.root / "blobs" / "sha256" / hexdigest
        return path if path.is_file() else None

    def manifest(self, repository: str, reference: str) -> tuple[str, Path] | None:
        if reference.startswith("sha256:"):
            digests = {e["digest"] for (r, _), e in self.tags.items() if r == repository}
            path = self.blob(reference) if reference in digests else None
            return (reference, path) if path else None
        entry = self.tags.get((repository, reference))
        return (entry["digest"], self.blob(entry["digest"])) if entry else None


def registry_app(layout: Layout):
    """The pull half of the OCI distribution API: /v2/, manifests and blobs, GET and HEAD."""
    from aiohttp import web

    def error(status: int, code: str, message: str) -> web.Response:
        return web.json_response({"errors": [{"code": code, "message": message}]}, status=status)

    def file_response(request: web.Request, path: Path, digest: str, content_type: str) -> web.Response:
        headers = {"Docker-Content-Digest": digest, "Content-Type": content_type,
                   "Content-Length": str(path.stat().st_size)}
        if request.method == "HEAD":
            return web.Response(headers=headers)
        return web.Response(body=path.read_bytes(), headers=headers)

    async def root(request: web.Request) -> web.Response:
        return web.json_response({}, headers={"Docker-Distribution-API-Version": "registry/2.0"})

    async def manifest(request: web.Request) -> web.Response:
        repository, reference = request.match_info["name"], request.match_info["reference"]
        found = layout.manifest(repository, reference)
        if found is None:
            known = sorted(f"{r}:{t}" for r, t in layout.tags)
            return error(404, "MANIFEST_UNKNOWN", f"{repository}:{reference} is not in the local registry, "
                                                  f"which holds {', '.join(known)}")
        return file_response(request, found[1], found[0], MANIFEST_TYPE)

    async def blob(request: web.Request) -> web.Response:
        digest = request.match_info["digest"]
        path = layout.blob(digest)
        if path is None:
            return error(404, "BLOB_UNKNOWN", f"blob {digest} is not in the local registry")
        return file_response(request, path, digest, "application/octet-stream")

    app = web.Application()
    app.router.add_route("GET", "/v2/", root)
    app.router.add_route("*", "/v2/{name:.+}/manifests/{reference}", manifest)
    app.router.add_route("*", "/v2/{name:.+}/blobs/{digest}", blob)
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m draplane.localenv.images",
                                     description="Build the local images and serve them as a read-only registry.")
    parser.add_argument("--layout", required=True, type=Path, help="the OCI layout folder (built when missing)")
    parser.add_argument("--listen", default="127.0.0.1:5000", help="host:port (default %(default)s)")
    args = parser.parse_args(argv)
    from aiohttp import web

    try:
        layout = Layout(build_layout(args.layout))
    except (ImageError, OSError, subprocess.CalledProcessError) as exc:
        print(f"images: {exc}", file=sys.stderr)
        return 1
    host, _, port = args.listen.rpartition(":")
    web.run_app(registry_app(layout), host=host, port=int(port), print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
