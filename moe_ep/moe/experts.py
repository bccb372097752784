"""Grouped SwiGLU experts: the E_l experts one rank owns, run over the rows dispatch delivered.

Weights are stacked per local expert in nn.Linear layout (w1, w3: [E_l, F, H]; w2: [E_l, H, F]);
out = w2 @ (silu(w1 @ x) * (w3 @ x)). w1 and w3 are two parameters over ONE allocation
[E_l, 2F, H] (`fused_w13`), so gate and up run as one grouped GEMM. The state dict holds one tensor
per expert under its GLOBAL id (`{e}.w1`, `{e}.w2`, `{e}.w3`), so a checkpoint written at one
expert-parallel size loads at another: merge the ranks' dicts and every rank picks its own experts.

The forward pass, per (row, local expert) pair sorted by expert: gate/up GEMM, SwiGLU scaled by
the router weight (one pass, moe_ep.moe.expert_kernels), down GEMM. `forward_sorted` takes the pairs
already grouped (the layer's default normal mode: an expert-major dispatch made them, its combine
sums each row's); `forward` (the layer with expert_major=False) takes rows and does both ends
itself: the sort and gather of the pairs, and a fixed-order sum of each row's pairs. The backward is written out (dX and dW as grouped GEMMs,
the SwiGLU backward in one pass) rather than left to autograd, whose index backward adds with
atomics (CUDA; CPU threads in float32) and so changes the bits from run to run.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..comm.row_sum import sum_rows
from . import decode_experts
from .expert_kernels import swiglu, swiglu_backward

WEIGHT_NAMES = ("w1", "w2", "w3")
INIT_STD = 0.02


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """torch._grouped_mm runs on CUDA sm90+ in bf16; elsewhere the experts loop one by one."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


@dataclass
class Routing:
    """Received rows [M] with top-k slots [M, K] as (row, local expert) pairs sorted by expert."""

    rows: torch.Tensor  # [P] int64: the received row of each pair, pairs in ascending expert order
    pairs: torch.Tensor  # [P] int64: each pair's position in topk_idx.view(-1)
    slots: torch.Tensor  # [M, K] int64: the sorted position of pair (m, k), -1 where topk_idx is -1
    counts: torch.Tensor  # [E_l] int64: pairs per local expert


