"""A small HTTP JSON client with one kept-alive connection, for the heartbeat sender,
and its in-process twin for a node agent that lives beside its driver.

One connection is reused across heartbeats. The driver closes idle connections and a
restarted driver has none of the old ones, so a request that fails on a reused
connection is tried once more on a fresh one before the failure is reported.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import urllib.parse
from typing import Any, Protocol

from ms_health.record import MAX_BODY_BYTES

__all__ = ["JsonClient", "LocalApp", "LocalClient", "TransportError"]

_log = logging.getLogger(__name__)


class TransportError(Exception):
    """The request did not get an HTTP answer (refused, reset, timed out, garbled)."""


class JsonClient:
    """POST JSON to one server with ``Authorization: Bearer <token>``."""

    def __init__(self, url: str, token: str, *, timeout_s: float) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url must be http://HOST:PORT or https://HOST:PORT, got {url!r}")
        self.url = url
        self._scheme = parts.scheme
        self._host = parts.hostname
        self._port = parts.port
        self._base = parts.path.rstrip("/")
        self._headers = {
            "Authorization": f"Bearer {token}",
            "Content-Type": "application/json",
        }
        self._timeout_s = timeout_s
        self._conn: http.client.HTTPConnection | None = None

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """(status, decoded JSON reply, ``{}`` if none); TransportError without an answer."""
        data = json.dumps(body, allow_nan=False, separators=(",", ":")).encode()
        reused = self._conn is not None
        try:
            return self._request(path, data)
        except (OSError, http.client.HTTPException) as first:
            self.close()
            if not reused:
                raise TransportError(f"{type(first).__name__}: {first}") from first
        try:
            return self._request(path, data)
        except (OSError, http.client.HTTPException) as second:
            self.close()
            raise TransportError(f"{type(second).__name__}: {second}") from second

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.close()
            self._conn = None

    def _request(self, path: str, data: bytes) -> tuple[int, dict[str, Any]]:
        if self._conn is None:
            cls = (
                http.client.HTTPSConnection
                if self._scheme == "https"
                else http.client.HTTPConnection
            )
            self._conn = cls(self._host, self._port, timeout=self._timeout_s)
        self._conn.request("POST", self._base + path, body=data, headers=self._headers)
        response = self._conn.getresponse()
        raw = response.read()
        if response.getheader("Connection", "").lower() == "close":
            self.close()
        return response.status, _reply(raw)


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


def _reply(raw: bytes) -> dict[str, Any]:
    """A reply's body as a JSON object (``{}`` when empty, not JSON, or not an object)."""
    try:
        reply = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return reply if isinstance(reply, dict) else {}
