"""MoE layer (reference backend, gloo, CPU, R = 1, 2, 4) against a dense single-process reference.

The reference runs every expert locally on the same weights (all experts, gathered from a seeded
generator) with plain per-expert loops, and its gradients are summed over ranks for the experts.
Its experts and its shared expert are SwiGLUs written here in float64 from plain tensor operations
(_swiglu_f64: no moe_ep module, not even F.silu), so a wrong activation in the library's SwiGLU or
GroupedExperts fails. The cases cover the expert-major path (the default), the row path
(expert_major=False) and worst-case mode; recompute_swiglu=True must give recompute_swiglu=False's bits.

Tolerances: the layer computes in float32 but communicates in bf16 (the Buffer's contract), so
x is rounded to bf16 before the experts (the reference does the same), each rank's partial output
is rounded to bf16 before combine and the sum again after it, and gradients crossing ranks are
rounded to bf16 once per crossing. bf16 keeps 8 significant bits (relative rounding error at most
2^-9 ~ 0.2%); a value passes at most ~3 roundings and sums over experts/tokens can cancel, so
errors are compared against the largest magnitude of the reference: max|got - want| <= 2% of
max|want|. Routing (integer) must match exactly. Low-latency FP8 (3 mantissa bits) gets 10%.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import moe_ep
from moe_ep import MoE, TopKRouter
from moe_ep.moe.experts import GroupedExperts, grouped_mm_supported
from tests._dist import device, requires_gpus, run_workers

TOL = 2e-2
FP8_TOL = 1e-1


@dataclass
class Case:
    seed: int
    tokens: list[int]  # per rank, cycled over ranks
    hidden: int
    experts: int
    topk: int
    ffn: int
    router: dict = field(default_factory=dict)
    shared: int = 0
    layer: dict = field(default_factory=dict)  # MoE keyword arguments: expert_major, worst_case, ...

    def n(self, rank: int) -> int:
        return self.tokens[rank % len(self.tokens)]


GRAD_CASES = [
    Case(1, [23, 17, 0, 9], 32, 8, 2, 48, dict(aux_loss_coef=0.01, z_loss_coef=1e-3)),
    Case(2, [19, 31, 12, 0], 64, 16, 4, 32,
         dict(score_func="sigmoid", num_groups=4, topk_groups=2, routed_scaling_factor=2.5, expert_bias=True),
         shared=24),
    Case(3, [21, 8, 14, 30], 16, 8, 1, 24, dict(capacity_factor=1.0)),  # K = 1, overflow dropped
    Case(4, [11, 0, 7, 13], 16, 8, 8, 16, dict(norm_topk_prob=False, aux_loss_coef=0.02)),  # 3K > H
    Case(5, [16, 16, 16, 16], 32, 8, 3, 40, dict(score_func="sigmoid", expert_bias=True, capacity_factor=0.8,
                                                  aux_loss_coef=0.01)),
    # the row path (experts sort the received rows) and worst-case mode (static shapes), with a shared expert
    Case(9, [19, 31, 12, 0], 64, 16, 4, 32, dict(score_func="sigmoid", aux_loss_coef=0.01), shared=24,
         layer=dict(expert_major=False)),
    Case(10, [13, 0, 22, 9], 32, 8, 2, 24, dict(aux_loss_coef=0.01), shared=16, layer=dict(worst_case=True)),
]


def _close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = TOL) -> None:
    assert got.shape == want.shape, f"{what}: shape {list(got.shape)} != {list(want.shape)}"
    got, want = got.detach().float(), want.detach().float()
    scale = float(want.abs().max()) if want.numel() else 0.0
    err = float((got - want).abs().max()) if want.numel() else 0.0
    assert err <= tol * scale + 1e-7, f"{what}: max error {err:.3e}, reference max {scale:.3e}"


def _grad(p: torch.Tensor) -> torch.Tensor:
    """p.grad, or zeros where nothing on this rank reached p (a rank with no tokens)."""
    return p.grad if p.grad is not None else torch.zeros_like(p)


def _full_expert_weights(case: Case, device: torch.device) -> dict[str, torch.Tensor]:
    """Every expert's weights [E, ...] from the case seed: the same on every rank."""
    g = torch.Generator().manual_seed(1000 + case.seed)
    s = case.hidden ** -0.5
    return {
        "w1": (torch.randn(case.experts, case.ffn, case.hidden, generator=g) * s).to(device),
        "w3": (torch.randn(case.experts, case.ffn, case.hidden, generator=g) * s).to(device),
        "w2": (torch.randn(case.experts, case.hidden, case.ffn, generator=g) * case.ffn ** -0.5).to(device),
    }


