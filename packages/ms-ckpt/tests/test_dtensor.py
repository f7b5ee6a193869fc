"""DTensor state on real gloo ranks: saved once per distinct piece, loaded into other DP
sizes (4 -> 2, 2 -> 4, 1 -> 2, 2 -> 1 as plain tensors), other placements and other
meshes (1-D and 2 x 2, a mesh spanning model-parallel parts), uneven shards (a rank
holding nothing), an AdamW state_dict of DTensor parameters resumed at another DP size,
and the refusals. Every loaded value is compared bit for bit with the region that
torch's own ``distribute_tensor`` gives of the saved global tensor."""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor import distribute_tensor as _distribute

from ms_ckpt import Checkpointer, CheckpointError, per_rank
from ms_ckpt.cli import main as cli
from ms_testing import run_ranks
from ms_testing.fs import COUNTER_ENV, read_counts, reset_counts

pytestmark = pytest.mark.slow  # every test starts 1 to 4 ranks, each with a writer
DEADLINE = 60.0

Spec = dict[str, tuple[tuple[int, ...], torch.dtype, list[str]]]

# State on a 1-D data-parallel mesh, as ZeRO (1-D buckets), FSDP (rows of a matrix) and
# a column split produce it. 10 and 3 rows do not divide by 4: torch.chunk gives 3,3,3,1
# and 1,1,1,0 (the last rank holds nothing).
SPEC_1D: Spec = {
    "zero/exp_avg": ((10,), torch.float32, ["S0"]),
    "zero/exp_avg_sq": ((10,), torch.bfloat16, ["S0"]),
    "zero/short": ((3,), torch.float32, ["S0"]),
    "fsdp": ((7, 5), torch.float32, ["S0"]),
    "cols": ((6, 9), torch.float32, ["S1"]),
    "rep": ((4, 3), torch.float32, ["R"]),
    "big": ((4096,), torch.float32, ["S0"]),  # 16 KiB whole: the host buffer must not fit it
}
# How the loading job lays the same tensors out: other placements, and the plain
# replicated tensor "plain" as a DTensor.
LOAD_1D = {
    "zero/exp_avg": ["S0"],
    "zero/exp_avg_sq": ["S0"],
    "zero/short": ["R"],
    "fsdp": ["S1"],
    "cols": ["S0"],
    "rep": ["S0"],
    "big": ["S0"],
    "plain": ["S0"],
}
PLAIN = ((5, 2), torch.float32)


