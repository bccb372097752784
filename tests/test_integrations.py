"""docs/integrations.md's code blocks, executed as the page shows them (2 ranks, gloo, reference
backend) and checked against brute force, so the page and the tests cannot drift apart.

Each block marked `<!-- tested: name -->` runs in a fresh namespace holding the names the page
promises (group, x, topk_idx, topk_weights, num_experts, buffer, run_experts, ...); CHECKS[name]
supplies them and checks what the block left behind.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

import moe_ep
import moe_ep.deep_ep
from moe_ep.comm import fp8
from tests._dist import run_workers
from tests._frameworks import needs_deep_ep
from tests.test_compile import same_bits
from tests.test_overlap import _one_call as one_call
from tests.oracle import (Inputs, expected_combine, expected_dispatch, expected_low_latency_combine, fp8_dequantize,
                          fp8_quantize, make_inputs)

DOC = Path(__file__).resolve().parents[1] / "docs" / "integrations.md"
BLOCK = re.compile(r"<!-- tested: (\w+) -->\n```python\n(.*?)```", re.S)
WORLD, HIDDEN, EXPERTS, TOPK, T = 2, 256, 8, 3, 16
NUM_LOCAL = EXPERTS // WORLD
TOKENS = [13, 9]


def _blocks() -> dict[str, str]:
    """The page's tested blocks by name; every python block must carry a name."""
    text = DOC.read_text()
    found = dict(BLOCK.findall(text))
    assert len(found) == text.count("```python"), "every python block in integrations.md needs <!-- tested: name -->"
    return found


def _run(code: str, **names: object) -> dict[str, object]:
    namespace = dict(names)
    exec(compile(code, str(DOC), "exec"), namespace)
    return namespace


def _scale(e: int) -> float:
    """Expert e multiplies its rows by e + 1."""
    return float(e + 1)


# ---- the local experts each block calls, and the rows they return (brute force) ---------------
def _experts_by_k(me: int) -> Callable:
    """Normal mode: row m -> bf16(sum over k ascending of w[m, k] * x[m] * scale(expert)), local experts only."""
    def run(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, counts: object) -> torch.Tensor:
        acc = torch.zeros(x.shape, dtype=torch.float32)
        for k in range(topk_idx.shape[1]):
            local = topk_idx[:, k:k + 1]
            scale = (local + me * NUM_LOCAL + 1).float()
            acc = torch.where(local >= 0, acc + topk_weights[:, k:k + 1] * (x.float() * scale), acc)
        return acc.to(torch.bfloat16)

    return run


def _row_by_k(inp: Inputs) -> Callable:
    """What rank r's _experts_by_k returns for token i of source s."""
    def row(r: int, s: int, i: int) -> torch.Tensor:
        acc = torch.zeros(HIDDEN)
        for k, e in enumerate(inp.topk_idx[s][i].tolist()):
            if e >= 0 and e // NUM_LOCAL == r:
                acc = acc + inp.topk_weights[s][i, k] * (inp.x[s][i].float() * _scale(e))
        return acc.to(torch.bfloat16)

    return row


