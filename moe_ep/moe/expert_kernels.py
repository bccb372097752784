"""The grouped experts' memory-bound passes, each one read and one write of its tensors: the SwiGLU
activation, forward and backward (the fixed-order row sum that undoes the expert sort is
moe_ep.comm.row_sum).

Triton kernels on CUDA (Triton ships with torch there); torch code elsewhere. Every sum runs in
float32 in a fixed order and every result is rounded once, so the bits repeat from run to run
(no atomics). The Triton and torch versions compute the same formulas, not the same bits; the
torch versions compute float64 inputs in float64.

Layouts: h13 [P, 2F] holds the gate (columns [0, F)) and up (columns [F, 2F)) projections of P
rows; scale [P] float32 is each row's router weight, applied to the activation
a = silu(gate) * up * scale, which is what the down projection reads.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..comm.row_sum import use_triton, wide

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch versions below serve
    triton = None


# ---- torch versions ----------------------------------------------------------------------------
def swiglu_wide(h13: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The torch versions' activation silu(gate) * up * scale in float32 (float64 for float64 input),
    not rounded: swiglu rounds it to h13's dtype, the FP8 experts quantize it (moe_ep.moe.fp8_experts)."""
    f = h13.shape[1] // 2
    g, u = wide(h13[:, :f]), wide(h13[:, f:])
    return g * torch.sigmoid(g) * u * scale.unsqueeze(1)


def _swiglu_torch(h13: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return swiglu_wide(h13, scale).to(h13.dtype)


def _swiglu_backward_torch(h13: torch.Tensor, grad_a: torch.Tensor, scale: torch.Tensor,
                           want_a: bool) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    f = h13.shape[1] // 2
    g, u, da = wide(h13[:, :f]), wide(h13[:, f:]), wide(grad_a)
    sig = torch.sigmoid(g)
    silu = g * sig
    ds = da * scale.unsqueeze(1)
    grad_h13 = torch.cat([ds * u * sig * (1 + g * (1 - sig)), ds * silu], dim=1).to(h13.dtype)
    grad_scale = (da * (silu * u)).sum(1).to(scale.dtype)
    return grad_h13, grad_scale, _swiglu_torch(h13, scale) if want_a else None


# ---- Triton kernels ------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def activation(g, u, scale):
        """sigmoid(g), silu(g) and the scaled activation, in one order for forward and recompute."""
        sig = 1.0 / (1.0 + tl.exp(-g))
        silu = g * sig
        return sig, silu, (silu * u) * scale

    @triton.jit
    def _swiglu_kernel(h_ptr, scale_ptr, a_ptr, F, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = col < F
        g = tl.load(h_ptr + row * 2 * F + col, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h_ptr + row * 2 * F + F + col, mask=mask, other=0.0).to(tl.float32)
        _sig, _silu, a = activation(g, u, tl.load(scale_ptr + row))
        tl.store(a_ptr + row * F + col, a.to(a_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_backward_kernel(h_ptr, da_ptr, scale_ptr, dh_ptr, dscale_ptr, a_ptr, F,
                                WANT_A: tl.constexpr, BLOCK: tl.constexpr):
        """One program per row: the row's F columns in BLOCK chunks, then its weight gradient."""
        row = tl.program_id(0).to(tl.int64)
        scale = tl.load(scale_ptr + row)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, F, BLOCK):
            col = start + tl.arange(0, BLOCK)
            mask = col < F
            g = tl.load(h_ptr + row * 2 * F + col, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(h_ptr + row * 2 * F + F + col, mask=mask, other=0.0).to(tl.float32)
            da = tl.load(da_ptr + row * F + col, mask=mask, other=0.0).to(tl.float32)
            sig, silu, a = activation(g, u, scale)
            acc += da * (silu * u)
            ds = da * scale
            tl.store(dh_ptr + row * 2 * F + col, (ds * u * sig * (1.0 + g * (1.0 - sig))).to(dh_ptr.dtype.element_ty),
                     mask=mask)
            tl.store(dh_ptr + row * 2 * F + F + col, (ds * silu).to(dh_ptr.dtype.element_ty), mask=mask)
            if WANT_A:
                tl.store(a_ptr + row * F + col, a.to(a_ptr.dtype.element_ty), mask=mask)
        tl.store(dscale_ptr + row, tl.sum(acc, axis=0))


_BLOCK = 1024


def _swiglu_triton(h13: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    p, f = h13.shape[0], h13.shape[1] // 2
    a = h13.new_empty(p, f)
    if p:
        _swiglu_kernel[(p, triton.cdiv(f, _BLOCK))](h13, scale, a, f, BLOCK=_BLOCK, num_warps=4)
    return a


def _swiglu_backward_triton(h13: torch.Tensor, grad_a: torch.Tensor, scale: torch.Tensor,
                            want_a: bool) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    p, f = h13.shape[0], h13.shape[1] // 2
    grad_h13, grad_scale = torch.empty_like(h13), scale.new_empty(p)
    a = h13.new_empty(p, f) if want_a else grad_h13  # a_ptr is not written without WANT_A
    if p:
        block = min(triton.next_power_of_2(f), 2048)
        _swiglu_backward_kernel[(p,)](h13, grad_a, scale, grad_h13, grad_scale, a, f, WANT_A=want_a, BLOCK=block,
                                      num_warps=8)
    return grad_h13, grad_scale, a if want_a else None


# ---- entry points ----------------------------------------------------------------------------------
def swiglu(h13: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """h13 [P, 2F] contiguous, scale [P] float32 -> a [P, F] in h13's dtype: silu(gate) * up * scale,
    computed in float32 and rounded once."""
    return _swiglu_triton(h13, scale) if use_triton(h13) else _swiglu_torch(h13, scale)


def swiglu_backward(h13: torch.Tensor, grad_a: torch.Tensor, scale: torch.Tensor, want_a: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Gradients of swiglu in one pass: (grad_h13 [P, 2F] in h13's dtype, grad_scale [P] float32,
    and with want_a the forward's activation again, the same bits as swiglu gives)."""
    if use_triton(h13):
        return _swiglu_backward_triton(h13, grad_a.contiguous(), scale, want_a)
    return _swiglu_backward_torch(h13, grad_a, scale, want_a)