def glob(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The global tensor ``name`` stands for: the same in every process."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g).to(dtype)


def placements(spec: list[str]) -> list[Placement]:
    return [Replicate() if p == "R" else Shard(int(p[1:])) for p in spec]


def distribute(t: torch.Tensor, mesh: DeviceMesh, spec: list[str]) -> DTensor:
    """torch's own split of ``t`` (each rank cuts its piece locally: no communication)."""
    return _distribute(t, mesh, placements(spec), src_data_rank=None)


def saved_state(mesh: DeviceMesh) -> dict[str, Any]:
    state: dict[str, Any] = {"zero": {}}
    for name, (shape, dtype, spec) in SPEC_1D.items():
        d = distribute(glob(name, shape, dtype), mesh, spec)
        if name.startswith("zero/"):
            state["zero"][name.removeprefix("zero/")] = d
        else:
            state[name] = d
    state["plain"] = glob("plain", *PLAIN)
    state["step"] = 7
    return state


def live_state(mesh: DeviceMesh) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """DTensors laid out as LOAD_1D, filled with -7, and the local piece each should get."""
    shapes = {n: (s, d) for n, (s, d, _) in SPEC_1D.items()} | {"plain": PLAIN}
    state: dict[str, Any] = {"zero": {}, "step": 0}
    expected = {}
    for name, spec in LOAD_1D.items():
        shape, dtype = shapes[name]
        d = distribute(torch.full(shape, -7.0, dtype=dtype), mesh, spec)
        if name.startswith("zero/"):
            state["zero"][name.removeprefix("zero/")] = d
        else:
            state[name] = d
        expected[name] = distribute(glob(name, shape, dtype), mesh, spec).to_local()
    return state, expected


def leaves(state: dict[str, Any], path: str = "") -> dict[str, torch.Tensor]:
    """Copies of every tensor in a nested dict by path; of a DTensor, its local shard."""
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out |= leaves(v, f"{path}{k}/")
        elif isinstance(v, DTensor):
            out[path + k] = v.to_local().clone()
        elif isinstance(v, torch.Tensor):
            out[path + k] = v.clone()
    return out


def assert_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(got[k], want[k]), k


def rank_save_1d(root: str) -> int:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with Checkpointer(root, compression="none") as ckpt:
        ckpt.save(1, saved_state(mesh)).wait(timeout=DEADLINE)
        pool = ckpt._pool._shm
        return 0 if pool is None else pool.size


def rank_load_1d(root: str, counter: str | None = None) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out: dict[str, Any] = {}
    for broadcast in (True, False):
        state, expected = live_state(mesh)
        if counter is not None and dist.get_rank() == 0:
            reset_counts(counter)
        dist.barrier()
        with Checkpointer(f"counting://{root}" if counter else root) as ckpt:
            assert ckpt.load(state, broadcast=broadcast) == 1
        dist.barrier()
        out[broadcast] = (leaves(state), expected, state["step"])
        if counter is not None:
            reads = read_counts(counter).by_path.items()
            out[f"reads_{broadcast}"] = sum(n for p, n in reads if p.endswith(".bin"))
        dist.barrier()
    return out


def rank_load_three_save_one(roots: dict[str, str]) -> dict[str, Any]:
    """At world 2: load the checkpoints saved at 4, at 1 and without DTensors; save one."""
    results = {k: rank_load_1d(roots[k]) for k in ("from4", "from1", "plain")}
    rank_save_1d(roots["at2"])
    return results


def check_loads(results: list[dict[str, Any]]) -> None:
    for r in results:
        for broadcast in (True, False):
            got, want, step = r[broadcast]
            assert_bits(got, want)
            assert step == 7


def test_dp_size_changes_reshard_dtensor_state(tmp_path: Path, capsys: Any) -> None:
    roots = {k: str(tmp_path / k) for k in ("from4", "from1", "plain", "at2")}
    pools = run_ranks(rank_save_1d, 4, args=(roots["from4"],), timeout=120)
    run_ranks(rank_save_1d, 1, args=(roots["from1"],), timeout=120)
    plain = {n: glob(n, s, d) for n, (s, d, _) in SPEC_1D.items()} | {
        "plain": glob("plain", *PLAIN)
    }
    with Checkpointer(roots["plain"]) as ckpt:  # no torch.distributed here: plain tensors
        nested = {k: v for k, v in plain.items() if not k.startswith("zero/")}
        nested["zero"] = {k[5:]: v for k, v in plain.items() if k.startswith("zero/")}
        ckpt.save(1, nested | {"step": 7}).wait(timeout=DEADLINE)

    # Stage 1 copied local shards only: the whole of "big" is 16 KiB, a rank's share 4 KiB.
    assert all(0 < size < 8 << 10 for size in pools), pools
    manifest = json.loads((tmp_path / "from4" / "step-00000001" / "manifest.json").read_text())
    assert manifest["version"] == 2
    by_key: dict[str, list[dict[str, Any]]] = {}
    for rec in manifest["records"]:
        by_key.setdefault(rec["key"], []).append(rec)
    (rep,) = by_key["rep"]  # Replicate: one rank writes it, the whole tensor
    assert rep["dtensor"] == {"global_shape": [4, 3], "offset": [0, 0], "parts": [0]}
    assert rep["dp_rank"] == 0
    short = sorted(by_key["zero/short"], key=lambda r: r["dp_rank"])
    assert [(r["dtensor"]["offset"], r["shape"]) for r in short] == [
        ([0], [1]),
        ([1], [1]),
        ([2], [1]),
        ([3], [0]),  # the rank that holds nothing writes an empty piece, at the end
    ]
    cols = sorted(by_key["cols"], key=lambda r: r["dp_rank"])
    assert [(r["dtensor"]["offset"], r["shape"]) for r in cols] == [
        ([0, 0], [6, 3]),
        ([0, 3], [6, 3]),
        ([0, 6], [6, 3]),
        ([0, 9], [6, 0]),
    ]
    for rec in manifest["records"]:  # uncompressed: exactly the local shard's bytes
        if "dtensor" in rec:
            assert rec["raw_length"] == rec["length"]

    at2 = run_ranks(rank_load_three_save_one, 2, args=(roots,), timeout=180)
    for r in at2:
        check_loads([r["from4"], r["from1"], r["plain"]])

    counter = str(tmp_path / "reads")
    at4 = run_ranks(
        rank_load_1d, 4, args=(roots["at2"], counter), env={COUNTER_ENV: counter}, timeout=180
    )
    check_loads(at4)
    # 2 -> 4: each saved piece is needed by two ranks, read by one of them and broadcast:
    # the DP group reads every record once. Without broadcast, both read it.
    saved2 = json.loads((tmp_path / "at2" / "step-00000001" / "manifest.json").read_text())
    total = sum(r["length"] for r in saved2["records"])
    assert all(r["reads_True"] == total for r in at4)
    assert all(r["reads_False"] > total for r in at4)

    # 2 -> 1 and 4 -> 1, into plain tensors: the whole tensors.
    for root in (roots["at2"], roots["from4"]):
        live = {n: torch.zeros_like(t) for n, t in plain.items()}
        nested = {k: v for k, v in live.items() if not k.startswith("zero/")}
        nested["zero"] = {k[5:]: v for k, v in live.items() if k.startswith("zero/")}
        with Checkpointer(root) as ckpt:
            ckpt.load(nested)
        assert_bits(live, plain)

    assert cli(["inspect", roots["from4"]]) == 0
    out = capsys.readouterr().out
    assert "dtensor [9:10] of (10,), by dp 3" in out and "dtensor [0:6, 3:6] of (6, 9)" in out
    assert "dtensors: 7 global tensors in 25 pieces" in out
    assert cli(["convert", roots["from4"], str(tmp_path / "whole.pt")]) == 0
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)
    assert torch.equal(whole["zero"]["short"], plain["zero/short"])
    assert torch.equal(whole["cols"], plain["cols"]) and torch.equal(whole["big"], plain["big"])


