"""NVFP4 rows as DeepEP's low-latency dispatch returns them with use_nvfp4=True (docs/api.md, docs/deep_ep_compat.md).

The format (DeepEP's hybrid-ep branch, csrc/kernels/internode_ll.cu cvt_warp_fp16_to_fp4, and csrc/deep_ep.cpp
Buffer::low_latency_dispatch; vLLM 0.33 passes it to FlashInfer's CuteDSL masked grouped GEMM):

- every 16 consecutive channels of a bf16 row form a block with one float8_e4m3fn scale; the values are
  e2m1 (sign, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6), two per byte, the block's
  even channel in the low nibble;
- one float32 global scale g for the whole call (x_global_scale; vLLM passes 1 / the layer's static input
  scale, DeepEP's own test 448 * 6 / amax(x)); a value dequantises as e2m1 * float(scale) / g;
- the recipe, in float32 with round-to-nearest-even at every step (DeepEP takes its reciprocals with
  rcp.approx.ftz, within one ulp of these; moe_ep takes them correctly rounded so that every backend
  gets the same bits; the native kernel runs csrc/kernels/low_latency/nvfp4.cuh):
      amax      = max |x| over the block
      s         = g * (amax * (1 / 6))
      scale     = e4m3(s), nearest even, saturating at +-448 with the sign kept  (the stored byte;
                  cuda_fp8.h's satfinite conversion); a NaN s stores 0x7F
      out_scale = 0 if scale == 0 else 1 / (scale * (1 / g))
      value     = e2m1(x * out_scale), nearest even, saturating at 6; the sign bit is the product's
                  (so -0.0 and negative values that round to 0 give the nibble 0x8); NaN gives 0x7
  (amax ignores NaN values, as the kernel's __hmax2 does; an inf saturates the scale at 448)
- g is read on the device and never checked (a check would cost a host sync). A g that is not finite and
  positive gives no usable rows, but the same bytes on every backend, as the recipe above makes them:
  g = +-0 stores scales +-0 and values +-0 by x's sign; g < 0 the scales of |g| with their sign bit set
  and the values of |g|; g = +-inf scales +-448 and values +-6 by x's sign; g = NaN scale 0x7F and values
  0x7. Where g * amax is NaN (g = +-0 and an inf in the block, g = +-inf and a zero block) the block's
  scale is 0x7F and its values 0x7; a NaN product x * out_scale (x NaN, or x zero with g = +-inf) is 0x7.
- the receive layout per local expert is CUTLASS's 128x4 scale-factor tile: values [E_l, R*T, H/2] uint8
  returned as the (R*T, H/2, E_l) view, scales (E_l, rm, rk, 32, 4, 4) e4m3 returned as the
  (32, 4, rm, 4, rk, E_l) view, rm = ceil(R*T / 128), rk = ceil(H / 64): row t's scale j sits at
  [l, t // 128, j // 4, t % 32, (t % 128) // 32, j % 4]. Padding (rows past R*T, scales past H/16) is zero.

The block size, e2m1's maximum and the tile's shape belong to the native kernels
(csrc/kernels/low_latency/low_latency.h kNvfp4*, with the byte offset of row t's scale j,
nvfp4_scale_offset); `constants()` reads them from moe_ep.comm._C, or _native's equal fallbacks where _C
is not built.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import _native
from .fp8 import FP8_MAX

# e2m1 magnitudes by code (bits 0..2); bit 3 is the sign
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# the midpoints between neighbouring magnitudes: a tie goes to the even code
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@dataclass(frozen=True)
class NvFp4Constants:
    """The format's constants shared with the native kernels (low_latency.h)."""

    block: int  # channels per e4m3 scale (kNvfp4Block)
    e2m1_max: int  # e2m1's largest magnitude: a block's scale maps its amax to it (kNvfp4E2m1Max)
    tile_rows: int  # rows of one scale tile (kNvfp4TileRows), in groups of tile_group_rows
    tile_group_rows: int  # row t is row t % 32 of group (t % 128) // 32 (kNvfp4TileGroupRows)
    tile_scales: int  # scales of one row in one tile (kNvfp4TileScales)


