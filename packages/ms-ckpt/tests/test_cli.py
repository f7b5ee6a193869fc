"""``ms-ckpt ls``, ``inspect`` and ``convert`` end to end, in subprocesses, on checkpoints
written by ``Checkpointer``: listings, verification, damage reports, exit codes, and
conversions that ``torch.load`` and ``torch.distributed.checkpoint.load`` read back."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ms_ckpt import Checkpointer, rng_state
from ms_ckpt.cli import main

STEP_DIR = "step-{:08d}"


def ms_ckpt(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ms_ckpt.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def make_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.95))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {
        "model": model,
        "optim": opt,
        "rng": rng_state(),
        "extra": {
            "bf16": torch.randn(5, 2).to(torch.bfloat16),
            "i64": torch.arange(7, dtype=torch.int64) * (2**40),
            "empty": torch.empty(0, 3),
        },
        "step": 2,
        "note": ("run", 1.5),
    }


def as_stored(state: dict[str, Any]) -> dict[str, Any]:
    """What the checkpoint stores: Stateful objects replaced by their state_dicts."""
    out = {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in state.items()}
    return copy.deepcopy(out)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """Committed steps 1 and 2, ``latest`` at 2, and a partial step 3 (a shard, no
    manifest: a save that crashed). Returns the root and step 2's stored state."""
    root = tmp_path_factory.mktemp("ckpt")
    state = make_state()
    with Checkpointer(str(root), stage2="inline") as ck:
        ck.save(1, state).wait(timeout=60)
        expected = as_stored(state)  # nothing random runs between this and the save
        ck.save(2, state).wait(timeout=60)
    partial = root / STEP_DIR.format(3)
    partial.mkdir()
    (partial / "rank-00000.bin").write_bytes(b"\x28\xb5\x2f\xfd" * 10)
    return root, expected


def manifest(root: Path, step: int) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((root / STEP_DIR.format(step) / "manifest.json").read_text())
    return doc


def assert_same(a: Any, b: Any, path: str = "") -> None:
    if isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(b, np.ndarray):
        assert np.array_equal(a, b), path
    elif isinstance(b, dict):
        assert isinstance(a, dict) and list(a) == list(b), path
        for k in b:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(b, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}/{i}")
    else:
        assert a == b, path