# ------------------------------------------------------------------ 2 x 2 meshes

SPEC_2D: Spec = {
    "ss": ((5, 7), torch.float32, ["S0", "S1"]),  # FSDP rows x TP columns, uneven both
    "rs": ((3, 4), torch.float32, ["R", "S0"]),  # HSDP: replicated over mesh dim 0
    "nested": ((9, 2), torch.float32, ["S0", "S0"]),  # one dim split by both mesh dims
    "tiny": ((1, 1), torch.bfloat16, ["S0", "S1"]),  # one rank holds it, three nothing
}
LOAD_2D = {"ss": ["S1", "R"], "rs": ["S0", "S1"], "nested": ["R", "S1"], "tiny": ["R", "R"]}
LOAD_2D_ON_2 = {"ss": ["S1"], "rs": ["S0"], "nested": ["S0"], "tiny": ["R"]}


def load_2d(root: str, mesh: DeviceMesh, layout: dict[str, list[str]]) -> dict[str, Any]:
    state = {
        n: distribute(torch.full(s, -7.0, dtype=d), mesh, layout[n])
        for n, (s, d, _) in SPEC_2D.items()
    }
    with Checkpointer(root) as ckpt:
        ckpt.load(state)
    want = {
        n: distribute(glob(n, s, d), mesh, layout[n]).to_local() for n, (s, d, _) in SPEC_2D.items()
    }
    return {"got": leaves(state), "want": want}


