"""The driver's HTTP server: authentication, body limits, timeouts, connection caps.

The server knows nothing of heartbeats: it hands authenticated, size-checked requests
to an :class:`App` (the driver) and turns every failure of a client into a refusal
counted under a reason, never into a dead thread or server. One thread serves one
connection (``ThreadingHTTPServer``); every socket read has a timeout, and a request's
head and its body each have a deadline, so a slow or silent client holds only its own
thread, and only for a while; past ``max_connections`` new connections are closed at
once.

Requests are parsed here rather than by ``BaseHTTPRequestHandler.parse_request``, which
reads headers through the ``email`` package: HTTP/1.0 and 1.1 only, header lines of
at most 64 KiB, at most 100 of them, no folded lines. A reply goes out in one write.
With both, a connection's thread serves a heartbeat in 0.10 ms of CPU instead of 0.14
(a driver without detectors, the body's parsing included; 2026-12-07): the driver
shares the ranks' cores on the node that hosts it.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
import selectors
import socket
import threading
import time
import urllib.parse
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, HTTPServer, ThreadingHTTPServer
from typing import Any, Protocol

from ms_health import _host
from ms_health.record import MAX_BODY_BYTES

__all__ = ["App", "Response", "Server", "json_response"]

_log = logging.getLogger("ms_health.driver")

#: (HTTP status, body, content type)
Response = tuple[int, bytes, str]

#: The longest request or header line read, and the most header lines (the stdlib's).
MAX_LINE_BYTES = 65536
MAX_HEADERS = 100
#: An HTTP version: its major and minor numbers.
_VERSION = re.compile(r"HTTP/([0-9]{1,9})\.([0-9]{1,9})")


def json_response(status: int, obj: Any) -> Response:
    return status, json.dumps(obj, separators=(",", ":")).encode(), "application/json"


class App(Protocol):
    """What the server serves."""

    get_paths: frozenset[str]
    post_paths: frozenset[str]

    def check_token(self, presented: bytes) -> bool: ...

    def rejected(self, reason: str, client: str, detail: str) -> None: ...

    def get(self, path: str, query: dict[str, list[str]]) -> Response: ...

    def post(self, path: str, body: bytes, client: str) -> Response: ...


class Server(ThreadingHTTPServer):
    """A threading HTTP server bound to ``(host, port)`` that serves ``app``."""

    daemon_threads = True
    allow_reuse_address = True  # a restarted driver takes its old port at once
    request_queue_size = 128

    def __init__(
        self, host: str, port: int, app: App, *, io_timeout_s: float, max_connections: int
    ) -> None:
        if ":" in host:
            self.address_family = socket.AF_INET6
        self.app = app
        self.io_timeout_s = io_timeout_s
        self.max_connections = max_connections
        self._conn_lock = threading.Lock()
        self._open: set[socket.socket] = set()
        # serve_forever() sleeps until a connection comes or shutdown() writes here:
        # socketserver's loop wakes every poll_interval to look for a shutdown. Made
        # before the bind, whose failure calls server_close().
        self._wake_r, self._wake_w = socket.socketpair()
        self._loop_lock = threading.Lock()  # orders serve_forever's start and shutdown
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._stopped.set()
        super().__init__((host, port), _Handler)

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """Serve until :meth:`shutdown`; idle, the thread sleeps (``poll_interval`` is
        ignored: nothing is polled). Once shut down, a server does not serve again."""
        with self._loop_lock:
            if self._stopping.is_set():
                return  # shut down before the loop began: the sockets may be closed
            self._stopped.clear()
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(self, selectors.EVENT_READ)
                selector.register(self._wake_r, selectors.EVENT_READ)
                while not self._stopping.is_set():
                    ready = selector.select()
                    if self._stopping.is_set():
                        break
                    if any(key.fileobj is self for key, _ in ready):
                        # what socketserver's own loop calls (not in typeshed's stubs)
                        self._handle_request_noblock()  # type: ignore[attr-defined]
                    self.service_actions()
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop :meth:`serve_forever` and wait until it has returned (at once when it
        never began)."""
        with self._loop_lock:
            self._stopping.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")
        self._stopped.wait()

    def server_close(self) -> None:
        super().server_close()
        for end in (self._wake_r, self._wake_w):
            end.close()

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves the host's FQDN, a DNS query that can stall.
        super(HTTPServer, self).server_bind()
        host, port = self.server_address[:2]
        self.server_name = str(host)
        self.server_port = int(port)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._conn_lock:
            full = len(self._open) >= self.max_connections
            if not full:
                self._open.add(request)
        if full:
            self.app.rejected("busy", str(client_address[0]), "too many open connections")
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._conn_lock:
                self._open.discard(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # The handler catches what it expects; anything else is logged, never raised.
        _log.debug("ms-health: error serving %s", client_address, exc_info=True)

    def close_connections(self) -> None:
        """Cut every open connection, so that clients reconnect to whoever listens next
        rather than talk to a stopped driver's threads."""
        with self._conn_lock:
            sockets = list(self._open)
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a sender reuses its connection
    # Refusals of garbage get a status line too: nobody here speaks HTTP/0.9.
    default_request_version = "HTTP/1.1"
    server_version = "ms-health"
    sys_version = ""
    server: Server

    raw_requestline: bytes
    _head_deadline: float

    def setup(self) -> None:
        _host.name_thread("http")  # this connection's thread
        self.request.settimeout(self.server.io_timeout_s)  # every read and write
        if self.request.family in (socket.AF_INET, socket.AF_INET6):
            # A reply is one write, but a client's next request must not wait on
            # Nagle's algorithm for the ACK of a previous segment (40 ms on Linux).
            self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._client = str(self.client_address[0])
        self._served = 0
        super().setup()
        if not isinstance(self.rfile, io.BufferedReader):  # rbufsize -1: always one
            raise TypeError(f"a buffered reader is needed, got {type(self.rfile).__name__}")
        self._reader: io.BufferedReader = self.rfile

    # ---------------------------------------------------------------- plumbing

    def log_message(self, format: str, *args: Any) -> None:
        pass  # requests are counted in metrics; refusals become events

    def log_error(self, format: str, *args: Any) -> None:
        # BaseHTTPRequestHandler reports a request line that never came this way.
        if args and isinstance(args[0], TimeoutError):
            if self._served == 0:
                self.server.app.rejected("timeout", self._client, "no request before the timeout")
        else:
            _log.debug("ms-health: " + format, *args)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # Reached for what the stdlib parser refuses: garbage request lines, huge
        # headers, unknown methods. The connection is closed after it.
        reason = "bad_request"
        self.server.app.rejected(reason, self._client, f"HTTP {code}: {message or ''}")
        self._reply(*json_response(code, {"error": message or "bad request"}), close=True)

    def _reply(self, status: int, body: bytes, ctype: str, *, close: bool = False) -> None:
        phrase = self.responses[status][0] if status in self.responses else ""
        head = [
            f"HTTP/1.1 {status} {phrase}",
            f"Server: {self.server_version}",
            f"Date: {self.date_time_string()}",
            f"Content-Type: {ctype}",
            f"Content-Length: {len(body)}",
        ]
        if status == 401:
            head.append('WWW-Authenticate: Bearer realm="ms-health"')
        if close:
            self.close_connection = True
        if self.close_connection:  # asked for, HTTP/1.0, or a refusal that ends it
            head.append("Connection: close")
        try:
            self.wfile.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        except OSError:
            self.close_connection = True

    def handle_one_request(self) -> None:
        """Serve one request: the stdlib's, with the head read under a deadline."""
        try:
            # Waiting for a request to begin is bounded by the socket's timeout (an
            # idle kept-alive connection is closed after it); from its first byte, the
            # whole head must arrive within the same time.
            if not self._reader.peek(1):
                self.close_connection = True  # the client closed the connection
                return
            self._head_deadline = time.monotonic() + self.server.io_timeout_s
            self.raw_requestline = self._read_line()
            if not self.parse_request():
                return
            method = getattr(self, "do_" + self.command, None)
            if method is None:
                self.send_error(
                    HTTPStatus.NOT_IMPLEMENTED, f"unsupported method {self.command[:20]!r}"
                )
                return
            method()
        except TimeoutError as e:  # as the stdlib's: log_error counts it, then close
            self.log_error("Request timed out: %r", e)
            self.close_connection = True

    def _read_line(self) -> bytes:
        """One line of the head, at most ``MAX_LINE_BYTES + 1`` bytes (one more: too
        long), by reads that each wait at most the socket's timeout, none begun after
        the head's deadline: a client trickling bytes cannot hold the thread longer."""
        line = bytearray()
        while len(line) <= MAX_LINE_BYTES:
            if time.monotonic() > self._head_deadline:
                raise TimeoutError("the request's head did not arrive in time")
            ready = self._reader.peek(1)  # what is buffered, or one read of the socket
            if not ready:
                break  # the client closed the connection
            room = MAX_LINE_BYTES + 1 - len(line)
            end = ready.find(b"\n", 0, room)
            line += self._reader.read(end + 1 if end >= 0 else min(len(ready), room))
            if end >= 0:
                break
        return bytes(line)

    def parse_request(self) -> bool:
        """Parse the request line (in ``raw_requestline``) and read the headers; False
        after refusing the request (or on an empty line, which ends the connection)."""
        self.command = None  # type: ignore[assignment]  # as the stdlib's, before a refusal
        self.request_version = self.default_request_version
        self.close_connection = True
        raw_line: bytes = self.raw_requestline
        if len(raw_line) > MAX_LINE_BYTES:
            self.requestline = ""
            self.send_error(HTTPStatus.REQUEST_URI_TOO_LONG, "request line too long")
            return False
        line = str(raw_line, "iso-8859-1").rstrip("\r\n")
        self.requestline = line
        words = line.split()
        if not words:
            return False
        if len(words) != 3:
            self.send_error(HTTPStatus.BAD_REQUEST, f"bad request line {line[:100]!r}")
            return False
        command, path, version = words
        number = _VERSION.fullmatch(version)
        if number is None or int(number[1]) != 1:
            # a version this server does not speak (505), or not a version at all (400)
            code = (
                HTTPStatus.BAD_REQUEST if number is None else HTTPStatus.HTTP_VERSION_NOT_SUPPORTED
            )
            self.send_error(code, f"HTTP/1.0 or HTTP/1.1 only, got {version[:20]!r}")
            return False
        self.command, self.request_version = command, version
        # "//host/x" reads as a URL without a scheme to some clients: one slash (gh-87389)
        self.path = "/" + path.lstrip("/") if path.startswith("//") else path
        headers = _Headers()
        while True:
            raw = self._read_line()
            if len(raw) > MAX_LINE_BYTES:
                self.send_error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "header line too long")
                return False
            if raw in (b"\r\n", b"\n", b""):
                break
            if len(headers) >= MAX_HEADERS:
                self.send_error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "too many headers")
                return False
            text = str(raw, "iso-8859-1")
            name, colon, value = text.partition(":")
            if not colon or not name or name != name.strip() or text[0] in " \t":
                self.send_error(HTTPStatus.BAD_REQUEST, f"bad header line {text[:100]!r}")
                return False
            headers.add(name, value.strip())
        self.headers = headers  # type: ignore[assignment]  # get, get_all and in, as used
        connection = {
            t.strip().lower() for v in headers.get_all("Connection", []) or [] for t in v.split(",")
        }
        self.close_connection = "close" in connection or (
            version == "HTTP/1.0" and "keep-alive" not in connection
        )
        if (headers.get("Expect") or "").lower() == "100-continue" and version != "HTTP/1.0":
            return self.handle_expect_100()
        return True

    def _refuse(self, status: int, reason: str, detail: str, *, close: bool) -> None:
        self.server.app.rejected(reason, self._client, detail)
        self._reply(*json_response(status, {"error": detail}), close=close)

    # ---------------------------------------------------------------- requests

    def do_GET(self) -> None:
        self._serve(post=False)

    def do_POST(self) -> None:
        self._serve(post=True)

    def _serve(self, *, post: bool) -> None:
        self._served += 1
        try:
            self._serve_checked(post)
        except TimeoutError:
            self.server.app.rejected("timeout", self._client, "the body did not arrive in time")
            self.close_connection = True
        except OSError:
            self.close_connection = True
        except Exception as e:  # the app's bug must cost one request, not the thread
            _log.exception("ms-health: error serving %s %s", self.command, self.path)
            self._reply(
                *json_response(500, {"error": f"internal error: {type(e).__name__}"}), close=True
            )

    def _serve_checked(self, post: bool) -> None:
        app = self.server.app
        # A body this handler does not read would be parsed as the next request.
        unread_body = post or "Content-Length" in self.headers or self._chunked()
        auth = self.headers.get("Authorization")
        if auth is None:
            self._refuse(401, "unauthorized", "missing bearer token", close=unread_body)
            return
        scheme, _, presented = auth.partition(" ")
        if scheme.lower() != "bearer" or not app.check_token(presented.strip().encode("latin-1")):
            self._refuse(401, "unauthorized", "wrong bearer token", close=unread_body)
            return
        url = urllib.parse.urlsplit(self.path)
        paths = app.post_paths if post else app.get_paths
        if url.path not in paths:
            self._refuse(404, "not_found", f"no {self.command} {url.path[:100]}", close=unread_body)
            return
        if not post:
            query = urllib.parse.parse_qs(url.query, max_num_fields=16)
            self._reply(*app.get(url.path, query), close=unread_body)
            return
        body = self._read_body()
        if body is not None:
            self._reply(*app.post(url.path, body, self._client))

    def _chunked(self) -> bool:
        return "Transfer-Encoding" in self.headers

    def _read_body(self) -> bytes | None:
        """The body, or None after refusing the request (and closing the connection)."""
        raw = self.headers.get("Content-Length")
        if raw is None or self._chunked():
            self._refuse(411, "length_required", "Content-Length is required", close=True)
            return None
        try:
            length = int(raw)
        except ValueError:
            length = -1
        if length < 0 or len(self.headers.get_all("Content-Length", [])) > 1:
            self._refuse(400, "bad_request", f"bad Content-Length {raw[:40]!r}", close=True)
            return None
        if length > MAX_BODY_BYTES:
            self._refuse(
                413,
                "too_large",
                f"body of {length} bytes, more than {MAX_BODY_BYTES}",
                close=True,
            )
            return None
        # Each read waits at most the socket timeout; the deadline bounds them together,
        # so a client trickling a byte at a time cannot hold the thread for long.
        deadline = time.monotonic() + self.server.io_timeout_s
        chunks, left = [], length
        while left:
            if time.monotonic() > deadline:
                raise TimeoutError
            chunk = self.rfile.read1(min(left, 65536))
            if not chunk:
                raise ConnectionResetError("the client closed the connection mid-body")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)


class _Headers:
    """A request's headers: names matched without regard to case, repeats kept."""

    def __init__(self) -> None:
        self._items: list[tuple[str, str]] = []  # (lower-case name, value)

    def add(self, name: str, value: str) -> None:
        self._items.append((name.lower(), value))

    def get(self, name: str, default: str | None = None) -> str | None:
        """The first value of ``name``, or ``default``."""
        key = name.lower()
        for k, v in self._items:
            if k == key:
                return v
        return default

    def get_all(self, name: str, default: list[str] | None = None) -> list[str] | None:
        key = name.lower()
        found = [v for k, v in self._items if k == key]
        return found or default

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.get(name) is not None

    def __len__(self) -> int:
        return len(self._items)
