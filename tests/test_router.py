"""TopKRouter against hand computations: plain-Python loops over tokens and experts (single process); its
one-pass Triton selection (moe_ep.moe.router_kernels) against the same, in Triton's interpreter on the CPU and on
the GPU."""
from __future__ import annotations

import math

import pytest
import torch

from moe_ep import TopKRouter
from moe_ep.moe import router_kernels
from tests._interpret import run_interpreted


def _logits(router: TopKRouter, x: torch.Tensor) -> list[list[float]]:
    w, xs = router.weight.detach().double().tolist(), x.double().tolist()
    return [[sum(a * b for a, b in zip(row, we)) for we in w] for row in xs]


def _hand_route(router: TopKRouter, x: torch.Tensor) -> tuple[list[list[int]], list[list[float]]]:
    """Selection and weights for every token, one token and one expert at a time."""
    e, k = router.num_experts, router.top_k
    bias = router.expert_bias.tolist() if router.expert_bias is not None else [0.0] * e
    per_group = e // router.num_groups
    ids, weights = [], []
    for logits in _logits(router, x):
        if router.score_func == "softmax":
            top = max(logits)
            exps = [math.exp(v - top) for v in logits]
            scores = [v / sum(exps) for v in exps]
        else:
            scores = [1 / (1 + math.exp(-v)) for v in logits]
        choice = [s + b for s, b in zip(scores, bias)]
        allowed = set(range(e))
        if router.num_groups > 1:
            group_score = []
            for g in range(router.num_groups):
                members = sorted(choice[g * per_group : (g + 1) * per_group], reverse=True)
                group_score.append(sum(members[:2]))
            best = sorted(range(router.num_groups), key=lambda g: -group_score[g])[: router.topk_groups]
            allowed = {g * per_group + i for g in best for i in range(per_group)}
        picked = sorted(allowed, key=lambda j: -choice[j])[:k]
        w = [scores[j] for j in picked]
        if router.norm_topk_prob and k > 1:
            w = [v / sum(w) for v in w]
        ids.append(picked)
        weights.append([v * router.routed_scaling_factor for v in w])
    return ids, weights


def _make(seed: int, hidden: int, num_tokens: int, **kw) -> tuple[TopKRouter, torch.Tensor]:
    torch.manual_seed(seed)
    router = TopKRouter(hidden, **kw)
    with torch.no_grad():
        router.weight.normal_(std=0.5)  # spread scores so that ties cannot happen
        if router.expert_bias is not None:
            router.expert_bias.uniform_(-0.3, 0.3)
    return router, torch.randn(num_tokens, hidden)


CONFIGS = [
    dict(num_experts=8, top_k=2),
    dict(num_experts=8, top_k=1),
    dict(num_experts=16, top_k=4, norm_topk_prob=False, routed_scaling_factor=2.5),
    dict(num_experts=16, top_k=4, score_func="sigmoid", num_groups=4, topk_groups=2, routed_scaling_factor=2.5),
    dict(num_experts=12, top_k=3, score_func="sigmoid", num_groups=3, topk_groups=1, expert_bias=True),
    dict(num_experts=8, top_k=2, score_func="softmax", num_groups=4, topk_groups=3, expert_bias=True),
    dict(num_experts=6, top_k=2, score_func="sigmoid", num_groups=6, topk_groups=2),  # one expert per group
]


@pytest.mark.parametrize("i", range(len(CONFIGS)))
def test_selection_and_weights(i: int) -> None:
    router, x = _make(i, 24, 37, **CONFIGS[i])
    out = router(x)
    ids, weights = _hand_route(router, x)
    assert out.topk_idx.dtype == torch.int64 and out.topk_weights.dtype == torch.float32
    assert out.topk_idx.shape == out.topk_weights.shape == (37, router.top_k)
    assert out.topk_idx.tolist() == ids
    torch.testing.assert_close(out.topk_weights, torch.tensor(weights, dtype=torch.float32), rtol=1e-5, atol=1e-6)
    counts = [sum(row.count(j) for row in ids) for j in range(router.num_experts)]
    assert out.tokens_per_expert.tolist() == counts
    assert int(out.num_dropped) == 0
    assert float(out.aux_loss) == 0.0 and float(out.z_loss) == 0.0


