"""Native normal-mode dispatch/combine against the reference backend on the same inputs (2 GPUs, NCCL).

One spawn runs every case: per Buffer shape, a native Buffer (backend="nvshmem") and a reference
Buffer see identical inputs; layouts, dispatch outputs (rows via integer views, scales, local expert
ids, weights, source info, per-expert counts) and combine outputs must be bitwise equal, and so must
cached dispatches (combine's backward). Token counts differ per rank (0, 1, 77, 4096), hidden sizes
include 2880 (not a multiple of 128), K runs 1 / 8 / 16, routings include -1 entries, duplicates
and every token on one expert; FP8 dispatch, expert_alignment, worst-case mode and several SM
budgets are covered. Before each native call the caching allocator's free blocks and the native
Buffer's symmetric workspace are poisoned, so rows or metadata a call fails to write cannot pass.
Combines also run with topk_weights (random magnitudes and signs, some -0.0): rows and combined
weights bitwise equal. Then STRESS_CALLS calls with changing inputs compared by hashes, a CUDA graph of a
worst-case dispatch + combine (with and without weights) replayed 20 times with fresh inputs, a
dispatch timeout that names its phase, a combine timeout that leaves NaN rows and weights, and
dispatch timeouts (at the stamp exchange, waiting for rows, at a cached dispatch's start) that leave
only poisoned or correct rows.

Everything runs three times: with the two GPUs as one node (the NVLink kernels); with
ranks_per_node=1, where the two GPUs are two "nodes" and every byte between them goes through the
cross-node kernels' network leg (NVSHMEM puts and signals, carried by NVSHMEM's P2P transport here);
and with hierarchical=True on one node of two, where the cross-node kernels' network leg only
reaches the rank itself and every byte between the GPUs takes their NVLink forwarding leg. The
reference Buffer gets the same topology, so its combine follows the same two-level order.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
import torch.distributed as dist

import moe_ep
from moe_ep.comm import fp8
from moe_ep.comm.backends import internode, intranode
from tests._dist import device, requires_gpus, run_workers
from tests.oracle import random_topk

pytestmark = requires_gpus()

WORLD = 2
POISON = 0x7F
STRESS_CALLS = 300  # per topology; 1000 made the suite overrun its device call (tests/README.md)
GRAPH_REPLAYS = 20
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Case:
    seed: int
    tokens: tuple[int, int]  # tokens on rank 0, rank 1
    routing: str  # random | skewed | one_expert | none
    fp8: bool = False
    alignment: int = 1
    worst_case: bool = False
    num_sms: Optional[int] = None


# (hidden, experts, topk, max_tokens_per_rank) -> cases run on one pair of Buffers
SHAPES: dict[tuple[int, int, int, int], list[Case]] = {
    (7168, 256, 8, 4096): [
        Case(1, (4096, 4096), "random"),
        Case(2, (4096, 77), "random", fp8=True, alignment=128),
        Case(3, (0, 1), "random", num_sms=8),
        Case(4, (77, 0), "one_expert", worst_case=True),
        Case(5, (4096, 4096), "random", fp8=True, worst_case=True, num_sms=32),
        Case(6, (1, 4096), "skewed", alignment=7, num_sms=1),
    ],
    (2880, 16, 16, 128): [
        Case(7, (77, 1), "random"),
        Case(8, (0, 0), "random"),
        Case(9, (1, 77), "skewed", alignment=4, worst_case=True),
        Case(10, (77, 77), "one_expert", num_sms=3),
        Case(11, (128, 0), "none"),
    ],
    (2048, 16, 1, 4096): [
        Case(12, (4096, 0), "random"),
        Case(13, (1, 4096), "random", fp8=True, worst_case=True, num_sms=16),
        Case(14, (77, 4096), "skewed", alignment=64),
        Case(15, (4096, 77), "one_expert", fp8=True),
    ],
    (2048, 256, 16, 77): [
        Case(16, (77, 77), "skewed", fp8=True, alignment=3),
        Case(17, (0, 77), "random", worst_case=True, num_sms=2),
    ],
    (8192, 2048, 8, 256): [  # 1024 local experts per rank
        Case(18, (256, 200), "random", fp8=True),
        Case(19, (31, 256), "skewed", worst_case=True, alignment=16),
    ],
    (4096, 64, 4, 512): [
        Case(20, (512, 333), "random", num_sms=5),
    ],
}
STRESS_SHAPE = (2048, 256, 8, 256)
GRAPH_SHAPE = (2048, 16, 8, 128)


# ---- inputs -----------------------------------------------------------------------------------
def _x(n: int, hidden: int, g: torch.Generator) -> torch.Tensor:
    return (torch.randn(n, hidden, generator=g, device="cuda") * 2).to(torch.bfloat16)


def _w(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Weights a combine returns with its rows: float32 of random signs and magnitudes (2^-12..2^12),
    every 7th -0.0 (a sum that starts from +0.0 turns it into +0.0)."""
    w = torch.randn(m, k, generator=g, device="cuda") * torch.exp2(torch.randint(-12, 13, (m, k), generator=g,
                                                                                device="cuda").float())
    w.view(-1)[::7] = -0.0
    return w