def parts_state(mesh: DeviceMesh, fill: float | None) -> dict[str, Any]:
    """On a ("tp", "dp") mesh: ZeRO state on the "dp" dim (another tensor per tp rank),
    tensor-parallel weights on the "tp" dim (the same in every DP replica), and a tensor
    over the whole mesh. ``fill``: the live state to load into, with that value."""
    tp = mesh.get_local_rank("tp")
    layout = {
        "zero": (mesh["dp"], (5,), f"zero{tp}", ["S0"]),
        "w": (mesh["tp"], (6, 4), "w", ["S0"]),
        "b": (mesh["tp"], (3,), "b", ["R"]),
        "full": (mesh, (4, 6), "full", ["S1", "S0"]),
    }
    if fill is not None:  # the loading job's layout
        layout["w"] = (mesh["tp"], (6, 4), "w", ["S1"])
        layout["b"] = (mesh["tp"], (3,), "b", ["S0"])
        layout["full"] = (mesh, (4, 6), "full", ["S0", "R"])
    out: dict[str, Any] = {}
    for key, (m, shape, name, spec) in layout.items():
        g = glob(name, shape, torch.float32)
        out[key] = distribute(g if fill is None else torch.full(shape, fill), m, spec)
        out[f"want/{key}"] = distribute(g, m, spec).to_local()
    return out


def rank_2d(roots: dict[str, str]) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    state = {n: distribute(glob(n, s, d), mesh, p) for n, (s, d, p) in SPEC_2D.items()}
    with Checkpointer(roots["2d"]) as ckpt:
        ckpt.save(1, state).wait(timeout=DEADLINE)
    dist.barrier()  # committed on rank 0 before anyone loads
    out: dict[str, Any] = {"same_world": load_2d(roots["2d"], mesh, LOAD_2D)}

    # A mesh that holds half of the DP group (here the whole world): the other half
    # would hold copies nobody can tell apart from other tensors. Refused, on every rank.
    with (
        Checkpointer(roots["refused"]) as ckpt,
        pytest.raises(ValueError, match="data-parallel group") as info,
    ):
        ckpt.save(1, {"h": distribute(glob("h", (4,), torch.float32), mesh["b"], ["S0"])})
    out["half_mesh"] = str(info.value)

    tpdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))
    saved = parts_state(tpdp, None)
    with Checkpointer(roots["parts"], mesh=tpdp, dp_dim="dp") as ckpt:
        ckpt.save(1, {k: v for k, v in saved.items() if not k.startswith("want/")}).wait(
            timeout=DEADLINE
        )
    return out


def rank_2d_on_2(roots: dict[str, str]) -> dict[str, Any]:
    out = {"from_2d": load_2d(roots["2d"], init_device_mesh("cpu", (2,)), LOAD_2D_ON_2)}
    # 2 parts x DP 2 -> 2 parts x DP 1, and the tp-dim DTensors in other placements.
    tpdp = init_device_mesh("cpu", (2, 1), mesh_dim_names=("tp", "dp"))
    live = parts_state(tpdp, -7.0)
    state = {k: v for k, v in live.items() if not k.startswith("want/")}
    with Checkpointer(roots["parts"], mesh=tpdp, dp_dim="dp") as ckpt:
        ckpt.load(state)
    out["parts"] = {
        "got": leaves(state),
        "want": {k.removeprefix("want/"): v for k, v in live.items() if k.startswith("want/")},
    }
    return out