def _build(case: Case, buf: moe_ep.Buffer, dtype: torch.dtype = torch.float32) -> tuple[MoE, dict]:
    """MoE with a spread-out router, random bias, and all experts' weights loaded through a state
    dict that holds every global expert (each rank keeps its own)."""
    torch.manual_seed(case.seed)
    moe = MoE(buf, case.ffn, shared_ffn_hidden=case.shared, dtype=dtype, **case.router, **case.layer)
    full = _full_expert_weights(case, buf.device)
    state = moe.state_dict()
    g = torch.Generator().manual_seed(case.seed)
    state["router.weight"] = torch.randn(case.experts, case.hidden, generator=g).to(buf.device)
    if moe.router.expert_bias is not None:
        state["router.expert_bias"] = (torch.rand(case.experts, generator=g) * 0.1).to(buf.device)
    for e in range(case.experts):
        for name, w in full.items():
            state[f"experts.{e}.{name}"] = w[e]
    moe.load_state_dict(state)
    return moe, full


def _swiglu_f64(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """SwiGLU in float64 from plain operations: (silu(x w1^T) * (x w3^T)) w2^T, silu(g) = g / (1 + e^-g)."""
    x = x.double()
    g = x @ w1.double().t()
    return (g / (1 + torch.exp(-g)) * (x @ w3.double().t())) @ w2.double().t()


def _dense(x: torch.Tensor, routing: moe_ep.RouterOutput, w: dict[str, torch.Tensor]) -> torch.Tensor:
    """float64: sum_k weight[n, k] * SwiGLU_{idx[n, k]}(bf16(x[n])), one expert at a time."""
    xb = x.to(torch.bfloat16).double()
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for k in range(routing.topk_idx.shape[1]):
        idx = routing.topk_idx[:, k]
        for e in idx.unique().tolist():
            if e < 0:
                continue
            rows = (idx == e).nonzero().squeeze(1)
            y = _swiglu_f64(xb[rows], w["w1"][e], w["w3"][e], w["w2"][e]) * routing.topk_weights[rows, k].double().unsqueeze(1)
            out = out.index_add(0, rows, y)
    return out


def _reference_modules(case: Case, moe: MoE, group: Optional[dist.ProcessGroup]
                       ) -> tuple[TopKRouter, Optional[dict[str, torch.Tensor]]]:
    """The router (the library's, tested in test_router; routing must match exactly) and the shared
    expert's weights as float64 leaves for _shared_f64."""
    router = TopKRouter(case.hidden, case.experts, case.topk, aux_loss_group=group, device=moe.buffer.device,
                        **case.router)
    router.load_state_dict(moe.router.state_dict())
    shared = None
    if moe.shared is not None:
        shared = {name: p.detach().double().clone().requires_grad_(True) for name, p in moe.shared.named_parameters()}
        assert set(shared) == {"w1.weight", "w3.weight", "w2.weight"}
    return router, shared


def _shared_f64(x: torch.Tensor, shared: Optional[dict[str, torch.Tensor]]) -> torch.Tensor | int:
    """The shared expert in float64 (_swiglu_f64), or 0 without one."""
    if shared is None:
        return 0
    return _swiglu_f64(x, shared["w1.weight"], shared["w3.weight"], shared["w2.weight"])


def _inputs(case: Case, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * case.seed + rank)
    n = case.n(rank)
    return torch.randn(n, case.hidden, generator=g).to(device), torch.randn(n, case.hidden, generator=g).to(device)


def _grad_case(rank: int, world: int, case: Case, backend: str = "reference", dtype: torch.dtype = torch.float32,
               tol: float = TOL) -> None:
    """Forward and every gradient (x, router, experts, shared expert) against the dense reference."""
    max_tokens = max(case.n(r) for r in range(world)) or 1
    buf = moe_ep.Buffer(None, device=device(), hidden=case.hidden, num_experts=case.experts, num_topk=case.topk,
                        max_tokens_per_rank=max_tokens, backend=backend)
    moe, full = _build(case, buf, dtype)
    group = dist.group.WORLD if world > 1 else None
    ref_router, ref_shared = _reference_modules(case, moe, group)
    x0, grad_out = _inputs(case, rank, buf.device)

    x = x0.clone().requires_grad_(True)
    out = moe(x, mode="normal")
    routing = moe.last_routing
    ((out * grad_out).sum() + moe.aux_loss).backward()

    xr = x0.clone().requires_grad_(True)
    wr = {k: v.clone().requires_grad_(True) for k, v in full.items()}
    r = ref_router(xr)
    want = _dense(xr, r, wr) + _shared_f64(xr, ref_shared)
    ((want * grad_out).sum() + r.aux_loss + r.z_loss).backward()

    assert torch.equal(routing.topk_idx, r.topk_idx)
    assert int(routing.num_dropped) == int(r.num_dropped)
    torch.testing.assert_close(routing.aux_loss.detach(), r.aux_loss.detach())
    _close(out, want, "output", tol)
    _close(_grad(x), _grad(xr), "x.grad", tol)
    _close(_grad(moe.router.weight), _grad(ref_router.weight), "router.weight.grad", tol)
    if ref_shared is not None:
        for name, p in ref_shared.items():
            _close(_grad(moe.shared.get_parameter(name)), _grad(p), f"shared.{name}.grad", tol)
    lo, e_l = moe.experts.first_expert, moe.experts.num_local_experts
    for name, w in wr.items():
        total = _grad(w).clone()
        dist.all_reduce(total)  # every rank's tokens contribute to every expert
        _close(_grad(getattr(moe.experts, name)), total[lo : lo + e_l], f"experts.{name}.grad", tol)
    buf.close()


def _state_dict_case(rank: int, world: int, singles: list[dist.ProcessGroup]) -> None:
    """Per-expert keys under global ids; a merged checkpoint loads at EP=1 and back at EP=R."""
    case = GRAD_CASES[1]
    buf = moe_ep.Buffer(None, device=device(), hidden=case.hidden, num_experts=case.experts, num_topk=case.topk,
                        max_tokens_per_rank=64, backend="reference")
    moe, full = _build(case, buf)
    e_l = case.experts // world
    state = moe.state_dict()
    expert_keys = {k for k in state if k.startswith("experts.")}
    assert expert_keys == {f"experts.{e}.{n}" for e in range(rank * e_l, (rank + 1) * e_l) for n in ("w1", "w2", "w3")}
    for e in range(rank * e_l, (rank + 1) * e_l):
        assert torch.equal(state[f"experts.{e}.w2"], full["w2"][e])
    parts: list = [None] * world
    dist.all_gather_object(parts, {k: v.cpu() for k, v in state.items()})
    merged = {k: v for part in parts for k, v in part.items()}
    assert len([k for k in merged if k.startswith("experts.")]) == 3 * case.experts

    x, _ = _inputs(case, rank, buf.device)
    with torch.no_grad():
        out = moe(x, mode="normal")
        # EP=1 on a one-rank group: holds all experts, loads the merged checkpoint
        buf1 = moe_ep.Buffer(singles[rank], device=device(), hidden=case.hidden, num_experts=case.experts, num_topk=case.topk,
                             max_tokens_per_rank=64, backend="reference")
        torch.manual_seed(99)
        moe1 = MoE(buf1, case.ffn, shared_ffn_hidden=case.shared, **case.router)
        moe1.load_state_dict(merged)
        _close(moe1(x, mode="normal"), out, "EP=1 from a merged EP=R checkpoint")
        # and back: a freshly initialised EP=R layer takes its experts from the EP=1 state
        torch.manual_seed(98)
        again = MoE(buf, case.ffn, shared_ffn_hidden=case.shared, **case.router)
        again.load_state_dict(moe1.state_dict())
        assert torch.equal(again(x, mode="normal"), out)
    # a checkpoint without this rank's experts reports them missing; foreign keys are unexpected
    partial = {k: v for k, v in merged.items() if not k.startswith(f"experts.{rank * e_l}.")}
    partial["experts.999.w1"] = merged["experts.0.w1"]
    result = again.load_state_dict(partial, strict=False)
    assert sorted(result.missing_keys) == [f"experts.{rank * e_l}.{n}" for n in ("w1", "w2", "w3")]
    assert result.unexpected_keys == ["experts.999.w1"]
    buf1.close()
    buf.close()


def _low_latency_case(rank: int, world: int, use_fp8: bool, backend: str = "reference") -> None:
    """Decode path: auto mode picks it only without autograd and for few tokens; results match."""
    case = Case(6, [5, 9, 0, 3], 128 if use_fp8 else 32, 8, 2, 24, dict(score_func="sigmoid"), shared=16)
    buf = moe_ep.Buffer(None, device=device(), hidden=case.hidden, num_experts=case.experts, num_topk=case.topk,
                        max_tokens_per_rank=16, backend=backend, low_latency=True)
    moe, full = _build(case, buf)
    moe.low_latency_fp8 = use_fp8
    ll_calls = []
    original = buf.low_latency_dispatch

    def counting(*args, **kwargs):
        ll_calls.append(1)
        return original(*args, **kwargs)

    buf.low_latency_dispatch = counting
    x, _ = _inputs(case, rank, buf.device)
    ref_router, ref_shared = _reference_modules(case, moe, None)
    with torch.no_grad():
        r = ref_router(x)
        want = _dense(x, r, full) + _shared_f64(x, ref_shared)
        out_auto = moe(x)
        assert len(ll_calls) == 1, "auto mode should pick low-latency under no_grad with few tokens"
        _close(out_auto, want, "low-latency output", FP8_TOL if use_fp8 else TOL)
        out_normal = moe(x, mode="normal")
        _close(out_normal, want, "normal output")
        moe.low_latency_max_tokens = 6  # rank 1 has 9 tokens: every rank must fall back to normal
        moe(x)
        assert len(ll_calls) == (1 if world > 1 else 2)
        moe.low_latency_max_tokens = 128
    moe(x.requires_grad_(True))  # autograd on: normal mode
    assert len(ll_calls) == (1 if world > 1 else 2)
    with pytest.raises(RuntimeError, match="no backward"):
        moe(x, mode="low_latency")
    buf.close()


def _recompute_case(rank: int, world: int) -> None:
    """MoE(recompute_swiglu=True) gives recompute_swiglu=False's output and gradients bit for bit, on the
    expert-major and the row path: it only trades memory for compute (docs/api.md)."""
    for layer in (dict(), dict(expert_major=False)):
        case = Case(11, [17, 9, 0, 23], 32, 8, 3, 40, dict(aux_loss_coef=0.01), shared=16, layer=layer)
        buf = moe_ep.Buffer(None, device=device(), hidden=case.hidden, num_experts=case.experts, num_topk=case.topk,
                            max_tokens_per_rank=32, backend="reference")
        x0, grad_out = _inputs(case, rank, buf.device)
        runs = []
        for recompute in (False, True):
            moe, _ = _build(replace(case, layer=dict(layer, recompute_swiglu=recompute)), buf)
            assert moe.experts.recompute_swiglu is recompute
            x = x0.clone().requires_grad_(True)
            out = moe(x, mode="normal")
            ((out * grad_out).sum() + moe.aux_loss).backward()
            runs.append([out.detach(), _grad(x)] + [_grad(p) for _, p in sorted(moe.named_parameters())])
        for i, (a, b) in enumerate(zip(*runs)):
            assert torch.equal(a, b), f"{layer}: recompute_swiglu changed tensor {i} (0: output, 1: x.grad, then params)"
        buf.close()


def _balancing_case(rank: int, world: int) -> None:
    """Aux loss over the group equals the whole batch's; the bias update is identical on every rank."""
    case = Case(7, [12], 32, 8, 2, 16, dict(aux_loss_coef=0.05, expert_bias=True, bias_update_rate=0.01))
    buf = moe_ep.Buffer(None, device=device(), hidden=case.hidden, num_experts=case.experts, num_topk=case.topk,
                        max_tokens_per_rank=16, backend="reference")
    moe, _ = _build(case, buf)
    x, _ = _inputs(case, rank, buf.device)
    moe.train()
    moe(x)
    everyone = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(everyone, x)
    single = TopKRouter(case.hidden, case.experts, case.topk, **case.router)
    single.load_state_dict(moe.router.state_dict())
    whole = single(torch.cat(everyone))
    mean_aux = moe.last_routing.aux_loss.detach().clone()
    dist.all_reduce(mean_aux)
    torch.testing.assert_close(mean_aux / world, whole.aux_loss.detach())
    bias_before = moe.router.expert_bias.clone()
    moe.update_expert_bias()
    load = whole.tokens_per_expert.float()
    torch.testing.assert_close(moe.router.expert_bias, bias_before + 0.01 * torch.sign(load.mean() - load))
    biases = [torch.empty_like(moe.router.expert_bias) for _ in range(world)]
    dist.all_gather(biases, moe.router.expert_bias)
    assert all(torch.equal(b, biases[0]) for b in biases)
    assert int(moe.expert_load.sum()) == 0
    buf.close()


def _bad_input_case() -> None:
    """Wrong mode, width or (with static shapes) token count fail with a clear error."""
    buf = moe_ep.Buffer(None, device=device(), hidden=16, num_experts=4, num_topk=2, max_tokens_per_rank=8, backend="reference")
    moe = MoE(buf, 8)
    with pytest.raises(ValueError, match="mode"):
        moe(torch.randn(3, 16), mode="fast")
    with pytest.raises(ValueError, match="features"):
        moe(torch.randn(3, 8))
    assert moe(torch.randn(9, 16)).shape == (9, 16)  # above max_tokens_per_rank: streamed in rounds
    with pytest.raises(ValueError, match="max_tokens_per_rank"):  # a static-shape forward holds at most 8
        MoE(buf, 8, worst_case=True)(torch.randn(9, 16))
    with pytest.raises(ValueError, match="low_latency_fp8"):
        MoE(buf, 8, low_latency_fp8=True)
    with pytest.raises(RuntimeError, match="aux_loss"):
        MoE(buf, 8).aux_loss
    buf.close()


def _replicated_case(rank: int, world: int) -> None:
    """Each rank seeds its own MoE: construction makes the router, expert bias and shared expert equal
    on every rank (rank 0's), and the layer then equals the dense MoE with those weights and every
    rank's experts; rank-specific values loaded later are made equal again by sync_replicated()."""
    case = GRAD_CASES[1]  # sigmoid router with expert bias, shared expert
    buf = moe_ep.Buffer(None, device=device(), hidden=case.hidden, num_experts=case.experts, num_topk=case.topk,
                        max_tokens_per_rank=64, backend="reference")
    torch.manual_seed(500 + rank)
    moe = MoE(buf, case.ffn, shared_ffn_hidden=case.shared, **case.router)
    torch.manual_seed(500)  # the router is the first thing MoE draws: rank 0's is this one
    ranks_zero = TopKRouter(case.hidden, case.experts, case.topk, device=buf.device, **case.router)
    assert torch.equal(moe.router.weight, ranks_zero.weight)
    with torch.no_grad():
        moe.router.expert_bias.copy_(torch.rand(case.experts, generator=torch.Generator().manual_seed(rank)))
        moe.sync_replicated()  # e.g. after loading a rank-specific checkpoint
        parts: list = [None] * world
        dist.all_gather_object(parts, {k: v.cpu() for k, v in moe.state_dict().items()})
        for key in moe.replicated_tensors():
            assert all(torch.equal(part[key], parts[0][key]) for part in parts), f"{key} differs between ranks"
        merged = {k: v for part in parts for k, v in part.items()}
        full = {n: torch.stack([merged[f"experts.{e}.{n}"] for e in range(case.experts)]).to(buf.device)
                for n in ("w1", "w2", "w3")}
        ref_router, ref_shared = _reference_modules(case, moe, dist.group.WORLD if world > 1 else None)
        x, _ = _inputs(case, rank, buf.device)
        want = _dense(x, ref_router(x), full) + _shared_f64(x, ref_shared)
        _close(moe(x, mode="normal"), want, "differently seeded ranks against the dense MoE")
    buf.close()


def _worker(rank: int, world: int) -> None:
    singles = [dist.new_group([r]) for r in range(world)]
    for case in GRAD_CASES:
        _grad_case(rank, world, case)
    _state_dict_case(rank, world, singles)
    _low_latency_case(rank, world, use_fp8=False)
    _low_latency_case(rank, world, use_fp8=True)
    _balancing_case(rank, world)
    _recompute_case(rank, world)
    _replicated_case(rank, world)
    if world == 1:
        _bad_input_case()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_layer(world: int) -> None:
    run_workers(world, _worker)


# ---- GPU: the grouped-GEMM path and the native backend ------------------------------------------
def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="torch._grouped_mm path needs CUDA sm90")
def test_grouped_mm_matches_loop() -> None:
    torch.manual_seed(0)
    experts = GroupedExperts(8, 4, 0, 128, 256, dtype=torch.bfloat16, device=torch.device("cuda"))
    with torch.no_grad():
        for w in experts.parameters():
            w.normal_(std=0.05)
    x = torch.randn(300, 128, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(-1, 4, (300, 2), device="cuda")
    weights = torch.rand(300, 2, device="cuda")
    assert grouped_mm_supported(x)
    grouped = experts(x, idx, weights)
    g = torch.randn_like(grouped)
    (grouped * g).sum().backward()
    grads = [p.grad.clone() for p in experts.parameters()]
    experts.zero_grad()
    loop = _loop_forward(experts, x, idx, weights)
    (loop * g).sum().backward()
    _close(grouped, loop, "grouped output", 2e-2)
    for got, p in zip(grads, experts.parameters()):
        _close(got, p.grad, "grouped grad", 3e-2)


def _loop_forward(experts: GroupedExperts, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x.shape[0], experts.hidden, device=x.device)
    for k in range(idx.shape[1]):
        for e in range(experts.num_local_experts):
            rows = (idx[:, k] == e).nonzero().squeeze(1)
            xe = x[rows]
            h = F.silu(xe @ experts.w1[e].t()) * (xe @ experts.w3[e].t())
            out = out.index_add(0, rows, (h @ experts.w2[e].t()).float() * w[rows, k, None])
    return out


def _gpu_worker(rank: int, world: int) -> None:
    for case in GRAD_CASES:
        _grad_case(rank, world, case, backend="auto")
    _grad_case(rank, world, Case(8, [200, 150], 128, 16, 4, 256, dict(aux_loss_coef=0.01)), backend="auto",
               dtype=torch.bfloat16, tol=5e-2)
    _low_latency_case(rank, world, use_fp8=False, backend="auto")
    _low_latency_case(rank, world, use_fp8=True, backend="auto")


@requires_gpus()
def test_layer_gpu() -> None:
    run_workers(2, _gpu_worker, backend="gpu")
