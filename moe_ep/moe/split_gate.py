"""The router's float32 gate on bf16 tensor cores: logits = x W^T for bf16 tokens x [N, H] and a float32 gate
weight W [E, H], as one bf16 GEMM against W split three ways (W = hi + mid + lo, each bf16; what is left is
below 2^-26 |W|) with float32 accumulation and output, instead of a float32 GEMM on the CUDA cores over
x.float() (~0.2 ms of a 4096 x 7168 x 128 forward on an H100, docs/benchmarks.md). Products of bf16 numbers
are exact in float32, so the logits have float32 GEMM's accuracy, not its bits; the bits repeat from run to run.

Backward, from float32 dlogits g [N, E]: dW = g^T x with g split three ways (one GEMM, float32 out, the same
accuracy as the forward); dx = g W from the two leading parts of each (hi.hi + hi.mid + mid.hi, one GEMM over
the three products stacked along its reduction dimension, rounded once to bf16): its relative error, ~2^-16,
lies far below dx's own bf16 rounding.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

PARTS = 3  # bf16 parts of a float32 operand


def split(t: torch.Tensor, parts: int = PARTS) -> torch.Tensor:
    """float32 t as [parts, *t.shape] bf16, each part t minus the earlier ones rounded to nearest: their sum is
    t to within 2^-(8 parts + 2) |t| (the subtractions are exact in float32)."""
    out, rest = [], t.float()
    for _ in range(parts):
        part = rest.to(torch.bfloat16)
        out.append(part)
        rest = rest - part.float()
    return torch.stack(out)


def _mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b for bf16 a and b, summed in float32, as out_dtype: cuBLAS on CUDA; elsewhere (tests) the same
    products in float32 (exact: bf16 x bf16 fits float32's 24 bits)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=out_dtype) if out_dtype != a.dtype else torch.mm(a, b)
    return torch.mm(a.float(), b.float()).to(out_dtype)


def _sum_parts(stacked: torch.Tensor, dim: int) -> torch.Tensor:
    """The PARTS results stacked along `dim` (hi's first) added smallest first: (lo + mid) + hi."""
    chunks = stacked.chunk(PARTS, dim)
    total = chunks[-1]
    for chunk in reversed(chunks[:-1]):
        total = total + chunk
    return total


def available(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether gate_logits serves this call: bf16 tokens and a plain float32 weight (no tensor subclass such as
    a DTensor) on a CUDA device, outside torch.compile (which traces the plain float32 linear instead)."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2 and weight.dtype == torch.float32
            and type(weight.detach()) is torch.Tensor and not torch.compiler.is_compiling())


class SplitGate(torch.autograd.Function):
    """logits = x W^T (float32) from x [N, H] bf16, W [E, H] float32 and W_parts = split(W) [3, E, H] bf16."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, weight_parts: torch.Tensor) -> torch.Tensor:
        e, h = weight.shape
        ctx.save_for_backward(x, weight_parts)
        return _sum_parts(_mm(x, weight_parts.view(PARTS * e, h).t(), torch.float32), dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], None]:
        x, w = ctx.saved_tensors
        e = w.shape[1]
        g = split(grad.contiguous())  # [3, N, E]
        dx = dw = None
        if ctx.needs_input_grad[0]:
            a = torch.cat([g[0], g[0], g[1]], dim=1)  # [N, 3E]: hi.hi + hi.mid + mid.hi along the reduction
            b = torch.cat([w[0], w[1], w[0]])  # [3E, H]
            dx = _mm(a, b, x.dtype)
        if ctx.needs_input_grad[1]:
            dw = _sum_parts(_mm(g.transpose(1, 2).reshape(PARTS * e, -1), x, torch.float32), dim=0)
        return dx, dw, None


class GateWeightParts:
    """split(W) of one gate weight, made again only when W changes (its storage or its version counter: optimizer
    steps and load_state_dict bump it), as moe_ep.moe.fp8_experts.FP8WeightCache keeps the experts' FP8 copy. A
    CUDA graph being captured gets a split of its own, so each replay reads W as it then is."""

    def __init__(self) -> None:
        self._key: Optional[tuple] = None
        self._parts: Optional[torch.Tensor] = None

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return split(weight.detach())
        key = (weight.data_ptr(), weight._version, weight.device)
        if self._parts is None or key != self._key:
            with torch.no_grad():
                self._parts = split(weight.detach())
            self._key = key
        return self._parts


def gate_logits(x: torch.Tensor, weight: torch.Tensor, parts: GateWeightParts) -> torch.Tensor:
    """float32 logits x W^T through SplitGate (callers check `available` first)."""
    return SplitGate.apply(x, weight, parts(weight))
