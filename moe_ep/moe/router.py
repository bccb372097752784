"""TopKRouter: a linear gate that picks K experts per token, with the balancing tools MoE training needs.

Scores are softmax or sigmoid of float32 logits. Selection may be group-limited (DeepSeek-V3: keep
the `topk_groups` groups whose two best scores sum highest, then take the top K inside them) and may
add a per-expert bias that steers selection only (aux-loss-free balancing). The returned weights
are the unbiased scores of the chosen experts, optionally renormalised and scaled. Two losses are
available: a switch-style load-balancing loss and the router z-loss. A capacity factor drops the
assignments that overflow an expert; they come back as -1 and are counted, never silently.
On CUDA the selection and its backward are one Triton pass each (moe_ep.moe.router_kernels, as the custom op
moe_ep::route, so torch.compile calls the same kernels) and the float32 gate of bf16 tokens runs on bf16 tensor
cores (moe_ep.moe.split_gate); the CPU runs the torch ops below.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import router_kernels, split_gate

SCORE_FUNCS = ("softmax", "sigmoid")


@dataclass
class RouterOutput:
    """What the router decided for N tokens.

    `tokens_per_expert` counts the (token, k) selections per expert before capacity dropping: the
    load the router asked for, which the balancing loss and the expert bias act on. `num_dropped`
    counts the selections removed by the capacity limit (they are -1 in `topk_idx`, 0 in weights).
    `aux_loss` and `z_loss` are already multiplied by their coefficients (0 when the coefficient is 0).
    """

    topk_idx: torch.Tensor  # [N, K] int64 global expert ids, -1 for dropped selections
    topk_weights: torch.Tensor  # [N, K] float32, 0 for dropped selections
    aux_loss: torch.Tensor  # scalar float32
    z_loss: torch.Tensor  # scalar float32
    tokens_per_expert: torch.Tensor  # [E] int64
    num_dropped: torch.Tensor  # scalar int64


def count_ids(ids: torch.Tensor, n: int) -> torch.Tensor:
    """How often each of 0..n-1 occurs in ids (int64 [n]). Unlike torch.bincount on CUDA it needs no host
    sync, so a router inside a CUDA graph can count; integer adds, so the order does not matter."""
    return torch.zeros(n, dtype=torch.int64, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))


class TopKRouter(nn.Module):
    """Linear gate [E, H] -> scores -> (group-limited) top-k, plus balancing losses and expert bias.

    aux_loss_group: when given, the per-expert selection counts in the balancing loss are summed
    over this process group, so the loss averaged over its ranks equals the loss of the whole batch
    on one rank (the forward is then collective over the group).
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int, *, score_func: str = "softmax",
                 num_groups: int = 1, topk_groups: int = 1, norm_topk_prob: bool = True,
                 routed_scaling_factor: float = 1.0, aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0,
                 expert_bias: bool = False, bias_update_rate: float = 1e-3,
                 capacity_factor: Optional[float] = None, aux_loss_group: Optional[dist.ProcessGroup] = None,
                 device: Optional[torch.device] = None) -> None:
        super().__init__()
        if score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must lie in [1, num_experts={num_experts}], got {top_k}")
        if num_groups < 1 or num_experts % num_groups != 0:
            raise ValueError(f"num_groups ({num_groups}) must divide num_experts ({num_experts})")
        if not 1 <= topk_groups <= num_groups:
            raise ValueError(f"topk_groups must lie in [1, num_groups={num_groups}], got {topk_groups}")
        if top_k > topk_groups * (num_experts // num_groups):
            raise ValueError(f"top_k ({top_k}) exceeds the experts in {topk_groups} of {num_groups} groups")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be positive or None, got {capacity_factor!r}")
        self.hidden, self.num_experts, self.top_k = hidden, num_experts, top_k
        self.score_func = score_func
        self.num_groups, self.topk_groups = num_groups, topk_groups
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.aux_loss_coef, self.z_loss_coef = float(aux_loss_coef), float(z_loss_coef)
        self.bias_update_rate = float(bias_update_rate)
        self.capacity_factor = capacity_factor
        self.aux_loss_group = aux_loss_group
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, device=device, dtype=torch.float32))
        self.expert_bias: Optional[torch.Tensor]
        self.register_buffer("expert_bias", torch.zeros(num_experts, device=device) if expert_bias else None)
        self._gate_parts = split_gate.GateWeightParts()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Small gate weights (std 0.02, as for the other projections) so routing starts near uniform."""
        nn.init.normal_(self.weight, std=0.02)

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, num_experts={self.num_experts}, top_k={self.top_k}, "
                f"score_func={self.score_func}, groups={self.topk_groups}/{self.num_groups}")

    # ---- selection ------------------------------------------------------------------------
    def _select(self, choice: torch.Tensor) -> torch.Tensor:
        """Top-k expert ids [N, K] of `choice` scores, restricted to the best groups when grouped."""
        if self.num_groups > 1:
            n = choice.shape[0]
            grouped = choice.view(n, self.num_groups, self.num_experts // self.num_groups)
            best2 = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [N, G]
            keep = torch.zeros_like(best2, dtype=torch.bool)
            keep.scatter_(1, best2.topk(self.topk_groups, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(n, self.num_experts)
        return choice.topk(self.top_k, dim=-1).indices

    def _drop_over_capacity(self, topk_idx: torch.Tensor) -> torch.Tensor:
        """Keep at most ceil(capacity_factor * N * K / E) selections per expert; -1 for the rest.

        Priority: every token's first choice before any second choice, and so on; inside one k, by
        token index. Deterministic and independent of scores.
        """
        n, k = topk_idx.shape
        capacity = math.ceil(self.capacity_factor * n * k / self.num_experts)
        flat = topk_idx.t().reshape(-1)  # k-major priority order
        order = torch.argsort(flat, stable=True)
        counts = count_ids(flat, self.num_experts)
        first = torch.cumsum(counts, 0) - counts
        position = torch.empty_like(flat)
        position[order] = torch.arange(flat.numel(), device=flat.device) - first[flat[order]]
        kept = torch.where(position < capacity, flat, torch.full_like(flat, -1))
        return kept.view(k, n).t().contiguous()

    # ---- losses ---------------------------------------------------------------------------
    def _aux_loss(self, scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """coef * E * sum_e f_e * P_e: f_e = share of the N*K selections, P_e = mean normalised score."""
        n = scores.shape[0]
        total = scores.new_full((1,), float(n))
        load = counts.float()
        if self.aux_loss_group is not None:
            stats = torch.cat([load, total])
            dist.all_reduce(stats, group=self.aux_loss_group)
            load, total = stats[:-1], stats[-1:]
        probs = scores if self.score_func == "softmax" else scores / scores.sum(-1, keepdim=True).clamp_min(1e-20)
        f = load / (total * self.top_k).clamp_min(1.0)
        p = probs.sum(0) / max(n, 1)
        return self.aux_loss_coef * self.num_experts * (f * p).sum()

    def _z_loss(self, logits: torch.Tensor) -> torch.Tensor:
        """coef * mean over tokens of logsumexp(logits)^2: keeps the gate logits small."""
        return self.z_loss_coef * torch.logsumexp(logits, dim=-1).square().sum() / max(logits.shape[0], 1)

    # ---- forward --------------------------------------------------------------------------
    def gate_scores(self, logits: torch.Tensor) -> torch.Tensor:
        """The gate's scores: softmax or sigmoid of the float32 logits."""
        return logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()

    def chosen_weights(self, scores: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
        """The chosen experts' unbiased scores, renormalised (norm_topk_prob) and scaled."""
        # gather's backward scatter-adds (atomics on CUDA), but a row's top-k ids are distinct: each
        # element gets at most one add, so the bits do not depend on the order
        weights = scores.gather(1, topk_idx)
        if self.norm_topk_prob and self.top_k > 1:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
        return weights * self.routed_scaling_factor

    def _route_torch(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(topk_idx, topk_weights, counts, scores) in torch ops: the CPU and the cases the kernel lacks."""
        scores = self.gate_scores(logits)
        choice = scores.detach()
        if self.expert_bias is not None:
            choice = choice + self.expert_bias
        topk_idx = self._select(choice)
        return topk_idx, self.chosen_weights(scores, topk_idx), count_ids(topk_idx.flatten(), self.num_experts), scores

    def _fused(self, logits: torch.Tensor) -> bool:
        """Whether this forward selects in one Triton pass (moe_ep.moe.router_kernels), eager or compiled alike."""
        return logits.is_cuda and router_kernels.supports(self.num_experts, self.num_groups)

    def _route_fused(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(topk_idx, topk_weights, counts, scores) from the one-pass kernel (the op moe_ep::route, whose backward
        is the other pass: the scores recomputed from the logits, differentiated at the same ids). The scores
        are stored only where the balancing loss reads them (an empty tensor otherwise)."""
        return router_kernels.route_op(logits, self.expert_bias, self.top_k, self.score_func == "softmax",
                                       self.num_groups, self.topk_groups, self.norm_topk_prob and self.top_k > 1,
                                       self.routed_scaling_factor, bool(self.aux_loss_coef))

    def forward(self, x: torch.Tensor) -> RouterOutput:
        """Route x [N, H] (any float dtype; the gate runs in float32: on bf16 tensor cores for bf16 x on CUDA,
        moe_ep.moe.split_gate)."""
        if split_gate.available(x, self.weight):
            logits = split_gate.gate_logits(x, self.weight, self._gate_parts)
        else:
            logits = F.linear(x.float(), self.weight.float())
        if self._fused(logits):
            topk_idx, weights, counts, scores = self._route_fused(logits)
        else:
            topk_idx, weights, counts, scores = self._route_torch(logits)
        zero = logits.new_zeros(())
        aux = self._aux_loss(scores, counts) if self.aux_loss_coef else zero
        z = self._z_loss(logits) if self.z_loss_coef else zero
        num_dropped = torch.zeros((), dtype=torch.int64, device=x.device)
        if self.capacity_factor is not None:
            kept = self._drop_over_capacity(topk_idx)
            dropped = kept < 0
            num_dropped = dropped.sum()
            topk_idx = kept
            weights = weights.masked_fill(dropped, 0.0)
        return RouterOutput(topk_idx.contiguous(), weights.contiguous(), aux, z, counts, num_dropped)

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """Aux-loss-free balancing step: bias_e += rate * sign(mean load - load_e).

        Call it with the load summed over every rank that shares this router (all ranks must pass
        the same counts so the replicated bias stays identical).
        """
        if self.expert_bias is None:
            raise RuntimeError("this router was built without expert_bias=True")
        load = tokens_per_expert.to(self.expert_bias.device, torch.float32)
        self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)
