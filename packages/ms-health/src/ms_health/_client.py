"""A small HTTP JSON client with one kept-alive connection, for the heartbeat sender,
and its in-process twin for a node agent that lives beside its driver.

One connection is reused across heartbeats. The driver closes idle connections and a
restarted driver has none of the old ones, so a request that fails on a reused
connection is tried once more on a fresh one before the failure is reported.

The client speaks the little HTTP/1.1 it needs itself: one write per request (head
and body together) and a reply read as a status line, headers and a
``Content-Length`` body (or, without one, everything up to the close). This runs on
the sender's thread, holding the training process's GIL: ``http.client`` parses
every reply's headers through the ``email`` package, which took about half of a
heartbeat's CPU (measured 2026-12-07, ``tools/bench/health/sender_overhead.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import ssl
import urllib.parse
from typing import Any, Protocol

from ms_health.record import MAX_BODY_BYTES

__all__ = ["JsonClient", "LocalApp", "LocalClient", "TransportError"]

_log = logging.getLogger(__name__)

#: The most a reply's status line and headers may take, and its body.
MAX_REPLY_HEAD_BYTES = 64 * 1024
MAX_REPLY_BODY_BYTES = 16 * 1024 * 1024


class TransportError(Exception):
    """The request did not get an HTTP answer (refused, reset, timed out, garbled)."""


class _Garbled(Exception):
    """The server's answer is not an HTTP reply this client reads."""


