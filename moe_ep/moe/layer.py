"""MoE: router -> dispatch -> grouped SwiGLU experts (weighted in their epilogue) -> combine.
Exact-size normal mode dispatches expert-major by default (moe_ep.comm.expert_major): the experts get
their (row, local expert) pairs grouped by expert and the combine sums each row's pairs, so the
layer runs no permutation pass of its own (expert_major=False: rows, sorted by the experts).

Everything crosses ranks through one `moe_ep.Buffer`, so the layer runs on every backend. The
Buffer fixes hidden size, expert count and top-k; this rank owns experts
[rank * E_l, (rank + 1) * E_l). The router (with its expert bias) and the optional shared expert are
replicated: construction copies the group's first rank's values to every rank (as DDP does), so a
rank seeded differently cannot silently compute with another router; train them data-parallel and
call sync_replicated() after loading rank-specific values. Expert weights exist only on their owner.

Two modes, which every rank of the group must pick alike:
- "normal" (training, prefill): differentiable dispatch/combine (moe_ep.moe.autograd); with
  worst_case=True the dispatch output has R * T rows (static shapes, no wait for the counts).
- "low_latency" (decode, no autograd): expert-major buffers; the router weights are applied by
  low_latency_combine instead of the experts' epilogue. Needs a Buffer made with low_latency=True.
mode=None picks low-latency when the Buffer has it, autograd is off and no rank has more than
`low_latency_max_tokens` tokens (one small all-reduce decides it; pass the mode to avoid it, e.g.
under CUDA-graph capture or torch.compile).

Communication goes through the moe_ep custom ops (moe_ep.moe.ops), so torch.compile traces the layer.
Overlap of communication with computation (normal mode's communication stream, the start/compute/finish
decode API) lives in moe_ep.moe.overlap.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import autograd, fp8_normal, ops, overlap
from ..comm import fp8
from . import fp8_experts as fp8_experts_module
from ..comm.buffer import Buffer
from .experts import GroupedExperts
from .router import RouterOutput, TopKRouter

MODES = ("normal", "low_latency")


class SwiGLU(nn.Module):
    """Dense SwiGLU MLP, used as the shared expert."""

    def __init__(self, hidden: int, ffn_hidden: int, *, dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device] = None) -> None:
        super().__init__()
        kw = {"bias": False, "dtype": dtype, "device": device}
        self.w1 = nn.Linear(hidden, ffn_hidden, **kw)
        self.w3 = nn.Linear(hidden, ffn_hidden, **kw)
        self.w2 = nn.Linear(ffn_hidden, hidden, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


@torch.compiler.disable
def _row_experts(experts: GroupedExperts, d: autograd.Dispatched) -> torch.Tensor:
    """Exact-size mode's experts over dispatched rows: each row's pairs sorted by expert (a host read
    of the counts), so torch.compile runs them eagerly: that mode's one graph break."""
    return experts(d.x, d.topk_idx, d.topk_weights)


@torch.compiler.disable
def _sparse_experts(experts: GroupedExperts, d: autograd.ExpertMajorDispatched) -> torch.Tensor:
    """Exact-size mode's experts over an expert-major dispatch's pairs (no sort, gather or row sum
    here: the dispatch grouped them, its combine sums them). Their GEMMs split the pairs by
    per-expert counts (a host read, except with torch._grouped_mm) over data-dependent sizes, so
    torch.compile runs them eagerly: that mode's one graph break."""
    return experts.forward_sorted(d.x, d.tokens_per_expert, d.weights)


