"""The Alibaba GPU cluster trace (cluster-trace-gpu-v2023) as DRA objects.

The trace was published with Weng et al., "Beware of Fragmentation: Scheduling GPU-Sharing
Workloads with Fragmentation Gradient Descent", USENIX ATC 2023. Two CSV files describe it:

- nodes: `sn, cpu_milli, memory_mib, gpu, model`;
- pods: `name, cpu_milli, memory_mib, num_gpu, gpu_milli[, gpu_spec, ...]`.

A GPU node becomes a Node (CPU and memory allocatable) and a ResourceSlice of its GPUs. Each GPU has
the attribute `model`, the capacity `memory`, and a sharable `compute` capacity of one GPU
(`allowMultipleAllocations`, request policy in milli-GPU steps), so a sharing pod consumes part of a
GPU through a consumable-capacity request, while a whole-GPU request takes the default: all of it.

A pod becomes a Pod with CPU and memory requests and, when it uses GPUs, a ResourceClaim: either
`num_gpu` whole GPUs or one GPU share of `gpu_milli`, plus a CEL selector on `model` when the pod
names allowed models. Reading the objects back gives the trace rows again (`trace_pod_of`,
`trace_node_of`), which is what the simulator and the round-trip test rely on.

Bad input is reported as `file:line: column 'name': what is wrong`.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from draplane.api.core import Container, Node, NodeSpec, NodeStatus, Pod, PodResourceClaim, PodSpec, ResourceClaimRef, ResourceRequirements
from draplane.api.meta import ObjectMeta
from draplane.api.quantity import parse_quantity
from draplane.api.resource import (
    CapacityRequestPolicy,
    CapacityRequestPolicyRange,
    CapacityRequirements,
    CELDeviceSelector,
    Device,
    DeviceAttribute,
    DeviceCapacity,
    DeviceClaim,
    DeviceClass,
    DeviceClassSpec,
    DeviceRequest,
    DeviceSelector,
    ExactDeviceRequest,
    ResourceClaim,
    ResourceClaimSpec,
    ResourcePool,
    ResourceSlice,
    ResourceSliceSpec,
)

DRIVER = "gpu.nvidia.com"
DEVICE_CLASS = "gpu.nvidia.com"
MODEL_ATTRIBUTE = "model"
COMPUTE = "compute"  # the sharable capacity, in milli-GPU: one GPU is 1000
MILLI_PER_GPU = 1000
CLAIM_NAME = "gpu"  # the pod's claim entry and the claim's request
NAMESPACE = "trace"
# The paper's simulator caps every node at this many pods; we carry it as the `pods` allocatable.
PODS_PER_NODE = 1001
MODEL_LABEL = "gpu.nvidia.com/model"

# GPU memory per model in MiB, as the trace's own simulator records it. G1-G3 are Alibaba's internal
# codes; their sizes are the ones that simulator assumes.
GPU_MEMORY_MIB: dict[str, int] = {
    "G1": 10000,
    "G2": 20000,
    "G3": 30000,
    "T4": 15109,
    "P100": 16280,
    "V100M16": 16160,
    "V100M32": 32510,
    "A10": 22731,
}
KNOWN_MODELS = frozenset(GPU_MEMORY_MIB)

NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
POD_OPTIONAL_COLUMNS = ("gpu_spec",)


class TraceError(ValueError):
    """A trace file that cannot be read; the message names file, line and column."""


@dataclass(frozen=True, slots=True)
class TraceNode:
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str  # empty for CPU-only nodes


@dataclass(frozen=True, slots=True)
class TracePod:
    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int  # per GPU, 0..1000; below 1000 only for one-GPU sharing pods
    gpu_spec: tuple[str, ...] = ()  # allowed models; empty means any

    @property
    def gpu_demand_milli(self) -> int:
        return self.num_gpu * self.gpu_milli

    @property
    def shares_gpu(self) -> bool:
        return self.num_gpu == 1 and 0 < self.gpu_milli < MILLI_PER_GPU


# --- reading CSV ---------------------------------------------------------------------------------


def _rows(path: Path, required: Sequence[str]) -> Iterable[tuple[int, dict[str, str]]]:
    try:
        handle = open(path, newline="")
    except OSError as exc:
        raise TraceError(f"{path}: cannot open: {exc.strerror}") from None
    with handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        if header is None:
            raise TraceError(f"{path}:1: empty file, expected a header with columns {', '.join(required)}")
        header = [h.strip() for h in header]
        missing = [c for c in required if c not in header]
        if missing:
            raise TraceError(
                f"{path}:1: missing column{'s' if len(missing) > 1 else ''} {', '.join(repr(m) for m in missing)}"
                f" (header has {', '.join(header)})"
            )
        for row in reader:
            line = reader.line_num
            if not row or all(not cell.strip() for cell in row):
                continue
            if len(row) != len(header):
                raise TraceError(f"{path}:{line}: {len(row)} fields, the header has {len(header)}")
            yield line, dict(zip(header, (cell.strip() for cell in row)))


def _integer(path: Path, line: int, row: dict[str, str], column: str, *, upper: int | None = None) -> int:
    text = row[column]
    try:
        value = int(text)
    except ValueError:
        raise TraceError(f"{path}:{line}: column {column!r}: {text!r} is not an integer") from None
    if value < 0:
        raise TraceError(f"{path}:{line}: column {column!r}: {value} is negative")
    if upper is not None and value > upper:
        raise TraceError(f"{path}:{line}: column {column!r}: {value} is more than {upper}")
    return value


def _model(path: Path, line: int, column: str, text: str) -> str:
    if text not in KNOWN_MODELS:
        raise TraceError(
            f"{path}:{line}: column {column!r}: unknown GPU model {text!r} (known: {', '.join(sorted(KNOWN_MODELS))})"
        )
    return text


def read_nodes(path: str | Path, *, gpu_only: bool = True) -> list[TraceNode]:
    """The trace's nodes. The paper's cluster is the GPU nodes only, so CPU-only nodes are skipped by default."""
    path = Path(path)
    nodes: list[TraceNode] = []
    seen: dict[str, int] = {}
    for line, row in _rows(path, NODE_COLUMNS):
        name = row["sn"]
        if not name:
            raise TraceError(f"{path}:{line}: column 'sn': empty node name")
        if name in seen:
            raise TraceError(f"{path}:{line}: column 'sn': node {name!r} already on line {seen[name]}")
        seen[name] = line
        gpus = _integer(path, line, row, "gpu")
        model = row["model"]
        if gpus > 0:
            model = _model(path, line, "model", model)
        elif model:
            raise TraceError(f"{path}:{line}: column 'model': {model!r} on a node without GPUs")
        node = TraceNode(
            name=name,
            cpu_milli=_integer(path, line, row, "cpu_milli"),
            memory_mib=_integer(path, line, row, "memory_mib"),
            gpus=gpus,
            model=model,
        )
        if gpus > 0 or not gpu_only:
            nodes.append(node)
    return nodes


def read_pods(path: str | Path) -> list[TracePod]:
    path = Path(path)
    pods: list[TracePod] = []
    seen: dict[str, int] = {}
    for line, row in _rows(path, POD_COLUMNS):
        name = row["name"]
        if not name:
            raise TraceError(f"{path}:{line}: column 'name': empty pod name")
        if name in seen:
            raise TraceError(f"{path}:{line}: column 'name': pod {name!r} already on line {seen[name]}")
        seen[name] = line
        num_gpu = _integer(path, line, row, "num_gpu")
        # The paper's simulator clamps gpu_milli to 0..1000; a value above is a whole GPU, not an error.
        gpu_milli = min(_integer(path, line, row, "gpu_milli"), MILLI_PER_GPU)
        if num_gpu > 1 and gpu_milli != MILLI_PER_GPU:
            raise TraceError(
                f"{path}:{line}: column 'gpu_milli': {gpu_milli} with num_gpu {num_gpu};"
                f" only one-GPU pods may share a GPU"
            )
        if num_gpu > 0 and gpu_milli == 0:
            raise TraceError(f"{path}:{line}: column 'gpu_milli': 0 with num_gpu {num_gpu}")
        spec_text = row.get("gpu_spec", "")
        spec = tuple(_model(path, line, "gpu_spec", m.strip()) for m in spec_text.split("|")) if spec_text else ()
        pods.append(
            TracePod(
                name=name,
                cpu_milli=_integer(path, line, row, "cpu_milli"),
                memory_mib=_integer(path, line, row, "memory_mib"),
                num_gpu=num_gpu,
                gpu_milli=gpu_milli if num_gpu > 0 else 0,
                gpu_spec=spec,
            )
        )
    return pods


# --- trace rows -> DRA objects -------------------------------------------------------------------


def gpu_device_class() -> DeviceClass:
    return DeviceClass(
        metadata=ObjectMeta(name=DEVICE_CLASS),
        spec=DeviceClassSpec(selectors=[DeviceSelector(cel=CELDeviceSelector(expression=f'device.driver == "{DRIVER}"'))]),
    )


def device_name(index: int) -> str:
    return f"gpu-{index}"


def node_objects(node: TraceNode) -> tuple[Node, ResourceSlice | None]:
    """The Node, and the ResourceSlice of its GPUs (None for a CPU-only node)."""
    labels = {"kubernetes.io/hostname": node.name}
    if node.model:
        labels[MODEL_LABEL] = node.model
    k8s_node = Node(
        metadata=ObjectMeta(name=node.name, labels=labels),
        spec=NodeSpec(),
        status=NodeStatus(
            capacity={"cpu": f"{node.cpu_milli}m", "memory": f"{node.memory_mib}Mi", "pods": str(PODS_PER_NODE)},
            allocatable={"cpu": f"{node.cpu_milli}m", "memory": f"{node.memory_mib}Mi", "pods": str(PODS_PER_NODE)},
        ),
    )
    if node.gpus == 0:
        return k8s_node, None
    devices = [
        Device(
            name=device_name(i),
            attributes={MODEL_ATTRIBUTE: DeviceAttribute(string_value=node.model)},
            capacity={
                # Shares are metered in compute only (the trace gives no GPU memory per pod): a
                # claim that names no memory consumes none, instead of all of it, which would make
                # the GPU unsharable.
                "memory": DeviceCapacity(
                    value=f"{GPU_MEMORY_MIB[node.model]}Mi",
                    request_policy=CapacityRequestPolicy(default="0", valid_range=CapacityRequestPolicyRange(min="0")),
                ),
                # Counted in milli-GPU as whole units: request policies round to whole units of
                # the quantity, so a step of "1m" would round every share up to a whole GPU.
                # A request that names no compute takes all 1000 (the default): whole-GPU pods and
                # sharing pods never land on the same device.
                COMPUTE: DeviceCapacity(
                    value=str(MILLI_PER_GPU),
                    request_policy=CapacityRequestPolicy(
                        default=str(MILLI_PER_GPU),
                        valid_range=CapacityRequestPolicyRange(min="1", max=str(MILLI_PER_GPU), step="1"),
                    ),
                ),
            },
            allow_multiple_allocations=True,
        )
        for i in range(node.gpus)
    ]
    slice_ = ResourceSlice(
        metadata=ObjectMeta(name=f"{node.name}-{DRIVER}"),
        spec=ResourceSliceSpec(
            driver=DRIVER,
            pool=ResourcePool(name=node.name, generation=1, resource_slice_count=1),
            node_name=node.name,
            devices=devices,
        ),
    )
    return k8s_node, slice_


def model_selector(models: Sequence[str]) -> str:
    """CEL on the driver's `model` attribute: one of the allowed models."""
    listed = ", ".join(f'"{m}"' for m in models)
    return f'device.attributes["{DRIVER}"].{MODEL_ATTRIBUTE} in [{listed}]'


