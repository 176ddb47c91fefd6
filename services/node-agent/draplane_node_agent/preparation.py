"""What preparing a claim's devices on this node means, decided without I/O.

The kubelet asks the driver's plugin to prepare a claim before it starts a pod that uses it. For
one driver, `plan_claim` checks the claim against what this node published and turns it into a
`PreparedClaim`: the devices the kubelet hands to containers (with their CDI device IDs), and the
CDI spec and device files that give a container exactly those devices. `kubelet_plugin.py` is the
shell that reads the claim, writes the files and the checkpoint, and answers over gRPC.

A refusal is a `PrepareRefused` whose message names the claim and the field; the kubelet shows it
on the pod (event FailedPrepareDynamicResources) and asks again later.
"""

from __future__ import annotations

import re
from typing import Iterable

import msgspec

from draplane.api.resource import Device, DeviceAllocationConfiguration, DeviceRequestAllocationResult, ResourceClaim

# The CDI kind of every device we prepare: vendor k8s.draplane.io, class "claim". Device names
# carry the claim's UID and the driver, so specs of several claims and drivers never collide.
CDI_KIND = "k8s.draplane.io/claim"
CDI_VERSION = "0.6.0"
# Where a container finds one file per device it was given: `ls` lists exactly its devices.
CONTAINER_DEVICE_DIR = "/var/run/draplane/devices"
# The NVIDIA container toolkit's CDI spec names every GPU and MIG device by its UUID (`nvidia-ctk
# cdi generate`); with it, the container runtime adds the device nodes and the driver's libraries.
NVIDIA_CDI_KIND = "nvidia.com/gpu"

CONFIG_API_VERSION = "draplane.io/v1alpha1"
CONFIG_KIND = "DeviceConfig"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
RESERVED_ENV_PREFIX = "DRAPLANE_"


class PrepareRefused(Exception):
    """The claim cannot be prepared on this node; the message says which object and field."""


class ClaimRef(msgspec.Struct, frozen=True):
    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


class PreparedDevice(msgspec.Struct, frozen=True, kw_only=True):
    """One device as the kubelet gets it back, and what the container sees of it."""

    request_names: list[str]  # base request names: the kubelet matches containers' claim requests on them
    pool: str
    device: str
    cdi_device_ids: list[str]
    share_id: str | None = None
    admin_access: bool = False
    exclusive: bool = True  # False: the device allows multiple allocations (or the claim has admin access)
    env: dict[str, str] = {}
    file_name: str = ""  # under CONTAINER_DEVICE_DIR and the claim's host folder
    file_text: str = ""


class PreparedClaim(msgspec.Struct, frozen=True, kw_only=True):
    """A claim prepared for one driver: the checkpoint's entry, and enough to rebuild its files."""

    claim: ClaimRef
    driver: str
    devices: list[PreparedDevice]

    @property
    def key(self) -> str:
        return claim_key(self.claim.uid, self.driver)


def claim_key(uid: str, driver: str) -> str:
    return f"{uid}/{driver}"


