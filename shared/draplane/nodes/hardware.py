"""What a node has, in hardware terms, and how the real drivers publish it as DRA devices.

Both discovery backends (NVML on a real node, a YAML profile for simulated ones) produce a
`NodeHardware`; `driver_devices()` turns it into the devices and counter sets that go into the
node's ResourceSlices. Pure: no I/O.

Names follow the NVIDIA DRA driver so existing DeviceClasses and selectors work unchanged: driver
``gpu.nvidia.com``; attributes ``type`` (gpu|mig), ``uuid``, ``productName``, ``brand``,
``architecture``, ``cudaComputeCapability`` and ``driverVersion`` (versions), capacity ``memory``;
and the standard ``resource.kubernetes.io/pcieRoot``, ``pciBusID`` and ``numaNode``. MIG is modelled
as partitionable devices: one counter set per GPU, the whole GPU and each possible MIG placement a
device that consumes from it, so the allocator never hands out overlapping slices.
"""

from __future__ import annotations

import dataclasses
import re

from draplane.api.quantity import Quantity, QuantityFormat
from draplane.api.resource import (
    CapacityRequestPolicy,
    CapacityRequestPolicyRange,
    Counter,
    CounterSet,
    Device,
    DeviceAttribute,
    DeviceCapacity,
    DeviceCounterConsumption,
)
from draplane.messages.inventory import DriverDevices

GPU_DRIVER = "gpu.nvidia.com"
STANDARD_DOMAIN = "resource.kubernetes.io"

_SEMVER_PART = re.compile(r"^(0|[1-9][0-9]*)$")


class HardwareError(ValueError):
    """A hardware description that cannot be published. The message names the device and field."""


@dataclasses.dataclass(frozen=True, slots=True)
class MigProfile:
    """One MIG GPU-instance profile and where it may be placed (in memory-slice units)."""

    name: str  # as nvidia-smi prints it: 1g.5gb
    memory: int  # bytes
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg_engines: int
    ofa_engines: int
    placements: tuple[tuple[int, int], ...]  # (start, size) in memory slices


