"""The fixed-order row sum: out[m] = the sum of src's rows listed in slots[m], in float32, left to right,
rounded once. It undoes an expert sort (an expert-major combine, moe_ep.comm.expert_major; the experts'
backward). A Triton kernel on CUDA (Triton ships with torch there), torch code elsewhere; the torch
version computes float64 input in float64. No atomics, so the bits repeat from run to run."""
from __future__ import annotations

from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch version serves
    triton = None

_BLOCK = 1024


def use_triton(t: torch.Tensor) -> bool:
    """The Triton kernels run on CUDA tensors when Triton is importable."""
    return triton is not None and t.is_cuda


def wide(t: torch.Tensor) -> torch.Tensor:
    """t in float32, or in its own dtype when that is wider (float64 stays float64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _sum_rows_torch(src: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype,
                    weights: Optional[torch.Tensor]) -> torch.Tensor:
    acc = wide(src.new_zeros(slots.shape[0], src.shape[1]))
    if src.shape[0] == 0:
        return acc.to(dtype)
    for j in range(slots.shape[1]):
        slot = slots[:, j]
        term = src[slot.clamp_min(0)]
        if weights is not None:
            term = weights[slot.clamp_min(0)].unsqueeze(1) * term
        acc = torch.where((slot >= 0).unsqueeze(1), acc + term, acc)
    return acc.to(dtype)


if triton is not None:

    @triton.jit
    def _sum_rows_kernel(src_ptr, slots_ptr, w_ptr, out_ptr, H, K: tl.constexpr, WEIGHTED: tl.constexpr,
                         BLOCK: tl.constexpr):
        """out[row] = src[slots[row, 0]] + src[slots[row, 1]] + ... (slots < 0 skipped), float32, left to right;
        WEIGHTED: each term times w[slot] first."""
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = col < H
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):
            slot = tl.load(slots_ptr + row * K + j)
            width = tl.where(slot >= 0, H, 0)  # a missing slot reads nothing
            term = tl.load(src_ptr + slot * H + col, mask=col < width, other=0.0).to(tl.float32)
            if WEIGHTED:
                term = term * tl.load(w_ptr + slot, mask=slot >= 0, other=0.0)
            acc += term
        tl.store(out_ptr + row * H + col, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _sum_rows_triton(src: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype,
                     weights: Optional[torch.Tensor]) -> torch.Tensor:
    m, h = slots.shape[0], src.shape[1]
    if src.shape[0] == 0:
        return src.new_zeros(m, h, dtype=dtype)
    out = src.new_empty(m, h, dtype=dtype)
    if m and h:
        w = weights if weights is not None else slots  # w_ptr is not read without WEIGHTED
        _sum_rows_kernel[(m, triton.cdiv(h, _BLOCK))](src, slots, w, out, h, K=slots.shape[1],
                                                      WEIGHTED=weights is not None, BLOCK=_BLOCK, num_warps=4)
    return out


def sum_rows(src: torch.Tensor, slots: torch.Tensor, dtype: Optional[torch.dtype] = None,
             weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """src [P, H] contiguous, slots [M, K] int64 (each row's source rows, -1 where none) -> [M, H]:
    out[m] = src[slots[m, 0]] + src[slots[m, 1]] + ..., from +0.0, left to right in float32, rounded
    once to `dtype` (default src's); with weights [P] float32 each term is weights[slot] * src[slot]
    (a float32 product, then the add)."""
    dtype = dtype or src.dtype
    if use_triton(src):
        return _sum_rows_triton(src, slots, dtype, weights)
    return _sum_rows_torch(src, slots, dtype, weights)
