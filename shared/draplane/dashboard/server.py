"""The dashboard's shell: NATS in, an aiohttp page and server-sent events out.

Everything it shows comes from NATS (see `device_map` and `scheduling_facts` for which facts
from where); it writes nothing there and never asks Kubernetes.

- The inventory feed and reservation buckets are followed with draplane.device_view, the
  view `draplane free` and the metrics subscriber read.
- Plain subscriptions on ``{prefix}pending.*`` and ``{prefix}placement`` see every PendingPod,
  Placement and Unschedulable as it is published, without taking part in the work-queue streams.
- Two ephemeral pull consumers read the audit stream, never acknowledging (the audit subscriber's
  durable consumer is not touched): DeviceTaintRule events from the start of the stream (rules
  live long and their events are few), placements and rejections from shortly before the oldest
  reservation still held (the scores of what holds devices now, and recent reasons).

A change marks the map dirty; it is built again at most every `REDRAW_INTERVAL_SECONDS`, the
costly part in a thread, and each browser gets the rows that changed since what it was last sent.
A browser is sent only the newest map, never a queue of them, so a slow one costs no memory;
one that does not take a write within `WRITE_TIMEOUT_SECONDS` is dropped (EventSource
reconnects by itself). NATS and its streams are retried with backoff (1 s doubling to 30 s).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import importlib.resources
import logging
import time

import msgspec
import nats
import nats.errors
import nats.js.errors
from aiohttp import web
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from draplane.device_view import DeviceView, follow_cluster
from draplane.dashboard.device_map import DeviceMap, DeviceMapBuilder, RuleTaints
from draplane.dashboard.scheduling_facts import SchedulingFacts, shard_of_subject
from draplane.messages.audit import AuditEvent, AuditNames, MessageError as AuditMessageError, decode_event
from draplane.scheduling.messages import MessageError, Subjects, decode_message
from draplane.tasks import guarded_task

log = logging.getLogger(__name__)

REDRAW_INTERVAL_SECONDS = 0.2
# Quiet pods turn quiet and are forgotten with time alone, so the map is redrawn this often anyway.
TICK_SECONDS = 5.0
KEEPALIVE_SECONDS = 15.0
WRITE_TIMEOUT_SECONDS = 30.0
MAX_BROWSERS = 64
# Reservations and rejections are read back from this long before the oldest reservation held
# (the publishers' clocks and the stream's may differ a little).
HISTORY_MARGIN_SECONDS = 60.0
AUDIT_BATCH = 256
# Plain subscriptions: what may wait in memory for the callback before NATS drops (and counts) it.
PENDING_MESSAGES_LIMIT = 20_000
INITIAL_BACKOFF_SECONDS = 1.0
MAX_BACKOFF_SECONDS = 30.0


def backoff(failures: int) -> float:
    return min(MAX_BACKOFF_SECONDS, INITIAL_BACKOFF_SECONDS * 2 ** max(0, failures - 1))


@dataclasses.dataclass(slots=True)
class Snapshot:
    """The latest map as browsers are sent it: each row encoded once, for every browser."""

    version: int = 0
    order: list[str] = dataclasses.field(default_factory=list)
    rows: dict[str, bytes] = dataclasses.field(default_factory=dict)
    rest: bytes = b"{}"  # pending pods, totals, status: always sent whole
    full: bytes = b"{}"  # the whole map, for /api/map


@dataclasses.dataclass(slots=True)
class Counters:
    redraws: int = 0
    unreadable: int = 0  # messages that were not ours, or of another version
    audit_events: int = 0


class Dashboard:
    def __init__(self, nats_options: dict, prefix: str):
        self.nats_options = nats_options
        self.prefix = prefix
        self.subjects = Subjects(prefix=prefix)
        self.audit_names = AuditNames(prefix=prefix)
        self.view = DeviceView()
        self.facts = SchedulingFacts()
        self.rules = RuleTaints()
        self.builder = DeviceMapBuilder()
        self.counters = Counters()
        self.snapshot = Snapshot()
        self.latest: DeviceMap | None = None
        self.nc = None
        self.nats_state = "connecting"
        self.synced = asyncio.Event()  # both buckets read once
        self.closing = False
        self._dirty = asyncio.Event()
        self._published = asyncio.Event()  # replaced by a fresh one at every new snapshot
        self._tasks: list[asyncio.Task] = []

    # --- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._run(), name="dashboard nats"),
                       asyncio.create_task(self._redraw_loop(), name="dashboard redraw")]
        self._dirty.set()

    async def stop(self) -> None:
        self.closing = True
        self._wake_browsers()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.nc is not None and not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.close(), 5.0)
            except (Exception, asyncio.CancelledError):  # noqa: BLE001 - shutting down anyway
                pass

    def changed(self) -> None:
        self._dirty.set()

    def stopped(self) -> list[str]:
        """Names of the dashboard's tasks that ended (they never should)."""
        return [t.get_name() for t in self._tasks if t.done()]

    async def _connect(self):
        failures = 0
        while True:
            try:
                return await nats.connect(
                    **self.nats_options,
                    disconnected_cb=self._on_disconnected, reconnected_cb=self._on_reconnected,
                    error_cb=self._on_error, allow_reconnect=True, connect_timeout=5,
                )
            except (OSError, asyncio.TimeoutError, nats.errors.Error) as exc:
                failures += 1
                delay = backoff(failures)
                self.nats_state = "connecting"
                log.warning("dashboard: NATS at %s not reached (%r); again in %.0f s",
                            ", ".join(self.nats_options.get("servers", [])), exc, delay)
                await asyncio.sleep(delay)

    async def _on_disconnected(self) -> None:
        self.nats_state = "reconnecting"
        self.changed()

    async def _on_reconnected(self) -> None:
        self.nats_state = "connected"
        self.changed()

    async def _on_error(self, exc: Exception) -> None:
        log.warning("dashboard: NATS: %r", exc)

    async def _run(self) -> None:
        self.nc = await self._connect()
        self.nats_state = "connected"
        self.changed()
        js = self.nc.jetstream()
        await self.nc.subscribe(self.subjects.pending_all, cb=self._on_scheduling_message,
                                pending_msgs_limit=PENDING_MESSAGES_LIMIT)
        await self.nc.subscribe(self.subjects.results, cb=self._on_scheduling_message,
                                pending_msgs_limit=PENDING_MESSAGES_LIMIT)
        names = self.audit_names
        loops = [
            _guarded(lambda: follow_cluster(js, self.prefix, self.view, self.changed, self.synced), "cluster follower"),
            _guarded(lambda: self._read_audit(js, [names.subject("tainted"), names.subject("untainted")],
                                              lambda: None), "audit taint reader"),
            _guarded(lambda: self._read_audit(js, [names.subject("placed"), names.subject("rejected")],
                                              self._history_start), "audit placement reader"),
            _guarded(self._tick, "dashboard tick"),
        ]
        try:
            await asyncio.gather(*loops)
        finally:
            for task in loops:
                task.cancel()

    # --- NATS in -----------------------------------------------------------------------------------

    async def _on_scheduling_message(self, msg) -> None:
        try:
            message = decode_message(msg.data)
        except MessageError as exc:
            self.counters.unreadable += 1
            log.debug("dashboard: not a scheduling message on %s: %s", msg.subject, exc)
            return
        self.facts.apply_message(message, now=time.time(), shard=shard_of_subject(msg.subject, self.prefix))
        self.changed()

    def _history_start(self) -> float:
        """Unix seconds to read placements and rejections from: the scores of what is held now,
        and the reasons of pods rejected within the time a pending pod is remembered."""
        now = time.time()
        oldest = min((r.reserved_at for entry in self.view.reservations.values() for r in entry.claims.values()),
                     default=now)
        return min(oldest, now - self.facts.forget_after) - HISTORY_MARGIN_SECONDS

    async def _read_audit(self, js: JetStreamContext, subjects: list[str], start) -> None:
        """Apply the audit events of `subjects` from `start()` (unix seconds; None: the stream's
        start) on, forever, without acknowledging. Resumes after the last sequence read."""
        await self.synced.wait()  # the history start depends on the reservations
        stream = self.audit_names.stream
        last_sequence = 0
        failures = 0
        while True:
            sub = None
            try:
                info = await js.stream_info(stream)
                if info.state.last_seq < last_sequence:
                    last_sequence = 0  # a new stream under the old name (a new NATS server)
                # Ephemeral, in memory, never acknowledged: removed by the server a minute after
                # this process stops pulling.
                config = ConsumerConfig(ack_policy=AckPolicy.NONE, filter_subjects=subjects, mem_storage=True,
                                        num_replicas=1, inactive_threshold=60.0)
                if last_sequence:
                    config.deliver_policy, config.opt_start_seq = DeliverPolicy.BY_START_SEQUENCE, last_sequence + 1
                elif (since := start()) is not None:
                    config.deliver_policy = DeliverPolicy.BY_START_TIME
                    config.opt_start_time = datetime.datetime.fromtimestamp(since, tz=datetime.timezone.utc)
                else:
                    config.deliver_policy = DeliverPolicy.ALL
                sub = await js.pull_subscribe(subjects[0], stream=stream, config=config)
                idle = 0
                while True:
                    try:
                        messages = await sub.fetch(AUDIT_BATCH, timeout=5.0)
                    except (nats.errors.TimeoutError, asyncio.TimeoutError):
                        idle += 1
                        if idle % 6 == 0:
                            await sub.consumer_info()  # gone with a restarted server: NotFoundError
                        continue
                    idle, failures = 0, 0
                    for msg in messages:
                        last_sequence = msg.metadata.sequence.stream
                        self._apply_audit(msg.data)
                    self.changed()
            except nats.js.errors.NotFoundError:
                failures += 1
                # The binder makes the stream: until it runs, the map has no scores from history.
                (log.info if failures == 1 else log.debug)(
                    "dashboard: audit stream %s or its consumer not there; looking again in %.0f s",
                    stream, backoff(failures))
                await asyncio.sleep(backoff(failures))
            except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError, OSError) as exc:
                failures += 1
                log.warning("dashboard: reading the audit stream failed (%r); again in %.0f s", exc, backoff(failures))
                await asyncio.sleep(backoff(failures))
            finally:
                if sub is not None:
                    try:
                        await asyncio.wait_for(sub.unsubscribe(), 2.0)
                    except (Exception, asyncio.CancelledError):  # noqa: BLE001 - the connection may be gone
                        pass

    def _apply_audit(self, data: bytes) -> None:
        try:
            event: AuditEvent = decode_event(data)
        except AuditMessageError as exc:
            self.counters.unreadable += 1
            log.debug("dashboard: %s", exc)
            return
        self.counters.audit_events += 1
        self.facts.apply_audit(event)
        self.rules.apply_audit(event)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_SECONDS)
            self.facts.forget_old(time.time())
            self.changed()

    # --- the map out -------------------------------------------------------------------------------

    async def _redraw_loop(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            started = time.monotonic()
            try:
                await self._redraw()
            except Exception:  # noqa: BLE001 - the next change draws again; never a dead page
                log.exception("dashboard: drawing the map failed")
            await asyncio.sleep(max(REDRAW_INTERVAL_SECONDS - (time.monotonic() - started), REDRAW_INTERVAL_SECONDS / 4))

    async def _redraw(self) -> None:
        # Copies taken on the loop: the thread must not see the buckets change under it.
        feed, reservations = dict(self.view.feed), dict(self.view.reservations)
        await asyncio.to_thread(self.builder.refresh, feed, reservations)
        device_map = self.builder.build(feed, reservations, self.facts, time.time(), self.rules)
        self.latest = device_map
        status = {"nats": self.nats_state, "synced": self.synced.is_set(), "audit_events": self.counters.audit_events,
                  "unreadable": self.counters.unreadable}
        rows = {row.name: _encoder.encode(row) for row in device_map.rows}
        rest = _encoder.encode({"pending": device_map.pending, "totals": device_map.totals,
                                "at": device_map.at, "status": status})
        full = _encoder.encode({"rows": device_map.rows, "pending": device_map.pending,
                                "totals": device_map.totals, "at": device_map.at, "status": status})
        self.snapshot = Snapshot(version=self.snapshot.version + 1, order=list(rows), rows=rows, rest=rest, full=full)
        self.counters.redraws += 1
        self._wake_browsers()

    def _wake_browsers(self) -> None:
        published, self._published = self._published, asyncio.Event()
        published.set()

    def next_snapshot(self) -> asyncio.Event:
        """Set when a newer snapshot than the current one is there (or the dashboard closes)."""
        return self._published


_encoder = msgspec.json.Encoder()


def message_for(snapshot: Snapshot, sent: dict[str, bytes]) -> bytes:
    """The `map` event's data: the rows that differ from `sent`, the order of all, the rest whole."""
    changed = [row for name, row in snapshot.rows.items() if sent.get(name) != row]
    removed = [name for name in sent if name not in snapshot.rows]
    return (b'{"version":' + str(snapshot.version).encode() + b',"order":' + _encoder.encode(snapshot.order)
            + b',"removed":' + _encoder.encode(removed) + b',"rows":[' + b",".join(changed) + b'],"rest":'
            + snapshot.rest + b"}")


def _guarded(loop, name: str) -> asyncio.Task:
    return guarded_task(loop, name, log, owner="dashboard")


# --- HTTP ------------------------------------------------------------------------------------------

DASHBOARD = web.AppKey("dashboard", Dashboard)
STATIC = importlib.resources.files("draplane.dashboard") / "static"
STATIC_FILES = {"/": ("index.html", "text/html"), "/map.js": ("map.js", "text/javascript"),
                "/map.css": ("map.css", "text/css")}


async def static_file(request: web.Request) -> web.Response:
    name, content_type = STATIC_FILES[request.path]
    # read in a worker thread, not on the loop that streams the map to every browser; read on each
    # request, not once, so that an edited page shows on reload (no-cache)
    body = await asyncio.to_thread((STATIC / name).read_bytes)
    return web.Response(body=body, content_type=content_type, charset="utf-8", headers={"Cache-Control": "no-cache"})


async def events(request: web.Request) -> web.StreamResponse:
    """Server-sent events: a `map` event with every row at first, then with the rows that changed."""
    dashboard = request.app[DASHBOARD]
    browsers = request.app[BROWSERS]
    if len(browsers) >= MAX_BROWSERS:
        raise web.HTTPServiceUnavailable(text=f"at most {MAX_BROWSERS} browsers at once\n")
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    await response.prepare(request)
    browsers.add(response)
    sent: dict[str, bytes] = {}
    sent_version = -1
    try:
        await _write(response, b"retry: 2000\n\n")
        while not dashboard.closing:
            newer = dashboard.next_snapshot()  # taken before reading, so no snapshot slips between
            snapshot = dashboard.snapshot
            if snapshot.version != sent_version and snapshot.version > 0:
                await _write(response, b"event: map\ndata: " + message_for(snapshot, sent) + b"\n\n")
                sent, sent_version = snapshot.rows, snapshot.version
            try:
                await asyncio.wait_for(newer.wait(), KEEPALIVE_SECONDS)
            except asyncio.TimeoutError:
                await _write(response, b": keepalive\n\n")
    except (ConnectionResetError, asyncio.TimeoutError, RuntimeError):
        pass  # the browser went away, or took too long to read: it reconnects by itself
    finally:
        browsers.discard(response)
    return response


async def _write(response: web.StreamResponse, data: bytes) -> None:
    await asyncio.wait_for(response.write(data), WRITE_TIMEOUT_SECONDS)


async def api_map(request: web.Request) -> web.Response:
    return web.Response(body=request.app[DASHBOARD].snapshot.full, content_type="application/json")


async def healthz(request: web.Request) -> web.Response:
    dead = request.app[DASHBOARD].stopped()
    if dead:
        return web.Response(status=500, text=f"stopped: {', '.join(dead)}\n")
    return web.Response(text="ok\n")


async def readyz(request: web.Request) -> web.Response:
    dashboard = request.app[DASHBOARD]
    if not dashboard.synced.is_set():
        return web.Response(status=503, text=f"waiting for the inventory feed and reservations (NATS: "
                                             f"{dashboard.nats_state})\n")
    return web.Response(text="ok\n")


BROWSERS = web.AppKey("browsers", set)


async def _dashboard_ctx(app: web.Application):
    await app[DASHBOARD].start()
    yield
    await app[DASHBOARD].stop()


async def _close_browsers(app: web.Application) -> None:
    # Event streams never end by themselves: tell them to, so shutdown does not wait for them.
    app[DASHBOARD].closing = True
    app[DASHBOARD]._wake_browsers()


def build_app(dashboard: Dashboard) -> web.Application:
    app = web.Application()
    app[DASHBOARD] = dashboard
    app[BROWSERS] = set()
    app.cleanup_ctx.append(_dashboard_ctx)
    app.on_shutdown.append(_close_browsers)
    for path in STATIC_FILES:
        app.router.add_get(path, static_file)
    app.router.add_get("/events", events)
    app.router.add_get("/api/map", api_map)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app
