"""Differentiable dispatch and combine; each one's backward is the other. The formulas below are
registered on the moe_ep custom ops (moe_ep.ops, torch.library.register_autograd), so they hold
under torch.compile too; this module wraps those ops for layers.

- dispatch(x, topk_idx, topk_weights): backward is one combine of the received rows' gradient (a
  token's gradient is the sum of the gradients of its copies) that carries the received weights'
  gradient with the rows (`Buffer.combine(..., topk_weights=...)`, the moe_ep::combine_with_weights
  op), so a backward step costs one combine and one dispatch per layer.
- combine(y, ref): backward is a cached dispatch of the output gradient through the same handle
  (`Buffer.dispatch(grad, handle=handle)`): every row gets the gradient of the token it fed.

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
from .buffer import Buffer


@dataclass
class DispatchRef:
    """What combine needs from a dispatch, as tensors and ints (so compiled code can carry it)."""

    handle: torch.Tensor  # 0-d int64 CPU: the registered DispatchHandle (moe_ep.ops)
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


def dispatch(buffer: Buffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, *,
             worst_case: bool = False) -> Dispatched:
    """Differentiable Buffer.dispatch (the moe_ep::dispatch op): x [N, H] bf16, topk_idx [N, K] int64,
    topk_weights [N, K] float32. Under torch.compile `buffer` must already be registered
    (moe_ep.ops.register; MoE does it), as registering is a side effect the graph cannot hold."""
    buffer_id = buffer.cfg.buffer_id if torch.compiler.is_compiling() else ops.register(buffer)
    recv_x, recv_idx, recv_w, per_expert, src_rank, _src_index, handle = ops.dispatch(
        x, topk_idx, topk_weights, buffer_id, worst_case)
    return Dispatched(recv_x, recv_idx, recv_w, per_expert, src_rank, DispatchRef(handle, x.shape[0], buffer_id))


def combine(y: torch.Tensor, ref: DispatchRef) -> torch.Tensor:
    """Differentiable Buffer.combine (the moe_ep::combine op): y [M, H] bf16 rows -> [N, H] bf16 token sums."""
    return ops.combine(y, ref.handle, ref.num_tokens, ref.buffer_id)
