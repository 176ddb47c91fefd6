"""Change batches of the cluster bucket: what the binder wrote in one round, in one message.

Why: every shard follows every pod the binder binds, and nats-py spends about 28 us on each
message it delivers, even when they come ten to a socket read (measured with the shards' own
watch beside bench/e2e.py). A pod is two keys of the cluster bucket (its claim and itself), so
following it one key at a time cost a shard about 0.06 ms of the 0.17 ms it spent per pod.

The bucket stays what it was: one key per object, the latest value of each, and a shard that
starts rebuilds from it (draplane.scheduling.cluster_feed). Besides, after each round of puts,
the binder writes the round once more as a `Changes` value under a key of its own
(`CHANGES_PREFIX`), which expires after CHANGES_TTL_SECONDS. A shard replays the bucket once,
then reads only those keys: one message per round instead of one per key.

Nothing may be missed that way, so a shard counts the stream sequences it has taken in
(`Taken`): every put of the binder has its sequence named in the round written after it, and the
round's own message has one. A sequence left out (the binder died between its puts and their
round, a round too big to be written, a value written by anything but the binder) is read from
the bucket's stream itself, in order (`missing`). Values too large for a round are named in it
without their bytes (`Change.omitted`) and read the same way.

Pure: encoding, decoding and the counting; draplane.jetstream does the reading and writing.
"""

from __future__ import annotations

import msgspec

# The keys of the batches: CHANGES_PREFIX + "<binder's token>.<round number>". A round's key is new,
# never overwritten: with one value kept per key, a shard that falls behind would otherwise find
# the batches it had not read yet replaced by later ones.
CHANGES_PREFIX = "meta.changes."
# A batch is only read by shards following the bucket as it is written; one that falls further
# behind than this reads what it missed from the stream itself.
CHANGES_TTL_SECONDS = 30.0
# Values larger than this are named in a batch, not carried (the shard reads them from the stream).
MAX_VALUE_IN_BATCH = 64 * 1024
# A round larger than this is written as several batches (NATS refuses messages over 1 MB).
MAX_BATCH_BYTES = 256 * 1024


class ChangesError(ValueError):
    """A batch that cannot be read: it names its key and what is wrong."""


class Change(msgspec.Struct, array_like=True, frozen=True, gc=False):
    key: str
    revision: int  # the stream sequence of the put (or purge) that made this value
    value: bytes | None = None  # None: the key was purged (its object deleted)
    omitted: bool = False  # too large to carry: read revision `revision` from the stream


class Changes(msgspec.Struct, frozen=True, gc=False):
    binder: str
    changes: list[Change]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Changes)
# What a Change costs in a batch besides its key and value: its array header, the revision, the flag.
_CHANGE_OVERHEAD_BYTES = 16


def is_changes_key(key: str) -> bool:
    return key.startswith(CHANGES_PREFIX)


def changes_key(token: str, number: int) -> str:
    return f"{CHANGES_PREFIX}{token}.{number}"


def change(key: str, revision: int, value: bytes | None) -> Change:
    """The Change a round's put (or purge) makes: its value left out when too large to carry."""
    if value is not None and len(value) > MAX_VALUE_IN_BATCH:
        return Change(key, revision, None, True)
    return Change(key, revision, value)


def encode_batches(binder: str, changes: list[Change], *, max_bytes: int = MAX_BATCH_BYTES) -> list[bytes]:
    """A round's changes as batches of at most about `max_bytes` each, in order."""
    batches: list[bytes] = []
    current: list[Change] = []
    size = 0
    for item in changes:
        item_size = len(item.key) + len(item.value or b"") + _CHANGE_OVERHEAD_BYTES
        if current and size + item_size > max_bytes:
            batches.append(_ENCODER.encode(Changes(binder, current)))
            current, size = [], 0
        current.append(item)
        size += item_size
    if current:
        batches.append(_ENCODER.encode(Changes(binder, current)))
    return batches


def decode_changes(key: str, value: bytes) -> Changes:
    try:
        return _DECODER.decode(value)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ChangesError(f"cluster bucket change batch {key!r}: {exc}") from None


class Taken:
    """The stream sequences of the cluster bucket a shard has taken in: every one up to `upto`,
    and those in `ahead` beyond it. A sequence is taken when its value was applied, when a batch
    named it, or when the stream was read past it (a sequence not found there was overwritten or
    purged by a later one, which is read in its turn)."""

    __slots__ = ("upto", "ahead")

    def __init__(self, upto: int):
        self.upto = upto
        self.ahead: set[int] = set()

    def has(self, sequence: int) -> bool:
        return sequence <= self.upto or sequence in self.ahead

    def take(self, sequence: int) -> None:
        if sequence <= self.upto:
            return
        if sequence == self.upto + 1 and not self.ahead:
            self.upto = sequence  # the common case: the next one, nothing ahead
            return
        self.ahead.add(sequence)
        self._advance()

    def take_through(self, sequence: int) -> None:
        """Everything up to `sequence` is taken: the stream was read that far."""
        if sequence <= self.upto:
            return
        self.upto = sequence
        self.ahead = {s for s in self.ahead if s > sequence}
        self._advance()

    def highest(self) -> int:
        """The highest sequence taken."""
        return max(self.ahead) if self.ahead else self.upto

    def missing(self) -> tuple[int, int] | None:
        """The first and last sequence of the span a batch skipped, or None when none is missing
        below the highest taken."""
        if not self.ahead:
            return None
        return self.upto + 1, max(self.ahead)

    def _advance(self) -> None:
        while self.upto + 1 in self.ahead:
            self.upto += 1
            self.ahead.discard(self.upto)
