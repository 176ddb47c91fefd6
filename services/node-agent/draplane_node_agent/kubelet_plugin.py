"""The node agent as the kubelet plugin of the drivers it publishes: the asyncio/gRPC shell.

For each driver the agent publishes on its node, it serves two unix sockets, as the kubelet's
plugin manager expects:

- `<kubelet dir>/plugins_registry/<driver>-reg.sock`: plugin registration (`pluginregistration`
  v1). The kubelet finds the socket, asks GetInfo, and connects to the endpoint it names. A
  restarted kubelet finds the socket again and registers the plugin again.
- `<kubelet dir>/plugins/<driver>/dra.sock`: the DRA service in v1 and v1beta1 (older kubelets),
  and the v1 DRAResourceHealth stream.

Decisions are in `preparation.py`; files and the checkpoint in `claim_store.py`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from pathlib import Path
from typing import Awaitable, Callable

import grpc

from draplane.api.resource import Device, ResourceClaim
from draplane.structured_logs import error_text, fields
from draplane_node_agent.claim_store import ClaimStore
from draplane_node_agent.health import UNHEALTHY, HealthBoard
from draplane_node_agent.kubelet_api import KubeletApi, load
from draplane_node_agent.preparation import ClaimRef, PreparedClaim, PrepareRefused, conflicting_claim, plan_claim

log = logging.getLogger(__name__)

ReadClaim = Callable[[ClaimRef], Awaitable[ResourceClaim | None]]
Published = Callable[[], dict[str, Device]]

# The kubelet marks a device's health Unknown when no report came for this long; the stream sends
# every device again well within it.
HEALTH_TIMEOUT_SECONDS = 60
HEALTH_RESEND_SECONDS = 20.0


class DriverPreparer:
    """Prepare and unprepare one driver's claims on this node: idempotent, one at a time."""

    def __init__(self, *, driver: str, node: str, store: ClaimStore, read_claim: ReadClaim, published: Published,
                 real_gpus: bool = False):
        self.driver, self.node = driver, node
        self.store = store
        self.read_claim = read_claim
        self.published = published
        self.real_gpus = real_gpus
        self._lock = asyncio.Lock()
        self.prepared_total = 0
        self.refused_total = 0

    async def prepare(self, ref: ClaimRef) -> PreparedClaim:
        existing = self.store.get(ref.uid)
        if existing is not None:
            # Asked again (a kubelet restart, a retry after our answer was lost): the same answer,
            # from the checkpoint, with its files written again in case they went.
            async with self._lock:
                await asyncio.to_thread(self.store.materialize, existing)
            return existing
        try:
            claim = await self.read_claim(ref)
        except Exception as exc:
            raise PrepareRefused(f"ResourceClaim {ref}: cannot read it from the API server: {error_text(exc)}") from exc
        if claim is None:
            raise PrepareRefused(f"ResourceClaim {ref}: not found")
        async with self._lock:
            existing = self.store.get(ref.uid)
            if existing is not None:
                return existing
            plan = plan_claim(claim, ref, driver=self.driver, node=self.node, published=self.published(),
                              real_gpus=self.real_gpus)
            conflict = conflicting_claim(plan, self.store.all())
            if conflict is not None:
                raise PrepareRefused(conflict)
            await asyncio.to_thread(self.store.record, plan)
        self.prepared_total += 1
        log.info("prepared ResourceClaim %s for driver %s: %s", ref, self.driver,
                 ", ".join(d.device for d in plan.devices), extra=fields(claim=str(ref), node=self.node))
        return plan

    async def unprepare(self, ref: ClaimRef) -> None:
        async with self._lock:
            removed = await asyncio.to_thread(self.store.forget, ref.uid)
        if removed:
            log.info("unprepared ResourceClaim %s for driver %s", ref, self.driver,
                     extra=fields(claim=str(ref), node=self.node))


def _prepare_answer(messages, prepared: PreparedClaim):
    devices = []
    for device in prepared.devices:
        answer = messages.Device(request_names=device.request_names, pool_name=device.pool,
                                 device_name=device.device, cdi_device_ids=device.cdi_device_ids)
        if device.share_id and "share_id" in messages.Device.DESCRIPTOR.fields_by_name:
            answer.share_id = device.share_id
        devices.append(answer)
    return messages.NodePrepareResourceResponse(devices=devices)


