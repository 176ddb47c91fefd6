"""The `nvml` discovery backend: the node's real NVIDIA GPUs, through nvidia-ml-py.

NVML gives identity, memory, versions and MIG; the PCIe root and the NUMA node come from sysfs
(``/sys/bus/pci/devices/<bus id>``), as the NVIDIA DRA driver reads them. MIG-enabled GPUs get
their possible GPU-instance placements, which become partitionable devices (see hardware.py).
The NVML module and the sysfs root are parameters so that unit tests can run on a fake of each.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from types import ModuleType

from draplane_node_agent.hardware import GpuInfo, MigCapability, MigProfile, NodeHardware

_ARCHITECTURES = {
    # nvmlDeviceGetArchitecture values (nvml.h NVML_DEVICE_ARCH_*)
    2: "Kepler",
    3: "Maxwell",
    4: "Pascal",
    5: "Volta",
    6: "Turing",
    7: "Ampere",
    8: "Ada Lovelace",
    9: "Hopper",
    10: "Blackwell",
}

_BRANDS = {
    # nvmlDeviceGetBrand values (NVML_BRAND_*), named as the NVIDIA driver publishes them
    0: "Unknown",
    1: "Quadro",
    2: "Tesla",
    3: "NVS",
    4: "Grid",
    5: "GeForce",
    6: "Titan",
    7: "NvidiaVApps",
    8: "NvidiaVPC",
    9: "NvidiaVCS",
    10: "NvidiaVWS",
    11: "NvidiaCloudGaming",
    12: "Quadro_RTX",
    13: "Nvidia_RTX",
    14: "Nvidia",
    15: "GeForce_RTX",
    16: "Titan_RTX",
}


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def normalize_bus_id(nvml_bus_id: str) -> str:
    """NVML's "00000000:18:00.0" as sysfs names it: "0000:18:00.0"."""
    domain, _, rest = nvml_bus_id.strip().lower().partition(":")
    return f"{int(domain, 16):04x}:{rest}"


def pci_topology(bus_id: str, sysfs: Path = Path("/sys")) -> tuple[str | None, int | None]:
    """(PCIe root, NUMA node) of a PCI device, or None for what sysfs does not say."""
    device = sysfs / "bus" / "pci" / "devices" / bus_id
    root = None
    try:
        # The real path runs from the root complex down: /sys/devices/pci0000:15/0000:15:01.0/...
        for part in Path(os.path.realpath(device)).parts:
            if part.startswith("pci"):
                root = part
                break
    except OSError:
        pass
    numa = None
    try:
        value = int((device / "numa_node").read_text().strip())
        numa = value if value >= 0 else None  # -1: the platform has no NUMA information
    except (OSError, ValueError):
        pass
    return root, numa


def _mig_profile_name(slices: int, memory_mib: int, suffix: str = "") -> str:
    # nvidia-smi rounds the instance memory up to whole GB: 4864 MiB is 1g.5gb, 40192 MiB 7g.40gb.
    return f"{slices}g.{math.ceil(memory_mib / 1024)}gb{suffix}"


def _mig_capability(nvml: ModuleType, handle, memory_slices_hint: int = 8) -> MigCapability | None:
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(handle)
    except nvml.NVMLError:
        return None  # not MIG-capable
    if current != getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1):
        return None
    profiles: list[MigProfile] = []
    memory_slices = 0
    totals = None
    for profile_id in range(getattr(nvml, "NVML_GPU_INSTANCE_PROFILE_COUNT", 16)):
        try:
            info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, profile_id)
        except nvml.NVMLError:
            continue  # this profile does not exist on this GPU
        try:
            placements = nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, info.id)
        except nvml.NVMLError:
            continue
        if not placements:
            continue
        memory_slices = max(memory_slices, max(p.start + p.size for p in placements))
        profile = MigProfile(
            name=_mig_profile_name(info.sliceCount, info.memorySizeMB),
            memory=info.memorySizeMB * 1024 * 1024,
            multiprocessors=info.multiprocessorCount,
            copy_engines=info.copyEngineCount,
            decoders=info.decoderCount,
            encoders=info.encoderCount,
            jpeg_engines=info.jpegCount,
            ofa_engines=info.ofaCount,
            placements=tuple((p.start, p.size) for p in placements),
        )
        if any(p.name == profile.name for p in profiles):
            continue  # the +me / +gfx variants share the name and the placements
        profiles.append(profile)
        if totals is None or profile.multiprocessors > totals.multiprocessors:
            totals = profile
    if not profiles or totals is None:
        return None
    # The largest profile spans the whole GPU: its engines are the GPU's.
    return MigCapability(
        memory_slices=memory_slices or memory_slices_hint,
        multiprocessors=totals.multiprocessors,
        copy_engines=totals.copy_engines,
        decoders=totals.decoders,
        encoders=totals.encoders,
        jpeg_engines=totals.jpeg_engines,
        ofa_engines=totals.ofa_engines,
        profiles=tuple(profiles),
    )


def discover(nvml: ModuleType | None = None, sysfs: Path = Path("/sys")) -> NodeHardware:
    """Every GPU NVML sees. Raises nvml.NVMLError when there is no driver or no GPU library."""
    if nvml is None:
        import pynvml as nvml  # nvidia-ml-py
    nvml.nvmlInit()
    try:
        driver_version = _text(nvml.nvmlSystemGetDriverVersion())
        try:
            cuda = nvml.nvmlSystemGetCudaDriverVersion_v2()
            cuda_version = f"{cuda // 1000}.{(cuda % 1000) // 10}"
        except nvml.NVMLError:
            cuda_version = None
        gpus = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
            bus_id = normalize_bus_id(_text(nvml.nvmlDeviceGetPciInfo(handle).busId))
            pcie_root, numa = pci_topology(bus_id, sysfs)
            gpus.append(
                GpuInfo(
                    index=index,
                    uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                    product_name=_text(nvml.nvmlDeviceGetName(handle)),
                    brand=_BRANDS.get(nvml.nvmlDeviceGetBrand(handle), "Unknown"),
                    architecture=_ARCHITECTURES.get(nvml.nvmlDeviceGetArchitecture(handle), "Unknown"),
                    cuda_compute_capability=f"{major}.{minor}",
                    driver_version=driver_version,
                    cuda_driver_version=cuda_version,
                    memory=int(nvml.nvmlDeviceGetMemoryInfo(handle).total),
                    pci_bus_id=bus_id,
                    pcie_root=pcie_root,
                    numa_node=numa,
                    mig=_mig_capability(nvml, handle),
                )
            )
        return NodeHardware(gpus=tuple(gpus))
    finally:
        nvml.nvmlShutdown()
