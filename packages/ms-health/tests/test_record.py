"""The wire records: what parses, what is refused (each field, each way), round trips."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ms_health.record import (
    MAX_BODY_BYTES,
    MAX_LOG_LINE_CHARS,
    MAX_LOG_LINES,
    MAX_LOSSES,
    HeartbeatRecord,
    RecordError,
    StackDump,
    parse_dump,
    parse_heartbeat,
)

sys.path.insert(0, str(Path(__file__).parent))
from _driver_support import heartbeat_body, same_float


def dump_body(**fields: Any) -> dict[str, Any]:
    body = StackDump("j", 1, 42, 7, 2.0, "Thread 1:\n  File x\n").to_json()
    body.update(fields)
    return body


def test_a_full_heartbeat_parses_field_for_field() -> None:
    body = heartbeat_body(
        rank=1,
        local_rank=1,
        step=12,
        loss=2.5,
        tokens_per_s=1000.0,
        step_time_s=0.5,
        step_at=3.0,
        wait_s=0.1,
        step_cpu_s=0.4,
        last_op={"name": "all_reduce", "kind": "wait_begin", "t": 4.0, "bytes": 8},
        mesh={"dp": 1, "tp": 0},
        hardware={"cpu_cores": 2},
        logs=["WARNING x: NCCL timeout"],
        restart=3,
        nonfinite_step=11,
        losses=[[10, 2.75], [11, "nan"], [12, 2.5]],
    )
    record = parse_heartbeat(json.dumps(body).encode())
    assert record.rank == 1 and record.step == 12 and record.loss == 2.5
    assert record.mesh == {"dp": 1, "tp": 0} and record.logs == ("WARNING x: NCCL timeout",)
    assert record.last_op == {"name": "all_reduce", "kind": "wait_begin", "t": 4.0, "bytes": 8}
    assert record.restart == 3 and record.nonfinite_step == 11
    assert [s for s, _ in record.losses] == [10, 11, 12] and math.isnan(record.losses[1][1])
    assert record.to_json() == body


def test_optional_fields_default() -> None:
    record = parse_heartbeat(heartbeat_body())
    assert record.step is None and record.loss is None and record.last_op is None
    assert record.mesh == {} and record.logs == () and record.restart == 0
    assert record.losses == ()


@pytest.mark.parametrize("loss", [math.nan, math.inf, -math.inf])
def test_a_nonfinite_loss_travels_as_a_string_and_comes_back(loss: float) -> None:
    record = HeartbeatRecord(**{**_fields(parse_heartbeat(heartbeat_body())), "loss": loss})
    text = json.dumps(record.to_json(), allow_nan=False)  # strict JSON: no NaN literal
    back = parse_heartbeat(text)
    assert same_float(back.loss, loss)


def test_a_longer_list_of_losses_is_read_for_its_newest() -> None:
    body = heartbeat_body(losses=[[s, "nan" if s == 3 else 1.0] for s in range(MAX_LOSSES + 9)])
    record = parse_heartbeat(json.dumps(body))
    assert [s for s, _ in record.losses] == list(range(9, MAX_LOSSES + 9))


BAD_HEARTBEAT_FIELDS = [
    ("job", None, "heartbeat.job is missing"),
    ("job", "", "heartbeat.job must be a non-empty string"),
    ("job", "x" * 257, "heartbeat.job must be"),
    ("job", 5, "heartbeat.job must be"),
    ("rank", -1, "heartbeat.rank must be an int >= 0"),
    ("rank", True, "heartbeat.rank must be an int"),
    ("rank", 1.0, "heartbeat.rank must be an int"),
    ("rank", "0", "heartbeat.rank must be an int"),
    ("rank", 2, "heartbeat.rank must be < world_size (2), got 2"),
    ("world_size", 0, "heartbeat.world_size must be an int >= 1"),
    ("local_rank", -3, "heartbeat.local_rank must be an int >= 0"),
    ("node", "", "heartbeat.node must be"),
    ("host", None, "heartbeat.host is missing"),
    ("pid", 0, "heartbeat.pid must be an int >= 1"),
    ("seq", -1, "heartbeat.seq must be an int >= 0"),
    ("sent_at", "now", "heartbeat.sent_at must be a finite number"),
    ("sent_at", math.inf, "heartbeat.sent_at must be a finite number"),
    ("status", "dead", "heartbeat.status must be one of"),
    ("phase", "", "heartbeat.phase must be"),
    ("step", -1, "heartbeat.step must be an int >= 0"),
    ("step", 1.5, "heartbeat.step must be an int"),
    ("loss", "lots", 'heartbeat.loss must be a number, "nan", "inf" or "-inf"'),
    ("loss", False, "heartbeat.loss must be a number"),
    ("losses", {"1": 2.0}, "heartbeat.losses must be a list of [step, loss] pairs"),
    ("losses", [[1, 2.0], [1, 2.0, 3.0]] * MAX_LOSSES, f"heartbeat.losses[{MAX_LOSSES + 1}]"),
    ("losses", [[1, 2.0], [2]], "heartbeat.losses[1] must be a [step, loss] pair"),
    ("losses", [[1.5, 2.0]], "heartbeat.losses[0] must be a [step, loss] pair with an int"),
    ("losses", [[-1, 2.0]], "heartbeat.losses[0] must be a [step, loss] pair with an int"),
    ("losses", [[True, 2.0]], "heartbeat.losses[0] must be a [step, loss] pair with an int"),
    ("losses", [[3, None]], "heartbeat.losses[0] must be a [step, loss] pair with a loss"),
    ("losses", [[3, "lots"]], 'heartbeat.losses[0].loss must be a number, "nan"'),
    ("tokens_per_s", -1.0, "heartbeat.tokens_per_s must be a number >= 0.0"),
    ("tokens_per_s", math.nan, "heartbeat.tokens_per_s must be a finite number"),
    ("step_time_s", "1", "heartbeat.step_time_s must be a finite number"),
    ("wait_s", -0.5, "heartbeat.wait_s must be a number >= 0.0"),
    ("last_op", "all_reduce", "heartbeat.last_op must be a JSON object"),
    ("last_op", {str(i): i for i in range(65)}, "heartbeat.last_op must be a JSON object of <= 64"),
    ("mesh", {"dp": -1}, "heartbeat.mesh.dp must be an int >= 0"),
    ("mesh", {"dp": "1"}, "heartbeat.mesh.dp must be an int >= 0"),
    ("mesh", [1, 2], "heartbeat.mesh must be a JSON object"),
    ("hardware", "cpu", "heartbeat.hardware must be a JSON object"),
    ("logs", "one line", f"heartbeat.logs must be a list of <= {MAX_LOG_LINES} strings"),
    ("logs", ["x"] * (MAX_LOG_LINES + 1), "heartbeat.logs must be a list"),
    ("logs", ["ok", 3], "heartbeat.logs[1] must be a string"),
    (
        "logs",
        ["x" * (MAX_LOG_LINE_CHARS + 1)],
        f"heartbeat.logs[0] must be a string of <= {MAX_LOG_LINE_CHARS}",
    ),
    ("restart", -1, "heartbeat.restart must be an int >= 0"),
    ("format", 2, "heartbeat.format must be 1, got 2"),
    ("format", None, "heartbeat.format must be 1, got None"),
    ("type", "dump", "heartbeat.type must be 'heartbeat', got 'dump'"),
]


@pytest.mark.parametrize(("field", "value", "message"), BAD_HEARTBEAT_FIELDS)
def test_each_bad_heartbeat_field_is_refused_by_name(field: str, value: Any, message: str) -> None:
    body = heartbeat_body()
    if value is None and field not in ("format",):
        del body[field]
    else:
        body[field] = value
    with pytest.raises(RecordError, match="^" + re.escape(message)):
        # The driver gets bytes; NaN/inf travel as Python's JSON literals here, which a
        # sender never writes but a hostile client could.
        parse_heartbeat(json.dumps(body).encode())


BAD_DUMP_FIELDS = [
    ("job", None, "dump.job is missing"),
    ("rank", -1, "dump.rank must be an int >= 0"),
    ("pid", "1", "dump.pid must be an int >= 1"),
    ("request", -1, "dump.request must be an int >= 0"),
    ("sent_at", None, "dump.sent_at is missing"),
    ("stacks", 5, "dump.stacks must be a string"),
    ("last_op", [], "dump.last_op must be a JSON object"),
    ("step", "3", "dump.step must be an int >= 0"),
    ("type", "heartbeat", "dump.type must be 'dump'"),
]


@pytest.mark.parametrize(("field", "value", "message"), BAD_DUMP_FIELDS)
def test_each_bad_dump_field_is_refused_by_name(field: str, value: Any, message: str) -> None:
    body = dump_body()
    if value is None:
        del body[field]
    else:
        body[field] = value
    with pytest.raises(RecordError, match="^" + re.escape(message)):
        parse_dump(json.dumps(body))


def test_a_dump_round_trips_and_may_have_no_stacks() -> None:
    dump = StackDump("j", 1, 42, 7, 2.0, "", last_op={"name": "x"}, step=5)
    assert parse_dump(json.dumps(dump.to_json())) == dump


@pytest.mark.parametrize("parse", [parse_heartbeat, parse_dump])
def test_an_oversized_body_is_refused_before_it_is_decoded(parse: Any) -> None:
    body = b"{" + b" " * MAX_BODY_BYTES + b"}"
    with pytest.raises(RecordError, match=f"more than {MAX_BODY_BYTES}"):
        parse(body)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "heartbeat body is not JSON"),
        (b"\xff\xfe\x00", "heartbeat body is not JSON"),
        (b"[1, 2]", "heartbeat body must be a JSON object, got list"),
        (b'"text"', "heartbeat body must be a JSON object, got str"),
        (b"", "heartbeat body is not JSON"),
    ],
)
def test_a_body_that_is_not_a_json_object_is_refused(body: bytes, message: str) -> None:
    with pytest.raises(RecordError, match="^" + re.escape(message)):
        parse_heartbeat(body)


# ------------------------------------------------------------------ properties

finite = st.floats(allow_nan=False, allow_infinity=False)
text = st.text(min_size=1, max_size=40)


@st.composite
def heartbeat_records(draw: st.DrawFn) -> HeartbeatRecord:
    world = draw(st.integers(1, 10_000))
    return HeartbeatRecord(
        job=draw(text),
        rank=draw(st.integers(0, world - 1)),
        world_size=world,
        local_rank=draw(st.integers(0, 64)),
        node=draw(text),
        host=draw(text),
        pid=draw(st.integers(1, 2**22)),
        seq=draw(st.integers(0, 2**40)),
        sent_at=draw(finite),
        status=draw(st.sampled_from(("running", "stopping"))),
        phase=draw(text),
        step=draw(st.none() | st.integers(0, 2**40)),
        loss=draw(st.none() | st.floats()),
        tokens_per_s=draw(st.none() | st.floats(0, 1e12)),
        step_time_s=draw(st.none() | st.floats(0, 1e6)),
        step_at=draw(st.none() | finite),
        wait_s=draw(st.none() | st.floats(0, 1e6)),
        last_op=draw(st.none() | st.dictionaries(text, st.integers() | text, max_size=5)),
        mesh=draw(st.dictionaries(text, st.integers(0, 1024), max_size=4)),
        hardware=draw(st.dictionaries(text, st.integers() | text, max_size=4)),
        logs=tuple(draw(st.lists(st.text(max_size=MAX_LOG_LINE_CHARS), max_size=MAX_LOG_LINES))),
        restart=draw(st.integers(0, 100)),
    )


@given(heartbeat_records())
def test_every_valid_heartbeat_round_trips_through_strict_json(record: HeartbeatRecord) -> None:
    back = parse_heartbeat(json.dumps(record.to_json(), allow_nan=False).encode())
    assert same_float(back.loss, record.loss)
    assert attrs.evolve(back, loss=None) == attrs.evolve(record, loss=None)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=10,
)


@given(st.sampled_from(sorted(heartbeat_body(step=1, loss=1.0, logs=[], mesh={}))), json_values)
def test_any_value_in_any_field_parses_or_raises_record_error(field: str, value: Any) -> None:
    body = heartbeat_body(step=1, loss=1.0, logs=[], mesh={})
    body[field] = value
    outcome = _parse_or_error(json.dumps(body).encode())
    if isinstance(outcome, RecordError):
        # the message names the field (a rank is also judged against the world size)
        assert field in str(outcome) or "rank" in str(outcome), (field, str(outcome))
    else:
        assert isinstance(outcome, HeartbeatRecord)


def _parse_or_error(body: bytes) -> HeartbeatRecord | RecordError:
    try:
        return parse_heartbeat(body)
    except RecordError as e:
        return e


@given(st.binary(max_size=300))
def test_arbitrary_bytes_parse_or_raise_record_error(body: bytes) -> None:
    for parse in (parse_heartbeat, parse_dump):
        with pytest.raises(RecordError):
            parse(body)


def _fields(record: HeartbeatRecord) -> dict[str, Any]:
    return attrs.asdict(record, recurse=False)
