"""free_port: below the ephemeral range, never a listening port, never the same one twice."""

from __future__ import annotations

import socket

from services.common import ports


def test_ports_come_from_below_the_ephemeral_range_and_are_not_repeated() -> None:
    low = ports.ephemeral_low()
    chosen = [ports.free_port() for _ in range(50)]
    assert len(set(chosen)) == len(chosen)
    assert all(10000 <= port < low for port in chosen)
    for port in chosen[:5]:  # each can really be bound
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_something_listens_on_is_skipped(monkeypatch) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        busy = listener.getsockname()[1]
        monkeypatch.setattr(ports, "ephemeral_low", lambda: 65536)
        picks = iter([busy, busy, 23456])
        monkeypatch.setattr(ports._random, "randrange", lambda low, high: next(picks))
        ports._handed_out.discard(("127.0.0.1", 23456))
        assert ports.free_port() == 23456


def test_without_room_below_the_range_the_os_chooses(monkeypatch) -> None:
    monkeypatch.setattr(ports, "ephemeral_low", lambda: 10010)
    port = ports.free_port()
    assert port > 0
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
