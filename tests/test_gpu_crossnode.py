"""The native normal-mode kernels at 2, 4 and 8 ranks against the reference backend, and the
bad-input sequence that once raced on the cross-node path, on whatever GPUs are present (ranks
share them when fewer: tests/_dist.py).

Topologies: one node of R ranks (the NVLink kernels), and two "nodes" of R / 2 ranks (the cross-node
kernels: every byte between the halves goes through their NVSHMEM puts and signals). Each case runs
tests/test_gpu_intranode.py's checks (layout, dispatch, combine with and without weights, cached
dispatch, events; bitwise, with poisoned outputs and workspace) on random shapes of tokens per rank.

The bad-input sequence (issue "EP on one GPU", 4a): on one Buffer, a dispatch whose every expert id
is E, one whose every id is -2, one with int32 ids, one with a wrong hidden size, each expected to
raise on every rank, then a valid dispatch + combine that must match the reference bit for bit;
repeated BAD_ROUNDS times with a random delay (0-20 ms) before every call on every rank, so the
ranks leave and enter calls at different times.
"""
from __future__ import annotations

import random
import time

import pytest
import torch
import torch.distributed as dist

import moe_ep
from tests._dist import device, requires_gpus, run_workers
from tests.oracle import random_topk
from tests.test_gpu_intranode import Case, _run_case, _same, _same_dispatch

pytestmark = requires_gpus()

BAD_ROUNDS = 50
MAX_SKEW_S = 0.02
TIMEOUT_S = 20.0  # a desynchronised group fails as CommTimeoutError, not as a hang

# (hidden, experts, topk, max_tokens_per_rank) -> cases; tokens per rank are drawn per case seed
SHAPES = {
    (2048, 32, 8, 256): [Case(1, (), "random"), Case(2, (), "skewed", fp8=True, alignment=4),
                         Case(3, (), "one_expert", worst_case=True), Case(4, (), "none", num_sms=3)],
    (7168, 64, 4, 96): [Case(5, (), "random", fp8=True, worst_case=True), Case(6, (), "random", alignment=16)],
}
BAD_SHAPE = (1024, 16, 4, 64)


def _tokens(case: Case, world: int, most: int) -> tuple[int, ...]:
    """Tokens per rank for a case: one rank with 0, one at the limit, the others random."""
    rng = random.Random(case.seed)
    tokens = [rng.randint(1, most) for _ in range(world)]
    tokens[case.seed % world] = 0
    tokens[(case.seed + 1) % world] = most
    return tuple(tokens)


def _cases(rank: int, world: int, topo: dict) -> None:
    for shape, cases in SHAPES.items():
        hidden, experts, k, t = shape
        common = dict(hidden=hidden, num_experts=experts, num_topk=k, max_tokens_per_rank=t, **topo)
        with moe_ep.Buffer(dist.group.WORLD, device=device(), backend="nvshmem", **common) as nat, \
                moe_ep.Buffer(dist.group.WORLD, device=device(), backend="reference", **common) as ref:
            for case in cases:
                case = Case(case.seed, _tokens(case, world, t), case.routing, case.fp8, case.alignment,
                            case.worst_case, case.num_sms)
                _run_case(nat, ref, shape, case, rank)


def _bad_calls(buf: moe_ep.Buffer, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, experts: int):
    """(name, call, exception type) of each bad dispatch in the sequence."""
    return [
        ("every id = E", lambda: buf.dispatch(x, torch.full_like(idx, experts), w), ValueError),
        ("every id = -2", lambda: buf.dispatch(x, torch.full_like(idx, -2), w), ValueError),
        ("int32 ids", lambda: buf.dispatch(x, idx.to(torch.int32), w), TypeError),
        ("wrong hidden", lambda: buf.dispatch(x[:, :-8].contiguous(), idx, w), ValueError),
    ]


def _bad_sequence(rank: int, world: int, topo: dict) -> None:
    hidden, experts, k, t = BAD_SHAPE
    common = dict(hidden=hidden, num_experts=experts, num_topk=k, max_tokens_per_rank=t, **topo)
    rng = random.Random(1000 + rank)
    with moe_ep.Buffer(dist.group.WORLD, device=device(), backend="nvshmem", timeout_s=TIMEOUT_S, **common) as nat, \
            moe_ep.Buffer(dist.group.WORLD, device=device(), backend="reference", **common) as ref:
        for round_ in range(BAD_ROUNDS):
            g = torch.Generator(device="cuda").manual_seed(round_ * 131 + rank)
            n = int(torch.randint(1, t + 1, (1,), generator=g, device="cuda").item())
            x = torch.randn(n, hidden, generator=g, device="cuda").to(torch.bfloat16)
            idx = random_topk("random", n, experts, k, g)
            w = torch.rand(n, k, generator=g, device="cuda")
            for name, call, kind in _bad_calls(nat, x, idx, w, experts):
                time.sleep(rng.uniform(0, MAX_SKEW_S))
                with pytest.raises(kind):
                    call()
                    raise AssertionError(f"round {round_}: '{name}' was accepted")
            time.sleep(rng.uniform(0, MAX_SKEW_S))
            got, want = nat.dispatch(x, idx, w), ref.dispatch(x, idx, w)
            what = f"{topo or 'one node'} round {round_}"
            _same_dispatch(got, want, f"{what}: dispatch after the bad calls")
            y = torch.randn(want.x.shape, generator=g, device="cuda").to(torch.bfloat16)
            time.sleep(rng.uniform(0, MAX_SKEW_S))
            _same(nat.combine(y, got.handle), ref.combine(y, want.handle), f"{what}: combine after the bad calls")


def _worker(rank: int, world: int, topos: list[dict], cases: bool) -> None:
    for topo in topos:
        if cases:
            _cases(rank, world, topo)
        _bad_sequence(rank, world, topo)


def test_two_ranks_one_node_and_two_nodes() -> None:
    """2 ranks: the bad-input sequence as one node and as 2 nodes x 1 (the cases run in test_gpu_intranode)."""
    run_workers(2, _worker, [{}, {"ranks_per_node": 1}], False, backend="gpu", timeout_s=600)


def test_four_ranks() -> None:
    """4 ranks: one node, and 2 nodes x 2."""
    run_workers(4, _worker, [{}, {"ranks_per_node": 2}], True, backend="gpu", timeout_s=600)


def test_eight_ranks() -> None:
    """8 ranks: 2 nodes x 4 (the cases and the bad-input sequence)."""
    run_workers(8, _worker, [{"ranks_per_node": 4}], True, backend="gpu", timeout_s=900)
