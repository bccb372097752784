"""torch.compile of moe_ep (R = 2): the custom ops pass torch.library.opcheck, and a compiled
moe_ep.MoE equals eager bit for bit, forward and backward. On CPU (gloo, reference backend) and on
2 GPUs (NCCL, native backend; deterministic algorithms on, so eager itself repeats bit for bit).

Bitwise checks compile with backend="aot_eager" (dynamo + AOT autograd over the moe_ep ops, eager
kernels): inductor compiles too (checked forward, within a bf16 rounding), but on CPU its fused
float kernels (SiLU and friends, in the experts, not in moe_ep) round differently from eager in the
last bit, and a forward + backward takes ~30 s to compile here.
Inputs are fresh each run; the seed is in every failure message.
"""
from __future__ import annotations

import gc
import os
import random
from typing import Optional

import torch
import torch._dynamo

import moe_ep
from moe_ep import MoE
from moe_ep.comm import fp8
from moe_ep.moe import ops
from tests._dist import device, requires_gpus, run_workers

WORLD = 2
EXPERTS, TOPK, T = 8, 3, 12
HIDDEN = {"reference": 16, "nvshmem": 128}  # per backend: tiny rows keep the CPU run fast
FRESH_ID = ("test_schema", "test_autograd_registration", "test_faketensor")
COMPILE_FLAGS = dict(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True)


def _randn(g: torch.Generator, dev: torch.device, *shape: int) -> torch.Tensor:
    """Drawn on the CPU (one generator for every device), then moved to dev."""
    return torch.randn(*shape, generator=g).to(dev)


def _routing(n: int, g: torch.Generator, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.rand(n, EXPERTS, generator=g).argsort(1)[:, :TOPK].contiguous()
    idx[torch.rand(n, TOPK, generator=g) < 0.2] = -1
    return idx.to(dev), torch.rand(n, TOPK, generator=g).to(dev)


def _opcheck(buf: moe_ep.Buffer, fp8_buf: moe_ep.Buffer, g: torch.Generator) -> None:
    """Every op on fresh inputs; opcheck runs each several times (collectively, alike on all ranks).

    The two dispatch ops skip only opcheck's eager-vs-AOT output comparison: their handle output is
    a fresh id on every call by design (moe_ep.moe.ops), so two calls never agree on it. The compiled
    MoE tests below compare everything else they return, traced through AOT autograd, bit for bit.
    """
    bid, dev = ops.register(buf), buf.device
    x = _randn(g, dev, 7, buf.cfg.hidden).to(torch.bfloat16).requires_grad_()
    idx, w = _routing(7, g, dev)
    w.requires_grad_()
    for worst_case in (True, False):
        torch.library.opcheck(torch.ops.moe_ep.dispatch.default, (x, idx, w, bid, worst_case), test_utils=FRESH_ID)
    _, _, _, _, src_rank, _, handle = ops.dispatch(x.detach(), idx, w.detach(), bid, True)
    y = _randn(g, dev, src_rank.shape[0], buf.cfg.hidden).to(torch.bfloat16).requires_grad_()
    torch.library.opcheck(torch.ops.moe_ep.combine.default, (y, handle, 7, bid))
    torch.library.opcheck(torch.ops.moe_ep.combine_with_weights.default,
                          (y.detach(), _randn(g, dev, src_rank.shape[0], TOPK), handle, 7, bid))
    torch.library.opcheck(torch.ops.moe_ep.cached_dispatch.default,
                          (x.detach(), handle, src_rank.shape[0], bid))
    for dtype in (torch.bfloat16, torch.float32):  # expert-major: pairs in, pairs' gradients out
        torch.library.opcheck(torch.ops.moe_ep.dispatch_expert_major.default, (x, idx, w, bid, dtype),
                              test_utils=FRESH_ID)
    pairs, _, _, em_handle = ops.dispatch_expert_major(x.detach(), idx, w.detach(), bid, torch.float32)
    yp = _randn(g, dev, *pairs.shape).requires_grad_()
    torch.library.opcheck(torch.ops.moe_ep.combine.default, (yp, em_handle, 7, bid))
    torch.library.opcheck(torch.ops.moe_ep.combine_with_weights.default,
                          (yp.detach(), _randn(g, dev, pairs.shape[0]), em_handle, 7, bid))
    torch.library.opcheck(torch.ops.moe_ep.cached_dispatch.default, (x.detach(), em_handle, pairs.shape[0], bid))
    torch.library.opcheck(torch.ops.moe_ep.low_latency_dispatch.default, (x.detach(), idx, bid, False, False),
                          test_utils=FRESH_ID)
    recv, _, _, ll_handle = ops.low_latency_dispatch(x.detach(), idx, bid, False, False)
    torch.library.opcheck(torch.ops.moe_ep.low_latency_combine.default,
                          (_randn(g, dev, *recv.shape).to(torch.bfloat16), idx, w.detach(), ll_handle, bid))
    fid = ops.register(fp8_buf)
    x8 = _randn(g, dev, 5, fp8_buf.cfg.hidden).to(torch.bfloat16)
    for round_scale in (False, True):
        torch.library.opcheck(torch.ops.moe_ep.low_latency_dispatch.default,
                              (x8, _routing(5, g, dev)[0], fid, True, round_scale), test_utils=FRESH_ID)


def _grads(moe: MoE, x: torch.Tensor, y: torch.Tensor) -> list[Optional[torch.Tensor]]:
    """d(sum(y * probe))/d(x, parameters), with a probe that depends on nothing but y's shape."""
    probe = torch.linspace(-1.0, 1.0, y.numel(), device=y.device).view(y.shape)
    params = [p for p in moe.parameters()]
    return list(torch.autograd.grad((y.float() * probe).sum(), [x, *params], allow_unused=True))


def same_bits(got: object, want: object, what: str) -> None:
    """Both None, or the same dtype, shape and bits (also used by tests/test_integrations.py)."""
    if want is None or got is None:
        assert got is None and want is None, f"{what}: one side has no gradient"
        return
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype}{list(got.shape)}"
    assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), f"{what}: bits differ"