class MoE(nn.Module):
    """Expert-parallel MoE feed-forward over `buffer`'s group; x [..., H] -> [..., H] in x's dtype.

    Router options are TopKRouter's. `dtype` is the experts' compute dtype (float32, or bf16 for the
    grouped-GEMM path on sm90); communication is always bf16. After each forward, `last_routing`
    holds the RouterOutput and `aux_loss` its two losses summed (add it to the training loss).
    With expert_bias=True, call update_expert_bias() once per optimizer step (collective).
    worst_case=True: normal mode dispatches R * T rows and runs every local expert on all of them
    (static shapes, no wait for the counts: torch.compile without graph breaks, CUDA graphs).
    recompute_swiglu=True: normal mode's experts recompute their SwiGLU activation in backward instead
    of keeping it (docs/api.md says what is kept).
    overlap=True: normal mode runs its dispatch and combine on the Buffer's communication stream, forward and
    backward, so the shared expert runs beside the dispatch and, in backward, its backward beside the
    combine (moe_ep.moe.overlap). Every kernel is the
    one overlap=False runs, on the same inputs: outputs and gradients are the same bits, each expert's
    GEMM stays whole, and where nothing runs beside the communication it costs a few CUDA events. Every
    rank must pass the same value: the first normal-mode forward checks it (one all_gather_object) and
    raises ValueError on every rank when they differ. SM budget: each dispatch and combine gets the
    Buffer's num_sms; the experts' kernels take the rest.
    expert_major=True (the default): exact-size normal mode dispatches (row, local expert) pairs grouped
    by expert (moe_ep.comm.expert_major) and its combine sums them, so the experts sort, gather and sum
    nothing and the forward makes one host sync (the dispatch's counts) instead of two (docs/benchmarks.md,
    issue 21: 7.61 against 7.91 ms per forward at the issue's shape); expert_major=False keeps rows and
    sorts them by expert in the experts (experts.route).
    fp8_experts=True: normal mode dispatches the tokens in FP8 as (row, local expert) pairs and the experts'
    grouped GEMMs read those rows and their per-128 scales directly, against FP8 copies of the weights with
    128 x 128 block scales (moe_ep.moe.fp8_experts); its backward runs the data-gradient GEMMs in FP8 and
    the weight gradients in bf16 (moe_ep.moe.fp8_normal), or with fp8_wgrad=True in FP8 too, with 1 x 128 scales
    along each expert's tokens (moe_ep.moe.fp8_wgrad). Low-latency mode keeps its bf16 experts.
    """

    def __init__(self, buffer: Buffer, ffn_hidden: int, *, score_func: str = "softmax", num_groups: int = 1,
                 topk_groups: int = 1, norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0,
                 aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0, expert_bias: bool = False,
                 bias_update_rate: float = 1e-3, capacity_factor: Optional[float] = None,
                 shared_ffn_hidden: int = 0, low_latency_max_tokens: int = 128, low_latency_fp8: bool = False,
                 worst_case: bool = False, dtype: Optional[torch.dtype] = None, recompute_swiglu: bool = False,
                 overlap: bool = False, fp8_experts: bool = False, expert_major: bool = True,
                 fp8_wgrad: bool = False) -> None:
        super().__init__()
        cfg = buffer.cfg
        if fp8_experts:
            fp8_experts_module.check_shapes(cfg.hidden, ffn_hidden)
            if overlap:
                raise ValueError("fp8_experts=True has no overlap mode: pass overlap=False")
        elif fp8_wgrad:
            raise ValueError("fp8_wgrad=True needs fp8_experts=True (the FP8 experts' backward)")
        if not isinstance(overlap, bool):
            raise ValueError(f"overlap must be a bool, got {overlap!r}")
        if low_latency_fp8 and cfg.hidden % fp8.BLOCK != 0:
            raise ValueError(f"low_latency_fp8 needs hidden to be a multiple of {fp8.BLOCK}, got {cfg.hidden}")
        self.buffer = buffer
        self.buffer_id = ops.register(buffer)
        self.worst_case = worst_case
        self.overlap = overlap
        self._overlap_checked = cfg.world_size == 1
        self.hidden, self.num_experts, self.top_k = cfg.hidden, cfg.num_experts, cfg.num_topk
        self.low_latency_max_tokens = low_latency_max_tokens
        self.low_latency_fp8 = low_latency_fp8
        self.router = TopKRouter(
            cfg.hidden, cfg.num_experts, cfg.num_topk, score_func=score_func, num_groups=num_groups,
            topk_groups=topk_groups, norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor,
            aux_loss_coef=aux_loss_coef, z_loss_coef=z_loss_coef, expert_bias=expert_bias,
            bias_update_rate=bias_update_rate, capacity_factor=capacity_factor,
            aux_loss_group=cfg.group if cfg.world_size > 1 else None, device=cfg.device,
        )
        e_l = cfg.num_local_experts
        self.experts = GroupedExperts(cfg.num_experts, e_l, cfg.rank * e_l, cfg.hidden, ffn_hidden,
                                      dtype=dtype, device=cfg.device, recompute_swiglu=recompute_swiglu)
        self.shared = (SwiGLU(cfg.hidden, shared_ffn_hidden, dtype=dtype, device=cfg.device)
                       if shared_ffn_hidden else None)
        self.expert_load: Optional[torch.Tensor]
        self.register_buffer("expert_load", torch.zeros(cfg.num_experts, dtype=torch.int64, device=cfg.device)
                             if expert_bias else None, persistent=False)
        self.last_routing: Optional[RouterOutput] = None
        self.fp8_weights = fp8_experts_module.FP8WeightCache() if fp8_experts else None
        self.fp8_wgrad = bool(fp8_wgrad)
        self.expert_major = bool(expert_major)
        self.sync_replicated()

    def replicated_tensors(self) -> dict[str, torch.Tensor]:
        """The state every rank of the group holds alike, by state-dict key: the router's weight and
        expert bias and the shared expert's weights."""
        parts = {"router": self.router, "shared": self.shared}
        return {f"{prefix}.{name}": t for prefix, module in parts.items() if module is not None
                for name, t in [*module.named_parameters(), *module.named_buffers()]}

    @torch.no_grad()
    def sync_replicated(self) -> None:
        """Collective: copies the group's first rank's replicated_tensors() to every rank (one broadcast
        each). Construction runs it; run it again after loading a state that may differ per rank."""
        cfg = self.buffer.cfg
        if cfg.world_size == 1:
            return
        first = dist.get_global_rank(cfg.group, 0)
        for t in self.replicated_tensors().values():
            dist.broadcast(t, src=first, group=cfg.group)

    @property
    def aux_loss(self) -> torch.Tensor:
        """Balancing loss + z-loss of the last forward (coefficients applied)."""
        if self.last_routing is None:
            raise RuntimeError("aux_loss is only available after a forward pass")
        return self.last_routing.aux_loss + self.last_routing.z_loss

    def _pick_mode(self, num_tokens: int) -> str:
        cfg = self.buffer.cfg
        if not cfg.low_latency or torch.is_grad_enabled():
            return "normal"
        most = torch.tensor([num_tokens], device=cfg.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=cfg.group)
        return "low_latency" if int(most.item()) <= self.low_latency_max_tokens else "normal"

    @property
    def _pair_dtype(self) -> torch.dtype:
        """What exact-size mode's pairs travel to and from the experts in: the experts' dtype where an
        expert-major combine sums it (bf16, float32), else float32."""
        dtype = self.experts.w1.dtype
        return dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32

    def dispatch(self, tokens: torch.Tensor, topk_idx: torch.Tensor,
                 topk_weights: torch.Tensor) -> autograd.Dispatched | autograd.ExpertMajorDispatched:
        """Normal mode's differentiable dispatch of tokens [N, H] bf16: worst-case mode's R * T rows, or
        exact-size mode's rows, or its expert-major pairs with expert_major=True (moe_ep.comm.expert_major)."""
        if self.worst_case or not self.expert_major:
            return autograd.dispatch(self.buffer, tokens, topk_idx, topk_weights, worst_case=self.worst_case)
        return autograd.dispatch_expert_major(self.buffer, tokens, topk_idx, topk_weights, dtype=self._pair_dtype)

    def run_experts(self, d: autograd.Dispatched | autograd.ExpertMajorDispatched) -> torch.Tensor:
        """Normal mode's local experts over one dispatch -> what its combine takes: worst-case mode's
        [M, H] bf16 weighted row sums, exact-size mode's [P, H] weighted pair outputs (bf16 or float32,
        summed per row by the combine in float32 and rounded once)."""
        if self.worst_case:
            return self._static_experts(d).to(torch.bfloat16)
        if not self.expert_major:
            return _row_experts(self.experts, d).to(torch.bfloat16)
        return _sparse_experts(self.experts, d).to(self._pair_dtype)

    def shared_forward(self, tokens: torch.Tensor) -> Optional[torch.Tensor]:
        """The shared expert over tokens [N, H] in its weights' dtype, or None without one."""
        return None if self.shared is None else self.shared(tokens.to(self.shared.w1.weight.dtype))

    def _check_overlap(self) -> None:
        """Once, at the first eager normal-mode forward: every rank uses the same overlap setting."""
        if self._overlap_checked or torch.compiler.is_compiling():
            return
        if self.buffer.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("run one normal-mode forward of this MoE before capturing a CUDA graph: the first "
                               "forward checks (collectively) that every rank uses the same overlap setting")
        overlap.check_setting(self.buffer, self.overlap)
        self._overlap_checked = True

    def _static_experts(self, d: autograd.Dispatched) -> torch.Tensor:
        """Worst-case mode's experts, free of data-dependent shapes (torch.compile, CUDA graphs):
        every local expert runs on every received row (padding rows are zero), and row m sums its
        weighted experts' outputs in ascending expert order in float32."""
        m, e_l = d.x.shape[0], self.buffer.cfg.num_local_experts
        rows = d.x.to(self.experts.w1.dtype)
        y = self.experts.forward_padded(rows.expand(e_l, m, self.hidden)).float()
        out = torch.zeros(m, self.hidden, dtype=torch.float32, device=rows.device)
        for e in range(e_l):
            w = torch.where(d.topk_idx == e, d.topk_weights, torch.zeros_like(d.topk_weights)).sum(1)
            out = out + w.unsqueeze(1) * y[e]
        return out

    @staticmethod
    def _check_no_grad(x: torch.Tensor, routing: RouterOutput) -> None:
        if torch.is_grad_enabled() and (x.requires_grad or routing.topk_weights.requires_grad):
            raise RuntimeError("low-latency mode has no backward: run it under torch.no_grad() "
                               "or use mode='normal'")

    def _low_latency(self, x: torch.Tensor, routing: RouterOutput) -> torch.Tensor:
        """Low-latency mode through the custom ops (what torch.compile traces; no receive hooks)."""
        self._check_no_grad(x, routing)
        recv, scales, count, handle = ops.low_latency_dispatch(
            x.to(torch.bfloat16).contiguous(), routing.topk_idx, self.buffer_id, self.low_latency_fp8, False)
        rows = fp8.dequantize(recv, scales) if self.low_latency_fp8 else recv
        y = self.experts.forward_padded(rows, count).to(torch.bfloat16)
        return ops.low_latency_combine(y, routing.topk_idx, routing.topk_weights, handle, self.buffer_id)

    @torch.compiler.disable
    def _fp8_normal(self, tokens: torch.Tensor, routing: RouterOutput) -> torch.Tensor:
        """Normal mode with FP8 experts (moe_ep.moe.fp8_normal): FP8 expert-major dispatch, FP8 grouped GEMMs on
        the received pairs, bf16 combine; differentiable."""
        e = self.experts
        return fp8_normal.FP8Normal.apply(tokens, routing.topk_idx, routing.topk_weights, e.w1, e.w3, e.w2,
                                          self.buffer, e, self.fp8_weights, self.fp8_wgrad)

    def forward(self, x: torch.Tensor, mode: Optional[str] = None) -> torch.Tensor:
        """Route, dispatch, run the local experts, combine; plus the shared expert when present."""
        if mode is not None and mode not in MODES:
            raise ValueError(f"mode must be one of {MODES} or None, got {mode!r}")
        tokens, routing = self._route(x)
        mode = mode or self._pick_mode(tokens.shape[0])
        if mode == "low_latency":
            if not torch.compiler.is_compiling():
                self._check_no_grad(tokens, routing)
                return overlap.start(self, x, tokens, routing).finish()
            out, shared = self._low_latency(tokens, routing), self.shared_forward(tokens)
        elif self.fp8_weights is not None:
            out, shared = self._fp8_normal(tokens, routing), self.shared_forward(tokens)
        else:
            self._check_overlap()
            out, shared = overlap.normal(self, tokens, routing, lambda: self.shared_forward(tokens))
        out = out.to(x.dtype)
        if shared is not None:
            out = out + shared.to(x.dtype)
        return out.view(x.shape)

    def start(self, x: torch.Tensor) -> overlap.PendingMoE:
        """Decode, phase one of a low-latency step (moe_ep.moe.overlap.PendingMoE): route x [..., H], send its
        tokens to their experts and run the shared expert; `.compute()` and `.finish()` do the rest, so
        another micro-batch's work can run between the phases. Needs a Buffer with low_latency=True
        and autograd off (or x without grad); every rank calls each phase, in the same order."""
        tokens, routing = self._route(x)
        self._check_no_grad(tokens, routing)
        return overlap.start(self, x, tokens, routing)

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, RouterOutput]:
        """x [..., H] as tokens [N, H] and their routing (kept in last_routing, counted in expert_load)."""
        if x.shape[-1] != self.hidden:
            raise ValueError(f"x must have {self.hidden} features in its last dimension, got {list(x.shape)}")
        tokens = x.reshape(-1, self.hidden)
        routing = self.router(tokens)
        self.last_routing = routing
        if self.training and self.expert_load is not None:
            self.expert_load += routing.tokens_per_expert
        return tokens, routing

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """Sum the load seen since the last call over the group, step the router's bias, reset."""
        if self.expert_load is None:
            raise RuntimeError("this MoE was built without expert_bias=True")
        load = self.expert_load.clone()
        if self.buffer.cfg.world_size > 1:
            dist.all_reduce(load, group=self.buffer.cfg.group)
        self.router.update_expert_bias(load)
        self.expert_load.zero_()
