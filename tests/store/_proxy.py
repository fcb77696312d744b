"""A fault-injecting HTTP/1.1 proxy on 127.0.0.1 in front of the S3 test server.

Point s3fs at ``proxy.endpoint`` instead of the server's; every connection then behaves as
``proxy.mode`` says when it is accepted, and every request as ``proxy.rule(method, path)`` says
(the first matching fault wins; set both at any time, they apply to what comes next):

- ``"pass"``: forward the request and its response.
- ``"reset"``: close the connection with a TCP reset at once (a store that drops connections).
- ``"blackhole"`` (connection mode): accept and never read (a half-dead NAT or load balancer);
  the receive buffer is small, so a part upload blocks in its first few hundred KiB.
- ``"blackhole"`` (request action): read the request's head, never its body (a peer that
  stops reading mid-request: the client's send blocks).
- ``"stall"``: read the request, forward nothing and answer nothing (a store that stalls).
- ``"lose"``: forward the request, read the whole response, drop it and reset the connection
  (the store did the work; the answer was lost).
- ``"flip"``: forward the request and answer with one byte of the response body flipped.

Requests are parsed (``Content-Length`` or chunked bodies; the proxy answers ``Expect:
100-continue`` itself), so a fault hits one request of a keep-alive connection. ``proxy.seen`` lists ``(method, path, action)`` of every request.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from typing import BinaryIO

Rule = Callable[[str, str], str]


def _pass(method: str, path: str) -> str:
    return "pass"


def once(action: str, method: str, path_part: str) -> Rule:
    """A rule: ``action`` for the first request of ``method`` whose path contains
    ``path_part``, ``"pass"`` for every other."""
    left = [1]
    lock = threading.Lock()

    def rule(m: str, p: str) -> str:
        with lock:
            if left[0] and m == method and path_part in p:
                left[0] -= 1
                return action
        return "pass"

    return rule


class FaultProxy:
    """See the module docstring. A context manager; ``stop`` closes every connection."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.split("://", 1)[-1].rsplit(":", 1)
        self._upstream = (host, int(port))
        self.mode = "pass"
        self.rule: Rule = _pass
        self.seen: list[tuple[str, str, str]] = []
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 10)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self._listener.settimeout(0.1)  # accept wakes to see stop()
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._thread = threading.Thread(target=self._accept, daemon=True, name="fault-proxy")
        self._thread.start()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            with contextlib.suppress(OSError):
                s.close()
        self._thread.join(5)

    def _keep(self, s: socket.socket) -> None:
        with self._lock:
            self._socks.append(s)

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            self._keep(client)
            mode = self.mode
            if mode == "reset":
                _reset(client)
            elif mode != "blackhole":  # blackhole: kept open, never read
                threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        uin: BinaryIO | None = None
        cin = client.makefile("rb")
        try:
            while not self._stopped.is_set():
                got = _read_head(cin)
                if got is None:
                    return
                lines, headers = got
                method, path = (x.decode() for x in lines[0].split(b" ", 2)[:2])
                mode = self.mode  # a connection mode applies to pooled connections too
                action = mode if mode in ("reset", "blackhole") else self.rule(method, path)
                self.seen.append((method, path, action))
                if action == "reset":
                    _reset(client)
                    return
                if headers.get(b"expect", b"").lower() == b"100-continue":
                    # answered here, and not passed on: the upstream sends no interim answer
                    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                    lines = [ln for ln in lines if not ln.lower().startswith(b"expect:")]
                if action == "blackhole":  # never read the body (the client's send blocks)
                    self._stopped.wait()
                    return
                head, body = b"".join(lines), _read_body(cin, headers)
                if action == "stall":
                    self._stopped.wait()
                    return
                if upstream is None or uin is None:
                    upstream = socket.create_connection(self._upstream, timeout=30)
                    self._keep(upstream)
                    uin = upstream.makefile("rb")
                upstream.sendall(head + body)
                while True:  # skip interim (1xx) answers
                    rhead, rbody = _read_response(uin, no_body=method == "HEAD")
                    if rhead is None:
                        return
                    if not rhead.split(b" ", 2)[1].startswith(b"1"):
                        break
                if action == "lose":
                    _reset(client)
                    return
                if action == "flip" and rbody:
                    i = len(rbody) // 2
                    rbody = rbody[:i] + bytes([rbody[i] ^ 0x01]) + rbody[i + 1 :]
                client.sendall(rhead + rbody)
        except OSError:
            return
        finally:
            for s in (client, upstream):
                if s is not None:
                    with contextlib.suppress(OSError):
                        s.close()


def _reset(s: socket.socket) -> None:
    """Close ``s`` with a TCP reset (linger 0), not a clean FIN."""
    with contextlib.suppress(OSError):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()


def _read_head(f: BinaryIO) -> tuple[list[bytes], dict[bytes, bytes]] | None:
    """The head of one HTTP/1.1 message from ``f`` (its lines, the blank one last) and its
    headers (lower-case names); None at end of stream."""
    lines: list[bytes] = []
    while True:
        line = f.readline(65536)
        if not line:
            return None
        lines.append(line)
        if line in (b"\r\n", b"\n") and len(lines) > 1:
            return lines, dict(_headers(lines[1:-1]))


def _read_body(f: BinaryIO, headers: dict[bytes, bytes]) -> bytes:
    """The body of a message with ``headers`` as sent, chunked framing included."""
    if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
        return b"".join(_chunks(f))
    n = int(headers.get(b"content-length", b"0"))
    return f.read(n) if n else b""


def _read_response(f: BinaryIO, *, no_body: bool) -> tuple[bytes | None, bytes]:
    """One response from ``f``: (its head, its body); (None, b"") at end of stream."""
    got = _read_head(f)
    if got is None:
        return None, b""
    lines, headers = got
    code = lines[0].split(b" ", 2)[1]
    if no_body or code[:1] == b"1" or code in (b"204", b"304"):
        return b"".join(lines), b""
    return b"".join(lines), _read_body(f, headers)


def _headers(lines: list[bytes]) -> Iterator[tuple[bytes, bytes]]:
    for line in lines:
        name, _, value = line.partition(b":")
        yield name.strip().lower(), value.strip()


def _chunks(f: BinaryIO) -> Iterator[bytes]:
    while True:
        size_line = f.readline(65536)
        yield size_line
        n = int(size_line.split(b";")[0].strip() or b"0", 16)
        if n == 0:
            while True:  # trailers, then the blank line
                t = f.readline(65536)
                yield t
                if t in (b"\r\n", b"\n", b""):
                    return
        yield f.read(n + 2)