async def _answer_each_claim(request, one, response):
    """The kubelet's claims at once, each answered (or refused) on its own, keyed by claim UID."""
    for uid, answer in await asyncio.gather(*(one(claim) for claim in request.claims)):
        response.claims[uid].CopyFrom(answer)
    return response


def _dra_servicer(messages, services, preparer: DriverPreparer):
    """The DRAPlugin service of one API version (v1 and v1beta1 carry the same messages)."""

    class DRAPlugin(services.DRAPluginServicer):
        async def NodePrepareResources(self, request, context):
            async def one(claim):
                ref = ClaimRef(namespace=claim.namespace, name=claim.name, uid=claim.uid)
                try:
                    return claim.uid, _prepare_answer(messages, await preparer.prepare(ref))
                except PrepareRefused as exc:
                    preparer.refused_total += 1
                    log.warning("refused to prepare ResourceClaim %s: %s", ref, exc, extra=fields(claim=str(ref)))
                    return claim.uid, messages.NodePrepareResourceResponse(error=str(exc))
                except Exception as exc:  # a bug or a full disk: the kubelet retries; say what broke
                    log.exception("preparing ResourceClaim %s failed", ref, extra=fields(claim=str(ref)))
                    return claim.uid, messages.NodePrepareResourceResponse(
                        error=f"ResourceClaim {ref}: preparing failed: {error_text(exc)}")

            return await _answer_each_claim(request, one, messages.NodePrepareResourcesResponse())

        async def NodeUnprepareResources(self, request, context):
            async def one(claim):
                ref = ClaimRef(namespace=claim.namespace, name=claim.name, uid=claim.uid)
                try:
                    await preparer.unprepare(ref)
                    return claim.uid, messages.NodeUnprepareResourceResponse()
                except Exception as exc:
                    log.exception("unpreparing ResourceClaim %s failed", ref, extra=fields(claim=str(ref)))
                    return claim.uid, messages.NodeUnprepareResourceResponse(
                        error=f"ResourceClaim {ref}: unpreparing failed: {error_text(exc)}")

            return await _answer_each_claim(request, one, messages.NodeUnprepareResourcesResponse())

    return DRAPlugin()


def _health_servicer(api: KubeletApi, *, driver: str, node: str, board: HealthBoard, published: Published):
    messages = api.health_v1

    def snapshot():
        devices = []
        now = int(time.time())
        for name in sorted(published()):
            health = board.get(driver, name)
            status = messages.UNHEALTHY if health is not None and health.status == UNHEALTHY else messages.HEALTHY
            devices.append(messages.DeviceHealth(
                device=messages.DeviceIdentifier(pool_name=node, device_name=name), health=status,
                last_updated_time=now, health_check_timeout_seconds=HEALTH_TIMEOUT_SECONDS,
                message=health.message if health is not None else ""))
        return messages.NodeWatchResourcesResponse(devices=devices)

    class DRAResourceHealth(api.health_v1_grpc.DRAResourceHealthServicer):
        async def NodeWatchResources(self, request, context):
            # Every device now, then again on each change, and at least every HEALTH_RESEND_SECONDS
            # so that the kubelet never times a device out to Unknown.
            version = board.version
            while True:
                yield snapshot()
                version = await board.wait_changed(version, HEALTH_RESEND_SECONDS)

    return DRAResourceHealth()


def _registration_servicer(api: KubeletApi, *, driver: str, endpoint: str, versions: list[str]):
    messages = api.registration

    class Registration(api.registration_grpc.RegistrationServicer):
        registered = asyncio.Event()

        async def GetInfo(self, request, context):
            return messages.PluginInfo(type="DRAPlugin", name=driver, endpoint=endpoint, supported_versions=versions)

        async def NotifyRegistrationStatus(self, request, context):
            if request.plugin_registered:
                log.info("the kubelet registered the plugin of driver %s", driver)
                self.registered.set()
            else:
                log.error("the kubelet refused the plugin of driver %s: %s", driver, request.error)
            return messages.RegistrationStatusResponse()

    return Registration()


