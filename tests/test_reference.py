"""The reference backend against brute force over all ranks' inputs (gloo, CPU, R = 1..4)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import moe_ep
from moe_ep.comm import fp8
from tests._dist import run_workers
from tests.oracle import (
    expected_combine,
    expected_combine_weights,
    expected_dispatch,
    expected_layout,
    expected_low_latency_combine,
    expected_low_latency_dispatch,
    local_weights,
    make_inputs,
)

# (seed, tokens per rank (cycled over ranks), hidden, experts, topk, routing, max_tokens_per_rank)
CASES = {
    1: [(1, [37], 64, 8, 1, "random", 40), (2, [50], 256, 16, 8, "random", 64)],
    2: [
        (3, [33, 0], 128, 16, 8, "random", 40),
        (4, [1, 57], 8, 4, 1, "random", 64),
        (5, [40, 40], 256, 256, 8, "random", 48),
        (6, [25, 31], 128, 8, 4, "one_expert", 32),
        (7, [20, 29], 7168, 32, 8, "random", 32),
        (8, [45, 12], 384, 8, 8, "skewed", 48),
    ],
    3: [(9, [20, 0, 31], 128, 12, 4, "random", 32), (10, [15, 22, 9], 256, 12, 8, "skewed", 24)],
    4: [(11, [19, 0, 27, 8], 128, 16, 8, "random", 32), (12, [12, 12, 12, 12], 256, 8, 1, "one_expert", 16)],
}


def _weight_transform(seed: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per receiving rank r: the weights it returns for a row are w * scale[r] + shift[r] in float32;
    random magnitudes and signs, so the order of the float32 sums shows in the bits."""
    g = torch.Generator().manual_seed(seed + 2000)
    sign = torch.where(torch.rand(world, generator=g) < 0.5, -1.0, 1.0)
    return sign * (0.1 + 8 * torch.rand(world, generator=g)), torch.randn(world, generator=g) * 3


def _check_combine_weights(buf: moe_ep.Buffer, inp, got, me: int, world: int, num_experts: int, seed: int) -> None:
    """combine with topk_weights: the rows as without them, and the weights against the two-level oracle
    (the Buffer's ranks_per_node); worst-case padding rows carry NaN weights, which must be ignored."""
    scale, shift = _weight_transform(seed, world)
    valid = (got.src_rank >= 0).unsqueeze(1)
    w_back = torch.where(valid, got.topk_weights * scale[me] + shift[me], float("nan"))
    y = torch.where(valid, got.x, torch.full_like(got.x, float("nan")))
    out, out_w = buf.combine(y, got.handle, topk_weights=w_back)
    assert torch.equal(out.view(torch.int16), buf.combine(y, got.handle).view(torch.int16))  # rows unchanged
    out_async, out_w_async, event = buf.combine(y, got.handle, topk_weights=w_back, async_op=True)
    event.wait()
    assert torch.equal(out_async.view(torch.int16), out.view(torch.int16))

    def weights_of(r: int, s: int, i: int) -> torch.Tensor:
        return local_weights(inp, r, s, i, num_experts, world) * scale[r] + shift[r]

    want = expected_combine_weights(inp, me, world, num_experts, weights_of, ranks_per_node=buf.ranks_per_node)
    assert out_w.dtype == torch.float32 and out_w.shape == want.shape
    assert torch.equal(out_w.view(torch.int32), want.view(torch.int32)), "combined weights"
    assert torch.equal(out_w_async.view(torch.int32), want.view(torch.int32)), "combined weights (async)"


