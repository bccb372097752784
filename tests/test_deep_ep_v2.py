"""moe_ep.deep_ep.ElasticBuffer (DeepEP V2's API) against brute force over all ranks' inputs: the four
layouts (compact / expanded, with / without CPU sync), FP8, alignment, a dispatch through the
handle, combine with topk_weights and bias, and the arguments it refuses. 2 ranks on CPU (gloo,
reference backend) and, marked gpu, 2 ranks sharing one GPU (native kernels)."""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist

import moe_ep.deep_ep as deep_ep
from moe_ep.comm import fp8
from tests._dist import device, requires_gpus, run_workers
from tests.oracle import Inputs, assert_same_bits, expected_combine, expected_dispatch, make_inputs

WORLD, HIDDEN, EXPERTS, TOPK, T = 2, 256, 8, 3, 24
NUM_LOCAL = EXPERTS // WORLD


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def _on(t: torch.Tensor) -> torch.Tensor:
    return t.to(device())


def _expanded(inp: Inputs, me: int, alignment: int) -> tuple[list[list[tuple[int, int, int]]], list[int]]:
    """Per local expert, its (source rank, token, top-k slot) pairs in source order; raw counts."""
    blocks: list[list[tuple[int, int, int]]] = [[] for _ in range(NUM_LOCAL)]
    for s in range(WORLD):
        for n, row in enumerate(inp.topk_idx[s].tolist()):
            for k, e in enumerate(row):
                if e >= 0 and e // NUM_LOCAL == me:
                    blocks[e - me * NUM_LOCAL].append((s, n, k))
    return blocks, [len(b) for b in blocks]


def _check_handle(handle: deep_ep.EPHandle, inp: Inputs, me: int, alignment: int, sync: bool, expand: bool) -> None:
    want = expected_dispatch(inp, me, WORLD, EXPERTS)
    raw = want.tokens_per_expert
    aligned = [_align(c, alignment) for c in raw]
    assert handle.num_recv_tokens_per_expert_list == (aligned if sync else [])
    per_source = [want.src_rank.count(s) for s in range(WORLD)]
    assert handle.psum_num_recv_tokens_per_scaleup_rank.tolist() == torch.tensor(per_source).cumsum(0).tolist()
    psum = torch.tensor(aligned).cumsum(0)
    if expand:
        psum = psum - torch.tensor(aligned) + torch.tensor(raw)
    assert handle.psum_num_recv_tokens_per_expert.dtype == torch.int32
    assert handle.psum_num_recv_tokens_per_expert.tolist() == psum.tolist()
    assert handle.num_unaligned_recv_tokens_per_expert.tolist() == raw


def _scale_of(r: int, e_local: int) -> float:
    """What the test's expert (local id e_local on rank r) multiplies its rows by."""
    return float(r * NUM_LOCAL + e_local + 1)


