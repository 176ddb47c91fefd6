"""Child server processes that never outlive us and say clearly why they did not start."""

from __future__ import annotations

import collections
import ctypes
import errno
import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable

_PR_SET_PDEATHSIG = 1


class StartupError(RuntimeError):
    """A server could not be started. The message names the server and the reason."""


def _die_with_parent() -> None:
    # If the Python process is killed (kill -9, a CI timeout), the kernel kills the server too:
    # that is what keeps a crashed test run from leaving orphans holding ports.
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


# Where listening ports are drawn from when the kernel's ephemeral range leaves room below it.
LISTEN_PORTS_FROM = 10000
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Ports handed out lately, not handed out again: a server given one may not have bound it yet.
_RECENTLY_GIVEN_LIMIT = 4096
_recently_given: collections.deque[int] = collections.deque(maxlen=_RECENTLY_GIVEN_LIMIT)


def listen_port_range(ephemeral_range_file: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int] | None:
    """The ports below the kernel's ephemeral range, from LISTEN_PORTS_FROM; None when there are
    too few there (or the range cannot be read), and the kernel's own choice must do."""
    try:
        ephemeral_low = int(ephemeral_range_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if ephemeral_low - LISTEN_PORTS_FROM < 1000:
        return None
    return LISTEN_PORTS_FROM, ephemeral_low - 1


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", *, ephemeral_range_file: Path = EPHEMERAL_RANGE_FILE) -> int:
    """A port nothing listens on now, for a server about to start.

    Drawn below the kernel's ephemeral range: a port there is never taken by an outgoing
    connection between this call and the server's bind. The kernel's own choice (bind to port 0)
    is in that range, and CI saw a NATS cluster member fail to start with "address already in
    use" on such a port, taken meanwhile by a route its peers opened."""
    ports = listen_port_range(ephemeral_range_file)
    if ports is not None:
        for _ in range(200):
            port = random.randint(*ports)
            if port not in _recently_given and _bindable(host, port):
                _recently_given.append(port)
                return port
    while True:  # no room below the ephemeral range, or it is all taken: the kernel chooses
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port not in _recently_given:
            _recently_given.append(port)
            return port


def ensure_port_free(port: int, what: str, host: str = "127.0.0.1") -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise StartupError(
                    f"{what}: port {port} on {host} is already in use by another process; "
                    f"stop that process or choose another port"
                ) from None
            raise


class ServerProcess:
    """One server binary run as a child process, its output in a log file."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.env = env
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        try:
            self.process = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,  # Ctrl-C in a terminal reaches us, and we stop it in order
                preexec_fn=_die_with_parent,
            )
        except OSError as exc:
            raise StartupError(f"{self.name}: cannot execute {self.argv[0]}: {exc.strerror}") from None
        finally:
            log.close()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, probe: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                code = self.process.returncode if self.process else None
                raise StartupError(
                    f"{self.name} exited with code {code} while starting (log: {self.log_path}):\n{self.log_tail()}"
                )
            try:
                if probe():
                    return
            except Exception:  # not listening yet; anything else shows up in the log
                pass
            time.sleep(0.1)
        self.stop()
        raise StartupError(
            f"{self.name} did not become ready within {timeout:.0f}s (log: {self.log_path}):\n{self.log_tail()}"
        )

    def terminate(self) -> None:
        """SIGTERM without waiting, so that many processes can shut down at once."""
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def stop(self, timeout: float = 10.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.terminate()
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # It ignored SIGTERM: escalate, so that shutdown always finishes.
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(timeout=timeout)

    def kill(self) -> None:
        """SIGKILL, for crash tests."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
