"""The router's selection in one Triton pass: float32 logits [N, E] -> scores, (group-limited) top-k ids,
their weights and the per-expert counts. It replaces the ~15 small torch kernels of TopKRouter's torch
path, whose launches left the GPU idle between them (docs/benchmarks.md: ~0.5 ms per layer forward).

Semantics are TopKRouter's (moe_ep.moe.router): scores = softmax or sigmoid(logits); choice = scores + bias;
with groups, keep the `topk_groups` groups whose two best choices sum highest; ids = the top K choices in
descending order (ties to the lower id, NaN above everything as in torch.topk); weights = the ids' unbiased
scores, renormalised and scaled. The kernel's exp and sums are not torch's, so scores and weights may differ
from the torch path's in the last bits (same formulas, not the same bits); its own bits repeat from run to
run: counts are integer atomics, everything else has one fixed order.

Layout per program: BLOCK_N token rows x EP lanes (E rounded up to a power of two, padded lanes never
chosen). Selection compares int32 keys that order like the floats (`_order_key`), so a taken or padded lane
(key _NONE) sorts below every real value, -inf included, and K distinct real ids come out for K <= E.
"""
from __future__ import annotations

from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: TopKRouter's torch path serves
    triton = None

_ROW_LANES = 4096  # BLOCK_N x EP per program
_MAX_LANES = 2048  # wider expert counts take the torch path


def supports(num_experts: int, num_groups: int) -> bool:
    """Whether the kernel serves this router: at most _MAX_LANES experts, and groups only over a power-of-two
    expert count (the lanes reshape into [groups, experts per group])."""
    pow2 = num_experts & (num_experts - 1) == 0
    return triton is not None and num_experts <= _MAX_LANES and (num_groups == 1 or pow2)


