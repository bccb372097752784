"""Differentiable dispatch and combine; each one's backward is the other. The formulas below are
registered on the moe_ep custom ops (moe_ep.moe.ops, torch.library.register_autograd), so they hold
under torch.compile too; this module wraps those ops for layers.

- dispatch(x, topk_idx, topk_weights): backward is one combine of the received rows' gradient (a
  token's gradient is the sum of the gradients of its copies) that carries the received weights'
  gradient with the rows (`Buffer.combine(..., topk_weights=...)`, the moe_ep::combine_with_weights
  op), so a backward step costs one combine and one dispatch per layer.
- combine(y, ref): backward is a cached dispatch of the output gradient through the same handle
  (`Buffer.dispatch(grad, handle=handle)`): every row gets the gradient of the token it fed.
- dispatch_expert_major(x, topk_idx, topk_weights): the received rows as (row, local expert) pairs
  grouped by expert, with each pair's router weight (moe_ep.comm.expert_major). Its backward is the
  expert-major combine of the pairs' gradient: each row's pair gradients summed in ascending k, in
  float32 from +0.0 (unrounded when the pairs were float32), rounded once to bf16, then combined;
  the pair weights' gradient travels with the rows to every top-k slot of its pair. combine(y, ref)
  of such a dispatch takes the pairs' outputs [P, H] (bf16 or float32) and sums each row's pairs
  the same way before combining; its backward, the cached dispatch, gives each pair its token's gradient.

Rows are communicated in bf16, as the Buffer requires, so row gradients that cross ranks are rounded
to bf16 once per crossing. Weight gradients stay float32 and are exact: the gradient of the received
weight w[m, k] is nonzero only on the rank that owns expert topk_idx[m, k], and combine sums a
token's weight rows over ranks in float32 from +0.0, never rounding, so each sum has one nonzero
term. Both backwards are collective: every rank of the Buffer's group runs them, in the same order,
which autograd guarantees when every rank runs the same model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import ops
from ..comm.buffer import Buffer


@dataclass
class DispatchRef:
    """What combine needs from a dispatch, as tensors and ints (so compiled code can carry it)."""

    handle: torch.Tensor  # 0-d int64 CPU: the registered DispatchHandle (moe_ep.moe.ops)
    num_tokens: int  # N, the dispatching rank's tokens
    buffer_id: int


@dataclass
class Dispatched:
    """Rows this rank received, with autograd connected back to the sources."""

    x: torch.Tensor  # [M, H] bf16 (M = R * T in worst-case mode; padding rows have src_rank -1)
    topk_idx: torch.Tensor  # [M, K] int64 local expert ids, -1 where the expert is elsewhere
    topk_weights: torch.Tensor  # [M, K] float32, 0 where topk_idx is -1
    tokens_per_expert: torch.Tensor  # [E_l] int32 received rows per local expert
    src_rank: torch.Tensor  # [M] int32
    ref: DispatchRef

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor the experts read (the overlap streams order them)."""
        return self.x, self.topk_idx, self.topk_weights, self.tokens_per_expert, self.src_rank


@dataclass
class ExpertMajorDispatched:
    """(row, local expert) pairs this rank received, grouped by expert, with autograd to the sources."""

    x: torch.Tensor  # [P, H] bf16 or float32: pairs of expert 0, then expert 1, ...
    weights: torch.Tensor  # [P] float32 router weight of each pair
    tokens_per_expert: torch.Tensor  # [E_l] int32 pairs per local expert
    ref: DispatchRef

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor the experts read (the overlap streams order them)."""
        return self.x, self.weights, self.tokens_per_expert


def _buffer_id(buffer: Buffer) -> int:
    """The Buffer's op id; registering is a side effect a compiled graph cannot hold, so under
    torch.compile `buffer` must already be registered (moe_ep.moe.ops.register; MoE does it)."""
    return buffer.cfg.buffer_id if torch.compiler.is_compiling() else ops.register(buffer)


def dispatch(buffer: Buffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, *,
             worst_case: bool = False) -> Dispatched:
    """Differentiable Buffer.dispatch (the moe_ep::dispatch op): x [N, H] bf16, topk_idx [N, K] int64,
    topk_weights [N, K] float32."""
    buffer_id = _buffer_id(buffer)
    recv_x, recv_idx, recv_w, per_expert, src_rank, _src_index, handle = ops.dispatch(
        x, topk_idx, topk_weights, buffer_id, worst_case)
    return Dispatched(recv_x, recv_idx, recv_w, per_expert, src_rank, DispatchRef(handle, x.shape[0], buffer_id))


def dispatch_expert_major(buffer: Buffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, *,
                          dtype: torch.dtype = torch.bfloat16) -> ExpertMajorDispatched:
    """Differentiable Buffer.dispatch(..., expert_major=True) (the moe_ep::dispatch_expert_major op):
    pairs in `dtype` (bf16, or float32 for float32 experts, whose gradient then stays float32 until
    the backward's one rounding). Exact-size mode only."""
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"dtype must be torch.bfloat16 or torch.float32 (what an expert-major combine sums), got {dtype}")
    buffer_id = _buffer_id(buffer)
    pairs, weights, per_expert, handle = ops.dispatch_expert_major(x, topk_idx, topk_weights, buffer_id, dtype)
    return ExpertMajorDispatched(pairs, weights, per_expert, DispatchRef(handle, x.shape[0], buffer_id))


def combine(y: torch.Tensor, ref: DispatchRef) -> torch.Tensor:
    """Differentiable Buffer.combine (the moe_ep::combine op): y [M, H] bf16 rows (an expert-major
    dispatch's: [P, H] bf16 or float32 pairs) -> [N, H] bf16 token sums."""
    return ops.combine(y, ref.handle, ref.num_tokens, ref.buffer_id)
