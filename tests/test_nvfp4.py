"""NVFP4 low-latency dispatch (DeepEP hybrid-ep's use_nvfp4=True, as vLLM 0.33 calls it).

On CPU:
- a float64 quantiser written here from the format's definition (moe_ep/comm/nvfp4.py's docstring: e4m3 block
  scale of g * amax / 6 with float32 steps, e2m1 values nearest-even saturating at 6, the sign bit kept, two per
  byte low nibble first, NaN rules) gives the same bytes as moe_ep.comm.nvfp4.quantize for fresh random rows:
  values on the e2m1 and e4m3 rounding boundaries, zero and -0.0 rows, magnitudes from 1e-6 to 1e3, negative
  values; and for a g that is not finite and positive, the bytes the docstring promises;
- the dequantised values lie within the format's error bound of the input;
- the native dispatch kernel's per-block cast, run on the host (the same source), gives the float64 quantiser's
  bytes for every bf16 bit pattern and rows with special values, for every kind of g;
- 2 ranks (gloo, reference backend) through moe_ep.Buffer and moe_ep.deep_ep.Buffer: the values and swizzled
  scales of every received row equal the float64 quantiser's of its source row (brute force over both ranks'
  inputs), in DeepEP's views with their shapes and strides, padding zero; bad inputs raise naming themselves.
On GPUs (skipped without one): the native backend against the reference backend, bit for bit (the last section).
"""
from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist

