"""The benchmark scripts run: the GPU one says so without CUDA, and --smoke walks every path.

Benchmarks are not tests, so nothing here looks at a timing; these only check that a
script starts, takes its flags, prints its tables and writes JSON only when it measured.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _workspace import ROOT

NORMS_TITLE = "## norms and activations"
ATTENTION_TITLE = "## sliding-window attention"
NORM_OPS = (
    "layer_norm",
    "add + layer_norm",
    "rms_norm",
    "add + rms_norm",
    "bias + gelu (erf)",
    "bias + gelu (tanh)",
)
ATTENTION_CANDIDATES = (
    "ms (torch backend)",
    "flash-attn",
    "SDPA causal (no window)",
    "SDPA + window mask",
)


def _hidden_cuda() -> dict[str, str]:
    """This environment with CUDA hidden, and without the interpreter the workspace
    conftest sets."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return env | {"CUDA_VISIBLE_DEVICES": ""}


def _run_gpu_kernels(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return _run_bench("kernels/gpu_kernels.py", *args, cwd=cwd, env=_hidden_cuda())


def _rows(table: str, first_column: str) -> list[str]:
    return [line for line in table.splitlines() if line.startswith(first_column)]


def test_gpu_kernels_without_cuda_says_so_and_measures_nothing(tmp_path: Path) -> None:
    proc = _run_gpu_kernels(cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("no CUDA device"), proc.stdout
    assert not list(tmp_path.rglob("*")), "wrote files without measuring anything"


@pytest.mark.slow
def test_gpu_kernels_smoke_prints_every_table_and_writes_nothing(tmp_path: Path) -> None:
    proc = _run_gpu_kernels("--smoke", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.startswith("smoke: not a measurement"), out[:500]
    assert "no CUDA device" not in out
    norms, found, attention = out.partition(f"\n{ATTENTION_TITLE}")
    assert NORMS_TITLE in norms and "smoke: not a measurement" in norms
    assert found, f"no attention table in:\n{out}"
    for op in NORM_OPS:
        rows = _rows(norms, op + " ")
        # ms, eager and compile for fwd and fwd+bwd; the ms rows carry numbers
        assert len(rows) == 6, (op, rows)
        ms_rows = [r for r in rows if "ms (torch backend)" in r]
        assert len(ms_rows) == 2 and all(r.split()[-1] == "1.00" for r in ms_rows), ms_rows
    for name in ATTENTION_CANDIDATES:
        assert name in attention, name
    ms_rows = [r for r in attention.splitlines() if "ms (torch backend)" in r]
    # 2 shapes x (full causal, one window) x (fwd, fwd+bwd), each with a t/t_ms of 1.00
    assert len(ms_rows) == 8 and all(r.split()[-1] == "1.00" for r in ms_rows), ms_rows
    assert "error:" not in out and "OOM" not in out, out
    assert not list(tmp_path.rglob("*")), "--smoke wrote files"


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--norm-shapes", "8192x4096,16384"), ["--norm-shapes", "tokens x hidden", "'16384'"]),
        (("--attention-shapes", "4x4096x32x8"), ["--attention-shapes", "'4x4096x32x8'"]),
        (("--windows", "causal,0"), ["--windows", "or 'causal'", "'0'"]),
        (
            ("--attention-shapes", "1x1024x12x8x64"),
            ["--attention-shapes", "multiple of key/value heads", "12 query heads, 8"],
        ),
    ],
)
def test_gpu_kernels_refuses_a_bad_case_list(
    tmp_path: Path, args: tuple[str, ...], words: list[str]
) -> None:
    proc = _run_gpu_kernels(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert all(w in proc.stderr for w in words), proc.stderr
    assert not list(tmp_path.rglob("*"))


@pytest.mark.slow
def test_gpu_kernels_only_runs_one_section(tmp_path: Path) -> None:
    proc = _run_gpu_kernels("--smoke", "--only", "norms", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert NORMS_TITLE in proc.stdout and ATTENTION_TITLE not in proc.stdout


def _run_bench(
    script: str, *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``tools/bench/<script> args`` in ``cwd`` (with ``env``, else this process's
    environment), at most 240 s."""
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench" / script), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def test_attention_tiles_without_cuda_says_so_and_measures_nothing(tmp_path: Path) -> None:
    proc = _run_bench("kernels/attention_tiles.py", cwd=tmp_path, env=_hidden_cuda())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("no CUDA device"), proc.stdout
    assert not list(tmp_path.rglob("*")), "wrote files without measuring anything"


@pytest.mark.slow
def test_attention_tiles_smoke_sweeps_every_kernel_and_writes_nothing(tmp_path: Path) -> None:
    proc = _run_bench("kernels/attention_tiles.py", "--smoke", cwd=tmp_path, env=_hidden_cuda())
    assert proc.returncode == 0, proc.stderr[-3000:]
    for kernel in ("fwd", "dkdv", "dq"):
        assert f"## d=16 {kernel}: current 64x64 w4 s1: ok" in proc.stdout, proc.stdout
        assert f"best {kernel} d=16: " in proc.stdout, proc.stdout
    assert "wrong" not in proc.stdout and "Error" not in proc.stdout, proc.stdout
    assert proc.stdout.rstrip().endswith("smoke: not a measurement; no JSON written")
    assert not list(tmp_path.rglob("*"))


def test_attention_tiles_marks_a_launch_whose_results_differ_as_wrong() -> None:
    # The guard that keeps a fast but wrong launch from winning: the same launch is
    # "ok" against its own results and "wrong" once the reference is changed.
    spec = importlib.util.spec_from_file_location(
        "attention_tiles", ROOT / "tools" / "bench" / "kernels" / "attention_tiles.py"
    )
    assert spec is not None and spec.loader is not None
    tiles = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiles)
    cpu = torch.device("cpu")
    case = tiles.Case((1, 40, 2, 1, 16), 8, torch.float32, cpu)
    base = tiles.kernels._block_sizes(16, torch.float32, interpreting=True)
    tile = tiles.kernels._Tile(16, 32)
    timer = tiles.Timer(cpu)
    ok = tiles.time_launch("dkdv", tile, base, [case], timer, cpu, reps=1)
    assert ok["status"] == "ok", ok
    dq, dk, dv = case.grads
    case.grads = (dq, dk * 1.05, dv)
    wrong = tiles.time_launch("dkdv", tile, base, [case], timer, cpu, reps=1)
    assert wrong["status"].startswith("wrong: relative error 4.76e-02"), wrong  # 0.05 / 1.05
    assert tiles.score(wrong, ok) is None


def test_ckpt_gpu_stall_without_cuda_says_so_and_measures_nothing(tmp_path: Path) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = _run_bench("ckpt/gpu_stall.py", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("no CUDA device"), proc.stdout
    assert not list(tmp_path.rglob("*")), "wrote files without measuring anything"


@pytest.mark.slow
def test_ckpt_restore_smoke_checks_every_candidate(tmp_path: Path) -> None:
    """Two gloo ranks save a small state, restore it with every candidate (each load is
    verified against the saved state inside the script) and count the bytes read."""
    proc = _run_bench("ckpt/restore.py", "--smoke", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "### 2 ranks" in out, out[-2000:]
    for candidate in ("ms load, broadcast", "ms load, every rank reads"):
        assert candidate in out
    assert "read 1.00x the stored shard bytes" in out
    assert "read 2.00x the stored shard bytes" in out
    assert not list(tmp_path.rglob("*")), "--smoke wrote files into its working directory"


@pytest.mark.slow
def test_train_throughput_smoke_writes_ratio_and_mfu(tmp_path: Path) -> None:
    """ms-train and the plain loops each train a few steps; the JSON holds the ratios and
    the CPU MFU, and both ran the same math (the same losses)."""
    out = tmp_path / "out" / "train_throughput.json"
    # One intra-op thread: beside other busy processes (the rest of the suite), two
    # threads wait on each other at every op (tools/bench/train/throughput.py).
    args = ("--smoke", "--threads", "1", "--out", str(out))
    proc = _run_bench("train/throughput.py", *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("smoke: not a measurement"), proc.stdout[:500]
    assert "ratio ms-train / plain, median of 1 runs each over the mean of the plain" in (
        proc.stdout
    ), proc.stdout[-2000:]
    record = json.loads(out.read_text())
    assert record["smoke"] is True
    assert record["ratio"] > 0 and len(record["ratio_per_run"]) == 1
    assert record["ratio_in_memory_batches"] > 0 and record["ratio_vs_plain_with_reads"] > 0
    # Every candidate run lies between two plain runs, and its ratio is over their mean.
    order = record["order_of_runs"]
    assert order == [
        "plain loop",
        "ms-train",
        "plain loop",
        "ms-train, in-memory batches",
        "plain loop",
        "plain loop + reads",
        "plain loop",
    ], order
    plain = [r["tokens_per_s"] for r in record["runs"]["plain loop"]]
    ms = record["runs"]["ms-train"][0]["tokens_per_s"]
    assert record["ratio_per_run"][0] == pytest.approx(ms / ((plain[0] + plain[1]) / 2))
    # MFU is the model FLOPs rate over the better of the two measured matmul rates (not
    # asserted below 1: on a busy machine a measured rate says little).
    rate = record["matmul_flops"]
    assert rate["before"] > 0 and rate["after"] > 0
    assert rate["best"] == max(rate["before"], rate["after"])
    for key, name in (("mfu", "ms-train"), ("mfu_plain", "plain loop")):
        flops = record["median_tokens_per_s"][name] * record["parameters"]["flops_per_token"]
        assert record[key] == pytest.approx(flops / rate["best"], rel=1e-12), key
    assert record["losses_match"], record["loss_max_rel_diff"]
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["out", "train_throughput.json"]


@pytest.mark.slow
@pytest.mark.timeout(280)
def test_kill_soak_smoke_kills_once_and_finds_nothing_left(tmp_path: Path) -> None:
    """One 2-rank ms-train job SIGKILLed as a process group at a random moment, then
    rerun: the script itself fails (exit 1) if a process or /dev/shm segment of the job
    outlives the kill, a rank trains on after it, or the rerun's losses differ from an
    uninterrupted run's."""
    out = tmp_path / "kill_soak.json"
    proc = _run_bench("train/kill_soak.py", "--smoke", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["smoke"] is True
    assert record["processes_left"] == 0 and record["steps_trained_after_kill"] == 0
    assert record["segments_left_after_kill"] == 0 and record["segments_left_after_trial"] == 0
    assert record["runs_with_other_losses_or_unfinished"] == 0
    (trial,) = record["trials"]
    assert trial["finished"] and trial["exit"] == 0


@pytest.mark.slow
def test_mesh_init_smoke_times_and_counts_every_candidate(tmp_path: Path) -> None:
    """4 ranks build each shape with build_mesh, the textbook new_group loop and
    init_device_mesh under both TORCH_DIST_INIT_BARRIER settings (each mesh is checked
    by a collective inside the script); the counted builds show the textbook loop
    joining a world-wide barrier per group with the barrier on, and build_mesh none."""
    out = tmp_path / "mesh_init.json"
    proc = _run_bench("parallel/mesh_init.py", "--smoke", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.startswith("smoke: not a measurement"), proc.stdout[:500]
    record = json.loads(out.read_text())
    assert record["smoke"] is True and record["parameters"]["world"] == 4
    candidates = ("ms build_mesh", "new_group per group", "torch init_device_mesh")
    # Groups of pp=1 x dp=2 x tp=2 on 4 ranks: 4 pp groups, 2 dp, 2 tp; of dp=4: 4, 1, 4.
    for shape, groups in (("1x2x2", 8), ("1x4x1", 9)):
        for setting in ("0", "1"):
            entry = record["summary"][f"{setting}/{shape}"]
            assert set(entry) == set(candidates)
            for c in candidates:
                assert entry[c]["median_s"] > 0 and entry[c]["store_requests_max_rank"] > 0
            ms = entry["ms build_mesh"]
            assert ms["world_barriers_per_rank"] == 0
            assert ms["requests_on_other_groups_keys_max_rank"] == 0
            # its own groups (a dim spanning the world reuses the default group)
            own = 3 if shape == "1x2x2" else 2
            assert ms["new_group_calls_per_rank"] == own
            assert ms["group_local_barriers_per_rank"] == (own if setting == "1" else 0)
            assert entry["new_group per group"]["new_group_calls_per_rank"] == groups
            barriers = entry["new_group per group"]["world_barriers_per_rank"]
            assert barriers == (groups if setting == "1" else 0), (shape, setting, barriers)
    # 1 timed round and 1 counted build per (setting, shape, candidate)
    assert len(record["builds"]) == 2 * 2 * 2 * 3
    assert all(len(b["s_per_rank"]) == 4 for b in record["builds"])
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["mesh_init.json"]


@pytest.mark.slow
def test_parallel_overlap_smoke_measures_every_candidate_under_latency(tmp_path: Path) -> None:
    """Two gloo ranks run the compute-only floor, ms ZeRO-2 (six ways), torch DDP and
    torch FSDP2 (two ways) under no added latency, one block's forward and three, on
    the ring network (an all-reduce takes 2L); the JSON holds each one's ratio to the
    floor, the collectives it issued on the latency backend and the latency each got."""
    out = tmp_path / "out" / "parallel_overlap.json"
    proc = _run_bench(
        "parallel/overlap.py", "--smoke", "--network", "ring", "--out", str(out), cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("smoke: not a measurement"), proc.stdout[:500]
    assert proc.stdout.count("| torch FSDP2 ZeRO-2 |") == 3, proc.stdout[-3000:]
    record = json.loads(out.read_text())
    assert record["smoke"] is True
    assert record["machine"]["ms_parallel"]
    assert record["parameters"]["network"] == "ring"
    block = record["block_forward_s"]
    assert block > 0
    assert [s["latency_s"] for s in record["summary"]] == pytest.approx([0.0, block, 3 * block])
    for s in record["summary"]:
        rows = s["candidates"]
        assert list(rows) == [
            "compute only (floor)",
            "ms ZeRO-2",
            "ms ZeRO-2, first chunk replicated",
            "ms ZeRO-2, first 3 chunks replicated",
            "ms ZeRO-2, gathers after the whole step",
            "ms ZeRO-2, chain of 1",
            "ms ZeRO-2, serialized",
            "torch DDP",
            "torch FSDP2 ZeRO-2",
            "torch FSDP2 ZeRO-2, async AG",
        ]
        assert rows["compute only (floor)"]["ratio_to_floor"] == 1.0
        assert rows["compute only (floor)"]["collectives_by_type"] == {}
        assert rows["torch DDP"]["collectives_by_type"]["all_reduce"] >= 1
        names = (
            "ms ZeRO-2",
            "ms ZeRO-2, gathers after the whole step",
            "torch FSDP2 ZeRO-2",
            "torch FSDP2 ZeRO-2, async AG",
        )
        for name in names:
            fsdp = rows[name]["collectives_by_type"]
            assert fsdp["all_gather"] >= 2 and fsdp["reduce_scatter"] >= 2  # 2 blocks
        # The first block all-reduced, never gathered; the second still ZeRO's.
        replicated = rows["ms ZeRO-2, first chunk replicated"]["collectives_by_type"]
        assert replicated == {"all_reduce": 1, "reduce_scatter": 1, "all_gather": 1}
        # Of the smoke model's two blocks, both replicated: DDP's collectives.
        both = rows["ms ZeRO-2, first 3 chunks replicated"]["collectives_by_type"]
        assert both == {"all_reduce": 2}
        # the ring: an all-reduce takes twice what a reduce-scatter or all-gather takes
        applied = rows["ms ZeRO-2, first chunk replicated"]["latency_s_by_type"]
        latency = s["latency_s"]
        assert applied == pytest.approx(
            {"all_reduce": 2 * latency, "reduce_scatter": latency, "all_gather": latency}
        )
        for row in rows.values():
            assert row["median_step_s"] > 0 and len(row["ratio_per_round"]) == 1
    # every repetition keeps every rank's own step times
    reps = record["sweep"][1]["reps"]["torch DDP"]
    assert len(reps) == 1 and len(reps[0]["per_rank"]) == 2
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["out", "parallel_overlap.json"]


@pytest.mark.slow
def test_parallel_memory_smoke_counts_every_role(tmp_path: Path) -> None:
    """Two gloo ranks train a tiny model with DDP and with ms ZeRO-2; the JSON holds each
    rank's bytes by role, and ZeRO's optimizer state is about half of DDP's."""
    out = tmp_path / "parallel_memory.json"
    proc = _run_bench("parallel/memory.py", "--smoke", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("smoke: not a measurement"), proc.stdout[:500]
    record = json.loads(out.read_text())
    ddp, zero = record["results"]["ddp"], record["results"]["zero2"]
    assert len(ddp) == len(zero) == 2
    for rank in range(2):
        # ZeRO's flat buckets are padded to a multiple of the world size.
        params = ddp[rank]["bytes"]["parameters"]
        assert params <= zero[rank]["bytes"]["parameters"] <= params * 1.001
        assert ddp[rank]["bytes"]["gradients"] > 0 and zero[rank]["bytes"]["gradients"] > 0
        full = ddp[rank]["bytes"]["optimizer state"]
        # AdamW's two moments over this rank's shard; the buckets' padding is tiny.
        assert 0.45 * full <= zero[rank]["bytes"]["optimizer state"] <= 0.55 * full
        assert zero[rank]["peak_rss_over_model"] > 0


def test_health_sender_overhead_smoke_times_every_call(tmp_path: Path) -> None:
    """A driver and a heartbeat sender in one process: hb.step() and hb.on_event() and
    their no-op floors are timed, and the sender thread's CPU per heartbeat is read."""
    out = tmp_path / "out" / "sender_overhead.json"
    proc = _run_bench("health/sender_overhead.py", "--smoke", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("smoke: not a measurement"), proc.stdout[:500]
    assert "| hb.step() |" in proc.stdout and "| hb.on_event() |" in proc.stdout
    record = json.loads(out.read_text())
    assert record["smoke"] is True and record["machine"]["ms_health"]
    calls = ("hb.step()", "floor: no-op step()", "hb.on_event()", "floor: no-op on_event()")
    assert set(record["ns_per_call"]) == set(calls)
    assert all(len(v) == 1 and v[0] > 0 for v in record["ns_per_call"].values())
    med = record["median_ns_per_call"]
    assert record["added_ns"]["step"] == med["hb.step()"] - med["floor: no-op step()"]
    per_step = med["hb.step()"] + 40 * med["hb.on_event()"]
    assert record["loop_api_ns_per_step"] == pytest.approx(per_step)
    assert record["sender_thread"]["heartbeats"] >= 1
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["out", "sender_overhead.json"]


@pytest.mark.slow
def test_health_window_overhead_smoke_switches_health_on_and_off(tmp_path: Path) -> None:
    """ms-health switched on and off between windows of one training loop: the windows
    run on, off, off, on; the driver's helper process takes CPU only in the on windows
    (it is stopped in the others); heartbeats reach the driver; each block's ratio is
    its off windows' time over its on windows'."""
    out = tmp_path / "out" / "window_overhead.json"
    proc = _run_bench("health/window_overhead.py", "--smoke", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("smoke: not a measurement"), proc.stdout[:500]
    record = json.loads(out.read_text())
    assert record["kinds"] == ["on", "off", "off", "on"] * 2
    assert record["helper_cpu_s"]["off"] == 0.0
    # two on windows per block, each switched on and off by an acknowledged beat (the
    # windows' own beats come every 0.5 s: 3-step windows may hold none)
    assert record["heartbeats_sent"] >= 2 * 2 * 2
    assert record["heartbeat_loop_s"] > 0
    on, off = record["window_s"]["on"], record["window_s"]["off"]
    assert record["ratio_per_block"] == pytest.approx(
        [(off[0] + off[1]) / (on[0] + on[1]), (off[2] + off[3]) / (on[2] + on[3])]
    )
    # two blocks: the sign test's interval has too little coverage to decide
    assert record["ratio_ci"]["coverage"] < 0.95 and record["verdict"] == "undecided"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["out", "window_overhead.json"]


@pytest.mark.slow
def test_health_train_overhead_smoke_reads_both_shares(tmp_path: Path) -> None:
    """ms-train tiny on 2 ranks with --health, with --no-health and with --health idle
    (beats every 30 s): each run's tokens/s, the heartbeat's share measured inside the
    health runs, and the CPU of the launcher (the driver and agent with --health) and of
    the ranks, read from /proc as it ran."""
    out = tmp_path / "out" / "train_overhead.json"
    proc = _run_bench(
        "health/train_overhead.py",
        "--smoke",
        "--idle-interval",
        "30",
        "--out",
        str(out),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("smoke: not a measurement"), proc.stdout[:500]
    assert "the launcher's CPU" in proc.stdout, proc.stdout[-2000:]
    record = json.loads(out.read_text())
    (pair,) = record["pairs"]
    # the third arm: --health with beats and agent reports every 30 s, in one of the six
    # orders of the three
    idle = pair["runs"]["--health, idle"]
    assert idle["flag"] == "--health" and idle["interval_s"] == 30
    assert sorted(pair["order"]) == sorted(["--health", "--no-health", "--health, idle"])
    assert pair["idle_ratio"] == idle["tokens_per_s"] / pair["runs"]["--no-health"]["tokens_per_s"]
    assert pair["work_ratio"] == pair["runs"]["--health"]["tokens_per_s"] / idle["tokens_per_s"]
    assert record["split"]["idle_ratio"]["median"] == pair["idle_ratio"]
    assert "idle / no-health" in proc.stdout and "health / idle" in proc.stdout
    # its senders still time the loop's calls (steps, collective events), but the
    # interval reached the ranks: a beat at the start and the last, not one per 0.5 s
    assert idle["health_cost"]["loop_calls"] > 0
    beats = idle["health_cost"]["heartbeats"], pair["runs"]["--health"]["health_cost"]["heartbeats"]
    assert beats[0] <= 2 and beats[0] < beats[1], beats
    for flag in ("--health", "--no-health"):
        run = pair["runs"][flag]
        assert run["tokens_per_s"] > 0
        # the launcher imports ms_train and runs the elastic agent, the ranks train:
        # neither takes zero CPU, and the two cannot take more than the machine has
        cpu = run["cpu_s"]
        assert cpu["launcher"] > 0 and cpu["ranks"] > 0
        assert cpu["launcher"] + cpu["ranks"] < run["wall_s"] * (os.cpu_count() or 1)
    assert pair["runs"]["--health"]["health_cost"]["share"] > 0
    assert pair["runs"]["--no-health"]["health_cost"] is None
    # ms-health's threads, found by their kernel names: in the launcher (driver, agent)
    # and in the ranks (the senders) with --health, nowhere without it. In 12 steps
    # they can use less CPU than one 10 ms tick of /proc's counters.
    for arm in ("--health", "--health, idle"):
        seen = pair["runs"][arm]["health_threads_seen"]
        assert seen["launcher"] >= 2 and seen["ranks"] >= 2, (arm, seen)  # driver + agent
    assert pair["runs"]["--no-health"]["health_threads_seen"] == {"launcher": 0, "ranks": 0}
    assert pair["runs"]["--no-health"]["health_threads_cpu_s"] == {"launcher": 0, "ranks": 0}
    assert record["ranks_cpu_s"]["--health"] > 0
    rate = record["launcher_cpu_per_wall_s"]
    assert record["launcher_share"] == pytest.approx(
        (rate["--health"] - rate["--no-health"]) / min(2, os.cpu_count() or 1)
    )
    assert record["total_share"] == pytest.approx(
        record["measured_share"] + record["launcher_share"]
    )
    # one pair: the interval of its median is that pair's ratio, which decides nothing
    ci = record["ratio_ci"]
    assert ci["low"] == ci["high"] == pair["ratio"] and ci["coverage"] == 0
    assert record["target_verdict"] == "not decided by this run"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["out", "train_overhead.json"]


@pytest.mark.parametrize("idle", ["0.5", "0.2", "61"])
def test_health_train_overhead_refuses_an_idle_interval_out_of_range(
    tmp_path: Path, idle: str
) -> None:
    proc = _run_bench("health/train_overhead.py", "--idle-interval", idle, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--idle-interval must be above --interval (0.5) and at most 60 s" in proc.stderr
    assert f"got {float(idle):g}" in proc.stderr
    assert not list(tmp_path.rglob("*"))


def _trace(heartbeats: list[dict[str, object]], slowed: list[dict[str, object]]) -> dict:
    return {
        "parameters": {"burners": 2, "slow_steps": 30},
        "slowed": slowed,
        "driver_findings": [],
        "heartbeats": heartbeats,
    }


@pytest.mark.slow
def test_health_straggler_trace_replays_a_trace_under_each_setting(tmp_path: Path) -> None:
    """A made trace of 4 ranks on 50 ms steps: rank 1 at 1.4x its peers' CPU time from
    step 10 to 40, 2.4 ms of the step (a shared core); rank 3 spinning 25 ms more per
    step from step 60 to 90 (the slow fault). The floor on the slowdown keeps rank 1
    quiet; every setting flags rank 3, within 10 steps of its first slow step."""
    from ms_health.record import HeartbeatRecord

    beats = []
    for step in range(100):
        spin = 0.025 if 60 <= step < 90 else 0.0
        for r in range(4):
            cpu = 0.006 + (0.0024 if r == 1 and 10 <= step < 40 else 0.0)
            rec = HeartbeatRecord(
                job="j",
                rank=r,
                world_size=4,
                local_rank=r % 2,
                node=f"n{r // 2}",
                host="h",
                pid=100 + r,
                seq=step,
                sent_at=1e9 + step * 0.05,
                status="running",
                phase="train",
                step=step,
                step_time_s=0.05 + spin,
                step_cpu_s=cpu + (spin if r == 3 else 0.0),
                hardware={"cpu_model": "x"},
            )
            beats.append(rec.to_json())
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(_trace(beats, [{"rank": 3, "first_slow_step": 60}])))
    out = tmp_path / "replay.json"
    proc = _run_bench(
        "health/straggler_trace.py", "replay", str(path), "--out", str(out), cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # rank 1's excess is 4.8% of the step in every window: a floor of 4.8% still
    # counts its strikes (the floor is reached), the next 0.1% silences it
    # (no wait_s in these heartbeats: CPU time counts as wall time, at rate 1)
    assert "| 1.35 | 3 | 0.25 | 1 | 0 (-) | 4.9% | 8 |" in proc.stdout, proc.stdout
    assert "| 1.35 | 3 | 0.1 | 1 | 0 (-) | 4.9% | 8 |" in proc.stdout, proc.stdout
    assert "| 1.35 | 3 | 0 | 2 | 1 (4.8%) | 4.9% | 8 |" in proc.stdout, proc.stdout
    default, floor, none = json.loads(out.read_text())[str(path)]
    assert default["episodes"] == floor["episodes"]
    assert floor["silencing_floor"] == none["silencing_floor"] == pytest.approx(0.049)
    assert [e["rank"] for e in floor["episodes"]] == [3]
    assert 0 < floor["slowed"][0]["after_steps"] < 10
    assert floor["episodes"][0]["slowdown"] == pytest.approx(0.025 / 0.075, abs=1e-3)
    assert [e["rank"] for e in none["unexplained"]] == [1]
    assert none["unexplained"][0]["score"] == pytest.approx(1.4, abs=1e-3)
    for setting, said in (("1.3:2", "THRESHOLD:WINDOWS:MIN_SLOWDOWN"), ("1.0:3:0.1", "threshold")):
        bad = _run_bench(
            "health/straggler_trace.py", "replay", str(path), "--setting", setting, cwd=tmp_path
        )
        assert bad.returncode == 2 and said in bad.stderr, bad.stderr
        assert "Traceback" not in bad.stderr


@pytest.mark.slow
def test_health_straggler_trace_smoke_records_every_heartbeat(tmp_path: Path) -> None:
    """The soak's job with two busy loops beside it for 25 s and a slow rank every 7 s:
    every heartbeat is kept (each rank's sequence numbers without a gap) and parses
    back, each slowed rank's first slow step is read from its fault file, and the
    replay runs over the trace."""
    from ms_health.record import parse_heartbeat

    out = tmp_path / "out" / "trace.json"
    proc = _run_bench(
        "health/straggler_trace.py", "record", "--smoke", "--out", str(out), cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("smoke: not a measurement"), proc.stdout[:500]
    trace = json.loads(out.read_text())
    assert trace["smoke"] is True and trace["machine"]["ms_health"]
    records = [parse_heartbeat(json.dumps(h)) for h in trace["heartbeats"]]
    assert {r.rank for r in records} == {0, 1, 2, 3}
    gaps = 0
    for rank in range(4):
        seqs = [r.seq for r in records if r.rank == rank]
        assert seqs == sorted(set(seqs)), f"rank {rank}: a heartbeat kept twice or out of order"
        gaps += seqs[-1] - seqs[0] + 1 - len(seqs)
    # A poll every 20 ms sees nearly every beat of 0.1 s, even with the busy loops.
    assert gaps <= len(records) // 10, (gaps, len(records))
    assert trace["missed_heartbeats"] >= gaps  # and counts them (a first beat may be missed too)
    # Faults come every 7 s but none in the last 10 s; each was taken, at a real step.
    assert len(trace["slowed"]) == 2, trace["slowed"]
    assert all(f.get("first_slow_step", 0) > 0 for f in trace["slowed"]), trace["slowed"]
    replayed = _run_bench("health/straggler_trace.py", "replay", str(out), cwd=tmp_path)
    assert replayed.returncode == 0, replayed.stderr[-3000:]
    assert "| 1.35 | 3 | 0.1 |" in replayed.stdout
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["out", "trace.json"]


def test_gpu_tp_without_cuda_says_so_and_measures_nothing(tmp_path: Path) -> None:
    proc = _run_bench("parallel/gpu_tp.py", cwd=tmp_path, env=_hidden_cuda())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("no CUDA device"), proc.stdout
    assert not list(tmp_path.rglob("*")), "wrote files without measuring anything"


@pytest.mark.slow
def test_tp_overlap_smoke_times_every_candidate_and_counts_wire_bytes(tmp_path: Path) -> None:
    """Two gloo ranks on the latency backend run the MLP, the parallel block and the tiny
    GPT under each candidate: ms fused by chunk count and measured, ms unfused, torch
    DTensor TP; the JSON holds every one's step, its ratios and the bytes it sent."""
    out = tmp_path / "tp_overlap.json"
    proc = _run_bench("parallel/tp_overlap.py", "--smoke", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("smoke: not a measurement"), proc.stdout[:500]
    record = json.loads(out.read_text())
    assert record["smoke"] is True
    assert [(r["layout"], r["case"]["name"]) for r in record["results"]] == [
        ("1x2", "mlp"),
        ("1x2", "block"),
        ("1x2", "gpt"),
    ]
    for result in record["results"]:
        assert result["chunk_gemm_s"] > 0
        assert len(result["latencies"]) == 2  # L = 0 and L = one chunk's GEMM
        for res in result["latencies"].values():
            rows = res["summary"]
            assert list(rows) == [
                "ms fused, chunks=1",
                "ms fused, chunks=2",
                "ms fused, chunks=4",
                "ms fused, measured",
                "ms unfused",
                "torch DTensor TP",
            ]
            assert rows["torch DTensor TP"]["over_torch"] == 1.0
            assert rows["torch DTensor TP"]["exposed"] is None  # not in the event log
            assert rows["ms unfused"]["over_unfused"] == 1.0
            for name, row in rows.items():
                assert row["step_ms"] > 0, name
                assert row["wire_mb"] > 0, name
                if name != "torch DTensor TP":
                    assert 0 < row["exposed"] < 1, name
            # the tuner chose a count for each fused shape
            assert res["tuned"] and all(c in (1, 2, 4) for c in res["tuned"].values())
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["tp_overlap.json"]


@pytest.mark.slow
def test_tp_memory_measures_each_size(tmp_path: Path) -> None:
    """One forward at TP 1 and on 2 gloo ranks: the hidden states between blocks halve
    (sequence parallelism), and what the blocks save for backward shrinks."""
    out = tmp_path / "tp_memory.json"
    args = ("--tp", "2", "--width", "64", "--layers", "1", "--seq", "32", "--batch", "2")
    proc = _run_bench("parallel/tp_memory.py", *args, "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"1", "2"}
    assert rows["2"]["between_blocks_mib"] == pytest.approx(rows["1"]["between_blocks_mib"] / 2)
    assert 0 < rows["2"]["saved_blocks_mib"] < rows["1"]["saved_blocks_mib"]
