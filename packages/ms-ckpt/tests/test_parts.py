"""Loading across a changed number of model-parallel parts (tensor parallelism), on real
gloo ranks and real files, with meshes shaped as ms-parallel builds them ("pp", "dp",
"tp"): a dp 2 x tp 2 checkpoint loaded at dp 2 x tp 1, at dp 1 x tp 2 and in one
process without a process group; a tp 1 checkpoint loaded at dp 2 x tp 2 (reads
counted: broadcast recovery per DP group) and at dp 1 x tp 2; and the refusals of
state the saved parts do not hold alike. Every loaded value is compared bit for bit
with the region torch's own ``distribute_tensor`` gives of the saved global tensor."""

from __future__ import annotations

import dataclasses
import json
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from ms_ckpt import Checkpointer, CheckpointError, _parts, _plan, rng_state
from ms_testing import run_ranks
from ms_testing.fs import COUNTER_ENV, read_counts, reset_counts

DEADLINE = 60.0

# What a tensor-parallel model and its ZeRO state keyed by parameter name hold: name ->
# (global shape, the mesh dimensions of its DTensor, placements). The global shapes do
# not depend on the tp size; 7 rows split 4 | 3 over two ranks, 5 columns 3 | 2.
SPEC: dict[str, tuple[tuple[int, ...], tuple[str, ...], list[str]]] = {
    "model/wq": ((7, 6), ("tp",), ["S0"]),  # column-parallel linear
    "model/wo": ((6, 5), ("tp",), ["S1"]),  # row-parallel linear
    "model/ln": ((6,), ("tp",), ["R"]),  # a LayerNorm weight, replicated over tp
    "optim/wq": ((7, 6), ("dp", "tp"), ["S1", "S0"]),  # ZeRO over dp of the tp shard
    "optim/ln": ((6,), ("dp", "tp"), ["S0", "R"]),
    "optim/flat": ((11,), ("dp", "tp"), ["S0", "S0"]),  # one dim split by both
    "zero_same": ((10,), ("dp",), ["S0"]),  # a DTensor of each part's own, alike in all
}
# A DTensor of each part's own on "dp" that differs by tp rank (ZeRO buckets of the
# form before parameter names): loads only with the same number of parts.
PER_PART = "zero"
PER_PART_SHAPE = (10,)


