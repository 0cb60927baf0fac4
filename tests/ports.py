"""Ports for servers that a test starts but cannot hand an open socket: chosen below the OS's ephemeral range.

A port found with ``bind(("127.0.0.1", 0))`` is released before the server binds it, and in the seconds in
between (a torchrun imports torch first) any process that binds port 0 or connects out may be handed the same
number by the OS: on CI the other leg's ranks, stores and browsers do so all the time. A port below
``ip_local_port_range`` is never handed out that way, so only a server that asks for that very number can
take it, and the random choice makes two tests asking at once unlikely to pick the same one.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 10000  # below this sit well-known services (and 9000s of other test tools)


def ephemeral_range() -> tuple[int, int]:
    """The OS's range for port 0 and outgoing connections (Linux's default where it cannot be read)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def unclaimed_port(host: str = "127.0.0.1") -> int:
    """A free TCP port on ``host`` that the OS will not give to anyone who does not ask for it by number."""
    low, high = ephemeral_range()
    candidates = [p for p in range(LOWEST, 65536) if not low <= p <= high]
    for port in random.SystemRandom().sample(candidates, 200):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port outside the ephemeral range {low}-{high} after 200 tries")
