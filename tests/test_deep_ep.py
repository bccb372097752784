"""moe_ep.deep_ep (DeepEP V1's API) against brute force over all ranks' inputs: on CPU (gloo, reference
backend) and on 2 GPUs (NCCL, native and reference backends). Inputs and the oracle live on the CPU;
each check moves its rank's inputs to the device under test and the results back."""
from __future__ import annotations

import contextlib
import inspect

import pytest
import torch
import torch.distributed as dist

import moe_ep.deep_ep as deep_ep
from moe_ep.comm import fp8
from moe_ep.comm.config import DEEP_EP_HINT_TOKENS_PER_RANK, DEFAULT_NUM_SMS
from tests._dist import device, requires_gpus, run_workers
from tests.oracle import (
    Inputs,
    expected_combine,
    expected_combine_weights,
    expected_dispatch,
    expected_layout,
    expected_low_latency_combine,
    expected_low_latency_dispatch,
    local_weights,
    make_inputs,
    owners,
)

# (seed, tokens per rank (cycled over ranks), hidden, experts, topk, routing, max_tokens_per_rank, ranks_per_node)
CASES = {
    1: [(21, [29], 128, 8, 4, "random", 32, None)],
    2: [
        (22, [33, 0], 128, 16, 8, "random", 40, None),
        (23, [40, 17], 512, 8, 2, "skewed", 48, None),
        (24, [25, 31], 128, 8, 4, "one_expert", 32, 1),
    ],
    3: [(25, [20, 0, 31], 128, 12, 4, "random", 32, None)],
    4: [(26, [19, 5, 27, 8], 128, 16, 6, "random", 32, 2)],
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.cpu()
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16) if t.element_size() == 2 else t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _mine(inp: Inputs, me: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank me's x, topk_idx and topk_weights on the device under test."""
    return inp.x[me].to(dev), inp.topk_idx[me].to(dev), inp.topk_weights[me].to(dev)


def _aligned(counts: list[int], alignment: int) -> list[int]:
    return [-(-c // alignment) * alignment for c in counts]


def _sent(inp: Inputs, s: int, world: int, experts: int) -> list[int]:
    """Tokens rank s sends to each rank (brute force)."""
    return [sum(1 for row in inp.topk_idx[s].tolist() if r in owners(row, experts // world)) for r in range(world)]


def _layout(buf: deep_ep.Buffer, inp: Inputs, me: int, experts: int, dev: torch.device) -> tuple:
    return buf.get_dispatch_layout(inp.topk_idx[me].to(dev), experts)


def _check_layout(buf: deep_ep.Buffer, inp: Inputs, me: int, world: int, experts: int, per_node: int,
                  dev: torch.device) -> None:
    per_rank, per_rdma, per_expert, in_rank, event = _layout(buf, inp, me, experts, dev)
    want_rank, want_expert, want_mask = expected_layout(inp, me, world, experts)
    assert _same(per_rank, want_rank) and _same(per_expert, want_expert) and _same(in_rank, want_mask)
    if per_node == world:
        assert per_rdma is None
    else:
        nodes = [{r // per_node for r in owners(row, experts // world)} for row in inp.topk_idx[me].tolist()]
        want_nodes = [sum(1 for hit in nodes if n in hit) for n in range(world // per_node)]
        assert per_rdma.tolist() == want_nodes and per_rdma.dtype == torch.int32
    assert event.event is None
    with pytest.raises(RuntimeError, match="async_finish"):
        event.current_stream_wait()
    *_, event = buf.get_dispatch_layout(inp.topk_idx[me].to(dev), experts, previous_event=buf.capture(),
                                        async_finish=True)
    event.current_stream_wait()
    with event:
        pass


def _weights_back(recv_weights: torch.Tensor, me: int) -> torch.Tensor:
    """What rank `me` returns through combine: its received weights plus (me + 1), in float32."""
    return recv_weights + (me + 1)


def _expected_weights(inp: Inputs, me: int, world: int, experts: int, per_node: int) -> torch.Tensor:
    """moe_ep's combine order (two levels across nodes), in float32, of _weights_back of the rows."""
    return expected_combine_weights(inp, me, world, experts,
                                    lambda r, s, i: local_weights(inp, r, s, i, experts, world) + (r + 1), per_node)


def _row_back(inp: Inputs):
    """Rank r returns bf16(x * (r + 1) + s) for a row from source s."""
    return lambda r, s, i: (inp.x[s][i].float() * (r + 1) + s).to(torch.bfloat16)


def _returned(recv_x: torch.Tensor, me: int, src_rank: list[int], dev: torch.device) -> torch.Tensor:
    """What rank me's experts return for its received rows: bf16(x * (me + 1) + source rank), see _row_back."""
    src = torch.tensor(src_rank, dtype=torch.float32).unsqueeze(1)
    return (recv_x.cpu().float() * (me + 1) + src).to(torch.bfloat16).to(dev)


def _check_normal(buf: deep_ep.Buffer, inp: Inputs, me: int, world: int, experts: int, per_node: int,
                  alignment: int, async_mode: bool, dev: torch.device) -> None:
    x, idx, w = _mine(inp, me, dev)
    per_rank, _, per_expert, in_rank, _ = _layout(buf, inp, me, experts, dev)

    def extra() -> dict:
        """DeepEP's async arguments; previous_event captured at the call, after every input it reads was made
        (the communication stream waits for that event only, not for the caller's stream)."""
        return {"async_finish": async_mode, "previous_event": buf.capture() if async_mode else None}

    recv_x, recv_idx, recv_w, counts, handle, event = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx,
        topk_weights=w, expert_alignment=alignment, config=deep_ep.Config(8), **extra())
    if async_mode:
        event.current_stream_wait()
    want = expected_dispatch(inp, me, world, experts)
    assert _same(recv_x, want.x) and _same(recv_idx, want.topk_idx) and _same(recv_w, want.topk_weights)
    assert counts == _aligned(want.tokens_per_expert, alignment)
    sent = torch.tensor([_sent(inp, s, world, experts) for s in range(world)], dtype=torch.int32)
    assert len(handle) == 6 and handle[1] is None and handle[2] is None and handle[5] is None
    assert _same(handle[0], sent.cumsum(0, dtype=torch.int32))
    assert handle[3].tolist() == want.src_index and _same(handle[4], in_rank)

    # combine with weights and two biases: moe_ep's sum, then the biases in float32, one more rounding
    y = _returned(recv_x, me, want.src_rank, dev)
    g = torch.Generator().manual_seed(1000 + me)
    b0, b1 = ((torch.randn(x.shape, generator=g) * 4).to(torch.bfloat16) for _ in range(2))
    weights_back, biases = _weights_back(recv_w, me), (b0.to(dev), b1.to(dev))
    out, out_w, event = buf.combine(y, handle, topk_weights=weights_back, bias=biases, **extra())
    if async_mode:
        event.current_stream_wait()
    summed = expected_combine(inp, me, world, experts, _row_back(inp), per_node)
    assert _same(out, (summed.float() + b0.float() + b1.float()).to(torch.bfloat16))
    assert _same(out_w, _expected_weights(inp, me, world, experts, per_node))
    out, out_w, _ = buf.combine(y, handle, bias=b0.to(dev))
    assert out_w is None and _same(out, (summed.float() + b0.float()).to(torch.bfloat16))

    # cached dispatch of another tensor follows the same layout
    grads = [(torch.randn(t.shape, generator=torch.Generator().manual_seed(s)) * 3).to(torch.bfloat16)
             for s, t in enumerate(inp.x)]
    recv, a, b, c, d, _ = buf.dispatch(grads[me].to(dev), handle=handle)
    assert (a, b, c, d) == (None, None, None, None)
    rows = [grads[s][i] for s, i in zip(want.src_rank, want.src_index)]
    assert _same(recv, torch.stack(rows) if rows else torch.empty(0, x.shape[1], dtype=torch.bfloat16))


def _check_without_topk(buf: deep_ep.Buffer, inp: Inputs, me: int, world: int, experts: int, alignment: int,
                        dev: torch.device) -> None:
    per_rank, _, per_expert, in_rank, _ = _layout(buf, inp, me, experts, dev)
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
        inp.x[me].to(dev), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        expert_alignment=alignment)
    want = expected_dispatch(inp, me, world, experts)
    assert _same(recv_x, want.x) and recv_idx is None and recv_w is None
    total = sum(expected_layout(inp, s, world, experts)[1] for s in range(world))
    num_local = experts // world
    assert counts == _aligned(total[me * num_local:(me + 1) * num_local].tolist(), alignment)
    out, out_w, _ = buf.combine(recv_x, handle)
    visits = in_rank.cpu().sum(1, keepdim=True).float()
    assert out_w is None and _same(out, (inp.x[me].float() * visits + 0.0).to(torch.bfloat16))


def _check_fp8(buf: deep_ep.Buffer, inp: Inputs, me: int, world: int, experts: int, dev: torch.device) -> None:
    quantized = [fp8.quantize(x) for x in inp.x]
    q, s = (t.to(dev) for t in quantized[me])
    per_rank, _, per_expert, in_rank, _ = _layout(buf, inp, me, experts, dev)
    _, idx, w = _mine(inp, me, dev)
    args = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=idx, topk_weights=w)
    (recv_q, recv_s), *_ = buf.dispatch((q, s.T.contiguous().T), **args)  # column-major scales, as DeepEP's tests
    want = expected_dispatch(Inputs([t[0] for t in quantized], inp.topk_idx, inp.topk_weights), me, world, experts,
                             scales=[t[1] for t in quantized])
    assert _same(recv_q, want.x) and _same(recv_s, want.scales)
    worst = sum(x.shape[0] for x in inp.x) + 3
    (worst_q, worst_s), *_ = buf.dispatch((q, s), num_worst_tokens=worst, **args)
    m = want.x.shape[0]
    assert worst_q.shape[0] == worst and _same(worst_q[:m], want.x) and _same(worst_s[:m], want.scales)


def _check_worst(buf: deep_ep.Buffer, inp: Inputs, me: int, world: int, experts: int, t: int, per_node: int,
                 dev: torch.device) -> None:
    """num_worst_tokens: the exact results first, then padding; fewer rows than moe_ep's R * T, and more.
    Too few rows is checked on CPU only: on CUDA it is a device-side assert, which ends the process."""
    x, idx, w = _mine(inp, me, dev)
    per_rank, _, per_expert, in_rank, _ = _layout(buf, inp, me, experts, dev)
    want = expected_dispatch(inp, me, world, experts)
    m = want.x.shape[0]
    summed = expected_combine(inp, me, world, experts, _row_back(inp), per_node)
    for worst in (max(m, 1), sum(t.shape[0] for t in inp.x), world * t + 5):
        recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=idx, topk_weights=w, num_worst_tokens=worst)
        assert counts == [] and recv_x.shape[0] == recv_idx.shape[0] == recv_w.shape[0] == worst
        assert _same(recv_x[:m], want.x) and _same(recv_idx[:m], want.topk_idx) and _same(recv_w[:m], want.topk_weights)
        assert (recv_idx[m:] == -1).all() and (recv_w[m:] == 0).all()
        assert handle[3][:m].tolist() == want.src_index and (handle[3][m:] == -1).all()
        y = torch.randn(recv_x.shape, device=dev).to(torch.bfloat16)  # padding rows hold anything
        y[:m] = _returned(recv_x[:m], me, want.src_rank, dev)
        weights_back = torch.randn(recv_w.shape, device=dev)
        weights_back[:m] = _weights_back(recv_w[:m], me)
        out, out_w, _ = buf.combine(y, handle, topk_weights=weights_back)
        assert _same(out, summed) and _same(out_w, _expected_weights(inp, me, world, experts, per_node))
        cached, *_ = buf.dispatch(x, handle=handle)
        assert cached.shape[0] == worst and _same(cached[:m], want.x)
    if dev.type == "cuda":
        return
    # too few rows for what arrived: an error on the ranks concerned, after the call's collectives
    with pytest.raises(RuntimeError, match="num_worst_tokens") if m > 1 else contextlib.nullcontext():
        buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                     topk_idx=idx, topk_weights=w, num_worst_tokens=1)


def _check_low_latency(buf: deep_ep.Buffer, inp: Inputs, me: int, world: int, experts: int, t: int,
                       dev: torch.device) -> None:
    num_local, hidden = experts // world, inp.x[me].shape[1]
    x, idx, w = _mine(inp, me, dev)
    buf.clean_low_latency_buffer(t, hidden, experts)
    modes = [(False, False, False, False), (True, False, True, False), (True, True, False, False)]
    if hidden % 512 == 0:
        modes += [(True, True, True, True), (True, True, False, True)]
    for use_fp8, round_scale, hook, ue8m0 in modes:
        stats = torch.zeros(num_local, dtype=torch.int32, device=dev)
        recv, count, handle, event, hook_fn = buf.low_latency_dispatch(
            x, idx, t, experts, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8, round_scale=round_scale,
            use_ue8m0=ue8m0, async_finish=not hook, return_recv_hook=hook)
        if hook:
            assert event.event is None
            hook_fn()
        else:
            assert hook_fn is None
            event.current_stream_wait()
        want = expected_low_latency_dispatch(inp, me, world, experts, use_fp8, round_scale)
        recv_x, recv_s = recv if use_fp8 else (recv, None)
        if ue8m0:  # exponent bytes, four per int32, read back as DeepEP's tests do
            assert recv_s.dtype == torch.int32 and recv_s.shape[2] == hidden // 512
            bytes_ = recv_s.clone(memory_format=torch.contiguous_format).view(torch.uint8)  # H/512 may be 1
            recv_s = (bytes_.to(torch.int32) << 23).view(torch.float32)
        assert recv_x.shape == (num_local, world * t, hidden) and _same(stats, count)
        assert tuple(handle[2:]) == (t, hidden, experts) and handle[1].dtype == torch.int64
        for e in range(num_local):
            c = int(count[e])
            assert c == len(want.rows[e])
            if c:
                assert _same(recv_x[e, :c], torch.stack(want.rows[e]))
                if use_fp8:
                    assert _same(recv_s[e, :c], torch.stack(want.scales[e]))
            assert handle[0][e, :c].tolist() == [i for _, i in want.src[e]]
            from_src = [sum(1 for s, _ in want.src[e] if s == r) for r in range(world)]
            begins = [sum(from_src[:r]) for r in range(world)]
            assert handle[1][e].tolist() == [(b << 32) | n for b, n in zip(begins, from_src)]

    recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, t, experts, use_fp8=False)
    scale = (torch.arange(num_local) + me * num_local) % 7 + 1
    y = (recv.cpu().float() * scale.view(-1, 1, 1).float() + 0.25).to(torch.bfloat16).to(dev)
    ref = expected_low_latency_combine(
        inp, me, world, experts, lambda e, s, n, k: (inp.x[s][n].float() * (e % 7 + 1) + 0.25).to(torch.bfloat16))
    out, event, hook_fn = buf.low_latency_combine(y, idx, w, handle, async_finish=True)
    event.current_stream_wait()
    assert hook_fn is None and _same(out, ref)
    target = torch.empty_like(ref, device=dev)
    out, _, hook_fn = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=True, out=target)
    hook_fn()
    assert out is target and _same(target, ref)
    buf.get_next_low_latency_combine_buffer(handle)[:] = y
    out, _, _ = buf.low_latency_combine(torch.zeros_like(y), idx, w, handle, zero_copy=True)
    assert _same(out, ref)
    # SGLang's single-batch overlap on Hopper, every block already signalled: the same bits
    recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, t, experts, use_fp8=False)
    signal = torch.full((num_local * -(-world * t // 64),), 3, dtype=torch.int32, device=dev)
    for hook in (False, True):
        out, event, hook_fn = buf.low_latency_combine(y, idx, w, handle, async_finish=not hook, return_recv_hook=hook,
                                                      overlap=True, packed_recv_count=count, comp_signal=signal,
                                                      block_m=64, threshold=3, num_sms=3)
        if hook:
            hook_fn()
        else:
            event.current_stream_wait()
        assert _same(out, ref)


def _check_unsupported(buf: deep_ep.Buffer) -> None:
    """Every unsupported option raises before any communication, naming itself."""
    for option in ("use_fabric", "allow_mnnvl"):
        with pytest.raises(NotImplementedError, match=f"{option}=True.*no multi-node NVLink"):
            deep_ep.Buffer(dist.group.WORLD, **{option: True})
    with pytest.raises(NotImplementedError, match="allow_nvlink_for_low_latency_mode"):
        deep_ep.Buffer(dist.group.WORLD, allow_nvlink_for_low_latency_mode=False)
    with pytest.raises(NotImplementedError, match="comm"):
        deep_ep.Buffer(None, comm=object())
    x, idx = torch.zeros(2, 128, dtype=torch.bfloat16), torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="use_ue8m0"):
        buf.low_latency_dispatch(x, idx, 4, 8, use_ue8m0=True)
    with pytest.raises(NotImplementedError, match="dispatch_wait_recv_cost_stats"):
        buf.low_latency_dispatch(x, idx, 4, 8, dispatch_wait_recv_cost_stats=torch.zeros(1, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="use_nvfp4=True needs use_fp8=False"):  # use_fp8 defaults to True
        buf.low_latency_dispatch(x, idx, 4, 8, use_nvfp4=True, x_global_scale=torch.ones(1))
    with pytest.raises(NotImplementedError, match="use_ue8m0_for_sf"):
        buf.low_latency_dispatch(x, idx, 4, 8, use_fp8=False, use_nvfp4=True, x_global_scale=torch.ones(1),
                                 use_ue8m0_for_sf=True)
    with pytest.raises(NotImplementedError, match="src_signals / src_signal_expect_value"):
        buf.low_latency_combine(x, idx, torch.zeros(2, 2), None, overlap=True, src_signals=torch.zeros(4, dtype=torch.int32),
                                src_signal_expect_value=3)
    with pytest.raises(NotImplementedError, match="use_logfmt"):
        buf.low_latency_combine(x, idx, torch.zeros(2, 2), None, use_logfmt=True)
    with pytest.raises(NotImplementedError, match="combine_wait_recv_cost_stats"):
        buf.low_latency_combine(x, idx, torch.zeros(2, 2), None,
                                combine_wait_recv_cost_stats=torch.zeros(1, 1, dtype=torch.int64))
    for call in (lambda: buf.low_latency_update_mask_buffer(0, True), lambda: buf.low_latency_clean_mask_buffer(),
                 lambda: buf.low_latency_query_mask_buffer(torch.zeros(1, dtype=torch.int32))):
        with pytest.raises(ValueError, match="enable_shrink=True"):
            call()


def _check_budget_and_modes(rank: int, world: int) -> None:
    """num_nvl_bytes sizes normal mode; low-latency calls need low_latency_mode; destroy needs explicitly_destroy."""
    hidden, experts = 128, 4 * world
    hint = deep_ep.Config().get_nvl_buffer_size_hint(hidden * 2, world)
    buf = deep_ep.Buffer(dist.group.WORLD, hint)
    idx = torch.full((3, 2), -1, dtype=torch.int64)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
    buf.dispatch(torch.zeros(3, hidden, dtype=torch.bfloat16), num_tokens_per_rank=per_rank,
                 is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx,
                 topk_weights=torch.zeros(3, 2))
    assert [b.max_tokens_per_rank for b in buf.moe_ep_buffers] == [DEEP_EP_HINT_TOKENS_PER_RANK]
    with pytest.raises(ValueError, match="low_latency_mode"):
        buf.low_latency_dispatch(torch.zeros(3, hidden, dtype=torch.bfloat16), idx, 4, experts)
    with pytest.raises(RuntimeError, match="explicitly_destroy"):
        buf.destroy()
    with pytest.raises(ValueError, match="num_nvl_bytes"):
        deep_ep.Buffer(dist.group.WORLD).dispatch(
            torch.zeros(3, hidden, dtype=torch.bfloat16), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=torch.zeros(3, 2))


def _run_cases(rank: int, world: int, cases: list[tuple], backend: str, group: dist.ProcessGroup) -> None:
    """Every check on each case, through a deep_ep.Buffer over `group` whose moe_ep Buffers use `backend`;
    tensors on this rank's device (its GPU in a GPU run, shared or not)."""
    dev = device()
    for seed, tokens, hidden, experts, topk, routing, t, per_node in cases:
        inp = make_inputs(seed, [tokens[r % len(tokens)] for r in range(world)], hidden, experts, topk, routing)
        buf = deep_ep.Buffer(group, low_latency_mode=True, explicitly_destroy=True, backend=backend,
                             max_tokens_per_rank=t, ranks_per_node=per_node)
        node = per_node or world
        try:
            _check_layout(buf, inp, rank, world, experts, node, dev)
            for alignment, async_mode in ((1, False), (4, True)):
                _check_normal(buf, inp, rank, world, experts, node, alignment, async_mode, dev)
                _check_without_topk(buf, inp, rank, world, experts, alignment, dev)
            _check_fp8(buf, inp, rank, world, experts, dev)
            _check_worst(buf, inp, rank, world, experts, t, node, dev)
            _check_low_latency(buf, inp, rank, world, experts, t, dev)
            _check_unsupported(buf)
            assert {b.backend_name for b in buf.moe_ep_buffers} == {backend}
        except AssertionError as e:
            raise AssertionError(f"{backend} case seed={seed} rank={rank}: {e}") from e
        buf.destroy()


def _worker(rank: int, world: int) -> None:
    _run_cases(rank, world, CASES[world], "reference", dist.group.WORLD)
    _check_budget_and_modes(rank, world)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_deep_ep_semantics(world: int) -> None:
    run_workers(world, _worker)


# GPU: the two-rank cases (one node, and ranks_per_node=1 where every byte takes the network path), plus
# a larger one with 32 local experts.
GPU_CASES = CASES[2] + [(27, [300, 257], 2048, 64, 8, "random", 320, None)]


def _gpu_worker(rank: int, world: int) -> None:
    for backend in ("nvshmem", "reference"):
        _run_cases(rank, world, GPU_CASES, backend, dist.group.WORLD)
    # CUDA tensors over a CPU (gloo) group, which vLLM passes: the native backend runs over it
    _run_cases(rank, world, GPU_CASES[:1], "nvshmem", dist.new_group(backend="gloo"))


@requires_gpus()
def test_deep_ep_gpu() -> None:
    """The same checks with 2 ranks on GPUs (sharing one where there is one): native backend, the
    reference backend, and the native backend behind a gloo group."""
    run_workers(2, _gpu_worker, backend="gpu", timeout_s=600)


# DeepEP V1's parameter names, in order (deepseek-ai/DeepEP deep_ep/buffer.py), so calls by position
# or keyword written for DeepEP bind the same way here.
DEEP_EP_SIGNATURES = {
    "__init__": ["self", "group", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode", "num_qps_per_rank",
                 "allow_nvlink_for_low_latency_mode", "allow_mnnvl", "use_fabric", "explicitly_destroy",
                 "enable_shrink", "comm"],
    "get_dispatch_layout": ["self", "topk_idx", "num_experts", "previous_event", "async_finish",
                            "allocate_on_comm_stream"],
    "dispatch": ["self", "x", "handle", "num_tokens_per_rank", "num_tokens_per_rdma_rank", "is_token_in_rank",
                 "num_tokens_per_expert", "topk_idx", "topk_weights", "expert_alignment", "num_worst_tokens",
                 "config", "previous_event", "async_finish", "allocate_on_comm_stream"],
    "combine": ["self", "x", "handle", "topk_weights", "bias", "config", "previous_event", "async_finish",
                "allocate_on_comm_stream"],
    "clean_low_latency_buffer": ["self", "num_max_dispatch_tokens_per_rank", "hidden", "num_experts"],
    "low_latency_dispatch": ["self", "x", "topk_idx", "num_max_dispatch_tokens_per_rank", "num_experts",
                             "cumulative_local_expert_recv_stats", "dispatch_wait_recv_cost_stats", "use_fp8",
                             "round_scale", "use_ue8m0", "async_finish", "return_recv_hook"],
    "low_latency_combine": ["self", "x", "topk_idx", "topk_weights", "handle", "use_logfmt", "zero_copy",
                            "async_finish", "return_recv_hook", "out", "combine_wait_recv_cost_stats"],
    "get_next_low_latency_combine_buffer": ["self", "handle"],
    "low_latency_update_mask_buffer": ["self", "rank_to_mask", "mask"],
    "low_latency_query_mask_buffer": ["self", "mask_status"],
    "get_low_latency_rdma_size_hint": ["num_max_dispatch_tokens_per_rank", "hidden", "num_ranks", "num_experts"],
    "get_dispatch_config": ["num_ranks"],
    "get_combine_config": ["num_ranks"],
    "set_num_sms": ["new_num_sms"],
}


def test_signatures_match_deep_ep() -> None:
    for name, params in DEEP_EP_SIGNATURES.items():
        positional = [p.name for p in inspect.signature(getattr(deep_ep.Buffer, name)).parameters.values()
                      if p.kind is not inspect.Parameter.KEYWORD_ONLY]
        assert positional == params, name
    defaults = inspect.signature(deep_ep.Buffer.low_latency_dispatch).parameters
    assert defaults["use_fp8"].default is True and deep_ep.Buffer.num_sms == DEFAULT_NUM_SMS  # moe_ep's one default


def test_static_helpers() -> None:
    assert deep_ep.topk_idx_t is torch.int64 and deep_ep.Buffer.is_sm90_compiled()
    assert deep_ep.Config() == deep_ep.Config(DEFAULT_NUM_SMS, 6, 256, 6, 256)
    assert deep_ep.Buffer.get_dispatch_config(8).num_sms == DEFAULT_NUM_SMS
    assert deep_ep.Buffer.get_combine_config(2).num_sms == DEFAULT_NUM_SMS
    assert deep_ep.Config().get_rdma_buffer_size_hint(14336, 16) == 0
    assert deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256) > 2 * 8 * 128 * 7168 * 2
    deep_ep.Buffer.set_num_sms(DEFAULT_NUM_SMS + 2)
    try:
        assert deep_ep.Buffer.get_dispatch_config(2).num_sms == DEFAULT_NUM_SMS + 2
    finally:
        deep_ep.Buffer.set_num_sms(DEFAULT_NUM_SMS)
    with pytest.raises(ValueError, match="even"):
        deep_ep.Buffer.set_num_sms(23)
    event = deep_ep.Buffer.capture()
    event.current_stream_wait()
    with event:
        pass
    deep_ep.EventOverlap(deep_ep.EventHandle()).current_stream_wait()  # Megatron-Core's use
