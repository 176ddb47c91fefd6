"""How fast draplane.validation checks objects (draplane allocate validates all of its input).

    .venv/bin/python bench/validation.py

Shapes follow bench/allocator.py's case (a): 500 nodes x 10 GPUs in one slice per node, and 5,000
single-device claims with a CEL selector (compiled once, then served from the compile cache).
"""

from __future__ import annotations

import time
import tracemalloc

from draplane.validation import validate_object

NODES, DEVICES_PER_NODE, CLAIMS = 500, 10, 5000


def gpu(index: int) -> dict:
    return {
        "name": f"gpu-{index}",
        "attributes": {
            "productName": {"string": "NVIDIA H100 80GB HBM3"},
            "driverVersion": {"version": "550.54.15"},
            "resource.kubernetes.io/pcieRoot": {"string": f"pci0000:{index // 4:02x}"},
            "resource.kubernetes.io/numaNode": {"int": index // 4},
        },
        "capacity": {"memory": {"value": "80Gi"}},
    }


def node_slice(node: int) -> dict:
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": f"node-{node}-gpu"},
        "spec": {"driver": "gpu.nvidia.com", "nodeName": f"node-{node}",
                 "pool": {"name": f"node-{node}", "generation": 1, "resourceSliceCount": 1},
                 "devices": [gpu(i) for i in range(DEVICES_PER_NODE)]},
    }


def claim(index: int) -> dict:
    selector = 'device.capacity["gpu.nvidia.com"].memory.isGreaterThan(quantity("40Gi"))'
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": f"claim-{index}", "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "gpu.nvidia.com", "selectors": [{"cel": {"expression": selector}}]}}]}},
    }


def measure(objects: list[dict]) -> tuple[float, float]:
    """(seconds, peak MiB): timed without tracemalloc, whose hooks would slow it several-fold."""
    started = time.perf_counter()
    for obj in objects:
        problems = validate_object(obj)
        assert not problems, problems
    seconds = time.perf_counter() - started
    tracemalloc.start()
    for obj in objects[:200]:
        validate_object(obj)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return seconds, peak / 2**20


def main() -> None:
    slices = [node_slice(n) for n in range(NODES)]
    claims = [claim(i) for i in range(CLAIMS)]
    validate_object(claims[0])  # compile the selector once, as a long-running process would have
    slice_seconds, slice_mb = measure(slices)
    claim_seconds, claim_mb = measure(claims)
    print(f"BENCH name=validate_slices_{NODES}x{DEVICES_PER_NODE} seconds={slice_seconds:.3f} "
          f"devices={NODES * DEVICES_PER_NODE} peak_mb={slice_mb:.3f}")
    print(f"BENCH name=validate_claims_{CLAIMS} claims_per_s={CLAIMS / claim_seconds:.1f} "
          f"seconds={claim_seconds:.3f} peak_mb={claim_mb:.3f}")


if __name__ == "__main__":
    main()
