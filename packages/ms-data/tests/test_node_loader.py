"""NodeLoader on real processes, real /dev/shm segments and real shards.

Every batch is checked against ``PackedDataset.sample(g)`` for the ``g`` the global
stream rule gives (docs/design.md): step ``t``, dp rank ``r`` takes the ``g`` in
``[t*GB, (t+1)*GB)`` with ``g % dp_size == r``. Bytes read are counted by
``ms_testing.fs.CountingFileSystem``, whose counter file every process (ranks and
readers) appends to. Every multi-process test runs under a deadline.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.distributed as dist

from ms_data._procs import process_alive
from ms_data.dataset import PackedDataset
from ms_data.node_loader import NodeLoader, NodeLoaderError
from ms_data.shard import ChunkCorruptError, Corpus, ShardReader, ShardWriter
from ms_testing import launch, run_ranks
from ms_testing.fs import CountingFileSystem, read_counts

SEQ_LEN = 32
MICRO = 2
EOS = 65000
CHUNK_TOKENS = 512
SHM = Path("/dev/shm")


def build_corpus(root: Path) -> Path:
    """Three uint16 shards of documents with random lengths and tokens, small chunks."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1234)
    for s in range(3):
        with ShardWriter(
            str(root / f"shard-{s:03d}.mss"), "uint16", chunk_tokens=CHUNK_TOKENS
        ) as w:
            for _ in range(60):
                n = int(rng.integers(1, 300))
                w.add_document(rng.integers(0, 60000, n, dtype=np.uint16))
    return root


def make_dataset(corpus_dir: str | Path, counter: str | Path | None = None, **kw: Any) -> Any:
    fs = None if counter is None else CountingFileSystem(counter=str(counter))
    corpus = Corpus(str(corpus_dir), fs=fs)
    return PackedDataset(corpus, SEQ_LEN, seed=7, eos_id=EOS, **kw)


def expected_batch(ds: Any, step: int, dp_rank: int, dp_size: int, micro: int) -> np.ndarray:
    gb = dp_size * micro
    return np.stack([ds.sample(step * gb + dp_rank + j * dp_size) for j in range(micro)])


def job_segments(job: str) -> list[str]:
    return sorted(n for n in os.listdir(SHM) if n.startswith(f"ms_data_{job}"))


def new_job() -> str:
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_corpus(tmp_path_factory.mktemp("corpus"))


# -- 4 local ranks, 2 TP x 2 DP -----------------------------------------------------------


def rank_tree(corpus_dir: str, counter: str, job: str, steps: int) -> dict[str, Any]:
    ds = make_dataset(corpus_dir, counter)
    with NodeLoader(ds, micro_batch=MICRO, tp_size=2, job_id=job, timeout=30) as loader:
        batches = np.stack([next(loader).numpy() for _ in range(steps)])
        out = {
            "batches": batches,
            "dp_rank": loader.dp_rank,
            "tp_rank": loader.tp_rank,
            "reader_pid": loader.reader_pid,
            "stats": loader.stats(),
            "fraction": loader.data_wait_fraction,
        }
        # Local rank 0's close stops the reader: nobody may still be waiting for data.
        dist.barrier()
    return out


