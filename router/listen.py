"""The router's listening socket, with Nagle's algorithm off.

uvicorn binds with ``socket.socket(AF_INET, SOCK_STREAM)`` (``proto == 0``), and asyncio
only sets ``TCP_NODELAY`` on transports whose socket says ``IPPROTO_TCP``, so a response
written as headers then a small body chunk can wait for the client's delayed ACK (~40 ms
per streamed response).  Binding here with ``IPPROTO_TCP`` and ``TCP_NODELAY`` on the
listener fixes it for every accepted connection (Linux inherits the option on accept,
and asyncio sets it again because ``proto`` is TCP).
"""

from __future__ import annotations

import socket

__all__ = ["bind_socket"]


def bind_socket(host: str, port: int, *, backlog: int = 2048, reuse_port: bool = False,
                listen: bool = True) -> socket.socket:
    """A TCP socket on ``host:port`` (port 0 picks one) with ``TCP_NODELAY``, listening
    unless ``listen`` is false (a port reservation).  ``reuse_port`` sets ``SO_REUSEPORT``,
    so that several processes share the port (``kvroute serve --workers``)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP,
                               flags=socket.AI_PASSIVE)
    family, type_, proto, _, addr = infos[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(addr)
        if listen:
            sock.listen(backlog)
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock
