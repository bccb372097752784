"""NVFP4 low-latency dispatch (DeepEP hybrid-ep's use_nvfp4=True, as vLLM 0.33 calls it), on CPU:

- a float64 quantiser written here from the format's definition (moe_ep/comm/nvfp4.py's docstring: e4m3 block
  scale of g * amax / 6 with float32 steps, e2m1 values nearest-even saturating at 6, the sign bit kept, two per
  byte low nibble first) gives the same bytes as moe_ep.comm.nvfp4.quantize for fresh random rows: values on the
  e2m1 and e4m3 rounding boundaries, zero and -0.0 rows, magnitudes from 1e-6 to 1e3, negative values;
- the dequantised values lie within the format's error bound of the input;
- 2 ranks (gloo, reference backend) through moe_ep.Buffer and moe_ep.deep_ep.Buffer: the values and swizzled
  scales of every received row equal the float64 quantiser's of its source row (brute force over both ranks'
  inputs), in DeepEP's views with their shapes and strides, padding zero; bad inputs raise naming themselves.
"""
from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist

import moe_ep
import moe_ep.deep_ep as deep_ep
from moe_ep.comm import nvfp4
from tests._dist import device, run_workers
from tests.oracle import expected_low_latency_dispatch, make_inputs
from tests.test_low_latency_formats import e4m3_float64

WORLD = 2
GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1 magnitudes, codes 0..7
# (tokens per rank, hidden, experts, topk, routing, max_tokens_per_rank)
CASES = [([13, 7], 256, 8, 4, "random", 16), ([0, 9], 160, 4, 2, "skewed", 12), ([11, 11], 64, 6, 3, "one_expert", 70)]


def fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def f32(v: torch.Tensor) -> torch.Tensor:
    """float64 rounded to the nearest float32 (ties to even), back in float64."""
    return v.float().double()