if triton is not None:
    _NONE = tl.constexpr(-2 ** 31)  # below every _order_key of a float
    _NAN = tl.constexpr(2 ** 31 - 1)  # NaN sorts above +inf, as in torch.topk

    @triton.jit
    def _order_key(v):
        """float32 -> int32 with the floats' order (-0.0 just below +0.0)."""
        bits = v.to(tl.int32, bitcast=True)
        key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        return tl.where(v != v, _NAN, key)

    @triton.jit
    def _value_at(values, lanes, at):
        """values[row, at[row]] for each row: one lane of each row, exactly (the others add +0.0)."""
        return tl.sum(tl.where(lanes == at[:, None], values, 0.0), axis=1)

    @triton.jit
    def _slot(values, slots, k):
        """values[row, k] for each row of a [BLOCK_N, KP] tile, exactly (the other slots add 0)."""
        return tl.sum(tl.where(slots == k, values, 0), axis=1)

    @triton.jit
    def _scores(logits, row_ok, SOFTMAX: tl.constexpr):
        """softmax or sigmoid of a [BLOCK_N, EP] tile whose padded lanes hold -inf (score 0 there)."""
        if SOFTMAX:
            top = tl.where(row_ok, tl.max(logits, axis=1), 0.0)  # rows past N: all -inf, keep them finite
            ex = tl.exp(logits - top[:, None])
            return ex / tl.sum(ex, axis=1)[:, None]
        return 1.0 / (1.0 + tl.exp(-logits))

    @triton.jit
    def _route_kernel(logits_ptr, bias_ptr, scores_ptr, idx_ptr, w_ptr, counts_ptr, N, scale,
                      E: tl.constexpr, EP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, G: tl.constexpr,
                      TG: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                      STORE_SCORES: tl.constexpr, BLOCK_N: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        lanes = tl.arange(0, EP)
        row_ok = rows < N
        real = row_ok[:, None] & (lanes < E)[None, :]
        at = rows.to(tl.int64)[:, None] * E + lanes[None, :]
        scores = _scores(tl.load(logits_ptr + at, mask=real, other=float("-inf")), row_ok, SOFTMAX)
        if STORE_SCORES:
            tl.store(scores_ptr + at, scores, mask=real)
        choice = scores
        if HAS_BIAS:
            choice = choice + tl.load(bias_ptr + lanes, mask=lanes < E, other=0.0)[None, :]
        key = tl.where((lanes < E)[None, :], _order_key(choice), _NONE)
        if G > 1:  # EP == E here (supports): lane j is expert j of group j // (E // G)
            EG: tl.constexpr = E // G
            key3 = tl.reshape(key, [BLOCK_N, G, EG])
            choice3 = tl.reshape(choice, [BLOCK_N, G, EG])
            lane3 = tl.arange(0, EG)[None, None, :]
            first = tl.argmax(key3, axis=2)
            group_score = tl.sum(tl.where(lane3 == first[:, :, None], choice3, 0.0), axis=2)
            if EG > 1:
                second = tl.argmax(tl.where(lane3 == first[:, :, None], _NONE, key3), axis=2)
                group_score = group_score + tl.sum(tl.where(lane3 == second[:, :, None], choice3, 0.0), axis=2)
            group_key = _order_key(group_score)
            groups = tl.arange(0, G)[None, :]
            keep = tl.zeros([BLOCK_N, G], dtype=tl.int1)
            for _t in tl.static_range(TG):
                best = tl.argmax(group_key, axis=1)
                hit = groups == best[:, None]
                keep = keep | hit
                group_key = tl.where(hit, _NONE, group_key)
            key = tl.reshape(tl.where(keep[:, :, None], key3, _NONE), [BLOCK_N, EP])
        slots = tl.arange(0, KP)[None, :]
        ids = tl.zeros([BLOCK_N, KP], dtype=tl.int32)
        weights = tl.zeros([BLOCK_N, KP], dtype=tl.float32)
        for k in tl.static_range(K):
            pick = tl.argmax(key, axis=1)
            ids = tl.where(slots == k, pick[:, None], ids)
            weights = tl.where(slots == k, _value_at(scores, lanes[None, :], pick)[:, None], weights)
            key = tl.where(lanes[None, :] == pick[:, None], _NONE, key)
        if NORM:
            weights = weights / tl.maximum(tl.sum(weights, axis=1), 1e-20)[:, None]
        weights = weights * scale
        chosen = row_ok[:, None] & (slots < K)
        out = rows.to(tl.int64)[:, None] * K + slots
        tl.store(idx_ptr + out, ids.to(tl.int64), mask=chosen)
        tl.store(w_ptr + out, weights, mask=chosen)
        bins = tl.arange(0, 2 * EP)  # bin EP collects the slots that are no selection
        hist = tl.histogram(tl.reshape(tl.where(chosen, ids, EP), [BLOCK_N * KP]), 2 * EP)
        tl.atomic_add(counts_ptr + bins, hist.to(tl.int64), mask=bins < E)

    @triton.jit
    def _route_backward_kernel(logits_ptr, idx_ptr, gw_ptr, gs_ptr, dl_ptr, N, scale, E: tl.constexpr,
                               EP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, SOFTMAX: tl.constexpr,
                               NORM: tl.constexpr, HAS_GS: tl.constexpr, BLOCK_N: tl.constexpr):
        """d logits of weights (gw: their gradient) and of the scores (gs, when the balancing loss read them), at the
        forward's ids, with the scores recomputed as the forward computed them. Per row, s = scores, c_k = s[id_k],
        S = sum_k c_k: weight_k = scale * c_k / max(S, 1e-20) (NORM) or scale * c_k; ds = the ids' dc plus gs;
        softmax: dl = s * (ds - sum(ds * s)), sigmoid: dl = ds * s * (1 - s)."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        lanes = tl.arange(0, EP)[None, :]
        row_ok = rows < N
        real = row_ok[:, None] & (lanes < E)
        at = rows.to(tl.int64)[:, None] * E + lanes
        scores = _scores(tl.load(logits_ptr + at, mask=real, other=float("-inf")), row_ok, SOFTMAX)
        slots = tl.arange(0, KP)[None, :]
        chosen = row_ok[:, None] & (slots < K)
        out = rows.to(tl.int64)[:, None] * K + slots
        ids = tl.load(idx_ptr + out, mask=chosen, other=-1)
        gw = tl.load(gw_ptr + out, mask=chosen, other=0.0) * scale
        chosen_scores = tl.zeros([BLOCK_N, KP], dtype=tl.float32)
        for k in tl.static_range(K):
            chosen_scores = tl.where(slots == k, _value_at(scores, lanes, _slot(ids, slots, k))[:, None], chosen_scores)
        if NORM:
            total = tl.sum(chosen_scores, axis=1)
            norm = tl.maximum(total, 1e-20)
            through = tl.where(total >= 1e-20, tl.sum(gw * chosen_scores, axis=1) / (norm * norm), 0.0)
            gc = gw / norm[:, None] - through[:, None]
        else:
            gc = gw
        ds = tl.zeros([BLOCK_N, EP], dtype=tl.float32)
        if HAS_GS:
            ds = tl.load(gs_ptr + at, mask=real, other=0.0)
        for k in tl.static_range(K):
            ds += tl.where(lanes == _slot(ids, slots, k)[:, None], _slot(gc, slots, k)[:, None], 0.0)
        if SOFTMAX:
            dl = scores * (ds - tl.sum(ds * scores, axis=1)[:, None])
        else:
            dl = ds * scores * (1.0 - scores)
        tl.store(dl_ptr + at, dl, mask=real)


def _tiling(n: int, e: int, top_k: int) -> tuple[tuple[int], dict]:
    """Both kernels' grid and shared sizes: BLOCK_N rows x EP lanes per program, KP slots."""
    lanes = triton.next_power_of_2(e)
    block_n = max(1, min(64, _ROW_LANES // lanes))
    return (triton.cdiv(n, block_n),), dict(E=e, EP=lanes, K=top_k, KP=triton.next_power_of_2(top_k), BLOCK_N=block_n)


# ---- as custom ops: torch.compile calls the same kernels as eager (the same bits) -------------------------------
@torch.library.custom_op("moe_ep::route", mutates_args=())
def route_op(logits: torch.Tensor, bias: Optional[torch.Tensor], top_k: int, softmax: bool, num_groups: int,
             topk_groups: int, norm: bool, scale: float, want_scores: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [N, E] float32 (bias [E] float32 or None) -> (topk_idx [N, K] int64, topk_weights [N, K] float32,
    counts [E] int64, scores [N, E] float32, empty unless want_scores); differentiable in logits (weights and
    scores) through route_backward_op. supports() holds."""
    logits = logits.contiguous()
    n, e = logits.shape
    idx = logits.new_empty(n, top_k, dtype=torch.int64)
    weights = logits.new_empty(n, top_k)
    counts = torch.zeros(e, dtype=torch.int64, device=logits.device)
    scores = logits.new_empty(n, e) if want_scores else logits.new_empty(0)
    if n:
        grid, sizes = _tiling(n, e, top_k)
        _route_kernel[grid](
            logits, logits if bias is None else bias, scores if want_scores else weights, idx, weights, counts,
            n, scale, G=num_groups, TG=topk_groups, SOFTMAX=softmax, HAS_BIAS=bias is not None, NORM=norm,
            STORE_SCORES=want_scores, num_warps=4, **sizes)
    return idx, weights, counts, scores


@route_op.register_fake
def _route_fake(logits, bias, top_k, softmax, num_groups, topk_groups, norm, scale, want_scores):
    n, e = logits.shape
    return (logits.new_empty(n, top_k, dtype=torch.int64), logits.new_empty(n, top_k),
            logits.new_empty(e, dtype=torch.int64), logits.new_empty(n, e) if want_scores else logits.new_empty(0))


@torch.library.custom_op("moe_ep::route_backward", mutates_args=())
def route_backward_op(logits: torch.Tensor, topk_idx: torch.Tensor, grad_weights: torch.Tensor,
                      grad_scores: Optional[torch.Tensor], top_k: int, softmax: bool, norm: bool, scale: float
                      ) -> torch.Tensor:
    """d logits [N, E] float32 of route_op's weights (their gradient grad_weights [N, K]) and scores (grad_scores
    [N, E] or None) at its ids topk_idx [N, K]; logits as route_op got them."""
    logits = logits.contiguous()
    n, e = logits.shape
    grad_logits = torch.empty_like(logits)
    if n:
        gw = grad_weights.contiguous()
        grid, sizes = _tiling(n, e, top_k)
        _route_backward_kernel[grid](
            logits, topk_idx, gw, gw if grad_scores is None else grad_scores.contiguous(), grad_logits, n, scale,
            SOFTMAX=softmax, NORM=norm, HAS_GS=grad_scores is not None, num_warps=4, **sizes)
    return grad_logits


@route_backward_op.register_fake
def _route_backward_fake(logits, topk_idx, grad_weights, grad_scores, top_k, softmax, norm, scale):
    return torch.empty_like(logits)


def _route_setup(ctx, inputs, output) -> None:
    logits, _bias, top_k, softmax, _groups, _topk_groups, norm, scale, _want_scores = inputs
    ctx.save_for_backward(logits, output[0])
    ctx.args = (top_k, softmax, norm, scale)


def _route_grad(ctx, _grad_idx, grad_weights, _grad_counts, grad_scores):
    """Autograd hands every output's gradient, zeros where unused; grad_scores is empty where route_op stored no
    scores."""
    logits, topk_idx = ctx.saved_tensors
    grad_logits = route_backward_op(logits, topk_idx, grad_weights, grad_scores if grad_scores.numel() else None,
                                    *ctx.args)
    return grad_logits, None, None, None, None, None, None, None, None


torch.library.register_autograd("moe_ep::route", _route_grad, setup_context=_route_setup)
