"""Node agent reports on the wire: round trip, and every bad field refused by name; the
driver hands an agent the actions ordered for its node, once, and records outcomes; an
agent in the driver's process gets by a call what HTTP gets."""

from __future__ import annotations

import json
import time

import pytest

from ms_health._client import JsonClient, LocalClient
from ms_health.agent import NodeAgent
from ms_health.driver import Driver
from ms_health.record import MAX_BODY_BYTES, AgentReport, RecordError, parse_agent_report


def _report(**change: object) -> dict[str, object]:
    body = AgentReport(
        job="j", node="n0", host="h", pid=7, sent_at=time.time(), restart=1, workers={0: 11, 3: 12}
    ).to_json()
    body.update(change)
    return body


def test_round_trip_and_bad_fields() -> None:
    parsed = parse_agent_report(json.dumps(_report(results=[{"id": 4, "ok": True}])))
    assert parsed.workers == {0: 11, 3: 12} and parsed.restart == 1
    assert parsed.results == ({"id": 4, "ok": True},)
    for change, message in [
        ({"workers": {"x": 1}}, r"agent.workers keys must be ranks"),
        ({"workers": {"0": 0}}, r"agent.workers\[0\] must be a pid"),
        ({"results": [{"ok": True}]}, r"agent.results\[0\] must be an object with an int id"),
        ({"results": "no"}, r"agent.results must be a list"),
        ({"type": "heartbeat"}, r"agent.type must be 'agent'"),
        ({"pid": -1}, r"agent.pid must be an int >= 1"),
        ({"node": ""}, r"agent.node must be a non-empty string"),
    ]:
        with pytest.raises(RecordError, match=message):
            parse_agent_report(json.dumps(_report(**change)))


def test_the_driver_hands_each_action_once_to_its_node_and_records_the_outcome() -> None:
    driver = Driver("t", job="j", tick_s=None)
    first = parse_agent_report(_report())
    assert driver._take_agent_report(first, "test")[0] == 200
    action = driver.order("n0", "escalate", rank=3, pid=12)
    other = driver.order("n1", "diagnose")
    status, body, _ = driver._take_agent_report(first, "test")
    assert status == 200
    assert json.loads(body)["actions"] == [{"id": action, "kind": "escalate", "rank": 3, "pid": 12}]
    assert json.loads(driver._take_agent_report(first, "test")[1])["actions"] == []  # once
    assert driver.wait_result(action, 0.01) is None
    done = parse_agent_report(_report(results=[{"id": action, "kind": "escalate", "ok": True}]))
    driver._take_agent_report(done, "test")
    assert driver.wait_result(action, 1.0) == {"id": action, "kind": "escalate", "ok": True}
    assert driver.wait_result(other, 0.01) is None  # n1 never reported
    assert [e.kind for e in driver.events()][-1] == "action_result"
    status, body, _ = driver._take_agent_report(parse_agent_report(_report(job="k")), "test")
    assert status == 409 and "agent.job must be 'j'" in json.loads(body)["error"]
    with pytest.raises(ValueError, match="kind must be one of"):
        driver.order("n0", "reboot")


def test_a_dead_workers_node_is_still_known() -> None:
    # A crashed rank is gone from its agent's next report before the driver hears its
    # silence: the recovery must still find its node (to escalate, to diagnose).
    driver = Driver("t", job="j", tick_s=None)
    driver._take_agent_report(parse_agent_report(_report()), "test")
    driver._take_agent_report(parse_agent_report(_report(node="n1", workers={"1": 21})), "test")
    assert driver.node_of(12) == "n0" and driver.node_of(21) == "n1"
    driver._take_agent_report(parse_agent_report(_report(workers={"0": 11})), "test")  # 12 died
    assert driver.node_of(12) == "n0"
    # A pid reused on another node: the newest report wins.
    driver._take_agent_report(parse_agent_report(_report(node="n1", workers={"1": 12})), "test")
    assert driver.node_of(12) == "n1"
    assert driver.node_of(999) is None


def test_an_in_process_report_gets_what_http_gets() -> None:
    # The launcher that hosts the driver reports to it by a call: the same parsing and
    # checks as a request, the same answers, with the HTTP server's refusals kept.
    driver = Driver("t", job="j", tick_s=None).start()
    try:
        local = LocalClient(driver)
        http = JsonClient(driver.url, "t", timeout_s=5.0)
        action = driver.order("n0", "dump", rank=0, pid=11)
        status, reply = local.post("/agent", _report())
        assert (status, reply) == (
            200,
            {"ok": True, "actions": [{"id": action, "kind": "dump", "rank": 0, "pid": 11}]},
        )
        assert (
            http.post("/agent", _report())
            == local.post("/agent", _report())
            == (200, {"ok": True, "actions": []})
        )
        for bad in (_report(pid=-1), _report(job="k")):
            assert local.post("/agent", bad) == http.post("/agent", bad)
        assert local.post("/agent", _report(job="k"))[0] == 409
        # as the server refuses an oversized body (test_driver_security checks that one)
        huge = _report(node="n" * (MAX_BODY_BYTES + 1))
        assert local.post("/agent", huge)[0] == 413
        # and a path the driver does not serve, as the server does
        assert local.post("/nowhere", _report()) == http.post("/nowhere", _report())
        assert local.post("/nowhere", _report())[0] == 404
        http.close()
    finally:
        driver.stop()
    assert local.post("/agent", _report())[0] == 503  # a stopped driver refuses

    class Broken:
        def post(self, path: str, body: bytes, client: str) -> tuple[int, bytes, str]:
            raise RuntimeError("a bug")

    assert LocalClient(Broken()).post("/agent", _report()) == (
        500,
        {"error": "internal error: RuntimeError"},
    )
    with pytest.raises(TypeError, match="app must have post"):
        LocalClient(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"driver must be a Driver .*, got 'no driver'"):
        NodeAgent("http://127.0.0.1:1", "t", job="j", node="n0", workers=dict, driver="no driver")  # type: ignore[arg-type]
