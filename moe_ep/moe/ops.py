"""moe_ep's communication calls as `torch.library` custom ops (namespace `moe_ep`), so torch.compile
traces through them: each op has a fake implementation giving its output shapes, and dispatch and
combine carry their backward formulas (each one's backward is the other, see moe_ep.moe.autograd).

Custom ops take tensors and plain values only. Two registries bridge the gap:
- Buffers, weakly, by `buffer.cfg.buffer_id` (`register(buffer)` before tracing; the int is an op
  argument and a constant of the compiled graph).
- Handles, by an id held in a 0-d int64 CPU tensor (`handle` below) that a dispatch returns and
  combine takes. A handle's state is backend-private (the native kernels keep their own layout
  tensors), so it stays a Python object; the entry lives as long as that id tensor.

Shapes (docs/api.md): dispatch gives M = R * T rows with worst_case=True, else a data-dependent M
(an unbacked size while tracing), and dispatch_expert_major a data-dependent number of pairs P;
low-latency outputs are [E_l, R * T, ...].
"""
from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch

from ..comm import fp8
from ..comm.buffer import Buffer
from ..comm.types import DispatchHandle, LowLatencyHandle

_buffers: "weakref.WeakValueDictionary[int, Buffer]" = weakref.WeakValueDictionary()
_handles: dict[int, DispatchHandle | LowLatencyHandle] = {}
_handle_ids = itertools.count(1)


def register(buffer: Buffer) -> int:
    """Make `buffer` reachable by the ops; returns the id to pass them. Call it outside compiled code."""
    _buffers[buffer.cfg.buffer_id] = buffer
    return buffer.cfg.buffer_id


def _buffer(buffer_id: int) -> Buffer:
    buffer = _buffers.get(buffer_id)
    if buffer is None:
        raise RuntimeError(f"no live Buffer with id {buffer_id}: call moe_ep.moe.ops.register(buffer) first")
    return buffer


def _store(handle: DispatchHandle | LowLatencyHandle) -> torch.Tensor:
    """A 0-d int64 CPU tensor holding a fresh id for `handle` (copies of it name the same handle);
    the entry is dropped when this tensor is freed."""
    hid = next(_handle_ids)
    _handles[hid] = handle
    token = torch.tensor(hid, dtype=torch.int64)
    weakref.finalize(token, _handles.pop, hid, None)
    return token


def _handle(token: torch.Tensor) -> DispatchHandle | LowLatencyHandle:
    handle = _handles.get(int(token))
    if handle is None:
        raise RuntimeError(f"handle {int(token)} is gone: the handle tensor its dispatch returned was freed")
    return handle


def _fake_handle() -> torch.Tensor:
    return torch.empty((), dtype=torch.int64)


# ---- normal mode ----------------------------------------------------------------------------------
@torch.library.custom_op("moe_ep::dispatch", mutates_args=())
def dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, buffer_id: int,
             worst_case: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                        torch.Tensor, torch.Tensor]:
    """Buffer.dispatch -> (x [M, H], topk_idx [M, K], topk_weights [M, K], tokens_per_expert [E_l]
    int32, src_rank [M], src_index [M], handle). src_rank/src_index are copies: the handle keeps
    its own, which an op output must not share (the compiler may reuse a dead output's memory)."""
    res = _buffer(buffer_id).dispatch(x, topk_idx, topk_weights, worst_case=worst_case)
    return (res.x, res.topk_idx, res.topk_weights, res.tokens_per_expert_tensor, res.src_rank.clone(),
            res.src_index.clone(), _store(res.handle))


@dispatch.register_fake
def _(x, topk_idx, topk_weights, buffer_id, worst_case):
    cfg = _buffer(buffer_id).cfg
    m = cfg.world_size * cfg.max_tokens_per_rank if worst_case else torch.library.get_ctx().new_dynamic_size()
    k = topk_idx.shape[1]
    return (x.new_empty(m, x.shape[1]), topk_idx.new_empty(m, k), topk_weights.new_empty(m, k),
            x.new_empty(cfg.num_local_experts, dtype=torch.int32), x.new_empty(m, dtype=torch.int32),
            x.new_empty(m, dtype=torch.int32), _fake_handle())


