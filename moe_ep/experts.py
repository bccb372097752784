"""Grouped SwiGLU experts: the E_l experts one rank owns, run over the rows dispatch delivered.

Weights are stacked per local expert in nn.Linear layout (w1, w3: [E_l, F, H]; w2: [E_l, H, F]);
out = w2 @ (silu(w1 @ x) * (w3 @ x)). The state dict holds one tensor per expert under its GLOBAL
id (`{e}.w1`, `{e}.w2`, `{e}.w3`), so a checkpoint written at one expert-parallel size loads at
another: merge the ranks' dicts and every rank picks its own experts.

Rows and their (row, expert) pairs meet through fixed-order sums (`_sum_rows`) rather than
index_add or autograd's index backward, whose atomic adds (CUDA; CPU threads in float32) make the
bits change from run to run.
"""
from __future__ import annotations

import re
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

WEIGHT_NAMES = ("w1", "w2", "w3")
INIT_STD = 0.02


def _row_slots(rows: torch.Tensor, num_rows: int, width: int) -> torch.Tensor:
    """[num_rows, width] int64: slots[r, j] is the position of the j-th occurrence of r in `rows`
    (ascending), -1 past its last; no row may occur more than `width` times."""
    order = torch.argsort(rows, stable=True)
    sorted_rows = rows[order]
    counts = torch.bincount(rows, minlength=num_rows)
    first = torch.cumsum(counts, 0) - counts
    nth = torch.arange(rows.numel(), device=rows.device) - first[sorted_rows]
    slots = torch.full((num_rows, width), -1, dtype=torch.int64, device=rows.device)
    slots[sorted_rows, nth] = order  # every (row, nth) once: no accumulation
    return slots


def _sum_rows(src: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """out[r] = +0.0 + src[slots[r, 0]] + src[slots[r, 1]] + ... left to right, in src's dtype: the
    bits of a serial zeros.index_add(0, rows, src), on every device and run."""
    out = src.new_zeros(slots.shape[0], *src.shape[1:])
    if src.shape[0] == 0:
        return out
    for j in range(slots.shape[1]):
        slot = slots[:, j]
        out = torch.where((slot >= 0).unsqueeze(1), out + src[slot.clamp_min(0)], out)
    return out


class _GatherRows(torch.autograd.Function):
    """x[rows]; backward sums each row's gradients with _sum_rows (in x's dtype)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(slots)
        return x[rows]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (slots,) = ctx.saved_tensors
        return _sum_rows(grad, slots), None, None


class _SumRows(torch.autograd.Function):
    """zeros(len(slots), ...).index_add(0, rows, src), summed by _sum_rows; backward gathers grad[rows]."""

    @staticmethod
    def forward(ctx: Any, src: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows)
        return _sum_rows(src, slots)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (rows,) = ctx.saved_tensors
        return grad[rows], None, None


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """torch._grouped_mm runs on CUDA sm90+ in bf16; elsewhere the experts loop one by one."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


class GroupedExperts(nn.Module):
    """SwiGLU experts first_expert .. first_expert + E_l - 1 of num_experts."""

    def __init__(self, num_experts: int, num_local_experts: int, first_expert: int, hidden: int, ffn_hidden: int,
                 *, dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None) -> None:
        super().__init__()
        if not 0 <= first_expert <= num_experts - num_local_experts:
            raise ValueError(f"experts [{first_expert}, {first_expert + num_local_experts}) "
                             f"do not fit in {num_experts}")
        self.num_experts, self.num_local_experts, self.first_expert = num_experts, num_local_experts, first_expert
        self.hidden, self.ffn_hidden = hidden, ffn_hidden
        kw = {"dtype": dtype, "device": device}
        self.w1 = nn.Parameter(torch.empty(num_local_experts, ffn_hidden, hidden, **kw))
        self.w3 = nn.Parameter(torch.empty(num_local_experts, ffn_hidden, hidden, **kw))
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

    # ---- compute ----------------------------------------------------------------------------
    def _swiglu_loop(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Expert-sorted rows x [P, H], counts[e] rows per local expert -> [P, H]."""
        outs = []
        for e, rows in enumerate(x.split(counts)):
            h = F.silu(rows @ self.w1[e].t()) * (rows @ self.w3[e].t())
            outs.append(h @ self.w2[e].t())
        return torch.cat(outs)

    def _swiglu_grouped(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Same as _swiglu_loop through torch._grouped_mm; `counts` stays on the device (no sync)."""
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        gate = torch._grouped_mm(x, self.w1.transpose(-2, -1), offs=offs)
        up = torch._grouped_mm(x, self.w3.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(F.silu(gate) * up, self.w2.transpose(-2, -1), offs=offs)

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Normal mode: x [M, H] received rows, topk_idx [M, K] LOCAL expert ids (-1: elsewhere),
        topk_weights [M, K] float32 -> [M, H] float32, row m = sum_k w[m, k] * expert_{idx[m, k]}(x[m]).

        Each (row, local expert) pair becomes one row; pairs are sorted by expert (stable, so by row
        inside an expert), run through the experts, scaled by their weight (the epilogue) and summed
        back into their rows in float32, in pair order (ascending expert, then k).
        """
        m, k = topk_idx.shape
        flat = topk_idx.reshape(-1)
        pairs = (flat >= 0).nonzero().squeeze(1)
        expert = flat[pairs]
        order = torch.argsort(expert, stable=True)
        pairs, expert = pairs[order], expert[order]
        rows = pairs // k
        slots = _row_slots(rows, m, k)
        xs = _GatherRows.apply(x, rows, slots).to(self.w1.dtype)
        counts = torch.bincount(expert, minlength=self.num_local_experts)
        if grouped_mm_supported(xs) and xs.shape[0] > 0:
            y = self._swiglu_grouped(xs, counts)
        else:
            y = self._swiglu_loop(xs, counts.tolist())
        y = y.float() * topk_weights.reshape(-1)[pairs].unsqueeze(1)
        return _SumRows.apply(y, rows, slots)

    def forward_padded(self, x: torch.Tensor) -> torch.Tensor:
        """Low-latency mode: x [E_l, C, H] expert-major rows (each expert's valid rows first)
        -> [E_l, C, H] unweighted outputs in x's dtype (outputs of rows past the valid ones are unspecified).

        Every slot is computed (batched matmul): no host sync on the counts, so the call can be captured
        in a CUDA graph and traced by torch.compile without data-dependent shapes.
        """
        xs = x.to(self.w1.dtype)
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
