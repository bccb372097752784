"""The MoE layer's normal mode with FP8 experts, forward and backward, as one autograd Function.

Forward: the tokens quantized per row per 128 channels (moe_ep.comm.fp8), one FP8 expert-major dispatch (the
pairs grouped by local expert with their scales and router weights: the experts gather nothing), the FP8
experts (moe_ep.moe.fp8_experts.pairs_forward), one expert-major combine (each row's pairs summed, then sent
back). Backward, as moe_ep.moe.autograd pairs dispatch and combine: a cached dispatch of the output gradient
gives each pair its token's gradient, fp8_experts.pairs_backward runs the experts' backward, and one combine
carries the pairs' row gradient and their router weights' gradient back to the tokens and their top-k weights.
The tokens' quantization passes the gradient through unchanged (straight-through). Collective: every rank
runs forward and backward in the same order, which autograd does when every rank runs the same model.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..comm import fp8
from ..comm.buffer import Buffer
from . import fp8_experts
from .experts import GroupedExperts


class FP8Normal(torch.autograd.Function):
    """forward(tokens [N, H], topk_idx [N, K] int64, topk_weights [N, K] float32, w1, w3, w2 (the experts'
    parameters, for autograd), buffer, experts, cache: fp8_experts.FP8WeightCache, fp8_wgrad: the weight gradients
    in FP8 too, fp8_experts.pairs_backward) -> [N, H] bf16."""

    @staticmethod
    def forward(ctx: Any, tokens: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, buffer: Buffer, experts: GroupedExperts,
                cache: fp8_experts.FP8WeightCache, fp8_wgrad: bool) -> torch.Tensor:
        q, scales = fp8.quantize(tokens.to(torch.bfloat16))
        d = buffer.dispatch(q, topk_idx, topk_weights, x_scales=scales, expert_major=True)
        counts = d.tokens_per_expert_tensor
        y, saved = fp8_experts.pairs_forward(cache.get(experts), d.x, d.x_scales, d.pair_weights, counts)
        out = buffer.combine(y, d.handle)
        if any(ctx.needs_input_grad):
            ctx.save_for_backward(d.x, d.x_scales, saved.h13, saved.a, saved.a_scale, d.pair_weights, counts)
            ctx.handle, ctx.buffer, ctx.experts, ctx.cache, ctx.dtype = d.handle, buffer, experts, cache, tokens.dtype
            ctx.fp8_wgrad = fp8_wgrad
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        x, x_scale, h13, a, a_scale, pair_weights, counts = ctx.saved_tensors
        need_tokens, _, need_weights, need_w1, need_w3, need_w2 = ctx.needs_input_grad[:6]
        dy = ctx.buffer.dispatch(grad.to(torch.bfloat16).contiguous(), handle=ctx.handle).x
        saved = fp8_experts.PairsSaved(h13, a, a_scale)
        g = fp8_experts.pairs_backward(ctx.cache.get_transposed(ctx.experts), x, x_scale, saved, pair_weights, counts,
                                       dy, need_w1, need_w3, need_w2, ctx.fp8_wgrad)
        del dy
        gx, gw = ctx.buffer.combine(g.x, ctx.handle, topk_weights=g.pair_weights)
        ctx.handle = None
        return (gx.to(ctx.dtype) if need_tokens else None, None, gw if need_weights else None, g.w1, g.w3, g.w2,
                None, None, None, None)