@pytest.mark.slow
def test_tp_pairs_identical_dp_disjoint_and_read_once_per_node(
    corpus_dir: Path, tmp_path: Path
) -> None:
    steps = 6
    counter = tmp_path / "tree-reads"
    job = new_job()
    results = run_ranks(rank_tree, 4, args=(str(corpus_dir), str(counter), job, steps), timeout=90)

    ref = make_dataset(corpus_dir)
    for rank, res in enumerate(results):
        assert (res["dp_rank"], res["tp_rank"]) == (rank // 2, rank % 2)
        want = np.stack([expected_batch(ref, t, rank // 2, 2, MICRO) for t in range(steps)])
        np.testing.assert_array_equal(res["batches"], want)
        assert res["stats"]["batches"] == steps and 0.0 <= res["fraction"] <= 1.0
    # TP pairs identical, DP ranks disjoint (different samples at every step).
    np.testing.assert_array_equal(results[0]["batches"], results[1]["batches"])
    np.testing.assert_array_equal(results[2]["batches"], results[3]["batches"])
    for t in range(steps):
        assert not np.array_equal(results[0]["batches"][t], results[2]["batches"][t])
    assert len({r["reader_pid"] for r in results}) == 1
    assert job_segments(job) == []

    # Bytes: the one reader read what one process sampling the node's steps reads; the
    # ranks only read their corpus index (opening the dataset). It may be up to `depth`
    # (4) steps ahead of the ranks.
    counts = read_counts(counter)
    reader = counts.by_pid[results[0]["reader_pid"]]
    single = [
        single_process_bytes(corpus_dir, tmp_path / f"one-{n}", n) for n in (steps, steps + 4)
    ]
    assert single[0] <= reader <= single[1]
    index = single_process_bytes(corpus_dir, tmp_path / "index-only", 0)
    rank_bytes = counts.total - reader
    assert rank_bytes == 4 * index

    # One loader per rank: each of the 4 iterates its own PackedDataset. Each one's reads
    # depend on nothing but its own samples, so running them one after the other here
    # reads what 4 rank processes would.
    base_counter = tmp_path / "baseline-reads"
    for rank in range(4):
        own = make_dataset(corpus_dir, base_counter, dp_rank=rank // 2, dp_size=2)
        it = iter(own)
        for _ in range(steps * MICRO):
            next(it)
    baseline = read_counts(base_counter).total - 4 * index
    tree = single[0] - index
    print(f"payload bytes: tree {tree}, per-rank loaders {baseline} ({baseline / tree:.2f}x)")
    # The two ranks of a TP pair read identical bytes: at least 2x, more where the
    # DP ranks' samples share chunks.
    assert baseline >= 1.9 * tree


def single_process_bytes(corpus_dir: Path, counter: Path, steps: int) -> int:
    """Bytes one process reads to open the corpus and build the node's first `steps` steps."""
    ds = make_dataset(corpus_dir, counter)
    for t in range(steps):
        for dp in range(2):  # the reader's order: dp slice, then micro-batch row
            expected_batch(ds, t, dp, 2, MICRO)
    return read_counts(counter).total


# -- two nodes, and a restart mid-run ----------------------------------------------------------


def rank_two_nodes(corpus_dir: str, job: str, steps: int) -> dict[str, Any]:
    rank = dist.get_rank()
    ds = make_dataset(corpus_dir)
    # 4 ranks as 2 nodes of 2 (TP 1): node 0 holds dp ranks 0, 1; node 1 holds 2, 3.
    loader = NodeLoader(
        ds, micro_batch=MICRO, local_rank=rank % 2, local_world_size=2, job_id=job, timeout=30
    )
    batches = []
    names = []
    for t in range(steps):
        if t == 2:
            # A resume on a running loader: the reader restarts from the saved step.
            loader.load_state_dict(loader.state_dict())
        batches.append(next(loader).numpy())
        names.append(loader.segment_name)
    out = {"batches": np.stack(batches), "names": names, "reader": loader.reader_pid}
    dist.barrier()
    loader.close()
    return out


@pytest.mark.slow
def test_two_nodes_and_restart(corpus_dir: Path) -> None:
    steps = 4
    job = new_job()
    results = run_ranks(rank_two_nodes, 4, args=(str(corpus_dir), job, steps), timeout=90)
    ref = make_dataset(corpus_dir)
    for rank, res in enumerate(results):
        want = np.stack([expected_batch(ref, t, rank, 4, MICRO) for t in range(steps)])
        np.testing.assert_array_equal(res["batches"], want)
    assert results[0]["names"] == results[1]["names"]
    assert results[2]["names"] == results[3]["names"]
    assert results[0]["names"][0] != results[2]["names"][0]  # one ring per node
    assert results[0]["names"][1].endswith("_s0") and results[0]["names"][2].endswith("_s2")
    assert results[0]["reader"] != results[2]["reader"]
    assert job_segments(job) == []


def rank_loads_state_at_different_times(corpus_dir: str, job: str) -> dict[str, Any]:
    """Local rank 0 takes a batch, then loads the state; local rank 1 loads it first.

    With a segment name counted per process (rings opened so far), rank 0's second
    ring and rank 1's first had different names and rank 1 waited out its timeout.
    """
    rank = dist.get_rank()
    loader = NodeLoader(make_dataset(corpus_dir), micro_batch=MICRO, job_id=job, timeout=20)
    state = loader.state_dict()
    gb = loader.global_batch
    state.update(step=3, next_index=3 * gb)
    state["dataset"]["next_index"] = 3 * gb
    names = []
    if rank == 0:
        # An extra loader of the same name first, then this one's first batch.
        with NodeLoader(make_dataset(corpus_dir), micro_batch=MICRO, job_id=job) as extra:
            next(extra)
        next(loader)
        names.append(loader.segment_name)
    dist.barrier()
    loader.load_state_dict(state)
    batch = next(loader).numpy()
    names.append(loader.segment_name)
    out = {"batch": batch, "names": names, "stats": loader.stats(), "step": loader.step}
    dist.barrier()
    loader.close()
    return out


@pytest.mark.slow
def test_ranks_agree_on_the_segment_whatever_they_did_before(corpus_dir: Path) -> None:
    job = new_job()
    results = run_ranks(rank_loads_state_at_different_times, 2, args=(str(corpus_dir), job))
    ref = make_dataset(corpus_dir)
    first, second = results
    assert first["names"][0].endswith("_s0")
    assert first["names"][-1] == second["names"][-1] and second["names"][-1].endswith("_s3")
    for rank, res in enumerate(results):
        np.testing.assert_array_equal(res["batch"], expected_batch(ref, 3, rank, 2, MICRO))
        assert res["step"] == 4 and res["stats"]["batches"] == 1 + (rank == 0)
    assert job_segments(job) == []


def other_data(corpus_dir: str | Path) -> PackedDataset:
    """The same shapes as make_dataset's (so the same ring spec), other samples."""
    return PackedDataset(Corpus(str(corpus_dir)), SEQ_LEN, seed=8, eos_id=EOS)


def rank_rebuilds_its_loader(corpus_dir: str, job: str) -> dict[str, Any]:
    """Both ranks replace their loader by one of the same name and first step over other
    data; local rank 1 asks the new one for a batch while local rank 0 still holds the
    old ring open, whose spec matches."""
    rank = dist.get_rank()
    old = NodeLoader(make_dataset(corpus_dir), micro_batch=MICRO, job_id=job, timeout=20)
    next(old)
    dist.barrier()
    if rank == 0:
        time.sleep(2.0)  # the old ring stays alive while rank 1 looks for the new one
    old.close()
    new = NodeLoader(other_data(corpus_dir), micro_batch=MICRO, job_id=job, timeout=20)
    batch = next(new).numpy()
    out = {"batch": batch, "step": new.step}
    dist.barrier()
    new.close()
    return out


@pytest.mark.slow
def test_a_rebuilt_loader_never_joins_the_old_ring(corpus_dir: Path) -> None:
    job = new_job()
    results = run_ranks(rank_rebuilds_its_loader, 2, args=(str(corpus_dir), job))
    ref = other_data(corpus_dir)
    for rank, res in enumerate(results):
        np.testing.assert_array_equal(res["batch"], expected_batch(ref, 0, rank, 2, MICRO))
        assert res["step"] == 1
    assert job_segments(job) == []


# -- resume ------------------------------------------------------------------------------------


def single_loader(ds: Any, job: str, **kw: Any) -> NodeLoader:
    kw.setdefault("micro_batch", 4)
    return NodeLoader(ds, local_rank=0, local_world_size=1, job_id=job, timeout=30, **kw)


@pytest.mark.slow
def test_resume_continues_the_stream(corpus_dir: Path) -> None:
    job = new_job()
    ref = make_dataset(corpus_dir)
    uninterrupted = [expected_batch(ref, t, 0, 1, 4) for t in range(6)]
    with single_loader(make_dataset(corpus_dir), job, dp_rank=0, dp_size=1) as first:
        head = []
        for _ in range(3):
            head.append(next(first).numpy())
            time.sleep(0.02)  # "training"
        state = first.state_dict()
        stats = first.stats()
    # The data-wait metric: the first batch waited for the reader's start-up, counted
    # apart; between batches, wall time holds the two sleeps and every wait.
    assert stats["batches"] == 3 and stats["startup_wait_s"] > 0
    assert stats["data_wait_s"] + 2 * 0.02 <= stats["wall_s"]
    assert stats["data_wait_fraction"] == stats["data_wait_s"] / stats["wall_s"]
    assert state["step"] == 3 and state["next_index"] == 12 and state["dataset"]["next_index"] == 12
    with single_loader(make_dataset(corpus_dir), job, dp_rank=0, dp_size=1) as second:
        second.load_state_dict(state)
        tail = [next(second).numpy() for _ in range(3)]
    np.testing.assert_array_equal(np.stack(head + tail), np.stack(uninterrupted))

    # The same global batch (4) on 2 dp ranks: dp rank 0 continues with g = 12, 14, ...
    with single_loader(make_dataset(corpus_dir), job, dp_rank=0, dp_size=2, micro_batch=2) as two:
        two.load_state_dict(state)
        assert two.step == 3
        np.testing.assert_array_equal(next(two).numpy(), expected_batch(ref, 3, 0, 2, 2))

    odd = single_loader(make_dataset(corpus_dir), job, dp_rank=0, dp_size=1, micro_batch=5)
    with pytest.raises(ValueError, match="not a step boundary"):
        odd.load_state_dict(state)
    other_seed = other_data(corpus_dir)
    wrong = single_loader(other_seed, job, dp_rank=0, dp_size=1)
    with pytest.raises(ValueError, match="seed"):
        wrong.load_state_dict(state)
    assert job_segments(job) == []


@pytest.mark.slow
def test_a_state_saved_on_2_dp_ranks_resumes_on_1_and_on_4(corpus_dir: Path) -> None:
    """The global order does not depend on the DP size, so a loader's state carries over
    to any DP size whose global batch the saved position is a step boundary of: every
    rank gets the samples the stream rule gives it, and together the ranks of each
    size get every sample from the saved position on exactly once."""
    ref = make_dataset(corpus_dir)
    index = {ref.sample(g).tobytes(): g for g in range(48)}
    assert len(index) == 48, "two samples alike: rows would not name their g"

    def read(dp_rank: int, dp_size: int, steps: int, state: Any = None) -> tuple[Any, list[int]]:
        with single_loader(
            make_dataset(corpus_dir), new_job(), dp_rank=dp_rank, dp_size=dp_size, micro_batch=2
        ) as loader:
            if state is not None:
                loader.load_state_dict(state)
            first = loader.step
            rows = []
            for t in range(first, first + steps):
                batch = next(loader).numpy()
                np.testing.assert_array_equal(batch, expected_batch(ref, t, dp_rank, dp_size, 2))
                rows += [index[row.tobytes()] for row in batch]
            return loader.state_dict(), rows

    saved = [read(r, 2, 4) for r in range(2)]  # global batch 4: samples [0, 16)
    state = saved[0][0]
    assert saved[1][0] == state  # nothing per rank: one copy serves every rank
    assert state["next_index"] == 16 and state["dp_size"] == 2
    assert sorted(saved[0][1] + saved[1][1]) == list(range(16))
    for dp_size, steps in ((1, 8), (4, 2)):  # global batch 2 and 8: samples [16, 32)
        got = [read(r, dp_size, steps, state)[1] for r in range(dp_size)]
        assert sorted(g for rows in got for g in rows) == list(range(16, 32)), dp_size


@pytest.mark.parametrize(
    ("threads", "shuffle"),
    [
        pytest.param(3, True, marks=pytest.mark.slow),
        # The fast tier's one end-to-end run: a real reader process and ring.
        (2, False),
        pytest.param(1, True, marks=pytest.mark.slow),
    ],
)
def test_reader_threads_deliver_the_stream_in_order(
    corpus_dir: Path, threads: int, shuffle: bool
) -> None:
    """Threads build up to depth steps at once; steps still arrive whole and in order."""
    steps = 200  # more than one epoch of the small corpus
    ref = make_dataset(corpus_dir, shuffle=shuffle)
    ds = make_dataset(corpus_dir, shuffle=shuffle)
    job = new_job()
    with single_loader(ds, job, dp_rank=1, dp_size=2, reader_threads=threads) as loader:
        for t in range(steps):
            if t % 50 == 25:
                time.sleep(0.05)  # let the reader fill the ring: back-pressure
            np.testing.assert_array_equal(next(loader).numpy(), expected_batch(ref, t, 1, 2, 4))
    assert ref.epoch((steps - 1) * 8) >= 1
    assert job_segments(job) == []


# -- faults ------------------------------------------------------------------------------------


def rank_kill_reader(corpus_dir: str, job: str, timeout: float) -> tuple[str, int]:
    loader = NodeLoader(
        make_dataset(corpus_dir), micro_batch=MICRO, job_id=job, timeout=timeout, depth=2
    )
    next(loader)
    dist.barrier()
    if loader.local_rank == 0:
        os.kill(loader.reader_pid or 0, signal.SIGKILL)
    dist.barrier()
    delivered = 0
    try:
        while delivered < 100:
            next(loader)
            delivered += 1
    except NodeLoaderError as e:
        message = str(e)
    else:
        message = "no error"
    dist.barrier()
    loader.close()
    return message, delivered


@pytest.mark.slow
def test_sigkill_reader_ranks_raise_before_their_timeout(corpus_dir: Path) -> None:
    timeout = 10.0
    job = new_job()
    results = run_ranks(rank_kill_reader, 2, args=(str(corpus_dir), job, timeout), timeout=60)
    for message, delivered in results:
        # "is gone", not the timeout's message: the death was noticed, not waited out.
        assert "reader process" in message and "is gone" in message, message
        assert "timeout" not in message
        assert delivered <= 2  # at most the ring's depth, prefetched before the kill
    assert job_segments(job) == []


def rank_dies(corpus_dir: str, job: str) -> tuple[str, bool]:
    """A rank dies mid-run: the others get the reader's failure; the reader waits for
    local rank 0 to close the loader, then exits (True when both held)."""
    loader = NodeLoader(make_dataset(corpus_dir), micro_batch=MICRO, job_id=job, timeout=20)
    next(loader)
    dist.barrier()
    if loader.local_rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        for _ in range(100):
            next(loader)
        message = "no error"
    except NodeLoaderError as e:
        message = str(e)
    pid = loader.reader_pid or 0
    # The failed reader stays until its owner stops it (or dies): it is the one left to
    # unlink the segment when the whole node is killed.
    waiting = process_alive(pid)
    loader.close()
    deadline = time.monotonic() + 5
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return message, waiting and not process_alive(pid)


@pytest.mark.slow
def test_dead_rank_stops_the_reader(corpus_dir: Path) -> None:
    job = new_job()
    report = launch(rank_dies, 2, args=(str(corpus_dir), job), timeout=60, grace=20)
    assert report.outcomes[1].status == "died"
    assert report.outcomes[0].status == "ok", report.describe()
    message, reader_waited_then_went = report.outcomes[0].value
    assert "local rank 1" in message and "exited without closing" in message, message
    assert reader_waited_then_went
    assert job_segments(job) == []


def rank_sigkilled(corpus_dir: str, job: str) -> None:
    loaders = [
        NodeLoader(make_dataset(corpus_dir), micro_batch=MICRO, job_id=job, name=n, timeout=30)
        for n in ("train", "val")
    ]
    for loader in loaders:
        next(loader)
    dist.barrier()
    # The harness gives each rank its own process group: rank 0's holds its readers.
    os.killpg(os.getpgrp(), signal.SIGKILL)


def rank_after_kill(corpus_dir: str, job: str) -> list[str]:
    loader = NodeLoader(make_dataset(corpus_dir), micro_batch=MICRO, job_id=job, timeout=30)
    batch = next(loader).numpy()
    ref = make_dataset(corpus_dir)
    np.testing.assert_array_equal(batch, expected_batch(ref, 0, dist.get_rank(), 2, MICRO))
    seen = job_segments(job)
    dist.barrier()
    loader.close()
    return seen


@pytest.mark.slow
@pytest.mark.shm_dead_owner
def test_restart_after_sigkill_removes_stale_segments(corpus_dir: Path) -> None:
    job = new_job()
    report = launch(rank_sigkilled, 2, args=(str(corpus_dir), job), timeout=60)
    assert [o.status for o in report.outcomes] == ["died", "died"], report.describe()
    stale = job_segments(job)
    assert len(stale) == 2  # train and val, left behind with their creator dead

    seen = run_ranks(rank_after_kill, 2, args=(str(corpus_dir), job), timeout=60)
    # Local rank 0 swept both at start: the stale val, and the stale train whose name it
    # then reused; during the run only the new train ring exists.
    assert seen[0] == seen[1] == [n for n in stale if "_train_" in n]
    assert job_segments(job) == []


CHILD = """
import json, signal, sys, time
# As a process started from a terminal has it, whatever this test inherited (a shell
# starts background jobs with SIGINT ignored, and Python keeps that).
signal.signal(signal.SIGINT, signal.default_int_handler)
from ms_data.dataset import PackedDataset
from ms_data.node_loader import NodeLoader
from ms_data.shard import Corpus
ds = PackedDataset(Corpus(sys.argv[1]), 32, seed=7, eos_id=65000)
loader = NodeLoader(ds, micro_batch=2, job_id=sys.argv[2], timeout=30)
next(loader)
print(json.dumps({"segment": loader.segment_name, "reader": loader.reader_pid}), flush=True)
while True:
    next(loader)
    time.sleep(0.001)
"""


@pytest.mark.slow
def test_sigint_and_sigterm_to_a_rank_unlink_its_segment(corpus_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    children = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            job = new_job()
            children[sig] = (
                job,
                subprocess.Popen(
                    [sys.executable, "-c", CHILD, str(corpus_dir), job],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    env=env,
                ),
            )
        for sig, (job, proc) in children.items():
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], 60)
            assert ready, "the child never started loading"
            info = json.loads(proc.stdout.readline())
            assert job_segments(job) == [info["segment"]]
            assert process_alive(info["reader"])
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=30)
            # An uncaught KeyboardInterrupt ends Python by SIGINT too.
            assert proc.returncode == -sig, err.decode()
            if sig == signal.SIGINT:
                assert b"KeyboardInterrupt" in err, err.decode()
            assert job_segments(job) == []
            deadline = time.monotonic() + 10
            while process_alive(info["reader"]) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not process_alive(info["reader"])
    finally:
        for _, proc in children.values():
            proc.kill()
            proc.wait(timeout=30)


@pytest.mark.slow
def test_corrupt_shard_error_reaches_the_rank(corpus_dir: Path, tmp_path: Path) -> None:
    bad_dir = tmp_path / "bad"
    shutil.copytree(corpus_dir, bad_dir)
    shard = bad_dir / "shard-000.mss"
    chunk = 3
    offset = int(ShardReader(str(shard)).chunk_table[chunk]["offset"])
    with open(shard, "r+b") as f:
        f.seek(offset + 4)
        byte = f.read(1)
        f.seek(offset + 4)
        f.write(bytes([byte[0] ^ 0xFF]))

    ref = make_dataset(bad_dir, shuffle=False)
    assert ref.samples_per_epoch is not None
    for first_bad in range(ref.samples_per_epoch):
        try:
            ref.sample(first_bad)
        except ChunkCorruptError as e:
            shard_message = str(e)
            break
    else:
        pytest.fail("no sample of the epoch reads the damaged chunk")
    job = new_job()
    good = []
    with single_loader(make_dataset(bad_dir, shuffle=False), job, micro_batch=4) as loader:
        try:
            for _ in range(1000):
                good.append(next(loader).numpy())
        except NodeLoaderError as e:
            error = e
        else:
            pytest.fail("the corrupt chunk raised nothing")
    assert shard_message in str(error)
    assert isinstance(error.__cause__, ChunkCorruptError)
    assert str(shard) in str(error) and f"chunk {chunk}" in str(error)
    # Every step before the damaged one was delivered, intact.
    assert len(good) == first_bad // 4
    for t, batch in enumerate(good):
        np.testing.assert_array_equal(batch, expected_batch(ref, t, 0, 1, 4))
    assert job_segments(job) == []


def test_shm_too_small_fails_at_start_with_the_numbers(corpus_dir: Path) -> None:
    with pytest.raises(NodeLoaderError) as info:
        NodeLoader(make_dataset(corpus_dir), micro_batch=64, depth=10**7, job_id=new_job())
    message = str(info.value)
    match = re.search(r"needs (\d+) bytes .* has (\d+) bytes", message)
    assert match and int(match[1]) > int(match[2]), message
    assert "depth=10000000" in message and "micro_batch=64" in message
    assert "seq_len+1=33" in message and "uint16" in message


@pytest.mark.slow
def test_rank_without_local_rank_zero_times_out(corpus_dir: Path) -> None:
    loader = NodeLoader(
        make_dataset(corpus_dir),
        micro_batch=1,
        local_rank=1,
        local_world_size=2,
        dp_rank=1,
        dp_size=2,
        job_id=new_job(),
        timeout=1.0,
    )
    with pytest.raises(NodeLoaderError, match=r"waited 1\.0s for local rank 0"):
        next(loader)


def test_layout_validation(corpus_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ds = make_dataset(corpus_dir)
    for var in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="tp_size must divide local_world_size"):
        NodeLoader(ds, micro_batch=1, tp_size=3, local_world_size=4, job_id="j")
    with pytest.raises(ValueError, match="job_id is required"):
        NodeLoader(ds, micro_batch=1, local_rank=0, local_world_size=2)
    with pytest.raises(ValueError, match="local_rank must be in"):
        NodeLoader(ds, micro_batch=1, local_rank=2, local_world_size=2, job_id="j")
    with pytest.raises(ValueError, match="exceed dp_size"):
        NodeLoader(ds, micro_batch=1, local_world_size=4, dp_size=2, dp_rank=0, job_id="j")
    with pytest.raises(ValueError, match="micro_batch must be >= 1"):
        NodeLoader(ds, micro_batch=0)
    with pytest.raises(ValueError, match="reader_threads must be >= 1"):
        NodeLoader(ds, micro_batch=1, reader_threads=0)
    with pytest.raises(TypeError, match="reader_threads must be an int"):
        NodeLoader(ds, micro_batch=1, reader_threads=2.0)  # type: ignore[arg-type]
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run")
    loader = NodeLoader(ds, micro_batch=1, tp_size=2)
    assert (loader.dp_rank, loader.dp_size, loader.dp_index, loader.tp_rank) == (2, 4, 0, 1)
    assert loader.dp_first == 2 and loader.global_batch == 4


@pytest.mark.slow
def test_a_full_ring_with_a_paced_rank_delivers_every_batch_in_order(corpus_dir: Path) -> None:
    """The ring fills, then the rank takes a batch every 60 ms: the reader's paced
    polling of a full ring (``_reader.poll_cap``) still refills every slot in order.
    How often it wakes up and how long the rank waits are timings, measured by
    tools/bench/data/node_loading.py, not asserted here."""
    ds = make_dataset(corpus_dir)
    ref = make_dataset(corpus_dir)
    with single_loader(ds, new_job(), dp_rank=0, dp_size=1, depth=4) as loader:
        batches = [next(loader).numpy()]
        time.sleep(0.3)  # the ring fills
        for _ in range(12):
            time.sleep(0.06)
            batches.append(next(loader).numpy())
        assert loader.stats()["batches"] == 13 and loader.step == 13
    np.testing.assert_array_equal(
        np.stack(batches), np.stack([expected_batch(ref, t, 0, 1, 4) for t in range(13)])
    )


@pytest.mark.slow
def test_the_reader_ignores_sigint_and_sigterm(corpus_dir: Path) -> None:
    """Ctrl-C reaches the terminal's whole process group and torchrun signals a rank's
    whole group: the reader goes on serving its rank, whose signal handling decides
    (a rank stopping gracefully still reads the rest of its step)."""
    ds = make_dataset(corpus_dir)
    with single_loader(ds, new_job()) as loader:
        got = [next(loader).numpy()]  # the reader is running (past its start-up)
        reader = loader.reader_pid
        assert reader is not None
        os.kill(reader, signal.SIGINT)
        os.kill(reader, signal.SIGTERM)
        got += [next(loader).numpy() for _ in range(5)]
        assert process_alive(reader)
    ref = make_dataset(corpus_dir)
    for step, batch in enumerate(got):
        np.testing.assert_array_equal(batch, expected_batch(ref, step, 0, 1, 4))


# A training loop that handles SIGTERM itself (finish the step, then stop), as ms-train's
# does: after the signal it still needs batches, more than the ring holds.
GRACEFUL = """
import json, signal, sys, time
from ms_data.dataset import PackedDataset
from ms_data.node_loader import NodeLoader, NodeLoaderError
from ms_data.shard import Corpus
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
ds = PackedDataset(Corpus(sys.argv[1]), 32, seed=7, eos_id=65000)
loader = NodeLoader(ds, micro_batch=2, job_id=sys.argv[2], timeout=30, depth=2,
                    signal_cleanup=sys.argv[3] == "1")
next(loader)
print(json.dumps({"segment": loader.segment_name, "reader": loader.reader_pid}), flush=True)
while not stop:
    time.sleep(0.01)
try:
    for _ in range(10):
        next(loader)
    print("fed", flush=True)
except NodeLoaderError as e:
    print("starved:", e, flush=True)
loader.close()
"""


@pytest.mark.slow
@pytest.mark.parametrize("cleanup", [True, False])
def test_signal_cleanup_off_leaves_the_signal_to_a_loop_that_closes(
    corpus_dir: Path, cleanup: bool
) -> None:
    """With the default, SIGTERM stops the reader and unlinks the segment at once, so a
    loop that handles the signal to finish its step is starved; with
    ``signal_cleanup=False`` the reader goes on until the loop closes the loader."""
    job = new_job()
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    proc = subprocess.Popen(
        [sys.executable, "-c", GRACEFUL, str(corpus_dir), job, "1" if cleanup else "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "the child never started loading"
        info = json.loads(proc.stdout.readline())
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == 0, err
    if cleanup:
        assert out.startswith("starved:") and "is gone" in out, out
    else:
        assert out == "fed\n", out + err
    assert job_segments(job) == []
    deadline = time.monotonic() + 10
    while process_alive(info["reader"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process_alive(info["reader"])


def test_signal_cleanup_must_be_a_bool(corpus_dir: Path) -> None:
    with pytest.raises(TypeError, match="signal_cleanup must be a bool, got 'no'"):
        NodeLoader(make_dataset(corpus_dir), micro_batch=2, job_id=new_job(), signal_cleanup="no")  # type: ignore[arg-type]