def glob(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The global tensor ``name`` stands for: the same in every process."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g)


def mesh_of(dp: int, tp: int) -> DeviceMesh:
    return init_device_mesh("cpu", (1, dp, tp), mesh_dim_names=("pp", "dp", "tp"))


def distribute(t: torch.Tensor, mesh: DeviceMesh, spec: list[str]) -> DTensor:
    """torch's own split of ``t`` (each rank cuts its piece locally: no communication)."""
    places: list[Placement] = [Replicate() if p == "R" else Shard(int(p[1:])) for p in spec]
    return distribute_tensor(t, mesh, places, src_data_rank=None)


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, value in flat.items():
        *dirs, name = path.split("/")
        node = out
        for d in dirs:
            node = node.setdefault(d, {})
        node[name] = value
    return out


def leaves(state: dict[str, Any], path: str = "") -> dict[str, Any]:
    """Copies of every value in a nested dict by path; of a DTensor, its local shard."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out |= leaves(v, f"{path}{k}/")
        elif isinstance(v, DTensor):
            out[path + k] = v.to_local().clone()
        elif isinstance(v, torch.Tensor):
            out[path + k] = v.clone()
        elif not hasattr(v, "state_dict"):  # the RNG is kept on load: left out
            out[path + k] = v
    return out


def state_of(
    mesh: DeviceMesh | None, *, per_part: bool, fill: float | None, zero_from: int | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The state on ``mesh`` (None: plain whole tensors, one process): the saved values
    when ``fill`` is None, else a live state of ``fill`` to load into; and the values it
    holds after a load (local shards). ``zero_from``: the tp rank whose ``PER_PART``
    tensor it gets (None: its own)."""
    tp = 0 if mesh is None else mesh.get_local_rank("tp")
    flat: dict[str, Any] = {}
    want: dict[str, Any] = {}
    named = {n: (s, d, p, n) for n, (s, d, p) in SPEC.items()}
    if per_part:
        source = tp if zero_from is None else zero_from
        named[PER_PART] = (PER_PART_SHAPE, ("dp",), ["S0"], f"zero{source}")
    for key, (shape, dims, spec, name) in named.items():
        g = glob(name, shape)
        value = g if fill is None else torch.full(shape, fill)
        if mesh is None:
            flat[key], want[key] = value, g
            continue
        sub = mesh[dims[0]] if len(dims) == 1 else mesh[dims]
        flat[key] = distribute(value, sub, spec)
        want[key] = distribute(g, sub, spec).to_local()
    bias = glob("bias", (5,))  # a plain tensor, the same on every rank of every part
    flat["model/bias"] = bias.clone() if fill is None else torch.full((5,), fill)
    want["model/bias"] = bias
    flat["step"], want["step"] = (7 if fill is None else 0), 7
    flat["note"], want["note"] = ("tp" if fill is None else ""), "tp"
    state = nest(flat)
    if mesh is not None:
        state["rng"] = rng_state()  # per-rank: loads only with per_rank="keep" here
    return state, want


def assert_loaded(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for k, w in want.items():
        if isinstance(w, torch.Tensor):
            assert got[k].dtype == w.dtype and got[k].shape == w.shape, k
            assert torch.equal(got[k], w), k
        else:
            assert got[k] == w, k


def load_into(
    root: str, mesh: DeviceMesh, step: int, *, per_part: bool, zero_from: int | None = None
) -> dict[bool, Any]:
    """Load ``step`` into a fresh live state on ``mesh``, with and without broadcast."""
    out: dict[bool, Any] = {}
    for broadcast in (True, False):
        live, want = state_of(mesh, per_part=per_part, fill=-7.0, zero_from=zero_from)
        with Checkpointer(root, mesh=mesh, dp_dim="dp") as ckpt:
            assert ckpt.load(live, step=step, broadcast=broadcast, per_rank="keep") == step
        out[broadcast] = (leaves(live), want)
    return out


def refusals(root: str, mesh: DeviceMesh) -> dict[str, str]:
    """What a load of the dp 2 x tp 2 checkpoint into one part refuses; nothing restored."""
    out: dict[str, str] = {}
    cases = {"per_part": (2, "keep"), "tree": (3, "keep"), "per_rank": (1, "refuse")}
    with Checkpointer(root, mesh=mesh, dp_dim="dp") as ckpt:
        for name, (step, per_rank) in cases.items():
            live, _ = state_of(mesh, per_part=step == 2, fill=-7.0)
            before = leaves(live)
            with pytest.raises(CheckpointError) as info:
                ckpt.load(live, step=step, per_rank=per_rank)  # type: ignore[arg-type]
            assert_loaded(leaves(live), before)
            out[name] = str(info.value)
    return out


def rank_save_2x2(root: str) -> None:
    mesh = mesh_of(2, 2)  # ranks (dp, tp): 0 (0, 0), 1 (0, 1), 2 (1, 0), 3 (1, 1)
    state, _ = state_of(mesh, per_part=False, fill=None)
    with Checkpointer(root, mesh=mesh, dp_dim="dp") as ckpt:
        ckpt.save(1, state).wait(timeout=DEADLINE)
        with_zero, _ = state_of(mesh, per_part=True, fill=None)
        ckpt.save(2, with_zero).wait(timeout=DEADLINE)
        # A plain value that differs by tp rank: in each part's tree.
        ckpt.save(3, state | {"tp_rank": mesh.get_local_rank("tp")}).wait(timeout=DEADLINE)


def rank_at_2(roots: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    one_part = mesh_of(2, 1)
    out["dp2_tp1"] = load_into(roots["tp2"], one_part, 1, per_part=False)
    out["refused"] = refusals(roots["tp2"], one_part)
    # As many parts as saved (2), DP 2 -> 1: each part loads its own ZeRO state.
    two_parts = mesh_of(1, 2)
    out["dp1_tp2"] = load_into(roots["tp2"], two_parts, 2, per_part=True)
    # The reverse: save at tp 1, load at tp 2.
    state, _ = state_of(one_part, per_part=True, fill=None)
    with Checkpointer(roots["tp1"], mesh=one_part, dp_dim="dp") as ckpt:
        ckpt.save(1, state).wait(timeout=DEADLINE)
    dist.barrier()  # committed on rank 0 before anyone loads
    out["tp1_to_dp1_tp2"] = load_into(roots["tp1"], two_parts, 1, per_part=True, zero_from=0)
    return out


def rank_at_4(root: str, counter: str) -> dict[bool, Any]:
    mesh = mesh_of(2, 2)
    out: dict[bool, Any] = {}
    for broadcast in (True, False):
        live, want = state_of(mesh, per_part=True, fill=-7.0, zero_from=0)
        if dist.get_rank() == 0:
            reset_counts(counter)
        dist.barrier()
        with Checkpointer(f"counting://{root}", mesh=mesh, dp_dim="dp") as ckpt:
            assert ckpt.load(live, broadcast=broadcast, per_rank="keep") == 1
        dist.barrier()
        reads = sum(n for p, n in read_counts(counter).by_path.items() if p.endswith(".bin"))
        out[broadcast] = (leaves(live), want, reads)
        dist.barrier()
    return out


def manifest_of(root: str, step: int) -> dict[str, Any]:
    path = Path(root) / f"step-{step:08d}" / "manifest.json"
    return json.loads(path.read_text())  # type: ignore[no-any-return]


@pytest.mark.slow
def test_tensor_parallel_state_loads_into_another_number_of_parts(tmp_path: Path) -> None:
    roots = {k: str(tmp_path / k) for k in ("tp2", "tp1")}
    run_ranks(rank_save_2x2, 4, args=(roots["tp2"],), timeout=180)
    saved = manifest_of(roots["tp2"], 2)
    assert saved["world"] | {"writers": None} == {
        "world_size": 4,
        "dp_size": 2,
        "parts": 2,
        "writers": None,
    }
    scopes = {r["key"]: r["dtensor"]["parts"] for r in saved["records"] if "dtensor" in r}
    assert scopes["model/wq"] == scopes["optim/flat"] == [0, 1]  # one global tensor
    assert sorted(r["part"] for r in saved["records"] if r["key"] == PER_PART) == [0, 0, 1, 1]

    at2 = run_ranks(rank_at_2, 2, args=(roots,), timeout=300)
    for r in at2:
        for case in ("dp2_tp1", "dp1_tp2", "tp1_to_dp1_tp2"):
            for broadcast in (True, False):
                assert_loaded(*r[case][broadcast])
        refused = r["refused"]
        assert (
            "the number of model-parallel parts changed from 2 (world 4, data-parallel size "
            "2) to 1 (world 2, data-parallel size 2), and state['zero'] cannot follow it"
        ) in refused["per_part"]
        assert f"state[{PER_PART!r}] cannot follow it" in refused["per_part"]
        assert "each part saved a DTensor of its own" in refused["per_part"]
        assert "parts 0 and 1 differ; only state that every part" in refused["per_part"]
        assert "load it with 2 parts" in refused["per_part"]
        assert "zero_same" not in refused["per_part"]  # alike in both parts: it loads
        assert "different plain values at state['tp_rank']" in refused["tree"]
        assert (
            "the number of model-parallel parts changed from 2 (world 4, data-parallel size "
            "2) to 1 (world 2, data-parallel size 2) and 'rng' is per-rank"
        ) in refused["per_rank"]
        assert "per_rank='keep'" in refused["per_rank"]
        assert "rank 0:" in refused["tree"] and "rank 1:" in refused["tree"]  # agreed

    # tp 1 -> dp 2 x tp 2: both DP groups load part 0 of one; each reads every record
    # it needs once with broadcast (here every record but the per-rank ones).
    counter = str(tmp_path / "reads")
    at4 = run_ranks(
        rank_at_4, 4, args=(roots["tp1"], counter), env={COUNTER_ENV: counter}, timeout=180
    )
    tp1 = manifest_of(roots["tp1"], 1)
    assert tp1["world"]["parts"] == 1
    needed = sum(r["length"] for r in tp1["records"] if "dp_rank" not in r or "dtensor" in r)
    for r in at4:
        for broadcast in (True, False):
            assert_loaded(*r[broadcast][:2])
        assert r[True][2] == 2 * needed  # two DP groups, each reads it once
        assert r[False][2] > 2 * needed

    # One process, no process group: plain whole tensors.
    for root, step, per_part in ((roots["tp2"], 1, False), (roots["tp1"], 1, True)):
        live, want = state_of(None, per_part=per_part, fill=0.0, zero_from=0)
        with Checkpointer(root) as ckpt:
            assert ckpt.load(live, step=step, per_rank="keep") == step
        assert_loaded(leaves(live), want)
        assert "rng" not in live  # a per-rank value is not made up
    live, _ = state_of(None, per_part=True, fill=0.0)
    with Checkpointer(roots["tp2"]) as ckpt, pytest.raises(CheckpointError) as info:
        ckpt.load(live, step=2, per_rank="keep")
    assert "to 1 (world 1, data-parallel size 1), and state['zero'] cannot" in str(info.value)


# ------------------------------------------------------------------ the rule alone


def _record(key: str, part: int, crc: int, **extra: Any) -> dict[str, Any]:
    base = {"key": key, "kind": "tensor", "dtype": "float32", "shape": [2], "part": part}
    return base | {"raw_length": 8, "raw_crc32": crc} | extra


def _piece(key: str, part: int, parts: list[int], at: int, size: int, crc: int) -> Any:
    box = {"global_shape": [4], "offset": [at], "parts": parts}
    return _record(key, part, crc, shape=[size], dtensor=box, dp_rank=0)


def layout(parts: int) -> _plan.Layout:
    """A loading job of ``parts`` parts of two DP ranks each (no process group needed)."""
    return dataclasses.replace(_plan.single(), parts=parts, world_size=2 * parts, dp_size=2)


def test_parts_alike_load_into_any_number_and_the_others_are_named() -> None:
    world = {"world_size": 4, "dp_size": 2, "parts": 2}
    tree = {"d": [["a", {"t": "a"}], ["b", {"t": "b"}], ["x", {"x": "x"}]]}
    parts = [{"tree": tree, "per_rank": {}}, {"tree": tree, "per_rank": {}}]
    plain = [_record("a", 0, 1), _record("a", 1, 1), _record("b", 0, 2), _record("b", 1, 2)]
    spanning = [
        _piece("x", 0, [0, 1], 0, 4, 3),  # one global tensor over both parts
        _piece("x", 1, [0, 1], 4, 0, 9),  # an empty piece: nothing to differ in
    ]
    manifest: dict[str, Any] = {"world": world, "parts": parts, "records": plain + spanning}
    assert _parts.reshard_error(manifest, layout(1)) is None
    assert _parts.reshard_error(manifest, layout(3)) is None
    assert _parts.source(manifest, 1, 0) == 0 and _parts.source(manifest, 2, 1) == 1

    # Each part's own DTensor: alike, it loads; one piece different, refused by key.
    own = [_piece("x", p, [p], 2 * i, 2, 10 + i) for p in (0, 1) for i in (0, 1)]
    manifest["records"] = plain + own
    assert _parts.reshard_error(manifest, layout(1)) is None
    own[3]["raw_crc32"] = 99
    why = _parts.reshard_error(manifest, layout(4))
    assert why is not None
    assert why.startswith(
        "the number of model-parallel parts changed from 2 (world 4, data-parallel size 2) "
        "to 4 (world 8, data-parallel size 2), and "
    )
    assert "state['x'] cannot follow it: each part saved a DTensor of its own" in why
    assert "parts 0 and 1 differ" in why

    # Plain copies that differ: the first named in full, the others listed.
    manifest["records"] = [_record("a", 0, 1), _record("a", 1, 5), _record("b", 0, 2)]
    manifest["records"] += [_record("b", 1, 6), *spanning]
    why = _parts.reshard_error(manifest, layout(1))
    assert why is not None
    assert "state['a'] (also 'b') cannot follow it: each part saved a copy of its own" in why
    assert "load it with 2 parts" in why
    assert _parts.reshard_error(manifest, layout(2)) is None  # part i loads part i

    # One saved part holds everything alike with itself.
    manifest = {"world": world | {"parts": 1}, "parts": parts[:1], "records": [_record("a", 0, 1)]}
    assert _parts.reshard_error(manifest, layout(2)) is None

    # Trees that differ: the path named.
    other = {"d": [["a", {"t": "a"}], ["b", {"v": 1}], ["x", {"x": "x"}]]}
    manifest["parts"] = [parts[0], {"tree": other, "per_rank": {}}]
    manifest["world"], manifest["records"] = world, []
    why = _parts.reshard_error(manifest, layout(1))
    assert why is not None and "at state['b']" in why
