"""What a node entry's write costs every reader of the reservation bucket: decoding it whole
(`reservations.decode_entry`) beside decoding only the reservations the write changed
(`reservations.EntryDecoder`, what ReservationStore's watch uses), each followed by what a shard
does with it (`SchedulingState.set_reservations`), on the same writes, in one process.

The writes are those of a busy node as bench/e2e.py makes them: a shard reserves one more claim
and its pod under a lease, the binder confirms a burst of them, leases are renewed; the entry
grows to `--claims` confirmed claims and keeps up to `--pods` pod reservations (a pod's stays
for its 30 s lease). Each round runs both ways in turn, their order alternating (the machine is
noisy); the median round is reported.

    .venv/bin/python bench/reservation_entries.py
    .venv/bin/python bench/reservation_entries.py --claims 40 --pods 40 --rounds 7

Prints `BENCH name=reservation_entries way=whole|changed claims=C pods=P writes=W us_per_write=...
decode_us_per_write=...` per way, and `BENCH name=reservation_entries_ratio whole_over_changed=...`.
"""

from __future__ import annotations

import argparse
import statistics
import time

from draplane.api.meta import NodeSelector, NodeSelectorRequirement, NodeSelectorTerm
from draplane.api.resource import AllocationResult, DeviceAllocationResult, DeviceRequestAllocationResult
from draplane.scheduling import reservations as rv
from draplane.scheduling.placing import SchedulingState

NODE = "node-007"
DRIVER = "gpu.nvidia.com"


def allocation(device: str) -> AllocationResult:
    return AllocationResult(
        devices=DeviceAllocationResult(results=[DeviceRequestAllocationResult(
            request="gpu", driver=DRIVER, pool=NODE, device=device)]),
        node_selector=NodeSelector(node_selector_terms=[NodeSelectorTerm(match_fields=[
            NodeSelectorRequirement(key="metadata.name", operator="In", values=[NODE])])]))


def writes(claims: int, pods: int, now: float = 1_000_000.0) -> list[bytes]:
    """The node's entry after each write, encoded as the writer encodes it."""
    entry = rv.NodeReservations(node=NODE)
    out: list[bytes] = []
    for i in range(claims):
        uid, pod_uid = f"claim-{i:04d}-5b9c2e7a-1f0d-4e55-9c33", f"pod-{i:04d}-8a1f6c3d-7e2b-4d90-b1a4"
        alloc = allocation(f"gpu-{i}")
        reservation = rv.Reservation(claim_uid=uid, claim_namespace="bench", claim_name=f"p-{i:05d}-gpu",
                                     pod_uid=pod_uid, devices=rv.devices_of(alloc), allocation=alloc,
                                     reserved_at=now + i, expires_at=now + i + 30, shard=i % 4)
        pod = rv.PodReservation(pod_uid=pod_uid, pod_namespace="bench", pod_name=f"p-{i:05d}",
                                requests={"cpu": 100, "memory": 128 << 20}, reserved_at=now + i,
                                expires_at=now + i + 30, shard=i % 4)
        entry = rv.add(entry, [reservation], pod)
        out.append(rv.encode_entry(entry))  # the shard's reservation
        entry = rv.extend(entry, uid, now + i + 45) or entry
        out.append(rv.encode_entry(entry))  # the binder renews the lease as it writes
        if i % 2:  # the binder confirms a burst of two
            for done in (i - 1, i):
                entry = rv.confirm(entry, f"claim-{done:04d}-5b9c2e7a-1f0d-4e55-9c33") or entry
            out.append(rv.encode_entry(entry))
        if len(entry.pods) > pods:  # the oldest pod reservation lapsed: the next write drops it
            oldest = min(entry.pods.values(), key=lambda p: p.reserved_at)
            entry = rv.NodeReservations(node=NODE, claims=entry.claims,
                                        pods={k: v for k, v in entry.pods.items() if k != oldest.pod_uid})
    return out


def run(way: str, data: list[bytes]) -> tuple[float, float]:
    """(µs per write, µs of it decoding) for one pass over the writes, on a fresh state."""
    state = SchedulingState()
    decoder = rv.EntryDecoder()
    decode = (lambda d: rv.decode_entry(d, NODE)) if way == "whole" else (lambda d: decoder.decode(d, NODE))
    decoding = 0.0
    started = time.perf_counter()
    for value in data:
        t = time.perf_counter()
        entry = decode(value)
        decoding += time.perf_counter() - t
        state.set_reservations(NODE, entry)
    total = time.perf_counter() - started
    return total / len(data) * 1e6, decoding / len(data) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--claims", type=int, default=20, help="claims the node's entry ends with")
    parser.add_argument("--pods", type=int, default=20, help="pod reservations it keeps at most")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=20, help="passes over the writes per round")
    args = parser.parse_args()
    for name in ("claims", "pods", "rounds", "repeat"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    data = writes(args.claims, args.pods)
    results: dict[str, list[tuple[float, float]]] = {"whole": [], "changed": []}
    for r in range(args.rounds):
        for way in (("whole", "changed") if r % 2 == 0 else ("changed", "whole")):
            passes = [run(way, data) for _ in range(args.repeat)]
            results[way].append((statistics.median(p[0] for p in passes), statistics.median(p[1] for p in passes)))
    medians = {}
    for way, rounds in results.items():
        total = statistics.median(t for t, _ in rounds)
        decoding = statistics.median(d for _, d in rounds)
        medians[way] = total
        print(f"BENCH name=reservation_entries way={way} claims={args.claims} pods={args.pods} writes={len(data)} "
              f"bytes_per_write={sum(map(len, data)) // len(data)} us_per_write={total:.1f} "
              f"decode_us_per_write={decoding:.1f}", flush=True)
    print(f"BENCH name=reservation_entries_ratio whole_over_changed={medians['whole'] / medians['changed']:.2f}")


if __name__ == "__main__":
    main()
