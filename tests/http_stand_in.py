"""A stand-in HTTP server on loopback, in the test's own process: each GET or POST is answered by a function of the
request (the path, the headers, the body read), so a test says what a route, a vLLM server or a proxy's upstream answers."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Request:
    path: str
    headers: dict[str, str]
    body: bytes


Answer = Callable[[Request], tuple[int, bytes]]


class HttpStandIn:
    """Threaded, HTTP/1.1 (kept-alive connections), one port of its own; close() when done."""

    def __init__(self, answer: Answer):
        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                status, data = answer(Request(path=self.path, headers=dict(self.headers), body=body))
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