def claim_name(pod_name: str) -> str:
    return f"{pod_name}-{CLAIM_NAME}"


def pod_objects(pod: TracePod) -> tuple[Pod, ResourceClaim | None]:
    """The Pod, and its ResourceClaim (None for a CPU-only pod)."""
    requests = {"cpu": f"{pod.cpu_milli}m", "memory": f"{pod.memory_mib}Mi"}
    uses_gpu = pod.num_gpu > 0
    container = Container(
        name="main",
        resources=ResourceRequirements(
            requests=requests, claims=[ResourceClaimRef(name=CLAIM_NAME)] if uses_gpu else None
        ),
    )
    k8s_pod = Pod(
        metadata=ObjectMeta(name=pod.name, namespace=NAMESPACE),
        spec=PodSpec(
            containers=[container],
            resource_claims=[PodResourceClaim(name=CLAIM_NAME, resource_claim_name=claim_name(pod.name))] if uses_gpu else None,
        ),
    )
    if not uses_gpu:
        return k8s_pod, None
    selectors = [DeviceSelector(cel=CELDeviceSelector(expression=model_selector(pod.gpu_spec)))] if pod.gpu_spec else None
    if pod.shares_gpu:
        exact = ExactDeviceRequest(
            device_class_name=DEVICE_CLASS,
            selectors=selectors,
            count=1,
            capacity=CapacityRequirements(requests={COMPUTE: str(pod.gpu_milli)}),
        )
    else:
        exact = ExactDeviceRequest(device_class_name=DEVICE_CLASS, selectors=selectors, count=pod.num_gpu)
    claim = ResourceClaim(
        metadata=ObjectMeta(name=claim_name(pod.name), namespace=NAMESPACE),
        spec=ResourceClaimSpec(devices=DeviceClaim(requests=[DeviceRequest(name=CLAIM_NAME, exactly=exact)])),
    )
    return k8s_pod, claim


