"""Device health: the board, the NoSchedule taint it puts in the node's slices, and NVML's XID
events read through a fake NVML module."""

from __future__ import annotations

import asyncio
import types

from draplane.api.resource import Device
from draplane.messages.inventory import DriverDevices
from draplane_node_agent import nvml as nvml_backend
from draplane_node_agent.health import UNHEALTHY_TAINT_KEY, HealthBoard, with_health_taints


def drivers():
    return [DriverDevices(driver="gpu.nvidia.com", devices=[Device(name="gpu-0"), Device(name="gpu-1")])]


def test_an_unhealthy_device_is_tainted_once_with_the_time_it_turned():
    board = HealthBoard()
    assert with_health_taints(drivers(), board) == drivers()
    assert board.report("gpu.nvidia.com", "gpu-1", healthy=False, message="XID 79", now=1_700_000_000)
    # The same report again changes nothing, so the slice is not written again.
    assert not board.report("gpu.nvidia.com", "gpu-1", healthy=False, message="XID 79", now=1_700_000_100)
    tainted = with_health_taints(drivers(), board)
    assert tainted[0].devices[0].taints is None
    (taint,) = tainted[0].devices[1].taints
    assert (taint.key, taint.value, taint.effect, taint.time_added) == (
        UNHEALTHY_TAINT_KEY, "true", "NoSchedule", "2023-11-14T22:13:20Z")
    assert board.report("gpu.nvidia.com", "gpu-1", healthy=True)
    assert with_health_taints(drivers(), board) == drivers()


async def test_watchers_wake_on_a_change_and_time_out_without_one():
    board = HealthBoard()
    assert await board.wait_changed(board.version, 0.05) == 0
    waiter = asyncio.create_task(board.wait_changed(0, 5))
    await asyncio.sleep(0)
    board.report("d", "x", healthy=False)
    assert await asyncio.wait_for(waiter, 2) == 1


class FakeNVMLError(Exception):
    pass


class FakeTimeout(FakeNVMLError):
    pass


def fake_nvml(events: list[tuple[int, int]], *, unwatchable: set[int] = frozenset()):
    """Two GPUs; `events` are (gpu index, xid), then the wait times out until stopped."""
    m = types.ModuleType("fake_pynvml")
    m.NVMLError = FakeNVMLError
    m.nvmlEventTypeXidCriticalError = 8
    m.calls = []
    m.nvmlInit = lambda: m.calls.append("init")
    m.nvmlShutdown = lambda: m.calls.append("shutdown")
    m.nvmlDeviceGetCount = lambda: 2
    m.nvmlDeviceGetHandleByIndex = lambda i: f"handle-{i}"
    m.nvmlEventSetCreate = lambda: "set"
    m.nvmlEventSetFree = lambda s: m.calls.append("free")

    def register(handle, kind, event_set):
        if int(handle[-1]) in unwatchable:
            raise FakeNVMLError("Not Supported")

    m.nvmlDeviceRegisterEvents = register
    queue = list(events)

    def wait(event_set, ms):
        if not queue:
            raise FakeTimeout("Timeout")
        index, xid = queue.pop(0)
        return types.SimpleNamespace(eventData=xid, device=f"handle-{index}")

    m.nvmlEventSetWait_v2 = wait
    return m


def test_critical_xids_mark_their_gpu_and_application_xids_do_not():
    reports = []
    m = fake_nvml([(1, 79), (0, 13), (0, 48)], unwatchable={1})
    waits = iter(range(10))
    nvml_backend.watch_xid_events(lambda index, message: reports.append((index, message)),
                                  stopped=lambda: next(waits) >= 5, nvml=m)
    # GPU 1 could not be watched: said once; its event is not attributed. XID 13 is the application's.
    assert reports == [(None, "GPU 1: cannot watch XID events: Not Supported"), (0, "XID 48")]
    assert m.calls == ["init", "free", "shutdown"]
