"""A moto S3 server on 127.0.0.1 in its own process (so it does not share the benchmark's GIL)
that counts bytes at the server: request bodies received (uploads) and response bodies sent
(downloads). ``GET /__bytes__`` answers ``{"up": N, "down": N, "requests": N}``.

Run: ``python benchmarks/_objstore/server.py PORT``; it prints ``ready`` when it serves."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

COUNTS = {"up": 0, "down": 0, "requests": 0}
_LOCK = threading.Lock()


class _Counted:
    def __init__(self, stream: Any) -> None:
        self._s = stream

    def read(self, *a: Any) -> bytes:
        data = self._s.read(*a)
        with _LOCK:
            COUNTS["up"] += len(data)
        return data

    def readline(self, *a: Any) -> bytes:
        data = self._s.readline(*a)
        with _LOCK:
            COUNTS["up"] += len(data)
        return data

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.readline, b"")


def counting(app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
    def wrapped(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == "/__bytes__":
            with _LOCK:
                body = json.dumps(COUNTS).encode()
            start_response("200 OK", [("Content-Type", "application/json")])
            return [body]
        with _LOCK:
            COUNTS["requests"] += 1
        environ["wsgi.input"] = _Counted(environ["wsgi.input"])
        out = app(environ, start_response)

        def body() -> Iterator[bytes]:
            for piece in out:
                with _LOCK:
                    COUNTS["down"] += len(piece)
                yield piece

        return body()

    return wrapped


def main() -> None:
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(k, "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=int(sys.argv[1]), verbose=False)
    server.start()
    srv = server._server  # werkzeug's server: each request looks its app up here
    assert srv is not None
    srv.app = counting(srv.app)
    print("ready", flush=True)
    sys.stdin.read()  # runs until the benchmark closes our stdin
    server.stop()


if __name__ == "__main__":
    main()
