"""EventLog: recording from many threads, queries, the clock, and the JSON-lines round trip."""

from __future__ import annotations

import itertools
import json
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ms_parallel.events import EVENT_KINDS, Event, EventHook, EventLog


def test_records_in_order_with_attrs() -> None:
    log = EventLog()
    hook: EventHook = log  # an EventLog is usable wherever a hook is asked for
    hook("ag/0", "issue", 1.0, group="0", bytes=64)
    hook("ag/0", "wait_begin", 2.0)
    hook("ag/0", "wait_end", 3.5, group="0")
    assert [(e.name, e.kind, e.t) for e in log.events] == [
        ("ag/0", "issue", 1.0),
        ("ag/0", "wait_begin", 2.0),
        ("ag/0", "wait_end", 3.5),
    ]
    assert log.events[0].attrs == {"group": "0", "bytes": 64}
    assert len(log) == 3
    with pytest.raises(AttributeError):
        log.events[0].t = 5.0  # type: ignore[misc]


def test_events_is_a_copy() -> None:
    log = EventLog()
    log("a", "issue", 0.0)
    snapshot = log.events
    log("b", "issue", 1.0)
    assert [e.name for e in snapshot] == ["a"]


def test_queries() -> None:
    log = EventLog()
    for i, kind in enumerate(["issue", "compute_begin", "compute_end", "wait_begin", "wait_end"]):
        log("rs", kind, float(i), chunk=i % 2)
    log("ag", "issue", 9.0, chunk=1)
    assert log.index(kind="wait_begin") == 3
    assert log.index("rs", chunk=1) == 1
    assert log.index("rs", chunk=1, start=2) == 3
    assert log.index(chunk=1, start=4) == 5
    assert log.first("ag").t == 9.0
    assert [e.kind for e in log.select("rs", chunk=0)] == ["issue", "compute_end", "wait_end"]
    assert log.select(kind="nothing") == []
    with pytest.raises(ValueError, match="no event with name='ag', kind='wait_end'"):
        log.index("ag", "wait_end")
    # an attr the event lacks never matches, not even when asked for None
    assert log.select(missing=None) == []
    assert Event("x", "issue", 0.0, {"a": 1}).matches(kind="issue", a=1)
    assert not Event("x", "issue", 0.0, {"a": 1}).matches(a=2)


def test_clear() -> None:
    log = EventLog()
    log("a", "issue", 0.0)
    log.clear()
    assert log.events == [] and len(log) == 0
    log("b", "issue", 1.0)
    assert [e.name for e in log] == ["b"]


def test_clock_choice_and_mark() -> None:
    ticks = itertools.count(10)
    log = EventLog(clock=lambda: float(next(ticks)))
    assert log.now() == 10.0
    assert log.mark("fwd/0", "compute_begin", chunk=0) == 11.0
    log("fwd/0", "compute_end", 99.0)  # a given t is kept as given
    assert [e.t for e in log.events] == [11.0, 99.0]
    assert log.events[0].attrs == {"chunk": 0}


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="clock must be a callable"):
        EventLog(clock=1.0)  # type: ignore[arg-type]
    log = EventLog()
    with pytest.raises(TypeError, match="name and kind must be str"):
        log(3, "issue", 0.0)  # type: ignore[arg-type]


def test_thread_safe_appends() -> None:
    log = EventLog()
    threads, per_thread = 8, 500

    def work(i: int) -> None:
        for j in range(per_thread):
            log(f"t{i}", "issue", float(j), j=j)

    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert len(log) == threads * per_thread
    for i in range(threads):  # each thread's own events keep their order
        assert [e.attrs["j"] for e in log.select(f"t{i}")] == list(range(per_thread))


def test_kinds_vocabulary() -> None:
    assert set(EVENT_KINDS) >= {"issue", "wait_begin", "wait_end", "compute_begin", "compute_end"}


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
events = st.tuples(
    st.text(max_size=12),
    st.sampled_from([*EVENT_KINDS, "custom"]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.dictionaries(st.text(min_size=1, max_size=6), json_values, max_size=4),
)


@given(st.lists(events, max_size=20))
def test_jsonl_round_trip(tmp_path_factory: pytest.TempPathFactory, items: list[Any]) -> None:
    path = tmp_path_factory.mktemp("log") / "events.jsonl"
    log = EventLog()
    for name, kind, t, attrs in items:
        log(name, kind, t, **attrs)
    log.to_jsonl(path)
    back = EventLog.from_jsonl(path)
    assert back.events == log.events
    assert len(path.read_text().splitlines()) == len(items)


def test_from_jsonl_names_the_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    good = json.dumps({"name": "a", "kind": "issue", "t": 1.0, "attrs": {}})
    path.write_text(good + "\n\n" + json.dumps({"name": "b"}) + "\n")
    with pytest.raises(ValueError, match=r"line 3 is not an event record"):
        EventLog.from_jsonl(path)
