"""free_port: ports for servers about to start, out of the way of outgoing connections."""

from __future__ import annotations

import collections
import socket
from pathlib import Path

from draplane.localenv import processes
from draplane.localenv.processes import LISTEN_PORTS_FROM, free_port, listen_port_range


def _range_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "ip_local_port_range"
    path.write_text(text)
    return path


def test_ports_are_drawn_below_the_ephemeral_range_and_never_given_twice(tmp_path: Path):
    ranges = _range_file(tmp_path, "32768\t60999\n")
    ports = [free_port(ephemeral_range_file=ranges) for _ in range(500)]
    assert all(LISTEN_PORTS_FROM <= p < 32768 for p in ports)
    assert len(set(ports)) == len(ports)


def test_a_port_in_use_is_not_given(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(processes, "_recently_given", collections.deque(maxlen=4096))
    ranges = _range_file(tmp_path, f"{LISTEN_PORTS_FROM + 1000} 60999\n")  # 1,000 ports to draw from
    with socket.socket() as taken:
        for busy in range(LISTEN_PORTS_FROM, LISTEN_PORTS_FROM + 1000):
            try:
                taken.bind(("127.0.0.1", busy))
                break
            except OSError:
                continue
        taken.listen()
        ports = [free_port(ephemeral_range_file=ranges) for _ in range(900)]
    assert busy not in ports
    assert all(LISTEN_PORTS_FROM <= p < LISTEN_PORTS_FROM + 1000 for p in ports)
    for port in ports[:20]:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))  # free when given


def test_an_unreadable_or_crowded_range_leaves_the_choice_to_the_kernel(tmp_path: Path):
    for text in ("", "not a number\n", "1024 65535\n", f"{LISTEN_PORTS_FROM + 999} 60999\n"):
        ranges = _range_file(tmp_path, text)
        assert listen_port_range(ranges) is None
        port = free_port(ephemeral_range_file=ranges)
        assert 0 < port < 65536
    assert listen_port_range(tmp_path / "missing") is None
    assert listen_port_range(_range_file(tmp_path, "32768 60999")) == (LISTEN_PORTS_FROM, 32767)
