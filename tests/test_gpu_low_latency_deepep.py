"""DeepEP's low-latency formats and rank mask on the native kernels (2 ranks, on 2 GPUs or sharing one):

- FP8 scales token-major per expert (float32 [E_l, R*T, H/128], strides (H/128 * R*T, 1, R*T)) and
  UE8M0 (int32 [E_l, R*T, H/512], same layout): native bytes equal the reference backend's on the same
  inputs, with and without the receive hook, through moe_ep.Buffer and the DeepEP drop-in, on NVLink
  and (ranks_per_node=1) on the NVSHMEM put path; native outputs are poisoned between calls;
- moe_ep.Buffer.set_rank_masked with both ranks alive, each masking the other: native bits equal a
  fault-tolerant reference Buffer's with the same mask;
- the mask API of deep_ep.Buffer(enable_shrink=True): a killed rank masked by the survivor before its
  next call (the Buffer's timeout is far longer than the test may run, so the call must not wait for
  the dead rank), and a stalled rank masked by the kernels' timeout and reported by the query; the
  survivor's combine equals the combine rule with the masked rank's experts dropped.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist

import moe_ep
import moe_ep.deep_ep as deep_ep
from tests._dist import device, requires_gpus, run_workers
from tests.oracle import random_topk
from tests.test_gpu_faults import E, T, TIMEOUT_S, _expected_ll_combine, _inputs, _launch
from tests.test_gpu_low_latency import _x

pytestmark = requires_gpus()

WORLD = 2
SHAPES = [(7168, 16, 8, 32), (512, 8, 4, 20), (384, 4, 2, 12)]  # (hidden, experts, topk, max_tokens_per_rank)
LONG_TIMEOUT_S = 600.0  # a call that waited for the killed rank would outlast the test's wait


def _layout(scales: torch.Tensor, e_l: int, slots: int, per_row: int, dtype: torch.dtype, what: str) -> None:
    assert scales.dtype == dtype and scales.shape == (e_l, slots, per_row), (what, scales.dtype, scales.shape)
    assert scales.stride() == (per_row * slots, 1, slots) and scales.transpose(1, 2).is_contiguous(), \
        (what, scales.stride())


def _same_rows(x, scales, count, want, what: str) -> None:
    """Counts, rows below count and their scales equal the reference's bitwise."""
    assert torch.equal(count, want.count), f"{what}: count"
    valid = torch.arange(x.shape[1], device=x.device) < want.count.unsqueeze(1)
    assert torch.equal(x.view(torch.uint8)[valid], want.x.view(torch.uint8)[valid]), f"{what}: rows differ"
    assert torch.equal(scales.view(torch.int32)[valid], want.x_scales.view(torch.int32)[valid]), f"{what}: scales"


