"""A NATS connection that reads its socket at most once per `pace` under load (issue 26).

A shard follows every change of the cluster: node reservation entries and the binder's change
batches, a few tens of messages a second, most of them arriving alone. A message that arrives
alone costs nats-py and the event loop their whole wakeup (epoll, the socket read, the read
loop's task, the parser, the subscription's queue): bench/nats_receive.py measured 58-72 us of
CPU per message at 600 messages a second, and 4-15 us per message inside a burst. So a following
connection that, after a read, leaves the socket alone for `pace` seconds receives whatever came
meanwhile in one read and one parse. A read after a quiet spell (longer than `pace` since the
previous one) goes at once, so an idle cluster's changes arrive as fast as before; under load a
message waits at most `pace`, and not at all while a reader waits for what the connection brings
(`PacedReadingClient.unpaced`: a shard's pod waiting for the cluster bucket to reach the revision
that holds its claims). Bytes already waiting to be read are read at once: the pace gathers
messages that trickle in and never throttles a backlog (a shard replaying a bucket).

Only following goes through such a connection: a delay on the connection a shard commits or
fetches on would lengthen every round trip. `connect_paced` opens one; `wait_before_read` is the
decision, kept apart from the event loop so that it can be tested alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import sys
import termios
import time
from collections.abc import Iterator
from typing import Any

from nats.aio.client import Client

# The longest pace accepted: it bounds how far behind a shard's view of the others' reservations
# and of the cluster may fall under load (a shard that commits on a node entry it has not yet read
# fails its compare-and-set and reads the entry again).
MAX_PACE_SECONDS = 0.5
UNKNOWN_BYTES_WAITING = 1 << 62


def wait_before_read(previous_read_at: float | None, now: float, pace: float) -> float:
    """Seconds to leave the socket alone before the next read: what remains of `pace` since the
    previous read, nothing after a quiet spell or before the first read."""
    if previous_read_at is None or pace <= 0:
        return 0.0
    return max(0.0, previous_read_at + pace - now)


class PacedReadingClient(Client):
    """nats-py's client, whose reads of the server's socket are at least `pace_seconds` apart,
    except while someone waits for what it brings (`unpaced`).

    nats-py starts its read loop once per connection (again after each reconnect), so the pacing
    is put on the transport as the loop starts, once: nats-py may keep the transport object across
    reconnects and only give it a new socket."""

    def __init__(self, pace_seconds: float) -> None:
        super().__init__()
        if not 0 <= pace_seconds <= MAX_PACE_SECONDS:
            raise ValueError(f"pace_seconds: {pace_seconds} is outside 0..{MAX_PACE_SECONDS}")
        self.pace_seconds = pace_seconds
        self._waiting_readers = 0
        self._pause: asyncio.Future | None = None  # the read loop's wait, while it waits out the pace

    @contextlib.contextmanager
    def unpaced(self) -> Iterator[None]:
        """Read at once while inside: a reader waits for something this connection brings (a
        shard's pod for the cluster bucket's revision holding its claims), so the pace would be
        its latency. Cuts a wait under way short."""
        self._waiting_readers += 1
        if self._pause is not None and not self._pause.done():
            self._pause.set_result(None)
        try:
            yield
        finally:
            self._waiting_readers -= 1

    async def _read_loop(self) -> None:
        transport = self._transport
        if transport is not None and self.pace_seconds > 0 and not getattr(transport, "draplane_paced", False):
            self._pace_reads(transport)
        await super()._read_loop()

    def _pace_reads(self, transport: Any) -> None:
        """Make `transport.read` wait out the pace, with the socket's reading paused meanwhile (the
        kernel holds what arrives, and the read after the pause takes it all in one go)."""
        read = transport.read
        previous_read_at: float | None = None

        async def paced_read(buffer_size: int) -> bytes:
            nonlocal previous_read_at
            wait = 0.0 if self._waiting_readers else wait_before_read(previous_read_at, time.monotonic(),
                                                                      self.pace_seconds)
            if wait > 0:
                # A backlog is read at once: the pace gathers messages that trickle in, it must
                # never throttle a replay of a whole bucket (a read takes at most buffer_size
                # bytes). A message or two that came meanwhile is no backlog: the read after the
                # pace takes it. One turn of the event loop first lets what already came reach the
                # reader, from TLS's buffers too, which FIONREAD does not count.
                await asyncio.sleep(0)
                if _bytes_waiting(transport) < buffer_size:
                    await self._wait_out(transport, wait)
            data = await read(buffer_size)
            previous_read_at = time.monotonic()
            return data

        paced_read.__wrapped__ = read
        transport.read = paced_read
        transport.draplane_paced = True

    async def _wait_out(self, transport: Any, wait: float) -> None:
        # Not paused already: asyncio's StreamReader pauses the socket itself when its buffer is
        # full, and only its own read may resume it then (else the buffer grows unbounded).
        socket_transport = _socket_transport(transport)
        paused_here = socket_transport is not None and socket_transport.is_reading()
        if paused_here:
            socket_transport.pause_reading()
        loop = asyncio.get_running_loop()
        self._pause = loop.create_future()
        timer = loop.call_later(wait, _set_done, self._pause)
        try:
            await self._pause
        finally:
            timer.cancel()
            self._pause = None
            if paused_here and not socket_transport.is_closing():
                socket_transport.resume_reading()


def _bytes_waiting(transport: Any) -> int:
    """How many bytes wait to be read: in asyncio's StreamReader, and in the kernel's socket buffer
    (FIONREAD). A huge number when it cannot tell: then the read goes at once, unpaced."""
    reader = getattr(transport, "_io_reader", None)
    buffered = getattr(reader, "_buffer", None)
    socket_transport = _socket_transport(transport)
    sock = socket_transport.get_extra_info("socket") if socket_transport is not None else None
    if buffered is None or sock is None:
        return UNKNOWN_BYTES_WAITING
    try:
        in_socket = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    except (OSError, ValueError):
        return UNKNOWN_BYTES_WAITING
    return len(buffered) + int.from_bytes(in_socket, sys.byteorder)


def _set_done(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _socket_transport(transport: Any) -> asyncio.Transport | None:
    """The asyncio transport under nats-py's TCP (or TLS) transport, which can pause reading; None
    for one that has none (a websocket), whose reads are not paced (`_bytes_waiting`)."""
    writer = getattr(transport, "_io_writer", None)
    socket_transport = getattr(writer, "transport", None)
    if socket_transport is None or not hasattr(socket_transport, "is_reading"):
        return None
    return socket_transport


async def connect_paced(pace_seconds: float, **options: Any) -> PacedReadingClient:
    """Connect as nats.connect(**options) does, reading at most once per `pace_seconds` under load."""
    client = PacedReadingClient(pace_seconds)
    await client.connect(**options)
    return client
