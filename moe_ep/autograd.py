"""Dispatch and combine as autograd functions; each one's backward is the other.

- dispatch(x, topk_idx, topk_weights): backward of the received rows is a combine of their
  gradient (a token's gradient is the sum of the gradients of its copies); backward of the received
  weights is a combine too (each (token, k) weight has exactly one receiving rank, see below).
- combine(y, handle): backward is a cached dispatch of the output gradient through the same handle
  (`Buffer.dispatch(grad, handle=handle)`): every row gets the gradient of the token it fed.

Communication is bf16, as the Buffer requires, so gradients that cross ranks are rounded to bf16
once per crossing. Both backwards are collective: every rank of the Buffer's group runs them, in
the same order, which autograd guarantees when every rank runs the same model.

Weight gradients: the gradient of the received weight w[m, k] is nonzero only on the rank that
owns expert topk_idx[m, k], and the Buffer's combine sums a token's rows over ranks in float32,
starting from +0.0, rounding to bf16 once. A float32 value split into three bf16 terms
(hi + mid + lo, 8 significant bits each) therefore survives a combine exactly: each term is added
to zeros only. The terms of all K weights are packed into the first 3K columns of [M, H] rows (more
combines when 3K > H).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .buffer import Buffer
from .types import DispatchHandle

SPLIT_TERMS = 3  # bf16 terms that carry a float32 value exactly (3 x 8 significant bits)


@dataclass
class Dispatched:
    """Rows this rank received, with autograd connected back to the sources."""

    x: torch.Tensor  # [M, H] bf16
    topk_idx: torch.Tensor  # [M, K] int64 local expert ids, -1 where the expert is elsewhere
    topk_weights: torch.Tensor  # [M, K] float32, 0 where topk_idx is -1
    tokens_per_expert: list[int]  # [E_l] received rows per local expert
    handle: DispatchHandle


def _split_bf16(v: torch.Tensor) -> torch.Tensor:
    """float32 [...] -> bf16 [..., 3] whose float32 sum is v (each rounding error is exact in float32)."""
    terms, rest = [], v.float()
    for _ in range(SPLIT_TERMS):
        t = rest.to(torch.bfloat16)
        terms.append(t)
        rest = rest - t.float()
    return torch.stack(terms, dim=-1)


def _combine_values(buffer: Buffer, handle: DispatchHandle, values: torch.Tensor) -> torch.Tensor:
    """Sum float32 values [M, C] back to their source tokens [N, C], exactly, when each value is
    nonzero on at most one of the ranks that received its token."""
    m, c = values.shape
    hidden = buffer.cfg.hidden
    packed = _split_bf16(values).reshape(m, c * SPLIT_TERMS)
    out = []
    for start in range(0, packed.shape[1], hidden):
        chunk = packed[:, start : start + hidden]
        rows = torch.zeros(m, hidden, dtype=torch.bfloat16, device=values.device)
        rows[:, : chunk.shape[1]] = chunk
        out.append(buffer.combine(rows, handle)[:, : chunk.shape[1]])
    summed = torch.cat(out, dim=1).float().view(handle.num_tokens, c, SPLIT_TERMS)
    return (summed[..., 0] + summed[..., 1]) + summed[..., 2]


class _Dispatch(torch.autograd.Function):
    """Buffer.dispatch forward; combine of the row and weight gradients backward. The full
    DispatchResult (handle, counts) is handed out through the `out` list, as autograd passes only
    tensors through apply()."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, topk_weights: torch.Tensor, topk_idx: torch.Tensor, buffer: Buffer,
                out: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        res = buffer.dispatch(x, topk_idx, topk_weights)
        out.append(res)
        ctx.buffer, ctx.handle = buffer, res.handle
        ctx.mark_non_differentiable(res.topk_idx)
        return res.x, res.topk_weights, res.topk_idx

    @staticmethod
    def backward(ctx, grad_x: torch.Tensor, grad_w: torch.Tensor, _grad_idx: Optional[torch.Tensor]):
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = ctx.buffer.combine(grad_x.to(torch.bfloat16).contiguous(), ctx.handle)
        if ctx.needs_input_grad[1]:
            gw = _combine_values(ctx.buffer, ctx.handle, grad_w)
        return gx, gw, None, None, None


class _Combine(torch.autograd.Function):
    """Buffer.combine forward; cached dispatch of the output gradient backward."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, buffer: Buffer, handle: DispatchHandle) -> torch.Tensor:
        ctx.buffer, ctx.handle = buffer, handle
        return buffer.combine(y, handle)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        res = ctx.buffer.dispatch(grad.to(torch.bfloat16).contiguous(), handle=ctx.handle)
        return res.x, None, None


def dispatch(buffer: Buffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> Dispatched:
    """Differentiable Buffer.dispatch: x [N, H] bf16, topk_idx [N, K] int64, topk_weights [N, K] float32."""
    results: list = []
    recv_x, recv_w, recv_idx = _Dispatch.apply(x, topk_weights, topk_idx, buffer, results)
    res = results[0]
    return Dispatched(recv_x, recv_idx, recv_w, res.tokens_per_expert, res.handle)


def combine(buffer: Buffer, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """Differentiable Buffer.combine: y [M, H] bf16 rows -> [N, H] bf16 token sums."""
    return _Combine.apply(y, buffer, handle)
