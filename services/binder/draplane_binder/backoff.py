"""When each pending pod is tried again: kube-scheduler's backoff queue, as a table. Pure.

A pod whose attempt failed waits `retry_initial_seconds`, doubling with each failure in a row up
to `retry_max_seconds`. What a pod waits for changing (a claim released, a node changed, a
PersistentVolumeClaim bound) brings its retry forward to `retry_flush_seconds` from now, backoff
or not. A pod that is bound, gone or done is forgotten.
"""

from __future__ import annotations

from collections.abc import Iterable

# A retry whose moment has passed and that was handed out: its backoff is kept for the next failure.
DUE_ALREADY = float("-inf")


class PodBackoff:
    __slots__ = ("initial", "maximum", "flush", "_retry")

    def __init__(self, *, initial: float, maximum: float, flush: float) -> None:
        self.initial, self.maximum, self.flush = initial, maximum, flush
        # pod uid -> (retry at, current backoff), monotonic seconds
        self._retry: dict[str, tuple[float, float]] = {}

    def __contains__(self, uid: str) -> bool:
        return uid in self._retry

    def __len__(self) -> int:
        return len(self._retry)

    def waiting(self, uid: str, now: float) -> bool:
        """The pod's retry is still ahead: it must not be sent to the shards yet."""
        return uid in self._retry and self._retry[uid][0] > now

    def next_backoff(self, uid: str) -> float:
        """The pod's backoff after one more failed attempt."""
        return min(self.maximum, self._retry.get(uid, (0.0, self.initial / 2))[1] * 2)

    def failed(self, uid: str, now: float) -> float:
        """An attempt failed (unschedulable): retry after the next backoff, which is returned."""
        backoff = self.next_backoff(uid)
        self._retry[uid] = (now + backoff, backoff)
        return backoff

    def not_sent(self, uid: str, now: float) -> None:
        """The pod could not be sent (NATS did not take it): not its fault, so retried after the
        first backoff, its own backoff kept."""
        self._retry[uid] = (now + self.initial, self._retry.get(uid, (0.0, self.initial))[1])

    def placement_abandoned(self, uid: str, now: float) -> None:
        """A placement was given up (a lease lapsed, the pod changed): tried again soon."""
        self._retry[uid] = (now + self.flush, self.initial)

    def back_off(self, uid: str, backoff: float, now: float) -> None:
        """A PreBind step failed: the pod waits `backoff` (computed before the placement was
        abandoned), not the quick retry of an abandoned placement."""
        if uid in self._retry:
            self._retry[uid] = (now + backoff, backoff)

    def wake(self, uids: Iterable[str], now: float) -> None:
        """Something these pods wait for changed: tried again soon, backoff or not."""
        soon = now + self.flush
        for uid in uids:
            entry = self._retry.get(uid)
            if entry is not None and entry[0] > soon:
                self._retry[uid] = (soon, entry[1])

    def wake_all(self, now: float) -> None:
        self.wake(list(self._retry), now)

    def due(self, now: float) -> list[str]:
        """The pods whose retry has come, each handed out once (its backoff kept)."""
        due = [uid for uid, (at, _) in self._retry.items() if at <= now and at != DUE_ALREADY]
        for uid in due:
            self._retry[uid] = (DUE_ALREADY, self._retry[uid][1])
        return due

    def forget(self, uid: str) -> None:
        self._retry.pop(uid, None)