@functools.cache
def constants() -> NvFp4Constants:
    """The constants from moe_ep.comm._C where it loads, else _native's fallbacks (tests/test_native.py
    checks that they are equal); read once per process, as _native loads _C once."""
    return NvFp4Constants(_native.constant("NVFP4_BLOCK"), _native.constant("NVFP4_E2M1_MAX"),
                          _native.constant("NVFP4_TILE_ROWS"), _native.constant("NVFP4_TILE_GROUP_ROWS"),
                          _native.constant("NVFP4_TILE_SCALES"))


@dataclass
class NvFp4Rows:
    """Rows in NVFP4, row-major: values [N, H/2] uint8 (block channel 2i in the low nibble of byte i) and
    scales [N, H/16] float8_e4m3fn, one per 16 channels; they dequantise with the call's global scale."""

    values: torch.Tensor
    scales: torch.Tensor


@dataclass(frozen=True)
class NvFp4Layout:
    """DeepEP's low-latency NVFP4 receive layout for E_l local experts of `slots` (R * T) rows of `hidden`
    channels; see the module docstring."""

    num_experts: int
    slots: int
    hidden: int

    @property
    def num_scales(self) -> int:
        return self.hidden // constants().block

    @property
    def row_tiles(self) -> int:
        """rm: 128-row tiles per expert."""
        return -(-self.slots // constants().tile_rows)

    @property
    def scale_tiles(self) -> int:
        """rk: 4-scale tile columns per row."""
        return -(-self.num_scales // constants().tile_scales)

    def _tiles_shape(self) -> tuple[int, int, int, int, int, int]:
        """The scales' storage shape (E_l, rm, rk, 32, 4, 4): per tile, the row in its group, the group,
        the scale."""
        c = constants()
        return (self.num_experts, self.row_tiles, self.scale_tiles, c.tile_group_rows,
                c.tile_rows // c.tile_group_rows, c.tile_scales)

    def empty_values(self, device: torch.device) -> torch.Tensor:
        """Zeroed values in their storage order, [E_l, R*T, H/2] uint8 (values_view gives DeepEP's view)."""
        return torch.zeros(self.num_experts, self.slots, self.hidden // 2, dtype=torch.uint8, device=device)

    def empty_scales(self, device: torch.device) -> torch.Tensor:
        """Zeroed scales in their storage order, (E_l, rm, rk, 32, 4, 4) float8_e4m3fn (scales_view gives
        DeepEP's view)."""
        return torch.zeros(self._tiles_shape(), dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)

    @staticmethod
    def values_view(values: torch.Tensor) -> torch.Tensor:
        """[E_l, R*T, H/2] storage -> DeepEP's (R*T, H/2, E_l) view (CuteDSL's (m, k, l)); permute(2, 0, 1)
        gives the storage back, as vLLM does."""
        return values.permute(1, 2, 0)

    @staticmethod
    def scales_view(scales: torch.Tensor) -> torch.Tensor:
        """(E_l, rm, rk, 32, 4, 4) storage -> DeepEP's (32, 4, rm, 4, rk, E_l) view (CuteDSL's MMA scale view)."""
        return scales.permute(3, 4, 1, 5, 2, 0)

    def swizzle(self, linear: torch.Tensor) -> torch.Tensor:
        """Row-major scales [E_l, R*T, H/16] -> the (E_l, rm, rk, 32, 4, 4) storage, padding zero."""
        e, rm, rk, lanes, groups, scales = self._tiles_shape()
        padded = torch.zeros(e, rm * lanes * groups, rk * scales, dtype=torch.uint8, device=linear.device)
        padded[:, : self.slots, : self.num_scales] = linear.view(torch.uint8)
        tiles = padded.view(e, rm, groups, lanes, rk, scales)
        return tiles.permute(0, 1, 4, 3, 2, 5).contiguous().view(torch.float8_e4m3fn)

    @staticmethod
    def scales_storage(view: torch.Tensor) -> torch.Tensor:
        """DeepEP's (32, 4, rm, 4, rk, E_l) view -> the (E_l, rm, rk, 32, 4, 4) storage (what vLLM's and
        DeepEP's tests unpermute)."""
        return view.permute(5, 2, 4, 0, 1, 3)

    def unswizzle(self, scales: torch.Tensor) -> torch.Tensor:
        """The inverse of swizzle: the (E_l, rm, rk, 32, 4, 4) storage -> row-major [E_l, R*T, H/16] e4m3."""
        e, rm, rk, lanes, groups, per_tile = self._tiles_shape()
        rows = scales.view(torch.uint8).permute(0, 1, 4, 3, 2, 5).reshape(e, rm * groups * lanes, rk * per_tile)
        return rows[:, : self.slots, : self.num_scales].contiguous().view(torch.float8_e4m3fn)


def _f32_reciprocal(t: torch.Tensor) -> torch.Tensor:
    """1 / t, correctly rounded to float32 (a true division by a tensor, on CPU and CUDA alike)."""
    return torch.ones_like(t) / t


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """float32 -> e2m1 codes (uint8, 0..15) as cvt.rn.satfinite.e2m1x2.f32 converts (CUDA's cuda_fp4.hpp
    emulates it): the magnitude's nearest code, a tie to the even code, above 6 saturating at 6 (code 7);
    bit 3 the sign bit of v, zero included; NaN gives +6 (0x7)."""
    mag = v.abs()
    mids = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=v.device)
    code = torch.bucketize(mag, mids)  # the midpoints strictly below mag
    at_tie = mids[code.clamp_max(len(_MIDPOINTS) - 1)] == mag
    code = code + (at_tie & (code % 2 == 1)).long()  # a tie between codes c and c + 1 goes to the even one
    nan = torch.isnan(v)
    code = torch.where(nan, 7, code | (torch.signbit(v).long() << 3))
    return code.to(torch.uint8)


def quantize(x: torch.Tensor, global_scale: torch.Tensor) -> NvFp4Rows:
    """x [N, H] (H % 16 == 0, read as float32) and a float32 global scale (its first element is used, as
    DeepEP's kernel does) -> NvFp4Rows, by the module docstring's recipe."""
    n, h = x.shape
    c = constants()
    g = global_scale.reshape(-1)[:1].to(device=x.device, dtype=torch.float32)
    blocks = x.float().view(n, h // c.block, c.block)
    # NaN-ignoring, as __hmax2 is (NaN only where every value of the block is NaN)
    mag = blocks.abs()
    nan = torch.isnan(mag)
    amax = torch.where(nan.all(dim=-1), torch.nan, mag.masked_fill(nan, 0).amax(dim=-1))
    inv6 = _f32_reciprocal(torch.full_like(g, float(c.e2m1_max)))
    s = g * (amax * inv6)
    # satfinite, as __nv_fp8_e4m3(float) rounds (torch's cast would make |s| > 464 NaN); NaN as 0x7F
    s = torch.where(torch.isnan(s), torch.full_like(s, torch.nan), s.clamp(-FP8_MAX, FP8_MAX))
    scale = s.to(torch.float8_e4m3fn)
    stored = scale.float()
    out_scale = torch.where(stored == 0, torch.zeros_like(stored), _f32_reciprocal(stored * _f32_reciprocal(g)))
    codes = _e2m1_codes(blocks * out_scale.unsqueeze(-1)).view(n, h // 2, 2)
    return NvFp4Rows((codes[..., 0] | (codes[..., 1] << 4)).contiguous(), scale.contiguous())


def unpack(values: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 [..., H/2] uint8 -> float32 [..., H] (the low nibble first)."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=values.device)
    nibbles = torch.stack([values & 0xF, values >> 4], dim=-1).long()
    return table[nibbles].flatten(-2)


def dequantize(values: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Row-major values [..., H/2] and scales [..., H/16] -> float32 [..., H]: e2m1 * float(scale) / g
    (float32, one division per block), the inverse of quantize up to its rounding."""
    g = global_scale.reshape(-1)[:1].to(device=values.device, dtype=torch.float32)
    v = unpack(values)
    block = scales.float() / g
    return (v.view(*v.shape[:-1], -1, constants().block) * block.unsqueeze(-1)).flatten(-2)