def test_two_dim_meshes_and_model_parallel_parts(tmp_path: Path) -> None:
    roots = {k: str(tmp_path / k) for k in ("2d", "refused", "parts")}
    at4 = run_ranks(rank_2d, 4, args=(roots,), timeout=180)
    for r in at4:
        assert_bits(r["same_world"]["got"], r["same_world"]["want"])
        assert "must contain this rank's whole data-parallel group" in r["half_mesh"]
        assert "state['h']" in r["half_mesh"]

    manifest = json.loads((tmp_path / "2d" / "step-00000001" / "manifest.json").read_text())
    pieces: dict[str, list[tuple[int, list[int], list[int]]]] = {}
    for rec in manifest["records"]:
        pieces.setdefault(rec["key"], []).append(
            (rec["dp_rank"], rec["dtensor"]["offset"], rec["shape"])
        )
    # [Replicate(), Shard(0)]: only the ranks at coordinate 0 of mesh dim 0 (ranks 0, 1).
    assert sorted(pieces["rs"]) == [(0, [0, 0], [2, 4]), (1, [2, 0], [1, 4])]
    assert sorted(pieces["ss"]) == [
        (0, [0, 0], [3, 4]),
        (1, [0, 4], [3, 3]),
        (2, [3, 0], [2, 4]),
        (3, [3, 4], [2, 3]),
    ]
    # Both mesh dims split dim 0: 9 rows -> 5 | 4 -> 3, 2 | 2, 2.
    assert sorted(pieces["nested"]) == [
        (0, [0, 0], [3, 2]),
        (1, [3, 0], [2, 2]),
        (2, [5, 0], [2, 2]),
        (3, [7, 0], [2, 2]),
    ]
    assert len(pieces["tiny"]) == 4  # every rank writes its piece, three of them empty
    assert [p for p in pieces["tiny"] if 0 not in p[2]] == [(0, [0, 0], [1, 1])]

    parts = json.loads((tmp_path / "parts" / "step-00000001" / "manifest.json").read_text())
    scopes: dict[str, list[tuple[int, list[int]]]] = {}
    for rec in parts["records"]:
        scopes.setdefault(rec["key"], []).append((rec["part"], rec["dtensor"]["parts"]))
    # ZeRO state: one global tensor per part, both of its DP ranks' pieces.
    assert sorted(scopes["zero"]) == [(0, [0]), (0, [0]), (1, [1]), (1, [1])]
    # TP weights replicated across DP: each piece once (one DP rank of each part).
    assert sorted(scopes["w"]) == [(0, [0, 1]), (1, [0, 1])]
    assert scopes["b"] == [(0, [0, 1])]  # Replicate on tp and across DP: written once
    assert len(scopes["full"]) == 4

    at2 = run_ranks(rank_2d_on_2, 2, args=(roots,), timeout=180)
    for r in at2:
        assert_bits(r["from_2d"]["got"], r["from_2d"]["want"])
        assert_bits(r["parts"]["got"], r["parts"]["want"])
    live = {n: torch.zeros(s, dtype=d) for n, (s, d, _) in SPEC_2D.items()}
    with Checkpointer(roots["2d"]) as ckpt:
        ckpt.load(live)
    assert_bits(live, {n: glob(n, s, d) for n, (s, d, _) in SPEC_2D.items()})


# ------------------------------------------------------------------ optimizer state


def grad(name: str, shape: tuple[int, ...], step: int) -> torch.Tensor:
    return glob(f"{name}@{step}", shape, torch.float32)


PARAMS = {"w": (6, 5), "b": (3,), "v": (10,)}  # 6 and 3 rows split unevenly over 4


def adamw_run(root: str, first: int, last: int, save_at: int | None) -> dict[str, Any]:
    """AdamW on DTensor parameters (Shard(0) over the 1-D mesh), steps first..last with
    gradients drawn per step; resumes from ``root`` when ``save_at`` is None."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    init = 0.0 if save_at is None else 1.0  # a resumed run starts elsewhere
    params = {
        n: torch.nn.Parameter(distribute(glob(n, s, torch.float32) * init, mesh, ["S0"]))
        for n, s in PARAMS.items()
    }
    opt = torch.optim.AdamW(params.values(), lr=0.1, weight_decay=0.1)
    state = {"params": params, "optim": opt, "step": first - 1}

    def step(i: int) -> None:
        for n, p in params.items():
            p.grad = distribute(grad(n, PARAMS[n], i), mesh, ["S0"])
        opt.step()
        state["step"] = i

    def moments() -> dict[str, torch.Tensor]:
        """Every DTensor of the optimizer's state, whole (a collective)."""
        out = {}
        for n, p in params.items():
            for k, v in opt.state[p].items():
                if isinstance(v, DTensor):
                    out[f"{n}/{k}"] = v.full_tensor()
        return out

    out: dict[str, Any] = {}
    with Checkpointer(root) as ckpt:
        if save_at is None:
            step(0)  # the optimizer's state exists (DTensors) before it is loaded into
            assert ckpt.load(state) == first - 1 and state["step"] == first - 1
            out["loaded"] = moments()
        for i in range(first, last + 1):
            step(i)
            if i == save_at:
                ckpt.save(i, state).wait(timeout=DEADLINE)
                out["saved"] = moments()
    out["final"] = {n: p.full_tensor() for n, p in params.items()}
    return out


