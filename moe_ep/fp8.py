"""FP8 (e4m3) quantisation with one float32 scale per token per 128 channels, as docs/api.md defines it
(amax over 128 channels floored at 1e-4, scale = amax / 448, or the next power of two with round_scale)."""
from __future__ import annotations

import torch

FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
BLOCK = 128


def quantize(x: torch.Tensor, round_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H] (H % 128 == 0) -> (e4m3 [N, H], float32 scales [N, H / 128]).

    scale = max(amax, 1e-4) / 448, or with round_scale the smallest power of two >= that (exact via
    frexp, so every backend gets the same bits); values are x / scale rounded to nearest e4m3.
    """
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


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of quantize up to rounding: e4m3 [..., H] and scales [..., H / 128] -> float32."""
    shape = q.shape
    blocks = q.float().view(*shape[:-1], shape[-1] // BLOCK, BLOCK)
    return (blocks * scales.unsqueeze(-1)).view(shape)