import moe_ep
import moe_ep.deep_ep as deep_ep
from moe_ep.comm import _native, nvfp4
from tests._dist import device, requires_gpus, run_workers
from tests.oracle import expected_low_latency_dispatch, make_inputs, random_topk
from tests.test_gpu_low_latency import _busy
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
    2 above; ties to even), saturating at 6; bit 3 the sign bit of v (so -0.0 -> 0x8); NaN -> code 7."""
    mag = v.abs()
    quantum = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0)).double()
    q = (torch.round(mag / quantum) * quantum).clamp_max(6.0)  # torch.round: half to even
    code = torch.zeros_like(q, dtype=torch.int64)
    for i, g in enumerate(GRID):
        code = torch.where(q == g, i, code)
    code = torch.where(torch.isnan(v), 7, code | (torch.signbit(v).long() << 3))
    return torch.where(torch.signbit(v), -q, q), code


def pack_codes(code: torch.Tensor) -> torch.Tensor:
    """4-bit codes [N, H] -> bytes [N, H/2], code 2i in the low nibble of byte i."""
    pairs = code.reshape(code.shape[0], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)


def reference_nvfp4(x: torch.Tensor, g: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H] bf16 and a finite positive float32 g -> (values [N, H/2] uint8, scale bytes [N, H/16] uint8), per
    16 channels in float64 with each float32 step rounded: amax ignoring NaN (NaN where all are),
    s = f32(g * f32(amax * f32(1/6))), scale = e4m3(min(s, 448)) (a NaN s: 0x7F), out = 0 if scale == 0 else
    f32(1 / f32(scale * f32(1/g))), value = e2m1(f32(x * out))."""
    n, h = x.shape
    blocks = x.double().view(n, h // 16, 16)
    g64 = f32(torch.tensor(g, dtype=torch.float64))
    inv6 = f32(torch.tensor(1 / 6, dtype=torch.float64))
    mag = blocks.abs()
    amax = torch.where(mag.isnan().all(-1), math.nan, mag.nan_to_num(nan=0.0, posinf=math.inf).amax(-1))
    s = f32(g64 * f32(amax * inv6))
    scale = e4m3_float64(s.clamp_max(448.0))
    out = torch.where(scale == 0, 0.0, f32(1 / f32(scale * f32(1 / g64)))).double()
    _, code = e2m1_float64(f32(blocks * out.unsqueeze(-1)))
    scale_bytes = scale.float().to(torch.float8_e4m3fn).view(torch.uint8)
    return pack_codes(code.view(n, h)), torch.where(s.isnan(), 0x7F, scale_bytes).to(torch.uint8)


def special_nvfp4(x: torch.Tensor, g: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The bytes moe_ep/comm/nvfp4.py's docstring gives for a float32 g that is not finite and positive, built
    from its rules (on top of reference_nvfp4 for |g|): NaN -> scales 0x7F, values 0x7; g < 0 -> the scales of
    |g| with the sign bit set (0x7F stays), the values of |g|; g = +-0 -> scales +-0 and values +-0 by x's
    sign; g = +-inf -> scales +-448 and values +-6 by x's sign. A block whose g * amax is NaN (+-0 with an inf,
    +-inf with amax 0, or every value NaN) stores 0x7F and values 0x7; a NaN x, or a zero x with g = +-inf, 0x7."""
    n, h = x.shape
    blocks = x.double().view(n, h // 16, 16)
    nan_x, sign = blocks.isnan(), torch.signbit(blocks).long() << 3
    mag = blocks.abs().nan_to_num(nan=-1.0, posinf=math.inf)
    amax = mag.amax(-1)  # -1: every value NaN
    negative = math.copysign(1.0, g) < 0
    if math.isnan(g):
        return torch.full((n, h // 2), 0x77, dtype=torch.uint8), torch.full((n, h // 16), 0x7F, dtype=torch.uint8)
    if math.isfinite(g) and g != 0:
        values, scales = reference_nvfp4(x, -g)
        return values, torch.where(scales == 0x7F, scales, scales | 0x80)
    if g == 0:
        bad_block = (amax == math.inf) | (amax < 0)
        scale = 0x80 if negative else 0x00
        code = torch.where(nan_x, 7, sign)
    else:
        bad_block = amax <= 0
        scale = 0xFE if negative else 0x7E
        code = torch.where(nan_x | (blocks == 0), 7, 7 | sign)
    code = torch.where(bad_block.unsqueeze(-1), 7, code)
    scales = torch.where(bad_block, 0x7F, scale).to(torch.uint8)
    return pack_codes(code.view(n, h)), scales


def expected_nvfp4(x: torch.Tensor, g: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle's bytes for any float32 g."""
    return reference_nvfp4(x, g) if math.isfinite(g) and g > 0 else special_nvfp4(x, g)


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


# bf16 bit patterns of special values: quiet NaN, signalling NaN, negative NaN, +inf, -inf, -0.0, subnormals, the
# least normal, the largest finite
SPECIAL_BF16 = (0x7FC0, 0x7F81, 0xFFC1, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x8003, 0x0080, 0x7F7F)


def special_rows(n: int, h: int, g: torch.Generator) -> torch.Tensor:
    """make_rows with special values: in every row four random channels set to SPECIAL_BF16 patterns; then (where
    the rows exist) row 0's first block NaN only, row 1's second block one inf among zeros, row 2's last block
    1e30 times the rest of the data (its scale saturates at 448 for a g fitted to the rest)."""
    x = make_rows(n, h, g).view(torch.int16).clone()
    patterns = torch.tensor(SPECIAL_BF16, dtype=torch.int32).to(torch.int16)
    for r in range(n):
        cols = torch.randint(0, h, (4,), generator=g)
        x[r, cols] = patterns[torch.randint(0, len(SPECIAL_BF16), (4,), generator=g)]
    x = x.view(torch.bfloat16)
    if n > 0:
        x[0, :16] = math.nan
    if n > 1:
        x[1, 16:32] = 0.0
        x[1, 16 + int(torch.randint(0, 16, (1,), generator=g))] = -math.inf
    if n > 2:
        x[2, -16:] = (torch.randn(16, generator=g) * 1e30).to(torch.bfloat16)
    return x


def test_global_scale_not_finite_positive() -> None:
    """moe_ep's quantiser gives the bytes its docstring promises for g = +-0, g < 0, +-inf and NaN (the test's
    special_nvfp4, on top of the float64 quantiser for |g|), on rows with special values."""
    seed = fresh_seed()
    x = special_rows(48, 128, torch.Generator().manual_seed(seed))
    for g in (0.0, -0.0, -0.37, -1e30, math.inf, -math.inf, math.nan):
        got = nvfp4.quantize(x, torch.tensor(g, dtype=torch.float32))
        g32 = float(torch.tensor(g, dtype=torch.float32))
        values, scales = special_nvfp4(x, g32)
        assert torch.equal(got.values, values), f"seed {seed}, g {g}: e2m1 bytes differ"
        assert torch.equal(got.scales.view(torch.uint8), scales), f"seed {seed}, g {g}: e4m3 scale bytes differ"
    got = nvfp4.quantize(x, torch.tensor(math.nan))
    assert (got.values == 0x77).all() and (got.scales.view(torch.uint8) == 0x7F).all()


def native_cast(x: torch.Tensor, g: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The dispatch kernel's NVFP4 cast (csrc/kernels/low_latency/nvfp4.cuh) run on the host by moe_ep.comm._C."""
    n, h = x.shape
    values = torch.full((n, h // 2), 0xAB, dtype=torch.uint8)
    scales = torch.full((n, h // 16), 0xAB, dtype=torch.uint8)
    _native.load().ll_nvfp4_cast_host(x=x.contiguous().data_ptr(), num_rows=n, hidden=h, global_scale=g,
                                      values=values.data_ptr(), scales=scales.data_ptr())
    return values, scales


@pytest.mark.skipif(not _native.available()[0], reason=f"moe_ep.comm._C unavailable: {_native.available()[1]}")
def test_native_cast_matches_the_definition() -> None:
    """The native kernel's per-block arithmetic, run on the host (the same source: __fmul_rn / __frcp_rn become
    IEEE * and /, cuda_fp8.h's and cuda_fp4.h's conversions their host emulation, which sm_90 runs for e2m1
    too), gives the float64 quantiser's bytes, for g finite and positive, and the docstring's otherwise: on
    every bf16 bit pattern (in order and shuffled) and on fresh rows with special values. The device's own
    bytes are the GPU test's (test_native_matches_the_reference_backend)."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = torch.cat([every.view(-1, 256), every[torch.randperm(1 << 16, generator=gen)].view(-1, 256),
                   special_rows(64, 256, gen)])
    amax = float(x.float().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).abs().max())
    for g in (1.0, 0.37, 5.5, 448 * 6 / 3.0, 448 * 6 / amax, 1e-30, 1e30, 3e38, 1e-40, 2.0 ** -126, 0.0, -0.0,
              -1.5, math.inf, -math.inf, math.nan):
        g32 = float(torch.tensor(g, dtype=torch.float32))
        values, scales = native_cast(x, g32)
        want_values, want_scales = expected_nvfp4(x, g32)
        assert torch.equal(values, want_values), f"seed {seed}, g {g32}: e2m1 bytes differ"
        assert torch.equal(scales, want_scales), f"seed {seed}, g {g32}: e4m3 scale bytes differ"
        got = nvfp4.quantize(x, torch.tensor(g32))
        assert torch.equal(got.values, values) and torch.equal(got.scales.view(torch.uint8), scales), (seed, g32)


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
            g = scales_per_rank[src]
            values, sbytes = expected_nvfp4(inp.x[src][n : n + 1], g)
            assert torch.equal(got_v[i], values[0]), f"seed {seed}, g {g}, expert {e} row {i}: e2m1 bytes differ"
            assert torch.equal(got_s[i, :s], sbytes[0]), f"seed {seed}, g {g}, expert {e} row {i}: scale bytes differ"
            if math.isfinite(g) and g > 0:
                check_bound(inp.x[src][n : n + 1], values, sbytes, g)


def _global_scales(inp, rank_scale: str) -> list[float]:
    """Each rank's float32 global scale: DeepEP's test recipe (448 * 6 / amax over every rank's rows, one value),
    a fixed 1.0 (scale 1 where amax is 6: the ties stay ties), a different value per rank, or values that are not
    finite and positive (never checked: they give the docstring's bytes)."""
    if rank_scale == "amax":
        amax = max(float(x.float().abs().max()) if x.numel() else 0.0 for x in inp.x) or 1.0
        return [float(torch.tensor(448 * 6 / amax, dtype=torch.float32))] * WORLD
    if rank_scale == "one":
        return [1.0] * WORLD
    if rank_scale == "not_positive":
        return [-0.37, 0.0]
    if rank_scale == "not_finite":
        return [math.inf, math.nan]
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
                                            ("per_rank", (experts // 2,), False), ("not_positive", (2,), True),
                                            ("not_finite", (), False)]:
                scales = _global_scales(inp, rank_scale)
                gs = torch.full(shape, scales[rank], dtype=torch.float32, device=dev)
                gs.view(-1)[1:] = 2.0  # only the first element counts (DeepEP's kernel reads it), the rest unchecked
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


# ---- GPU: the native kernels' NVFP4 dispatch against the reference backend ----------------------------------
# (hidden, experts, topk, max_tokens_per_rank): the decode hidden size (448 scales per row); H = 2064, whose 129
# scales leave 3 zero columns in the last scale tile and whose H/2 value bytes are a multiple of 8, not 16; a small
# H. No R * T is a multiple of 128, so the last row tile always has padding rows.
GPU_SHAPES = [(7168, 16, 8, 40), (2064, 8, 4, 72), (144, 12, 3, 33)]
GPU_ITERS = 8
GRAPH_REPLAYS = 12
SPECIAL_G = (0.0, -0.37, math.inf, math.nan, -0.0, -math.inf)


def _scale_rows(view: torch.Tensor) -> torch.Tensor:
    """DeepEP's (32, 4, rm, 4, rk, E_l) scale view -> [E_l, rm * 128, rk * 4] uint8, row t's scale j read by the
    layout's formula (row t at [t % 32, (t % 128) // 32, t // 128], scale j at [j % 4, j // 4]), padding included."""
    _, _, rm, _, rk, _ = view.shape
    t = torch.arange(rm * 128, device=view.device).unsqueeze(1)
    j = torch.arange(rk * 4, device=view.device).unsqueeze(0)
    return view.view(torch.uint8)[t % 32, (t % 128) // 32, t // 128, j % 4, j // 4].permute(2, 0, 1)


def _same_rows(x: torch.Tensor, x_scales: torch.Tensor, count: torch.Tensor, want, hidden: int,
               what: str) -> torch.Tensor:
    """Counts, and per expert the rows below count (values, scales with their padding columns) and the last row
    tile's padding rows equal the reference's bitwise, in DeepEP's views; the padding is zero. Returns the
    [E_l, R * T] mask of rows below count."""
    assert torch.equal(count, want.count), f"{what}: count {count.tolist()} != {want.count.tolist()}"
    slots = x.shape[0]
    valid = torch.arange(slots, device=count.device) < want.count.unsqueeze(1)
    assert x.shape == want.x.shape and x.stride() == want.x.stride() and x.dtype == want.x.dtype, what
    assert torch.equal(x.permute(2, 0, 1)[valid], want.x.permute(2, 0, 1)[valid]), f"{what}: e2m1 bytes differ"
    assert x_scales.shape == want.x_scales.shape and x_scales.stride() == want.x_scales.stride(), what
    assert x_scales.dtype == want.x_scales.dtype, what
    scales, want_scales = _scale_rows(x_scales), _scale_rows(want.x_scales)
    compared = torch.cat([valid, torch.ones_like(valid[:, :1]).expand(-1, scales.shape[1] - slots)], dim=1)
    assert torch.equal(scales[compared], want_scales[compared]), f"{what}: scale bytes differ"
    padding = scales[:, slots:].any() or scales[:, :slots][valid][:, hidden // 16:].any()
    assert not padding, f"{what}: padding not zero"
    return valid


def _same_nvfp4(got, want, hidden: int, what: str) -> None:
    """_same_rows, and the source rank and index of every row below count."""
    valid = _same_rows(got.x, got.x_scales, got.count, want, hidden, what)
    assert torch.equal(got.handle.src_rank[valid], want.handle.src_rank[valid]), f"{what}: src_rank differs"
    assert torch.equal(got.handle.src_index[valid], want.handle.src_index[valid]), f"{what}: src_index differs"


def _poison_nvfp4(res) -> None:
    """Overwrite a native result (values, every byte of the scale tiles, source info, counts), so anything a later
    call into the same output set leaves unwritten cannot pass."""
    res.x.fill_(0xFF)
    res.x_scales.view(torch.uint8).fill_(0xFF)
    res.handle.src_rank.fill_(-7)
    res.handle.src_index.fill_(-7)
    res.count.fill_(-7)


def _draw_g(rank: int, it: int, local: torch.Generator) -> float:
    """This rank's float32 global scale for iteration `it`: 10^u (u in [-2, 3], so some blocks saturate at 448 and
    some underflow to scale 0), different on every rank; every fourth iteration rank 0 passes one that is not
    finite and positive (SPECIAL_G in turn)."""
    if it % 4 == 3 and rank == 0:
        return SPECIAL_G[(it // 4) % len(SPECIAL_G)]
    return float(torch.tensor(10.0 ** float(torch.empty(1).uniform_(-2, 3, generator=local)), dtype=torch.float32))


def _global_scale(g: float, shape: tuple[int, ...]) -> torch.Tensor:
    """x_global_scale holding g first; any further elements differ (only the first is read)."""
    gs = torch.full(shape, g, dtype=torch.float32, device="cuda")
    gs.view(-1)[1:] = 7.0
    return gs


def _gpu_cases(nat, ref, shape, rank: int, world: int, seed: int, what: str) -> None:
    """GPU_ITERS NVFP4 dispatches (tokens per rank t, 0 or random; hook on every other one; x_global_scale [], [1]
    or [E_l]) on outputs poisoned before the call, each against the reference and followed by a combine."""
    hidden, experts, k, t = shape
    e_l = experts // world
    shared = torch.Generator().manual_seed(seed)  # the same draws on every rank
    local = torch.Generator().manual_seed(seed * 7919 + rank)
    local_cuda = torch.Generator(device="cuda").manual_seed(seed * 7919 + rank)
    for _ in range(2):  # both output sets poisoned before the first checked call
        x = special_rows(t, hidden, local).cuda()
        idx = random_topk("random", t, experts, k, local_cuda)
        _poison_nvfp4(nat.low_latency_dispatch(x, idx, use_nvfp4=True, x_global_scale=_global_scale(1.0, ())))
    for it in range(GPU_ITERS):
        pick = int(torch.randint(0, 3, (1,), generator=shared))
        n = [t, 0, int(torch.randint(1, t + 1, (1,), generator=local))][(pick + rank) % 3]
        routing = ["random", "skewed", "one_expert", "random"][it % 4]
        x = special_rows(n, hidden, local).cuda()
        idx = random_topk(routing, n, experts, k, local_cuda)
        w = torch.rand(n, k, generator=local_cuda, device="cuda")
        g = _draw_g(rank, it, local)
        gs = _global_scale(g, [(), (1,), (e_l,)][it % 3])
        hook = it % 2 == 1
        case = f"{what} it={it} n={n} routing={routing} g={g} hook={hook}"
        got = nat.low_latency_dispatch(x, idx, use_nvfp4=True, x_global_scale=gs, return_recv_hook=hook)
        if hook:
            assert got.hook is not None
            _busy()
            got.hook()
        want = ref.low_latency_dispatch(x, idx, use_nvfp4=True, x_global_scale=gs)
        _same_nvfp4(got, want, hidden, case)
        y = (torch.randn(e_l, world * t, hidden, generator=local_cuda, device="cuda") * 3).to(torch.bfloat16)
        back = nat.low_latency_combine(y, idx, w, got.handle, return_recv_hook=hook)
        if hook:
            back.hook()
        want_back = ref.low_latency_combine(y, idx, w, want.handle)
        assert torch.equal(back.x.view(torch.int16), want_back.x.view(torch.int16)), f"{case}: combine differs"
        _poison_nvfp4(got)


def _graph_case(nat, ref, shape, rank: int, world: int, seed: int, what: str) -> None:
    """An NVFP4 dispatch and a combine captured in one CUDA graph; each replay gets fresh rows, routing, weights,
    expert outputs and a fresh global scale copied into the captured tensors (the kernel reads g on the device)."""
    hidden, experts, k, t = shape
    e_l = experts // world
    n = t - rank
    local = torch.Generator().manual_seed(seed * 104729 + rank)
    local_cuda = torch.Generator(device="cuda").manual_seed(seed * 104729 + rank)
    x_s = torch.empty(n, hidden, dtype=torch.bfloat16, device="cuda")
    idx_s = torch.empty(n, k, dtype=torch.int64, device="cuda")
    w_s = torch.empty(n, k, dtype=torch.float32, device="cuda")
    y_s = torch.empty(e_l, world * t, hidden, dtype=torch.bfloat16, device="cuda")
    g_s = torch.empty(e_l, dtype=torch.float32, device="cuda")

    def fill(i: int) -> None:
        x_s.copy_(special_rows(n, hidden, local))
        idx_s.copy_(random_topk(["random", "skewed", "one_expert"][i % 3], n, experts, k, local_cuda))
        w_s.copy_(torch.rand(n, k, generator=local_cuda, device="cuda"))
        y_s.copy_((torch.randn(y_s.shape, generator=local_cuda, device="cuda") * 3).to(torch.bfloat16))
        g_s.copy_(_global_scale(_draw_g(rank, i, local), (e_l,)))

    fill(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        disp = nat.low_latency_dispatch(x_s, idx_s, use_nvfp4=True, x_global_scale=g_s)
        comb = nat.low_latency_combine(y_s, idx_s, w_s, disp.handle)
    for i in range(GRAPH_REPLAYS):
        _poison_nvfp4(disp)
        fill(i)
        graph.replay()
        case = f"{what} graph replay {i} g={float(g_s[0])}"
        want = ref.low_latency_dispatch(x_s, idx_s, use_nvfp4=True, x_global_scale=g_s)
        _same_nvfp4(disp, want, hidden, case)
        want_back = ref.low_latency_combine(y_s, idx_s, w_s, want.handle).x
        assert torch.equal(comb.x.view(torch.int16), want_back.view(torch.int16)), f"{case}: combine differs"
    del graph


def _drop_in_case(rank: int, world: int, topo: dict, shape, seed: int, what: str) -> None:
    """One NVFP4 call through moe_ep.deep_ep.Buffer on the native backend, as vLLM makes it, against the
    reference Buffer."""
    hidden, experts, k, t = shape
    local = torch.Generator().manual_seed(seed * 31 + rank)
    x = special_rows(t, hidden, local).cuda()
    idx = random_topk("random", t, experts, k, torch.Generator(device="cuda").manual_seed(seed * 31 + rank))
    gs = _global_scale(_draw_g(rank, 0, local), (experts // world,))
    buf = deep_ep.Buffer(dist.group.WORLD, low_latency_mode=True, explicitly_destroy=True, backend="nvshmem", **topo)
    with moe_ep.Buffer(dist.group.WORLD, device=device(), backend="reference", hidden=hidden, num_experts=experts,
                       num_topk=k, max_tokens_per_rank=t, low_latency=True, **topo) as ref:
        (q, sf), count, _, _, _ = buf.low_latency_dispatch(x, idx, t, experts, use_fp8=False, use_nvfp4=True,
                                                           x_global_scale=gs)
        want = ref.low_latency_dispatch(x, idx, use_nvfp4=True, x_global_scale=gs)
        _same_rows(q, sf, count, want, hidden, f"{what} deep_ep drop-in")
        assert q.permute(2, 0, 1).is_contiguous()  # vLLM's x[0].permute(2, 0, 1)
        torch.cuda.synchronize()
    buf.destroy()


def _gpu_worker(rank: int, world: int, topos: list[dict], seed: int) -> None:
    for topo in topos:
        for shape in GPU_SHAPES:
            hidden, experts, k, t = shape
            what = f"seed {seed} world {world} {topo or 'one node'} shape {shape}"
            kwargs = dict(hidden=hidden, num_experts=experts, num_topk=k, max_tokens_per_rank=t, low_latency=True,
                          **topo)
            with moe_ep.Buffer(dist.group.WORLD, device=device(), backend="nvshmem", **kwargs) as nat, \
                    moe_ep.Buffer(dist.group.WORLD, device=device(), backend="reference", **kwargs) as ref:
                assert nat.backend_name == "nvshmem"
                _gpu_cases(nat, ref, shape, rank, world, seed, what)
                if shape != GPU_SHAPES[2]:
                    _graph_case(nat, ref, shape, rank, world, seed, what)
                torch.cuda.synchronize()
        _drop_in_case(rank, world, topo, GPU_SHAPES[1], seed, f"seed {seed} world {world} {topo or 'one node'}")


@requires_gpus()
@pytest.mark.parametrize("world, topos", [(2, [{}, {"ranks_per_node": 1}]), (4, [{}, {"ranks_per_node": 2}])],
                         ids=["EP2", "EP4"])
def test_native_matches_the_reference_backend(world: int, topos: list[dict]) -> None:
    """The native low-latency dispatch with use_nvfp4 against the reference backend, bitwise (values, swizzled
    scales with their padding, counts, source info; the combine that follows), at EP2 and EP4, each as one node
    (NVLink stores) and as two nodes (ranks_per_node: every byte between the halves by NVSHMEM puts and signals),
    on GPU_SHAPES, with and without the receive hook, in a CUDA graph, with rows holding special values and
    per-rank global scales (some not finite and positive). Ranks share the GPUs present (tests/_dist.py)."""
    run_workers(world, _gpu_worker, topos, fresh_seed(), backend="gpu", timeout_s=600)
