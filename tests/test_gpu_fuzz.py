"""GPU fuzz: up to 10,000 random calls, within a time budget (MOE_EP_FUZZ_SECONDS, 90 s: the ranks
agree every 100 calls whether to go on, so the GPU suite fits one device call), on one native Buffer
(low_latency=True) with 2 ranks (on 2 GPUs, or sharing one: tests/_dist.py), interleaved as
tests/test_fuzz.py draws them (normal dispatch with random N including 0, K routing kinds, skew, FP8,
alignment, worst case, NaN/Inf; combine and cached dispatch through live handles; layout;
low-latency with and without hooks, FP8; bad inputs that must raise), each run on the reference
backend with the same inputs and compared bit for bit. Device memory (torch allocations and the
NVSHMEM heap's reservations) is the same before and after.

Bad expert ids are left to tests/test_gpu_faults.py and tests/test_one_rank_bad_input.py: the native
kernels report them once a call's kernels are launched (in the call that syncs, or a later one), the
reference backend after the call's exchange."""
from __future__ import annotations

import gc
import os
import random
import time
from dataclasses import replace
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

import moe_ep
from tests._dist import device, requires_gpus, run_workers
from tests.test_fuzz import BAD_INPUTS, Call, FuzzShape, call_inputs, fp8_payloads, fuzz_calls

pytestmark = requires_gpus()

CALLS = int(os.environ.get("MOE_EP_FUZZ_CALLS", "10000"))  # each run draws a fresh seed: coverage adds up over runs
SECONDS = float(os.environ.get("MOE_EP_FUZZ_SECONDS", "90"))  # the fuzz part stops once this is spent
AGREE_EVERY = 100  # calls between the ranks' agreements on the time budget
WARMUP = 200  # calls before the memory is first measured
SHAPE = FuzzShape(hidden=256, experts=16, topk=6, max_tokens=32)
GPU_BAD = ("x_dtype", "topk_dtype", "weights_dtype", "too_many_tokens", "misaligned", "non_contiguous", "event_type",
           "expert_alignment", "scales_without_fp8", "fp8_without_scales", "round_scale_without_fp8", "combine_rows",
           "cached_with_topk")


def _same(a: Any, b: Any, what: str) -> None:
    """Bitwise equality of two tensors (or both None)."""
    if a is None or b is None:
        assert a is None and b is None, what
        return
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    if a.dtype.is_floating_point:  # standard strides first: low-latency scales are token-major
        a, b = (t.clone(memory_format=torch.contiguous_format).view(torch.uint8) for t in (a, b))
    assert torch.equal(a, b), what