def test_ls_lists_committed_partial_sizes_records_latest(
    ckpt: tuple[Path, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    root, _ = ckpt
    code = main(["ls", str(root)])  # in-process: the other tests run the real command
    out = capsys.readouterr()
    assert code == 0, out.err
    lines = out.out.splitlines()
    assert lines[0].split() == ["STEP", "STATE", "BYTES", "RECORDS"]
    rows = {int(line.split()[0]): line.split()[1:] for line in lines[1:]}
    assert sorted(rows) == [1, 2, 3]
    for step in (1, 2, 3):
        size = sum(f.stat().st_size for f in (root / STEP_DIR.format(step)).iterdir())
        assert rows[step][1] == str(size), (step, out.out)
    for step in (1, 2):
        n = len(manifest(root, step)["records"])
        assert rows[step][0] == "committed" and rows[step][2] == str(n)
    assert rows[1][3:] == [] and rows[2][3:] == ["latest"]
    assert rows[3] == ["partial", "40", "-"]


@pytest.mark.slow  # runs the command in a fresh interpreter (a torch import)
def test_inspect_reports_manifest_and_verifies_every_record(
    ckpt: tuple[Path, dict[str, Any]],
) -> None:
    root, _ = ckpt
    proc = ms_ckpt("inspect", f"file://{root}")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "format: ms-ckpt version 1, step 2" in out
    assert "world: world_size 1, dp_size 1, parts 1" in out
    assert "compression: zstd level 3" in out
    records = manifest(root, 2)["records"]
    for rec in records:
        line = next(x for x in out.splitlines() if x.split()[:3] == ["0", rec["key"], rec["kind"]])
        if rec["kind"] == "tensor":
            assert rec["dtype"] in line and str(tuple(rec["shape"])) in line, line
        assert line.split()[-3:] == [str(rec["length"]), str(rec["raw_length"]), "OK"], line
    assert "extra/bf16" in out and "bfloat16" in out
    assert f"verified: all {len(records)} records OK" in out
    older = ms_ckpt("inspect", root, "--step", 1)
    assert older.returncode == 0 and "step 1" in older.stdout


@pytest.mark.slow  # runs the command in a fresh interpreter (a torch import)
@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_inspect_names_damaged_file_and_key(
    ckpt: tuple[Path, dict[str, Any]], tmp_path: Path, damage: str
) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(ckpt[0], root)
    rec = next(r for r in manifest(root, 2)["records"] if r["key"] == "extra/bf16")
    shard = root / STEP_DIR.format(2) / rec["file"]
    data = bytearray(shard.read_bytes())
    if damage == "flip":
        data[rec["offset"] + rec["length"] // 2] ^= 0x10
    else:
        data = data[: rec["offset"] + rec["length"] - 1]
    shard.write_bytes(bytes(data))
    proc = ms_ckpt("inspect", root)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    bad = [x for x in proc.stdout.splitlines() if x.startswith("DAMAGED:")]
    assert bad and str(shard) in bad[0] and "'extra/bf16'" in bad[0], proc.stdout
    assert ("truncated" if damage == "truncate" else "crc32") in bad[0]
    model_line = next(x for x in proc.stdout.splitlines() if x.split()[1:2] == ["model/0.weight"])
    assert model_line.endswith("OK")
    assert "damaged" in proc.stderr


@pytest.mark.slow  # runs the command in a fresh interpreter (a torch import)
def test_inspect_damaged_manifest(ckpt: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(ckpt[0], root)
    path = root / STEP_DIR.format(2) / "manifest.json"
    doc = json.loads(path.read_text())
    doc["world"]["writers"][0]["bytes"] += 1  # a bit flip the JSON parser cannot see
    path.write_text(json.dumps(doc))
    proc = ms_ckpt("inspect", root)
    assert proc.returncode == 1 and "manifest checksum mismatch" in proc.stdout
    assert str(path) in proc.stdout


@pytest.mark.slow  # runs the command in a fresh interpreter (a torch import)
def test_usage_errors_exit_2_with_a_message(
    ckpt: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, _ = ckpt
    for args, message in [
        (("inspect",), "the following arguments are required: URL"),
        (("inspect", root, "--step", 3), "step 3 is partial"),
    ]:
        proc = ms_ckpt(*args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert message in proc.stderr and "Traceback" not in proc.stderr, (args, proc.stderr)
    # The same code path in-process, for the rest (each subprocess pays a torch import).
    for argv, message in [
        (["inspect", str(root), "--step", "99"], "step 99 does not exist"),
        (["inspect", str(tmp_path)], "no committed checkpoint"),
        (["convert", str(tmp_path), str(tmp_path / "out.pt")], "no committed checkpoint"),
        (["ls", str(tmp_path / "missing")], "not a directory"),
    ]:
        assert main(argv) == 2, argv
        assert message in capsys.readouterr().err, argv
    with pytest.raises(SystemExit) as exc:
        main(["convert", str(root)])
    assert exc.value.code == 2 and "OUT" in capsys.readouterr().err


@pytest.mark.slow  # runs the command in a fresh interpreter (a torch import)
def test_convert_to_torch_save(ckpt: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    root, expected = ckpt
    out = tmp_path / "state.pt"
    proc = ms_ckpt("convert", root, out)
    assert proc.returncode == 0, proc.stderr
    assert "step 2" in proc.stdout
    loaded = torch.load(out, weights_only=False)
    assert_same(loaded, expected)
    # The module state_dict keeps its _metadata, so it loads like the original.
    model = make_state()["model"]
    model.load_state_dict(loaded["model"])


@pytest.mark.slow  # runs the command in a fresh interpreter (a torch import)
def test_convert_to_dcp_loads_into_a_plain_state_dict(
    ckpt: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    import torch.distributed.checkpoint as dcp

    root, expected = ckpt
    out = tmp_path / "dcp"
    proc = ms_ckpt("convert", root, out, "--to", "dcp", "--step", 2)
    assert proc.returncode == 0, proc.stderr
    assert "Warning" not in proc.stderr, proc.stderr

    def zeroed(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return torch.zeros_like(x)
        if isinstance(x, dict):
            return {k: zeroed(v) for k, v in x.items()}
        return x

    target = zeroed(expected)
    target["step"] = -1
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(target, checkpoint_id=str(out), no_dist=True)
    assert_same(target, expected)


@pytest.mark.slow  # runs the command in a fresh interpreter (a torch import)
def test_console_script_is_installed() -> None:
    script = Path(sys.executable).with_name("ms-ckpt")
    proc = subprocess.run(
        [str(script), "--help"], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "usage: ms-ckpt" in proc.stdout and "convert" in proc.stdout
