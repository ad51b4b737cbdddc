"""A Ray cluster's address, checked before Ray is imported or a job planned: `auto`, `HOST:PORT` (the cluster's GCS) or
`ray://HOST:PORT` (its Ray client server), answered by a real handshake within CONNECT_TIMEOUT_S (docs/scale-out.md).
Standard library only: the job command checks an address given on its command line before anything heavy."""

from __future__ import annotations

import importlib.util
import socket
import threading
import time
from typing import Any
from urllib.parse import urlsplit

from pipelines.console.redact import without_credentials
from pipelines.errors import InputError

ADDRESS_FIELD = "--ray-address"
CONNECT_TIMEOUT_S = 5.0
MAX_ADDRESS_CHARS = 300  # a host name is at most 253 characters
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_SETTINGS = 0x4
_SETTINGS_FRAME = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # length 0, type SETTINGS, no flags, stream 0


def check_address(address: str, field: str = ADDRESS_FIELD) -> None:
    """`auto`, `host:port` (the cluster's GCS) or `ray://host:port` (its Ray client server), checked in at most
    CONNECT_TIMEOUT_S by a real handshake: both are gRPC servers, which answer HTTP/2's connection preface with
    their SETTINGS at once. A listener that accepts and never answers, or answers another protocol, is refused, as
    is an address that is not one (whitespace or control characters, a trailing newline, thousands of characters)."""
    if len(address) > MAX_ADDRESS_CHARS or not address.isprintable() or any(char.isspace() for char in address):
        shown = repr(address if len(address) <= 80 else address[:77] + "...")
        why = f"{len(address):,} characters" if len(address) > MAX_ADDRESS_CHARS else "whitespace or a control character in it"
        raise InputError(f"not a Ray address (auto, HOST:PORT or ray://HOST:PORT): {shown}: {why}", field=field)
    if address == "auto":
        return
    try:  # urlsplit itself refuses an unclosed IPv6 bracket; .port a port that is no number or out of range
        parts = urlsplit(address if "://" in address else f"tcp://{address}")
        host, port = parts.hostname, parts.port
    except ValueError:
        parts, host, port = urlsplit(""), None, None
    if parts.scheme not in ("tcp", "ray") or not host or port is None or parts.path or parts.query or parts.fragment:
        raise InputError(f"not a Ray address (auto, HOST:PORT or ray://HOST:PORT): {without_credentials(address)!r}", field=field)
    if parts.scheme == "ray" and importlib.util.find_spec("grpc") is None:
        raise InputError(f"{address}: a ray:// address needs the Ray client (ray[client], which brings grpcio), not installed in this "
                         "environment; give the cluster's GCS address HOST:PORT instead (docs/scale-out.md)", field=field)
    try:
        handshake(host, port, CONNECT_TIMEOUT_S)
    except OSError as error:
        raise InputError(f"the Ray cluster at {address} is unreachable: {error.strerror or error}", field=field) from None


def handshake(host: str, port: int, timeout_s: float) -> None:
    """HTTP/2's client preface and an empty SETTINGS frame; the server's first frame must be its SETTINGS (RFC 9113, 3.4).
    Name resolution, connection and answer share one deadline (OSError: TimeoutError, refused, not HTTP/2...)."""
    deadline = time.monotonic() + timeout_s
    address = _resolve(host, port, timeout_s)
    with socket.socket(address[0], socket.SOCK_STREAM) as connection:
        connection.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            connection.connect(address[4])
            connection.sendall(_HTTP2_PREFACE + _SETTINGS_FRAME)
            header = b""
            while len(header) < 9:
                connection.settimeout(max(0.01, deadline - time.monotonic()))
                chunk = connection.recv(9 - len(header))
                if not chunk:
                    raise ConnectionError("the connection was closed without an answer")
                header += chunk
        except TimeoutError:
            raise TimeoutError(f"no answer to a gRPC (HTTP/2) handshake within {timeout_s:g} s") from None
    if header[3] != _SETTINGS or header[5:9] != bytes(4):
        raise ConnectionError("the server does not speak gRPC (HTTP/2): not a Ray GCS or client server")


def _resolve(host: str, port: int, timeout_s: float) -> tuple:
    """getaddrinfo's first TCP address, in a daemon thread: a resolver that hangs cannot hold the command past the deadline."""
    found: list[Any] = []
    resolver = threading.Thread(target=lambda: found.append(_getaddrinfo(host, port)), daemon=True)
    resolver.start()
    resolver.join(timeout_s)
    if not found:
        raise TimeoutError(f"{host!r} did not resolve within {timeout_s:g} s")
    if isinstance(found[0], OSError):
        raise found[0]
    return found[0]


def _getaddrinfo(host: str, port: int) -> tuple | OSError:
    try:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (OSError, UnicodeError) as error:  # UnicodeError: a label the IDNA codec refuses
        return error if isinstance(error, OSError) else OSError(f"not a host name ({error})")
