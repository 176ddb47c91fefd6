from __future__ import annotations

from draplane.api.meta import ObjectMeta
from draplane.api.resource import ResourcePool, ResourceSlice, ResourceSliceSpec
from draplane.messages.inventory import InventoryNames
from prometheus_client import generate_latest

from draplane.metrics import sample_value
from draplane_inventory.metrics import InventoryMetrics
from draplane_inventory.slicecache import SliceCache
from draplane.nodes.slices import MANAGED_BY_LABEL


def _slice(name, rv, node="n1", driver="gpu.nvidia.com", managed="inv", pool=None):
    return ResourceSlice(
        metadata=ObjectMeta(name=name, resource_version=str(rv), labels={MANAGED_BY_LABEL: managed} if managed else None),
        spec=ResourceSliceSpec(driver=driver, pool=ResourcePool(name=pool or node or "p", generation=1, resource_slice_count=1),
                               node_name=node, all_nodes=None if node else True),
    )


def test_keys_by_node_and_by_pool():
    cache = SliceCache(InventoryNames(), "inv")
    assert cache.put(_slice("a", 1)) == "node.n1"
    assert cache.put(_slice("b", 2, node=None, driver="nas.example.com", pool="san", managed=None)) == "pool.nas.example.com.san"
    assert [s.metadata.name for s in cache.slices("node.n1")] == ["a"]
    assert cache.managed_nodes() == {"n1"}


def test_an_overtaken_watch_event_is_dropped():
    cache = SliceCache(InventoryNames(), "inv")
    cache.put(_slice("a", 10))  # the response to our own update
    assert cache.put(_slice("a", 7)) is None  # the watch's older event arrives later
    assert cache.by_name["a"].metadata.resource_version == "10"


def test_deletion_of_an_earlier_incarnation_keeps_the_new_one():
    cache = SliceCache(InventoryNames(), "inv")
    cache.put(_slice("a", 20))  # re-created after a delete at revision 15
    assert cache.remove("a", "15") is None
    assert "a" in cache.by_name
    assert cache.remove("a", "21") == "node.n1"
    assert cache.slices("node.n1") == []


def test_only_our_instance_is_managed():
    cache = SliceCache(InventoryNames(), "inv")
    cache.put(_slice("ours", 1))
    cache.put(_slice("theirs", 2, managed="other-instance"))
    assert [s.metadata.name for s in cache.managed_for_node("n1")] == ["ours"]
    assert len(cache.slices("node.n1")) == 2  # the feed still carries both


def test_metrics_are_counted_in_the_service_s_own_registry():
    metrics, other = InventoryMetrics(), InventoryMetrics()  # two services in one process do not collide
    metrics.messages_rejected.labels("version").inc(2)
    metrics.slice_writes.labels("create").inc()
    metrics.export_nodes(lambda: {"fresh": 3, "tainted": 1})
    assert sample_value(metrics.registry, "draplane_inventory_messages_rejected_total", reason="version") == 2
    assert sample_value(metrics.registry, "draplane_inventory_messages_rejected_total") == 2
    assert sample_value(other.registry, "draplane_inventory_messages_rejected_total") == 0
    text = generate_latest(metrics.registry).decode()
    assert 'draplane_inventory_messages_rejected_total{reason="version"} 2.0' in text
    assert 'draplane_inventory_nodes{state="tainted"} 1.0' in text
