"""The claims this node prepared for one driver: a checkpoint on disk, and their CDI specs and files.

Everything a prepared claim puts on the node is derived from its checkpoint entry, so the order
of writes is what makes a crash harmless:

- prepare writes the claim's device files and CDI spec first, then the checkpoint, then answers.
  A crash before the checkpoint leaves files no entry names; `restore()` removes them at start,
  and the kubelet, which got no answer, asks again.
- unprepare removes the files first, then the entry. A crash in between leaves an entry without
  files; the kubelet asks again, and the entry goes.

`restore()` also writes the files of every entry again: after a reboot the CDI folder (a tmpfs,
/var/run/cdi) is empty while the checkpoint survives, and the kubelet prepares its pods again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import msgspec

from draplane_node_agent.preparation import PreparedClaim, cdi_spec, cdi_spec_file_name

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.json"
CHECKPOINT_VERSION = 1


class CheckpointError(RuntimeError):
    """The checkpoint cannot be read; the message names the file. The agent does not start, because
    forgetting prepared claims would let their devices be prepared for other pods."""


class _Checkpoint(msgspec.Struct, kw_only=True):
    version: int
    driver: str
    node: str
    claims: dict[str, PreparedClaim]
    checksum: str = ""


def _checksum(claims: dict[str, PreparedClaim]) -> str:
    return hashlib.sha256(msgspec.json.encode(dict(sorted(claims.items())))).hexdigest()


def write_atomically(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace `path` whole: readers see the old or the new content, never half of it, even after
    a power cut (the file and its folder are synced before and after the rename)."""
    tmp = path.with_name(f".{path.name}.tmp")
    # A crash may have left one behind, read-only (device files are 0444): start it afresh.
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _sync_dir(path.parent)


def _sync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ClaimStore:
    """One driver's prepared claims on this node. Not thread-safe: the plugin serializes its calls."""

    def __init__(self, *, driver: str, node: str, plugin_dir: Path, cdi_dir: Path):
        self.driver, self.node = driver, node
        self.plugin_dir, self.cdi_dir = Path(plugin_dir), Path(cdi_dir)
        self.checkpoint_path = self.plugin_dir / CHECKPOINT_FILE
        self.claims_dir = self.plugin_dir / "claims"
        self._claims: dict[str, PreparedClaim] = {}

    # --- the checkpoint ----------------------------------------------------------------------------

    def load(self) -> None:
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        if not self.checkpoint_path.exists():
            self._claims = {}
            return
        raw = self.checkpoint_path.read_bytes()
        try:
            checkpoint = msgspec.json.decode(raw, type=_Checkpoint)
        except msgspec.DecodeError as exc:
            raise CheckpointError(f"checkpoint {self.checkpoint_path} cannot be read: {exc}; "
                                  "move it aside only once no pod on this node uses a prepared claim") from None
        if checkpoint.version != CHECKPOINT_VERSION:
            raise CheckpointError(f"checkpoint {self.checkpoint_path}: version {checkpoint.version} is not "
                                  f"{CHECKPOINT_VERSION}, the one this agent writes")
        if checkpoint.checksum != _checksum(checkpoint.claims):
            raise CheckpointError(f"checkpoint {self.checkpoint_path}: checksum mismatch (the file was changed or "
                                  "damaged); move it aside only once no pod on this node uses a prepared claim")
        if checkpoint.driver != self.driver or checkpoint.node != self.node:
            raise CheckpointError(f"checkpoint {self.checkpoint_path} belongs to driver {checkpoint.driver} on node "
                                  f"{checkpoint.node}, not {self.driver} on {self.node}")
        self._claims = dict(checkpoint.claims)

    def _save(self, claims: dict[str, PreparedClaim]) -> None:
        checkpoint = _Checkpoint(version=CHECKPOINT_VERSION, driver=self.driver, node=self.node,
                                 claims=claims, checksum=_checksum(claims))
        write_atomically(self.checkpoint_path, msgspec.json.encode(checkpoint), 0o600)
        self._claims = claims

    def get(self, uid: str) -> PreparedClaim | None:
        return self._claims.get(uid)

    def all(self) -> list[PreparedClaim]:
        return list(self._claims.values())

    # --- prepare and its undo -----------------------------------------------------------------

    def record(self, prepared: PreparedClaim) -> None:
        """Prepare: the files, then the checkpoint entry."""
        self.materialize(prepared)
        self._save({**self._claims, prepared.claim.uid: prepared})

    def forget(self, uid: str) -> bool:
        """Unprepare: the files, then the entry. False when the claim was not prepared here."""
        self._remove_files(uid)
        if uid not in self._claims:
            return False
        self._save({k: v for k, v in self._claims.items() if k != uid})
        return True

    # --- files --------------------------------------------------------------------------------

    def spec_path(self, uid: str) -> Path:
        return self.cdi_dir / cdi_spec_file_name(uid, self.driver)

    def device_file_dir(self, uid: str) -> Path:
        return self.claims_dir / uid

    def materialize(self, prepared: PreparedClaim) -> None:
        uid = prepared.claim.uid
        folder = self.device_file_dir(uid)
        folder.mkdir(parents=True, exist_ok=True)
        for device in prepared.devices:
            write_atomically(folder / device.file_name, device.file_text.encode(), 0o444)
        self.cdi_dir.mkdir(parents=True, exist_ok=True)
        spec = cdi_spec(prepared, str(folder))
        write_atomically(self.spec_path(uid), json.dumps(spec, indent=1).encode(), 0o644)

    def _remove_files(self, uid: str) -> None:
        self.spec_path(uid).unlink(missing_ok=True)
        shutil.rmtree(self.device_file_dir(uid), ignore_errors=True)

    def restore(self) -> tuple[int, int]:
        """At start: every entry's files written again, and files no entry names removed.
        Returns (restored, removed)."""
        for prepared in self._claims.values():
            self.materialize(prepared)
        removed: set[str] = set()
        prefix, suffix = cdi_spec_file_name("", self.driver).split("_", 1)[0] + "_", f"_{self.driver}.json"
        if self.cdi_dir.is_dir():
            for spec in self.cdi_dir.iterdir():
                name = spec.name
                if name.startswith(prefix) and name.endswith(suffix):
                    uid = name[len(prefix):-len(suffix)]
                    if uid not in self._claims:
                        spec.unlink(missing_ok=True)
                        removed.add(uid)
        if self.claims_dir.is_dir():
            for folder in self.claims_dir.iterdir():
                if folder.name not in self._claims:
                    shutil.rmtree(folder, ignore_errors=True)
                    removed.add(folder.name)
        if removed:
            log.info("driver %s: removed the files of %d claim(s) that no checkpoint entry names", self.driver, len(removed))
        return len(self._claims), len(removed)