# --- DRA objects -> trace rows (the inverse, for the simulator and the round trip) ---------------


def _milli(text: str) -> int:
    value = parse_quantity(text).value * 1000
    return -((-value.numerator) // value.denominator)


def _units(text: str) -> int:
    value = parse_quantity(text).value
    return -((-value.numerator) // value.denominator)


def _mib(text: str) -> int:
    value = parse_quantity(text).value / (1 << 20)
    return -((-value.numerator) // value.denominator)


def trace_node_of(node: Node, slice_: ResourceSlice | None) -> TraceNode:
    allocatable = (node.status.allocatable if node.status else None) or {}
    devices = (slice_.spec.devices or []) if slice_ else []
    model = ""
    if devices:
        attr = (devices[0].attributes or {}).get(MODEL_ATTRIBUTE)
        model = str(attr.value()) if attr else ""
    return TraceNode(
        name=node.metadata.name or "",
        cpu_milli=_milli(allocatable.get("cpu", "0")),
        memory_mib=_mib(allocatable.get("memory", "0")),
        gpus=len(devices),
        model=model,
    )


def _models_of_selector(expression: str) -> tuple[str, ...]:
    head = f'device.attributes["{DRIVER}"].{MODEL_ATTRIBUTE} in ['
    if not expression.startswith(head) or not expression.endswith("]"):
        raise TraceError(f"selector {expression!r} is not a model selector written by this loader")
    inner = expression[len(head):-1]
    return tuple(part.strip().strip('"') for part in inner.split(",") if part.strip())


def trace_pod_of(pod: Pod, claim: ResourceClaim | None) -> TracePod:
    requests: dict[str, str] = {}
    for container in pod.spec.containers:
        requests.update((container.resources.requests or {}) if container.resources else {})
    num_gpu = gpu_milli = 0
    spec: tuple[str, ...] = ()
    if claim is not None and claim.spec.devices and claim.spec.devices.requests:
        exact = claim.spec.devices.requests[0].exactly
        if exact is None:
            raise TraceError(f"claim {claim.metadata.name}: spec.devices.requests[0]: not an `exactly` request")
        num_gpu = exact.count or 1
        share = (exact.capacity.requests or {}).get(COMPUTE) if exact.capacity else None
        gpu_milli = _units(share) if share is not None else MILLI_PER_GPU
        for selector in exact.selectors or []:
            if selector.cel is not None:
                spec = _models_of_selector(selector.cel.expression)
    return TracePod(
        name=pod.metadata.name or "",
        cpu_milli=_milli(requests.get("cpu", "0")),
        memory_mib=_mib(requests.get("memory", "0")),
        num_gpu=num_gpu,
        gpu_milli=gpu_milli,
        gpu_spec=spec,
    )