@dataclasses.dataclass(frozen=True, slots=True)
class MigCapability:
    """The GPU's total engines, the pool MIG placements draw from."""

    memory_slices: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg_engines: int
    ofa_engines: int
    profiles: tuple[MigProfile, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class GpuInfo:
    index: int
    uuid: str
    product_name: str
    brand: str
    architecture: str
    cuda_compute_capability: str  # "9.0"
    driver_version: str  # "550.54.15"
    cuda_driver_version: str | None
    memory: int  # bytes
    pci_bus_id: str  # 0000:18:00.0
    pcie_root: str | None  # pci0000:15
    numa_node: int | None
    mig: MigCapability | None = None  # set when MIG mode is enabled
    # Shared by several claims, each taking memory in multiples of this many bytes (None: whole only)
    share_memory_step: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class NicInfo:
    driver: str
    index: int
    product_name: str
    link_speed_gbps: int
    pci_bus_id: str
    pcie_root: str | None
    numa_node: int | None
    rdma: bool = True


@dataclasses.dataclass(frozen=True, slots=True)
class NodeHardware:
    gpus: tuple[GpuInfo, ...] = ()
    nics: tuple[NicInfo, ...] = ()


# --- attribute values --------------------------------------------------------------------------


def as_semver(text: str, *, what: str) -> str:
    """NVIDIA versions as semver: "550.54.15" stays, "9.0" -> "9.0.0", "550.90.07" -> "550.90.7"."""
    parts = text.strip().split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        raise HardwareError(f"{what}: {text!r} is not a dotted version of up to three numbers")
    parts = [str(int(p)) for p in parts] + ["0"] * (3 - len(parts))
    return ".".join(parts)


def _string(value: str, *, what: str) -> DeviceAttribute:
    if len(value) > 64:
        raise HardwareError(f"{what}: {value!r} is longer than the 64 characters an attribute may hold")
    return DeviceAttribute(string_value=value)


def _bytes(value: int) -> DeviceCapacity:
    return DeviceCapacity(value=str(Quantity(value, QuantityFormat.BINARY_SI)))


def _count(value: int) -> str:
    return str(Quantity(value))


def _topology(attrs: dict[str, DeviceAttribute], bus_id: str, pcie_root: str | None, numa: int | None) -> None:
    attrs[f"{STANDARD_DOMAIN}/pciBusID"] = DeviceAttribute(string_value=bus_id)
    if pcie_root:
        attrs[f"{STANDARD_DOMAIN}/pcieRoot"] = DeviceAttribute(string_value=pcie_root)
    if numa is not None and numa >= 0:
        attrs[f"{STANDARD_DOMAIN}/numaNode"] = DeviceAttribute(int_value=numa)


def _gpu_common(gpu: GpuInfo, what: str) -> dict[str, DeviceAttribute]:
    attrs = {
        "productName": _string(gpu.product_name, what=f"{what} productName"),
        "brand": _string(gpu.brand, what=f"{what} brand"),
        "architecture": _string(gpu.architecture, what=f"{what} architecture"),
        "cudaComputeCapability": DeviceAttribute(
            version_value=as_semver(gpu.cuda_compute_capability, what=f"{what} cudaComputeCapability")
        ),
        "driverVersion": DeviceAttribute(version_value=as_semver(gpu.driver_version, what=f"{what} driverVersion")),
    }
    if gpu.cuda_driver_version:
        attrs["cudaDriverVersion"] = DeviceAttribute(
            version_value=as_semver(gpu.cuda_driver_version, what=f"{what} cudaDriverVersion")
        )
    return attrs


def counter_set_name(gpu: GpuInfo) -> str:
    return f"gpu-{gpu.index}-counter-set"


def mig_device_name(gpu: GpuInfo, profile: MigProfile, start: int) -> str:
    return f"gpu-{gpu.index}-mig-{profile.name.replace('.', '-').replace('+', '-').lower()}-{start}"


def _gpu_counters(gpu: GpuInfo, mig: MigCapability) -> dict[str, Counter]:
    counters = {
        "memory": Counter(value=str(Quantity(gpu.memory, QuantityFormat.BINARY_SI))),
        "multiprocessors": Counter(value=_count(mig.multiprocessors)),
        "copy-engines": Counter(value=_count(mig.copy_engines)),
        "decoders": Counter(value=_count(mig.decoders)),
        "encoders": Counter(value=_count(mig.encoders)),
        "jpeg-engines": Counter(value=_count(mig.jpeg_engines)),
        "ofa-engines": Counter(value=_count(mig.ofa_engines)),
    }
    # One counter per memory slice: two placements overlap exactly when they share a slice.
    for i in range(mig.memory_slices):
        counters[f"memory-slice-{i}"] = Counter(value="1")
    counters = {k: v for k, v in counters.items() if v.value != "0"}
    if len(counters) > 32:
        raise HardwareError(f"GPU {gpu.index}: {mig.memory_slices} memory slices need {len(counters)} counters; a counter set holds at most 32")
    return counters


def _placement_counters(profile: MigProfile, start: int, size: int) -> dict[str, Counter]:
    counters = {
        "memory": Counter(value=str(Quantity(profile.memory, QuantityFormat.BINARY_SI))),
        "multiprocessors": Counter(value=_count(profile.multiprocessors)),
        "copy-engines": Counter(value=_count(profile.copy_engines)),
        "decoders": Counter(value=_count(profile.decoders)),
        "encoders": Counter(value=_count(profile.encoders)),
        "jpeg-engines": Counter(value=_count(profile.jpeg_engines)),
        "ofa-engines": Counter(value=_count(profile.ofa_engines)),
    }
    for i in range(start, start + size):
        counters[f"memory-slice-{i}"] = Counter(value="1")
    # An engine the placement does not use is simply not consumed.
    return {k: v for k, v in counters.items() if v.value != "0"}


def _share(whole: Device, gpu: GpuInfo, what: str) -> None:
    """Claims share the GPU: each consumes memory in steps, the default one step, as the
    allocator's consumable capacity (allowMultipleAllocations and a request policy) counts it."""
    step = gpu.share_memory_step
    if gpu.mig is not None:
        raise HardwareError(f"{what}: a GPU is either partitioned (MIG) or shared, not both")
    if step is None or step <= 0 or step > gpu.memory:
        raise HardwareError(f"{what}: share memory step must be between 1 byte and the GPU's memory, got {step}")
    quantity = _bytes(step).value
    whole.allow_multiple_allocations = True
    whole.capacity["memory"].request_policy = CapacityRequestPolicy(
        default=quantity, valid_range=CapacityRequestPolicyRange(min=quantity, step=quantity))


def gpu_devices(gpus: tuple[GpuInfo, ...] | list[GpuInfo]) -> DriverDevices:
    devices: list[Device] = []
    counter_sets: list[CounterSet] = []
    seen_index: set[int] = set()
    for gpu in gpus:
        what = f"GPU {gpu.index} ({gpu.uuid})"
        if gpu.index in seen_index:
            raise HardwareError(f"{what}: index {gpu.index} is used twice")
        seen_index.add(gpu.index)
        if gpu.memory <= 0:
            raise HardwareError(f"{what}: memory must be positive, got {gpu.memory}")
        attrs = {"type": DeviceAttribute(string_value="gpu"), "uuid": _string(gpu.uuid, what=f"{what} uuid"), "index": DeviceAttribute(int_value=gpu.index)}
        attrs.update(_gpu_common(gpu, what))
        _topology(attrs, gpu.pci_bus_id, gpu.pcie_root, gpu.numa_node)
        whole = Device(name=f"gpu-{gpu.index}", attributes=attrs, capacity={"memory": _bytes(gpu.memory)})
        devices.append(whole)
        if gpu.share_memory_step is not None:
            _share(whole, gpu, what)
        if gpu.mig is None:
            continue
        mig = gpu.mig
        set_name = counter_set_name(gpu)
        gpu_counters = _gpu_counters(gpu, mig)
        counter_sets.append(CounterSet(name=set_name, counters=gpu_counters))
        # The whole GPU uses everything, so it excludes every MIG placement and vice versa.
        whole.consumes_counters = [DeviceCounterConsumption(counter_set=set_name, counters=dict(gpu_counters))]
        for profile in mig.profiles:
            for start, size in profile.placements:
                if start < 0 or size <= 0 or start + size > mig.memory_slices:
                    raise HardwareError(
                        f"{what} MIG profile {profile.name}: placement start={start} size={size} lies outside "
                        f"the GPU's {mig.memory_slices} memory slices"
                    )
                mig_attrs = {
                    "type": DeviceAttribute(string_value="mig"),
                    "parentUUID": _string(gpu.uuid, what=f"{what} uuid"),
                    "parentIndex": DeviceAttribute(int_value=gpu.index),
                    "profile": _string(profile.name, what=f"{what} MIG profile name"),
                    "placementStart": DeviceAttribute(int_value=start),
                    "placementSize": DeviceAttribute(int_value=size),
                }
                mig_attrs.update(_gpu_common(gpu, what))
                _topology(mig_attrs, gpu.pci_bus_id, gpu.pcie_root, gpu.numa_node)
                devices.append(
                    Device(
                        name=mig_device_name(gpu, profile, start),
                        attributes=mig_attrs,
                        capacity={
                            "memory": _bytes(profile.memory),
                            "multiprocessors": DeviceCapacity(value=_count(profile.multiprocessors)),
                        },
                        consumes_counters=[
                            DeviceCounterConsumption(counter_set=set_name, counters=_placement_counters(profile, start, size))
                        ],
                    )
                )
    return DriverDevices(driver=GPU_DRIVER, devices=devices, counter_sets=counter_sets)


def nic_devices(nics: list[NicInfo]) -> list[DriverDevices]:
    by_driver: dict[str, list[Device]] = {}
    for nic in nics:
        attrs = {
            "type": DeviceAttribute(string_value="nic"),
            "productName": _string(nic.product_name, what=f"NIC {nic.index} productName"),
            "linkSpeedGbps": DeviceAttribute(int_value=nic.link_speed_gbps),
            "rdma": DeviceAttribute(bool_value=nic.rdma),
        }
        _topology(attrs, nic.pci_bus_id, nic.pcie_root, nic.numa_node)
        by_driver.setdefault(nic.driver, []).append(Device(name=f"nic-{nic.index}", attributes=attrs))
    return [DriverDevices(driver=driver, devices=devices) for driver, devices in sorted(by_driver.items())]


def driver_devices(hardware: NodeHardware) -> list[DriverDevices]:
    """One entry per driver, GPUs first; a node without GPUs still reports an empty GPU pool."""
    result = [gpu_devices(hardware.gpus)]
    result.extend(nic_devices(list(hardware.nics)))
    names: dict[str, set[str]] = {}
    for entry in result:
        seen = names.setdefault(entry.driver, set())
        for device in entry.devices:
            if device.name in seen:
                raise HardwareError(f"driver {entry.driver}: device name {device.name!r} is used twice")
            seen.add(device.name)
    return result