def test_bias_steers_selection_only() -> None:
    router, x = _make(11, 16, 20, num_experts=8, top_k=2, score_func="sigmoid", expert_bias=True)
    with torch.no_grad():
        router.expert_bias.zero_()
        router.expert_bias[5] = 100.0  # expert 5 always wins selection
    out = router(x)
    assert (out.topk_idx[:, 0] == 5).all()
    s = torch.sigmoid(x @ router.weight.detach().t())
    chosen = s.gather(1, out.topk_idx)
    torch.testing.assert_close(out.topk_weights, chosen / chosen.sum(1, keepdim=True))


def test_aux_and_z_loss() -> None:
    for score_func in ("softmax", "sigmoid"):
        router, x = _make(3, 16, 29, num_experts=8, top_k=2, score_func=score_func,
                          aux_loss_coef=0.03, z_loss_coef=0.002)
        out = router(x)
        ids, _ = _hand_route(router, x)
        logits = _logits(router, x)
        n, e, k = len(ids), 8, 2
        probs = []
        for row in logits:
            if score_func == "softmax":
                exps = [math.exp(v) for v in row]
                probs.append([v / sum(exps) for v in exps])
            else:
                sig = [1 / (1 + math.exp(-v)) for v in row]
                probs.append([v / sum(sig) for v in sig])
        f = [sum(r.count(j) for r in ids) / (n * k) for j in range(e)]
        p = [sum(pr[j] for pr in probs) / n for j in range(e)]
        aux = 0.03 * e * sum(a * b for a, b in zip(f, p))
        z = 0.002 * sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits) / n
        assert out.aux_loss.item() == pytest.approx(aux, rel=1e-5)
        assert out.z_loss.item() == pytest.approx(z, rel=1e-5)
        (out.aux_loss + out.z_loss).backward()
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_losses_on_empty_batch() -> None:
    router, _ = _make(4, 16, 0, num_experts=8, top_k=2, aux_loss_coef=0.01, z_loss_coef=0.001, capacity_factor=1.0,
                      num_groups=2, expert_bias=True)
    out = router(torch.zeros(0, 16))
    assert out.topk_idx.shape == (0, 2) and out.aux_loss.item() == 0.0 and out.z_loss.item() == 0.0
    assert int(out.num_dropped) == 0


def test_capacity_drops_overflow_in_priority_order() -> None:
    n, e, k, cf = 13, 4, 2, 1.0
    router, x = _make(5, 16, n, num_experts=e, top_k=k)
    ids, weights = _hand_route(router, x)
    router.capacity_factor = cf
    out = router(x)
    capacity = math.ceil(cf * n * k / e)
    kept = [[-1] * k for _ in range(n)]
    used = [0] * e
    for kk in range(k):  # first choices of all tokens, then second choices
        for t in range(n):
            j = ids[t][kk]
            if used[j] < capacity:
                used[j] += 1
                kept[t][kk] = j
    dropped = sum(row.count(-1) for row in kept)
    assert dropped > 0, "the case must overflow some expert"
    assert out.topk_idx.tolist() == kept
    assert int(out.num_dropped) == dropped
    want_w = [[w if j >= 0 else 0.0 for w, j in zip(wr, kr)] for wr, kr in zip(weights, kept)]
    torch.testing.assert_close(out.topk_weights, torch.tensor(want_w, dtype=torch.float32), rtol=1e-5, atol=1e-6)
    # tokens_per_expert is the requested load, before dropping
    assert out.tokens_per_expert.tolist() == [sum(r.count(j) for r in ids) for j in range(e)]


def test_capacity_with_everything_on_one_expert() -> None:
    router = TopKRouter(8, 4, 1, capacity_factor=2.0)
    with torch.no_grad():
        router.weight.zero_()
        router.weight[2, 0] = 5.0
    x = torch.zeros(10, 8)
    x[:, 0] = 1.0
    out = router(x)
    capacity = math.ceil(2.0 * 10 / 4)
    assert out.topk_idx.squeeze(1).tolist() == [2] * capacity + [-1] * (10 - capacity)
    assert int(out.num_dropped) == 10 - capacity
    assert (out.topk_weights.squeeze(1)[capacity:] == 0).all()