def route(topk_idx: torch.Tensor, num_local_experts: int) -> Routing:
    """Sort the valid pairs of topk_idx [M, K] (LOCAL ids, -1: elsewhere) by expert, stably (so by
    row inside an expert). One host sync: the number of pairs."""
    m, k = topk_idx.shape
    flat = topk_idx.reshape(-1)
    key = torch.where(flat >= 0, flat, num_local_experts)
    counts = torch.bincount(key, minlength=num_local_experts + 1)[:num_local_experts]
    pairs = torch.argsort(key, stable=True)[: int(counts.sum())]
    slots = torch.full_like(flat, -1)
    slots[pairs] = torch.arange(pairs.numel(), device=flat.device)  # each position once: no accumulation
    return Routing(pairs // k, pairs, slots.view(m, k), counts)


@dataclass
class _Groups:
    """Consecutive row groups, one per local expert, and the GEMMs over them."""

    offs: torch.Tensor  # [E_l] int32 cumulative row counts (torch._grouped_mm)
    sizes: Optional[list[int]]  # rows per group on the host: the per-expert loop instead of grouped GEMMs

    def mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a [P, K], b [E_l, K, N] -> [P, N]: group e's rows times b[e]."""
        if self.sizes is None:
            return torch._grouped_mm(a, b, offs=self.offs)
        return torch.cat([rows @ b[e] for e, rows in enumerate(a.split(self.sizes))])

    def mm_t(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a [P, I], b [P, J] -> [E_l, I, J]: group e's a^T b (the weight gradient; empty groups give 0)."""
        if self.sizes is None:
            return torch._grouped_mm(a.t(), b, offs=self.offs)
        return torch.stack([ae.t() @ be for ae, be in zip(a.split(self.sizes), b.split(self.sizes))])


def groups_of(rows: torch.Tensor, counts: torch.Tensor) -> _Groups:
    """The groups of `counts` [E_l] consecutive rows (like `rows`): torch._grouped_mm where it runs, else one
    matmul per expert."""
    grouped = grouped_mm_supported(rows) and rows.shape[0] > 0
    return _Groups(torch.cumsum(counts, 0, dtype=torch.int32), None if grouped else counts.tolist())


def _weight_grads(groups: _Groups, f: int, xs: Optional[torch.Tensor], dh13: Optional[torch.Tensor],
                  dy: Optional[torch.Tensor], a: Optional[torch.Tensor], need_w1: bool, need_w3: bool,
                  need_w2: bool) -> tuple[Optional[torch.Tensor], ...]:
    """(dW1, dW3, dW2) as grouped GEMMs over expert-sorted rows: dH^T X for gate and up, dY^T a for down
    (None where not needed)."""
    dw1 = groups.mm_t(dh13[:, :f], xs) if need_w1 else None
    dw3 = groups.mm_t(dh13[:, f:], xs) if need_w3 else None
    dw2 = groups.mm_t(dy, a) if need_w2 else None
    return dw1, dw3, dw2


class _SwiGLUExperts(torch.autograd.Function):
    """Scaled SwiGLU experts over pairs; with `rows`, pairs are gathered from x and summed back per row.

    forward(x [M, H], scale [P] float32, w1, w3, w2, rows [P] | None, slots [M, K] | None, counts [E_l],
    recompute) -> [M, H] (rows given) or [P, H] (x already expert-sorted, one pair per row), in the
    weights' dtype. Keeps for backward the gate/up output [P, 2F] and, unless `recompute`, the
    activation [P, F] and the gathered rows [P, H] (else x [M, H] and rows).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                w2: torch.Tensor, rows: Optional[torch.Tensor], slots: Optional[torch.Tensor],
                counts: torch.Tensor, recompute: bool) -> torch.Tensor:
        xs = (x if rows is None else x.index_select(0, rows)).to(w1.dtype)
        groups = groups_of(xs, counts)
        h13 = groups.mm(xs, _fused_w13(w1, w3).transpose(1, 2))
        a = swiglu(h13, scale)
        y = groups.mm(a, w2.transpose(1, 2))
        keep = (x, None) if recompute else (xs, a)
        ctx.save_for_backward(*keep, h13, scale, w1, w3, w2, rows, slots)
        ctx.groups, ctx.recompute, ctx.x_dtype = groups, recompute, x.dtype
        return y if rows is None else sum_rows(y, slots)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        xs, a, h13, scale, w1, w3, w2, rows, slots = ctx.saved_tensors
        groups, f = ctx.groups, w1.shape[1]
        grad = grad.to(w1.dtype).contiguous()
        dy = grad if rows is None else grad.index_select(0, rows)
        need_x, need_scale, need_w1, need_w3, need_w2 = ctx.needs_input_grad[:5]
        dh13, dscale, a_again = swiglu_backward(h13, groups.mm(dy, w2), scale, want_a=ctx.recompute and need_w2)
        if ctx.recompute and (need_w1 or need_w3):
            xs = (xs if rows is None else xs.index_select(0, rows)).to(w1.dtype)
        dx = None
        if need_x:
            dxs = groups.mm(dh13, _fused_w13(w1, w3))
            dx = dxs.to(ctx.x_dtype) if rows is None else sum_rows(dxs, slots, ctx.x_dtype)
        dw1, dw3, dw2 = _weight_grads(groups, f, xs, dh13, dy, a_again if ctx.recompute else a,
                                      need_w1, need_w3, need_w2)
        return dx, dscale if need_scale else None, dw1, dw3, dw2, None, None, None, None


def _fused_w13(w1: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """[E_l, 2F, H]: w1 and w3 stacked per expert; a view when they share one allocation, else a copy."""
    e, f, h = w1.shape
    tied = (w1.stride() == (2 * f * h, h, 1) and w3.stride() == w1.stride() and w1.device == w3.device
            and w1.untyped_storage().data_ptr() == w3.untyped_storage().data_ptr()
            and w3.storage_offset() == w1.storage_offset() + f * h)
    if tied:
        return w1.detach().as_strided((e, 2 * f, h), (2 * f * h, h, 1), w1.storage_offset())
    return torch.cat([w1.detach(), w3.detach()], 1)


class GroupedExperts(nn.Module):
    """SwiGLU experts first_expert .. first_expert + E_l - 1 of num_experts.

    recompute_swiglu=True keeps less for backward (docs/api.md): the activation is computed again
    there (one elementwise pass) instead of kept, and with `forward`'s rows the expert-sorted copy of
    them too (one gather).
    """

    def __init__(self, num_experts: int, num_local_experts: int, first_expert: int, hidden: int, ffn_hidden: int,
                 *, dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None,
                 recompute_swiglu: bool = False) -> None:
        super().__init__()
        if not 0 <= first_expert <= num_experts - num_local_experts:
            raise ValueError(f"experts [{first_expert}, {first_expert + num_local_experts}) "
                             f"do not fit in {num_experts}")
        self.num_experts, self.num_local_experts, self.first_expert = num_experts, num_local_experts, first_expert
        self.hidden, self.ffn_hidden = hidden, ffn_hidden
        self.recompute_swiglu = recompute_swiglu
        kw = {"dtype": dtype, "device": device}
        w13 = torch.empty(num_local_experts, 2 * ffn_hidden, hidden, **kw)
        self.w1 = nn.Parameter(w13[:, :ffn_hidden])
        self.w3 = nn.Parameter(w13[:, ffn_hidden:])
        self.w2 = nn.Parameter(torch.empty(num_local_experts, hidden, ffn_hidden, **kw))
        self.reset_parameters()

    def extra_repr(self) -> str:
        last = self.first_expert + self.num_local_experts - 1
        return f"experts {self.first_expert}..{last} of {self.num_experts}, hidden={self.hidden}, ffn={self.ffn_hidden}"

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draw every GLOBAL expert in turn and keep the local ones, so the weights (and the RNG
        state afterwards) do not depend on how experts are sharded."""
        for e in range(self.num_experts):
            local = e - self.first_expert
            for w in (self.w1, self.w3, self.w2):
                draw = torch.empty_like(w[0]).normal_(std=INIT_STD)
                if 0 <= local < self.num_local_experts:
                    w[local].copy_(draw)

    @property
    def fused_w13(self) -> torch.Tensor:
        """[E_l, 2F, H] (detached): w1 and w3 stacked per expert, the gate/up GEMM's weights."""
        return _fused_w13(self.w1, self.w3)

    def _apply(self, fn: Any, recurse: bool = True) -> "GroupedExperts":
        """Module.to() and friends give w1 and w3 separate tensors: put them back in one allocation."""
        super()._apply(fn, recurse)
        with torch.no_grad():
            w13 = torch.cat([self.w1, self.w3], 1)
            self.w1.data, self.w3.data = w13[:, : self.ffn_hidden], w13[:, self.ffn_hidden :]
        return self

    # ---- compute ----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Normal mode: x [M, H] received rows, topk_idx [M, K] LOCAL expert ids (-1: elsewhere),
        topk_weights [M, K] float32 -> [M, H] in the weights' dtype,
        row m = sum_k w[m, k] * expert_{idx[m, k]}(x[m]).

        Each (row, local expert) pair becomes one row, sorted by expert (`route`); the router weight
        scales its activation before the down projection, and row m sums its pairs from +0.0 in
        ascending k in float32, rounded once.
        """
        r = route(topk_idx, self.num_local_experts)
        return self._apply_experts(x, topk_weights.reshape(-1)[r.pairs], r.rows, r.slots, r.counts)

    def _apply_experts(self, x: torch.Tensor, scale: torch.Tensor, rows: Optional[torch.Tensor],
                       slots: Optional[torch.Tensor], counts: torch.Tensor) -> torch.Tensor:
        """_SwiGLUExperts over this module's weights."""
        return _SwiGLUExperts.apply(x, scale, self.w1, self.w3, self.w2, rows, slots, counts, self.recompute_swiglu)

    def forward_sorted(self, x: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Rows already grouped by local expert, one pair per row (counts [E_l] rows per expert, in
        order; weights [P] float32) -> [P, H] weighted outputs in the same order, in the weights'
        dtype: no gather, no sum (an expert-major dispatch's pairs; its combine sums each row's)."""
        return self._apply_experts(x, weights, None, None, counts)

    def forward_padded(self, x: torch.Tensor, counts: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Low-latency mode: x [E_l, C, H] expert-major rows (each expert's valid rows first), counts [E_l]
        valid rows per expert on the device (None: all C) -> [E_l, C, H] unweighted outputs in x's dtype
        (outputs of rows past the valid ones are unspecified).

        No host sync on the counts, so the call can be captured in a CUDA graph and traced by torch.compile
        without data-dependent shapes: with counts on CUDA in bf16, only the valid rows are computed
        (moe_ep.moe.decode_experts); otherwise every slot (batched matmul).
        """
        xs = x.to(self.w1.dtype)
        if counts is not None and decode_experts.supported(xs, self.w1, self.w3, self.w2):
            return decode_experts.decode_experts(xs, self.w1, self.w3, self.w2, counts).to(x.dtype)
        h = F.silu(torch.bmm(xs, self.w1.transpose(1, 2))) * torch.bmm(xs, self.w3.transpose(1, 2))
        return torch.bmm(h, self.w2.transpose(1, 2)).to(x.dtype)
    # ---- per-expert state dict ----------------------------------------------------------------
    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        for local in range(self.num_local_experts):
            for name in WEIGHT_NAMES:
                param = getattr(self, name)
                t = param[local] if keep_vars else param.detach()[local]
                destination[f"{prefix}{self.first_expert + local}.{name}"] = t

    def _load_from_state_dict(self, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
                              missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        """Take this rank's experts; keys of other valid experts are expected (resharding), not errors."""
        pattern = re.compile(rf"^{re.escape(prefix)}(\d+)\.({'|'.join(WEIGHT_NAMES)})$")
        for key in state_dict:
            if not key.startswith(prefix):
                continue
            match = pattern.match(key)
            if match is None or int(match.group(1)) >= self.num_experts:
                unexpected_keys.append(key)
        for name in WEIGHT_NAMES:
            param = getattr(self, name)
            for local in range(self.num_local_experts):
                key = f"{prefix}{self.first_expert + local}.{name}"
                if key not in state_dict:
                    missing_keys.append(key)
                    continue
                value = state_dict[key]
                if value.shape != param.shape[1:]:
                    error_msgs.append(f"size mismatch for {key}: checkpoint {list(value.shape)}, "
                                      f"model {list(param.shape[1:])}")
                    continue
                with torch.no_grad():
                    param[local].copy_(value)