def _check_normal(buf: moe_ep.Buffer, inp, me: int, world: int, num_experts: int, alignment: int, seed: int) -> None:
    x, idx, w = inp.x[me], inp.topk_idx[me], inp.topk_weights[me]
    want_rank, want_expert, want_mask = expected_layout(inp, me, world, num_experts)
    layout = buf.get_dispatch_layout(idx)
    assert torch.equal(layout.num_tokens_per_rank, want_rank)
    assert torch.equal(layout.num_tokens_per_expert, want_expert)
    assert torch.equal(layout.is_token_in_rank, want_mask)

    want = expected_dispatch(inp, me, world, num_experts)
    got = buf.dispatch(x, idx, w, expert_alignment=alignment)
    assert torch.equal(got.x.view(torch.int16), want.x.view(torch.int16))
    assert got.x_scales is None
    assert torch.equal(got.topk_idx, want.topk_idx)
    assert torch.equal(got.topk_weights, want.topk_weights)
    assert got.src_rank.tolist() == want.src_rank and got.src_index.tolist() == want.src_index
    aligned = [-(-c // alignment) * alignment for c in want.tokens_per_expert]
    assert got.tokens_per_expert == aligned
    assert got.tokens_per_expert_tensor.tolist() == aligned
    assert got.handle.recv_counts == [want.src_rank.count(s) for s in range(world)]

    # combine: rank r returns bf16(x * (r + 1) + s) for a row from source s
    y = (got.x.float() * (me + 1) + got.src_rank.unsqueeze(1).float()).to(torch.bfloat16)
    out = buf.combine(y, got.handle)
    ref = expected_combine(inp, me, world, num_experts,
                           lambda r, s, i: (inp.x[s][i].float() * (r + 1) + s).to(torch.bfloat16))
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))

    # combine of dispatch: every token comes back times the number of ranks it visited (exact in float32)
    back, event = buf.combine(got.x, got.handle, async_op=True)
    event.wait()
    visits = want_mask.sum(1, keepdim=True).float()
    want_back = x.float() * visits + 0.0  # + 0.0: a token that went nowhere sums to +0, not -0
    assert torch.equal(back.view(torch.int16), want_back.to(torch.bfloat16).view(torch.int16))
    _check_combine_weights(buf, inp, got, me, world, num_experts, seed)

    # cached dispatch (combine's backward) of another tensor follows the same layout
    grads = [(torch.randn(t.shape, generator=torch.Generator().manual_seed(s)) * 3).to(torch.bfloat16)
             for s, t in enumerate(inp.x)]
    cached = buf.dispatch(grads[me], handle=got.handle)
    assert cached.topk_idx is None and cached.topk_weights is None
    assert torch.equal(cached.src_rank, got.src_rank) and torch.equal(cached.src_index, got.src_index)
    rows = [grads[s][i] for s, i in zip(want.src_rank, want.src_index)]
    want_grad = torch.stack(rows) if rows else torch.empty(0, x.shape[1], dtype=torch.bfloat16)
    assert torch.equal(cached.x.view(torch.int16), want_grad.view(torch.int16))


def _check_worst_case(buf: moe_ep.Buffer, inp, me: int, world: int, num_experts: int, t: int, seed: int) -> None:
    x, idx, w = inp.x[me], inp.topk_idx[me], inp.topk_weights[me]
    want = expected_dispatch(inp, me, world, num_experts)
    got = buf.dispatch(x, idx, w, worst_case=True)
    assert got.x.shape[0] == world * t and got.tokens_per_expert is None
    assert got.tokens_per_expert_tensor.tolist() == want.tokens_per_expert
    pos = [s * t + want.src_rank[:j].count(s) for j, s in enumerate(want.src_rank)]
    valid = torch.zeros(world * t, dtype=torch.bool)
    valid[pos] = True
    assert torch.equal(got.x[pos].view(torch.int16), want.x.view(torch.int16))
    assert torch.equal(got.topk_idx[pos], want.topk_idx)
    assert got.src_rank[pos].tolist() == want.src_rank and got.src_index[pos].tolist() == want.src_index
    assert (got.src_rank[~valid] == -1).all() and (got.src_index[~valid] == -1).all()
    assert (got.topk_idx[~valid] == -1).all() and (got.topk_weights[~valid] == 0).all()
    assert (got.x[~valid].view(torch.int16) == 0).all()  # padding rows are zero
    y = torch.randn(got.x.shape).to(torch.bfloat16)
    y[valid] = got.x[valid]
    back = buf.combine(y, got.handle)
    visits = expected_layout(inp, me, world, num_experts)[2].sum(1, keepdim=True).float()
    assert torch.equal(back.view(torch.int16), (x.float() * visits + 0.0).to(torch.bfloat16).view(torch.int16))
    _check_combine_weights(buf, inp, got, me, world, num_experts, seed)


