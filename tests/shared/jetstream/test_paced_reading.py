"""draplane.jetstream.paced_reading: the decision alone, then a paced connection on a real
nats-server (every message in order, the first after a quiet spell at once, the rest read in a few
reads, and the pacing kept across a reconnect)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
from pathlib import Path

import nats
import pytest

from draplane.jetstream.paced_reading import MAX_PACE_SECONDS, PacedReadingClient, connect_paced, wait_before_read


def test_first_read_and_a_read_after_a_quiet_spell_go_at_once():
    assert wait_before_read(None, 100.0, 0.02) == 0.0
    assert wait_before_read(100.0, 100.5, 0.02) == 0.0
    assert wait_before_read(100.0, 100.02, 0.02) == 0.0


def test_a_read_soon_after_the_previous_waits_out_the_pace():
    assert wait_before_read(100.0, 100.005, 0.02) == pytest.approx(0.015)
    assert wait_before_read(100.0, 100.0, 0.02) == pytest.approx(0.02)


def test_no_pace_never_waits():
    assert wait_before_read(100.0, 100.0, 0.0) == 0.0


@pytest.mark.parametrize("pace", [-0.001, MAX_PACE_SECONDS + 0.001])
def test_a_pace_out_of_range_is_refused_with_its_bounds(pace):
    with pytest.raises(ValueError, match=r"pace_seconds: .* is outside 0\.\.0\.5"):
        PacedReadingClient(pace)


def _count_reads(client) -> list[float]:
    """The times of the connection's reads from now on (wrapping the paced read)."""
    transport = client._transport
    paced_read, reads = transport.read, []

    async def counted(size):
        data = await paced_read(size)
        reads.append(time.monotonic())
        return data

    transport.read = counted
    return reads


async def _receive(client, subject: str) -> tuple[list[bytes], list[float]]:
    got, at = [], []

    async def on_message(msg):
        got.append(msg.data)
        at.append(time.monotonic())

    await client.subscribe(subject, cb=on_message)
    await client.flush()
    return got, at


@contextlib.asynccontextmanager
async def _paced_and_publisher(url: str, pace: float, **options):
    """A paced connection and a plain one to publish on, both closed after."""
    paced = await connect_paced(pace, servers=[url], name="paced-test", **options)
    publisher = await nats.connect(url, name="paced-test-publisher", **options)
    try:
        yield paced, publisher
    finally:
        await paced.close()
        await publisher.close()


async def _publish_spread(publisher, subject: str, count: int, gap: float) -> None:
    for i in range(count):
        await publisher.publish(subject, str(i).encode())
        await publisher.flush()
        await asyncio.sleep(gap)


@pytest.mark.integration
async def test_paced_connection_reads_a_stream_of_messages_in_few_reads_and_loses_none(control_plane):
    pace = 0.1
    paced = await connect_paced(pace, servers=[control_plane.nats_url], name="paced-test")
    plain = await nats.connect(control_plane.nats_url, name="paced-test-plain")
    publisher = await nats.connect(control_plane.nats_url, name="paced-test-publisher")
    try:
        subject = f"paced.{time.monotonic_ns()}"
        paced_got, _ = await _receive(paced, subject)
        plain_got, _ = await _receive(plain, subject)
        await asyncio.sleep(2 * pace)
        paced_reads, plain_reads = _count_reads(paced), _count_reads(plain)
        # 100 messages over about a second, each flushed alone
        await _publish_spread(publisher, subject, 100, 0.01)
        deadline = time.monotonic() + 10
        while len(paced_got) < 100 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        expected = [str(i).encode() for i in range(100)]
        assert paced_got == expected and plain_got == expected
        # about one read per pace over the second, where the plain connection reads most messages alone
        assert len(paced_reads) <= 25, f"{len(paced_reads)} reads for 100 messages at a {pace} s pace"
        assert len(plain_reads) >= 2 * len(paced_reads), (len(plain_reads), len(paced_reads))
        gaps = [b - a for a, b in zip(paced_reads, paced_reads[1:])]
        assert min(gaps) >= pace * 0.9, f"two reads {min(gaps):.3f} s apart under a {pace} s pace"
    finally:
        for client in (paced, plain, publisher):
            await client.close()


@pytest.mark.integration
async def test_a_message_after_a_quiet_spell_is_read_at_once(control_plane):
    pace = MAX_PACE_SECONDS
    async with _paced_and_publisher(control_plane.nats_url, pace) as (paced, publisher):
        subject = f"paced.{time.monotonic_ns()}"
        got, at = await _receive(paced, subject)
        for _ in range(3):
            await asyncio.sleep(2 * pace)  # quiet longer than the pace
            sent = time.monotonic()
            await publisher.publish(subject, b"alone")
            await publisher.flush()
            deadline = sent + 5
            count = len(got)
            while len(got) == count and time.monotonic() < deadline:
                await asyncio.sleep(0.002)
            assert at[-1] - sent < pace / 2, f"a lone message took {at[-1] - sent:.3f} s under a {pace} s pace"