def test_expert_bias_update_is_sign_based() -> None:
    router = TopKRouter(8, 4, 1, expert_bias=True, bias_update_rate=0.01)
    load = torch.tensor([10, 2, 4, 4])  # mean 5
    router.update_expert_bias(load)
    assert router.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0.01, 0.01])
    router.update_expert_bias(torch.tensor([5, 5, 9, 1]))
    assert router.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.02])
    assert "expert_bias" in router.state_dict()
    with pytest.raises(RuntimeError, match="expert_bias"):
        TopKRouter(8, 4, 1).update_expert_bias(load)


def test_bias_update_balances_a_skewed_router() -> None:
    torch.manual_seed(0)
    router = TopKRouter(16, 8, 2, score_func="sigmoid", expert_bias=True, bias_update_rate=0.02)
    with torch.no_grad():
        router.weight.normal_(std=0.3)
        router.weight[0] += 1.0  # expert 0 is favoured
    x = torch.randn(512, 16) + 0.5
    before = router(x).tokens_per_expert.float()
    for _ in range(100):
        router.update_expert_bias(router(x).tokens_per_expert)
    after = router(x).tokens_per_expert.float()
    assert after.max() - after.min() < (before.max() - before.min()) / 3


def test_gradient_reaches_gate_through_weights() -> None:
    router, x = _make(7, 16, 9, num_experts=8, top_k=2, score_func="sigmoid", routed_scaling_factor=2.0)
    x.requires_grad_(True)
    out = router(x)
    g = torch.randn_like(out.topk_weights)
    (out.topk_weights * g).sum().backward()
    # the same weights through a hand-written graph of the chosen experts
    w = router.weight.detach().clone().requires_grad_(True)
    xr = x.detach().clone().requires_grad_(True)
    s = torch.sigmoid(xr @ w.t()).gather(1, out.topk_idx)
    ((s / s.sum(1, keepdim=True) * 2.0) * g).sum().backward()
    torch.testing.assert_close(router.weight.grad, w.grad)
    torch.testing.assert_close(x.grad, xr.grad)


@pytest.mark.parametrize("kw, match", [
    (dict(num_experts=8, top_k=2, score_func="relu"), "score_func"),
    (dict(num_experts=8, top_k=9), "top_k"),
    (dict(num_experts=8, top_k=2, num_groups=3), "num_groups"),
    (dict(num_experts=8, top_k=2, num_groups=4, topk_groups=5), "topk_groups"),
    (dict(num_experts=8, top_k=5, num_groups=4, topk_groups=2), "exceeds"),
    (dict(num_experts=8, top_k=2, capacity_factor=0.0), "capacity_factor"),
])
def test_bad_arguments(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TopKRouter(16, **kw)


# ---- the one-pass Triton selection ----------------------------------------------------------------
FUSED_CONFIGS = [c for c in CONFIGS if router_kernels.supports(c["num_experts"], c.get("num_groups", 1))] + [
    dict(num_experts=128, top_k=8),  # the layer bench's router
    dict(num_experts=256, top_k=8, score_func="sigmoid", num_groups=8, topk_groups=4, expert_bias=True,
         routed_scaling_factor=2.5),  # DeepSeek-V3's
    dict(num_experts=12, top_k=3, expert_bias=True),  # padded lanes
    dict(num_experts=16, top_k=4, aux_loss_coef=0.03, z_loss_coef=0.002, capacity_factor=1.0),
    dict(num_experts=32, top_k=1, score_func="sigmoid", num_groups=32, topk_groups=3),  # one expert per group
]


def _route_both(router: TopKRouter, x: torch.Tensor) -> tuple[list, list]:
    """The router's output and its gradients (x, gate weight) of weights * g + losses, through the one-pass
    selection (forced, so it runs on CPU tensors in the interpreter) and through the torch path."""
    g = torch.randn(x.shape[0], router.top_k, generator=torch.Generator().manual_seed(1)).to(x.device)
    results = []
    for fused in (True, False):
        router._fused = lambda _logits, fused=fused: fused  # the instance's choice, for this test only
        router.weight.grad = None
        xg = x.detach().clone().requires_grad_(True)
        out = router(xg)
        ((out.topk_weights * g).sum() + out.aux_loss + out.z_loss).backward()
        results.append([out, xg.grad, router.weight.grad.clone()])
    del router._fused
    return results[0], results[1]


def _check_logit_gradient(router: TopKRouter, x: torch.Tensor, where: str) -> None:
    """The one-pass selection's backward kernel (moe_ep::route's backward) against autograd through the torch path's formulas (TopKRouter.gate_scores,
    chosen_weights) at the kernel's own ids: d logits of weights * g, plus a term on the scores where the
    balancing loss reads them."""
    grads, ids = [], None
    for fused in (True, False):
        logits = torch.nn.functional.linear(x.float(), router.weight.detach()).requires_grad_(True)
        if fused:
            ids, weights, _counts, scores = router._route_fused(logits)
        else:
            scores = router.gate_scores(logits)
            weights = router.chosen_weights(scores, ids)
        g = torch.randn(weights.shape, generator=torch.Generator().manual_seed(2)).to(x.device)
        loss = (weights * g).sum()
        if router.aux_loss_coef:
            loss = loss + (scores.sum(0) * torch.linspace(-1, 1, scores.shape[1], device=x.device)).sum()
        grads.append(torch.autograd.grad(loss, logits)[0])
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-7, msg=f"{where}: d logits")