class PairFuzzer:
    """Runs every call on the native and the reference Buffer and compares the results."""

    def __init__(self, native: moe_ep.Buffer, ref: moe_ep.Buffer) -> None:
        self.bufs = (native, ref)
        self.me, self.world, self.dev = native.rank, native.group_size, native.device
        self.live: dict[int, tuple[Any, Any, Any]] = {}  # dispatch index -> (inputs, native result, reference result)

    def inputs(self, call: Call) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        inp = call_inputs(call, SHAPE)
        scales = None
        x = inp.x[self.me]
        if call.fp8:
            q, s = fp8_payloads([x])
            x, scales = q[0].to(self.dev), s[0].to(self.dev)
        return x.to(self.dev), inp.topk_idx[self.me].to(self.dev), inp.topk_weights[self.me].to(self.dev), scales

    def run(self, index: int, call: Call) -> None:
        getattr(self, f"_{call.kind}")(index, call)

    def _compare_dispatch(self, got: Any, want: Any) -> None:
        rows = want.src_rank >= 0  # worst case: padding rows are unspecified
        _same(got.src_rank[rows], want.src_rank[rows], "src_rank")
        _same(got.src_index[rows], want.src_index[rows], "src_index")
        _same(got.x[rows], want.x[rows], "x")
        _same(None if got.x_scales is None else got.x_scales[rows],
              None if want.x_scales is None else want.x_scales[rows], "x_scales")
        for name in ("topk_idx", "topk_weights"):
            a, b = getattr(got, name), getattr(want, name)
            _same(None if a is None else a[rows], None if b is None else b[rows], name)
        assert got.tokens_per_expert == want.tokens_per_expert, "tokens_per_expert"
        assert got.tokens_per_expert_tensor.tolist() == want.tokens_per_expert_tensor.tolist(), "tokens_per_expert_tensor"

    def _dispatch(self, index: int, call: Call) -> None:
        x, idx, w, scales = self.inputs(call)
        res = [b.dispatch(x, idx, w, x_scales=scales, expert_alignment=call.alignment, worst_case=call.worst_case,
                          async_op=call.async_op) for b in self.bufs]
        for r in res:
            if call.async_op:
                r.event.synchronize()
        self._compare_dispatch(*res)
        self.live[index] = (call, *res)
        for old in sorted(self.live)[:-4]:
            del self.live[old]

    def _cached(self, index: int, call: Call) -> None:
        _, got, want = self.live[call.source]
        x, _, _, scales = self.inputs(call)
        res = [b.dispatch(x, x_scales=scales, handle=r.handle, expert_alignment=call.alignment)
               for b, r in zip(self.bufs, (got, want))]
        self._compare_dispatch(*res)

    def _combine(self, index: int, call: Call) -> None:
        _, got, want = self.live[call.source]
        g = torch.Generator(device=self.dev).manual_seed(call.seed + self.me)
        y = (torch.randn(got.x.shape[0], SHAPE.hidden, generator=g, device=self.dev) * 64).to(torch.bfloat16)
        y[got.src_rank < 0] = float("nan")  # padding rows must not be read
        outs = []
        for b, r in zip(self.bufs, (got, want)):
            out = b.combine(y, r.handle, async_op=call.async_op)
            if call.async_op:
                out, event = out
                event.synchronize()
            outs.append(out)
        _same(outs[0], outs[1], "combine")

    def _layout(self, index: int, call: Call) -> None:
        _, idx, _, _ = self.inputs(call)
        got, want = (b.get_dispatch_layout(idx) for b in self.bufs)
        for name in ("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank"):
            _same(getattr(got, name).to(torch.int64), getattr(want, name).to(torch.int64), name)

    def _low_latency(self, index: int, call: Call) -> None:
        inp = call_inputs(call, SHAPE)
        x, idx, w = (t[self.me].to(self.dev) for t in (inp.x, inp.topk_idx, inp.topk_weights))
        res = []
        for b in self.bufs:
            d = b.low_latency_dispatch(x, idx, use_fp8=call.fp8, round_scale=call.round_scale,
                                       return_recv_hook=call.hook)
            if call.hook:
                d.hook()
            res.append(d)
        got, want = res
        _same(got.count, want.count, "low-latency count")
        g = torch.Generator(device=self.dev).manual_seed(call.seed + self.me)
        y = (torch.randn(got.x.shape, generator=g, device=self.dev) * 64).to(torch.bfloat16)
        for e, c in enumerate(got.count.tolist()):
            for name in ("src_rank", "src_index"):
                _same(getattr(got.handle, name)[e, :c], getattr(want.handle, name)[e, :c], f"expert {e} {name}")
            _same(got.x[e, :c], want.x[e, :c], f"expert {e} x")
            if call.fp8:
                _same(got.x_scales[e, :c], want.x_scales[e, :c], f"expert {e} x_scales")
            y[e, c:] = float("nan")
        outs = []
        for b, d in zip(self.bufs, res):
            out = b.low_latency_combine(y, idx, w, d.handle, return_recv_hook=call.hook)
            if call.hook:
                out.hook()
            outs.append(out.x)
        _same(outs[0], outs[1], "low-latency combine")

    def _bad(self, index: int, call: Call) -> None:
        rule = BAD_INPUTS[call.bad]
        for b in self.bufs:
            with pytest.raises(rule.error, match=rule.match):
                self._bad_call(b, call)()

    def _bad_call(self, buf: moe_ep.Buffer, call: Call) -> Callable[[], Any]:
        x, idx, w, _ = self.inputs(replace_fp8(call))
        handle = None
        if call.source in self.live:
            handle = self.live[call.source][1 if buf is self.bufs[0] else 2].handle
        store = torch.empty(x.numel() + 8, dtype=torch.bfloat16, device=self.dev)
        misaligned = store[1:1 + x.numel()].view_as(x).copy_(x)
        calls = {
            "x_dtype": lambda: buf.dispatch(x.float(), idx, w),
            "topk_dtype": lambda: buf.dispatch(x, idx.int(), w),
            "weights_dtype": lambda: buf.dispatch(x, idx, w.double()),
            "too_many_tokens": lambda: buf.dispatch(x, idx, w, worst_case=True),  # static shapes hold at most T
            "misaligned": lambda: buf.dispatch(misaligned, idx, w),
            "non_contiguous": lambda: buf.dispatch(torch.stack([x, x], dim=-1)[..., 0], idx, w),
            "event_type": lambda: buf.dispatch(x, idx, w, previous_event=object()),
            "expert_alignment": lambda: buf.dispatch(x, idx, w, expert_alignment=0),
            "scales_without_fp8": lambda: buf.dispatch(x, idx, w, x_scales=torch.ones(x.shape[0], 1, device=self.dev)),
            "fp8_without_scales": lambda: buf.dispatch(x.to(torch.float8_e4m3fn), idx, w),
            "round_scale_without_fp8": lambda: buf.low_latency_dispatch(x, idx, round_scale=True),
            "combine_rows": lambda: buf.combine(
                torch.zeros(handle.num_recv_rows + 1, SHAPE.hidden, dtype=torch.bfloat16, device=self.dev), handle),
            "cached_with_topk": lambda: buf.dispatch(x, idx, w, handle=handle),
        }
        return calls[call.bad]


