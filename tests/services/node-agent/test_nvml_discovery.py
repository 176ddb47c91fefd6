"""The nvml backend against a fake NVML module and a fake sysfs, and against a real GPU where one exists."""

from __future__ import annotations

import os
import types
from pathlib import Path

import pytest

from draplane.api.quantity import parse_quantity
from draplane_node_agent import nvml as nvml_backend
from draplane.nodes.hardware import driver_devices


class FakeNVMLError(Exception):
    pass


def _fake_nvml(mig: bool) -> types.ModuleType:
    m = types.ModuleType("fake_pynvml")
    m.NVMLError = FakeNVMLError
    m.NVML_DEVICE_MIG_ENABLE = 1
    m.NVML_GPU_INSTANCE_PROFILE_COUNT = 8
    calls = {"init": 0, "shutdown": 0}
    m.calls = calls
    m.nvmlInit = lambda: calls.__setitem__("init", calls["init"] + 1)
    m.nvmlShutdown = lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1)
    m.nvmlSystemGetDriverVersion = lambda: "550.90.07"
    m.nvmlSystemGetCudaDriverVersion_v2 = lambda: 12040
    m.nvmlDeviceGetCount = lambda: 2
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetCudaComputeCapability = lambda h: (8, 0)
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=f"00000000:{0x18 + h:02X}:00.0".encode())
    m.nvmlDeviceGetUUID = lambda h: f"GPU-fake-{h}"
    m.nvmlDeviceGetName = lambda h: b"NVIDIA A100-SXM4-40GB"
    m.nvmlDeviceGetBrand = lambda h: 14
    m.nvmlDeviceGetArchitecture = lambda h: 7
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=40 * 2**30)

    def mig_mode(h):
        if not mig:
            raise FakeNVMLError("not supported")
        return (1, 1) if h == 0 else (0, 0)

    m.nvmlDeviceGetMigMode = mig_mode
    profiles = {
        0: types.SimpleNamespace(id=0, sliceCount=1, memorySizeMB=4864, multiprocessorCount=14, copyEngineCount=1,
                                 decoderCount=0, encoderCount=0, jpegCount=0, ofaCount=0),
        4: types.SimpleNamespace(id=4, sliceCount=7, memorySizeMB=40192, multiprocessorCount=98, copyEngineCount=7,
                                 decoderCount=5, encoderCount=0, jpegCount=1, ofaCount=1),
    }

    def profile_info(h, pid):
        if pid not in profiles:
            raise FakeNVMLError("no such profile")
        return profiles[pid]

    m.nvmlDeviceGetGpuInstanceProfileInfo = profile_info
    m.nvmlDeviceGetGpuInstancePossiblePlacements = lambda h, pid: (
        [types.SimpleNamespace(start=i, size=1) for i in range(7)] if pid == 0 else [types.SimpleNamespace(start=0, size=8)]
    )
    return m


def _fake_sysfs(tmp_path: Path) -> Path:
    for bus, root, numa in (("0000:18:00.0", "pci0000:15", "0"), ("0000:19:00.0", "pci0000:15", "-1")):
        real = tmp_path / "devices" / root / "0000:15:01.0" / bus
        real.mkdir(parents=True)
        (real / "numa_node").write_text(numa + "\n")
        link_dir = tmp_path / "bus" / "pci" / "devices"
        link_dir.mkdir(parents=True, exist_ok=True)
        os.symlink(real, link_dir / bus)
    return tmp_path


def test_nvml_backend_reads_identity_topology_and_mig(tmp_path):
    fake = _fake_nvml(mig=True)
    hardware = nvml_backend.discover(fake, _fake_sysfs(tmp_path))
    assert fake.calls == {"init": 1, "shutdown": 1}
    g0, g1 = hardware.gpus
    assert g0.pci_bus_id == "0000:18:00.0" and g0.pcie_root == "pci0000:15" and g0.numa_node == 0
    assert g1.numa_node is None  # sysfs says -1: no NUMA information
    assert g0.architecture == "Ampere" and g0.brand == "Nvidia" and g0.product_name == "NVIDIA A100-SXM4-40GB"
    assert g0.mig is not None and g1.mig is None
    assert [p.name for p in g0.mig.profiles] == ["1g.5gb", "7g.40gb"]
    assert g0.mig.memory_slices == 8 and g0.mig.multiprocessors == 98
    (gpus,) = driver_devices(hardware)
    names = [d.name for d in gpus.devices]
    assert names[:2] == ["gpu-0", "gpu-0-mig-1g-5gb-0"] and "gpu-1" in names
    gpu0 = gpus.devices[0]
    assert gpu0.attributes["driverVersion"].version_value == "550.90.7"
    assert gpu0.attributes["cudaDriverVersion"].version_value == "12.4.0"
    assert gpu0.attributes["cudaComputeCapability"].version_value == "8.0.0"
    assert "resource.kubernetes.io/numaNode" not in gpus.devices[-1].attributes


def test_nvml_backend_without_mig_support(tmp_path):
    hardware = nvml_backend.discover(_fake_nvml(mig=False), _fake_sysfs(tmp_path))
    assert all(g.mig is None for g in hardware.gpus)


def test_bus_id_normalisation():
    assert nvml_backend.normalize_bus_id("00000000:9A:00.0") == "0000:9a:00.0"


def _real_nvml():
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
    except Exception:  # no driver, no library, no GPU: all mean "skip"
        return None
    return pynvml if count else None


@pytest.mark.gpu
@pytest.mark.skipif(_real_nvml() is None, reason="no NVIDIA GPU or driver on this machine")
def test_real_h200():
    (gpus,) = driver_devices(nvml_backend.discover())
    gpu = next(d for d in gpus.devices if d.attributes["type"].value() == "gpu")
    print(gpu)
    assert "H200" in gpu.attributes["productName"].value()
    memory_gb = float(parse_quantity(gpu.capacity["memory"].value).value) / 1e9
    assert 135 < memory_gb < 155, memory_gb
    assert gpu.attributes["architecture"].value() == "Hopper"
    assert gpu.attributes["cudaComputeCapability"].version_value == "9.0.0"