def test_adamw_state_of_dtensor_parameters_resumes_at_another_dp_size(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    full = run_ranks(adamw_run, 2, args=(root, 1, 5, 3), timeout=180)
    resumed = run_ranks(adamw_run, 4, args=(root, 4, 5, None), timeout=180)
    assert len(full[0]["saved"]) == 2 * len(PARAMS)  # exp_avg and exp_avg_sq, DTensors
    for b in resumed:
        assert_bits(b["loaded"], full[0]["saved"])
        for n in PARAMS:
            # Elementwise math on the same values: the same bits at any DP size.
            assert torch.equal(full[0]["final"][n], b["final"][n]), n


# ------------------------------------------------------------------ refusals


def rank_refusals(root: str) -> dict[str, str]:
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (2,))
    out: dict[str, str] = {}
    with Checkpointer(root) as ckpt:
        strided = [_StridedShard(0, split_factor=2)]
        bad = {
            "partial": {"g": DTensor.from_local(torch.ones(4), mesh, [Partial()])},
            "strided": {"s": DTensor.from_local(torch.ones(4), mesh, strided)},
            "per_rank": {"r": per_rank({"x": distribute(torch.ones(4), mesh, ["S0"])})},
            # 5 rows split 3 | 2, but each rank says it holds 4.
            "shape": {
                "u": DTensor.from_local(torch.ones(4), mesh, [Shard(0)], shape=(5,), stride=(1,))
            },
        }
        for name, state in bad.items():
            with pytest.raises((TypeError, ValueError)) as info:
                ckpt.save(1, state)
            out[name] = str(info.value)
        good = {
            "a": distribute(glob("a", (10,), torch.float32), mesh, ["S0"]),
            "p": glob("p", (5, 2), torch.float32),
        }
        ckpt.save(2, good).wait(timeout=DEADLINE)
        dist.barrier()
        wrong = {
            "longer": {"a": distribute(torch.zeros(11), mesh, ["S0"])},
            "dtype": {"a": distribute(torch.zeros(10, dtype=torch.bfloat16), mesh, ["S0"])},
            "plain_live": {"a": torch.zeros(9)},
            "plain_saved": {"p": distribute(torch.zeros(5, 3), mesh, ["S1"])},
            "partial_live": {"a": DTensor.from_local(torch.zeros(10), mesh, [Partial()])},
        }
        for name, state in wrong.items():
            before = leaves(state)
            with pytest.raises(CheckpointError) as err:
                ckpt.load(state, step=2)
            assert_bits(leaves(state), before)  # nothing was restored
            out[name] = str(err.value)
    return out


def test_unsupported_dtensors_and_mismatches_are_refused_by_path(tmp_path: Path) -> None:
    results = run_ranks(rank_refusals, 2, args=(str(tmp_path / "ckpt"),), timeout=180)
    for r in results:
        assert "state['g']" in r["partial"] and "Partial(sum)" in r["partial"]
        assert "pending reduction" in r["partial"]
        assert "state['s']" in r["strided"] and "strided sharding" in r["strided"]
        assert "state['r/x']: a DTensor cannot be inside per_rank()" in r["per_rank"]
        assert "state['u']" in r["shape"] and "local shard has shape (4,)" in r["shape"]
        # Every rank raises the same agreed error, naming the path, saved and asked.
        assert (
            "state['a']: checkpoint holds a DTensor of float32 with global shape (10,)"
            in (r["longer"])
        )
        assert "the live DTensor is float32 with global shape (11,)" in r["longer"]
        assert "the live DTensor is bfloat16 with global shape (10,)" in r["dtype"]
        assert "the live tensor is float32 with global shape (9,)" in r["plain_live"]
        assert (
            "state['p']: checkpoint holds a tensor of float32 with global shape (5, 2)"
            in (r["plain_saved"])
        )
        assert "(5, 3)" in r["plain_saved"]
        assert "state['a']" in r["partial_live"] and "Partial" in r["partial_live"]
        assert "rank 0:" in r["longer"] and "rank 1:" in r["longer"]