def _compact_case(buf: deep_ep.ElasticBuffer, inp: Inputs, me: int, sync: bool, use_fp8: bool) -> None:
    x, idx, w = _on(inp.x[me]), _on(inp.topk_idx[me]), _on(inp.topk_weights[me])
    scales = None
    if use_fp8:
        qs = [fp8.quantize(inp.x[s]) for s in range(WORLD)]
        x = (_on(qs[me][0]), _on(qs[me][1]))
        scales = [q[1] for q in qs]
    recv, recv_idx, recv_w, handle, event = buf.dispatch(
        x, topk_idx=idx, topk_weights=w, num_experts=EXPERTS, num_max_tokens_per_rank=T, do_cpu_sync=sync,
        use_tma_aligned_col_major_sf=use_fp8 and sync)
    assert event.event is None
    want = expected_dispatch(Inputs([q[0] for q in qs] if use_fp8 else inp.x, inp.topk_idx, inp.topk_weights),
                             me, WORLD, EXPERTS, scales)
    m = len(want.src_rank)
    rows_out = recv[0] if use_fp8 else recv
    assert rows_out.shape[0] == (m if sync else WORLD * T) == handle.num_recv_tokens
    assert handle.psum_num_recv_tokens_per_scaleup_rank[-1].item() == m
    assert_same_bits(rows_out[:m].cpu(), want.x, "recv_x")
    if use_fp8:
        assert_same_bits(recv[1][:m].contiguous().cpu(), want.scales, "recv scales")
        if sync:  # DeepEP's TMA-aligned column-major scales: column stride align(rows, 4)
            assert recv[1].stride() == (1, _align(max(m, 1), 4))
    assert torch.equal(recv_idx[:m].cpu(), want.topk_idx)
    local = want.topk_idx >= 0
    assert torch.equal(recv_w[:m].cpu()[local], want.topk_weights[local])
    if not sync:
        assert (rows_out[m:].view(torch.uint8) == 0).all() and (recv_idx[m:] == -1).all()
    _check_handle(handle, inp, me, 1, sync, False)
    # the backward of combine: a dispatch through the handle moves other rows the same way
    g = [(torch.randn(inp.x[s].shape, generator=torch.Generator().manual_seed(50 + s))).to(torch.bfloat16)
         for s in range(WORLD)]
    again, _, _, same, _ = buf.dispatch(_on(g[me]), handle=handle, num_sms=handle.num_sms, do_cpu_sync=False)
    assert same is handle and again.shape == rows_out.shape
    assert_same_bits(again[:m].cpu(), expected_dispatch(Inputs(g, inp.topk_idx, inp.topk_weights), me, WORLD,
                                                        EXPERTS).x, "cached recv_x")
    if use_fp8:
        return
    # combine: rank r's rows times (r + 1), unweighted; the weights come back from their experts' ranks
    y = torch.full_like(rows_out, float("nan"))
    y[:m] = (rows_out[:m].float() * (me + 1)).to(torch.bfloat16)
    bias = _on(torch.randn(inp.x[me].shape, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16))
    out, out_w, event = buf.combine(y, handle, topk_weights=recv_w, bias=bias, async_with_compute_stream=True)
    event.current_stream_wait()
    summed = expected_combine(inp, me, WORLD, EXPERTS,
                              lambda r, s, i: (inp.x[s][i].float() * (r + 1)).to(torch.bfloat16))
    assert_same_bits(out.cpu(), (summed.float() + bias.cpu().float()).to(torch.bfloat16), "combined x")
    assert_same_bits(out_w.cpu(), torch.where(inp.topk_idx[me] >= 0, inp.topk_weights[me], 0.0), "combined weights")


def _expand_fp8(buf: deep_ep.ElasticBuffer, inp: Inputs, me: int, sync: bool, alignment: int) -> None:
    """FP8 expanded: e4m3 rows and their scales travel together into the same blocks (zero padding)."""
    qs = [fp8.quantize(inp.x[s]) for s in range(WORLD)]
    (recv, recv_sf), _, _, _, _ = buf.dispatch(
        (_on(qs[me][0]), _on(qs[me][1])), topk_idx=_on(inp.topk_idx[me]), topk_weights=_on(inp.topk_weights[me]),
        num_experts=EXPERTS, num_max_tokens_per_rank=T, expert_alignment=alignment, do_cpu_sync=sync, do_expand=True)
    blocks, _ = _expanded(inp, me, alignment)
    want_x = torch.zeros(recv.shape, dtype=torch.uint8)
    want_sf = torch.zeros(recv_sf.shape)
    start = 0
    for block in blocks:
        for j, (s, n, _) in enumerate(block):
            want_x[start + j] = qs[s][0][n].view(torch.uint8)
            want_sf[start + j] = qs[s][1][n]
        start += _align(len(block), alignment)
    assert_same_bits(recv.view(torch.uint8).cpu(), want_x, "expanded FP8 rows")
    assert_same_bits(recv_sf.cpu(), want_sf, "expanded FP8 scales")


