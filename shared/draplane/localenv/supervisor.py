"""What `draplane up` does when one of its processes dies: restart it with backoff, or give up.

A pure policy (no processes, no clock of its own), so that tests step it through crashes: `exited`
says when to start the process again, or that it cannot be kept alive; `started` records the start.
A process that stayed up for `stable_after` seconds is forgiven its earlier crashes.
"""

from __future__ import annotations

import collections
import dataclasses
import signal


@dataclasses.dataclass(frozen=True, slots=True)
class RestartPolicy:
    initial_delay: float = 1.0
    max_delay: float = 30.0
    # Up this long after a start: its next crash starts the backoff afresh.
    stable_after: float = 60.0
    # More crashes than this within `window` seconds: it cannot be kept alive.
    max_crashes: int = 5
    window: float = 600.0


@dataclasses.dataclass(frozen=True, slots=True)
class Restart:
    at: float
    delay: float
    crashes: int  # crashes within the window, this one included


@dataclasses.dataclass(frozen=True, slots=True)
class GiveUp:
    crashes: int
    window: float


def describe_exit(returncode: int | None) -> str:
    """`exit code 1`, `killed by SIGKILL`: how a process ended, as a person says it."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


class Supervision:
    """The restart history of one process."""

    def __init__(self, policy: RestartPolicy = RestartPolicy()):
        self.policy = policy
        self._crashes: collections.deque[float] = collections.deque()
        self._delay = 0.0
        self._started_at: float | None = None

    def started(self, now: float) -> None:
        self._started_at = now

    def exited(self, now: float) -> Restart | GiveUp:
        if self._started_at is not None and now - self._started_at >= self.policy.stable_after:
            self._delay = 0.0  # it ran well: this is a new problem, not the same one again
        self._started_at = None
        self._crashes.append(now)
        while self._crashes and now - self._crashes[0] > self.policy.window:
            self._crashes.popleft()
        if len(self._crashes) > self.policy.max_crashes:
            return GiveUp(crashes=len(self._crashes), window=self.policy.window)
        self._delay = self.policy.initial_delay if self._delay == 0.0 else min(self.policy.max_delay, self._delay * 2)
        return Restart(at=now + self._delay, delay=self._delay, crashes=len(self._crashes))
