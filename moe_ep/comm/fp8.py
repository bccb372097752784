"""FP8 (e4m3) quantisation with one float32 scale per token per 128 channels, as docs/api.md defines it
(amax over 128 channels floored at 1e-4, scale = amax / 448, or the next power of two with round_scale)."""
from __future__ import annotations

import torch

from .row_sum import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch version serves
    triton = None

FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
BLOCK = 128


def quantize(x: torch.Tensor, round_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H] (H % 128 == 0) -> (e4m3 [N, H], float32 scales [N, H / 128]).

    scale = max(amax, 1e-4) / 448, or with round_scale the smallest power of two >= that (exact via
    frexp, so every backend gets the same bits); values are x / scale rounded to nearest e4m3.
    On CUDA without round_scale one Triton pass (_quantize_kernel), else torch ops; the same bits.
    """
    if use_triton(x) and not round_scale:
        return _quantize_triton(x.contiguous())
    return _quantize_torch(x, round_scale)


def _quantize_torch(x: torch.Tensor, round_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize in torch ops (float32 blocks, true divisions)."""
    n, h = x.shape
    blocks = x.float().view(n, h // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1).clamp_min(AMAX_FLOOR)
    # Divide by a tensor: a true float32 division on CPU and CUDA alike (CUDA turns division by a
    # Python scalar into a multiply by its rounded reciprocal, which can differ by one ulp).
    scale = amax / torch.full_like(amax, FP8_MAX)
    if round_scale:
        mantissa, exponent = torch.frexp(scale)
        scale = torch.where(mantissa == 0.5, scale, torch.ldexp(torch.ones_like(scale), exponent))
    q = (blocks / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).view(n, h)
    return q, scale.contiguous()


if triton is not None:

    @triton.jit
    def quantize_blocks(a):
        """a [R, 128] float32 -> (a / scale, scale [R]) with quantize's scale: amax floored at 1e-4,
        / 448; both divisions true (IEEE-rounded: div_rn; tl.fdiv measured one ulp off on an H200)
        ones, as the torch version's are. Shared by every Triton kernel that writes FP8 rows (this
        module's, moe_ep.moe.fp8_experts')."""
        amax = tl.maximum(tl.max(tl.abs(a), axis=1), 1e-4)
        s = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
        return tl.math.div_rn(a, s[:, None]), s

    @triton.jit
    def row_block(N, BR: tl.constexpr):
        """The tile of a program of a (row blocks, 128-column blocks) grid over N rows: (its column block, the
        block's columns, which of its BR rows exist, their indices as int64)."""
        row = tl.program_id(0) * BR + tl.arange(0, BR)
        blk = tl.program_id(1)
        return blk, blk * 128 + tl.arange(0, 128), row < N, row.to(tl.int64)

    @triton.jit
    def _quantize_kernel(x_ptr, q_ptr, s_ptr, N, H, BR: tl.constexpr):
        """BR rows x one 128-column block of x: read once, written once as e4m3 (nearest even) and
        one scale per row."""
        blk, col, ok, r64 = row_block(N, BR)
        x = tl.load(x_ptr + r64[:, None] * H + col[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        q, s = quantize_blocks(x)
        tl.store(q_ptr + r64[:, None] * H + col[None, :], q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
                 mask=ok[:, None])
        tl.store(s_ptr + r64 * (H // 128) + blk, s, mask=ok)


def _quantize_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize (no round_scale) in _quantize_kernel; x contiguous."""
    n, h = x.shape
    q = torch.empty(n, h, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(n, h // BLOCK, dtype=torch.float32, device=x.device)
    if n:
        rows = 16
        _quantize_kernel[(triton.cdiv(n, rows), h // BLOCK)](x, q, s, n, h, BR=rows, num_warps=4)
    return q, s


def expert_major_scales(num_experts: int, slots: int, num_scales: int, dtype: torch.dtype,
                        device: torch.device) -> torch.Tensor:
    """An empty [E_l, slots, num_scales] scale tensor stored token-major per expert (DeepEP's
    low-latency layout, which DeepGEMM's masked grouped GEMM reads through TMA): the transposed view
    of a contiguous [E_l, num_scales, slots] tensor, strides (num_scales * slots, 1, slots)."""
    return torch.empty(num_experts, num_scales, slots, dtype=dtype, device=device).transpose(1, 2)


def pack_ue8m0(scales: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales [..., S] (S % 4 == 0, round_scale) -> UE8M0 [..., S / 4] int32:
    each scale's biased exponent byte (bits 23..30; exact, no mantissa bits), four to an int32,
    scale 4i + j in byte j (little-endian) of int32 i. Any strides in, a contiguous tensor out."""
    exponents = (scales.contiguous().view(torch.int32) >> 23).to(torch.uint8)
    return exponents.view(torch.int32)


def dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of quantize up to rounding: e4m3 [..., H] and scales [..., H / 128] -> `dtype` (float32 products,
    rounded once to `dtype` when narrower). On CUDA, 2-d contiguous rows to bf16: one Triton pass
    (_dequantize_kernel), the same bits."""
    if dtype == torch.bfloat16 and q.dim() == 2 and q.is_contiguous() and scales.is_contiguous() and use_triton(q):
        return _dequantize_triton(q, scales)
    shape = q.shape
    blocks = q.float().view(*shape[:-1], shape[-1] // BLOCK, BLOCK)
    return (blocks * scales.unsqueeze(-1)).view(shape).to(dtype)


if triton is not None:

    @triton.jit
    def _dequantize_kernel(q_ptr, s_ptr, out_ptr, N, H, BR: tl.constexpr):
        """BR rows x one 128-column block: e4m3 times its float32 scale in float32, rounded to bf16 (nearest even)."""
        blk, col, ok, r64 = row_block(N, BR)
        q = tl.load(q_ptr + r64[:, None] * H + col[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        s = tl.load(s_ptr + r64 * (H // 128) + blk, mask=ok, other=0.0)
        tl.store(out_ptr + r64[:, None] * H + col[None, :], (q * s[:, None]).to(tl.bfloat16, fp_downcast_rounding="rtne"),
                 mask=ok[:, None])


def _dequantize_triton(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """dequantize to bf16 in _dequantize_kernel; q and scales contiguous."""
    n, h = q.shape
    out = torch.empty(n, h, dtype=torch.bfloat16, device=q.device)
    if n:
        rows = 16
        _dequantize_kernel[(triton.cdiv(n, rows), h // BLOCK)](q, scales, out, n, h, BR=rows, num_warps=4)
    return out
