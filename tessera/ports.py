"""Loopback ports for daemons and rendezvous that are told their port (stdlib only).

``free_ports(n)`` / ``free_port()`` pick ports that a daemon started with ``--listen``,
or a ``torch.distributed`` rendezvous (``MASTER_PORT``), binds a moment later. Nothing
holds a port in between, so the choice avoids where other sockets land by themselves:
the kernel's ephemeral range (see ``free_ports``).
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["ephemeral_range", "free_port", "free_ports"]


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free on ``host`` a moment ago (see ``free_ports``)."""
    return free_ports(1, host)[0]


# Ports this process has handed out (most recent last): a daemon told to listen on one
# may take a second or two to bind it, and a later call must not hand it out again.
_HANDED: list[int] = []
_HANDED_MAX = 4096
_LOW_PORT = 10000  # below: well-known and registered services


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ephemeral ports (``net.ipv4.ip_local_port_range``), from
    which it takes the local port of every outgoing connection and of ``bind(port 0)``;
    Linux's default where it cannot be read."""
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[:2])
        if 0 < lo <= hi <= 65535:
            return lo, hi
    except (OSError, ValueError):
        pass
    return 32768, 60999


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """Return ``n`` distinct ports that were free on ``host`` a moment ago, for daemons
    started with ``--listen`` (the caller passes the port on; nothing holds it meanwhile).

    Picked at random *outside* the kernel's ephemeral range (``ephemeral_range``) and
    above ``_LOW_PORT``, each checked by binding it (all held open while choosing), and
    never one this process handed out recently. A port the kernel picked (``bind`` to
    port 0) lies inside the ephemeral range, where any outgoing connection of any
    process — a gRPC client's, etcd's — may take it between this call and the daemon's
    bind: the testbed's controller once failed to start with "Address already in use"
    that way. Outside the range only another explicit binder can take it. Falls back to
    the kernel's choice when the range outside leaves too few candidates."""
    lo, hi = ephemeral_range()
    spans = [(a, b) for a, b in ((_LOW_PORT, lo - 1), (hi + 1, 65535)) if b - a >= 1000]
    room = sum(b - a + 1 for a, b in spans)
    socks: list[socket.socket] = []
    ports: list[int] = []
    recent = set(_HANDED)
    rng = random.SystemRandom()
    try:
        tries = 0
        while len(ports) < n:
            tries += 1
            if spans and tries <= 50 * n:
                port = _nth(spans, rng.randrange(room))  # uniform over both spans
                if port in recent or port in ports:
                    continue
            else:
                port = 0  # the kernel's choice (inside the ephemeral range)
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                if port == 0:  # not a busy port: this host cannot bind there at all
                    raise
                continue
            if s.getsockname()[1] in ports:
                s.close()
                continue
            socks.append(s)
            ports.append(s.getsockname()[1])
        _HANDED.extend(ports)
        del _HANDED[:-_HANDED_MAX]
        return ports
    finally:
        for s in socks:
            s.close()


def _nth(spans: list[tuple[int, int]], i: int) -> int:
    """The ``i``-th port (0-based) of the inclusive ``spans`` taken in order."""
    for a, b in spans:
        if i <= b - a:
            return a + i
        i -= b - a + 1
    raise IndexError(i)