@pytest.mark.integration
async def test_pacing_holds_on_the_connection_made_after_a_reconnect():
    from draplane.localenv import binaries
    from draplane.localenv.controlplane import Ports, _start_nats

    workdir = Path(tempfile.mkdtemp(prefix="draplane-paced-"))
    (workdir / "logs").mkdir()
    ports = Ports().resolve()
    binary = binaries.require(binaries.NATS_SERVER)
    server = _start_nats(binary, workdir, ports, 30.0)
    url = f"nats://127.0.0.1:{ports.nats}"
    reconnected = asyncio.Event()

    async def on_reconnect():
        reconnected.set()

    pace = 0.1
    paced = await connect_paced(pace, servers=[url], name="paced-test", reconnected_cb=on_reconnect,
                                max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    try:
        server.stop(timeout=10.0)
        server = _start_nats(binary, workdir, ports, 30.0)
        await asyncio.wait_for(reconnected.wait(), 30)
        # paced once, not once more per connection: nats-py kept the transport, with a new socket
        assert paced._transport.read.__wrapped__.__func__ is type(paced._transport).read
        subject = f"paced.{time.monotonic_ns()}"
        got, _ = await _receive(paced, subject)
        await asyncio.sleep(2 * pace)
        reads = _count_reads(paced)
        publisher = await nats.connect(url, name="paced-test-publisher")
        await _publish_spread(publisher, subject, 50, 0.01)
        await publisher.close()
        deadline = time.monotonic() + 10
        while len(got) < 50 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert got == [str(i).encode() for i in range(50)]
        assert len(reads) <= 15, f"{len(reads)} reads for 50 messages over 0.5 s at a {pace} s pace after a reconnect"
    finally:
        await paced.close()
        server.stop(timeout=10.0)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.integration
async def test_a_reader_waiting_cuts_the_pace_short_and_reads_go_at_once_while_it_waits(control_plane):
    pace = MAX_PACE_SECONDS
    async with _paced_and_publisher(control_plane.nats_url, pace) as (paced, publisher):
        subject = f"paced.{time.monotonic_ns()}"
        got, at = await _receive(paced, subject)
        await asyncio.sleep(2 * pace)

        async def publish(data: bytes) -> float:
            await publisher.publish(subject, data)
            await publisher.flush()
            return time.monotonic()

        async def until(count: int) -> None:
            deadline = time.monotonic() + 5
            while len(got) < count and time.monotonic() < deadline:
                await asyncio.sleep(0.002)

        await publish(b"first")  # after a quiet spell: read at once, and the pace starts
        await until(1)
        await asyncio.sleep(0.05)
        await publish(b"second")  # waits out the pace...
        await asyncio.sleep(0.05)
        assert got == [b"first"]
        with paced.unpaced():  # ...until a reader waits for it
            entered = time.monotonic()
            await until(2)
            assert at[1] - entered < pace / 4, f"the wait went on {at[1] - entered:.3f} s after a reader came"
            sent = await publish(b"third")  # and while it waits, nothing is paced
            await until(3)
            assert at[2] - sent < pace / 4, f"a read {at[2] - sent:.3f} s late while a reader waited"
        assert got == [b"first", b"second", b"third"]


@pytest.fixture
def tls_nats_url(tmp_path: Path):
    """nats-server over TLS from a CA of its own (as draplane up and deploy/ run it), and the CA."""
    import json
    import urllib.request

    from draplane.localenv import binaries, pki
    from draplane.localenv.processes import ServerProcess, free_port

    port, monitor = free_port(), free_port()
    tls = pki.create_nats_tls(tmp_path / "tls")
    config = tmp_path / "nats.conf"
    config.write_text(f"listen: 127.0.0.1:{port}\nhttp: 127.0.0.1:{monitor}\n"
                      f"tls {json.dumps({'cert_file': str(tls.server_cert), 'key_file': str(tls.server_key)})}\n")
    server = ServerProcess("nats-server (tls)", [str(binaries.require(binaries.NATS_SERVER)), "-c", str(config)],
                           tmp_path / "nats.log")
    server.start()
    try:
        server.wait_ready(lambda: urllib.request.urlopen(f"http://127.0.0.1:{monitor}/healthz", timeout=2).status == 200,
                          30)
        yield f"tls://127.0.0.1:{port}", tls.ca_cert
    finally:
        server.stop()


@pytest.mark.integration
@pytest.mark.parametrize("over", ["tcp", "tls"])
async def test_a_backlog_is_read_at_once_not_one_buffer_per_pace(request, over):
    """5 MB published at once (a bucket's replay): at one 32 KB read per 0.5 s pace it would take
    80 s; the pace only gathers what trickles in. Over TLS, what waits sits in the SSL protocol's
    buffers, where no socket query sees it."""
    from draplane.entrypoints import nats_tls_context

    if over == "tls":
        url, ca = request.getfixturevalue("tls_nats_url")
        options = {"tls": nats_tls_context(str(ca))}
    else:
        url, options = request.getfixturevalue("control_plane").nats_url, {}
    pace = MAX_PACE_SECONDS
    async with _paced_and_publisher(url, pace, pending_size=64 * 1024 * 1024, **options) as (paced, publisher):
        subject = f"paced.{time.monotonic_ns()}"
        got, _ = await _receive(paced, subject)
        await publisher.publish(subject, b"first")  # the pace starts
        await publisher.flush()
        value = b"v" * 10_000
        started = time.monotonic()
        for _ in range(500):
            await publisher.publish(subject, value)
        await publisher.flush()
        while len(got) < 501 and time.monotonic() < started + 30:
            await asyncio.sleep(0.01)
        took = time.monotonic() - started
        assert len(got) == 501
        assert took < 8 * pace, f"5 MB took {took:.2f} s to read under a {pace} s pace over {over}"