class JsonClient:
    """POST JSON to one server with ``Authorization: Bearer <token>``."""

    def __init__(self, url: str, token: str, *, timeout_s: float) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url must be http://HOST:PORT or https://HOST:PORT, got {url!r}")
        try:
            port = parts.port
        except ValueError as e:  # not a number, or out of range
            raise ValueError(f"url must have a port in 0-65535, got {url!r}") from e
        if not (token.isascii() and token.isprintable()):
            raise ValueError("token must be printable ASCII (no line breaks)")
        _check_path("url's path", parts.path)
        try:
            parts.hostname.encode("idna")  # what the connect would do, failing there
        except UnicodeError as e:
            raise ValueError(f"url's host is not a valid host name, got {url!r}") from e
        self.url = url
        self._tls = parts.scheme == "https"
        self._host = parts.hostname
        self._port = port if port is not None else (443 if self._tls else 80)
        self._base = parts.path.rstrip("/")
        host = f"[{self._host}]" if ":" in self._host else self._host
        # Everything of a request's head but its path and length, encoded once.
        self._headers = (
            f"Host: {host}:{self._port}\r\n"
            f"Authorization: Bearer {token}\r\n"
            "Content-Type: application/json\r\n"
            "Accept: application/json\r\n"
        ).encode()
        self._timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._buf = bytearray()  # bytes read but not yet taken
        self._answered = False  # bytes of a reply to the request in flight came

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """(status, decoded JSON reply, ``{}`` if none); TransportError without an answer.

        A request that fails on a reused connection before any of its reply arrived is
        sent once more on a new one (the server closed the old one); once a reply began,
        it is not: the server may have acted on it."""
        _check_path("path", path)
        data = json.dumps(body, allow_nan=False, separators=(",", ":")).encode()
        reused = self._sock is not None
        try:
            return self._request(path, data)
        except (OSError, ValueError, _Garbled) as first:  # ValueError: UnicodeError too
            self.close()
            if not reused or self._answered:
                raise TransportError(f"{type(first).__name__}: {first}") from first
        try:
            return self._request(path, data)
        except (OSError, ValueError, _Garbled) as second:
            self.close()
            raise TransportError(f"{type(second).__name__}: {second}") from second

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
        self._buf.clear()

    def _connect(self) -> socket.socket:
        sock = socket.create_connection((self._host, self._port), timeout=self._timeout_s)
        try:
            # One write per request; without this a second segment would wait for the
            # server's delayed ACK.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls:
                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=self._host)
        except BaseException:
            sock.close()
            raise
        return sock

    def _request(self, path: str, data: bytes) -> tuple[int, dict[str, Any]]:
        if self._sock is None:
            self._sock = self._connect()
            self._buf.clear()
        self._answered = False
        head = b"POST %s HTTP/1.1\r\n%sContent-Length: %d\r\n\r\n" % (
            (self._base + path).encode("ascii"),
            self._headers,
            len(data),
        )
        self._sock.sendall(head + data)
        status, length, close = self._read_head()
        if length is None:  # no length: the body runs to the close
            raw = self._read_to_close()
            close = True
        else:
            raw = self._read_exactly(length)
        if close:
            self.close()
        elif self._buf:  # more than the one reply asked for
            raise _Garbled(f"{len(self._buf)} unexpected bytes after the reply")
        return status, _reply(raw)

    def _recv(self, *, close_ends: bool = False) -> bool:
        """Read what has come into the buffer; False when the server closed the
        connection and ``close_ends`` (else ConnectionResetError)."""
        assert self._sock is not None
        chunk = self._sock.recv(65536)
        if not chunk:
            if close_ends:
                return False
            raise ConnectionResetError("the server closed the connection")
        self._answered = True
        self._buf += chunk
        return True

    def _read_head(self) -> tuple[int, int | None, bool]:
        """(status, Content-Length or None, whether the server closes after this reply)."""
        searched = 0
        while (end := self._buf.find(b"\r\n\r\n", searched)) < 0:
            if len(self._buf) > MAX_REPLY_HEAD_BYTES:
                break
            searched = max(0, len(self._buf) - 3)
            self._recv()
        if not 0 <= end <= MAX_REPLY_HEAD_BYTES:
            raise _Garbled(f"a reply head longer than {MAX_REPLY_HEAD_BYTES} bytes")
        lines = self._take(end + 4)[:-4].decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        code = rest[:3]
        if not (
            version.startswith("HTTP/1.")
            and len(code) == 3
            and code.isascii()
            and code.isdigit()
            and rest[3:4] in ("", " ")
        ):
            raise _Garbled(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        status = int(code)
        if 100 <= status < 200:
            raise _Garbled(f"an interim reply ({status}) to a request that asked for none")
        length: int | None = None
        close = version == "HTTP/1.0"
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if not colon:
                raise _Garbled(f"a header line without a colon: {line[:80]!r}")
            name, value = name.strip().lower(), value.strip()
            if name == "content-length":
                digits = value.isascii() and value.isdigit() and len(value) <= 18
                if not digits or length not in (None, int(value)):
                    raise _Garbled(f"bad Content-Length {value[:40]!r}")
                length = int(value)
            elif name == "transfer-encoding":
                raise _Garbled(f"Transfer-Encoding {value[:40]!r} is not read by this client")
            elif name == "connection":
                tokens = {t.strip().lower() for t in value.split(",")}
                if "close" in tokens:
                    close = True
                elif "keep-alive" in tokens:
                    close = False
        if length is not None and length > MAX_REPLY_BODY_BYTES:
            raise _Garbled(f"a reply body of {length} bytes, more than {MAX_REPLY_BODY_BYTES}")
        if status in (204, 304):
            length = 0
        return status, length, close

    def _take(self, n: int) -> bytes:
        """The buffer's first ``n`` bytes, removed from it."""
        raw = bytes(self._buf[:n])
        del self._buf[:n]
        return raw

    def _read_exactly(self, n: int) -> bytes:
        while len(self._buf) < n:
            self._recv()
        return self._take(n)

    def _read_to_close(self) -> bytes:
        while self._recv(close_ends=True):
            if len(self._buf) > MAX_REPLY_BODY_BYTES:
                raise _Garbled(f"a reply body of more than {MAX_REPLY_BODY_BYTES} bytes")
        return self._take(len(self._buf))


class LocalApp(Protocol):
    """What :class:`LocalClient` calls: the driver's request entry point (and, when it
    has them, its ``post_paths``, checked first as the HTTP server does)."""

    def post(self, path: str, body: bytes, client: str) -> tuple[int, bytes, str]: ...


class LocalClient:
    """:class:`JsonClient`'s ``post`` for a driver in this process: the same body, the
    same checks and the same reply, through a call instead of a socket, a request
    thread and HTTP parsing on both sides. Nothing crosses a trust boundary, so no
    token is presented."""

    def __init__(self, app: LocalApp, *, name: str = "in-process") -> None:
        if not callable(getattr(app, "post", None)):
            raise TypeError(f"app must have post(path, body, client), got {app!r}")
        self.app, self.name = app, name
        self.url = f"{name}:{type(app).__name__}"

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        paths = getattr(self.app, "post_paths", None)
        if paths is not None and path not in paths:  # as the HTTP server refuses it
            return self._refuse(404, "not_found", f"no POST {path[:100]}")
        data = json.dumps(body, allow_nan=False, separators=(",", ":")).encode()
        if len(data) > MAX_BODY_BYTES:
            detail = f"body of {len(data)} bytes, more than {MAX_BODY_BYTES}"
            return self._refuse(413, "too_large", detail)
        try:
            status, raw, _ = self.app.post(path, data, self.name)
        except Exception as e:  # as the HTTP server answers an app's bug: 500
            _log.exception("ms-health: error serving an in-process POST %s", path)
            return 500, {"error": f"internal error: {type(e).__name__}"}
        return status, _reply(raw)

    def close(self) -> None:
        pass

    def _refuse(self, status: int, reason: str, detail: str) -> tuple[int, dict[str, Any]]:
        rejected = getattr(self.app, "rejected", None)
        if callable(rejected):  # counted and logged as the server's refusals are
            rejected(reason, self.name, detail)
        return status, {"error": detail}


def _check_path(name: str, path: str) -> None:
    if not (path.isascii() and path.isprintable()) or " " in path:
        raise ValueError(f"{name} must be printable ASCII without spaces, got {path!r}")


def _reply(raw: bytes) -> dict[str, Any]:
    """A reply's body as a JSON object (``{}`` when empty, not JSON, nested too deeply
    to decode, or not an object)."""
    try:
        reply = json.loads(raw) if raw else {}
    except (ValueError, RecursionError):
        return {}
    return reply if isinstance(reply, dict) else {}
