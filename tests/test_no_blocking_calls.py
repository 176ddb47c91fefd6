"""The suite's blocking-call fixture (tests/conftest.py, `no_blocking_calls`) on a deliberately
broken example: draplane code reading a file on the event loop's thread fails; the same read off
the loop, in a worker thread, does not."""

from __future__ import annotations

import asyncio

import pytest
from blockbuster import BlockingError

from draplane.api import codec

CLAIM = """apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: gpu, namespace: default}
spec: {devices: {requests: [{name: gpu, exactly: {deviceClassName: gpu.example.com}}]}}
"""


async def test_draplane_code_that_reads_a_file_on_the_loop_fails(no_blocking_calls, tmp_path):
    path = tmp_path / "claim.yaml"
    path.write_text(CLAIM)  # the test's own code is not scanned
    with pytest.raises(BlockingError, match="read"):
        codec.load_files([path])


async def test_the_same_read_in_a_worker_thread_passes(no_blocking_calls, tmp_path):
    path = tmp_path / "claim.yaml"
    path.write_text(CLAIM)
    [claim] = await asyncio.to_thread(codec.load_files, [path])
    assert claim.metadata.name == "gpu"


def test_a_synchronous_test_is_left_alone(no_blocking_calls, tmp_path):
    path = tmp_path / "claim.yaml"
    path.write_text(CLAIM)
    assert no_blocking_calls is None
    assert codec.load_files([path])[0].metadata.name == "gpu"