@torch.library.custom_op("moe_ep::dispatch_expert_major", mutates_args=())
def dispatch_expert_major(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, buffer_id: int,
                          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Buffer.dispatch(..., expert_major=True) -> (pairs [P, H] in `dtype` (bf16 or float32: the experts'),
    pair_weights [P] float32, tokens_per_expert [E_l] int32 (pairs per local expert), handle). Its
    backward sums each row's pair gradients in float32 before the one rounding to bf16, so `dtype`
    float32 keeps a float32 gradient unrounded until then."""
    res = _buffer(buffer_id).dispatch(x, topk_idx, topk_weights, expert_major=True)
    return res.x.to(dtype), res.pair_weights, res.tokens_per_expert_tensor.clone(), _store(res.handle)


@dispatch_expert_major.register_fake
def _(x, topk_idx, topk_weights, buffer_id, dtype):
    cfg = _buffer(buffer_id).cfg
    p = torch.library.get_ctx().new_dynamic_size()
    return (x.new_empty(p, x.shape[1], dtype=dtype), topk_weights.new_empty(p),
            x.new_empty(cfg.num_local_experts, dtype=torch.int32), _fake_handle())


@torch.library.custom_op("moe_ep::combine", mutates_args=())
def combine(x: torch.Tensor, handle: torch.Tensor, num_tokens: int, buffer_id: int) -> torch.Tensor:
    """Buffer.combine of x through a dispatch's handle -> [num_tokens, H] bf16 (x: rows [M, H] bf16, or an
    expert-major handle's pairs [P, H] bf16 or float32)."""
    return _buffer(buffer_id).combine(x, _handle(handle))


@combine.register_fake
def _(x, handle, num_tokens, buffer_id):
    return x.new_empty(num_tokens, x.shape[1], dtype=torch.bfloat16)


@torch.library.custom_op("moe_ep::combine_with_weights", mutates_args=())
def combine_with_weights(x: torch.Tensor, topk_weights: torch.Tensor, handle: torch.Tensor, num_tokens: int,
                         buffer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Buffer.combine(x, handle, topk_weights=...) -> ([num_tokens, H] bf16, [num_tokens, K] float32): the
    weights ([M, K], or [P] per pair for an expert-major handle) travel with the rows. Dispatch's
    backward; it has no backward of its own."""
    return _buffer(buffer_id).combine(x, _handle(handle), topk_weights=topk_weights)


@combine_with_weights.register_fake
def _(x, topk_weights, handle, num_tokens, buffer_id):
    k = _buffer(buffer_id).cfg.num_topk
    return x.new_empty(num_tokens, x.shape[1], dtype=torch.bfloat16), topk_weights.new_empty(num_tokens, k)


@torch.library.custom_op("moe_ep::cached_dispatch", mutates_args=())
def cached_dispatch(x: torch.Tensor, handle: torch.Tensor, num_rows: int, buffer_id: int) -> torch.Tensor:
    """Buffer.dispatch(x, handle=...) -> [num_rows, H] (num_rows: the handle's dispatch output rows, or
    its pairs for an expert-major handle)."""
    return _buffer(buffer_id).dispatch(x, handle=_handle(handle)).x


@cached_dispatch.register_fake
def _(x, handle, num_rows, buffer_id):
    return x.new_empty(num_rows, x.shape[1])


# ---- autograd: dispatch <-> combine ----------------------------------------------------------------
def _dispatch_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    ctx.num_tokens, ctx.buffer_id = inputs[0].shape[0], inputs[3]
    ctx.save_for_backward(output[-1])


def _send_back(ctx: Any, rows: torch.Tensor, grad_w: torch.Tensor) -> tuple:
    """A dispatch's backward: one combine of the rows' (or pairs') gradient, carrying the weights'
    gradient when that is needed (moe_ep.moe.autograd); Buffer.combine always moves rows, so a
    weights-only backward sends them too."""
    (handle,) = ctx.saved_tensors
    if not ctx.needs_input_grad[2]:
        return combine(rows, handle, ctx.num_tokens, ctx.buffer_id), None, None, None, None
    gx, gw = combine_with_weights(rows, grad_w.contiguous(), handle, ctx.num_tokens, ctx.buffer_id)
    return gx if ctx.needs_input_grad[0] else None, None, gw, None, None


def _dispatch_backward(ctx: Any, grad_x: torch.Tensor, _grad_idx: None, grad_w: torch.Tensor, *_rest: None) -> tuple:
    """Rows cross ranks in bf16: the rows' gradient is rounded once before the combine."""
    return _send_back(ctx, grad_x.to(torch.bfloat16).contiguous(), grad_w)


def _combine_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.num_rows, ctx.buffer_id, ctx.dtype = inputs[0].shape[0], inputs[3], inputs[0].dtype
    ctx.save_for_backward(inputs[1])


def _combine_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    """A cached dispatch of the output gradient: every row (or pair) gets the gradient of the token it fed."""
    (handle,) = ctx.saved_tensors
    rows = cached_dispatch(grad.to(torch.bfloat16).contiguous(), handle, ctx.num_rows, ctx.buffer_id)
    return rows.to(ctx.dtype), None, None, None


def _dispatch_expert_major_backward(ctx: Any, grad_x: torch.Tensor, grad_w: torch.Tensor, *_rest: None) -> tuple:
    """The expert-major combine of the pairs' gradient, as it comes (bf16 or float32): each row's pairs
    are summed in float32 and rounded once; the pair weights' gradient goes back to the top-k slots."""
    return _send_back(ctx, grad_x.contiguous(), grad_w)


torch.library.register_autograd("moe_ep::dispatch", _dispatch_backward, setup_context=_dispatch_setup)
torch.library.register_autograd("moe_ep::combine", _combine_backward, setup_context=_combine_setup)
torch.library.register_autograd("moe_ep::dispatch_expert_major", _dispatch_expert_major_backward,
                                setup_context=_dispatch_setup)


# ---- low-latency mode -----------------------------------------------------------------------------
@torch.library.custom_op("moe_ep::low_latency_dispatch", mutates_args=())
def low_latency_dispatch(x: torch.Tensor, topk_idx: torch.Tensor, buffer_id: int, use_fp8: bool,
                         round_scale: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Buffer.low_latency_dispatch -> (x [E_l, R*T, H], x_scales [E_l, R*T, H/128] float32 token-major per
    expert ([..., 0] without FP8), count [E_l] int32, handle). No receive hook: the op completes the receive."""
    res = _buffer(buffer_id).low_latency_dispatch(x, topk_idx, use_fp8=use_fp8, round_scale=round_scale)
    scales = res.x_scales if use_fp8 else x.new_empty(*res.x.shape[:2], 0, dtype=torch.float32)
    return res.x, scales, res.count.clone(), _store(res.handle)


@low_latency_dispatch.register_fake
def _(x, topk_idx, buffer_id, use_fp8, round_scale):
    cfg = _buffer(buffer_id).cfg
    e_l, slots = cfg.num_local_experts, cfg.world_size * cfg.max_tokens_per_rank
    dtype = torch.float8_e4m3fn if use_fp8 else torch.bfloat16
    scales = (fp8.expert_major_scales(e_l, slots, cfg.num_scales, torch.float32, x.device) if use_fp8
              else x.new_empty(e_l, slots, 0, dtype=torch.float32))  # the real op's strides (DeepEP's layout)
    return (x.new_empty(e_l, slots, cfg.hidden, dtype=dtype), scales,
            x.new_empty(e_l, dtype=torch.int32), _fake_handle())


@torch.library.custom_op("moe_ep::low_latency_combine", mutates_args=())
def low_latency_combine(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: torch.Tensor,
                        buffer_id: int) -> torch.Tensor:
    """Buffer.low_latency_combine -> [N, H] bf16 (N = topk_idx rows). No receive hook."""
    return _buffer(buffer_id).low_latency_combine(x, topk_idx, topk_weights, _handle(handle)).x


@low_latency_combine.register_fake
def _(x, topk_idx, topk_weights, handle, buffer_id):
    return x.new_empty(topk_idx.shape[0], x.shape[2], dtype=torch.bfloat16)

