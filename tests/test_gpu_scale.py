"""EP32 (4 nodes x 8) and EP48 (6 nodes x 8) with every rank on one GPU: the native normal-mode and
low-latency kernels against the reference backend, bitwise, as tests/test_gpu_crossnode.py and
tests/test_gpu_low_latency.py check them at 2-8 ranks (their comparisons, poisoning and inputs).
EP64 on one GPU is beyond NVSHMEM (at most 48 processes per GPU; its init crashed at 64): every rank's
native Buffer raises ValueError saying so, and the reference backend serves the same group.

Sized for time-slicing: R processes share the GPU, so a kernel that waits for a peer waits until the
peer's process gets its slice (~2 ms, docs/one_gpu.md), and a call costs about one slice per rank
however little it moves. What made the earlier 32-rank run stall was the data, not the kernels: the
low-latency checks at 2 ranks use T = 128 tokens at hidden 7168, where one rank's expert-major
buffers are [E_l, R * T, H] (470 MB per tensor at R = 32, about 2 GB per rank with the reference's
copy and the combine input: ~60 GB of the GPU and 2 GB through gloo per reference call), and their
CUDA graph replays 100 calls, each checked against the reference. Here T is 16 at hidden 7168 and
the graph replays 3 calls; each phase's time goes to stdout (pytest -s).

Runs only with MOE_EP_SCALE=1 (tests/run_gpu_scale.sh sets it): minutes, not seconds.
"""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import moe_ep
from moe_ep.comm import _native
from tests._dist import device, requires_gpus, run_workers
from tests.oracle import random_topk
from tests.test_gpu_crossnode import _tokens
from tests.test_gpu_intranode import Case, _run_case
from tests.test_gpu_low_latency import _check_combine, _check_dispatch, _poison, _x

pytestmark = [requires_gpus(), pytest.mark.skipif(os.environ.get("MOE_EP_SCALE") != "1",
                                                 reason="the 32- and 64-rank runs take minutes: MOE_EP_SCALE=1")]

RANKS_PER_NODE = 8


def _normal_shapes(world: int) -> dict[tuple[int, int, int, int], list[Case]]:
    """(hidden, experts, topk, max_tokens_per_rank) -> cases; experts are a multiple of the world."""
    return {
        (2048, 4 * world, 8, 64): [Case(1, (), "random"), Case(2, (), "skewed", fp8=True, alignment=4),
                                   Case(3, (), "one_expert", worst_case=True)],
        (7168, 2 * world, 4, 32): [Case(4, (), "random", fp8=True, worst_case=True), Case(5, (), "none")],
    }