def _check_fp8(buf: moe_ep.Buffer, inp, me: int, world: int, num_experts: int) -> None:
    quantized = [fp8.quantize(x) if x.shape[0] else (x.to(torch.float8_e4m3fn), torch.empty(0, x.shape[1] // 128))
                 for x in inp.x]
    q, s = quantized[me]
    got = buf.dispatch(q, inp.topk_idx[me], inp.topk_weights[me], x_scales=s)
    want = expected_dispatch(
        type(inp)([t[0] for t in quantized], inp.topk_idx, inp.topk_weights), me, world, num_experts,
        scales=[t[1] for t in quantized],
    )
    assert got.x.dtype == torch.float8_e4m3fn
    assert torch.equal(got.x.view(torch.uint8), want.x.view(torch.uint8))
    assert torch.equal(got.x_scales, want.scales)


def _check_low_latency(buf: moe_ep.Buffer, inp, me: int, world: int, num_experts: int, t: int) -> None:
    num_local = num_experts // world
    x, idx, w = inp.x[me], inp.topk_idx[me], inp.topk_weights[me]
    fp8_ok = x.shape[1] % 128 == 0
    for use_fp8, round_scale, hook in ((False, False, False), (True, False, False), (True, True, True)):
        if use_fp8 and not fp8_ok:
            continue
        want = expected_low_latency_dispatch(inp, me, world, num_experts, use_fp8, round_scale)
        got = buf.low_latency_dispatch(x, idx, use_fp8=use_fp8, round_scale=round_scale, return_recv_hook=hook)
        if hook:
            got.hook()
        assert got.x.shape == (num_local, world * t, x.shape[1])
        for e in range(num_local):
            c = int(got.count[e])
            assert c == len(want.rows[e])
            if c:
                assert torch.equal(got.x[e, :c].view(torch.uint8), torch.stack(want.rows[e]).view(torch.uint8))
                if use_fp8:
                    assert torch.equal(got.x_scales[e, :c], torch.stack(want.scales[e]))
            assert list(zip(got.handle.src_rank[e, :c].tolist(), got.handle.src_index[e, :c].tolist())) == want.src[e]

    disp = buf.low_latency_dispatch(x, idx)
    scale = (torch.arange(num_local) + me * num_local) % 7 + 1
    y = (disp.x.float() * scale.view(-1, 1, 1).float() + 0.25).to(torch.bfloat16)
    ref = expected_low_latency_combine(
        inp, me, world, num_experts, lambda e, s, n, k: (inp.x[s][n].float() * (e % 7 + 1) + 0.25).to(torch.bfloat16)
    )
    first = buf.low_latency_combine(y, idx, w, disp.handle).x
    assert torch.equal(first.view(torch.int16), ref.view(torch.int16))
    again = buf.low_latency_combine(y, idx, w, disp.handle, return_recv_hook=True)
    again.hook()
    assert torch.equal(again.x.view(torch.int16), first.view(torch.int16))


def _semantics_worker(rank: int, world: int) -> None:
    for seed, tokens, hidden, experts, topk, routing, t in CASES[world]:
        inp = make_inputs(seed, [tokens[r % len(tokens)] for r in range(world)], hidden, experts, topk, routing)
        with moe_ep.Buffer(dist.group.WORLD, hidden=hidden, num_experts=experts, num_topk=topk,
                           max_tokens_per_rank=t, backend="reference", low_latency=True) as buf:
            assert buf.backend_name == "reference"
            try:
                for alignment in (1, 4):
                    _check_normal(buf, inp, rank, world, experts, alignment, seed)
                _check_worst_case(buf, inp, rank, world, experts, t, seed)
                if hidden % 128 == 0:
                    _check_fp8(buf, inp, rank, world, experts)
                _check_low_latency(buf, inp, rank, world, experts, t)
            except AssertionError as e:
                raise AssertionError(f"case seed={seed} rank={rank}: {e}") from e


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_reference_semantics(world: int) -> None:
    run_workers(world, _semantics_worker)