def e2m1_float64(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 -> (e2m1 value, 4-bit code): the magnitude rounded to the e2m1 grid (quantum 0.5 below 2, 1 below 4,
    2 above; ties to even), saturating at 6; bit 3 the sign bit of v (so -0.0 -> 0x8)."""
    mag = v.abs()
    quantum = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0)).double()
    q = (torch.round(mag / quantum) * quantum).clamp_max(6.0)  # torch.round: half to even
    code = torch.zeros_like(q, dtype=torch.int64)
    for i, g in enumerate(GRID):
        code = torch.where(q == g, i, code)
    return torch.where(torch.signbit(v), -q, q), code | (torch.signbit(v).long() << 3)


def reference_nvfp4(x: torch.Tensor, g: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H] bf16 -> (values [N, H/2] uint8, scale bytes [N, H/16] uint8), per 16 channels in float64 with
    each float32 step rounded: s = f32(g * f32(amax * f32(1/6))), scale = e4m3(min(s, 448)), out = 0 if
    scale == 0 else f32(1 / f32(scale * f32(1/g))), value = e2m1(f32(x * out)); value 2i in the low nibble."""
    n, h = x.shape
    blocks = x.double().view(n, h // 16, 16)
    g64 = f32(torch.tensor(g, dtype=torch.float64))
    inv6 = f32(torch.tensor(1 / 6, dtype=torch.float64))
    s = f32(g64 * f32(blocks.abs().amax(-1) * inv6))
    scale = e4m3_float64(s.clamp_max(448.0))
    out = torch.where(scale == 0, 0.0, f32(1 / f32(scale * f32(1 / g64)))).double()
    _, code = e2m1_float64(f32(blocks * out.unsqueeze(-1)))
    code = code.view(n, h // 2, 2)
    values = (code[..., 0] | (code[..., 1] << 4)).to(torch.uint8)
    return values, scale.float().to(torch.float8_e4m3fn).view(torch.uint8)


def dequantize_float64(values: torch.Tensor, scale_bytes: torch.Tensor, g: float) -> torch.Tensor:
    """values [N, H/2] uint8 and scale bytes [N, H/16] -> float64 e2m1 * scale / g (low nibble first)."""
    table = torch.tensor(GRID + tuple(-v for v in GRID), dtype=torch.float64)
    v = table[torch.stack([values & 15, values >> 4], -1).long()].flatten(-2)
    s = scale_bytes.view(torch.float8_e4m3fn).double() / f32(torch.tensor(g, dtype=torch.float64))
    return (v.view(*v.shape[:-1], -1, 16) * s.unsqueeze(-1)).flatten(-2)


def check_bound(x: torch.Tensor, values: torch.Tensor, scale_bytes: torch.Tensor, g: float) -> None:
    """|dequantised - x| <= max(S/4, |x|/4) + amax/16 + 6 * 2^-10 / g per 16-block (S = scale / g): half an e2m1
    step, plus what saturating at 6 loses once the e4m3 scale rounded down (at most 2^-4 of it, or half its least
    subnormal). Blocks whose scale saturates (g * amax / 6 > 448: a global scale too large for them) are only
    checked to stay within +-6 * 448 / g."""
    n, h = x.shape
    got = dequantize_float64(values, scale_bytes, g).view(n, h // 16, 16)
    src = x.double().view(n, h // 16, 16)
    big_s = (scale_bytes.view(torch.float8_e4m3fn).double() / g).unsqueeze(-1)
    amax = src.abs().amax(-1, keepdim=True)
    bound = torch.maximum(big_s / 4, src.abs() / 4) + amax / 16 + 6 * 2.0 ** -10 / g
    inside = ((got - src).abs() <= bound * (1 + 1e-6) + 1e-30) | (g * amax / 6 > 448)
    assert bool(inside.all()), "a value is off by more than NVFP4's bound"
    assert bool((got.abs() <= 6 * 448 / g * (1 + 1e-9)).all())


def make_rows(n: int, h: int, g: torch.Generator) -> torch.Tensor:
    """Fresh bf16 rows [n, h]: per 16-block magnitudes 10^u (u in [-6, 3]), both signs; some rows all zero or
    -0.0, some blocks of e2m1 ties (x exactly on a midpoint when the scale is 1: g = 1 and amax = 6), some with
    amax on an e4m3 midpoint times 6, some with a single nonzero value."""
    x = torch.randn(n, h, generator=g, dtype=torch.float64)
    x *= (10.0 ** torch.empty(n, h // 16, dtype=torch.float64).uniform_(-6, 3, generator=g)).repeat_interleave(16, 1)
    ties = torch.tensor([6.0, 0.25, -0.75, 1.25, -1.75, 2.5, -3.5, 5.0, -0.25, 0.75, 7.0, -6.5, 0.125, 3.0, -5.0, 1.0],
                        dtype=torch.float64)
    kinds = torch.randint(0, 6, (n,), generator=g)
    for r in range(n):
        kind = int(kinds[r])
        if kind == 0:
            x[r] = 0.0
        elif kind == 1:
            x[r] = -0.0
        elif kind == 2:  # every block a shuffled copy of the ties
            for b in range(h // 16):
                x[r, b * 16:(b + 1) * 16] = ties[torch.randperm(16, generator=g)]
        elif kind == 3:  # amax / 6 on an e4m3 midpoint (1.0625 = (1 + 1.125) / 2) times a power of two
            x[r, ::16] = 6 * 1.0625 * 2.0 ** float(torch.randint(-8, 4, (1,), generator=g))
        elif kind == 4:
            x[r] = 0.0
            x[r, int(torch.randint(0, h, (1,), generator=g))] = -3.0
    return x.to(torch.bfloat16)


def test_quantiser_matches_the_definition() -> None:
    """moe_ep's quantiser and the float64 one agree byte for byte; dequantised values within the bound."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    x = make_rows(64, 256, g)
    amax = float(x.float().abs().max())
    for scale in (1.0, 448 * 6 / amax, 0.37, 2.0 ** -3, 448 * 6 / amax * 1e-3):
        got = nvfp4.quantize(x, torch.tensor(scale, dtype=torch.float32))
        g32 = float(torch.tensor(scale, dtype=torch.float32))
        values, scales = reference_nvfp4(x, g32)
        assert got.values.dtype == torch.uint8 and got.values.shape == (64, 128), (seed, got.values.shape)
        assert got.scales.dtype == torch.float8_e4m3fn and got.scales.shape == (64, 16), (seed, got.scales.shape)
        assert torch.equal(got.values, values), f"seed {seed}, g {scale}: e2m1 bytes differ"
        assert torch.equal(got.scales.view(torch.uint8), scales), f"seed {seed}, g {scale}: e4m3 scale bytes differ"
        check_bound(x, values, scales, g32)
        deq = nvfp4.dequantize(got.values, got.scales, torch.tensor([scale], dtype=torch.float32))
        assert torch.allclose(deq.double(), dequantize_float64(values, scales, g32), rtol=2.0 ** -22, atol=1e-37)


def test_e2m1_rounding_points() -> None:
    """Each midpoint rounds to its even neighbour, values above 6 saturate, the sign bit survives 0 (-0.0 and
    negative underflow -> 0x8); the same through moe_ep's quantiser with g = 1 and amax 6 (scale 1, x unscaled),
    and amax 6.375 (s = 1.0625, an e4m3 tie, rounds to the even 1.0: 6.375 saturates to 6)."""
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, 1e9, -0.0, -0.2, 0.2, -5.0, 5.5], dtype=torch.float64)
    assert e2m1_float64(v)[1].tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 7, 8, 8, 0, 14, 7]
    x = torch.zeros(2, 16, dtype=torch.bfloat16)
    x[0] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0, -0.2, 0.2, -5.0, 5.5, 6.0, 0, 0, -1.0])
    x[1, :3] = torch.tensor([6.375, -6.375, 1.0])
    got = nvfp4.quantize(x, torch.tensor(1.0))
    codes = torch.stack([got.values & 15, got.values >> 4], -1).flatten(1).tolist()
    assert codes[0] == [0, 2, 2, 4, 4, 6, 6, 8, 8, 0, 14, 7, 7, 0, 0, 10]
    assert codes[1][:3] == [7, 15, 2] and got.scales.float().tolist() == [[1.0], [1.0]]


def test_non_finite_values() -> None:
    """NaN: ignored by the block's amax (as __hmax2 is), its own nibble +6 (0x7); inf: the scale saturates at 448,
    the value at 6 with its sign; a block of NaN only: scale NaN (0x7F), every nibble 0x7."""
    x = torch.zeros(3, 16, dtype=torch.bfloat16)
    x[0, :3] = torch.tensor([math.nan, 6.0, -3.0])
    x[1, :2] = torch.tensor([-math.inf, 1.0])
    x[2] = math.nan
    got = nvfp4.quantize(x, torch.tensor(1.0))
    codes = torch.stack([got.values & 15, got.values >> 4], -1).flatten(1)
    assert codes[0, :3].tolist() == [7, 7, 13] and got.scales.float()[0].tolist() == [1.0]
    assert codes[1, :2].tolist() == [15, 0] and got.scales.float()[1].tolist() == [448.0]
    assert (codes[2] == 7).all() and got.scales.view(torch.uint8)[2].tolist() == [0x7F]


def test_layout_swizzle_round_trip() -> None:
    """NvFp4Layout.swizzle places row t's scale j at [l, t // 128, j // 4, t % 32, (t % 128) // 32, j % 4] and
    unswizzle inverts it; DeepEP's views have DeepEP's shapes."""
    layout = nvfp4.NvFp4Layout(3, 130, 112)  # rm 2, rk 2: padded rows and scales
    linear = torch.randint(1, 120, (3, 130, 7), dtype=torch.uint8).view(torch.float8_e4m3fn)
    storage = layout.swizzle(linear)
    assert storage.shape == (3, 2, 2, 32, 4, 4) and storage.is_contiguous()
    raw = storage.view(torch.uint8)
    for l, t, j in [(0, 0, 0), (1, 129, 6), (2, 37, 5), (0, 127, 3)]:
        assert raw[l, t // 128, j // 4, t % 32, (t % 128) // 32, j % 4] == linear.view(torch.uint8)[l, t, j]
    assert int(raw.sum()) == int(linear.view(torch.uint8).long().sum())  # the rest is zero padding
    assert torch.equal(layout.unswizzle(storage).view(torch.uint8), linear.view(torch.uint8))
    view = layout.scales_view(storage)
    assert view.shape == (32, 4, 2, 4, 2, 3)
    assert torch.equal(layout.scales_storage(view).view(torch.uint8), raw)


def check_received(inp, me: int, experts: int, t: int, hidden: int, scales_per_rank: list[float], x, scales,
                   count, seed: int) -> None:
    """DeepEP's views (shapes, strides, dtypes), and every expert's rows below count equal to the float64
    quantiser's of their source rows (with the source rank's global scale), padding zero."""
    e_l, slots = experts // WORLD, WORLD * t
    rm, rk, s = -(-slots // 128), -(-(hidden // 16) // 4), hidden // 16
    assert x.dtype == torch.uint8 and x.shape == (slots, hidden // 2, e_l), x.shape
    assert x.stride() == (hidden // 2, 1, slots * hidden // 2), x.stride()
    assert scales.dtype == torch.float8_e4m3fn and scales.shape == (32, 4, rm, 4, rk, e_l), scales.shape
    assert scales.stride() == (16, 4, rk * 512, 1, 512, rm * rk * 512), scales.stride()
    want = expected_low_latency_dispatch(inp, me, WORLD, experts, False, False)
    x, scales, count = x.cpu(), scales.cpu().view(torch.uint8), count.cpu()
    rows_t = torch.arange(rm * 128)
    for e in range(e_l):
        c = int(count[e])
        assert c == len(want.src[e]), (seed, e, c, len(want.src[e]))
        got_v = x[:, :, e]
        got_s = torch.empty(rm * 128, rk * 4, dtype=torch.uint8)  # row t's scales, read by the layout's formula
        for j in range(rk * 4):
            got_s[:, j] = scales[rows_t % 32, (rows_t % 128) // 32, rows_t // 128, j % 4, j // 4, e]
        assert not got_v[c:].any() and not got_s[c:].any() and not got_s[:, s:].any(), \
            f"seed {seed}, expert {e}: padding or rows past count not zero"
        for i, (src, n) in enumerate(want.src[e]):
            values, sbytes = reference_nvfp4(inp.x[src][n : n + 1], scales_per_rank[src])
            assert torch.equal(got_v[i], values[0]), f"seed {seed}, expert {e} row {i}: e2m1 bytes differ"
            assert torch.equal(got_s[i, :s], sbytes[0]), f"seed {seed}, expert {e} row {i}: scale bytes differ"
            check_bound(inp.x[src][n : n + 1], values, sbytes, scales_per_rank[src])


def _global_scales(inp, rank_scale: str) -> list[float]:
    """Each rank's float32 global scale: DeepEP's test recipe (448 * 6 / amax over every rank's rows, one value),
    a fixed 1.0 (scale 1 where amax is 6: the ties stay ties), or a different value per rank."""
    if rank_scale == "amax":
        amax = max(float(x.float().abs().max()) if x.numel() else 0.0 for x in inp.x) or 1.0
        return [float(torch.tensor(448 * 6 / amax, dtype=torch.float32))] * WORLD
    if rank_scale == "one":
        return [1.0] * WORLD
    return [float(torch.tensor(v, dtype=torch.float32)) for v in (0.37, 5.5)]


def _bad_inputs(buf: moe_ep.Buffer, x: torch.Tensor, idx: torch.Tensor, hidden: int) -> None:
    """Every rank passes the same bad argument, so every rank raises its own error (after taking part)."""
    dev, one = x.device, torch.ones((), device=x.device)
    cases = [
        (dict(use_nvfp4=True), ValueError, "use_nvfp4=True needs x_global_scale"),
        (dict(use_nvfp4=True, use_fp8=True, x_global_scale=one), ValueError,
         "exclude each other" if hidden % 128 == 0 else "FP8 needs hidden to be a multiple of 128"),
        (dict(x_global_scale=one), ValueError, "x_global_scale applies only with use_nvfp4=True"),
        (dict(use_nvfp4=True, x_global_scale=1.0), TypeError, "x_global_scale must be a torch.Tensor"),
        (dict(use_nvfp4=True, x_global_scale=one.double()), TypeError, "x_global_scale must have dtype torch.float32"),
        (dict(use_nvfp4=True, x_global_scale=torch.ones(2, 2, device=dev)), ValueError, r"shape \[\] or \[k\]"),
        (dict(use_nvfp4=True, x_global_scale=torch.ones(0, device=dev)), ValueError, r"shape \[\] or \[k\]"),
        (dict(use_nvfp4=True, x_global_scale=torch.tensor([1.0, 2.0], device=dev)), ValueError, "every element equal"),
        (dict(use_nvfp4=True, x_global_scale=-one), ValueError, "finite positive"),
        (dict(use_nvfp4=True, x_global_scale=one * math.inf), ValueError, "finite positive"),
        (dict(use_nvfp4=True, round_scale=True, x_global_scale=one), ValueError, "round_scale applies only"),
    ]
    for kwargs, kind, message in cases:
        with pytest.raises(kind, match=message):
            buf.low_latency_dispatch(x, idx, **kwargs)
    with pytest.raises(TypeError, match="x must have dtype torch.bfloat16"):
        buf.low_latency_dispatch(x.float(), idx, use_nvfp4=True, x_global_scale=one)


def _moe_ep_cases(rank: int, seed: int) -> None:
    dev = device()
    g = torch.Generator().manual_seed(seed)
    for case, (tokens, hidden, experts, topk, routing, t) in enumerate(CASES):
        inp = make_inputs(seed + case, tokens, hidden, experts, topk, routing)
        inp.x = [make_rows(n, hidden, g) for n in tokens]  # the same generator state on both ranks
        with moe_ep.Buffer(dist.group.WORLD, hidden=hidden, num_experts=experts, num_topk=topk, max_tokens_per_rank=t,
                           low_latency=True, backend="reference", device=dev) as buf:
            x, idx = inp.x[rank].to(dev), inp.topk_idx[rank].to(dev)
            for rank_scale, shape, hook in [("amax", (), False), ("one", (1,), True),
                                            ("per_rank", (experts // 2,), False)]:
                scales = _global_scales(inp, rank_scale)
                gs = torch.full(shape, scales[rank], dtype=torch.float32, device=dev)
                got = buf.low_latency_dispatch(x, idx, use_nvfp4=True, x_global_scale=gs, return_recv_hook=hook)
                if hook:
                    got.hook()
                check_received(inp, rank, experts, t, hidden, scales, got.x, got.x_scales, got.count, seed)
            _bad_inputs(buf, x, idx, hidden)
    with moe_ep.Buffer(dist.group.WORLD, hidden=40, num_experts=4, num_topk=2, max_tokens_per_rank=4,
                       low_latency=True, backend="reference", device=dev) as buf:
        x, idx = torch.zeros(2, 40, dtype=torch.bfloat16, device=dev), torch.zeros(2, 2, dtype=torch.int64, device=dev)
        one = torch.ones((), device=dev)
        with pytest.raises(ValueError, match="hidden % 16 == 0"):
            buf.low_latency_dispatch(x, idx, use_nvfp4=True, x_global_scale=one)
        # a backend without NVFP4 (the native one today) refuses it at once, before any communication
        buf.backend.serves_nvfp4 = False
        with pytest.raises(NotImplementedError, match="use_nvfp4=True is not implemented .*do not have NVFP4 yet"):
            buf.low_latency_dispatch(x, idx, use_nvfp4=True, x_global_scale=one)
        del buf.backend.serves_nvfp4
        buf.low_latency_dispatch(x, idx)  # the ranks are still in step


def _drop_in_cases(rank: int, seed: int) -> None:
    """moe_ep.deep_ep.Buffer.low_latency_dispatch as vLLM's DeepEPLLPrepareAndFinalize calls it."""
    dev = device()
    g = torch.Generator().manual_seed(seed + 100)
    buf = deep_ep.Buffer(dist.group.WORLD, low_latency_mode=True, explicitly_destroy=True)
    for case, (tokens, hidden, experts, topk, routing, t) in enumerate(CASES):
        inp = make_inputs(seed + 10 + case, tokens, hidden, experts, topk, routing)
        inp.x = [make_rows(n, hidden, g) for n in tokens]
        x, idx = inp.x[rank].to(dev), inp.topk_idx[rank].to(dev)
        scales = _global_scales(inp, "amax")
        gs = torch.full((experts // WORLD,), scales[rank], dtype=torch.float32, device=dev)  # vLLM's a1_gscale
        for hook in (True, False):
            (q, sf), count, handle, _, hook_fn = buf.low_latency_dispatch(
                x, idx, t, experts, use_fp8=False, round_scale=False, use_ue8m0=False, use_nvfp4=True,
                x_global_scale=gs, async_finish=False, return_recv_hook=hook)
            if hook:
                hook_fn()
            check_received(inp, rank, experts, t, hidden, scales, q, sf, count, seed)
            assert q.permute(2, 0, 1).is_contiguous()  # vLLM's x[0].permute(2, 0, 1)
        # DeepEP ignores x_global_scale without use_nvfp4: the bf16 dispatch still runs
        recv, _, _, _, _ = buf.low_latency_dispatch(x, idx, t, experts, use_fp8=False, x_global_scale=gs)
        assert recv.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="use_nvfp4=True needs use_fp8=False"):
        buf.low_latency_dispatch(x, idx, t, experts, use_nvfp4=True, x_global_scale=gs)
    with pytest.raises(NotImplementedError, match="use_ue8m0_for_sf"):
        buf.low_latency_dispatch(x, idx, t, experts, use_fp8=False, use_nvfp4=True, x_global_scale=gs,
                                 use_ue8m0_for_sf=True)
    buf.destroy()


def _worker(rank: int, world: int, seed: int) -> None:
    _moe_ep_cases(rank, seed)
    _drop_in_cases(rank, seed)


def test_nvfp4_low_latency_dispatch() -> None:
    run_workers(WORLD, _worker, fresh_seed())