def _expand_case(buf: deep_ep.ElasticBuffer, inp: Inputs, me: int, sync: bool, alignment: int) -> None:
    x, idx, w = _on(inp.x[me]), _on(inp.topk_idx[me]), _on(inp.topk_weights[me])
    recv, recv_idx, recv_w, handle, _ = buf.dispatch(
        x, topk_idx=idx, topk_weights=w, num_experts=EXPERTS, num_max_tokens_per_rank=T, expert_alignment=alignment,
        do_cpu_sync=sync, do_expand=True, do_zero_padding=True)
    assert recv_idx is None and recv_w.dim() == 1 and recv_w.shape[0] == recv.shape[0] == handle.num_expanded_tokens
    blocks, raw = _expanded(inp, me, alignment)
    total = sum(_align(c, alignment) for c in raw)
    worst = WORLD * T * min(TOPK, NUM_LOCAL) + (alignment - 1) * NUM_LOCAL  # moe_ep's static pair bound
    assert recv.shape[0] == (total if sync else worst)
    want_x = torch.zeros(recv.shape, dtype=torch.bfloat16)
    want_w = torch.zeros(recv.shape[0])
    start = 0
    for e, block in enumerate(blocks):
        for j, (s, n, k) in enumerate(block):
            want_x[start + j] = inp.x[s][n]
            want_w[start + j] = inp.topk_weights[s][n, k]
        start += _align(len(block), alignment)
    assert_same_bits(recv.cpu(), want_x, "expanded recv_x")
    assert_same_bits(recv_w.cpu(), want_w, "expanded weights")
    _check_handle(handle, inp, me, alignment, sync, True)
    # experts: pair p of local expert e times scale(me, e); padding rows hold garbage the combine must skip
    expert_of = torch.repeat_interleave(torch.arange(NUM_LOCAL), torch.tensor([_align(c, alignment) for c in raw]))
    scale = torch.ones(recv.shape[0])
    scale[:total] = torch.tensor([_scale_of(me, int(e)) for e in expert_of])
    y = (recv.float() * _on(scale).unsqueeze(1)).to(torch.bfloat16)
    pad = torch.ones(recv.shape[0], dtype=torch.bool)
    start = 0
    for c in raw:
        pad[start:start + c] = False
        start += _align(c, alignment)
    y[_on(pad)] = float("nan")
    out, out_w, _ = buf.combine(y, handle, topk_weights=recv_w)

    def row_of(r: int, s: int, i: int) -> torch.Tensor:
        acc = torch.zeros(HIDDEN)
        for e in sorted({e for e in inp.topk_idx[s][i].tolist() if e >= 0 and e // NUM_LOCAL == r},
                        key=inp.topk_idx[s][i].tolist().index):
            acc = acc + (inp.x[s][i].float() * _scale_of(r, e - r * NUM_LOCAL)).to(torch.bfloat16).float()
        return acc.to(torch.bfloat16)

    assert_same_bits(out.cpu(), expected_combine(inp, me, WORLD, EXPERTS, row_of), "combined expanded x")
    assert_same_bits(out_w.cpu(), torch.where(inp.topk_idx[me] >= 0, inp.topk_weights[me], 0.0), "combined weights")
    # a dispatch through an expanded handle gives the same layout
    again, _, _, _, _ = buf.dispatch(x, handle=handle, num_sms=handle.num_sms, do_expand=True)
    assert_same_bits(again.cpu(), want_x, "cached expanded recv_x")


def _refusals(buf: deep_ep.ElasticBuffer, inp: Inputs, me: int) -> None:
    x, idx = _on(inp.x[me]), _on(inp.topk_idx[me])
    with pytest.raises(NotImplementedError, match="num_cpu_bytes"):
        deep_ep.ElasticBuffer(buf.group, num_cpu_bytes=1 << 20, num_max_tokens_per_rank=T, hidden=HIDDEN)
    # rank 0's 7 tokens exceed the bound: it takes part without tokens and raises, rank 1 gets its rows
    if me == 0:
        with pytest.raises(ValueError, match="num_max_tokens_per_rank"):
            buf.dispatch(x, topk_idx=idx, num_experts=EXPERTS, num_max_tokens_per_rank=6)
    else:
        recv, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, num_experts=EXPERTS, num_max_tokens_per_rank=6)
        want = expected_dispatch(Inputs([inp.x[0][:0], inp.x[1]], [inp.topk_idx[0][:0], inp.topk_idx[1]],
                                        [inp.topk_weights[0][:0], inp.topk_weights[1]]), me, WORLD, EXPERTS)
        assert_same_bits(recv.cpu(), want.x, "rows beside a rejected rank")
    with pytest.raises(ValueError, match="do_zero_padding"):
        buf.dispatch(x, topk_idx=idx, num_experts=EXPERTS, do_zero_padding=True)
    with pytest.raises(NotImplementedError, match="UE8M0"):
        buf.dispatch((x, torch.zeros(x.shape[0], 1, dtype=torch.int32, device=x.device)), topk_idx=idx,
                     num_experts=EXPERTS)
    _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, num_experts=EXPERTS)
    with pytest.raises(ValueError, match="topk_idx"):
        buf.dispatch(x, topk_idx=idx, handle=handle)
    with pytest.raises(NotImplementedError, match="topk_weights with a handle"):
        buf.dispatch(x, topk_weights=_on(inp.topk_weights[me]), handle=handle)
    with pytest.raises(ValueError, match="do_expand"):
        buf.dispatch(x, handle=handle, do_expand=True)
    with pytest.raises(ValueError, match="num_experts"):
        buf.dispatch(x, handle=handle, num_experts=2 * EXPERTS)
    buf.combine(torch.zeros(handle.num_recv_tokens, HIDDEN, dtype=torch.bfloat16, device=x.device), handle)


