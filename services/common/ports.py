"""Free TCP ports for services started on this machine (the launcher, benches, tests).

A port the OS hands out for `bind(0)` comes from the ephemeral range
(/proc/sys/net/ipv4/ip_local_port_range, 32768-60999 by default), the same range it takes the
source ports of outgoing connections from. Between choosing such a port and the child process
binding it, any connection this machine opens (a gRPC channel, a health check) can take it, and
the child fails with "Address already in use" (seen about once in 30 bench runs). So
`free_port` picks at random below the ephemeral range, where only an explicit bind can take a
port, checks that nothing listens there, and never hands the same port out twice in one
process. Where no such port is found it falls back to the OS's choice.
"""

from __future__ import annotations

import random
import socket
import threading

_LOWEST = 10000  # below: well-known and registered services' usual ports
_DEFAULT_EPHEMERAL_LOW = 32768
_ATTEMPTS = 64

_lock = threading.Lock()
_handed_out: set[tuple[str, int]] = set()
_random = random.SystemRandom()


def ephemeral_low() -> int:
    """The lowest port of the OS's ephemeral range (Linux), else the usual 32768."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as handle:
            return int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _DEFAULT_EPHEMERAL_LOW


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listened on a moment ago (see the module docstring)."""
    high = ephemeral_low()
    with _lock:
        if high - _LOWEST > _ATTEMPTS:
            for _ in range(_ATTEMPTS):
                port = _random.randrange(_LOWEST, high)
                if (host, port) not in _handed_out and _bindable(host, port):
                    _handed_out.add((host, port))
                    return port
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        _handed_out.add((host, port))
        return port


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
