"""Low-latency FP8 scales in DeepEP's formats, on CPU (2 ranks, gloo, reference backend):

- the [E_l, R*T, H/128] float32 scales are token-major per expert (strides (H/128 * R*T, 1, R*T): the
  transpose of a contiguous [E_l, H/128, R*T] tensor) and dequantise to the brute-force oracle's values,
  which lie within e4m3's rounding of the input;
- use_ue8m0 gives [E_l, R*T, H/512] int32 in the same layout whose bytes, and the e4m3 rows beside them,
  equal a float64 quantiser written here from the formats' definitions (UE8M0: a biased 8-bit exponent,
  four per int32 little-endian; e4m3: 3 mantissa bits, exponent bias 7, subnormals below 2^-6, max 448);
- the DeepEP drop-in returns the same tensors, and the moe_ep Buffer refuses use_ue8m0 where it cannot hold.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import moe_ep
import moe_ep.deep_ep as deep_ep
from moe_ep.comm import fp8
from tests._dist import device, run_workers
from tests.oracle import Inputs, expected_low_latency_dispatch, make_inputs

WORLD = 2
# (seed, tokens per rank, hidden, experts, topk, routing, max_tokens_per_rank)
CASES = [(41, [13, 7], 512, 8, 4, "random", 16), (42, [0, 9], 1024, 4, 2, "skewed", 12),
         (43, [11, 11], 384, 6, 3, "one_expert", 12)]


def spread(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """x with each 128-channel block scaled by 10^u, u in [-7, 3]: the amax floor, subnormal e4m3 values
    and exponent bytes on both sides of 127 occur."""
    n, h = x.shape
    mag = 10.0 ** torch.empty(n, h // 128).uniform_(-7, 3, generator=g)
    return (x.float().view(n, h // 128, 128) * mag.unsqueeze(-1)).view(n, h).to(torch.bfloat16)


def e4m3_float64(v: torch.Tensor) -> torch.Tensor:
    """float64 values rounded to e4m3 (nearest, ties to even), saturating at +-448."""
    mag = v.abs()
    exponent = torch.floor(torch.log2(mag.clamp_min(2.0 ** -9))).clamp_min(-6)
    quantum = torch.pow(2.0, exponent - 3)
    q = torch.round(mag / quantum) * quantum  # torch.round: half to even
    return torch.sign(v) * q.clamp_max(448.0)


def reference_ue8m0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H] -> (e4m3 bytes [N, H] uint8, UE8M0 words [N, H/512] int32), in float64 from the definition:
    per 128 channels scale = 2^ceil(log2(max(amax, 1e-4) / 448)), byte = exponent + 127, values x / scale
    rounded to e4m3; int32 i holds the bytes of blocks 4i..4i+3, block 4i + j in bits 8j..8j+7."""
    n, h = x.shape
    blocks = x.double().view(n, h // 128, 128)
    amax = blocks.abs().amax(-1).clamp_min(1e-4)
    exponent = torch.ceil(torch.log2(amax / 448.0))
    values = e4m3_float64(blocks / torch.pow(2.0, exponent).unsqueeze(-1)).view(n, h)
    biased = (exponent + 127).to(torch.int64).view(n, h // 512, 4)
    words = (biased << (8 * torch.arange(4))).sum(-1)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)  # two's complement
    return values.to(torch.float32).to(torch.float8_e4m3fn).view(torch.uint8), words


def check_layout(scales: torch.Tensor, num_local: int, slots: int, per_row: int, dtype: torch.dtype) -> None:
    """DeepEP's low-latency scale layout: [E_l, R*T, per_row], token index contiguous per expert."""
    assert scales.dtype == dtype and scales.shape == (num_local, slots, per_row), (scales.dtype, scales.shape)
    assert scales.stride() == (per_row * slots, 1, slots), scales.stride()
    assert scales.transpose(1, 2).is_contiguous()


def check_dispatch(inp: Inputs, me: int, experts: int, t: int, x, scales, count, round_scale: bool,
                   ue8m0: bool) -> None:
    """Rows below count against brute force: float scales dequantise to the oracle's values (and lie within
    e4m3's rounding of the input); UE8M0 bytes and rows equal reference_ue8m0 of the source rows."""
    num_local, hidden = experts // WORLD, inp.x[me].shape[1]
    want = expected_low_latency_dispatch(inp, me, WORLD, experts, True, round_scale)
    per_row = hidden // 512 if ue8m0 else hidden // 128
    check_layout(scales, num_local, WORLD * t, per_row, torch.int32 if ue8m0 else torch.float32)
    x, scales, count = x.cpu(), scales.cpu(), count.cpu()
    for e in range(num_local):
        c = int(count[e])
        assert c == len(want.rows[e]), (e, c, len(want.rows[e]))
        if not c:
            continue
        src = torch.stack([inp.x[s][n] for s, n in want.src[e]])
        if ue8m0:
            values, words = reference_ue8m0(src)
            assert torch.equal(x[e, :c].view(torch.uint8), values), f"expert {e}: e4m3 bytes differ"
            assert torch.equal(scales[e, :c], words), f"expert {e}: UE8M0 words differ"
            continue
        got = fp8.dequantize(x[e, :c], scales[e, :c])
        oracle = fp8.dequantize(torch.stack(want.rows[e]), torch.stack(want.scales[e]))
        assert torch.equal(got.view(torch.int32), oracle.view(torch.int32)), f"expert {e}: dequantised values differ"
        s = scales[e, :c].repeat_interleave(128, dim=1)
        err = (got.double() - src.double()).abs()
        bound = torch.maximum(src.double().abs() / 16, s.double() * 2.0 ** -10) * (1 + 2.0 ** -20)  # float32 slack
        assert bool((err <= bound).all()), \
            f"expert {e}: a dequantised value is off by more than e4m3's rounding"


def _moe_ep_cases(rank: int, g: torch.Generator) -> None:
    dev = device()
    for seed, tokens, hidden, experts, topk, routing, t in CASES:
        inp = make_inputs(seed, tokens, hidden, experts, topk, routing)
        inp.x = [spread(x, g) if x.shape[0] else x for x in inp.x]  # the same generator state on both ranks
        with moe_ep.Buffer(dist.group.WORLD, hidden=hidden, num_experts=experts, num_topk=topk, max_tokens_per_rank=t,
                           low_latency=True, device=dev) as buf:
            x, idx = inp.x[rank].to(dev), inp.topk_idx[rank].to(dev)
            modes = [(False, False), (True, False)] + ([(True, True)] if hidden % 512 == 0 else [])
            for round_scale, ue8m0 in modes:
                got = buf.low_latency_dispatch(x, idx, use_fp8=True, round_scale=round_scale, use_ue8m0=ue8m0)
                check_dispatch(inp, rank, experts, t, got.x, got.x_scales, got.count, round_scale, ue8m0)
            if hidden % 512:
                with pytest.raises(ValueError, match="hidden % 512 == 0"):
                    buf.low_latency_dispatch(x, idx, use_fp8=True, round_scale=True, use_ue8m0=True)
            with pytest.raises(ValueError, match="use_ue8m0=True needs"):
                buf.low_latency_dispatch(x, idx, use_fp8=True, use_ue8m0=True)


def _drop_in_cases(rank: int, g: torch.Generator) -> None:
    dev = device()
    buf = deep_ep.Buffer(dist.group.WORLD, low_latency_mode=True, explicitly_destroy=True)
    for seed, tokens, hidden, experts, topk, routing, t in CASES:
        if hidden % 512:
            continue  # DeepEP's FP8 low-latency dispatch needs hidden % 512 == 0
        inp = make_inputs(seed, tokens, hidden, experts, topk, routing)
        inp.x = [spread(x, g) if x.shape[0] else x for x in inp.x]
        x, idx = inp.x[rank].to(dev), inp.topk_idx[rank].to(dev)
        for round_scale, ue8m0, hook in [(False, False, False), (True, False, True), (True, True, False),
                                         (True, True, True)]:
            (q, scales), count, _, _, hook_fn = buf.low_latency_dispatch(
                x, idx, t, experts, use_fp8=True, round_scale=round_scale, use_ue8m0=ue8m0, return_recv_hook=hook)
            if hook:
                hook_fn()
            check_dispatch(inp, rank, experts, t, q, scales, count, round_scale, ue8m0)
    buf.destroy()


def _worker(rank: int, world: int) -> None:
    g = torch.Generator().manual_seed(7)
    _moe_ep_cases(rank, g)
    _drop_in_cases(rank, g)


def test_low_latency_scale_formats() -> None:
    run_workers(WORLD, _worker)


def test_reference_quantiser_matches_the_definition() -> None:
    """The float64 e4m3 rounding here agrees with torch's float8_e4m3fn cast on values exact in float32."""
    g = torch.Generator().manual_seed(3)
    v = torch.randn(4096, generator=g, dtype=torch.float64) * 10.0 ** torch.empty(4096, dtype=torch.float64).uniform_(
        -4, 2.6, generator=g)
    v = v.clamp(-440.0, 440.0).float().double()  # torch's cast gives NaN past 464; e4m3_float64 saturates
    want = v.float().to(torch.float8_e4m3fn).float().double()
    assert torch.equal(e4m3_float64(v), want)
    assert math.isclose(float(e4m3_float64(torch.tensor([2.0 ** -10]))[0]), 0.0)  # half the least subnormal: to even
