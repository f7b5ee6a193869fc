"""The blocklist: listed with reason and evidence, persisted atomically, shared through
its file by separate instances (a driver and node agents), damaged state refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ms_health.blocklist import Blocklist
from ms_health.cli import main


def test_listed_nodes_persist_and_are_shared_through_the_file(tmp_path: Path) -> None:
    path = tmp_path / "health" / "blocklist.json"
    driver, agent = Blocklist(path), Blocklist(path)
    assert agent.blocked("node1") is None
    driver.add("node1", "collective self-test failed", {"op": "all_reduce", "peer": 2})
    seen = agent.blocked("node1")
    assert seen is not None and seen.reason == "collective self-test failed"
    assert seen.evidence == {"op": "all_reduce", "peer": 2}
    assert [e.node for e in Blocklist(path).entries()] == ["node1"]  # a restarted driver
    assert agent.remove("node1") and not agent.remove("node1")
    assert driver.blocked("node1") is None
    assert [p.name for p in path.parent.iterdir()] == ["blocklist.json"]  # no temp files


def test_state_round_trip_and_bad_input(tmp_path: Path) -> None:
    mem = Blocklist()
    mem.add("n0", "matmul check failed")
    other = Blocklist()
    other.load_state_dict(mem.state_dict())
    assert [(e.node, e.reason) for e in other.entries()] == [("n0", "matmul check failed")]
    with pytest.raises(ValueError, match=r"state.format must be 1, got 7"):
        other.load_state_dict({"format": 7, "nodes": []})
    with pytest.raises(ValueError, match=r"state.nodes\[0\] must be"):
        other.load_state_dict({"format": 1, "nodes": [{"node": "", "reason": "x", "since": 0}]})
    with pytest.raises(ValueError, match="node must be a non-empty string"):
        mem.add("", "x")
    with pytest.raises(TypeError):
        mem.add("n1", "x", {"f": object()})
    assert [e.node for e in mem.entries()] == ["n0"]
    bad = tmp_path / "b.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        Blocklist(bad)
    bad.write_text(json.dumps({"format": 1, "nodes": "n0"}))
    with pytest.raises(ValueError, match=r"nodes must be a list, got str"):
        Blocklist(bad)


def test_the_command_lists_checks_and_clears_hosts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "blocklist.json"
    Blocklist(path).add("gpu-17", "matmul check failed: 0.2x the floor")
    assert main(["blocklist", "--file", str(path), "list"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("gpu-17  since ") and out.rstrip().endswith(
        "UTC  matmul check failed: 0.2x the floor"
    )
    assert main(["blocklist", "--file", str(path), "check", "gpu-17"]) == 1  # listed
    assert "gpu-17" in capsys.readouterr().out
    assert main(["blocklist", "--file", str(path), "check", "gpu-18"]) == 0
    assert "not on the blocklist" in capsys.readouterr().out
    assert main(["blocklist", "--file", str(path), "remove", "gpu-17"]) == 0
    assert main(["blocklist", "--file", str(path), "remove", "gpu-17"]) == 1
    assert "gpu-17: not on the blocklist" in capsys.readouterr().err
    assert Blocklist(path).entries() == []
    path.write_text("{not json")
    assert main(["blocklist", "--file", str(path), "list"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ms-health blocklist: error: blocklist ") and "is not JSON" in err
