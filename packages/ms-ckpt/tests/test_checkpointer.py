"""Checkpointer on real files (file://, with the stage-2 writer process) and memory://
(stage 2 inline): round trips, stage-1 isolation, the in-flight policy, retention and
load-time checks."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import torch

from ms_ckpt import (
    Checkpointer,
    CheckpointError,
    CheckpointWriteError,
    committed_steps,
    rng_state,
)

HERE = Path(__file__).parent
if str(HERE) not in sys.path:  # the writer process imports the hooks by module name
    sys.path.insert(0, str(HERE))
from _writer_faults import PauseAt, RecordModules  # noqa: E402

DEADLINE = 60.0  # for every wait on a save


class Counter:
    """A user Stateful object with a versioned state."""

    def __init__(self, n: int = 0) -> None:
        self.n = n
        self.history: list[int] = []

    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, "n": self.n, "history": list(self.history)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd["version"] != 1:
            raise ValueError(f"Counter state version must be 1, got {sd['version']}")
        self.n, self.history = sd["n"], list(sd["history"])


def make_state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.95))
    if seed == 0:  # the saved state has optimizer moments; the fresh one has none
        model(torch.randn(3, 6)).sum().backward()
        opt.step()
    counter = Counter(seed + 5)
    counter.history = [seed, seed + 1]
    g = torch.Generator().manual_seed(seed + 1)
    return {
        "model": model,
        "optim": opt,
        "rng": rng_state(),
        "counter": counter,
        "tensors": {
            "bf16": torch.randn(4, 3, generator=g).to(torch.bfloat16),
            "f16": torch.randn(7, generator=g).half(),
            "i64": torch.randint(-(2**40), 2**40, (5,), generator=g),
            "bool": torch.rand(9, generator=g) > 0.5,
            "scalar": torch.tensor(3.5 + seed),
            "empty": torch.empty(0, 4),
            "strided": torch.randn(4, 6, generator=g).t(),
        },
        "nested": [torch.full((2,), float(seed)), (seed, "a"), {"k": None}],
        "meta": {"epoch": seed, "lr": 0.5 + seed, "name": f"run{seed}", "inf": float("inf")},
    }


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    ma, mb = a["model"].state_dict(), b["model"].state_dict()
    assert ma.keys() == mb.keys()
    for k in ma:
        assert torch.equal(ma[k], mb[k]), k
    oa, ob = a["optim"].state_dict(), b["optim"].state_dict()
    assert oa["param_groups"] == ob["param_groups"]
    assert oa["state"].keys() == ob["state"].keys() and oa["state"]
    for i in oa["state"]:
        for k, v in oa["state"][i].items():
            assert torch.equal(v, ob["state"][i][k]), (i, k)
    for k, t in a["tensors"].items():
        u = b["tensors"][k]
        assert t.dtype == u.dtype and t.shape == u.shape and torch.equal(t, u), k
    assert torch.equal(a["nested"][0], b["nested"][0]) and a["nested"][1:] == b["nested"][1:]
    assert a["meta"] == b["meta"]
    assert a["counter"].state_dict() == b["counter"].state_dict()


@pytest.mark.parametrize("scheme", [pytest.param("file", marks=pytest.mark.slow), "memory"])
def test_round_trip(tmp_path: Path, scheme: str) -> None:
    url = f"file://{tmp_path}/ck" if scheme == "file" else f"memory://ck-{uuid.uuid4().hex}"
    saved = make_state(0)
    torch.manual_seed(1234)
    with Checkpointer(url) as ckpt:
        assert ckpt.stage2 == ("process" if scheme == "file" else "inline")
        handle = ckpt.save(100, saved)
        handle.wait(timeout=DEADLINE)
        assert handle.done() and not handle.skipped
        # What every RNG gives right after the save; load must bring these back.
        expected = (torch.rand(5), np.random.rand(3), random.random())
        fresh = make_state(1)
        live_bf16 = fresh["tensors"]["bf16"]
        assert ckpt.load(fresh) == 100
    assert_same(saved, fresh)
    assert fresh["tensors"]["bf16"] is live_bf16  # restored in place, not replaced
    assert torch.equal(torch.rand(5), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1]) and random.random() == expected[2]
    fs, root = fsspec.core.url_to_fs(url)
    assert fs.cat_file(f"{root}/latest").decode().strip() == "step-00000100"
    manifest = json.loads(fs.cat_file(f"{root}/step-00000100/manifest.json"))
    assert manifest["step"] == 100 and manifest["world"]["world_size"] == 1
    keys = {r["key"]: r for r in manifest["records"]}
    assert keys["tensors/bf16"]["dtype"] == "bfloat16" and keys["tensors/bf16"]["shape"] == [4, 3]
    if scheme == "memory":
        fs.rm(root, recursive=True)


def test_uncompressed_round_trip(tmp_path: Path) -> None:
    saved = make_state(0)
    with Checkpointer(str(tmp_path), compression="none") as ckpt:
        ckpt.save(1, saved).wait(timeout=DEADLINE)
        fresh = make_state(1)
        ckpt.load(fresh)
    assert_same(saved, fresh)
    manifest = json.loads((tmp_path / "step-00000001" / "manifest.json").read_text())
    assert all(r["length"] == r["raw_length"] for r in manifest["records"])


def test_tensor_changed_after_save_returns_is_not_written(tmp_path: Path) -> None:
    w = torch.arange(10_000, dtype=torch.float32)
    model = torch.nn.Linear(4, 4)
    before = model.weight.detach().clone()
    # The writer waits 0.5 s before reading the host buffer: the edits below land first.
    with Checkpointer(str(tmp_path), hook=PauseAt("stage2", 0.5)) as ckpt:
        handle = ckpt.save(1, {"w": w, "model": model})
        w.add_(1)
        with torch.no_grad():
            model.weight.zero_()
        assert not handle.done()
        handle.wait(timeout=DEADLINE)
        got = {"w": torch.zeros(10_000), "model": torch.nn.Linear(4, 4)}
        ckpt.load(got)
    assert torch.equal(got["w"], torch.arange(10_000, dtype=torch.float32))
    assert torch.equal(got["model"].weight, before)


@pytest.mark.slow  # holds stage 2 for 0.5-1 s on purpose
def test_skip_policy_returns_skipped_handle(tmp_path: Path) -> None:
    state = {"w": torch.ones(3)}
    hook = PauseAt("stage2", 1, steps=[1])
    with Checkpointer(str(tmp_path), policy="skip", hook=hook) as ckpt:
        first = ckpt.save(1, state)
        second = ckpt.save(2, state)
        assert second.skipped and second.done() and not first.done()
        second.wait(timeout=0)  # a skipped save has nothing to wait for
        first.wait(timeout=DEADLINE)
        third = ckpt.save(3, state)
        assert not third.skipped
        third.wait(timeout=DEADLINE)
        fourth = ckpt.save(4, state)
        deadline = time.monotonic() + 60
        while not ckpt._conn.poll(0.05):  # the writer has answered; nobody collected it
            assert time.monotonic() < deadline, "the writer did not answer"
        fifth = ckpt.save(5, state)  # the writer is idle: not skipped
        assert not fifth.skipped and fourth.done()
        fifth.wait(timeout=DEADLINE)
        assert ckpt.steps() == {1: True, 3: True, 4: True, 5: True}


@pytest.mark.slow  # holds stage 2 for 0.5-1 s on purpose
def test_wait_policy_waits_for_the_save_in_flight(tmp_path: Path) -> None:
    w = torch.zeros(3)
    with Checkpointer(str(tmp_path), hook=PauseAt("stage2", 0.5)) as ckpt:
        first = ckpt.save(1, {"w": w})
        w.fill_(2)
        second = ckpt.save(2, {"w": w})  # blocks until step 1 is committed
        assert first.done() and not second.skipped
        second.wait(timeout=DEADLINE)
        got = {"w": torch.empty(3)}
        assert ckpt.load(got, step=1) == 1 and torch.equal(got["w"], torch.zeros(3))
        assert ckpt.load(got) == 2 and torch.equal(got["w"], torch.full((3,), 2.0))


def test_keep_last_keeps_newest_and_cleans_old_partials(tmp_path: Path) -> None:
    state = {"w": torch.ones(3)}
    with Checkpointer(str(tmp_path), keep_last=2) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, state).wait(timeout=DEADLINE)
        assert ckpt.steps() == {2: True, 3: True}
        (tmp_path / "step-00000001").mkdir()  # partials left by crashes
        (tmp_path / "step-00000009").mkdir()
        ckpt.save(4, state).wait(timeout=DEADLINE)
        # Step 1's partial is older than the newest commit: cleaned. Step 9 may be a
        # save still in flight elsewhere: kept.
        assert ckpt.steps() == {3: True, 4: True, 9: False}
    assert (tmp_path / "latest").read_text().strip() == "step-00000004"


def test_load_refuses_mismatched_state(tmp_path: Path) -> None:
    with Checkpointer(str(tmp_path)) as ckpt:
        with pytest.raises(CheckpointError, match="no committed checkpoint"):
            ckpt.load({"w": torch.ones(3)})
        ckpt.save(5, {"w": torch.ones(3), "model": torch.nn.Linear(3, 2)}).wait(timeout=DEADLINE)
        with pytest.raises(CheckpointError, match=r"state\['w'\].*float32 \(3,\).*float64"):
            ckpt.load({"w": torch.ones(3, dtype=torch.float64), "model": torch.nn.Linear(3, 2)})
        with pytest.raises(CheckpointError, match=r"state\['model/weight'\].*\(2, 3\).*\(4, 3\)"):
            ckpt.load({"w": torch.ones(3), "model": torch.nn.Linear(3, 4)})
        with pytest.raises(CheckpointError, match=r"state\['extra'\]: not in the checkpoint"):
            ckpt.load({"w": torch.ones(3), "model": torch.nn.Linear(3, 2), "extra": 1})
        with pytest.raises(CheckpointError, match="step 4 has no committed checkpoint"):
            ckpt.load({"w": torch.ones(3)}, step=4)


def test_arguments_are_validated(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep_last must be None or an int >= 1, got 0"):
        Checkpointer(str(tmp_path), keep_last=0)
    with pytest.raises(ValueError, match="compression must be"):
        Checkpointer(str(tmp_path), compression="lz4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="another process cannot see"):
        Checkpointer("memory://x", stage2="process")
    with pytest.raises(ValueError, match=r"nice must be an int in \[0, 19\], got 20"):
        Checkpointer(str(tmp_path), nice=20)
    with pytest.raises(ValueError, match="commit_timeout must be a number > 0 seconds, got 0"):
        Checkpointer(str(tmp_path), commit_timeout=0)
    with pytest.raises(ValueError, match=r"torch\.distributed is not initialized"):
        Checkpointer(str(tmp_path), dp_group=object())


def test_pool_grows_and_latest_never_moves_back(tmp_path: Path) -> None:
    small = {"w": torch.arange(10.0)}
    big = {"w": torch.arange(300_000.0)}  # needs a larger host segment: the writer remaps
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(5, small).wait(timeout=DEADLINE)
        first_pool = ckpt._pool.name
        # Re-saving an older step must not move 'latest' back.
        ckpt.save(3, big).wait(timeout=DEADLINE)
        assert ckpt._pool.name != first_pool
        assert (tmp_path / "latest").read_text().strip() == "step-00000005"
        got = {"w": torch.empty(300_000)}
        assert ckpt.load(got, step=3) == 3 and torch.equal(got["w"], big["w"])
        got = {"w": torch.empty(10)}
        assert ckpt.load(got) == 5 and torch.equal(got["w"], small["w"])


def test_latest_step_is_the_newest_committed_step_or_none(tmp_path: Path) -> None:
    with Checkpointer(str(tmp_path), stage2="inline") as ckpt:
        assert ckpt.latest_step() is None
        (tmp_path / "step-00000007").mkdir()  # a partial step: a save that crashed
        assert ckpt.steps() == {7: False} and ckpt.latest_step() is None
        ckpt.save(3, {"w": torch.ones(3)}).wait(timeout=DEADLINE)
        ckpt.save(5, {"w": torch.ones(3)}).wait(timeout=DEADLINE)
        assert ckpt.latest_step() == 5  # the partial step 7 is newer, but not committed
        got = {"w": torch.zeros(3)}
        assert ckpt.load(got) == ckpt.latest_step()


def test_committed_steps_lists_storage_without_a_checkpointer(tmp_path: Path) -> None:
    """What a launcher or preflight asks before any Checkpointer (a collective under a
    process group) exists: the committed steps, oldest first; partial ones left out."""
    root = tmp_path / "ckpt"
    assert committed_steps(str(root)) == []  # no directory yet
    with Checkpointer(str(root), stage2="inline") as ckpt:
        for step in (12, 3):
            ckpt.save(step, {"w": torch.ones(3)}).wait(timeout=DEADLINE)
    (root / "step-00000020").mkdir()  # partial
    (root / "notes").mkdir()
    assert committed_steps(str(root)) == [3, 12]
    assert committed_steps(f"file://{root}") == [3, 12]
    fs = fsspec.filesystem("memory")
    with Checkpointer("/ms-ckpt-steps", fs=fs) as ckpt:
        ckpt.save(4, {"w": torch.ones(3)}).wait(timeout=DEADLINE)
    assert committed_steps("/ms-ckpt-steps", fs=fs) == [4]


def test_hook_sees_every_point_in_order_before_the_commit(tmp_path: Path) -> None:
    seen: list[tuple[str, int, bool]] = []
    manifest = tmp_path / "step-00000004" / "manifest.json"

    def hook(point: str, step: int) -> None:
        seen.append((point, step, manifest.exists()))
        if point == "manifest":  # durable under its temporary name, not yet renamed
            (tmp,) = manifest.parent.glob("manifest.json.tmp-*")
            assert json.loads(tmp.read_text())["step"] == 4

    state = {"a": torch.ones(3), "b": torch.zeros(2), "c": torch.ones(1)}
    with Checkpointer(str(tmp_path), stage2="inline", hook=hook) as ckpt:
        ckpt.save(4, state).wait(timeout=DEADLINE)
    assert seen == [("stage2", 4, False)] + [("record", 4, False)] * 3 + [("manifest", 4, False)]
    assert manifest.exists()


def test_a_failing_hook_fails_the_save_and_the_next_one_works(tmp_path: Path) -> None:
    def hook(point: str, step: int) -> None:
        if point == "manifest" and step == 1:
            raise RuntimeError("injected before the commit")

    with Checkpointer(str(tmp_path), stage2="inline", hook=hook) as ckpt:
        with pytest.raises(CheckpointWriteError, match="injected before the commit"):
            ckpt.save(1, {"w": torch.ones(3)}).wait(timeout=DEADLINE)
        assert ckpt.steps() == {} and ckpt.latest_step() is None
        ckpt.save(2, {"w": torch.ones(3)}).wait(timeout=DEADLINE)
        assert ckpt.latest_step() == 2


def test_hook_must_be_callable_and_pickle_for_a_writer_process(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="hook must be callable as hook\\(point, step\\), got 3"):
        Checkpointer(str(tmp_path), hook=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="hook must pickle, since it runs in the writer process"):
        Checkpointer(str(tmp_path), hook=lambda point, step: None)
    Checkpointer(str(tmp_path), stage2="inline", hook=lambda point, step: None).finalize()


@pytest.mark.slow
def test_a_hook_from_the_users_script_is_refused_for_a_writer_process(tmp_path: Path) -> None:
    """A function of the running script pickles as __main__.f, which the writer's own
    interpreter cannot find: refused when the Checkpointer is built, not at a save."""
    script = tmp_path / "train.py"
    script.write_text(
        "import sys\n"
        "from ms_ckpt import Checkpointer\n"
        "def hook(point, step):\n"
        "    pass\n"
        "try:\n"
        "    Checkpointer(sys.argv[1], hook=hook)\n"
        "except TypeError as e:\n"
        "    print(e)\n"
        "    sys.exit(3)\n"
    )
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "hook must be importable from a module" in proc.stdout
    assert "__main__" in proc.stdout


def test_writer_process_imports_no_torch(tmp_path: Path) -> None:
    report = tmp_path / "writer-modules.json"
    with Checkpointer(str(tmp_path / "ck"), hook=RecordModules(str(report))) as ckpt:
        ckpt.save(1, {"w": torch.ones(3)}).wait(timeout=DEADLINE)
        writer = ckpt.writer_pid
    got = json.loads(report.read_text())
    assert got["pid"] == writer  # it ran in the writer, not here
    assert got["torch_modules"] == []


@pytest.mark.gpu
def test_stage1_waits_for_the_current_stream_only(tmp_path: Path) -> None:
    """A kernel on another stream still runs when ``save()`` returns; the state made on
    the current stream is what gets written."""
    w = torch.arange(1 << 20, device="cuda", dtype=torch.float32).mul_(3)
    with Checkpointer(str(tmp_path)) as ckpt:
        # The first save starts the writer and maps the host buffer, and the first
        # mul_ loads its kernel: with CUDA's lazy module loading a first launch can
        # wait for every stream. Only the second save, after warm kernels, is under test.
        ckpt.save(1, {"w": w}).wait(timeout=DEADLINE)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(10_000_000_000)  # seconds of GPU cycles, off the state's path
            side_done = torch.cuda.Event()
            side_done.record()
        # current stream: a stage 1 that did not wait for it would copy w before the mul_
        torch.cuda._sleep(200_000_000)
        w.mul_(3)
        handle = ckpt.save(2, {"w": w})
        assert not side_done.query()  # a global synchronize would have waited for it
        handle.wait(timeout=DEADLINE)
        got = {"w": torch.zeros(1 << 20)}
        ckpt.load(got)
    side_done.synchronize()
    assert torch.equal(got["w"], torch.arange(1 << 20, dtype=torch.float32) * 9)


def test_optional_keys_may_be_missing_from_an_older_checkpoint(tmp_path) -> None:
    class Plan:
        def __init__(self) -> None:
            self.plan = {"a": 1}
            self.loaded = False

        def state_dict(self) -> dict:
            return {"plan": dict(self.plan)}

        def load_state_dict(self, state: dict) -> None:
            self.plan, self.loaded = dict(state["plan"]), True

    with Checkpointer(str(tmp_path), stage2="inline") as ckpt:
        ckpt.save(1, {"w": torch.ones(3), "step": 1}).wait()
        state = {"w": torch.zeros(3), "step": 0, "plan": Plan()}
        with pytest.raises(CheckpointError, match=r"state\['plan'\]: not in the checkpoint"):
            ckpt.load(state)
        assert ckpt.load(state, optional=("plan",)) == 1
        assert torch.equal(state["w"], torch.ones(3)) and state["step"] == 1
        assert not state["plan"].loaded  # left as it is
        ckpt.save(2, {"w": torch.full((3,), 2.0), "step": 2, "plan": Plan()}).wait()
        fresh = {"w": torch.zeros(3), "step": 0, "plan": Plan()}
        fresh["plan"].plan = {}
        assert ckpt.load(fresh, optional=("plan",)) == 2
        assert fresh["plan"].loaded and fresh["plan"].plan == {"a": 1}
        with pytest.raises(TypeError, match="optional must be a collection of key names"):
            ckpt.load(fresh, optional="plan")
