"""How `kvgrid serve` takes its HTTP port: it refuses a port something listens on, holds the port from that check
until its gateway replicas have bound it (so no outgoing connection of the starting server can take it as its
local port). That a failed gateway deployment says why: tests/test_frontend_placement.py."""

from __future__ import annotations

import errno
import selectors
import socket

import pytest

from harness import free_port
from router.gateway.server import PortInUse, listen, reserve_port

HOST = "127.0.0.1"


def _plain_bind(port: int) -> None:
    """Bind ``port`` the way the kernel's choice of a connection's local port treats it (no reuse options)."""
    with socket.socket() as s:
        s.bind((HOST, port))


@pytest.mark.parametrize("shared", [False, True])
def test_a_port_something_listens_on_is_refused(shared):
    port = free_port()
    with listen(HOST, port, shared=shared):  # shared: an earlier kvgrid's gateway replica
        with pytest.raises(PortInUse, match=f"{port} is in use"):
            reserve_port(HOST, port)


def test_a_held_port_is_taken_by_nothing_else_but_the_gateway_replicas():
    port = free_port()
    hold = reserve_port(HOST, port)
    try:
        with pytest.raises(OSError) as exc:
            _plain_bind(port)
        assert exc.value.errno == errno.EADDRINUSE
        replicas = [listen(HOST, port), listen(HOST, port)]  # two replicas of one node share the port
        with socket.create_connection((HOST, port), timeout=5) as client:
            client.sendall(b"x")
            with selectors.DefaultSelector() as sel:  # the connection went to a listening replica, not the hold
                for r in replicas:
                    sel.register(r, selectors.EVENT_READ)
                assert sel.select(timeout=5)
        for r in replicas:
            r.close()
    finally:
        hold.close()
    _plain_bind(port)  # released