def _low_latency_shapes(world: int) -> list[tuple[int, int, int, int]]:
    """(hidden, experts, topk, max_tokens_per_rank): the decode shape at T = 16 and K = 16, with 256 and
    128 experts, or the largest multiple of the world below (EP48: 240 and 96)."""
    return [(7168, world * (256 // world), 8, 16), (512, world * (128 // world), 16, 24)]


LOW_LATENCY_ITERS = 4
GRAPH_REPLAYS = 3


def _phase(rank: int, world: int, what: str, began: float) -> None:
    """Every rank finishes the phase; rank 0 prints how long it took."""
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 0:
        print(f"EP{world}: {what}: {time.monotonic() - began:.1f} s", flush=True)


def _normal(rank: int, world: int) -> None:
    topo = {"ranks_per_node": RANKS_PER_NODE}
    for shape, cases in _normal_shapes(world).items():
        began = time.monotonic()
        hidden, experts, k, t = shape
        common = dict(hidden=hidden, num_experts=experts, num_topk=k, max_tokens_per_rank=t, **topo)
        with moe_ep.Buffer(dist.group.WORLD, device=device(), backend="nvshmem", **common) as nat, \
                moe_ep.Buffer(dist.group.WORLD, device=device(), backend="reference", **common) as ref:
            assert nat.backend_name == "nvshmem" and nat.ranks_per_node == RANKS_PER_NODE
            for case in cases:
                case = Case(case.seed, _tokens(case, world, t), case.routing, case.fp8, case.alignment,
                            case.worst_case, case.num_sms)
                _run_case(nat, ref, shape, case, rank)
                torch.cuda.empty_cache()  # _run_case's poisoning leaves ~0.5 GB cached per rank
        _phase(rank, world, f"normal mode {shape}, {len(cases)} cases", began)


def _low_latency_calls(buf, ref, shape, rank: int, world: int, shared: torch.Generator,
                       local: torch.Generator) -> None:
    """Dispatch, check, combine, check: every routing, bf16 and FP8, with and without the receive hook,
    one rank with no tokens and one at the limit per call."""
    hidden, experts, k, t = shape
    e_l, slots = experts // world, world * t
    for it in range(LOW_LATENCY_ITERS):
        empty = int(torch.randint(0, world, (1,), generator=shared))
        n = 0 if rank == empty else t if rank == (empty + 1) % world else \
            int(torch.randint(1, t + 1, (1,), generator=local, device="cuda"))
        routing = ["random", "skewed", "one_expert", "none"][it % 4]
        use_fp8, hook = hidden % 128 == 0 and it % 2 == 0, it % 3 == 1
        x, idx = _x(n, hidden, local), random_topk(routing, n, experts, k, local)
        w = torch.rand(n, k, generator=local, device="cuda")
        what = f"EP{world} shape={shape} it={it} n={n} routing={routing} fp8={use_fp8} hook={hook}"
        nat = buf.low_latency_dispatch(x, idx, use_fp8=use_fp8, return_recv_hook=hook)
        if hook:
            nat.hook()
        want = ref.low_latency_dispatch(x, idx, use_fp8=use_fp8)
        _check_dispatch(nat, want, what)
        y = (torch.randn(e_l, slots, hidden, generator=local, device="cuda") * 3).to(torch.bfloat16)
        _check_combine(buf, ref, nat.handle, want.handle, idx, w, y, hook=not hook, what=what)
        _poison(nat)


def _low_latency_graph(buf, ref, shape, rank: int, local: torch.Generator) -> None:
    """Dispatch + combine captured in one CUDA graph, replayed with fresh inputs."""
    hidden, experts, k, t = shape
    n = t if rank % 2 == 0 else max(t - 3, 1)
    x_s = torch.empty(n, hidden, dtype=torch.bfloat16, device="cuda")
    idx_s = torch.empty(n, k, dtype=torch.int64, device="cuda")
    w_s = torch.empty(n, k, dtype=torch.float32, device="cuda")

    def fill() -> None:
        x_s.copy_(_x(n, hidden, local))
        idx_s.copy_(random_topk("random", n, experts, k, local))
        w_s.copy_(torch.rand(n, k, generator=local, device="cuda"))

    fill()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        disp = buf.low_latency_dispatch(x_s, idx_s)
        comb = buf.low_latency_combine(disp.x, idx_s, w_s, disp.handle)
    for i in range(GRAPH_REPLAYS):
        fill()
        graph.replay()
        want = ref.low_latency_dispatch(x_s, idx_s)
        _check_dispatch(disp, want, f"shape={shape} graph replay {i}")
        want_out = ref.low_latency_combine(want.x, idx_s, w_s, want.handle).x
        assert torch.equal(comb.x.view(torch.int16), want_out.view(torch.int16)), f"graph replay {i}: combine differs"
        _poison(disp)
    del graph


def _low_latency(rank: int, world: int) -> None:
    shared = torch.Generator().manual_seed(1234)
    local = torch.Generator(device="cuda").manual_seed(99 + rank)
    shapes = _low_latency_shapes(world)
    for shape in shapes:
        began = time.monotonic()
        hidden, experts, k, t = shape
        kwargs = dict(hidden=hidden, num_experts=experts, num_topk=k, max_tokens_per_rank=t, low_latency=True,
                      ranks_per_node=RANKS_PER_NODE)
        with moe_ep.Buffer(dist.group.WORLD, device=device(), backend="nvshmem", **kwargs) as buf, \
                moe_ep.Buffer(dist.group.WORLD, device=device(), backend="reference", **kwargs) as ref:
            _low_latency_calls(buf, ref, shape, rank, world, shared, local)
            if shape == shapes[-1]:
                _low_latency_graph(buf, ref, shape, rank, local)
        _phase(rank, world, f"low latency {shape}", began)


def _worker(rank: int, world: int) -> None:
    if rank == 0:
        free, total = torch.cuda.mem_get_info()
        print(f"EP{world}: {world} ranks on {torch.cuda.get_device_name()}, {free / 2**30:.0f} of "
              f"{total / 2**30:.0f} GiB free", flush=True)
    _normal(rank, world)
    _low_latency(rank, world)
    if rank == 0:
        print(f"EP{world}: peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB allocated by rank 0", flush=True)


@pytest.mark.parametrize("world", [32, 48])
def test_many_ranks_on_one_gpu(world: int) -> None:
    """world ranks as world / 8 nodes of 8, all on the GPUs present (one H200: all on it)."""
    run_workers(world, _worker, backend="gpu", timeout_s=540)


def _refused(rank: int, world: int) -> None:
    kwargs = dict(hidden=512, num_experts=world, num_topk=4, max_tokens_per_rank=8, ranks_per_node=RANKS_PER_NODE)
    most = _native.constant("MAX_RANKS_PER_GPU")
    with pytest.raises(ValueError, match=rf"{world} ranks of the group share one GPU, but NVSHMEM serves at most "
                                         rf"{most} processes per GPU"):
        moe_ep.Buffer(dist.group.WORLD, device=device(), backend="nvshmem", **kwargs)
    with moe_ep.Buffer(dist.group.WORLD, device=device(), backend="reference", **kwargs) as ref:
        x = torch.randn(8, 512, device="cuda").to(torch.bfloat16)
        idx = random_topk("random", 8, world, 4, torch.Generator(device="cuda").manual_seed(rank), device="cuda")
        disp = ref.dispatch(x, idx, torch.rand(8, 4, device="cuda"))
        every = [torch.empty_like(idx) for _ in range(world)]
        dist.all_gather(every, idx)  # brute force: this rank's one expert, over every rank's top-k
        assert disp.tokens_per_expert == [sum(int((i == rank).sum()) for i in every)]


def test_more_ranks_on_one_gpu_than_nvshmem_serves() -> None:
    """64 ranks on one GPU: every rank's native Buffer is refused alike, none crashes; the reference serves."""
    world = 64
    if world // torch.cuda.device_count() <= _native.constant("MAX_RANKS_PER_GPU"):
        pytest.skip(f"{world} ranks on {torch.cuda.device_count()} GPUs share none beyond NVSHMEM's limit")
    run_workers(world, _refused, backend="gpu", timeout_s=300)
