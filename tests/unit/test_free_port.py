"""The test harness's free ports: drawn below the kernel's ephemeral range, where no outgoing
connection of another process can take one between the draw and the server's bind."""

from __future__ import annotations

import socket

import pytest

from spotrl_e2e import procs


def test_free_ports_are_below_the_ephemeral_range_and_above_rays_worker_ports() -> None:
    low = procs._ephemeral_ports_from()
    ports = {procs.free_port() for _ in range(50)}
    assert all(procs.FREE_PORTS_FROM <= p < low for p in ports), sorted(ports)
    assert len(ports) > 40, "drawn at random, not one port again and again"


def test_a_free_port_can_be_bound_and_a_bound_one_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", procs.FREE_PORTS_FROM))
        draws = iter([procs.FREE_PORTS_FROM, procs.FREE_PORTS_FROM, procs.FREE_PORTS_FROM + 1])

        class Fixed:
            def randrange(self, start: int, stop: int) -> int:
                return next(draws)

        monkeypatch.setattr(procs.random, "SystemRandom", Fixed)
        port = procs.free_port()
    assert port == procs.FREE_PORTS_FROM + 1
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))
