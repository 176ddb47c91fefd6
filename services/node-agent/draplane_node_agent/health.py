"""Each device's health, as the agent knows it, and what follows from it.

The kubelet watches it through the plugin's DRAResourceHealth stream (KEP-4680) and shows it in
the pod's `status.containerStatuses[].allocatedResourcesStatus`. The agent also taints an
unhealthy device NoSchedule in the node's ResourceSlice, so no new pod is placed on it.

Health comes from NVML's XID events on a real GPU (`nvml.watch_xid_events`) and, on simulated
nodes, from the switch the agent serves for tests (`PUT /devices/<driver>/<device>/health`).
"""

from __future__ import annotations

import asyncio
import datetime
import time

import msgspec

from draplane.api.resource import DeviceTaint
from draplane.messages.inventory import DriverDevices

UNHEALTHY_TAINT_KEY = "draplane.io/device-unhealthy"
HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"


class DeviceHealth(msgspec.Struct, frozen=True, kw_only=True):
    status: str  # Healthy | Unhealthy
    message: str = ""
    since: float  # epoch seconds of the last change
    updated: float  # epoch seconds of the last report


class HealthReport(msgspec.Struct, forbid_unknown_fields=True):
    """The test switch's body: {"healthy": false, "message": "XID 79: GPU has fallen off the bus"}."""

    healthy: bool
    message: str = ""


class HealthBoard:
    """Every device's last reported health; watchers wake on each change. Devices never reported
    are healthy: a driver that cannot tell reports nothing bad."""

    def __init__(self) -> None:
        self._health: dict[tuple[str, str], DeviceHealth] = {}
        self._changed = asyncio.Condition()
        self.version = 0

    def get(self, driver: str, device: str) -> DeviceHealth | None:
        return self._health.get((driver, device))

    def unhealthy(self) -> dict[tuple[str, str], DeviceHealth]:
        return {key: h for key, h in self._health.items() if h.status == UNHEALTHY}

    def report(self, driver: str, device: str, *, healthy: bool, message: str = "", now: float | None = None) -> bool:
        """Record a report; True when the device's status or message changed."""
        now = time.time() if now is None else now
        status = HEALTHY if healthy else UNHEALTHY
        before = self._health.get((driver, device))
        if before is not None and before.status == status and before.message == message:
            self._health[(driver, device)] = msgspec.structs.replace(before, updated=now)
            return False
        since = before.since if before is not None and before.status == status else now
        self._health[(driver, device)] = DeviceHealth(status=status, message=message, since=since, updated=now)
        self.version += 1
        self._notify()
        return True

    def _notify(self) -> None:
        async def wake() -> None:
            async with self._changed:
                self._changed.notify_all()

        try:
            asyncio.get_running_loop().create_task(wake())
        except RuntimeError:
            pass  # no loop (a pure test): nobody can be waiting

    async def wait_changed(self, seen_version: int, timeout: float) -> int:
        """Until the version moves past `seen_version` or `timeout` passes; returns the version."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self.version != seen_version), timeout)
            except asyncio.TimeoutError:
                pass
        return self.version


def _rfc3339(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(int(epoch), datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def unhealthy_taint(health: DeviceHealth) -> DeviceTaint:
    # The time the device turned unhealthy, not now: the published slice changes once, not on
    # every rescan.
    return DeviceTaint(key=UNHEALTHY_TAINT_KEY, value="true", effect="NoSchedule", time_added=_rfc3339(health.since))


def with_health_taints(drivers: list[DriverDevices], board: HealthBoard) -> list[DriverDevices]:
    """The discovered devices, each unhealthy one tainted NoSchedule."""
    bad = board.unhealthy()
    if not bad:
        return drivers
    result = []
    for entry in drivers:
        devices = []
        for device in entry.devices:
            health = bad.get((entry.driver, device.name))
            if health is not None:
                taints = [t for t in (device.taints or []) if t.key != UNHEALTHY_TAINT_KEY] + [unhealthy_taint(health)]
                device = msgspec.structs.replace(device, taints=taints)
            devices.append(device)
        result.append(msgspec.structs.replace(entry, devices=devices))
    return result
