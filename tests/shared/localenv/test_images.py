"""The local images made from busybox-static, and the registry the real node pulls them from."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from draplane.localenv.images import ImageError, Layout, build_layout, registry_app

BUSYBOX = Path("/usr/bin/busybox")
needs_busybox = pytest.mark.skipif(not BUSYBOX.is_file(), reason="Debian's busybox-static is not installed")


def test_a_missing_busybox_names_the_package(tmp_path):
    with pytest.raises(ImageError, match="apt-get install busybox-static"):
        build_layout(tmp_path / "layout", busybox=tmp_path / "no-busybox")


@needs_busybox
def test_the_layout_holds_busybox_and_pause_whose_layer_matches_its_diff_id(tmp_path):
    layout = Layout(build_layout(tmp_path / "layout"))
    assert {("library/busybox", "latest"), ("pause", "3.10")} <= set(layout.tags)
    digest, path = layout.manifest("library/busybox", "latest")
    assert "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest() == digest
    manifest = json.loads(path.read_bytes())
    config = json.loads(layout.blob(manifest["config"]["digest"]).read_bytes())
    layer = gzip.decompress(layout.blob(manifest["layers"][0]["digest"]).read_bytes())
    # containerd checks the unpacked layer against the config's diff_id
    assert config["rootfs"]["diff_ids"] == ["sha256:" + hashlib.sha256(layer).hexdigest()]
    names = tarfile.open(fileobj=io.BytesIO(layer)).getnames()
    assert {"bin/busybox", "bin/sh", "bin/sleep", "bin/ls", "tmp"} <= set(names)
    # Built once: a second call keeps the same blobs.
    assert Layout(build_layout(tmp_path / "layout")).manifest("library/busybox", "latest")[0] == digest


@needs_busybox
async def test_the_registry_serves_manifests_and_blobs_and_names_what_it_holds(tmp_path):
    from aiohttp.test_utils import TestClient, TestServer

    layout = Layout(build_layout(tmp_path / "layout"))
    async with TestClient(TestServer(registry_app(layout))) as client:
        assert (await client.get("/v2/")).status == 200
        response = await client.get("/v2/library/busybox/manifests/latest")
        assert response.status == 200 and response.headers["Content-Type"] == "application/vnd.oci.image.manifest.v1+json"
        digest = response.headers["Docker-Content-Digest"]
        assert (await client.head(f"/v2/library/busybox/manifests/{digest}")).status == 200
        manifest = json.loads(await response.read())
        blob = await client.get(f"/v2/library/busybox/blobs/{manifest['layers'][0]['digest']}")
        assert blob.status == 200 and len(await blob.read()) == manifest["layers"][0]["size"]
        missing = await client.get("/v2/library/ubuntu/manifests/22.04")
        assert missing.status == 404
        assert "library/ubuntu:22.04 is not in the local registry, which holds library/busybox" in (
            await missing.json())["errors"][0]["message"]
        assert (await client.get("/v2/library/busybox/blobs/sha256:../../etc/passwd")).status == 404
