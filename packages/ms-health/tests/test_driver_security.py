"""What a client can do to the driver: wrong or missing tokens, malformed and oversized
bodies, missing lengths, other jobs, garbage bytes, silence, trickles, floods. Each is
refused and counted, and the driver goes on serving a good client afterwards."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ms_health.driver import Driver
from ms_health.record import MAX_BODY_BYTES

sys.path.insert(0, str(Path(__file__).parent))
from _driver_support import DEADLINE_S, TOKEN, heartbeat_body, request, wait_until

IO_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def driver() -> Iterator[Driver]:
    with Driver(TOKEN, tick_s=None, world_size=2, job="j", io_timeout_s=IO_TIMEOUT_S) as d:
        yield d


def rejected(driver: Driver, reason: str) -> int:
    text = request(driver.url, "GET", "/metrics")[1]
    for line in text.splitlines():
        if line.startswith(f'ms_health_rejected_requests_total{{reason="{reason}"}}'):
            return int(line.rsplit(" ", 1)[1])
    return 0


def still_serves(driver: Driver) -> None:
    code, body = request(driver.url, "POST", "/heartbeat", body=heartbeat_body())
    assert code == 200 and body["ok"] is True and body["job"]["heard"] >= 1


def raw(driver: Driver, data: bytes, *, read: bool = True) -> bytes:
    """Send ``data`` on a fresh socket; everything the driver answers until it closes."""
    with socket.create_connection(("127.0.0.1", driver.port), timeout=DEADLINE_S) as s:
        s.sendall(data)
        if not read:
            return b""
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


def headers(method: str, path: str, *lines: str) -> bytes:
    text = f"{method} {path} HTTP/1.1\r\nHost: x\r\n" + "".join(f"{h}\r\n" for h in lines)
    return (text + "\r\n").encode()


AUTH = f"Authorization: Bearer {TOKEN}"


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/status"), ("GET", "/ranks"), ("GET", "/events"), ("GET", "/metrics"),
     ("POST", "/heartbeat"), ("POST", "/dump"), ("GET", "/nothing")],
)  # fmt: skip
@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x", ""])
def test_every_endpoint_needs_the_token(
    driver: Driver, method: str, path: str, token: str | None
) -> None:
    before = rejected(driver, "unauthorized")
    body = heartbeat_body() if method == "POST" else None
    code, reply = request(driver.url, method, path, body=body, token=token)
    assert code == 401 and "token" in reply["error"]
    assert rejected(driver, "unauthorized") == before + 1
    still_serves(driver)


def test_a_refused_token_is_an_event_without_the_token_and_a_flood_is_not_a_flood() -> None:
    with Driver(TOKEN, tick_s=None) as driver:
        for _ in range(50):
            assert request(driver.url, "GET", "/status", token="guess")[0] == 401
        assert request(driver.url, "GET", "/status", token=None)[0] == 401
        events = [e for e in driver.events() if e.kind == "rejected"]
        assert rejected(driver, "unauthorized") == 51
    # one event per reason per 10 s: the log cannot be filled by a flood
    assert len(events) == 1
    assert events[0].evidence["reason"] == "unauthorized"
    assert events[0].evidence["client"] == "127.0.0.1"
    assert "wrong bearer token" in events[0].message
    assert all(TOKEN not in json.dumps(e.to_json()) for e in driver.events())


def test_a_scheme_other_than_bearer_is_refused(driver: Driver) -> None:
    code, _ = request(driver.url, "GET", "/status", token=None,
                      headers={"Authorization": f"Basic {TOKEN}"})  # fmt: skip
    assert code == 401


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "heartbeat body is not JSON"),
        (b"[]", "heartbeat body must be a JSON object"),
        (json.dumps(heartbeat_body(rank="0")).encode(), "heartbeat.rank must be an int"),
        (json.dumps(heartbeat_body(loss=[1])).encode(), "heartbeat.loss must be a number"),
        (json.dumps(heartbeat_body(phase="")).encode(), "heartbeat.phase must be"),
    ],
)
def test_a_malformed_body_gets_400_with_the_record_error(
    driver: Driver, body: bytes, message: str
) -> None:
    code, reply = request(driver.url, "POST", "/heartbeat", body=body)
    assert code == 400 and reply["error"].startswith(message)
    still_serves(driver)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"job": "other"}, "heartbeat.job must be 'j', got 'other'"),
        ({"world_size": 8, "rank": 5}, "heartbeat.world_size must be 2"),
    ],
)
def test_another_job_or_a_rank_outside_the_world_gets_409(
    driver: Driver, fields: dict[str, Any], message: str
) -> None:
    before = rejected(driver, "conflict")
    code, reply = request(driver.url, "POST", "/heartbeat", body=heartbeat_body(**fields))
    assert code == 409 and reply["error"].startswith(message)
    assert rejected(driver, "conflict") == before + 1
    still_serves(driver)


def test_an_oversized_body_is_refused_before_it_is_read(driver: Driver) -> None:
    # Only the headers are sent: the answer comes without the body ever arriving.
    reply = raw(
        driver, headers("POST", "/heartbeat", AUTH, f"Content-Length: {MAX_BODY_BYTES + 1}")
    )
    assert status_of(reply) == 413 and b"Connection: close" in reply
    still_serves(driver)


@pytest.mark.parametrize(
    ("extra", "status"),
    [
        ((), 411),
        (("Transfer-Encoding: chunked",), 411),
        (("Content-Length: -5",), 400),
        (("Content-Length: ten",), 400),
        (("Content-Length: 2", "Content-Length: 2"), 400),
    ],
)
def test_a_body_without_a_usable_length_is_refused(
    driver: Driver, extra: tuple[str, ...], status: int
) -> None:
    reply = raw(driver, headers("POST", "/heartbeat", AUTH, *extra) + b"{}")
    assert status_of(reply) == status
    still_serves(driver)


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x00\xff\xfe garbage\r\n\r\n",
        b"GET\r\n\r\n",
        b"PUT /heartbeat HTTP/1.1\r\n" + AUTH.encode() + b"\r\n\r\n",
        b"GET /status HTTP/9.9\r\n\r\n",
        b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n",
        b"GET /status HTTP/1.1\r\n" + b"X: y\r\n" * 200 + b"\r\n",
        b"GET /status HTTP/1.1\r\nbroken header line\r\n\r\n",
    ],
)
def test_garbage_on_the_socket_is_refused_and_the_driver_serves_on(
    driver: Driver, garbage: bytes
) -> None:
    reply = raw(driver, garbage)
    assert reply == b"" or status_of(reply) >= 400
    still_serves(driver)


@pytest.mark.parametrize(
    ("request_head", "status"),
    [
        (b"GET /status HTTP/1.1\r\nX: a\r\n  folded\r\n\r\n", 400),
        (b"GET /status HTTP/1.1\r\nX : a\r\n\r\n", 400),
        (b"GET /status HTTP/1.1\r\n: a\r\n\r\n", 400),
        (b"GET /status HTTP/2.0\r\n\r\n", 505),
        (b"GET /status HTTP/0.9\r\n\r\n", 505),
        (b"GET /status HTTP/1.x\r\n\r\n", 400),
        (b"GET /status HTTP/1.1.1\r\n\r\n", 400),
        (b"GET /status HTTPS/1.1\r\n\r\n", 400),
        (b"GET /status\r\n\r\n", 400),
        (b"GET /status HTTP/1.1 more\r\n\r\n", 400),
        (b"GET /status HTTP/1.1\r\nX: " + b"y" * 70_000 + b"\r\n\r\n", 431),
        (b"GET /status HTTP/1.1\r\n" + b"X: y\r\n" * 101 + b"\r\n", 431),
    ],
    ids=[
        "folded",
        "space-before-colon",
        "no-name",
        "http2",
        "http0.9",
        "minor-not-a-number",
        "three-numbers",
        "not-http",
        "no-version",
        "four-words",
        "long-line",
        "too-many",
    ],
)
def test_a_malformed_request_head_gets_its_status_and_the_connection_closes(
    driver: Driver, request_head: bytes, status: int
) -> None:
    before = rejected(driver, "bad_request")
    reply = raw(driver, request_head)  # reads until the driver closes
    assert status_of(reply) == status
    assert b"Connection: close" in reply.partition(b"\r\n\r\n")[0]
    assert rejected(driver, "bad_request") == before + 1
    still_serves(driver)


def replies(sock: socket.socket, n: int) -> list[tuple[int, dict[str, str], bytes]]:
    """The next ``n`` replies on ``sock``: (status, headers, body), read by length."""

    def more() -> bytes:
        chunk = sock.recv(65536)
        assert chunk, "the driver closed the connection"
        return chunk

    out, buf = [], b""
    for _ in range(n):
        while b"\r\n\r\n" not in buf:
            buf += more()
        head, _, buf = buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        fields = dict(line.split(": ", 1) for line in lines[1:])
        length = int(fields["Content-Length"])
        while len(buf) < length:
            buf += more()
        out.append((int(lines[0].split(" ")[1]), fields, buf[:length]))
        buf = buf[length:]
    return out


def test_requests_on_one_connection_are_answered_in_turn_and_headers_ignore_case(
    driver: Driver,
) -> None:
    body = json.dumps(heartbeat_body()).encode()
    post = headers(
        "POST", "/heartbeat", f"authorization: bearer {TOKEN}", f"content-length: {len(body)}"
    )
    get = headers("GET", "/status", AUTH)
    expect = headers(
        "POST", "/heartbeat", AUTH, f"Content-Length: {len(body)}", "Expect: 100-continue"
    )
    with socket.create_connection(("127.0.0.1", driver.port), timeout=DEADLINE_S) as s:
        s.sendall(post + body + get + post + body)
        (a, ha, ba), (b, _, bb), (c, _, _) = replies(s, 3)
        assert (a, b, c) == (200, 200, 200)
        assert json.loads(ba)["ok"] is True and "job" in json.loads(bb)
        assert ha["Content-Type"] == "application/json" and ha["Server"] == "ms-health"
        assert ha["Date"].endswith(" GMT") and "Connection" not in ha
        # a client that waits for 100 Continue before its body gets it, then the reply
        s.sendall(expect)
        interim = b""
        while not interim.endswith(b"\r\n\r\n"):
            chunk = s.recv(65536)
            assert chunk, "the driver closed the connection"
            interim += chunk
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(body)
        assert replies(s, 1)[0][0] == 200


@pytest.mark.parametrize(
    ("version", "connection", "kept"),
    [
        ("HTTP/1.1", (), True),
        ("HTTP/1.1", ("close",), False),
        ("HTTP/1.1", ("Keep-Alive, close",), False),
        ("HTTP/1.1", ("keep-alive", "close"), False),
        ("HTTP/1.0", (), False),
        ("HTTP/1.0", ("keep-alive",), True),
    ],
)
def test_the_connection_is_kept_as_the_request_asks(
    driver: Driver, version: str, connection: tuple[str, ...], kept: bool
) -> None:
    lines = [AUTH] + [f"Connection: {c}" for c in connection]
    head = headers("GET", "/status", *lines).replace(b"HTTP/1.1", version.encode(), 1)
    with socket.create_connection(("127.0.0.1", driver.port), timeout=DEADLINE_S) as s:
        s.sendall(head)
        status, fields, _ = replies(s, 1)[0]
        assert status == 200
        s.settimeout(IO_TIMEOUT_S / 4)  # well before the driver's idle timeout
        if kept:
            assert "Connection" not in fields
            with pytest.raises(TimeoutError):
                s.recv(1)
        else:
            assert fields["Connection"] == "close"
            assert s.recv(1) == b""


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=2000))
def test_any_body_with_the_token_is_200_or_4xx_never_5xx(driver: Driver, body: bytes) -> None:
    for path in ("/heartbeat", "/dump"):
        code, _ = request(driver.url, "POST", path, body=body)
        assert 400 <= code < 500


def test_a_silent_client_holds_only_its_own_thread_and_only_for_a_while(driver: Driver) -> None:
    before = rejected(driver, "timeout")
    with socket.create_connection(("127.0.0.1", driver.port), timeout=DEADLINE_S) as idle:
        still_serves(driver)  # while the silent connection is open
        assert idle.recv(1) == b""  # closed by the driver after its read timeout
    wait_until(lambda: rejected(driver, "timeout") == before + 1, "the timeout counted")
    still_serves(driver)


def test_a_trickling_body_is_cut_at_its_deadline(driver: Driver) -> None:
    before = rejected(driver, "timeout")
    with socket.create_connection(("127.0.0.1", driver.port), timeout=DEADLINE_S) as slow:
        slow.sendall(headers("POST", "/heartbeat", AUTH, "Content-Length: 1000"))
        # one byte per half read-timeout: no single read times out, the deadline does
        closed = False
        for _ in range(int(4 * IO_TIMEOUT_S / 0.5) + 20):
            try:
                slow.sendall(b" ")
            except OSError:
                closed = True
                break
            time.sleep(0.5 * IO_TIMEOUT_S)
            still_serves(driver)
            if rejected(driver, "timeout") > before:
                closed = True
                break
        assert closed
    wait_until(lambda: rejected(driver, "timeout") == before + 1, "the deadline counted")


@pytest.mark.parametrize(
    ("sent", "trickled"),
    [
        (b"", b"GET /" + b"a" * 1000),  # the request line, a byte at a time
        (b"GET /status HTTP/1.1\r\n", b"X-Long: " + b"y" * 1000),  # one header line
        (b"GET /status HTTP/1.1\r\n", b"".join(b"X-%d: y\r\n" % i for i in range(99))),
    ],
    ids=["request-line", "header-line", "header-lines"],
)
def test_a_trickling_head_is_cut_at_its_deadline(
    driver: Driver, sent: bytes, trickled: bytes
) -> None:
    before = rejected(driver, "timeout")
    with socket.create_connection(("127.0.0.1", driver.port), timeout=DEADLINE_S) as slow:
        slow.sendall(sent + trickled[:1])
        # a byte or a line every half read-timeout: no read times out, the deadline does
        t0 = time.monotonic()
        pieces = trickled.split(b"\n") if trickled.count(b"\n") > 1 else list(trickled[1:])
        closed = False
        for piece in pieces[: int(4 * IO_TIMEOUT_S / 0.5) + 20]:
            try:
                slow.sendall(bytes([piece]) if isinstance(piece, int) else piece + b"\n")
            except OSError:
                closed = True
                break
            time.sleep(0.5 * IO_TIMEOUT_S)
            if rejected(driver, "timeout") > before:
                closed = True
                break
        assert closed and time.monotonic() - t0 < 4 * IO_TIMEOUT_S + 2.0
    wait_until(lambda: rejected(driver, "timeout") == before + 1, "the deadline counted")
    still_serves(driver)


def test_past_max_connections_new_ones_are_closed_at_once() -> None:
    with Driver(TOKEN, tick_s=None, max_connections=2, io_timeout_s=30) as driver:
        idle = [socket.create_connection(("127.0.0.1", driver.port)) for _ in range(2)]
        try:
            wait_until(lambda: len(driver._server._open) == 2, "two open connections")  # type: ignore[union-attr]
            with socket.create_connection(("127.0.0.1", driver.port), timeout=DEADLINE_S) as s:
                assert s.recv(1) == b""
        finally:
            for s in idle:
                s.close()
        # the handlers of the closed connections end, and their places are free again
        wait_until(lambda: not driver._server._open, "closed connections released")  # type: ignore[union-attr]
        assert request(driver.url, "GET", "/status")[0] == 200
        assert rejected(driver, "busy") >= 1


def test_a_stopped_driver_cuts_kept_alive_connections() -> None:
    import http.client

    driver = Driver(TOKEN, tick_s=None).start()
    conn = http.client.HTTPConnection("127.0.0.1", driver.port, timeout=DEADLINE_S)
    body = json.dumps(heartbeat_body()).encode()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    conn.request("POST", "/heartbeat", body=body, headers=auth)
    assert json.loads(conn.getresponse().read())["ok"] is True
    driver.stop()
    # The kept-alive connection is gone: the next request on it fails rather than
    # reaching a handler thread of the stopped driver.
    with pytest.raises((OSError, http.client.HTTPException)):
        _post_and_read(conn, body, auth)
    conn.close()


def _post_and_read(conn: Any, body: bytes, headers: dict[str, str]) -> bytes:
    conn.request("POST", "/heartbeat", body=body, headers=headers)
    data: bytes = conn.getresponse().read()
    return data


def test_the_accept_loop_sleeps_until_a_connection_or_the_stop() -> None:
    # socketserver's loop wakes every poll_interval to look for a shutdown: on a
    # training host that is a wake-up of a thread beside the ranks, forever. This one
    # runs an iteration per connection, and stop() wakes it.
    from ms_health import _http

    class Counting(_http.Server):
        loops = 0

        def service_actions(self) -> None:
            self.loops += 1

    driver = Driver(TOKEN, tick_s=None)
    server = Counting("127.0.0.1", 0, driver, io_timeout_s=10.0, max_connections=8)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        time.sleep(0.5)  # socketserver's loop would have polled about 10 times by now
        assert server.loops == 0
        with socket.create_connection(("127.0.0.1", server.server_port), timeout=DEADLINE_S):
            wait_until(lambda: server.loops == 1, "one iteration for the connection")
    finally:
        server.shutdown()  # returns once the loop has: the wake-up is not a poll
        server.server_close()
    thread.join(DEADLINE_S)
    assert not thread.is_alive() and server.loops == 1
    server.shutdown()  # a second stop, or one of a loop never started, returns at once


def test_a_port_in_use_is_an_oserror_and_a_stop_before_the_loop_is_clean() -> None:
    import errno

    from ms_health import _http

    with Driver(TOKEN, tick_s=None) as first:
        with pytest.raises(OSError, match="in use") as raised:
            Driver(TOKEN, tick_s=None, port=first.port).start()
        assert raised.value.errno == errno.EADDRINUSE  # what a second launcher backs off on
    # stop() may come before the serving thread ran: the loop then never begins
    server = _http.Server("127.0.0.1", 0, first, io_timeout_s=1.0, max_connections=1)
    server.shutdown()
    server.server_close()
    server.serve_forever()  # returns at once, touching no closed socket
