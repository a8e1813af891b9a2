"""Raw HTTP/1.1 over a socket, for requests no HTTP client would send."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit


def connect(url: str, timeout: float = 10) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 80), timeout)
    sock.settimeout(timeout)
    return sock


def read_answer(
    sock: socket.socket, *, to_head: bool = False, pending: bytearray | None = None
) -> tuple[int, bytes]:
    """The status and body of one answer (by its content-length, or to the connection's end);
    `to_head`: the answer to a HEAD request, which has no body whatever its content-length says.
    `pending`: for several answers read from one connection (pipelined requests), the bytes read
    past an answer, where the next one starts: taken first, and what is read past this one left."""
    received = b""
    if pending is not None:
        received, pending[:] = bytes(pending), b""
    while b"\r\n\r\n" not in received:
        chunk = sock.recv(65536)
        if not chunk:
            break
        received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    if not head:
        return 0, b""
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    length = None
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    if to_head:
        length = 0
    while length is None or len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    if length is None:
        return status, body
    if pending is not None:
        pending.extend(body[length:])
    return status, body[:length]


def exchange(url: str, raw: bytes, timeout: float = 10) -> tuple[int, bytes]:
    """Send `raw` on a new connection; the answer's status and body (0 when none came)."""
    with connect(url, timeout) as sock:
        sock.sendall(raw)
        try:
            return read_answer(sock, to_head=raw.lstrip(b"\r\n").startswith(b"HEAD "))
        except ConnectionResetError:
            return 0, b""


def closed(sock: socket.socket) -> bool:
    """Whether the server has closed `sock` (read to its end, within the socket's timeout)."""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
