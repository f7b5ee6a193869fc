"""The heartbeat sender's HTTP client against servers that answer what they are told:
real sockets on loopback, replies written byte for byte, including broken ones."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from ms_health._client import MAX_REPLY_HEAD_BYTES, JsonClient, TransportError

TIMEOUT_S = 2.0

#: A server's answer to one request: the bytes to send back, and whether to close after.
Script = Callable[[bytes], tuple[bytes, bool]]


def wait_for(condition: Callable[[], bool]) -> None:
    """Until ``condition()`` holds (the server's thread counts a connection after the
    client has moved on); fails after a few seconds."""
    deadline = time.monotonic() + 5.0
    while not condition():
        assert time.monotonic() < deadline, "condition not met in 5 s"
        time.sleep(0.01)


def ok(body: bytes = b'{"ok":true}', *extra: str) -> bytes:
    head = ["HTTP/1.1 200 OK", f"Content-Length: {len(body)}", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class ScriptedServer:
    """Accepts connections on loopback; reads one request at a time (head and
    ``Content-Length`` body) and answers with ``script(request)``; keeps every
    request and counts connections."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests: list[bytes] = []
        self.connections = 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self._sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            with conn:
                conn.settimeout(TIMEOUT_S * 3)
                self._serve_connection(conn)

    def _serve_connection(self, conn: socket.socket) -> None:
        buf = b""
        while not self._stop.is_set():
            while b"\r\n\r\n" not in buf:
                try:
                    chunk = conn.recv(65536)
                except OSError:
                    return
                if not chunk:
                    return
                buf += chunk
            head, _, buf = buf.partition(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            while len(buf) < length:
                buf += conn.recv(65536)
            request, buf = head + b"\r\n\r\n" + buf[:length], buf[length:]
            self.requests.append(request)
            reply, close = self.script(request)
            if reply:
                conn.sendall(reply)
            if close:
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()


@pytest.fixture
def serve() -> Iterator[Callable[[Script], ScriptedServer]]:
    servers: list[ScriptedServer] = []

    def start(script: Script) -> ScriptedServer:
        servers.append(ScriptedServer(script))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def test_a_request_is_one_well_formed_post_and_the_connection_is_kept(
    serve: Callable[[Script], ScriptedServer],
) -> None:
    server = serve(lambda req: (ok(b'{"n":1}'), False))
    client = JsonClient(server.url + "/base/", "tok", timeout_s=TIMEOUT_S)
    assert client.post("/heartbeat", {"a": [1, 2.5, None], "b": "x"}) == (200, {"n": 1})
    assert client.post("/heartbeat", {"a": 2}) == (200, {"n": 1})
    assert server.connections == 1
    head, _, body = server.requests[0].partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "POST /base/heartbeat HTTP/1.1"
    fields = dict(line.split(": ", 1) for line in lines[1:])
    assert fields["Host"] == f"127.0.0.1:{server.port}"
    assert fields["Authorization"] == "Bearer tok"
    assert fields["Content-Type"] == "application/json"
    assert int(fields["Content-Length"]) == len(body)
    assert json.loads(body) == {"a": [1, 2.5, None], "b": "x"}
    client.close()


def test_connection_close_makes_the_next_request_connect_again(
    serve: Callable[[Script], ScriptedServer],
) -> None:
    # The server says it closes but keeps the socket open: a client that kept using it
    # would send every request on one connection.
    server = serve(lambda req: (ok(b"{}", "Connection: close"), False))
    client = JsonClient(server.url, "tok", timeout_s=TIMEOUT_S)
    for _ in range(3):
        assert client.post("/x", {}) == (200, {})
        assert client._sock is None
    wait_for(lambda: server.connections == 3)


def test_a_reply_without_a_length_is_read_to_the_close(
    serve: Callable[[Script], ScriptedServer],
) -> None:
    body = json.dumps({"big": "y" * 200_000}).encode()
    server = serve(lambda req: (b"HTTP/1.1 409 Conflict\r\nX-A: b\r\n\r\n" + body, True))
    client = JsonClient(server.url, "tok", timeout_s=TIMEOUT_S)
    assert client.post("/x", {}) == (409, {"big": "y" * 200_000})
    assert client._sock is None  # the close ended the body: nothing to reuse
    assert client.post("/x", {})[0] == 409
    assert server.connections == 2


def test_a_kept_connection_the_server_dropped_is_retried_once_on_a_fresh_one(
    serve: Callable[[Script], ScriptedServer],
) -> None:
    # The server answers once per connection and then hangs up without saying so, as
    # a driver that timed an idle connection out, or a restarted one, does.
    server = serve(lambda req: (ok(b'{"k":2}'), True))
    client = JsonClient(server.url, "tok", timeout_s=TIMEOUT_S)
    assert client.post("/x", {}) == (200, {"k": 2})
    time.sleep(0.1)  # the close reaches the client's socket
    assert client.post("/x", {}) == (200, {"k": 2})
    assert server.connections == 2 and len(server.requests) == 2


@pytest.mark.parametrize(
    ("reply", "says"),
    [
        (b"SSH-2.0-OpenSSH\r\n\r\n", "status line"),
        (b"HTTP/1.1 2x0 OK\r\n\r\n", "status line"),
        (b"HTTP/1.1 2000 OK\r\n\r\n", "status line"),
        (b"HTTP/1.1 2\xb20 OK\r\n\r\n", "status line"),  # a superscript two
        (b"HTTP/1.1 100 Continue\r\n\r\n", "interim"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", "chunked"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: \xb2\r\n\r\n", "Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n", "Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}", "Content-Length"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "colon"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 999999999\r\n\r\n", "more than"),
        (b"HTTP/1.1 200 OK\r\nX: " + b"y" * MAX_REPLY_HEAD_BYTES + b"\r\n\r\n", "longer"),
        (ok(b"{}") + b"HTTP/1.1 200 OK\r\n", "unexpected bytes"),
    ],
    ids=[
        "not-http",
        "bad-code",
        "four-digits",
        "superscript-code",
        "interim",
        "chunked",
        "negative-length",
        "superscript-length",
        "5000-digit-length",
        "two-lengths",
        "no-colon",
        "huge-body",
        "huge-head",
        "trailing-bytes",
    ],
)
def test_a_garbled_reply_is_a_transport_error_that_says_what(
    serve: Callable[[Script], ScriptedServer], reply: bytes, says: str
) -> None:
    server = serve(lambda req: (reply, True))
    client = JsonClient(server.url, "tok", timeout_s=TIMEOUT_S)
    with pytest.raises(TransportError, match=says):
        client.post("/x", {})


def test_an_answer_that_is_not_a_json_object_is_an_empty_reply(
    serve: Callable[[Script], ScriptedServer],
) -> None:
    replies = iter([ok(b"not json"), ok(b"[1, 2]"), b"HTTP/1.1 204 No Content\r\n\r\n"])
    server = serve(lambda req: (next(replies), False))
    client = JsonClient(server.url, "tok", timeout_s=TIMEOUT_S)
    assert client.post("/x", {}) == (200, {})
    assert client.post("/x", {}) == (200, {})
    assert client.post("/x", {}) == (204, {})
    assert server.connections == 1


def test_http_1_0_closes_unless_kept_alive(serve: Callable[[Script], ScriptedServer]) -> None:
    replies = iter(
        [
            b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n{}",
            b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\n{}",
            b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\n{}",
        ]
    )
    server = serve(lambda req: (next(replies), False))  # the server never closes
    client = JsonClient(server.url, "tok", timeout_s=TIMEOUT_S)
    kept = []
    for _ in range(3):
        assert client.post("/x", {}) == (200, {})
        kept.append(client._sock is not None)
    assert kept == [False, True, True]
    wait_for(lambda: server.connections == 2)  # the first dropped; the next two shared one


def test_a_silent_server_or_a_closed_port_is_a_transport_error_in_time(
    serve: Callable[[Script], ScriptedServer],
) -> None:
    server = serve(lambda req: (b"", False))  # reads the request, never answers
    client = JsonClient(server.url, "tok", timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="timed out"):
        client.post("/x", {})
    assert time.monotonic() - t0 < 0.3 * 2 + 1.0
    assert server.connections == 1 and len(server.requests) == 1  # new: not tried again
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(TransportError, match="ConnectionRefused"):
            JsonClient(f"http://127.0.0.1:{port}", "tok", timeout_s=0.3).post("/x", {})


@pytest.mark.parametrize(
    ("url", "token", "says"),
    [
        ("ftp://h:1", "t", "url must be http"),
        ("http://:1", "t", "url must be http"),
        ("http://h:99999", "t", "port in 0-65535"),
        ("http://h:1", "a\r\nX-Evil: 1", "token must be printable"),
        ("http://h:1", "tab\there", "token must be printable"),
        ("http://h:1", "tok\u00e9n", "token must be printable ASCII"),
        ("http://a..b:1", "t", "not a valid host name"),
        ("http://" + "a" * 64 + ":1", "t", "not a valid host name"),
        ("http://h:1/dr\u00efver", "t", "path must be printable ASCII"),
        ("http://h:1/a b", "t", "path must be printable ASCII"),
    ],
)
def test_bad_arguments_are_refused_up_front(url: str, token: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        JsonClient(url, token, timeout_s=1.0)


def test_a_reply_that_began_is_never_answered_by_sending_the_request_again(
    serve: Callable[[Script], ScriptedServer],
) -> None:
    # A well-formed reply followed by stray bytes on a kept connection: the server
    # acted on the request, so the client reports the failure instead of a second send.
    replies = iter([ok(b'{"n":1}'), ok(b'{"n":2}') + b"junk", ok(b'{"n":3}')])
    server = serve(lambda req: (next(replies), False))
    client = JsonClient(server.url, "tok", timeout_s=TIMEOUT_S)
    assert client.post("/x", {}) == (200, {"n": 1})
    with pytest.raises(TransportError, match="unexpected bytes"):
        client.post("/x", {})
    assert len(server.requests) == 2
    # and the next request starts clean on a new connection, with nothing stale read
    assert client.post("/x", {}) == (200, {"n": 3})
    wait_for(lambda: server.connections == 2)


def test_a_body_nested_too_deeply_to_decode_is_an_empty_reply(
    serve: Callable[[Script], ScriptedServer],
) -> None:
    server = serve(lambda req: (ok(b"[" * 100_000), False))
    assert JsonClient(server.url, "tok", timeout_s=TIMEOUT_S).post("/x", {}) == (200, {})


def test_a_path_that_cannot_go_in_a_request_line_is_refused(
    serve: Callable[[Script], ScriptedServer],
) -> None:
    server = serve(lambda req: (ok(), False))
    client = JsonClient(server.url, "tok", timeout_s=TIMEOUT_S)
    for path in ("/a b", "/x\r\nX-Evil: 1", "/caf\u00e9"):
        with pytest.raises(ValueError, match="path must be printable ASCII"):
            client.post(path, {})
    assert server.requests == []