class DeviceConfig(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    """The opaque `parameters` a claim or class may address to our drivers."""

    api_version: str
    kind: str
    # Extra environment for every container given the devices this config applies to.
    env: dict[str, str] | None = None


def base_request(name: str) -> str:
    """"gpu/large" (a firstAvailable subrequest) -> "gpu", as the kubelet stores request names."""
    return name.split("/", 1)[0]


def _sanitized(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]", "_", text).upper()


def device_env_prefix(driver: str, device: str) -> str:
    """DRAPLANE_DEVICE_<driver>_<device>: unique per device, so two devices never overwrite each other."""
    return f"DRAPLANE_DEVICE_{_sanitized(driver)}_{_sanitized(device)}"


def cdi_device_name(uid: str, driver: str, device: str, share_id: str | None = None) -> str:
    # A shared device's share gets its own name: one claim may hold two shares of one device.
    return f"{uid}_{driver}_{device}" + (f"_{share_id}" if share_id else "")


def cdi_spec_file_name(uid: str, driver: str) -> str:
    return f"k8s.draplane.io-claim_{uid}_{driver}.json"


# --- claim config ------------------------------------------------------------------------------


def _decode_config(entry: DeviceAllocationConfiguration, where: str) -> DeviceConfig:
    parameters = entry.opaque.parameters if entry.opaque is not None else None
    where = f"{where}.opaque.parameters"
    if not isinstance(parameters, dict):
        raise PrepareRefused(f"{where}: must be an object with apiVersion {CONFIG_API_VERSION} and kind {CONFIG_KIND}")
    try:
        config = msgspec.convert(parameters, DeviceConfig)
    except msgspec.ValidationError as exc:
        # msgspec says "Object contains unknown field `x` - at `$.env`": keep the field path ours.
        raise PrepareRefused(f"{where}: {exc}".replace(" - at `$", " (at `parameters")) from None
    if config.api_version != CONFIG_API_VERSION:
        raise PrepareRefused(f"{where}.apiVersion: {config.api_version!r} is not supported; use {CONFIG_API_VERSION!r}")
    if config.kind != CONFIG_KIND:
        raise PrepareRefused(f"{where}.kind: {config.kind!r} is not supported; use {CONFIG_KIND!r}")
    for name in config.env or {}:
        if not _ENV_NAME.match(name):
            raise PrepareRefused(f"{where}.env: {name!r} is not a valid environment variable name")
        if name.startswith(RESERVED_ENV_PREFIX):
            raise PrepareRefused(f"{where}.env: {name!r} starts with {RESERVED_ENV_PREFIX}, which draplane sets itself")
    return config


def config_env(claim: ResourceClaim, driver: str) -> dict[str | None, dict[str, str]]:
    """The environment each request gets from the opaque configs addressed to `driver`, checked.

    Keyed by base request name; key None applies to every request. Entries are applied in the
    allocation's order (the class's first, then the claim's), so a later one wins a name.
    """
    allocation = claim.status.allocation if claim.status else None
    entries = (allocation.devices.config if allocation and allocation.devices else None) or []
    env: dict[str | None, dict[str, str]] = {}
    for i, entry in enumerate(entries):
        if entry.opaque is None or entry.opaque.driver != driver:
            continue  # another driver's, or not opaque: not ours to judge
        config = _decode_config(entry, f"ResourceClaim {claim.metadata.namespace}/{claim.metadata.name}: "
                                       f"status.allocation.devices.config[{i}]")
        for request in (entry.requests or [None]):
            target = env.setdefault(base_request(request) if request else None, {})
            target.update(config.env or {})
    return env


def _env_for(request: str, env_by_request: dict[str | None, dict[str, str]], order: Iterable[str | None]) -> dict[str, str]:
    merged: dict[str, str] = {}
    for key in order:
        if key is None or key == request:
            merged.update(env_by_request.get(key, {}))
    return merged


# --- planning ----------------------------------------------------------------------------------


def check_claim(claim: ResourceClaim, ref: ClaimRef) -> list[tuple[int, DeviceRequestAllocationResult]]:
    """The claim is the one the kubelet named, and allocated; returns its results, numbered."""
    what = f"ResourceClaim {ref}"
    if claim.metadata.uid != ref.uid:
        raise PrepareRefused(f"{what}: metadata.uid is {claim.metadata.uid}, but the kubelet asked for UID {ref.uid} "
                             "(the claim was deleted and created again)")
    allocation = claim.status.allocation if claim.status else None
    if allocation is None or allocation.devices is None:
        raise PrepareRefused(f"{what}: status.allocation is not set; the claim is not allocated")
    return list(enumerate(allocation.devices.results or []))


def plan_claim(
    claim: ResourceClaim,
    ref: ClaimRef,
    *,
    driver: str,
    node: str,
    published: dict[str, Device],
    real_gpus: bool = False,
) -> PreparedClaim:
    """Prepare `claim`'s devices of `driver` on `node`, whose pool publishes `published`."""
    what = f"ResourceClaim {ref}"
    numbered = [(i, r) for i, r in check_claim(claim, ref) if r.driver == driver]
    if not numbered:
        raise PrepareRefused(f"{what}: status.allocation.devices.results has no device of driver {driver}")
    env_by_request = config_env(claim, driver)
    order = list(env_by_request)
    devices: list[PreparedDevice] = []
    for i, result in numbered:
        where = f"{what}: status.allocation.devices.results[{i}]"
        if result.pool != node:
            raise PrepareRefused(f"{where}.pool: {result.pool!r} is not this node's pool ({node!r}); "
                                 "the device was allocated on another node")
        device = published.get(result.device)
        if device is None:
            raise PrepareRefused(f"{where}.device: {driver}/{result.pool}/{result.device} is not a device this "
                                 "node publishes (removed since the allocation?)")
        devices.append(_prepared_device(claim, ref, result, device, driver=driver, real_gpus=real_gpus,
                                        env=_env_for(base_request(result.request), env_by_request, order),
                                        where=where))
    return PreparedClaim(claim=ref, driver=driver, devices=devices)


def _attribute_text(device: Device, name: str) -> str | None:
    attribute = (device.attributes or {}).get(name)
    if attribute is None:
        return None
    for value in (attribute.string_value, attribute.version_value, attribute.int_value, attribute.bool_value):
        if value is not None:
            return str(value).lower() if isinstance(value, bool) else str(value)
    return None


def _prepared_device(claim: ResourceClaim, ref: ClaimRef, result: DeviceRequestAllocationResult, device: Device, *,
                     driver: str, real_gpus: bool, env: dict[str, str], where: str) -> PreparedDevice:
    uuid = _attribute_text(device, "uuid")
    kind = _attribute_text(device, "type")
    cdi_ids = [f"{CDI_KIND}={cdi_device_name(ref.uid, driver, result.device, result.share_id)}"]
    if real_gpus and kind in ("gpu", "mig"):
        if not uuid:
            # Our slices model every MIG placement a GPU could hold; only existing instances have
            # a UUID, and draplane does not create MIG instances on a node.
            raise PrepareRefused(f"{where}.device: {result.device} is a MIG placement with no MIG instance on this "
                                 "GPU (no uuid); create the instance, or request an existing one")
        cdi_ids.append(f"{NVIDIA_CDI_KIND}={uuid}")
    prefix = device_env_prefix(driver, result.device)
    device_env = dict(env)
    device_env[f"{prefix}_NAME"] = f"{driver}/{result.pool}/{result.device}"
    if uuid:
        device_env[f"{prefix}_UUID"] = uuid
    if result.admin_access:
        device_env[f"{prefix}_ADMIN_ACCESS"] = "true"
    lines = [f"driver: {driver}", f"pool: {result.pool}", f"device: {result.device}",
             f"claim: {ref}", f"request: {base_request(result.request)}"]
    if uuid:
        lines.append(f"uuid: {uuid}")
    if result.admin_access:
        lines.append("adminAccess: true")
    if result.share_id:
        lines.append(f"shareID: {result.share_id}")
    for capacity, value in sorted((result.consumed_capacity or {}).items()):
        # A shared device's share: what the allocator took for this claim, e.g. memory 10Gi.
        device_env[f"{prefix}_CAPACITY_{_sanitized(capacity.rsplit('/', 1)[-1])}"] = value
        lines.append(f"capacity.{capacity}: {value}")
    return PreparedDevice(
        request_names=[base_request(result.request)],
        pool=result.pool,
        device=result.device,
        cdi_device_ids=cdi_ids,
        share_id=result.share_id,
        admin_access=bool(result.admin_access),
        exclusive=not (result.admin_access or device.allow_multiple_allocations),
        env=device_env,
        file_name=f"{driver}_{result.device}" + (f"_{result.share_id}" if result.share_id else ""),
        file_text="\n".join(lines) + "\n",
    )


def conflicting_claim(plan: PreparedClaim, prepared: Iterable[PreparedClaim]) -> str | None:
    """A device of `plan` that another prepared claim holds exclusively, or that `plan` would hold
    exclusively while another has it; None when there is none. This is the node's last check that
    a container sees only devices that are its own (CNCF AI conformance, secure accelerator access)."""
    held: dict[tuple[str, str], list[tuple[PreparedClaim, PreparedDevice]]] = {}
    for other in prepared:
        if other.key == plan.key:
            continue
        for device in other.devices:
            held.setdefault((other.driver, device.device), []).append((other, device))
    for device in plan.devices:
        for other, theirs in held.get((plan.driver, device.device), []):
            if device.admin_access or theirs.admin_access:
                continue  # admin access sees a device whoever uses it (KEP-5018)
            if device.exclusive or theirs.exclusive:
                return (f"ResourceClaim {plan.claim}: device {plan.driver}/{device.pool}/{device.device} is already "
                        f"prepared for ResourceClaim {other.claim} (uid {other.claim.uid}); the device does not allow multiple "
                        "allocations and neither claim has adminAccess, so two pods would see one device")
    return None


# --- CDI ---------------------------------------------------------------------------------------


def cdi_spec(prepared: PreparedClaim, device_file_dir: str) -> dict:
    """The claim's CDI spec: for each device, its env and its file mounted read-only.

    `device_file_dir` is the host folder that holds the claim's device files.
    """
    devices = []
    for device in prepared.devices:
        devices.append({
            "name": cdi_device_name(prepared.claim.uid, prepared.driver, device.device, device.share_id),
            "containerEdits": {
                "env": [f"{name}={value}" for name, value in sorted(device.env.items())],
                "mounts": [{
                    "hostPath": f"{device_file_dir}/{device.file_name}",
                    "containerPath": f"{CONTAINER_DEVICE_DIR}/{device.file_name}",
                    "options": ["ro", "nosuid", "nodev", "noexec", "bind"],
                    "type": "bind",
                }],
            },
        })
    return {"cdiVersion": CDI_VERSION, "kind": CDI_KIND, "devices": devices}

