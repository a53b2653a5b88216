"""How `kvgrid serve` takes its HTTP port: it refuses a port something listens on, holds the port from that check
until its gateway replicas have bound it (so no outgoing connection of the starting server can take it as its
local port). That a failed gateway deployment says why: tests/integration/test_frontend_placement.py."""

from __future__ import annotations

import errno
import selectors
import socket
import time

import httpx
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


def _get(sock: socket.socket) -> bytes:
    sock.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
    data = b""
    while b"pong" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def test_an_idle_connection_is_kept_for_keep_alive_s_then_closed():
    """A gateway replica's HTTP server keeps an idle keep-alive connection for ``http.keep_alive_s``, by default
    longer than the SDKs' own idle expiry (httpx's), so a client never sends on a connection the server is closing
    at that very moment (with uvicorn's default, equal to httpx's, CI saw the fuzz test get 2 connection errors in
    20,000 requests)."""
    from fastapi import FastAPI

    from common.config import HttpConfig
    from router.gateway.server import IngressServer

    assert HttpConfig().keep_alive_s > httpx.Limits().keepalive_expiry  # httpx's default: 5 s

    def make_app() -> FastAPI:
        app = FastAPI()
        app.get("/ping")(lambda: "pong")
        return app

    port = free_port()
    ingress = IngressServer(make_app, HOST, port, 16, keep_alive_s=2)
    try:
        with socket.create_connection((HOST, port), timeout=10) as sock:
            assert b"200 OK" in _get(sock)
            time.sleep(1.2)  # idle for less than keep_alive_s: still open
            assert b"200 OK" in _get(sock)
            time.sleep(3)  # idle for longer: the server closed it
            assert sock.recv(4096) == b""
    finally:
        ingress.stop()