# sun_path holds 108 bytes with its terminating NUL: a longer path cannot be bound at all.
UNIX_SOCKET_PATH_MAX = 107


def _listen_unix(server: grpc.aio.Server, path: Path) -> None:
    if len(os.fsencode(path)) > UNIX_SOCKET_PATH_MAX:
        raise OSError(f"unix socket path {path} is {len(os.fsencode(path))} bytes, over the {UNIX_SOCKET_PATH_MAX} "
                      "a socket address holds; use a shorter --kubelet-dir")
    path.parent.mkdir(parents=True, exist_ok=True)
    if _someone_listens(path):
        # Never take over a live socket: another plugin of this driver (NVIDIA's DRA driver also
        # registers gpu.nvidia.com) would lose its registration, and two drivers would prepare
        # one device.
        raise OSError(f"unix socket {path} is in use: another process serves it (another kubelet plugin of this "
                      "driver on this node?); stop it, or run the node agent without --kubelet-plugin")
    # A socket left by a killed agent: nothing listens on it, and bind would fail.
    path.unlink(missing_ok=True)
    if server.add_insecure_port(f"unix://{path}") == 0:
        raise OSError(f"cannot listen on unix socket {path}")


def _someone_listens(path: Path) -> bool:
    if not path.exists():
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except OSError:  # refused (a stale socket), or not a socket at all
        return False
    finally:
        probe.close()
    return True


class DriverPlugin:
    """One driver's registration and DRA sockets."""

    def __init__(self, *, preparer: DriverPreparer, board: HealthBoard, registry_dir: Path, plugin_dir: Path):
        self.preparer = preparer
        self.board = board
        self.registration_socket = Path(registry_dir) / f"{preparer.driver}-reg.sock"
        self.dra_socket = Path(plugin_dir) / "dra.sock"
        self._servers: list[grpc.aio.Server] = []
        self._bound: list[Path] = []  # only sockets we bound are ours to remove
        self.registration = None

    async def start(self) -> None:
        api = await asyncio.to_thread(load)  # imports the generated stubs: file reads, not on the loop
        driver, node = self.preparer.driver, self.preparer.node
        restored, removed = await asyncio.to_thread(self._restore)
        log.info("driver %s: %d prepared claim(s) restored from the checkpoint, %d stale one(s) removed",
                 driver, restored, removed)
        try:
            await self._serve(api)
        except BaseException:
            await self.stop()
            raise
        log.info("driver %s: kubelet plugin listening on %s (registration %s)", driver, self.dra_socket,
                 self.registration_socket)

    async def _serve(self, api: KubeletApi) -> None:
        driver, node = self.preparer.driver, self.preparer.node
        dra = grpc.aio.server()
        api.dra_v1_grpc.add_DRAPluginServicer_to_server(_dra_servicer(api.dra_v1, api.dra_v1_grpc, self.preparer), dra)
        api.dra_v1beta1_grpc.add_DRAPluginServicer_to_server(
            _dra_servicer(api.dra_v1beta1, api.dra_v1beta1_grpc, self.preparer), dra)
        api.health_v1_grpc.add_DRAResourceHealthServicer_to_server(
            _health_servicer(api, driver=driver, node=node, board=self.board, published=self.preparer.published), dra)
        self._servers.append(dra)
        _listen_unix(dra, self.dra_socket)
        self._bound.append(self.dra_socket)
        await dra.start()
        # Registration last: the kubelet may connect to the DRA socket as soon as it learns of it.
        registration = grpc.aio.server()
        self.registration = _registration_servicer(
            api, driver=driver, endpoint=str(self.dra_socket),
            versions=["v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth"])
        api.registration_grpc.add_RegistrationServicer_to_server(self.registration, registration)
        self._servers.append(registration)
        _listen_unix(registration, self.registration_socket)
        self._bound.append(self.registration_socket)
        await registration.start()

    def _restore(self) -> tuple[int, int]:
        self.preparer.store.load()
        return self.preparer.store.restore()

    async def stop(self) -> None:
        # The registration socket goes first, so the kubelet unregisters the plugin on its removal.
        for server in reversed(self._servers):
            await server.stop(grace=2)
        self._servers = []
        for path in reversed(self._bound):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._bound = []
