"""The inventory service's asyncio shell: JetStream in, ResourceSlices and the inventory feed out.

Start-up, in order: make sure the stream and the feed bucket exist; list-then-watch Nodes and
ResourceSlices until both are synced; read the latest snapshot of every node from the stream (so
the service knows every node, even those whose snapshots a previous run already acknowledged);
reconcile every node that has a snapshot or a slice of ours; then consume the durable consumer and
the heartbeats. A snapshot is acknowledged only once its node's slices are written, so a restart
mid-stream gets the unwritten ones again; deterministic slice names make a repeated write an update,
never a duplicate.

Writes go through a queue of dirty nodes with a fixed number of workers: one node is written by one
worker at a time, and a node that changes again while it is being written is written once more
afterwards with the latest state, so bursts coalesce.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.js import api as js_api

from draplane.api.core import Node
from draplane.api.resource import DeviceClass, ResourceSlice
from draplane.audit_publisher import AuditPublisher
from draplane.jetstream.setup import until_answered
from draplane.kube import KubeClient
from draplane.kube.client import KubeApiError
from draplane.kube.watching import watch_objects
from draplane.messages.inventory import (
    SCHEMA_VERSION,
    FeedChange,
    FeedEntry,
    Heartbeat,
    InventoryNames,
    MessageError,
    NodeSnapshot,
    decode_agent_message,
    encode,
)
from draplane.messages import audit
from draplane_inventory.liveness import Liveness, NodeLivenessTable
from draplane.structured_logs import error_text, fields
from draplane_inventory.metrics import InventoryMetrics
from draplane_inventory.slicecache import SliceCache
from draplane.nodes.slices import (
    STALE_TAINT_KEY,
    NodeRef,
    PoolPlan,
    check_snapshot,
    drivers_of_other_publishers,
    is_managed,
    plan_node,
    refused_drivers,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class InventorySettings:
    prefix: str = "draplane."
    taint_after: float = 30.0  # seconds without a heartbeat before the node's devices are tainted
    remove_after: float = 120.0  # seconds without a heartbeat before the node's slices are deleted
    workers: int = 32
    ack_wait: float = 120.0
    fetch_batch: int = 256
    check_interval: float = 1.0
    feed_interval: float = 0.1
    stream_max_age: float = 7 * 24 * 3600.0
    stream_replicas: int = 1  # 3 on a 3-server NATS cluster
    # Value of the managed-by label on our slices; only slices with it are ever changed or deleted.
    instance: str = "draplane-inventory"


class InventoryService:
    def __init__(self, kube: KubeClient, connection: nats.NATS, settings: InventorySettings = InventorySettings(), *,
                 metrics: InventoryMetrics | None = None):
        self.kube = kube
        self.connection = connection
        self.js = connection.jetstream()
        self.settings = settings
        self.names = InventoryNames(settings.prefix)
        self.metrics = metrics if metrics is not None else InventoryMetrics()
        self.liveness = NodeLivenessTable(taint_after=settings.taint_after, remove_after=settings.remove_after)
        self.metrics.export_nodes(self._nodes_by_state)
        self.slices = SliceCache(self.names, settings.instance)
        self.nodes: dict[str, str] = {}  # name -> uid
        # DeviceClasses, published in the feed (`class.<name>`) so that readers of NATS alone
        # (`draplane free`, the metrics subscriber) know them
        self.classes: dict[str, DeviceClass] = {}
        self.audit = AuditPublisher(self.js, settings.prefix)
        self.generations: dict[tuple[str, str], int] = {}  # (node, driver) -> last generation written
        # (node, driver) -> the other publisher of that driver there, while we refuse to publish it
        self.refused: dict[tuple[str, str], str] = {}
        self.contested: set[tuple[str, str]] = set()  # ours came first; warned once
        self.ready = asyncio.Event()
        self._dirty: asyncio.Queue[str] = asyncio.Queue()
        self._queued: set[str] = set()
        self._in_flight: set[str] = set()
        self._again: set[str] = set()
        self._pending_acks: dict[str, list] = collections.defaultdict(list)
        self._feed_dirty: set[str] = set()
        self._synced = {"nodes": asyncio.Event(), "slices": asyncio.Event()}
        self._tasks: list[asyncio.Task] = []
        # Loops also check this: nats-py swallows a cancellation that lands inside its flush().
        self._stopping = False
        self._heartbeat_sub = None
        self.kv = None

    # --- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        await self._ensure_jetstream()
        await self.audit.start(replicas=self.settings.stream_replicas)
        self._spawn(self._watch_nodes(), "watch-nodes")
        self._spawn(self._watch_slices(), "watch-slices")
        self._spawn(self._watch_classes(), "watch-classes")
        for event in self._synced.values():
            await event.wait()
        primed = await self._prime_with_retries()
        for node in sorted(set(primed) | self.slices.managed_nodes()):
            self._mark_dirty(node)
        for key in list(self.slices.by_key):
            self._feed_dirty.add(key)
        self._feed_dirty.update(self.names.class_key(name) for name in self.classes)
        log.info("inventory: reconciling %d node(s) (%d snapshot(s) in the stream)", len(self._queued), len(primed))
        for i in range(self.settings.workers):
            self._spawn(self._worker(), f"writer-{i}")
        self._spawn(self._consume(), "consume")
        self._spawn(self._expire_loop(), "expire")
        self._spawn(self._feed_loop(), "feed")
        self._spawn(self.metrics.consumer_lag.poll_forever(self.js, [(self.names.stream, self.names.consumer)]),
                    "consumer-lag")
        self._heartbeat_sub = await self.connection.subscribe(self.names.heartbeat_wildcard, cb=self._on_heartbeat)
        await self.connection.flush()  # "ready" means the server has our subscription
        self.ready.set()

    async def stop(self, timeout: float = 10.0) -> None:
        """Cancel every task and wait for them, but never forever: a hung one is logged and left."""
        self._stopping = True
        if self._heartbeat_sub is not None:
            try:
                await asyncio.wait_for(self._heartbeat_sub.unsubscribe(), timeout)
            except (nats.errors.Error, asyncio.TimeoutError):
                pass
            self._heartbeat_sub = None
        await _cancel_all(self._tasks, timeout)
        self._tasks = []

    def _nodes_by_state(self) -> dict[str, int]:
        counts = {state.value: 0 for state in Liveness}
        for record in list(self.liveness.records.values()):
            counts[record.liveness.value] += 1
        return counts

    def dead_tasks(self) -> list[str]:
        """Names of tasks that ended: none should while the service runs."""
        return [t.get_name() for t in self._tasks if t.done()]

    async def wait_idle(self, timeout: float = 60.0) -> None:
        """Until no node is queued or being written and the feed is flushed (tests, benchmarks)."""
        deadline = time.monotonic() + timeout
        while self._queued or self._in_flight or self._again or self._feed_dirty:
            if time.monotonic() > deadline:
                raise TimeoutError(f"inventory not idle after {timeout}s: {len(self._queued)} queued, {len(self._in_flight)} writing")
            await asyncio.sleep(0.02)

    def _spawn(self, coro, name: str) -> None:
        task = asyncio.create_task(coro, name=f"inventory-{name}")
        task.add_done_callback(self._task_done)
        self._tasks.append(task)

    @staticmethod
    def _task_done(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("inventory task %s died", task.get_name(), exc_info=task.exception())

    # --- JetStream -----------------------------------------------------------------------------

    async def _ensure_jetstream(self) -> None:
        await until_answered(self._ensure_stream_and_bucket,
                             f"creating stream {self.names.stream} and bucket {self.names.feed_bucket}", log=log)

    async def _ensure_stream_and_bucket(self) -> None:
        config = js_api.StreamConfig(
            name=self.names.stream,
            subjects=[self.names.snapshot_wildcard],
            storage=js_api.StorageType.FILE,
            retention=js_api.RetentionPolicy.LIMITS,
            max_msgs_per_subject=1,  # the latest snapshot of each node is all that matters
            max_age=self.settings.stream_max_age,
            num_replicas=self.settings.stream_replicas,
        )
        try:
            await self.js.add_stream(config)
        except nats.js.errors.BadRequestError:
            await self.js.update_stream(config)
        try:
            self.kv = await self.js.key_value(self.names.feed_bucket)
        except nats.js.errors.BucketNotFoundError:
            self.kv = await self.js.create_key_value(js_api.KeyValueConfig(
                bucket=self.names.feed_bucket, history=1, replicas=self.settings.stream_replicas))

    async def _prime_from_stream(self) -> dict[str, NodeSnapshot]:
        """The latest snapshot of every node, straight from the stream, without consuming it."""
        info = await self.js.stream_info(self.names.stream)
        if not info.state.messages:
            return {}
        sub = await self.js.pull_subscribe(
            self.names.snapshot_wildcard, stream=self.names.stream,
            config=js_api.ConsumerConfig(deliver_policy=js_api.DeliverPolicy.LAST_PER_SUBJECT,
                                         ack_policy=js_api.AckPolicy.NONE, inactive_threshold=30.0),
        )
        primed: dict[str, NodeSnapshot] = {}
        now = time.monotonic()
        try:
            while not self._stopping:
                try:
                    batch = await sub.fetch(self.settings.fetch_batch, timeout=1.0)
                except nats.errors.TimeoutError:
                    break
                for msg in batch:
                    message = self._decode(msg.subject, msg.data)
                    if isinstance(message, NodeSnapshot):
                        self.liveness.apply_snapshot(message, now)
                        primed[message.node] = message
                if batch and batch[-1].metadata.num_pending == 0:
                    break
        finally:
            try:
                await sub.unsubscribe()
            except nats.errors.Error:
                pass
        return primed

    async def _prime_with_retries(self, attempts: int = 8) -> dict[str, NodeSnapshot]:
        """Read the stream's snapshots at start, riding out a JetStream that is not serving yet: on
        a NATS cluster the stream's leader may still be elected (503 "service unavailable")."""
        delay = 0.5
        for attempt in range(1, attempts + 1):
            try:
                return await self._prime_from_stream()
            except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError) as exc:
                if attempt == attempts:
                    raise
                log.warning("inventory: reading the snapshot stream failed (%r); retrying in %.1f s (attempt %d of %d)",
                            exc, delay, attempt, attempts)
                await asyncio.sleep(delay)
                delay = min(8.0, delay * 2)
        raise AssertionError("unreachable")

    def _decode(self, subject: str, data: bytes) -> NodeSnapshot | Heartbeat | None:
        """The message, or None after logging and counting why it was rejected."""
        try:
            kind, node = self.names.node_from_subject(subject)
            message = decode_agent_message(data)
            if (kind == "snapshot") != isinstance(message, NodeSnapshot):
                raise MessageError("malformed", f"a {type(message).__name__} on the {kind} subject")
            NodeLivenessTable.check_subject(node, message)
            if isinstance(message, NodeSnapshot):
                check_snapshot(message)
        except MessageError as exc:
            self.metrics.messages_rejected.labels(exc.reason).inc()
            log.warning("inventory: rejected message on %s (%s): %s", subject, exc.reason, exc)
            return None
        return message

    async def _subscribe_durable(self):
        return await self.js.pull_subscribe(
            self.names.snapshot_wildcard, durable=self.names.consumer, stream=self.names.stream,
            config=js_api.ConsumerConfig(
                ack_policy=js_api.AckPolicy.EXPLICIT, ack_wait=self.settings.ack_wait,
                max_ack_pending=100_000, max_deliver=-1,
            ),
        )

    async def _jetstream_lost(self) -> bool:
        """True after making the stream, consumer and bucket again, if NATS lost them (restarted
        without its store); False when they are there, or NATS cannot say yet."""
        try:
            await self.js.consumer_info(self.names.stream, self.names.consumer)
            await self.js.stream_info(f"KV_{self.names.feed_bucket}")
            return False
        except nats.js.errors.NotFoundError:
            pass
        except (nats.errors.Error, nats.js.errors.Error, OSError, asyncio.TimeoutError):
            return False
        log.warning("inventory: NATS lost the inventory stream, consumer or feed bucket; creating them again")
        self.metrics.jetstream_recreated.inc()
        await self._ensure_jetstream()
        # A new bucket needs every key; agents resend their snapshots after reconnecting.
        self._feed_dirty.update(k for k, names in self.slices.by_key.items() if names)
        self._feed_dirty.update(self.names.class_key(name) for name in self.classes)
        return True

    async def _consume(self) -> None:
        sub = await self._subscribe_durable()
        failures = 0
        while not self._stopping:
            try:
                try:
                    batch = await sub.fetch(self.settings.fetch_batch, timeout=5.0)
                except nats.errors.TimeoutError:
                    # Idle, or NATS lost the consumer (a fetch then just times out): ask which.
                    if await self._jetstream_lost():
                        sub = await self._subscribe_durable()
                    continue
            except (nats.errors.Error, nats.js.errors.Error, OSError) as exc:
                failures += 1
                log.info("inventory: fetching snapshots failed (%s); retrying", error_text(exc))
                await asyncio.sleep(min(5.0, 0.1 * 2**failures))
                try:
                    if await self._jetstream_lost():
                        sub = await self._subscribe_durable()
                except (nats.errors.Error, nats.js.errors.Error, OSError) as again:
                    log.info("inventory: recreating the stream failed (%s); retrying", error_text(again))
                continue
            failures = 0
            now = time.monotonic()
            for msg in batch:
                self.metrics.messages_received.labels("snapshot").inc()
                message = self._decode(msg.subject, msg.data)
                if message is None:
                    await _ack(msg, term=True)
                    continue
                if self.liveness.apply_snapshot(message, now):
                    self.metrics.snapshots_applied.inc()
                    self._pending_acks[message.node].append(msg)
                    self._mark_dirty(message.node)
                else:
                    await _ack(msg)

    async def _on_heartbeat(self, msg) -> None:
        self.metrics.messages_received.labels("heartbeat").inc()
        message = self._decode(msg.subject, msg.data)
        if message is None:
            return
        record = self.liveness.records.get(message.node)
        if record is not None and record.agent_id == message.agent_id and record.digest != message.snapshot_digest:
            # The agent vouches for a snapshot we never applied; it is still in the stream or on its way.
            self.metrics.heartbeat_digest_mismatches.inc()
        record = self.liveness.records.get(message.node)
        tainted_at = record.tainted_at if record is not None else None
        if self.liveness.apply_heartbeat(message, time.monotonic()):
            log.info("inventory: node %s is back; removing the stale taint", message.node,
                     extra=fields(node=message.node))
            self._mark_dirty(message.node)
            self.audit.publish(self._stale_event("untainted", message.node, tainted_at or "",
                                                 "the node agent is heartbeating again: stale taint removed"))

    async def _expire_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.settings.check_interval)
            for node in self.liveness.expire(time.monotonic(), time.time()):
                state = self.liveness.liveness(node)
                log.warning("inventory: node %s missed its heartbeats; its devices are now %s", node, state.value,
                            extra=fields(node=node))
                self.metrics.stale_transitions.labels(state.value).inc()
                self._mark_dirty(node)
                self.audit.publish(self._stale_audit_event(node, state))

    def _stale_audit_event(self, node: str, state: Liveness) -> audit.AuditEvent:
        record = self.liveness.records[node]
        if state is Liveness.TAINTED:
            return self._stale_event("tainted", node, record.tainted_at or "",
                                     f"no heartbeat from the node agent for {self.settings.taint_after:.0f} s: "
                                     f"{STALE_TAINT_KEY}=true:NoSchedule")
        return self._stale_event("removed", node, record.tainted_at or "",
                                 f"no heartbeat from the node agent for {self.settings.remove_after:.0f} s: "
                                 "its ResourceSlices are deleted")

    def _stale_event(self, kind: str, node: str, since: str, reason: str) -> audit.AuditEvent:
        record = self.liveness.records.get(node)
        devices = [audit.DeviceRef(driver=d.driver, pool=node, device=device.name)
                   for d in (record.drivers if record is not None else ()) for device in d.devices]
        return audit.AuditEvent(
            id=audit.stale_node_id(kind, node, since), kind=kind, at=time.time(), by=[self.settings.instance],
            node=node, devices=devices[:audit.MAX_DEVICES_NAMED], device_count=len(devices), reason=reason,
        )

    # --- Kubernetes ----------------------------------------------------------------------------

    async def _watch_nodes(self) -> None:
        async for event in watch_objects(self.kube, Node):
            if event.type == "SYNCED":
                self._synced["nodes"].set()
                continue
            name, uid = event.object.metadata.name, event.object.metadata.uid
            if event.type == "DELETED":
                self.nodes.pop(name, None)
            elif self.nodes.get(name) != uid:
                self.nodes[name] = uid
            else:
                continue
            if self._synced["nodes"].is_set() and (name in self.liveness.records or self.slices.managed_for_node(name)):
                # A snapshot was waiting for this Node, or the Node is gone and its slices must go.
                self._mark_dirty(name)

    async def _watch_slices(self) -> None:
        async for event in watch_objects(self.kube, ResourceSlice):
            if event.type == "SYNCED":
                self._synced["slices"].set()
                continue
            if event.type == "DELETED":
                key = self.slices.remove(event.object.metadata.name, event.object.metadata.resource_version)
            else:
                key = self.slices.put(event.object)
            if key is not None:
                self._feed_dirty.add(key)
                if event.type == "DELETED" and is_managed(event.object, self.settings.instance) and self._synced["slices"].is_set():
                    # Someone else deleted one of ours: put it back if the node still has devices.
                    self._mark_dirty(event.object.spec.node_name)
                elif (event.type in ("ADDED", "DELETED") and not is_managed(event.object, self.settings.instance)
                      and event.object.spec.node_name in self.liveness.records and self._synced["slices"].is_set()):
                    # Another publisher came or went on a node of ours: which drivers are ours to
                    # publish there may have changed.
                    self._mark_dirty(event.object.spec.node_name)

    async def _watch_classes(self) -> None:
        async for event in watch_objects(self.kube, DeviceClass):
            if event.type == "SYNCED":
                continue  # classes are not the inventory's job: start-up does not wait for them
            name = event.object.metadata.name or ""
            if event.type == "DELETED":
                self.classes.pop(name, None)
            else:
                self.classes[name] = event.object
            self._feed_dirty.add(self.names.class_key(name))

    def _mark_dirty(self, node: str | None) -> None:
        if not node:
            return
        if node in self._in_flight:
            self._again.add(node)
        elif node not in self._queued:
            self._queued.add(node)
            self._dirty.put_nowait(node)

    async def _worker(self) -> None:
        while not self._stopping:
            node = await self._dirty.get()
            self._queued.discard(node)
            self._in_flight.add(node)
            acks = self._pending_acks.pop(node, [])
            try:
                await self._sync_node(node)
            except Exception as exc:  # one node's failure must not stop the others
                self.metrics.sync_failures.inc()
                log.warning("inventory: writing the slices of node %s failed: %s; retrying", node, error_text(exc),
                            extra=fields(node=node))
                self._pending_acks[node][:0] = acks
                acks = []
                self._in_flight.discard(node)
                await asyncio.sleep(0.5)
                self._mark_dirty(node)
                continue
            for msg in acks:
                await _ack(msg)
            self._in_flight.discard(node)
            if node in self._again:
                self._again.discard(node)
                self._mark_dirty(node)

    async def _sync_node(self, node: str, attempt: int = 0) -> None:
        desired = self.liveness.desired(node)
        existing = self.slices.managed_for_node(node)
        uid = self.nodes.get(node)
        drivers = desired.drivers
        if uid is None:
            # No Node object (not registered yet, or deleted): no slices, since nothing could own them.
            if drivers:
                self.metrics.nodes_without_node_object.inc()
                log.info("inventory: node %s has devices but no Node object; publishing none until it exists", node,
                         extra=fields(node=node))
            drivers = []
            uid = _owner_uid(existing) or ""
        drivers = self._without_refused_drivers(node, drivers, existing)
        plans = plan_node(
            NodeRef(node, uid), drivers, existing, taint=desired.taint,
            last_generations={d: g for (n, d), g in self.generations.items() if n == node},
            managed_by=self.settings.instance,
        )
        for plan in plans:
            if plan.empty:
                continue
            try:
                await self._execute(plan)
            except KubeApiError as exc:
                if (exc.is_conflict or exc.is_already_exists) and attempt < 5:
                    # Our cache was behind the apiserver: refresh this node's slices and plan again.
                    await self._refresh_node(node)
                    await self._sync_node(node, attempt + 1)
                    return
                raise

    def _without_refused_drivers(self, node: str, drivers: list, existing: list[ResourceSlice]) -> list:
        """The node's drivers less those another publisher already uses on it; a refusal is
        logged when it starts and when it ends, and counted while it lasts."""
        others = drivers_of_other_publishers(self.slices.slices(self.names.node_key(node)), self.settings.instance)
        refused = refused_drivers([d.driver for d in drivers], existing, others)
        for driver, holder in refused.items():
            if self.refused.get((node, driver)) != holder:
                log.warning("inventory: not publishing driver %s on node %s: %s already publishes it there. One "
                            "driver name has one publisher per node: run draplane's node agent for it, or the "
                            "other driver, not both", driver, node, holder, extra=fields(node=node))
        for key in [k for k in self.refused if k[0] == node and k[1] not in refused]:
            log.info("inventory: driver %s on node %s has no other publisher any more; publishing it", key[1], node,
                     extra=fields(node=node))
            del self.refused[key]
        self.refused.update({(node, driver): holder for driver, holder in refused.items()})
        for driver in {d.driver for d in drivers} & others.keys() - refused.keys():
            if (node, driver) not in self.contested:
                self.contested.add((node, driver))
                log.warning("inventory: %s also publishes driver %s on node %s, where draplane's slices came first; "
                            "the scheduler sees the pool twice until one of them goes", others[driver], driver, node,
                            extra=fields(node=node))
        self.metrics.drivers_refused.set(len(self.refused))
        return [d for d in drivers if d.driver not in refused]

    async def _refresh_node(self, node: str) -> None:
        items, _ = await self.kube.list(ResourceSlice, field_selector=f"spec.nodeName={node}")
        present = {s.metadata.name for s in items}
        for s in self.slices.slices(self.names.node_key(node)):
            if s.metadata.name not in present:
                self.slices.remove(s.metadata.name)
        for s in items:
            self.slices.put(s)

    async def _execute(self, plan: PoolPlan) -> None:
        for s in plan.creates:
            created = await self.kube.create(s)
            self.metrics.slice_writes.labels("create").inc()
            self._feed_dirty.add(self.slices.put(created))
        for s in plan.updates:
            updated = await self.kube.update(s)
            self.metrics.slice_writes.labels("update").inc()
            self._feed_dirty.add(self.slices.put(updated))
        for name in plan.deletes:
            await self.kube.delete(ResourceSlice, name)
            self.metrics.slice_writes.labels("delete").inc()
            key = self.slices.remove(name)
            if key:
                self._feed_dirty.add(key)
        self.generations[(plan.pool, plan.driver)] = plan.generation

    # --- inventory feed ------------------------------------------------------------------------

    async def _feed_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.settings.feed_interval)
            if not self._feed_dirty:
                continue
            keys, self._feed_dirty = sorted(self._feed_dirty), set()
            for i, key in enumerate(keys):
                try:
                    await self._publish_feed(key)
                except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError) as exc:
                    log.info("inventory: feed update for %s failed (%s); %d key(s) left to retry", key, error_text(exc),
                             len(keys) - i)
                    self._feed_dirty.update(keys[i:])
                    break
            if self._feed_dirty:
                await asyncio.sleep(0.5)
                try:
                    await self._jetstream_lost()
                except (nats.errors.Error, nats.js.errors.Error, OSError):
                    pass

    async def _publish_feed(self, key: str) -> None:
        # Compact: managedFields would more than double an entry, and no allocator reads them.
        slices = [msgspec.structs.replace(s, metadata=msgspec.structs.replace(s.metadata, managed_fields=None))
                  for s in self.slices.slices(key)]
        node = key[len("node."):] if key.startswith("node.") else None
        device_class = self.classes.get(key[len("class."):]) if key.startswith("class.") else None
        if device_class is not None:
            device_class = msgspec.structs.replace(
                device_class, metadata=msgspec.structs.replace(device_class.metadata, managed_fields=None))
            entry = FeedEntry(schema_version=SCHEMA_VERSION, key=key, device_class=device_class)
            revision = await self.kv.put(key, encode(entry))
            change = FeedChange(schema_version=SCHEMA_VERSION, key=key, kind="put", revision=revision)
        elif slices:
            entry = FeedEntry(schema_version=SCHEMA_VERSION, key=key, node=node,
                              stale=node is not None and self.liveness.liveness(node) is Liveness.TAINTED, slices=slices)
            revision = await self.kv.put(key, encode(entry))
            change = FeedChange(schema_version=SCHEMA_VERSION, key=key, kind="put", revision=revision,
                                device_count=sum(len(s.spec.devices or []) for s in slices))
        else:
            try:
                await self.kv.delete(key)
            except nats.js.errors.KeyNotFoundError:
                pass
            change = FeedChange(schema_version=SCHEMA_VERSION, key=key, kind="delete", revision=0)
        self.metrics.feed_updates.labels(change.kind).inc()
        await self.connection.publish(self.names.change_subject(key), encode(change))


async def _cancel_all(tasks: list[asyncio.Task], timeout: float) -> None:
    for task in tasks:
        task.cancel()
    if not tasks:
        return
    _, hung = await asyncio.wait(tasks, timeout=timeout)
    for task in hung:
        log.error("task %s did not stop within %.0fs of being cancelled", task.get_name(), timeout)


def _owner_uid(slices: list[ResourceSlice]) -> str | None:
    for s in slices:
        for ref in s.metadata.owner_references or []:
            if ref.kind == "Node":
                return ref.uid
    return None


async def _ack(msg, *, term: bool = False) -> None:
    try:
        await (msg.term() if term else msg.ack())
    except (nats.errors.Error, nats.js.errors.Error) as exc:
        log.debug("ack failed (it will be redelivered): %s", exc)
