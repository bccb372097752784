"""moe_ep.moe.split_gate (the router's float32 gate on bf16 tensor cores) against float64 oracles: the split is
exact, the logits and dW carry float32 accuracy, dx bf16's; on the GPU the same through cuBLAS (the logits to the
tensor cores' float32 accumulation), bit-stable run to run and inside TopKRouter."""
from __future__ import annotations

import pytest
import torch

from moe_ep import TopKRouter
from moe_ep.moe import split_gate


def _random(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32,
            device: str = "cpu") -> torch.Tensor:
    """Values over many binades (log-uniform magnitudes, both signs, a few exact zeros)."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp(torch.empty(shape).uniform_(-12, 4, generator=g))
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    t = mag * sign * (torch.rand(shape, generator=g) > 0.01)
    return t.to(dtype).to(device)


def test_split_sums_back_exactly() -> None:
    t = _random((97, 300), seed=1)
    parts = split_gate.split(t)
    assert parts.dtype == torch.bfloat16 and parts.shape == (3, 97, 300)
    total = parts.double().sum(0)
    assert torch.equal(total, t.double())  # 3 x 8 significant bits cover float32's 24
    # each part is what the earlier ones left, rounded to nearest: at most half an ulp of bf16 of the rest
    assert bool((parts[1].double().abs() <= t.double().abs() * 2 ** -8).all())


def _check_against_float64(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, where: str,
                           logits_bound: float = 2 ** -20) -> torch.Tensor:
    """SplitGate's logits, dx and dW against float64 products of the same inputs; returns the logits. The logits
    may be off by logits_bound of sum |x w| per element (float32 accumulation: a few ulps here, more on tensor
    cores; a float32 sum's worst case is K 2^-24), dW by 2^-20 of sum |g x| (a float32 GEMM), dx by bf16's
    rounding."""
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    logits = split_gate.gate_logits(xg, wg, split_gate.GateWeightParts())
    logits.backward(g)
    xd, wd, gd = x.double(), w.double(), g.double()
    for got, want, scale, bound, name in ((logits, xd @ wd.t(), xd.abs() @ wd.abs().t(), logits_bound, "logits"),
                                          (wg.grad, gd.t() @ xd, gd.abs().t() @ xd.abs(), 2 ** -20, "dW")):
        assert got.dtype == torch.float32, (where, name)
        err = (got.double() - want).abs()
        assert bool((err <= bound * scale + 1e-30).all()), f"{where}: {name} off by {(err / scale).max()}"
    want_dx = gd @ wd
    err = (xg.grad.double() - want_dx).abs()
    assert xg.grad.dtype == torch.bfloat16
    assert bool((err <= 2 ** -8 * want_dx.abs() + 2 ** -14 * (gd.abs() @ wd.abs())).all()), f"{where}: dx"
    return logits


def test_gate_matches_float64_on_cpu() -> None:
    """The same arithmetic as on the GPU (bf16 products summed in float32), here through float32 matmuls."""
    for seed, (n, h, e) in enumerate([(64, 256, 16), (33, 96, 7), (1, 128, 128), (0, 64, 8)]):
        x = torch.randn(n, h, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        w = _random((e, h), seed=10 + seed) * 0.02
        g = torch.randn(n, e, generator=torch.Generator().manual_seed(20 + seed))
        _check_against_float64(x, w, g, f"N {n}, H {h}, E {e}")


def test_weight_parts_follow_in_place_updates() -> None:
    w = torch.nn.Parameter(torch.randn(8, 32))
    parts = split_gate.GateWeightParts()
    first = parts(w)
    assert parts(w) is first  # unchanged weight: the cached split
    with torch.no_grad():
        w.add_(0.5)  # an optimizer step
    assert torch.equal(parts(w).double().sum(0), w.detach().double())


def test_available_only_for_bf16_tokens_on_cuda() -> None:
    w = torch.zeros(4, 8)
    assert not split_gate.available(torch.zeros(2, 8, dtype=torch.bfloat16), w)  # CPU
    if torch.cuda.is_available():
        assert split_gate.available(torch.zeros(2, 8, dtype=torch.bfloat16, device="cuda"), w.cuda())
        assert not split_gate.available(torch.zeros(2, 8, device="cuda"), w.cuda())  # float32 tokens
        assert not split_gate.available(torch.zeros(2, 8, dtype=torch.bfloat16, device="cuda"), w.cuda().double())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gate_on_cuda_matches_float64_and_repeats() -> None:
    """cuBLAS's bf16 GEMM at the layer bench's router size (4096 x 7168 -> 128) and a ragged one: within 2^-16 of
    sum |x w| of float64 (the tensor cores' float32 accumulation: 2^-19.2 measured on an H100, session 26), the
    bits of two runs equal, as close to the float32 linear it replaces; a captured graph reads the weight at
    replay; inside TopKRouter the gate's weight gets its gradient."""
    for seed, (n, h, e) in enumerate([(4096, 7168, 128), (77, 384, 40)]):
        torch.manual_seed(seed)
        x = torch.randn(n, h, device="cuda").to(torch.bfloat16)
        w = _random((e, h), seed=30 + seed, device="cuda") * 0.02
        g = torch.randn(n, e, device="cuda")
        logits = _check_against_float64(x, w, g, f"cuda N {n}, H {h}, E {e}", logits_bound=2 ** -16)
        again = split_gate.gate_logits(x, w, split_gate.GateWeightParts())
        assert torch.equal(logits.detach(), again)
        fp32 = torch.nn.functional.linear(x.float(), w)
        scale = x.float().abs() @ w.abs().t()
        assert bool(((logits.detach() - fp32).abs() <= 2 ** -16 * scale + 1e-30).all())
    # captured in a CUDA graph, the gate reads the weight at each replay (no split cached from before the capture)
    w = torch.randn(16, 256, device="cuda")
    x = torch.randn(64, 256, device="cuda").to(torch.bfloat16)
    parts = split_gate.GateWeightParts()
    parts(w)  # an eager call first: a cached split exists
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = split_gate.gate_logits(x, w, parts)
    w.add_(torch.randn_like(w))
    graph.replay()
    assert torch.equal(captured, split_gate.gate_logits(x, w, split_gate.GateWeightParts()))
    router = TopKRouter(7168, num_experts=128, top_k=8, device=torch.device("cuda"))
    x = torch.randn(512, 7168, device="cuda").to(torch.bfloat16).requires_grad_(True)
    router(x).topk_weights.square().sum().backward()
    assert router.weight.grad is not None and bool(router.weight.grad.abs().sum() > 0)
    assert x.grad is not None and x.grad.dtype == torch.bfloat16
