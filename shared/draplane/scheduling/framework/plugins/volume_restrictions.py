"""VolumeRestrictions: a ReadWriteOncePod claim that a scheduled pod uses already refuses the pod
on every node. The binder, which watches the pods and their claims, finds such claims
(`volume_binding.PodVolumes.in_use_elsewhere`)."""

from __future__ import annotations

from typing import Collection

NAME = "VolumeRestrictions"
REASON_RWOP_CONFLICT = ("node(s) unavailable due to PersistentVolumeClaim with ReadWriteOncePod access mode already "
                        "in-use by another pod")
READ_WRITE_ONCE_POD = "ReadWriteOncePod"


def filter_node(in_use_elsewhere: Collection[str]) -> str | None:
    return REASON_RWOP_CONFLICT if in_use_elsewhere else None