def replace_fp8(call: Call) -> Call:
    """Bad calls build their own FP8 inputs where they need them."""
    return replace(call, fp8=False)


def _heap_state() -> tuple[int, int]:
    heap = moe_ep.symmetric_heap_usage()
    return (heap.reserved_bytes, heap.buffers) if heap is not None else (0, 0)


def _spent(mine: bool) -> bool:
    """Whether any rank has spent the time budget (one all-reduce: every rank stops at the same call)."""
    flag = torch.tensor([int(mine)], device=device() if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _worker(rank: int, world: int, seed: int) -> None:
    kwargs = dict(hidden=SHAPE.hidden, num_experts=SHAPE.experts, num_topk=SHAPE.topk,
                  max_tokens_per_rank=SHAPE.max_tokens, low_latency=True)
    native = moe_ep.Buffer(dist.group.WORLD, device=device(), backend="nvshmem", **kwargs)
    ref = moe_ep.Buffer(dist.group.WORLD, device=device(), backend="reference", **kwargs)
    fuzzer = PairFuzzer(native, ref)
    counts: dict[str, int] = {}
    memory = []
    start = time.monotonic()
    for part, count in enumerate((WARMUP, CALLS)):  # warm-up: allocator caches; then memory must stay put
        for index, call in enumerate(fuzz_calls(seed + part, count, world, SHAPE, bad_inputs=GPU_BAD)):
            if part and index % AGREE_EVERY == 0 and _spent(time.monotonic() - start > SECONDS):
                break
            counts[call.kind] = counts.get(call.kind, 0) + part
            try:
                fuzzer.run(index, call)
            except (Exception, pytest.fail.Exception) as e:
                raise AssertionError(f"MOE_EP_FUZZ_SEED={seed}, rank {rank}, part {part}, call {index}: {call}: "
                                     f"{type(e).__name__}: {e}") from e
        fuzzer.live.clear()
        gc.collect()
        if native.device.type == "cuda":
            torch.cuda.synchronize()
            memory.append((torch.cuda.memory_allocated(), _heap_state()))
    assert len(set(memory)) <= 1, f"memory after the warm-up {memory[0]}, after the fuzz {memory[1]}"
    if rank == 0:
        print(f"gpu fuzz seed {seed}: {sum(counts.values())} calls in {time.monotonic() - start:.0f} s {counts}, "
              f"memory {memory} before and after", flush=True)
    native.close()
    ref.close()


def test_gpu_fuzz_matches_reference() -> None:
    seed = int(os.environ.get("MOE_EP_FUZZ_SEED", random.randrange(2**31)))
    print(f"gpu fuzz seed {seed} (MOE_EP_FUZZ_SEED={seed} repeats this run)")
    run_workers(2, _worker, seed, backend="gpu", timeout_s=500)
