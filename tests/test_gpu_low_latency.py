"""Native low-latency dispatch/combine against the reference backend on the same inputs (2 GPUs, NCCL).

One spawn runs every case: per shape, a native Buffer (backend="nvshmem", low_latency=True) and a
reference Buffer see identical inputs; dispatch rows below count, scales, counts and source info must
be bitwise equal, and so must combine. Native outputs are poisoned after each check, so rows a later
call fails to rewrite show up. Also: the receive hook, two results held at once, normal calls
interleaved with low-latency ones on one Buffer, a 2-SM grid (Config.low_latency_num_sms), one CUDA graph holding both calls replayed 100 times
with fresh inputs, the hook-order guard, an eager call returning while work queued before it still runs (its
stamp exchange off the caller's stream), and a timeout that names the phase (raised by the call). Everything runs twice:
with the detected node size (both GPUs in one node: NVLink loads/stores) and with ranks_per_node=1
(two "nodes": every byte between the GPUs goes through the NVSHMEM put/signal code).
"""
from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.distributed as dist

import moe_ep
from tests._dist import device, requires_gpus, run_workers
from tests.oracle import random_topk

WORLD = 2
# (hidden, experts, topk, max_tokens_per_rank): the L1 decode shape; K = 16; K = 1; hidden % 16 == 8.
SHAPES = [(7168, 256, 8, 128), (512, 16, 16, 40), (256, 8, 1, 17), (136, 12, 4, 24)]
ROUTINGS = ["random", "skewed", "one_expert", "random", "none"]
GRAPH_REPLAYS = 100