def _check_mode(moe: MoE, mode: str, tokens: list[int], rank: int, g: torch.Generator, fullgraph: bool) -> None:
    """Compile moe once, run it on several fresh batches and compare with eager, bit for bit."""
    compiled = torch.compile(moe, backend="aot_eager", fullgraph=fullgraph)
    grad = mode == "normal"
    for step, n in enumerate(tokens):
        x = _randn(g, moe.buffer.device, n, moe.hidden).requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            want = moe(x, mode=mode)
            want_aux = moe.aux_loss
            got = compiled(x, mode=mode)
        what = f"{mode} worst_case={moe.worst_case} step {step} rank {rank}"
        same_bits(got, want, f"{what}: output")
        same_bits(moe.aux_loss, want_aux, f"{what}: aux loss")
        if grad:
            for i, (a, b) in enumerate(zip(_grads(moe, x, got), _grads(moe, x, want))):
                same_bits(a, b, f"{what}: gradient {i}")


def _check_inductor(moes: list[tuple[MoE, str]], rank: int, g: torch.Generator) -> None:
    """Inductor compiles the no-break modes too (forward only, to keep the test short); its fused
    float kernels may round differently from eager, so within one bf16 rounding of the largest value."""
    for moe, mode in moes:
        x = _randn(g, moe.buffer.device, T - rank, moe.hidden)
        with torch.no_grad():
            want, got = moe(x, mode=mode), torch.compile(moe, fullgraph=True)(x, mode=mode)
        err = float((got - want).abs().max())
        assert err <= 2 ** -7 * float(want.abs().max()), f"inductor {mode} rank {rank}: max error {err:.3e}"


def _worst_case_matches_exact(buf: moe_ep.Buffer, g: torch.Generator) -> None:
    """The worst-case layer (static-shape experts) computes what the exact-size layer does, up to
    float32 summation order before the bf16 combine: within one bf16 rounding of the largest value."""
    torch.manual_seed(7)
    exact = MoE(buf, 24, shared_ffn_hidden=8)
    worst = MoE(buf, 24, shared_ffn_hidden=8, worst_case=True)
    worst.load_state_dict(exact.state_dict())
    x = _randn(g, buf.device, 9, buf.cfg.hidden)
    want, got = exact(x, mode="normal"), worst(x, mode="normal")
    assert float((got - want).abs().max()) <= 2 ** -7 * float(want.abs().max())