def _worker(rank: int, world: int) -> None:
    group = dist.group.WORLD
    assert deep_ep.get_logical_domain_size(group) == (1, WORLD)
    assert deep_ep.get_physical_domain_size(group)[0] == 1
    hint = deep_ep.ElasticBuffer.get_buffer_size_hint(group, T, HIDDEN, num_topk=TOPK)
    buf = deep_ep.ElasticBuffer(group, num_bytes=hint, num_max_tokens_per_rank=T, hidden=HIDDEN, num_topk=TOPK,
                                allow_hybrid_mode=False, prefer_overlap_with_compute=False, sl_idx=0,
                                explicitly_destroy=True)
    assert (buf.group, buf.num_bytes, buf.num_max_tokens_per_rank) == (group, hint, T)
    assert buf.get_theoretical_num_sms(EXPERTS, TOPK) > 0
    seed = 0
    for tokens in ([13, 9], [0, 17], [T, 1]):
        for sync in (True, False):
            seed += 1
            inp = make_inputs(seed, tokens, HIDDEN, EXPERTS, TOPK)
            _compact_case(buf, inp, rank, sync, use_fp8=False)
            _compact_case(buf, inp, rank, sync, use_fp8=True)
            for alignment in (1, 8):
                _expand_case(buf, inp, rank, sync, alignment)
            _expand_fp8(buf, inp, rank, sync, 8)
    _refusals(buf, make_inputs(99, [7, 5], HIDDEN, EXPERTS, TOPK), rank)
    buf.destroy()
    assert buf.moe_ep_buffers == []


def test_elastic_buffer_cpu() -> None:
    run_workers(WORLD, _worker)


@requires_gpus(1)
def test_elastic_buffer_gpu() -> None:
    run_workers(WORLD, _worker, backend="gpu")


# DeepEP V2's parameter lists (deep_ep/buffers/elastic.py on main; docs/deep_ep_compat.md), in order
DEEP_EP_V2_SIGNATURES = {
    "__init__": ["self", "group", "num_bytes", "num_cpu_bytes", "num_max_tokens_per_rank", "hidden", "num_topk",
                 "use_fp8_dispatch", "deterministic", "allow_hybrid_mode", "allow_multiple_reduction",
                 "prefer_overlap_with_compute", "sl_idx", "num_allocated_qps", "num_cpu_timeout_secs",
                 "num_gpu_timeout_secs", "explicitly_destroy"],
    "dispatch": ["self", "x", "topk_idx", "topk_weights", "cumulative_local_expert_recv_stats", "num_experts",
                 "num_max_tokens_per_rank", "expert_alignment", "num_sms", "num_qps", "previous_event",
                 "previous_event_before_epilogue", "async_with_compute_stream", "allocate_on_comm_stream", "handle",
                 "do_handle_copy", "do_cpu_sync", "do_expand", "do_zero_padding", "use_tma_aligned_col_major_sf"],
    "combine": ["self", "x", "handle", "topk_weights", "bias", "num_sms", "num_qps", "previous_event",
                "previous_event_before_epilogue", "async_with_compute_stream", "allocate_on_comm_stream"],
    "get_buffer_size_hint": ["group", "num_max_tokens_per_rank", "hidden", "num_topk", "use_fp8_dispatch",
                             "allow_hybrid_mode", "allow_multiple_reduction"],
    "get_theoretical_num_sms": ["self", "num_experts", "num_topk", "num_scaleout_topk", "rdma_gbs", "nvlink_gbs",
                                "sm_read_gbs", "sm_write_gbs"],
    "barrier": ["self", "use_comm_stream", "with_cpu_sync", "sequential"],
    "destroy": ["self"],
}


def test_signatures_match_deep_ep_v2() -> None:
    for name, params in DEEP_EP_V2_SIGNATURES.items():
        positional = [p.name for p in inspect.signature(getattr(deep_ep.ElasticBuffer, name)).parameters.values()
                      if p.kind is not inspect.Parameter.KEYWORD_ONLY]
        assert positional == params, name
    event = deep_ep.ElasticBuffer.capture()
    overlap = deep_ep.EventOverlap(event)
    ran: list[int] = []
    overlap.register_hook_after_wait(lambda: ran.append(1))
    overlap.current_stream_wait(release_handle=True)
    assert ran == [1]
    with pytest.raises(RuntimeError, match="async_with_compute_stream"):
        deep_ep.EventOverlap().current_stream_wait()
