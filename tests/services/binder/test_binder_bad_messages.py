"""The binder given what is not ours on the placement subject logs it, terms it (no redelivery)
and keeps binding. The decoder itself is fuzzed in tests/shared/scheduling/test_fuzz_*.py."""

from __future__ import annotations

import logging
import uuid

import msgspec
import pytest

from draplane.simulation import scenario
from draplane.scheduling.messages import PodRef, Subjects, Unschedulable, encode_message
from conftest import ensure_class  # noqa: E402  (tests/services/conftest.py)

pytestmark = pytest.mark.integration


async def test_the_binder_drops_what_is_not_ours_and_keeps_binding(scheduling, kube, nats, namespace, caplog):
    caplog.set_level(logging.INFO)
    class_name = f"gpu-{uuid.uuid4().hex[:6]}"
    await ensure_class(kube, scenario.device_class(class_name))
    node = f"bad-res-{namespace[-6:]}"
    await scheduling.put_node(scenario.gpu_node(node), [scenario.gpu_slice(node, 1, "80Gi")])
    await scheduling.start()
    js = nats.jetstream()
    subjects = Subjects(prefix=scheduling.prefix)
    newer = Unschedulable(version=2, pod=PodRef(namespace=namespace, name="x", uid="u"), shard=0, message="?")
    for junk in (b"\x93junk", msgspec.msgpack.encode({"type": "placement", "pod": []}), encode_message(newer)):
        await js.publish(subjects.results, junk, stream=subjects.results_stream)

    await kube.create(scenario.claim(namespace, "mine", class_name))
    await kube.create(scheduling.pod(namespace, "mine", claim_name="mine"))
    assert (await scheduling.bound_pod(namespace, "mine", timeout=60)).spec.node_name == node

    async def all_answered():
        info = await js.consumer_info(subjects.results_stream, "binder")
        return info.num_ack_pending == 0 and info.num_pending == 0 and info.num_redelivered == 0

    await scheduling.wait_for(all_answered, what="the bad results to be termed, none redelivered")
    messages = [r.getMessage() for r in caplog.records]
    assert sum("dropping a result that is not ours" in m for m in messages) == 3
    assert any("Unschedulable: field version is 2" in m for m in messages)
