"""What receiving one NATS message costs a shard, by arrival rate (issue 26: the F of the model).

Every shard follows every pod through the messages the binder and the other shards publish:
about 3.35 per pod (two claim entries, one pod entry, a third of a reservation entry). This
measures the receiving side alone, in this process, with nothing done with the message:

- `watch`: a key-value watch read as the shards read their buckets (draplane.jetstream.streams.
  bucket_entries over nats-py's ordered consumer);
- `ordered`: nats-py's ordered consumer on the bucket's stream read straight from its queue (no
  key-value layer, no task per message between): what a leaner watch could save;
- `subscription`: a plain core NATS subscription read straight from its queue, nats-py's floor.

A publisher in another process puts `--messages` values of `--sizes` bytes into one bucket at each
of `--rates` messages per second (0: as fast as it can, so that they arrive in bursts), each
publish flushed on its own as a service publishing one change at a time does. The receiver's CPU
(time.process_time: user and system) from the first publish to the last message received, over
the messages received, is `cpu_us_per_message`.

    .venv/bin/python bench/nats_receive.py
    .venv/bin/python bench/nats_receive.py --rates 600 0 --sizes 500 --messages 2000

Prints `BENCH name=nats_receive mode=M size=S rate=R messages=N received=N cpu_us_per_message=...
wall_s=...` per case.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUCKET = "RECEIVE_BENCH"
# The publisher: one connection, values put by publishing on the bucket's subjects (as a KV put
# is), paced to `rate` per second with a flush after each.
PUBLISHER = """
import asyncio, sys, time
import nats

async def main(url, bucket, count, size, rate):
    client = await nats.connect(url)
    value = b"v" * size
    started = time.monotonic()
    for i in range(count):
        await client.publish(f"$KV.{bucket}.key{i % 5000}", value)
        if rate:
            await client.flush()
            delay = started + (i + 1) / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
    await client.flush()
    await client.close()

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])))
"""


async def receive(url: str, mode: str, count: int, size: int, rate: float, timeout: float) -> dict:
    import nats

    from draplane.jetstream import streams

    client = await nats.connect(url)
    js = client.jetstream()
    with contextlib.suppress(Exception):
        await js.delete_key_value(BUCKET)
    kv = await js.create_key_value(bucket=BUCKET, history=1)
    received = 0
    all_in = asyncio.Event()

    async def by_watch() -> None:
        nonlocal received
        async with contextlib.aclosing(streams.bucket_entries(kv)) as entries:
            async for entry in entries:
                if entry is None:
                    continue
                received += 1
                if received >= count:
                    all_in.set()

    async def by_subscription() -> None:
        nonlocal received
        subscription = await client.subscribe(f"$KV.{BUCKET}.>", pending_msgs_limit=count + 1)
        queue = subscription._pending_queue  # nats-py's own queue: no task per message between
        while True:
            await queue.get()
            received += 1
            if received >= count:
                all_in.set()

    async def by_ordered() -> None:
        nonlocal received
        from nats.js.api import DeliverPolicy

        subscription = await js.subscribe(f"$KV.{BUCKET}.>", ordered_consumer=True, pending_msgs_limit=count + 1,
                                          deliver_policy=DeliverPolicy.LAST_PER_SUBJECT)
        queue = subscription._pending_queue
        while True:
            msg = await queue.get()
            subscription._pending_size -= len(msg.data)  # as next_msg keeps it, or nats-py drops messages
            _ = msg.metadata.sequence.stream  # the revision, which a watch needs
            received += 1
            if received >= count:
                all_in.set()

    reader = asyncio.create_task({"watch": by_watch, "subscription": by_subscription, "ordered": by_ordered}[mode]())
    await asyncio.sleep(0.5)  # the watch's consumer or the subscription in place
    publisher = subprocess.Popen([sys.executable, "-c", PUBLISHER, url, BUCKET, str(count), str(size), str(rate)])
    cpu, wall = time.process_time(), time.monotonic()
    try:
        await asyncio.wait_for(all_in.wait(), timeout)
    except asyncio.TimeoutError:
        pass
    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    publisher.wait(timeout=60)
    reader.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await reader
    await client.close()
    return {"received": received, "cpu_us_per_message": 1e6 * cpu / max(received, 1), "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["watch", "ordered", "subscription"],
                        choices=["watch", "ordered", "subscription"])
    parser.add_argument("--rates", type=float, nargs="+", default=[600.0, 3000.0, 0.0],
                        help="messages per second; 0: as fast as the publisher can (default %(default)s)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[500, 7500], help="bytes per value")
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--timeout", type=float, default=60.0, help="per case, after the publisher starts")
    args = parser.parse_args(argv)
    if args.messages < 1 or any(r < 0 for r in args.rates) or any(s < 1 for s in args.sizes):
        parser.error("--messages and --sizes must be positive, --rates not negative")

    import uvloop

    from draplane.localenv import binaries
    from draplane.localenv.controlplane import Ports, _start_nats

    workdir = Path(tempfile.mkdtemp(prefix="draplane-receive-"))
    (workdir / "logs").mkdir()
    ports = Ports().resolve()
    server = _start_nats(binaries.require(binaries.NATS_SERVER), workdir, ports, 30.0)
    url = f"nats://127.0.0.1:{ports.nats}"
    uvloop.install()  # as the services run
    try:
        for size in args.sizes:
            for rate in args.rates:
                for mode in args.modes:
                    result = asyncio.run(receive(url, mode, args.messages, size, rate, args.timeout))
                    print(f"BENCH name=nats_receive mode={mode} size={size} rate={rate:g} messages={args.messages} "
                          f"received={result['received']} cpu_us_per_message={result['cpu_us_per_message']:.1f} "
                          f"wall_s={result['wall_s']:.2f}", flush=True)
    finally:
        server.stop(timeout=10.0)
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "shared"))
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