def _deterministic() -> None:
    """GPU runs: eager repeats bit for bit (no atomics in backward kernels, fixed cuBLAS workspace);
    uninitialised memory is left as it is, as outside this test."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False


def _body(rank: int, world: int, seed: int, backend: str, parts: tuple[str, ...]) -> None:
    """parts: "aot_eager" (opcheck, compiled == eager bit for bit, the exact-size graph break) and/or
    "inductor" (forward, within a bf16 rounding)."""
    g = torch.Generator().manual_seed(seed * 31 + rank)
    buf = moe_ep.Buffer(device=device(), hidden=HIDDEN[backend], num_experts=EXPERTS, num_topk=TOPK, max_tokens_per_rank=T,
                        backend=backend, low_latency=True)
    fp8_buf = moe_ep.Buffer(device=device(), hidden=2 * fp8.BLOCK, num_experts=EXPERTS, num_topk=TOPK, max_tokens_per_rank=8,
                            backend=backend, low_latency=True)
    if buf.device.type == "cuda":
        _deterministic()
    if "aot_eager" in parts:
        _opcheck(buf, fp8_buf, g)
        _worst_case_matches_exact(buf, g)
    torch.manual_seed(seed)  # same weights on every rank where they are replicated
    router = dict(score_func="sigmoid", num_groups=4, topk_groups=2, routed_scaling_factor=1.5,
                  aux_loss_coef=0.01, z_loss_coef=1e-3)
    with torch._dynamo.config.patch(**COMPILE_FLAGS):
        low_latency = MoE(buf, 24, **router)
        worst_case = MoE(buf, 24, shared_ffn_hidden=8, worst_case=True, **router)
        if "aot_eager" in parts:
            _check_mode(low_latency, "low_latency", [T, 5], rank, g, fullgraph=True)
            _check_mode(worst_case, "normal", [T, 6 + 3 * rank], rank, g, fullgraph=True)
            torch._dynamo.reset()
        if "inductor" in parts:
            _check_inductor([(low_latency, "low_latency"), (worst_case, "normal")], rank, g)
            torch._dynamo.reset()
        if "aot_eager" in parts:
            # exact-size mode, on rows (default) and on expert-major pairs: one graph break, at the experts
            for expert_major, experts_fn in ((False, "_row_experts"), (True, "_sparse_experts")):
                exact = MoE(buf, 24, expert_major=expert_major)
                _check_mode(exact, "normal", [10, 4 + rank], rank, g, fullgraph=False)
                torch._dynamo.reset()
                x = _randn(g, buf.device, 8, buf.cfg.hidden)
                breaks = torch._dynamo.explain(exact)(x, mode="normal").break_reasons
                assert breaks and all(experts_fn in str(b.reason) for b in breaks), [str(b.reason) for b in breaks]
            torch._dynamo.reset()
    # Inductor may reuse a dead handle tensor's storage for a scalar output of the same graph (the
    # router's num_dropped), so a handle lives as long as the last RouterOutput a module keeps.
    for moe in (low_latency, worst_case):
        moe.last_routing = None
    gc.collect()
    assert not ops._handles, f"{len(ops._handles)} dispatch handles outlived their tensors"
    buf.close()
    fp8_buf.close()


def _run(moe_backend: str, parts: tuple[str, ...], dist_backend: str) -> None:
    """Spawn the ranks on a fresh seed, named in any failure."""
    seed = random.randrange(2**31)
    try:
        run_workers(WORLD, _body, seed, moe_backend, parts, backend=dist_backend)
    except AssertionError as e:
        raise AssertionError(f"seed {seed}\n{e}") from None


def test_compile() -> None:
    _run("reference", ("aot_eager", "inductor"), "gloo")


@requires_gpus()
def test_compile_gpu() -> None:
    """The native backend: opcheck, compiled (aot_eager) == eager bit for bit, forward and backward."""
    _run("nvshmem", ("aot_eager",), "gpu")


@requires_gpus()
def test_compile_inductor_gpu() -> None:
    """The native backend under inductor (Triton kernels for the rest of the layer), forward."""
    _run("nvshmem", ("inductor",), "gpu")
