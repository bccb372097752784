"""The router's float32 gate on bf16 tensor cores: logits = x W^T for bf16 tokens x [N, H] and a float32 gate
weight W [E, H], as one bf16 GEMM against W split three ways (W = hi + mid + lo, each bf16, their sum exactly W)
with float32 accumulation and output, instead of a float32 GEMM on the CUDA cores over x.float(). On one H100 at
4096 x 7168 -> 128 (session 26): 54 us against 254 us. Products of bf16 numbers are exact in float32; what is
lost is the tensor cores' float32 accumulation: the logits were within 6.9e-5 of the exact products (float64)
where the float32 GEMM's were within 6.6e-6, both far inside a float32 sum's error bound (K 2^-24 of sum |x w|)
and ~100x closer than bf16 logits. The bits repeat from run to run.

The backward is the float32 linear's own (dx = g W rounded once to x's dtype, dW = g^T x in float32): its
split form measured slower (845 against 688 us forward + backward).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

PARTS = 3  # bf16 parts of a float32 operand


def split(t: torch.Tensor) -> torch.Tensor:
    """float32 t as [3, *t.shape] bf16, each part what the earlier ones left of t, rounded to nearest: their sum is
    exactly t (3 x 8 significant bits cover float32's 24; the subtractions are exact in float32)."""
    out, rest = [], t.float()
    for _ in range(PARTS):
        part = rest.to(torch.bfloat16)
        out.append(part)
        rest = rest - part.float()
    return torch.stack(out)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for bf16 a and b, summed in float32, as float32: cuBLAS on CUDA; elsewhere (tests) the same
    products in float32 (exact: bf16 x bf16 fits float32's 24 bits)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def _sum_parts(stacked: torch.Tensor) -> torch.Tensor:
    """[N, 3E] (the products with hi, mid, lo side by side) -> [N, E], added smallest first: (lo + mid) + hi."""
    hi, mid, lo = stacked.chunk(PARTS, 1)
    return (lo + mid) + hi


def available(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether gate_logits serves this call: bf16 tokens and a float32 weight on a CUDA device (eager or compiled:
    both must give the same bits)."""
    return x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2 and weight.dtype == torch.float32


class SplitGate(torch.autograd.Function):
    """logits = x W^T (float32) from x [N, H] bf16, W [E, H] float32 and W_parts = split(W) [3, E, H] bf16."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, weight_parts: torch.Tensor) -> torch.Tensor:
        e, h = weight.shape
        ctx.save_for_backward(x, weight)
        return _sum_parts(_mm(x, weight_parts.view(PARTS * e, h).t()))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], None]:
        x, weight = ctx.saved_tensors
        dx = torch.mm(grad, weight).to(x.dtype) if ctx.needs_input_grad[0] else None
        dw = torch.mm(grad.t(), x.float()) if ctx.needs_input_grad[1] else None
        return dx, dw, None


class GateWeightParts:
    """split(W) of one gate weight, made again only when W changes (its storage or its version counter: optimizer
    steps and load_state_dict bump it), as moe_ep.moe.fp8_experts.FP8WeightCache keeps the experts' FP8 copy. Code
    that torch.compile traces or a CUDA graph captures splits W itself (a cache keyed on storage and version cannot
    be traced, and each replay must read W as it then is); the bits are the same."""

    def __init__(self) -> None:
        self._key: Optional[tuple] = None
        self._parts: Optional[torch.Tensor] = None

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            return split(weight.detach())
        key = (weight.data_ptr(), weight._version, weight.device)
        if key != self._key:
            self._parts, self._key = split(weight.detach()), key
        return self._parts


def gate_logits(x: torch.Tensor, weight: torch.Tensor, parts: GateWeightParts) -> torch.Tensor:
    """float32 logits x W^T through SplitGate (callers check `available` first)."""
    return SplitGate.apply(x, weight, parts(weight))
