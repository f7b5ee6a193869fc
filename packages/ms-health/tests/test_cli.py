"""``python -m ms_health.driver`` and ``ms-health driver`` in real processes: serving,
token handling, state and events on SIGTERM, one-line errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from ms_health.cli import COMMANDS, main

sys.path.insert(0, str(Path(__file__).parent))
from _driver_support import DEADLINE_S, TOKEN, heartbeat_body, request, wait_until

HERE = Path(__file__).parent


def start(*args: str, module: str = "ms_health.driver") -> subprocess.Popen[str]:
    # The tests folder is importable, for --detectors _driver_support:make_detectors.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["module", "dispatcher"])
def test_the_driver_serves_until_sigterm_and_saves_its_state(tmp_path: Path, how: str) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(f"  {TOKEN}\n")
    state, events = tmp_path / "state.json", tmp_path / "events.jsonl"
    args = ["--port", "0", "--token-file", str(token_file), "--state", str(state),
            "--events", str(events), "--observe-only",
            "--detectors", "_driver_support:make_detectors"]  # fmt: skip
    proc = start(*args) if how == "module" else start("driver", *args, module="ms_health.cli")
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line and "(observe-only)" in line
        url = line.split("listening on ")[1].split()[0]
        assert request(url, "POST", "/heartbeat", body=heartbeat_body())[0] == 200
        assert request(url, "GET", "/status", token="nope")[0] == 401
        status = request(url, "GET", "/status")[1]
        assert status["observe_only"] is True and status["job"] == "j"
        # the silence detector runs: rank 0 stops beating and a "would act" follows
        wait_until(lambda: '"would act' in events.read_text(), "a finding", DEADLINE_S)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=DEADLINE_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert out.strip().endswith("ms-health driver: stopped")
    assert TOKEN not in out + err + events.read_text() + state.read_text()
    saved = json.loads(state.read_text())
    assert saved["job"] == "j" and "silence" in saved["detectors"]
    kinds = [json.loads(line)["kind"] for line in events.read_text().splitlines()]
    assert kinds[0] == "start" and kinds[-1] == "stop" and "finding" in kinds


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("missing", "--token-file '{dir}/token' cannot be read"),
        ("empty", "--token-file '{dir}/token' is empty"),
        ("bad state", "state_path '{dir}/state.json' cannot be read"),
        ("bad detectors", "--detectors must be MODULE:CALLABLE, got 'nothing'"),
    ],
)
def test_bad_inputs_are_one_line_and_exit_2(
    tmp_path: Path, setup: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    token, state = tmp_path / "token", tmp_path / "state.json"
    if setup != "missing":
        token.write_text("" if setup == "empty" else TOKEN)
    state.write_text("{" if setup == "bad state" else "{}")
    args = ["driver", "--token-file", str(token), "--tick", "0.1"]
    if setup == "bad state":
        args += ["--state", str(state)]
    if setup == "bad detectors":
        args += ["--detectors", "nothing"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("ms-health driver: error: " + message.format(dir=tmp_path))


def test_the_dispatcher(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2 and "usage: ms-health COMMAND" in capsys.readouterr().err
    assert main(["--help"]) == 0 and "driver" in capsys.readouterr().out
    assert main(["nope"]) == 2
    assert "unknown command 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["driver", "--help"])
    assert e.value.code == 0 and "--token-file" in capsys.readouterr().out
    assert set(COMMANDS) == {"driver", "blocklist"}


def test_the_console_script_is_declared() -> None:
    with open(HERE.parent / "pyproject.toml", "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert scripts == {"ms-health": "ms_health.cli:main"}