def _x(n: int, hidden: int, g: torch.Generator) -> torch.Tensor:
    """Random bf16 rows whose 128-channel blocks span 1e-7..1e3, so the amax floor and large values occur."""
    x = torch.randn(n, hidden, generator=g, device="cuda")
    if hidden % 128 == 0:
        mag = 10.0 ** torch.empty(n, hidden // 128, device="cuda").uniform_(-7, 3, generator=g)
        x = (x.view(n, hidden // 128, 128) * mag.unsqueeze(-1)).view(n, hidden)
    return x.to(torch.bfloat16)


def _check_dispatch(got, want, what: str) -> None:
    """Counts, rows below count (bitwise), scales and source info equal the reference's."""
    assert torch.equal(got.count, want.count), f"{what}: count {got.count.tolist()} != {want.count.tolist()}"
    valid = torch.arange(got.x.shape[1], device="cuda") < want.count.unsqueeze(1)
    assert got.x.dtype == want.x.dtype and got.x.shape == want.x.shape, what
    assert torch.equal(got.x.view(torch.uint8)[valid], want.x.view(torch.uint8)[valid]), f"{what}: rows differ"
    if want.x_scales is None:
        assert got.x_scales is None, what
    else:
        assert torch.equal(got.x_scales.view(torch.int32)[valid], want.x_scales.view(torch.int32)[valid]), \
            f"{what}: scales differ"
    assert torch.equal(got.handle.src_rank[valid], want.handle.src_rank[valid]), f"{what}: src_rank differs"
    assert torch.equal(got.handle.src_index[valid], want.handle.src_index[valid]), f"{what}: src_index differs"


def _poison(res) -> None:
    """Overwrite a native result so anything a later call leaves unwritten cannot pass."""
    res.x.view(torch.uint8).fill_(0xFF)
    if res.x_scales is not None:
        res.x_scales.fill_(float("nan"))
    res.handle.src_rank.fill_(-7)
    res.handle.src_index.fill_(-7)
    res.count.fill_(-7)


def _busy() -> None:
    """Unrelated GPU work between a send half and its hook."""
    a = torch.randn(1024, 1024, device="cuda")
    (a @ a).sum()


def _check_combine(buf, ref, nat_handle, ref_handle, idx, w, y, hook: bool, what: str) -> None:
    got = buf.low_latency_combine(y, idx, w, nat_handle, return_recv_hook=hook)
    if hook:
        assert got.hook is not None
        _busy()
        got.hook()
    want = ref.low_latency_combine(y, idx, w, ref_handle)
    assert torch.equal(got.x.view(torch.int16), want.x.view(torch.int16)), f"{what}: combine differs"


def _check_normal(buf, ref, x, idx, w, what: str) -> None:
    """A normal-mode dispatch + combine on the low-latency Buffer, against the reference."""
    got = buf.dispatch(x, idx, w)
    want = ref.dispatch(x, idx, w)
    assert torch.equal(got.x.view(torch.int16), want.x.view(torch.int16)), f"{what}: normal dispatch differs"
    assert torch.equal(got.src_rank, want.src_rank) and torch.equal(got.src_index, want.src_index), what
    back = buf.combine(got.x, got.handle)
    assert torch.equal(back.view(torch.int16), ref.combine(want.x, want.handle).view(torch.int16)), \
        f"{what}: normal combine differs"


def _eager_cases(buf, ref, shape, rank: int, shared: torch.Generator, local: torch.Generator) -> None:
    """Dispatch i is checked, then combined (and re-checked) after dispatch i + 1: two results held at once."""
    hidden, experts, k, t = shape
    e_l, slots = experts // WORLD, WORLD * t
    modes = [(False, False)] + ([(True, False), (True, True)] if hidden % 128 == 0 else [])
    iters = 8 if hidden >= 4096 else 12
    prev = None
    for it in range(iters + 1):
        if it < iters:
            pick = int(torch.randint(0, 3, (1,), generator=shared))
            n = [t, 0, int(torch.randint(1, t + 1, (1,), generator=local, device="cuda"))][(pick + rank) % 3]
            routing = ROUTINGS[it % len(ROUTINGS)]
            use_fp8, round_scale = modes[it % len(modes)]
            hook = it % 2 == 1
            x, idx = _x(n, hidden, local), random_topk(routing, n, experts, k, local)
            w = torch.rand(n, k, generator=local, device="cuda")
            what = f"shape={shape} it={it} n={n} routing={routing} fp8={use_fp8} round_scale={round_scale} hook={hook}"
            nat = buf.low_latency_dispatch(x, idx, use_fp8=use_fp8, round_scale=round_scale, return_recv_hook=hook)
            if hook:
                assert nat.hook is not None
                if it % 4 == 1:
                    _check_normal(buf, ref, x, idx, w, what)  # normal calls between a send half and its hook
                else:
                    _busy()
                nat.hook()
            else:
                assert nat.hook is None
            want = ref.low_latency_dispatch(x, idx, use_fp8=use_fp8, round_scale=round_scale)
            _check_dispatch(nat, want, what)
        if prev is not None:
            p_nat, p_want, p_idx, p_w, p_what = prev
            y = (torch.randn(e_l, slots, hidden, generator=local, device="cuda") * 3).to(torch.bfloat16)
            _check_combine(buf, ref, p_nat.handle, p_want.handle, p_idx, p_w, y, hook=it % 3 == 0, what=p_what)
            _check_dispatch(p_nat, p_want, p_what + " (after the next dispatch)")
            _poison(p_nat)
        prev = (nat, want, idx, w, what) if it < iters else None


def _hook_order(buf, shape, local: torch.Generator) -> None:
    """A second dispatch before the first one's hook is refused (host-side, no kernel runs)."""
    hidden, experts, k, t = shape
    x, idx = _x(t, hidden, local), random_topk("random", t, experts, k, local)
    first = buf.low_latency_dispatch(x, idx, return_recv_hook=True)
    with pytest.raises(RuntimeError, match="hook"):
        buf.low_latency_dispatch(x, idx)
    first.hook()
    with pytest.raises(RuntimeError, match="already ran"):
        first.hook()


def _off_stream_case(buf, ref, shape, local: torch.Generator) -> None:
    """An eager call's host wait for its stamp exchange does not wait for the caller's work queued before the
    call (the exchange runs on the Buffer's own stream, docs/design.md): with a ~0.7 s kernel queued first, the
    send half returns while that kernel still runs; the results then match the reference."""
    hidden, experts, k, t = shape
    x, idx = _x(t, hidden, local), random_topk("random", t, experts, k, local)
    buf.low_latency_dispatch(x, idx)  # the Buffer's latest call reported its launches
    torch.cuda.synchronize()
    torch.cuda._sleep(int(1.4e9))  # clock cycles
    queued = torch.cuda.Event()
    queued.record()
    nat = buf.low_latency_dispatch(x, idx, return_recv_hook=True)
    assert not queued.query(), "the call waited for the work queued before it"
    nat.hook()
    _check_dispatch(nat, ref.low_latency_dispatch(x, idx), f"shape={shape} off-stream exchange")


def _graph_cases(buf, ref, shape, rank: int, local: torch.Generator) -> None:
    """Both calls captured in one CUDA graph; each replay gets fresh inputs copied into the captured ones."""
    hidden, experts, k, t = shape
    use_fp8 = hidden % 128 == 0
    n = t if rank == 0 else max(t - 3, 1)
    x_s = torch.empty(n, hidden, dtype=torch.bfloat16, device="cuda")
    idx_s = torch.empty(n, k, dtype=torch.int64, device="cuda")
    w_s = torch.empty(n, k, dtype=torch.float32, device="cuda")

    def fill(i: int) -> None:
        x_s.copy_(_x(n, hidden, local))
        idx_s.copy_(random_topk(ROUTINGS[i % len(ROUTINGS)], n, experts, k, local))
        w_s.copy_(torch.rand(n, k, generator=local, device="cuda"))

    fill(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        disp = buf.low_latency_dispatch(x_s, idx_s, use_fp8=use_fp8)
        y = disp.x.to(torch.bfloat16)
        comb = buf.low_latency_combine(y, idx_s, w_s, disp.handle)
    for i in range(GRAPH_REPLAYS):
        fill(i)
        graph.replay()
        what = f"shape={shape} graph replay {i}"
        want = ref.low_latency_dispatch(x_s, idx_s, use_fp8=use_fp8)
        _check_dispatch(disp, want, what)
        want_out = ref.low_latency_combine(want.x.to(torch.bfloat16), idx_s, w_s, want.handle).x
        assert torch.equal(comb.x.view(torch.int16), want_out.view(torch.int16)), f"{what}: combine differs"
        _poison(disp)
    del graph


def _timeout_case(rank: int, local: torch.Generator, ranks_per_node: Optional[int]) -> None:
    """Rank 1 dispatches alone: the call itself raises (its stamp exchange gives up), naming rank, peer and
    phase; so does the next one."""
    hidden, experts, k, t = 256, 8, 2, 8
    with moe_ep.Buffer(dist.group.WORLD, device=device(), hidden=hidden, num_experts=experts, num_topk=k, max_tokens_per_rank=t,
                       backend="nvshmem", low_latency=True, timeout_s=1.0, ranks_per_node=ranks_per_node) as buf:
        if rank == 1:
            x, idx = _x(t, hidden, local), random_topk("random", t, experts, k, local)
            for _ in range(2):
                with pytest.raises(moe_ep.CommTimeoutError, match="call stamp") as info:
                    buf.low_latency_dispatch(x, idx)
                assert (info.value.rank, info.value.peer) == (1, 0), str(info.value)


def _worker(rank: int, world: int, ranks_per_node: Optional[int]) -> None:
    shared = torch.Generator().manual_seed(1234)
    local = torch.Generator(device="cuda").manual_seed(99 + rank)
    for shape in SHAPES:
        hidden, experts, k, t = shape
        kwargs = dict(hidden=hidden, num_experts=experts, num_topk=k, max_tokens_per_rank=t, low_latency=True,
                      ranks_per_node=ranks_per_node)
        with moe_ep.Buffer(dist.group.WORLD, device=device(), backend="nvshmem", **kwargs) as buf, \
                moe_ep.Buffer(dist.group.WORLD, device=device(), backend="reference", **kwargs) as ref:
            assert buf.backend_name == "nvshmem"
            assert buf.ranks_per_node == (ranks_per_node or WORLD), buf.ranks_per_node
            _eager_cases(buf, ref, shape, rank, shared, local)
            _hook_order(buf, shape, local)
            _off_stream_case(buf, ref, shape, local)  # before any capture (which keeps exchanges on the stream)
            if shape in (SHAPES[0], SHAPES[3]):
                _graph_cases(buf, ref, shape, rank, local)
            _eager_cases(buf, ref, shape, rank, shared, local)  # eager again after the graph's replays
            torch.cuda.synchronize()
        if shape == SHAPES[1]:  # the grid knob: 2 SMs (4 blocks for every expert's items) gives the same bits
            with moe_ep.Buffer(dist.group.WORLD, device=device(), backend="nvshmem",
                               config=moe_ep.Config(low_latency_num_sms=2), **kwargs) as narrow, \
                    moe_ep.Buffer(dist.group.WORLD, device=device(), backend="reference", **kwargs) as ref:
                _eager_cases(narrow, ref, shape, rank, shared, local)
                torch.cuda.synchronize()
    _timeout_case(rank, local, ranks_per_node)


@requires_gpus()
@pytest.mark.parametrize("ranks_per_node", [None, 1], ids=["one-node", "ranks_per_node=1"])
def test_low_latency_against_reference(ranks_per_node: Optional[int]) -> None:
    """None: the detected node (both GPUs, NVLink path); 1: two nodes, the network path."""
    run_workers(WORLD, _worker, ranks_per_node, backend="gpu", timeout_s=900)
