"""A small HTTP JSON client with one kept-alive connection, for the heartbeat sender.

One connection is reused across heartbeats. The driver closes idle connections and a
restarted driver has none of the old ones, so a request that fails on a reused
connection is tried once more on a fresh one before the failure is reported.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import urllib.parse
from typing import Any

__all__ = ["JsonClient", "TransportError"]


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
        try:
            reply = json.loads(raw) if raw else {}
        except ValueError:
            reply = {}
        return response.status, reply if isinstance(reply, dict) else {}
