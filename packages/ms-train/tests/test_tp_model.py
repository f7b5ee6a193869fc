"""The tensor-parallel GPT against the same GPT in one process: loss, logits and every
gradient, on 2 and 4 gloo ranks, both block types, a sliding window, chunk counts 1, 2
and 4, a vocabulary that does not divide by TP, tied and untied, dropout on."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from ms_parallel.tensor_parallel import tp_spec
from ms_testing.dist import run_ranks
from ms_train import parallelize
from ms_train.config import ConfigError, ModelConfig
from ms_train.model import GPT

BASE: dict[str, Any] = {
    "vocab_size": 37,
    "d_model": 32,
    "n_layers": 2,
    "n_heads": 4,
    "seq_len": 16,
    "kernels": "torch",
    "seed": 3,
}


def _compare(world: int, overrides: dict[str, Any], chunks: int, overlap: bool) -> str:
    config = ModelConfig(**{**BASE, **overrides})
    torch.manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_len))
    targets = torch.randint(0, config.vocab_size, (2, config.seq_len))
    targets[0, :3] = -100  # ignored targets count in neither loss
    whole = GPT(config)
    _, ref_loss = whole(tokens, targets)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in whole.named_parameters()}
    ref_logits = whole(tokens).detach()

    model = parallelize(GPT(config), dist.group.WORLD, chunks=chunks, overlap=overlap)
    _, loss = model(tokens, targets)
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        spec = tp_spec(p)
        assert spec is not None, name
        grad = p.grad
        assert grad is not None, name
        if spec.partial_grad:
            grad = grad.clone()
            dist.all_reduce(grad)  # what the engine does for sequence-parallel partials
        ref = spec.from_state(ref_grads[name], p.detach(), name)
        torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-6, msg=name)
    with torch.no_grad():  # logits for sampling are gathered, also at odd lengths
        torch.testing.assert_close(model(tokens), ref_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(tokens[:, :5]), whole(tokens[:, :5]), rtol=1e-5, atol=1e-5)
    # The state holds the TP 1 model's keys and global shapes, and loads back.
    state = model.state_dict()
    assert set(state) == set(whole.state_dict())
    for key, value in whole.state_dict().items():
        assert tuple(state[key].shape) == tuple(value.shape), key
        torch.testing.assert_close(state[key].full_tensor(), value, msg=key)
    fresh = parallelize(GPT(ModelConfig(**{**BASE, **overrides, "seed": 9})), dist.group.WORLD)
    fresh.load_state_dict(whole.state_dict())  # whole tensors load, each rank its part
    for (name, a), (_, b) in zip(fresh.named_parameters(), model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    return "ok"


def _compare_dropout(block: str, chunks: int) -> str:
    """With dropout on, the TP GPT draws the TP 1 GPT's masks from the same generator
    state (every TP rank alike): the same loss and gradients. The parallel block's
    masks multiply partial sums (alike on every rank), the others a sequence shard
    (each rank its rows)."""
    config = ModelConfig(**{**BASE, "block": block, "dropout": 0.25})
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_len))
    whole = GPT(config).train()
    torch.manual_seed(11)
    _, ref_loss = whole(tokens, tokens)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in whole.named_parameters()}
    model = parallelize(GPT(config), dist.group.WORLD, chunks=chunks).train()
    torch.manual_seed(11)
    _, loss = model(tokens, tokens)
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        spec = tp_spec(p)
        assert spec is not None and p.grad is not None, name
        grad = p.grad.clone()
        if spec.partial_grad:
            dist.all_reduce(grad)
        torch.testing.assert_close(
            grad, spec.from_state(ref_grads[name], p.detach(), name), rtol=1e-5, atol=1e-6
        )
    # Another generator state draws other masks: the loss moves (dropout is on).
    _, other = model(tokens, tokens)
    assert not torch.equal(other, loss)
    return "ok"


CASES = [
    ({"block": "parallel", "window": 5}, 2, True),
    ({"block": "serial", "window": None}, 1, True),
    ({"block": "parallel", "tie_embeddings": False, "vocab_size": 257}, 4, True),
    ({"block": "serial", "window": 7, "vocab_size": 257}, 2, False),
]


def _all(world: int) -> list[str]:
    out = [_compare(world, o, c, ov) for o, c, ov in CASES]
    return [*out, _compare_dropout("parallel", 2), _compare_dropout("serial", 1)]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_tp_gpt_matches_one_process(world: int) -> None:
    got = run_ranks(_all, world, args=(world,), timeout=240)
    assert got == [["ok"] * (len(CASES) + 2)] * world


def test_sizes_that_do_not_divide_are_refused() -> None:
    from ms_train._tp_model import check_tp

    with pytest.raises(ConfigError, match=r"model.n_heads \(4\) must divide by parallel.tp \(3\)"):
        check_tp(ModelConfig(**BASE), 3)
    with pytest.raises(ConfigError, match=r"model.seq_len \(18\) must divide by parallel.tp \(4\)"):
        check_tp(ModelConfig(**{**BASE, "seq_len": 18}), 4)


def _events(block: str, chunks: int) -> dict[str, Any]:
    from ms_parallel.events import EventLog

    log = EventLog()
    config = ModelConfig(**{**BASE, "block": block, "n_layers": 2})
    model = parallelize(GPT(config), dist.group.WORLD, chunks=chunks, on_event=log)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_len))
    _, loss = model(tokens, tokens)
    forward = [e for e in log.events if e.kind == "issue" and e.attrs["phase"] == "forward"]
    loss.backward()
    per_layer: dict[str, dict[str, int]] = {}
    for e in forward:
        counts = per_layer.setdefault(e.attrs["layer"], {})
        counts[e.name] = counts.get(e.name, 0) + 1
    # In every forward gather, all pieces are issued before the first is waited for.
    order = []
    for e in log.events:
        if (
            e.name == "all_gather"
            and e.attrs["phase"] == "forward"
            and e.attrs["layer"] == "block 0"
        ):
            order.append((e.kind, e.attrs["chunk"]))
    return {"counts": per_layer, "order": order}


@pytest.mark.slow
@pytest.mark.parametrize("block", ["parallel", "serial"])
def test_a_block_gathers_and_scatters_once_per_branch_in_chunks(block: str) -> None:
    chunks = 3
    got = run_ranks(_events, 2, args=(block, chunks), timeout=120)[0]
    per_block = 1 if block == "parallel" else 2  # one pair, or one per attention and MLP
    for i in range(2):
        counts = got["counts"][f"block {i}"]
        assert counts == {"all_gather": per_block * chunks, "reduce_scatter": per_block * chunks}
    first = got["order"][: 2 * chunks]
    assert first[:chunks] == [("issue", c) for c in range(chunks)]
    assert first[chunks:] == [("wait_begin", 0), ("wait_end", 0), ("wait_begin", 1)][:chunks]


def _stopped_peer() -> str:
    from ms_parallel import CollectiveTimeout

    config = ModelConfig(**BASE)
    model = parallelize(GPT(config), dist.group.WORLD, chunks=2, timeout_s=2.0)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_len))
    if dist.get_rank() == 1:
        import time

        time.sleep(8)  # takes part in nothing
        return "slept"
    try:
        model(tokens, tokens)
    except CollectiveTimeout as e:
        return str(e)
    return "no error"


@pytest.mark.slow
def test_a_stopped_tp_peer_is_named() -> None:
    message = run_ranks(_stopped_peer, 2, timeout=60)[0]
    # The embedding's reduce-scatter is the first TP collective of a forward.
    assert message.startswith("reduce_scatter (embedding, forward, chunk 0 of 1)"), message
    assert "within 2 s on rank 0" in message and "ranks 0, 1" in message