def _payload(x: torch.Tensor, use_fp8: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    if not use_fp8:
        return x, None
    if x.shape[0] == 0:
        return x.to(torch.float8_e4m3fn), torch.empty(0, x.shape[1] // 128, device="cuda")
    return fp8.quantize(x)


# ---- poisoning --------------------------------------------------------------------------------
def _poison_allocator() -> None:
    """Fill free blocks of the caching allocator, which fresh outputs are carved from, with POISON."""
    blocks = [torch.empty(size, dtype=torch.uint8, device="cuda").fill_(POISON)
              for size in (320 << 20, 96 << 20, 24 << 20, 3 << 20, 1 << 20, 256 << 10, 32 << 10, 2 << 10, 512)]
    del blocks


def _poison_workspace(buf: moe_ep.Buffer) -> None:
    """Poison the native Buffer's symmetric workspace (the cross-node one without its signal words)
    while no rank is inside a call."""
    torch.cuda.synchronize()
    dist.barrier()
    buf.fill_workspace(POISON)
    torch.cuda.synchronize()
    dist.barrier()


# ---- comparisons ------------------------------------------------------------------------------
def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_OF_SIZE[t.element_size()])


def _same(got: Optional[torch.Tensor], want: Optional[torch.Tensor], what: str,
          rows: Optional[torch.Tensor] = None) -> None:
    """Bitwise equality (optionally only on the rows where `rows` is True)."""
    if want is None:
        assert got is None, f"{what}: expected None"
        return
    assert got is not None and got.dtype == want.dtype and got.shape == want.shape, \
        f"{what}: {None if got is None else (got.dtype, tuple(got.shape))} != {(want.dtype, tuple(want.shape))}"
    a, b = _bits(got), _bits(want)
    if rows is not None:
        a, b = a[rows], b[rows]
    if not torch.equal(a, b):
        bad = (a != b).reshape(a.shape[0], -1).any(1).nonzero().flatten()[:8].tolist() if a.dim() else []
        raise AssertionError(f"{what}: differs (first rows {bad})")


def _same_dispatch(got, want, what: str) -> None:
    _same(got.src_rank, want.src_rank, f"{what}: src_rank")
    _same(got.src_index, want.src_index, f"{what}: src_index")
    _same(got.x, want.x, f"{what}: x")  # worst-case padding rows included: zero on every backend
    _same(got.x_scales, want.x_scales, f"{what}: x_scales")
    _same(got.topk_idx, want.topk_idx, f"{what}: topk_idx")
    _same(got.topk_weights, want.topk_weights, f"{what}: topk_weights")
    assert got.tokens_per_expert == want.tokens_per_expert, \
        f"{what}: tokens_per_expert {got.tokens_per_expert} != {want.tokens_per_expert}"
    _same(got.tokens_per_expert_tensor, want.tokens_per_expert_tensor, f"{what}: tokens_per_expert_tensor")
    gh, wh = got.handle, want.handle
    assert (gh.num_tokens, gh.num_recv_rows, gh.recv_counts, gh.worst_case) == \
        (wh.num_tokens, wh.num_recv_rows, wh.recv_counts, wh.worst_case), f"{what}: handle fields"
    _same(gh.is_token_in_rank, wh.is_token_in_rank, f"{what}: handle.is_token_in_rank")


# ---- eager cases ------------------------------------------------------------------------------
def _run_case(nat: moe_ep.Buffer, ref: moe_ep.Buffer, shape, case: Case, rank: int) -> None:
    hidden, experts, k, _ = shape
    what = f"shape={shape} case={case}"
    g = torch.Generator(device="cuda").manual_seed(case.seed * 1009 + rank)
    n = case.tokens[rank]
    x, idx = _x(n, hidden, g), random_topk(case.routing, n, experts, k, g)
    w = torch.rand(n, k, generator=g, device="cuda")
    xin, scales = _payload(x, case.fp8)
    kw = dict(x_scales=scales, expert_alignment=case.alignment, worst_case=case.worst_case)

    _poison_allocator()
    got_layout, want_layout = nat.get_dispatch_layout(idx), ref.get_dispatch_layout(idx)
    for field in ("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank"):
        _same(getattr(got_layout, field), getattr(want_layout, field), f"{what}: layout.{field}")

    _poison_workspace(nat)
    _poison_allocator()
    got = nat.dispatch(xin, idx, w, num_sms=case.num_sms, **kw)
    want = ref.dispatch(xin, idx, w, **kw)
    _same_dispatch(got, want, f"{what}: dispatch")

    m = want.x.shape[0]
    y, wy = _x(m, hidden, g), _w(m, k, g)  # padding rows' weights (worst case) must be ignored
    _poison_workspace(nat)
    _poison_allocator()
    _same(nat.combine(y, got.handle, num_sms=case.num_sms), ref.combine(y, want.handle), f"{what}: combine")
    _poison_workspace(nat)
    _poison_allocator()
    got_y, got_w = nat.combine(y, got.handle, topk_weights=wy, num_sms=case.num_sms)
    want_y, want_w = ref.combine(y, want.handle, topk_weights=wy)
    _same(got_y, want_y, f"{what}: combine with weights: rows")
    _same(got_w, want_w, f"{what}: combine with weights: weights")

    # combine's backward: a cached dispatch of another tensor, bf16 or FP8 like the original
    grad, grad_scales = _payload(_x(n, hidden, g), case.fp8)
    _poison_workspace(nat)
    _poison_allocator()
    got_c = nat.dispatch(grad, x_scales=grad_scales, handle=got.handle, expert_alignment=case.alignment + 1,
                         num_sms=case.num_sms)
    want_c = ref.dispatch(grad, x_scales=grad_scales, handle=want.handle, expert_alignment=case.alignment + 1)
    _same_dispatch(got_c, want_c, f"{what}: cached dispatch")

    # the same calls ordered by events: previous_event in, async_op out
    before = torch.cuda.Event()
    before.record()
    got_a = nat.dispatch(xin, idx, w, num_sms=case.num_sms, previous_event=moe_ep.EventHandle(before),
                         async_op=True, **kw)
    got_a.event.wait()
    _same_dispatch(got_a, want, f"{what}: async dispatch")
    out_a, w_a, event = nat.combine(y, got_a.handle, topk_weights=wy, async_op=True, previous_event=got_a.event)
    event.wait()
    _same(out_a, want_y, f"{what}: async combine: rows")
    _same(w_a, want_w, f"{what}: async combine: weights")


# ---- stress: many calls, changing inputs, hashes ------------------------------------------------
def _hash(t: Optional[torch.Tensor], rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Position-weighted int64 sum of the tensor's bits (rows where `rows` is False count as 0)."""
    if t is None:
        return torch.zeros((), dtype=torch.int64, device="cuda")
    v = _bits(t).to(torch.int64)
    if rows is not None:
        v = torch.where(rows.view(-1, *([1] * (v.dim() - 1))), v, 0)
    v = v.reshape(-1)
    return (v * torch.arange(1, v.numel() + 1, device="cuda")).sum()


def _dispatch_hash(res) -> torch.Tensor:
    valid = res.src_rank >= 0
    parts = [_hash(res.x, valid), _hash(res.x_scales, valid), _hash(res.topk_idx), _hash(res.topk_weights),
             _hash(res.src_rank), _hash(res.src_index), _hash(res.tokens_per_expert_tensor)]
    return torch.stack(parts)


def _stress(rank: int, topo: dict) -> None:
    hidden, experts, k, t = STRESS_SHAPE
    common = dict(hidden=hidden, num_experts=experts, num_topk=k, max_tokens_per_rank=t, **topo)
    g = torch.Generator(device="cuda").manual_seed(777 + rank)
    shared = torch.Generator().manual_seed(4242)  # the same call sequence on both ranks
    routings = ["random", "skewed", "random", "one_expert", "none"]
    with moe_ep.Buffer(dist.group.WORLD, device=device(), backend="nvshmem", **common) as nat, \
            moe_ep.Buffer(dist.group.WORLD, device=device(), backend="reference", **common) as ref:
        diffs = torch.zeros(STRESS_CALLS, 4, dtype=torch.int64, device="cuda")
        for it in range(STRESS_CALLS):
            use_fp8, worst = it % 3 == 1, it % 4 == 3
            sms = int(torch.randint(1, 33, (1,), generator=shared))
            n = int(torch.randint(0, t + 1, (1,), generator=g, device="cuda"))
            x = _x(n, hidden, g)
            idx = random_topk(routings[it % len(routings)], n, experts, k, g)
            w = torch.rand(n, k, generator=g, device="cuda")
            xin, scales = _payload(x, use_fp8)
            got = nat.dispatch(xin, idx, w, x_scales=scales, worst_case=worst, num_sms=sms)
            want = ref.dispatch(xin, idx, w, x_scales=scales, worst_case=worst)
            diffs[it, 0] = (_dispatch_hash(got) != _dispatch_hash(want)).sum()
            y = _x(want.x.shape[0], hidden, g)
            if it % 2:  # with weights
                wy = _w(want.x.shape[0], k, g)
                (got_y, got_w), (want_y, want_w) = (nat.combine(y, got.handle, topk_weights=wy, num_sms=sms),
                                                    ref.combine(y, want.handle, topk_weights=wy))
                diffs[it, 3] = _hash(got_w) != _hash(want_w)
            else:
                got_y, want_y = nat.combine(y, got.handle, num_sms=sms), ref.combine(y, want.handle)
            diffs[it, 1] = _hash(got_y) - _hash(want_y)
            if it % 5 == 0:
                grad = _x(n, hidden, g)
                diffs[it, 2] = (_dispatch_hash(nat.dispatch(grad, handle=got.handle, num_sms=sms))
                                != _dispatch_hash(ref.dispatch(grad, handle=want.handle))).sum()
        bad = diffs.any(1).nonzero().flatten().tolist()
        assert not bad, f"stress: calls {bad[:10]} differ from the reference (dispatch, combine, cached, weights): " \
                        f"{diffs[bad[:10]].tolist()}"


# ---- CUDA graph of worst-case dispatch + combine ------------------------------------------------
def _graph(rank: int, topo: dict) -> None:
    hidden, experts, k, t = GRAPH_SHAPE
    common = dict(hidden=hidden, num_experts=experts, num_topk=k, max_tokens_per_rank=t, **topo)
    n = (t, 77)[rank]
    g = torch.Generator(device="cuda").manual_seed(99 + rank)
    x = torch.empty(n, hidden, dtype=torch.bfloat16, device="cuda")
    idx = torch.empty(n, k, dtype=torch.int64, device="cuda")
    w = torch.empty(n, k, dtype=torch.float32, device="cuda")

    def refill(routing: str) -> None:
        x.copy_(_x(n, hidden, g))
        idx.copy_(random_topk(routing, n, experts, k, g))
        w.copy_(torch.rand(n, k, generator=g, device="cuda"))

    def step(buf: moe_ep.Buffer):
        res = buf.dispatch(x, idx, w, worst_case=True, expert_alignment=4)
        y = (res.x.float() * 1.5 - 0.25).to(torch.bfloat16)
        return res, buf.combine(y, res.handle), buf.combine(y, res.handle, topk_weights=res.topk_weights * 3 - 1)

    with moe_ep.Buffer(dist.group.WORLD, device=device(), backend="nvshmem", **common) as nat, \
            moe_ep.Buffer(dist.group.WORLD, device=device(), backend="reference", **common) as ref:
        refill("random")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(nat)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        dist.barrier()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got, out, (out_y, out_w) = step(nat)
        for replay in range(GRAPH_REPLAYS):
            refill(["random", "skewed", "one_expert", "none"][replay % 4])
            graph.replay()
            want, want_out, (want_y, want_w) = step(ref)
            what = f"graph replay {replay}"
            _same_dispatch(got, want, what)
            _same(out, want_out, f"{what}: combine")
            _same(out_y, want_y, f"{what}: combine with weights: rows")
            _same(out_w, want_w, f"{what}: combine with weights: weights")


# ---- the stamp exchange off the caller's stream ------------------------------------------------
def _off_stream(rank: int, topo: dict) -> None:
    """A combine and a cached dispatch made behind a ~0.7 s kernel on the caller's stream return while it still
    runs (their stamp exchanges run on the Buffer's own stream after its earlier kernels only, docs/design.md);
    their results equal the reference's."""
    hidden, experts, k, t = next(iter(SHAPES))
    common = dict(hidden=hidden, num_experts=experts, num_topk=k, max_tokens_per_rank=t, **topo)
    g = torch.Generator(device="cuda").manual_seed(7 + rank)
    n = (t, t // 2)[rank]
    x, idx, w = _x(n, hidden, g), random_topk("random", n, experts, k, g), torch.rand(n, k, generator=g, device="cuda")
    with moe_ep.Buffer(dist.group.WORLD, device=device(), backend="nvshmem", **common) as nat, \
            moe_ep.Buffer(dist.group.WORLD, device=device(), backend="reference", **common) as ref:
        got, want = nat.dispatch(x, idx, w), ref.dispatch(x, idx, w)
        y, grad = _x(want.x.shape[0], hidden, g), _x(n, hidden, g)
        _poison_workspace(nat)
        torch.cuda.synchronize()
        torch.cuda._sleep(int(1.4e9))  # clock cycles
        queued = torch.cuda.Event()
        queued.record()
        out = nat.combine(y, got.handle)
        assert not queued.query(), "the combine waited for the work queued before it"
        cached = nat.dispatch(grad, handle=got.handle)
        assert not queued.query(), "the cached dispatch waited for the work queued before it"
        _same(out, ref.combine(y, want.handle), "off-stream exchange: combine")
        _same_dispatch(cached, ref.dispatch(grad, handle=want.handle), "off-stream exchange: cached dispatch")


# ---- timeout ----------------------------------------------------------------------------------
def _timeout(rank: int, topo: dict) -> None:
    """Rank 0 dispatches alone: its stamp exchange (every call's first kernel) gives up, and the call
    raises naming the phase and the silent peer."""
    with moe_ep.Buffer(dist.group.WORLD, device=device(), hidden=256, num_experts=8, num_topk=2, max_tokens_per_rank=16,
                       backend="nvshmem", timeout_s=1.0, **topo) as buf:
        if rank == 0:
            idx = torch.tensor([[0, 5]] * 4, device="cuda")
            with pytest.raises(moe_ep.CommTimeoutError, match="call stamp") as err:
                buf.dispatch(torch.ones(4, 256, dtype=torch.bfloat16, device="cuda"), idx,
                             torch.ones(4, 2, device="cuda"))
            assert (err.value.rank, err.value.peer) == (0, 1)
        torch.cuda.synchronize()
        dist.barrier()


def _combine_timeout(rank: int, topo: dict) -> None:
    """Rank 0 combines alone (with weights): its stamp exchange gives up, names the silent peer, and
    every output row and combined weight is NaN, so nothing downstream takes them for results."""
    with moe_ep.Buffer(dist.group.WORLD, device=device(), hidden=256, num_experts=8, num_topk=2, max_tokens_per_rank=16,
                       backend="nvshmem", timeout_s=1.0, **topo) as buf:
        idx = torch.tensor([[0, 5]] * 4, device="cuda")
        res = buf.dispatch(torch.ones(4, 256, dtype=torch.bfloat16, device="cuda"), idx,
                           torch.ones(4, 2, device="cuda"))
        torch.cuda.synchronize()
        dist.barrier()
        if rank == 0:
            out, out_w, event = buf.combine(res.x, res.handle, topk_weights=res.topk_weights, async_op=True)
            with pytest.raises(moe_ep.CommTimeoutError) as err:
                event.synchronize()
            assert (err.value.rank, err.value.peer) == (0, 1)
            assert torch.isnan(out.float()).all() and torch.isnan(out_w).all(), "a failed combine left values"
        torch.cuda.synchronize()
        dist.barrier()


def _poisoned(res) -> torch.Tensor:
    """Per output row of a dispatch: whether it holds the poison of a failed call (NaN x, FP8 0x7f bytes;
    NaN scales; topk_idx -1 and NaN weights, src_rank and src_index -1, except on a cached dispatch,
    which writes none of these)."""
    if res.x.dtype == torch.float8_e4m3fn:
        bad = (res.x.view(torch.uint8) == 0x7F).all(1)
    else:
        bad = torch.isnan(res.x.float()).all(1)
    if res.x_scales is not None:
        bad &= torch.isnan(res.x_scales).all(1)
    if res.topk_idx is not None:
        bad &= (res.topk_idx == -1).all(1) & torch.isnan(res.topk_weights).all(1)
        bad &= (res.src_rank == -1) & (res.src_index == -1)
    return bad


@contextmanager
def _no_dispatch_kernel(buf: moe_ep.Buffer):
    """This rank's dispatches inside run their count exchange but launch no dispatch kernel, so a peer's
    dispatch kernel waits for rows that never come (fault injection: the engine class of buf's path
    loses its launch, in this process only)."""
    engine = {"nvlink": intranode.IntranodeEngine, "cross-node": internode.InternodeEngine}[buf.normal_path]
    launch = engine.launch_dispatch
    engine.launch_dispatch = lambda *args, **kwargs: None
    try:
        yield
    finally:
        engine.launch_dispatch = launch


def _dispatch_timeout(rank: int, topo: dict) -> None:
    """Dispatches that give up: afterwards (the CommTimeoutError, naming the silent peer, comes from the
    call's event) no output row looks valid, every one holds poison or what a successful call writes.
      - worst case, rank 0 alone: its stamp exchange gives up, so no row was received: all R * T rows
        are poison;
      - FP8, rank 1 runs the count exchange but no dispatch kernel: rank 0's wait for rank 1's rows
        gives up; rank 1's rows are poison, rank 0's own rows are poison or exactly its tokens;
      - cached, rank 0 alone: its stamp exchange gives up, then the dispatch kernel's start barrier:
        every row is NaN."""
    def new_buffer() -> moe_ep.Buffer:
        return moe_ep.Buffer(dist.group.WORLD, device=device(), hidden=256, num_experts=8, num_topk=2,
                             max_tokens_per_rank=16, backend="nvshmem", timeout_s=1.0, **topo)

    g = torch.Generator(device="cuda").manual_seed(31 + rank)
    idx = torch.tensor([[0, 5]] * 4, device="cuda")  # every token to both ranks
    w = torch.rand(4, 2, generator=g, device="cuda")

    with new_buffer() as buf:
        if rank == 0:
            res = buf.dispatch(_x(4, 256, g), idx, w, worst_case=True, async_op=True)
            with pytest.raises(moe_ep.CommTimeoutError, match="call stamp") as err:
                res.event.synchronize()
            assert (err.value.rank, err.value.peer) == (0, 1)
            assert res.x.shape[0] == WORLD * 16 and _poisoned(res).all(), "a failed worst-case dispatch left rows"
        torch.cuda.synchronize()
        dist.barrier()

    xin, scales = _payload(_x(4, 256, g), True)
    with new_buffer() as buf:
        if rank == 1:
            with _no_dispatch_kernel(buf):
                buf.dispatch(xin, idx, w, x_scales=scales)
        else:
            res = buf.dispatch(xin, idx, w, x_scales=scales, async_op=True)
            with pytest.raises(moe_ep.CommTimeoutError) as err:
                res.event.synchronize()
            assert (err.value.rank, err.value.peer) == (0, 1)
            assert "rows" in err.value.phase and "token counts" not in err.value.phase, err.value.phase
            assert res.handle.recv_counts == [4, 4]
            bad = _poisoned(res)
            assert bad[4:].all(), "rows from the silent peer are not poison"
            kept = (~bad[:4]).nonzero().flatten()  # own rows a sender wrote: exactly the tokens
            assert (res.src_rank[kept] == 0).all() and torch.equal(res.src_index[kept].long(), kept)
            assert torch.equal(_bits(res.x[kept]), _bits(xin[kept])) and torch.equal(res.x_scales[kept], scales[kept])
        torch.cuda.synchronize()
        dist.barrier()

    with new_buffer() as buf:
        x = _x(4, 256, g)
        res = buf.dispatch(x, idx, w)
        torch.cuda.synchronize()
        dist.barrier()
        if rank == 0:
            cached = buf.dispatch(x, handle=res.handle, async_op=True)
            with pytest.raises(moe_ep.CommTimeoutError) as err:
                cached.event.synchronize()
            assert (err.value.rank, err.value.peer) == (0, 1)
            assert cached.x.shape[0] == 8 and _poisoned(cached).all(), "a failed cached dispatch left rows"
        torch.cuda.synchronize()
        dist.barrier()


def _worker(rank: int, world: int, topo: dict) -> None:
    """Every case, stress, graph and timeout on Buffers with the topology arguments `topo`."""
    assert world == WORLD
    label = " ".join(f"{k}={v}" for k, v in topo.items()) or "intranode"
    for shape, cases in SHAPES.items():
        hidden, experts, k, t = shape
        common = dict(hidden=hidden, num_experts=experts, num_topk=k, max_tokens_per_rank=t, **topo)
        with moe_ep.Buffer(dist.group.WORLD, device=device(), backend="nvshmem", **common) as nat, \
                moe_ep.Buffer(dist.group.WORLD, device=device(), backend="reference", **common) as ref:
            assert nat.backend_name == "nvshmem"
            assert nat.normal_path == ("cross-node" if topo else "nvlink")
            for case in cases:
                if rank == 0:
                    print(f"{label} case {case.seed} shape {shape}", flush=True)
                _run_case(nat, ref, shape, case, rank)
    # once more with exact-size outputs, allocated after the count wait
    shape = next(iter(SHAPES))
    hidden, experts, k, t = shape
    common = dict(hidden=hidden, num_experts=experts, num_topk=k, max_tokens_per_rank=t, **topo)
    with moe_ep.Buffer(dist.group.WORLD, device=device(), backend="nvshmem", config=moe_ep.Config(eager_output_bytes=0),
                       **common) as nat, \
            moe_ep.Buffer(dist.group.WORLD, device=device(), backend="reference", **common) as ref:
        for case in SHAPES[shape]:
            _run_case(nat, ref, shape, case, rank)
    for part in (_off_stream, _stress, _graph, _timeout, _combine_timeout, _dispatch_timeout):
        if rank == 0:
            print(f"{label} {part.__name__.strip('_')}", flush=True)
        part(rank, topo)


def test_intranode_matches_reference() -> None:
    run_workers(WORLD, _worker, {}, backend="gpu", timeout_s=1800)


def test_cross_node_matches_reference() -> None:
    """ranks_per_node=1: the two GPUs are two nodes; every byte between them takes the network leg."""
    run_workers(WORLD, _worker, {"ranks_per_node": 1}, backend="gpu", timeout_s=1800)


def test_forwarding_leg_matches_reference() -> None:
    """hierarchical=True on one node of two: every byte between the GPUs takes the NVLink forwarding leg."""
    run_workers(WORLD, _worker, {"hierarchical": True}, backend="gpu", timeout_s=1800)