def interpreted_cases() -> None:
    """Under TRITON_INTERPRET=1: for every config the kernel serves, ids and counts equal the hand oracle's,
    weights, losses and both gradients match it and the torch path; also 0 tokens, and row counts that are no
    multiple of a program's rows."""
    assert not router_kernels.supports(12, 3) and not router_kernels.supports(4096, 1)
    for i, cfg in enumerate(FUSED_CONFIGS):
        n = (37, 70, 5)[i % 3]
        router, x = _make(100 + i, 24, n, **cfg)
        (out, gx, gw), (ref, ref_gx, ref_gw) = _route_both(router, x)
        ids, weights = _hand_route(router, x)
        where = f"config {cfg}"
        counts = [sum(r.count(j) for r in ids) for j in range(router.num_experts)]
        assert out.tokens_per_expert.tolist() == counts, where
        assert out.topk_idx.tolist() == ref.topk_idx.tolist(), where
        if router.capacity_factor is None:
            assert out.topk_idx.tolist() == ids, where
            torch.testing.assert_close(out.topk_weights, torch.tensor(weights), rtol=1e-5, atol=1e-6, msg=where)
        torch.testing.assert_close(out.topk_weights, ref.topk_weights, rtol=1e-5, atol=1e-6, msg=where)
        assert int(out.num_dropped) == int(ref.num_dropped), where
        torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=1e-5, atol=1e-7, msg=where)
        torch.testing.assert_close(gx, ref_gx, rtol=1e-4, atol=1e-6, msg=where)
        torch.testing.assert_close(gw, ref_gw, rtol=1e-4, atol=1e-6, msg=where)
        _check_logit_gradient(router, x, where)
    router, _ = _make(9, 24, 0, num_experts=16, top_k=4, aux_loss_coef=0.01)
    (out, _, _), _ = _route_both(router, torch.zeros(0, 24))
    assert out.topk_idx.shape == (0, 4) and out.tokens_per_expert.tolist() == [0] * 16


def test_fused_selection_in_triton_interpreter() -> None:
    run_interpreted("tests.test_router", "interpreted_cases")


