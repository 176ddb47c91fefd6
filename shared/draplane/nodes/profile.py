"""The `profile` discovery backend: a YAML hardware profile describes a simulated node.

Profiles shipped with draplane live next to this module (`shipped_profiles()`: the node mixes that
`draplane up` and the benches deal out), more in `profiles/more` (`more_profiles()`: hardware only
some tools ask for by name, such as the H100 MIG node of `draplane simulate --mig`); `load_profile()`
takes either kind of name or a path. Devices are laid out the way real servers are: GPUs, then NICs,
spread evenly over the PCIe roots, and the roots evenly over the NUMA nodes, so topology-aware
requests ("a GPU and a NIC on the same PCIe root") have something real to match. UUIDs derive from
the node name, so a node keeps its identity across agent restarts.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import msgspec
import yaml

from draplane.api.quantity import QuantityError, parse_quantity
from draplane.nodes.hardware import (
    GpuInfo,
    HardwareError,
    MigCapability,
    MigProfile,
    NicInfo,
    NodeHardware,
    driver_devices,
)

PROFILE_DIR = Path(__file__).parent / "profiles"
MORE_PROFILE_DIR = PROFILE_DIR / "more"
_UUID_NAMESPACE = uuid.UUID("6f1d3c52-3f0e-4f3a-9d0b-4a6b8f1e2c77")


class ProfileError(ValueError):
    """A profile that cannot be read. The message names the file and the field."""


class _Spec(msgspec.Struct, rename="camel", forbid_unknown_fields=True, kw_only=True):
    pass


class PlacementSpec(_Spec, kw_only=True):
    start: int
    size: int


class MigProfileSpec(_Spec, kw_only=True):
    name: str
    memory: str
    multiprocessors: int
    copy_engines: int = 0
    decoders: int = 0
    encoders: int = 0
    jpeg_engines: int = 0
    ofa_engines: int = 0
    placements: list[PlacementSpec]


class MigSpec(_Spec, kw_only=True):
    memory_slices: int
    multiprocessors: int
    copy_engines: int = 0
    decoders: int = 0
    encoders: int = 0
    jpeg_engines: int = 0
    ofa_engines: int = 0
    profiles: list[MigProfileSpec]


class SharedGpuSpec(_Spec, kw_only=True):
    """A GPU that several claims share (time-slicing or MPS), each taking a part of its memory in
    whole `memoryStep`s: published as a device with consumable capacity."""

    memory_step: str


class GpuGroupSpec(_Spec, kw_only=True):
    count: int
    product_name: str
    brand: str = "Nvidia"
    architecture: str
    cuda_compute_capability: str
    memory: str
    mig: MigSpec | None = None
    shared: SharedGpuSpec | None = None


class NicGroupSpec(_Spec, kw_only=True):
    count: int
    driver: str
    product_name: str
    link_speed_gbps: int
    rdma: bool = True


class HardwareProfile(_Spec, kw_only=True):
    name: str
    description: str = ""
    numa_nodes: int = 1
    pcie_roots: int = 1
    driver_version: str
    cuda_driver_version: str | None = None
    gpus: list[GpuGroupSpec] = msgspec.field(default_factory=list)
    nics: list[NicGroupSpec] = msgspec.field(default_factory=list)

    def hardware(self, node: str) -> NodeHardware:
        return profile_hardware(self, node)


def shipped_profiles() -> dict[str, Path]:
    return {p.stem: p for p in sorted(PROFILE_DIR.glob("*.yaml"))}


def more_profiles() -> dict[str, Path]:
    return {p.stem: p for p in sorted(MORE_PROFILE_DIR.glob("*.yaml"))}


def profile_names() -> dict[str, Path]:
    """Every profile `load_profile()` knows by name."""
    return {**shipped_profiles(), **more_profiles()}


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    path = Path(name_or_path)
    known = profile_names()
    if str(name_or_path) in known:
        path = known[str(name_or_path)]
    elif not path.exists():
        raise ProfileError(f"profile {name_or_path!r}: no such file, and not a shipped profile ({', '.join(known)})")
    try:
        return parse_profile(path.read_text(), source=str(path))
    except OSError as exc:
        raise ProfileError(f"profile {path}: cannot read: {exc.strerror}") from None


def parse_profile(text: str, *, source: str = "<profile>") -> HardwareProfile:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ProfileError(f"{source}: not valid YAML: {exc}".replace("\n", " ")) from None
    try:
        profile = msgspec.convert(raw, type=HardwareProfile)
    except msgspec.ValidationError as exc:
        raise ProfileError(f"{source}: {exc}") from None
    _check(profile, source)
    try:
        driver_devices(profile_hardware(profile, "profile-check"))
    except HardwareError as exc:
        raise ProfileError(f"{source}: {exc}") from None
    return profile


def _check(profile: HardwareProfile, source: str) -> None:
    if profile.numa_nodes < 1:
        raise ProfileError(f"{source}: numaNodes must be at least 1, got {profile.numa_nodes}")
    if profile.pcie_roots < profile.numa_nodes:
        raise ProfileError(f"{source}: pcieRoots ({profile.pcie_roots}) must be at least numaNodes ({profile.numa_nodes})")
    for i, group in enumerate(profile.gpus):
        if group.count < 1:
            raise ProfileError(f"{source}: gpus[{i}].count must be at least 1, got {group.count}")
        if group.mig is not None and group.shared is not None:
            raise ProfileError(f"{source}: gpus[{i}]: a GPU is either partitioned (mig) or shared, not both")
        for field, value in (("memory", group.memory),) + tuple(
            (f"mig.profiles[{j}].memory", p.memory) for j, p in enumerate(group.mig.profiles if group.mig else ())
        ) + ((("shared.memoryStep", group.shared.memory_step),) if group.shared else ()):
            try:
                q = parse_quantity(value)
            except QuantityError as exc:
                raise ProfileError(f"{source}: gpus[{i}].{field}: {exc}") from None
            if q.value.denominator != 1 or q.value <= 0:
                raise ProfileError(f"{source}: gpus[{i}].{field}: {value!r} must be a positive whole number of bytes")
    for i, group in enumerate(profile.nics):
        if group.count < 1:
            raise ProfileError(f"{source}: nics[{i}].count must be at least 1, got {group.count}")


def _bytes(text: str) -> int:
    return int(parse_quantity(text).value)


def _root(index: int, count: int, roots: int) -> int:
    return index * roots // count if count else 0


def profile_hardware(profile: HardwareProfile, node: str) -> NodeHardware:
    roots = profile.pcie_roots
    # Root r is bus 0x10 + 0x40*r of domain 0; its devices take the buses right below it.
    root_bus = [0x10 + 0x40 * r for r in range(roots)]
    used_on_root = [0] * roots

    def place(root: int) -> tuple[str, str, int]:
        used_on_root[root] += 1
        bus = root_bus[root] + used_on_root[root]
        numa = root * profile.numa_nodes // roots
        return f"0000:{bus:02x}:00.0", f"pci0000:{root_bus[root]:02x}", numa

    gpu_total = sum(g.count for g in profile.gpus)
    gpus: list[GpuInfo] = []
    for group in profile.gpus:
        mig = None
        if group.mig is not None:
            m = group.mig
            mig = MigCapability(
                memory_slices=m.memory_slices,
                multiprocessors=m.multiprocessors,
                copy_engines=m.copy_engines,
                decoders=m.decoders,
                encoders=m.encoders,
                jpeg_engines=m.jpeg_engines,
                ofa_engines=m.ofa_engines,
                profiles=tuple(
                    MigProfile(
                        name=p.name,
                        memory=_bytes(p.memory),
                        multiprocessors=p.multiprocessors,
                        copy_engines=p.copy_engines,
                        decoders=p.decoders,
                        encoders=p.encoders,
                        jpeg_engines=p.jpeg_engines,
                        ofa_engines=p.ofa_engines,
                        placements=tuple((pl.start, pl.size) for pl in p.placements),
                    )
                    for p in m.profiles
                ),
            )
        for _ in range(group.count):
            index = len(gpus)
            bus_id, pcie_root, numa = place(_root(index, gpu_total, roots))
            gpus.append(
                GpuInfo(
                    index=index,
                    uuid=f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'{node}/gpu/{index}')}",
                    product_name=group.product_name,
                    brand=group.brand,
                    architecture=group.architecture,
                    cuda_compute_capability=group.cuda_compute_capability,
                    driver_version=profile.driver_version,
                    cuda_driver_version=profile.cuda_driver_version,
                    memory=_bytes(group.memory),
                    pci_bus_id=bus_id,
                    pcie_root=pcie_root,
                    numa_node=numa,
                    mig=mig,
                    share_memory_step=_bytes(group.shared.memory_step) if group.shared else None,
                )
            )
    nic_total = sum(n.count for n in profile.nics)
    nics: list[NicInfo] = []
    for group in profile.nics:
        for _ in range(group.count):
            index = len(nics)
            bus_id, pcie_root, numa = place(_root(index, nic_total, roots))
            nics.append(
                NicInfo(
                    driver=group.driver,
                    index=index,
                    product_name=group.product_name,
                    link_speed_gbps=group.link_speed_gbps,
                    pci_bus_id=bus_id,
                    pcie_root=pcie_root,
                    numa_node=numa,
                    rdma=group.rdma,
                )
            )
    return NodeHardware(gpus=tuple(gpus), nics=tuple(nics))