def _format_cases(rank: int, world: int, ranks_per_node: Optional[int]) -> None:
    local = torch.Generator(device="cuda").manual_seed(7 + rank)
    drop = deep_ep.Buffer(dist.group.WORLD, low_latency_mode=True, explicitly_destroy=True, backend="nvshmem",
                          ranks_per_node=ranks_per_node)
    for hidden, experts, k, t in SHAPES:
        e_l, slots = experts // WORLD, WORLD * t
        kwargs = dict(hidden=hidden, num_experts=experts, num_topk=k, max_tokens_per_rank=t, low_latency=True,
                      ranks_per_node=ranks_per_node)
        with moe_ep.Buffer(dist.group.WORLD, device=device(), backend="nvshmem", **kwargs) as buf, \
                moe_ep.Buffer(dist.group.WORLD, device=device(), backend="reference", **kwargs) as ref:
            modes = [(False, False), (True, False)] + ([(True, True)] if hidden % 512 == 0 else [])
            for it, (round_scale, ue8m0) in enumerate(modes * 2):
                n = [t, max(t - 5, 1), 0][(it + rank) % 3]
                x, idx = _x(n, hidden, local), random_topk(["random", "skewed"][it % 2], n, experts, k, local)
                what = f"hidden={hidden} round_scale={round_scale} ue8m0={ue8m0} it={it}"
                hook = it % 2 == 1
                got = buf.low_latency_dispatch(x, idx, use_fp8=True, round_scale=round_scale, use_ue8m0=ue8m0,
                                               return_recv_hook=hook)
                if hook:
                    got.hook()
                want = ref.low_latency_dispatch(x, idx, use_fp8=True, round_scale=round_scale, use_ue8m0=ue8m0)
                per_row, dtype = (hidden // 512, torch.int32) if ue8m0 else (hidden // 128, torch.float32)
                _layout(got.x_scales, e_l, slots, per_row, dtype, what)
                _layout(want.x_scales, e_l, slots, per_row, dtype, what + " (reference)")
                _same_rows(got.x, got.x_scales, got.count, want, what)
                got.x.view(torch.uint8).fill_(0xFF)
                got.x_scales.view(torch.int32).fill_(-1)  # poison: the next call must rewrite what it reports
                if hidden % 512 == 0:  # DeepEP's FP8 low-latency dispatch needs hidden % 512 == 0
                    (q, s), count, _, _, hook_fn = drop.low_latency_dispatch(
                        x, idx, t, experts, use_fp8=True, round_scale=round_scale, use_ue8m0=ue8m0,
                        return_recv_hook=hook)
                    if hook:
                        hook_fn()
                    _layout(s, e_l, slots, per_row, dtype, what + " (drop-in)")
                    _same_rows(q, s, count, want, what + " (drop-in)")
    drop.destroy()


@pytest.mark.parametrize("ranks_per_node", [None, 1], ids=["nvlink", "put_path"])
def test_scale_formats_native_equal_reference(ranks_per_node: Optional[int]) -> None:
    run_workers(WORLD, _format_cases, ranks_per_node, backend="gpu", timeout_s=600)


def _partition_cases(rank: int, world: int) -> None:
    """Both ranks alive, each masking the other (moe_ep.Buffer.set_rank_masked): the native Buffer and a
    fault-tolerant reference Buffer with the same mask give the same bits, so each rank works alone."""
    other, (hidden, experts, k, t) = 1 - rank, (1024, 16, 4, 64)
    local = torch.Generator(device="cuda").manual_seed(11 + rank)
    kwargs = dict(hidden=hidden, num_experts=experts, num_topk=k, max_tokens_per_rank=t, low_latency=True,
                  fault_tolerant=True)
    with moe_ep.Buffer(dist.group.WORLD, device=device(), backend="nvshmem", **kwargs) as buf, \
            moe_ep.Buffer(dist.group.WORLD, device=device(), backend="reference", **kwargs) as ref:
        for b in (buf, ref):
            b.set_rank_masked(other)
        for it in range(4):
            n = [t, t - 9, 1, 0][(it + rank) % 4]
            use_fp8, hook = it % 2 == 1, it >= 2
            x, idx = _x(n, hidden, local), random_topk("random", n, experts, k, local)
            w = torch.rand(n, k, generator=local, device="cuda")
            got = buf.low_latency_dispatch(x, idx, use_fp8=use_fp8, return_recv_hook=hook)
            if hook:
                got.hook()
            want = ref.low_latency_dispatch(x, idx, use_fp8=use_fp8)
            what = f"partition it={it}"
            assert torch.equal(got.count, want.count), what
            valid = torch.arange(got.x.shape[1], device="cuda") < want.count.unsqueeze(1)
            assert torch.equal(got.x.view(torch.uint8)[valid], want.x.view(torch.uint8)[valid]), what
            if use_fp8:
                assert torch.equal(got.x_scales.view(torch.int32)[valid], want.x_scales.view(torch.int32)[valid]), what
            y = (torch.randn(got.x.shape, generator=local, device="cuda") * 3).to(torch.bfloat16)
            out = buf.low_latency_combine(y, idx, w, got.handle, return_recv_hook=hook)
            if hook:
                out.hook()
            want_out = ref.low_latency_combine(y, idx, w, want.handle).x
            assert torch.equal(out.x.view(torch.int16), want_out.view(torch.int16)), f"{what}: combine"
        assert buf.masked_ranks == ref.masked_ranks == [other]
        for b in (buf, ref):
            b.clear_rank_masks()
        assert buf.masked_ranks == ref.masked_ranks == []


def test_partition_native_equals_reference() -> None:
    run_workers(WORLD, _partition_cases, backend="gpu", timeout_s=300)


def _round(buf: deep_ep.Buffer, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    x, idx, w = _inputs(rank, step)
    recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
    out, _, _ = buf.low_latency_combine(recv, idx, w, handle)
    return x, idx, w, out


def _status(buf: deep_ep.Buffer) -> list[int]:
    status = torch.full((WORLD,), 7, dtype=torch.int32, device="cuda")
    buf.low_latency_query_mask_buffer(status)
    return status.tolist()


def _killed(rank: int, report: Callable[[str, Any], None], _scratch: Path) -> None:
    buf = deep_ep.Buffer(dist.group.WORLD, low_latency_mode=True, enable_shrink=True, backend="nvshmem",
                         timeout_s=LONG_TIMEOUT_S)
    for step in range(2):
        x, idx, w, out = _round(buf, rank, step)
        assert torch.equal(out.cpu(), _expected_ll_combine(x, idx, w, {0, 1})), f"step {step} before the fault"
    report("before", _status(buf))
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    buf.low_latency_update_mask_buffer(1, True)
    for step in (2, 3):
        x, idx, w, out = _round(buf, rank, step)
        report(f"step{step}", torch.equal(out.cpu(), _expected_ll_combine(x, idx, w, {0})))
    report("after", _status(buf))
    buf.low_latency_clean_mask_buffer()
    report("cleaned", _status(buf))
    for b in buf.moe_ep_buffers:
        b.abort()


def test_killed_rank_masked_through_the_drop_in() -> None:
    seen = _launch(_killed, wait_s=120)
    assert seen[(0, "before")] == [0, 0] and seen[(1, "before")] == [0, 0]
    assert seen[(0, "step2")] and seen[(0, "step3")]
    assert seen[(0, "after")] == [0, 1] and seen[(0, "cleaned")] == [0, 0]


def _stalled(rank: int, report: Callable[[str, Any], None], _scratch: Path) -> None:
    buf = deep_ep.Buffer(dist.group.WORLD, low_latency_mode=True, enable_shrink=True, backend="nvshmem",
                         timeout_s=TIMEOUT_S)
    _round(buf, rank, 0)
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 1:
        time.sleep(2 * TIMEOUT_S + 2)
    x, idx, w, out = _round(buf, rank, 1)
    torch.cuda.synchronize()
    report("stalled", (_status(buf), torch.equal(out.cpu(), _expected_ll_combine(x, idx, w, {rank}))))


def test_stalled_rank_masked_by_timeout_and_queried() -> None:
    seen = _launch(_stalled)
    assert seen[(0, "stalled")] == ([0, 1], True)
    assert seen[(1, "stalled")] == ([1, 0], True)  # rank 0 had moved on: rank 1 masks it in turn
