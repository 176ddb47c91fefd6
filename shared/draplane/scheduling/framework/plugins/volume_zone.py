"""VolumeZone: a bound volume's zone and region labels must hold on the node. A node with none
of those labels (a single-zone cluster) takes any volume. The zones travel from the binder, which
reads the PersistentVolumes, inside `volume_binding.BoundVolume`."""

from __future__ import annotations

from typing import Iterable, Mapping

import msgspec

from draplane.api.storage import PersistentVolume

NAME = "VolumeZone"
REASON = "node(s) had no available volume zone"

# The labels compared between a bound volume and the node, beta ones read as GA ones.
ZONE_LABELS = ("failure-domain.beta.kubernetes.io/zone", "failure-domain.beta.kubernetes.io/region",
               "topology.kubernetes.io/zone", "topology.kubernetes.io/region")
_GA_LABEL = {"failure-domain.beta.kubernetes.io/zone": "topology.kubernetes.io/zone",
             "failure-domain.beta.kubernetes.io/region": "topology.kubernetes.io/region"}


class ZoneRequirement(msgspec.Struct, frozen=True, array_like=True):
    key: str
    values: tuple[str, ...]


def volume_zones(volume: PersistentVolume) -> tuple[ZoneRequirement, ...]:
    """The volume's zone and region labels; a value may list several, joined by `__`."""
    labels = volume.metadata.labels or {}
    return tuple(ZoneRequirement(key, tuple(v for v in labels[key].split("__") if v))
                 for key in ZONE_LABELS if key in labels)


def filter_node(zones_of_bound: Iterable[tuple[ZoneRequirement, ...]], labels: Mapping[str, str]) -> str | None:
    if not any(key in labels for key in ZONE_LABELS):
        return None
    for zones in zones_of_bound:
        for zone in zones:
            value = labels.get(zone.key)
            if value is None:
                value = labels.get(_GA_LABEL.get(zone.key, zone.key))
            if value is None or value not in zone.values:
                return REASON
    return None