def compiled_cases() -> None:
    """Under TRITON_INTERPRET=1: torch.library.opcheck on moe_ep::route (schema, autograd, fake) and
    moe_ep::route_backward (all of it), and the router
    compiled (backend="aot_eager", fullgraph) with the one-pass selection forced gives eager's bits: ids, weights,
    counts, losses and both gradients (the ops keep the kernels, so compiled code cannot fall back to the torch
    path's other rounding)."""
    for i, cfg in enumerate([FUSED_CONFIGS[3], FUSED_CONFIGS[-2]]):
        router, x = _make(200 + i, 24, 21, **cfg)
        logits = torch.nn.functional.linear(x, router.weight.detach()).requires_grad_(True)
        args = (router.expert_bias, router.top_k, router.score_func == "softmax", router.num_groups,
                router.topk_groups, router.norm_topk_prob and router.top_k > 1, router.routed_scaling_factor, True)
        # not opcheck's AOT test, whose loss sums the outputs in place, int64 ids first (then float fails to cast):
        # the compiled comparison below does that part
        torch.library.opcheck(torch.ops.moe_ep.route.default, (logits, *args),
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
        idx = router_kernels.route_op(logits.detach(), *args)[0]
        torch.library.opcheck(torch.ops.moe_ep.route_backward.default,
                              (logits.detach(), idx, torch.randn(idx.shape), torch.randn(logits.shape), *args[1:3],
                               *args[5:7]))
        router._fused = lambda _logits: True
        g = torch.randn(x.shape[0], router.top_k, generator=torch.Generator().manual_seed(3))

        def step(xs: torch.Tensor) -> list[torch.Tensor]:
            out = router(xs)
            loss = (out.topk_weights * g).sum() + out.aux_loss + out.z_loss
            return [out.topk_idx, out.topk_weights, out.tokens_per_expert, out.aux_loss, out.z_loss, loss]

        results = []
        for run in (step, torch.compile(step, backend="aot_eager", fullgraph=True)):
            router.weight.grad = None
            xs = x.detach().clone().requires_grad_(True)
            outs = run(xs)
            outs[-1].backward()
            results.append(outs[:-1] + [xs.grad, router.weight.grad.clone()])
        for got, want in zip(*results):
            assert torch.equal(got, want), f"config {cfg}: compiled and eager differ"
        torch._dynamo.reset()


def test_fused_selection_compiles_to_eager_bits() -> None:
    run_interpreted("tests.test_router", "compiled_cases")


def _near_ties(router: TopKRouter, x: torch.Tensor, rel: float) -> torch.Tensor:
    """[N] bool: rows where a few ulps of exp may change the kernel's ids against torch's: two of the K + 1 best
    choices within `rel` of each other (float64 from the same float32 logits), or with groups, two of the
    topk_groups + 1 best group scores, the choices counted only inside the kept groups."""
    logits = torch.nn.functional.linear(x.float(), router.weight).double()
    scores = logits.softmax(-1) if router.score_func == "softmax" else logits.sigmoid()
    choice = scores + (router.expert_bias.double() if router.expert_bias is not None else 0.0)

    def close(values: torch.Tensor, k: int) -> torch.Tensor:
        top = values.topk(min(k + 1, values.shape[-1]), dim=-1).values
        return ((top[:, :-1] - top[:, 1:]) <= rel * top[:, :-1].abs()).any(-1)

    ties = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    if router.num_groups > 1:
        grouped = choice.view(x.shape[0], router.num_groups, -1)
        group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        ties |= close(group_score, router.topk_groups)
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(router.topk_groups, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(x.shape[0], -1)
    return ties | close(choice, router.top_k)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or router_kernels.triton is None, reason="needs CUDA and Triton")
def test_fused_selection_on_cuda() -> None:
    """At the layer bench's size (4096 tokens, hidden 7168) on the GPU, where the router picks the kernel by itself:
    ids equal the torch path's except on rows with near-ties (fewer than 5 %), counts are those ids', weights,
    losses and gradients match, and two runs give the same bits."""
    cases = [dict(num_experts=128, top_k=8), dict(num_experts=256, top_k=8, score_func="sigmoid", num_groups=8,
                                                   topk_groups=4, expert_bias=True, aux_loss_coef=0.01)]
    for seed, cfg in enumerate(cases):
        torch.manual_seed(seed)
        router = TopKRouter(7168, device=torch.device("cuda"), **cfg)
        if router.expert_bias is not None:
            router.expert_bias.uniform_(-0.01, 0.01)
        x = torch.randn(4096, 7168, device="cuda").to(torch.bfloat16)
        assert router._fused(torch.empty(1, router.num_experts, device="cuda")), cfg
        (out, gx, gw), (ref, ref_gx, ref_gw) = _route_both(router, x)
        again = router(x)
        assert torch.equal(again.topk_idx, out.topk_idx) and torch.equal(again.topk_weights, out.topk_weights)
        ties = _near_ties(router, x, 2e-6)
        assert ties.float().mean() < 0.05, cfg
        same = (out.topk_idx == ref.topk_idx).all(-1)
        assert bool((same | ties).all()), f"{cfg}: ids differ on rows without near-ties"
        assert torch.equal(out.tokens_per_expert, torch.bincount(out.topk_idx.flatten(), minlength=router.num_experts))
        torch.testing.assert_close(out.topk_weights[same], ref.topk_weights[same], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=1e-4, atol=1e-7)
        if bool(same.all()):
            torch.testing.assert_close(gx.float(), ref_gx.float(), rtol=2e-2, atol=1e-5)
            torch.testing.assert_close(gw, ref_gw, rtol=1e-3, atol=1e-5)
        _check_logit_gradient(router, x, f"{cfg}")