def _experts_low_latency(me: int) -> Callable:
    """Low-latency mode: every expert-major row dequantized and scaled by its expert's scale, bf16."""
    def run(x: torch.Tensor, scales: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor([_scale(me * NUM_LOCAL + e) for e in range(NUM_LOCAL)]).view(-1, 1, 1)
        return (fp8.dequantize(x, scales) * scale).to(torch.bfloat16)

    return run


def _experts_grouped(me: int) -> Callable:
    """Megatron style: rows grouped by local expert (tokens_per_expert rows each), scaled, float32."""
    def run(rows: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        counts = tokens_per_expert.tolist()
        scale = torch.cat([torch.full((c,), _scale(me * NUM_LOCAL + e)) for e, c in enumerate(counts)])
        return rows.float() * scale.unsqueeze(1)

    return run


def _row_by_expert(inp: Inputs) -> Callable:
    """What rank r sends back for token i of source s after _experts_grouped and the weighting:
    bf16 of the float32 sum, in ascending expert order, of x * scale(e) * w."""
    def row(r: int, s: int, i: int) -> torch.Tensor:
        acc = torch.zeros(HIDDEN)
        for e, w in sorted(zip(inp.topk_idx[s][i].tolist(), inp.topk_weights[s][i])):
            if e >= 0 and e // NUM_LOCAL == r:
                acc = acc + (inp.x[s][i].float() * _scale(e)) * w
        return acc.to(torch.bfloat16)

    return row


# ---- checks, one per block --------------------------------------------------------------------
def _check_deep_ep(code: str, inp: Inputs, me: int, buffer: moe_ep.Buffer) -> None:
    ns = _run(code, group=dist.group.WORLD, x=inp.x[me], topk_idx=inp.topk_idx[me],
              topk_weights=inp.topk_weights[me], num_experts=EXPERTS, run_experts=_experts_by_k(me))
    want = expected_dispatch(inp, me, WORLD, EXPERTS)
    same_bits(ns["recv_x"], want.x, "deep_ep recv_x")
    assert ns["num_recv_tokens_per_expert_list"] == want.tokens_per_expert
    same_bits(ns["combined_x"], expected_combine(inp, me, WORLD, EXPERTS, _row_by_k(inp)), "deep_ep combined_x")


def _check_deep_ep_package(code: str, inp: Inputs, me: int, buffer: moe_ep.Buffer) -> None:
    """DeepEP-style calls through the installed `deep_ep` package's names, with DeepEP's events
    (Megatron-Core's use)."""
    ns = _run(code)
    deep_ep, event_handle, event_overlap = ns["deep_ep"], ns["EventHandle"], ns["EventOverlap"]
    assert deep_ep.Buffer is moe_ep.deep_ep.Buffer and event_overlap is moe_ep.deep_ep.EventOverlap
    x, idx, w = inp.x[me], inp.topk_idx[me], inp.topk_weights[me]
    config = deep_ep.Buffer.get_dispatch_config(WORLD)
    buf = deep_ep.Buffer(dist.group.WORLD, config.get_nvl_buffer_size_hint(2 * HIDDEN, WORLD),
                         config.get_rdma_buffer_size_hint(2 * HIDDEN, WORLD))
    per_rank, per_rdma, per_expert, in_rank, event = buf.get_dispatch_layout(
        idx, EXPERTS, previous_event=event_overlap(event_handle()), async_finish=True,
        allocate_on_comm_stream=False)
    recv_x, _, recv_w, _, handle, event = buf.dispatch(
        x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, previous_event=event, async_finish=True,
        allocate_on_comm_stream=False)
    event.current_stream_wait()
    same_bits(recv_x, expected_dispatch(inp, me, WORLD, EXPERTS).x, "deep_ep package dispatch")
    out, out_w, event = buf.combine(recv_x, handle, topk_weights=recv_w,
                                    previous_event=event_overlap(event_handle()), async_finish=True)
    event.current_stream_wait()
    same_bits(out, expected_combine(inp, me, WORLD, EXPERTS, lambda r, s, i: inp.x[s][i]), "deep_ep package combine")
    same_bits(out_w, torch.where(idx >= 0, w, 0.0), "deep_ep package combined weights")


def _check_prepare_finalize(code: str, inp: Inputs, me: int, buffer: moe_ep.Buffer) -> None:
    ns = _run(code, buffer=buffer, x=inp.x[me], topk_idx=inp.topk_idx[me], topk_weights=inp.topk_weights[me],
              run_experts=_experts_by_k(me))
    same_bits(ns["out"], expected_combine(inp, me, WORLD, EXPERTS, _row_by_k(inp)), "prepare/finalize")


def _check_prepare_finalize_low_latency(code: str, inp: Inputs, me: int, buffer: moe_ep.Buffer) -> None:
    ns = _run(code, buffer=buffer, x=inp.x[me], topk_idx=inp.topk_idx[me], topk_weights=inp.topk_weights[me],
              run_experts=_experts_low_latency(me))

    def row(e: int, s: int, n: int, k: int) -> torch.Tensor:
        return (fp8_dequantize(*fp8_quantize(inp.x[s][n:n + 1])).float()[0] * _scale(e)).to(torch.bfloat16)

    same_bits(ns["out"], expected_low_latency_combine(inp, me, WORLD, EXPERTS, row), "low-latency prepare/finalize")


def _dense_routing(inp: Inputs, me: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's router outputs: probs [N, E] float32 and routing_map [N, E] bool."""
    idx, w = inp.topk_idx[me], inp.topk_weights[me]
    routing_map = torch.zeros(idx.shape[0], EXPERTS, dtype=torch.bool)
    probs = torch.zeros(idx.shape[0], EXPERTS)
    for n, row in enumerate(idx.tolist()):
        for k, e in enumerate(row):
            if e >= 0:
                routing_map[n, e], probs[n, e] = True, w[n, k]
    return probs, routing_map


def _check_megatron(code: str, inp: Inputs, me: int, buffer: moe_ep.Buffer) -> None:
    """Forward bit for bit; gradients of x and probs against the dense formula, within bf16 roundings
    (gradient rows cross ranks as bf16)."""
    probs, routing_map = _dense_routing(inp, me)
    x = inp.x[me].clone().requires_grad_()
    probs.requires_grad_()
    ns = _run(code, buffer=buffer, x=x, probs=probs, routing_map=routing_map, run_experts=_experts_grouped(me))
    same_bits(ns["out"], expected_combine(inp, me, WORLD, EXPERTS, _row_by_expert(inp)), "megatron forward")
    probe = torch.linspace(-1.0, 1.0, x.numel()).view(x.shape)
    (ns["out"].float() * probe).sum().backward()
    scales = torch.tensor([_scale(e) for e in range(EXPERTS)])
    want_x = probe * (probs.detach() * scales).sum(1, keepdim=True)
    want_probs = (probe * inp.x[me].float()).sum(1, keepdim=True) * scales * routing_map
    for got, want, what in ((x.grad.float(), want_x, "x"), (probs.grad, want_probs, "probs")):
        err = float((got - want).abs().max())
        assert err <= 2 ** -6 * float(want.abs().max()), f"megatron gradient of {what}: max error {err:.3e}"


def _check_compile(code: str, inp: Inputs, me: int, buffer: moe_ep.Buffer) -> None:
    """The block compiled with aot_eager against the same layer in eager mode, bit for bit."""
    x = inp.x[me].float().requires_grad_()
    torch.manual_seed(0)  # the same replicated weights on every rank
    compile_ = torch.compile
    torch.compile = functools.partial(compile_, backend="aot_eager")
    try:
        ns = _run(code, buffer=buffer, x=x)
    finally:
        torch.compile = compile_
    moe = ns["moe"]
    grads = [x.grad, *(p.grad for p in moe.parameters())]
    moe.zero_grad(set_to_none=True)
    x_eager = x.detach().clone().requires_grad_()
    y = moe(x_eager, mode="normal")
    y.sum().backward()
    same_bits(ns["y"], y, "compiled forward")
    for i, (got, want) in enumerate(zip(grads, [x_eager.grad, *(p.grad for p in moe.parameters())])):
        same_bits(got, want, f"compiled gradient {i}")
    with torch.no_grad():
        same_bits(ns["y_decode"], moe(x, mode="low_latency"), "compiled low-latency forward")


def _check_decode_overlap(code: str, inp: Inputs, me: int, buffer: moe_ep.Buffer) -> None:
    """The two micro-batches against the same layer's one-call low-latency path (the custom ops, no
    receive hooks), bit for bit; tests/test_overlap.py checks that against the dense MoE."""
    x_a, x_b = inp.x[me].float(), inp.x[1 - me][: 5 + me].float()
    torch.manual_seed(0)  # the same replicated weights on every rank
    ns = _run(code, buffer=buffer, x_a=x_a, x_b=x_b, attention=torch.tanh)
    moe = ns["moe"]
    with torch.no_grad():
        for got, x, what in ((ns["y_a"], x_a, "A"), (ns["y_b"], torch.tanh(x_b), "B")):
            same_bits(got, one_call(moe, x), f"decode micro-batch {what}")


CHECKS = {
    "deep_ep": _check_deep_ep,
    "deep_ep_package": _check_deep_ep_package,
    "prepare_finalize": _check_prepare_finalize,
    "prepare_finalize_low_latency": _check_prepare_finalize_low_latency,
    "megatron": _check_megatron,
    "compile": _check_compile,
    "decode_overlap": _check_decode_overlap,
}


# The blocks that import the optional `deep_ep` package (pip install ./deep_ep_compat): their own test.
PACKAGE_BLOCKS = ("deep_ep_package",)


def _worker(rank: int, world: int, names: list[str]) -> None:
    blocks = _blocks()
    assert set(blocks) == set(CHECKS), f"tested blocks {sorted(blocks)} vs checks {sorted(CHECKS)}"
    inp = make_inputs(31, TOKENS, HIDDEN, EXPERTS, TOPK)
    with moe_ep.Buffer(hidden=HIDDEN, num_experts=EXPERTS, num_topk=TOPK, max_tokens_per_rank=T,
                       backend="reference", low_latency=True) as buffer:
        for name in names:
            CHECKS[name](blocks[name], inp, rank, buffer)


def test_integration_snippets() -> None:
    run_workers(WORLD, _worker, [name for name in CHECKS if name not in PACKAGE_BLOCKS])


@needs_deep_ep()
def test_deep_ep_package_snippets() -> None:
    run_workers(WORLD, _worker, list(PACKAGE_BLOCKS))
