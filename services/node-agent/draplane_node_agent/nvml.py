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

from draplane.nodes.hardware import GpuInfo, MigCapability, MigProfile, NodeHardware

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


# XIDs that an application causes (a bad kernel, a page fault of its own), not the GPU: the NVIDIA
# DRA driver and device plugin leave a GPU healthy on these, and so do we.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})


def watch_xid_events(report, *, stopped, nvml: ModuleType | None = None, wait_ms: int = 1000) -> None:
    """Block, calling `report(gpu_index, message)` for each critical XID on a GPU, until `stopped()`.

    Run in a thread: NVML's event wait blocks. A GPU that cannot register for events (an old
    driver, a vGPU) is left out with its reason reported once as a log line by the caller.
    """
    nvml = nvml or _pynvml()
    nvml.nvmlInit()
    try:
        events = nvml.nvmlEventSetCreate()
        index_of = {}
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            try:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, events)
            except nvml.NVMLError as exc:
                report(None, f"GPU {index}: cannot watch XID events: {exc}")
                continue
            index_of[_handle_key(handle)] = index
        while not stopped():
            try:
                event = nvml.nvmlEventSetWait_v2(events, wait_ms)
            except nvml.NVMLError as exc:
                if "Timeout" in type(exc).__name__ or "imeout" in str(exc):
                    continue
                raise
            xid = int(event.eventData)
            if xid in APPLICATION_XIDS:
                continue
            index = index_of.get(_handle_key(event.device))
            if index is not None:
                report(index, f"XID {xid}")
        nvml.nvmlEventSetFree(events)
    finally:
        nvml.nvmlShutdown()


def _handle_key(handle):
    # pynvml's handles are ctypes pointers: equal devices, distinct objects; compare addresses.
    value = getattr(handle, "value", None)
    if value is None and hasattr(handle, "contents"):
        import ctypes

        value = ctypes.addressof(handle.contents)
    return handle if value is None else value


def _pynvml() -> ModuleType:
    import pynvml

    return pynvml


def start_xid_watch(report, *, stop_flag, nvml: ModuleType | None = None):
    """`watch_xid_events` in a daemon thread; it ends once `stop_flag` (an asyncio.Event) is set."""
    import logging
    import threading

    log = logging.getLogger(__name__)

    def run() -> None:
        def forward(index, message):
            if index is None:
                log.warning("%s", message)
            else:
                report(index, message)

        try:
            watch_xid_events(forward, stopped=stop_flag.is_set, nvml=nvml)
        except Exception:
            log.exception("watching NVML's XID events failed; GPU health is no longer reported")

    thread = threading.Thread(target=run, name="nvml-xid-events", daemon=True)
    thread.start()
    return thread
