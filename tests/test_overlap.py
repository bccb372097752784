"""Overlap inside moe_ep.MoE (moe_ep.moe.overlap): MoE(overlap=True) against overlap=False, and the start /
compute / finish decode API. One spawn per world size (R = 2, 4 on the CPU; on a GPU EP2, EP4 and 2 nodes x 2,
ranks sharing it), many cases inside; 12 experts, so every world size divides them.

overlap=True runs the same kernels on the same inputs, only on two streams, so the output, the routing and
every gradient (input, router, experts, shared expert) must be the same bits as overlap=False, and the same
bits run to run; both are also checked against the independent dense MoE of tests/test_layer.py (float32
experts, on each case's own seeded inputs as there; on a GPU the bf16 grouped-GEMM experts are checked
bitwise only). On a GPU, random spin delays
on both streams (before each Buffer call of the forward, each expert call and each weight-gradient
pass) make a missing event show as a wrong result. Decode through start/finish is bitwise equal to the
one-call low-latency path (the same kernels in the same order).
"""
from __future__ import annotations

import contextlib
import random
from typing import Callable, Optional

import pytest
import torch
import torch.distributed as dist

import moe_ep
from moe_ep import MoE
from moe_ep.moe import experts as experts_module
from moe_ep.moe import overlap
from tests._dist import device, requires_gpus, run_workers
from tests.test_layer import (FP8_TOL, TOL, Case, _build, _close, _dense, _grad, _inputs, _reference_modules,
                              _shared_f64)

CASES = [
    Case(11, [23, 17, 0], 32, 12, 2, 24, dict(aux_loss_coef=0.01, z_loss_coef=1e-3)),  # a rank with no tokens
    Case(12, [19, 31, 12], 64, 12, 4, 32, dict(score_func="sigmoid", num_groups=3, topk_groups=2), shared=24),
    Case(13, [3, 1, 2], 16, 12, 1, 16, dict(capacity_factor=1.0), shared=8),
]
# (case index, MoE options) per layer variant: expert-major (the default), the row path, worst-case
# shapes, recomputed SwiGLU
VARIANTS = [(0, {}), (1, {}), (2, {}), (1, dict(expert_major=False)), (1, dict(worst_case=True)),
            (0, dict(recompute_swiglu=True)), (2, dict(expert_major=False, recompute_swiglu=True))]


def _poison(buf: moe_ep.Buffer) -> None:
    """Every rank's normal-mode workspace set to 0x7F bytes between barriers (none on the reference backend),
    so rows a call fails to write, or reads too early, cannot pass for results."""
    if buf.device.type == "cuda":
        torch.cuda.synchronize(buf.device)
    dist.barrier()
    buf.fill_workspace(0x7F)
    dist.barrier()


def _run(moe: MoE, x0: torch.Tensor, grad_out: torch.Tensor) -> dict[str, torch.Tensor]:
    """Output, routing and every gradient of sum(out * grad_out) + aux loss, on a poisoned workspace."""
    _poison(moe.buffer)
    moe.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_(True)
    out = moe(x, mode="normal")
    ((out * grad_out).sum() + moe.aux_loss).backward()
    got = {"out": out.detach(), "x.grad": _grad(x), "topk_idx": moe.last_routing.topk_idx,
           "topk_weights": moe.last_routing.topk_weights.detach()}
    for name, p in moe.named_parameters():
        got[name] = _grad(p).clone()
    return got


def _want(case: Case, moe: MoE, full: dict, x0: torch.Tensor, grad_out: torch.Tensor) -> dict:
    """The dense MoE's output and gradients, named like _run's (experts: this rank's slice of the sum
    over ranks)."""
    ref_router, ref_shared = _reference_modules(case, moe, dist.group.WORLD)
    xr = x0.clone().requires_grad_(True)
    wr = {k: v.clone().requires_grad_(True) for k, v in full.items()}
    r = ref_router(xr)
    out = _dense(xr, r, wr) + _shared_f64(xr, ref_shared)
    ((out * grad_out).sum() + r.aux_loss + r.z_loss).backward()
    want = {"out": out.detach(), "x.grad": _grad(xr), "router.weight": _grad(ref_router.weight)}
    if ref_shared is not None:
        want.update({f"shared.{n}": _grad(p) for n, p in ref_shared.items()})
    lo, e_l = moe.experts.first_expert, moe.experts.num_local_experts
    for name, w in wr.items():
        total = _grad(w).clone()
        dist.all_reduce(total)
        want[f"experts.{name}"] = total[lo:lo + e_l]
    return want


def _normal_case(buf: moe_ep.Buffer, rank: int, case: Case, layer_opts: dict, dtype: torch.dtype) -> None:
    """overlap=True against overlap=False bitwise (each run twice: the same bits again), and both against the
    dense MoE (float32 experts)."""
    template, full = _build(case, buf, dtype)
    x0, grad_out = _inputs(case, rank, buf.device)
    want = _want(case, template, full, x0, grad_out) if dtype == torch.float32 else None
    runs = {}
    for on in (False, True):
        moe = MoE(buf, case.ffn, shared_ffn_hidden=case.shared, dtype=dtype, overlap=on, **layer_opts, **case.router)
        moe.load_state_dict(template.state_dict())
        runs[on] = _run(moe, x0, grad_out)
        again = _run(moe, x0, grad_out)
        label = f"overlap={on} {layer_opts} {dtype} seed={case.seed}"
        for name, t in runs[on].items():
            assert torch.equal(t, again[name]), f"{label}: {name} differs run to run"
        for name, w in (want or {}).items():
            _close(runs[on][name], w, f"{label}: {name}")
    assert runs[False].keys() == runs[True].keys()
    for name, t in runs[False].items():
        assert torch.equal(runs[True][name], t), f"{layer_opts} {dtype} seed={case.seed}: {name} differs with overlap"


def _setting_must_agree(rank: int, world: int, opts: dict) -> None:
    """A rank with another overlap setting: every rank raises at the first forward, naming every value."""
    buf = moe_ep.Buffer(None, device=device(), hidden=16, num_experts=12, num_topk=2, max_tokens_per_rank=8,
                        **opts)
    with pytest.raises(ValueError, match="overlap must be a bool"):
        MoE(buf, 8, overlap=2)
    moe = MoE(buf, 8, overlap=rank == world - 1)
    with pytest.raises(ValueError, match=f"overlap=True on rank {world - 1}"):
        moe(torch.randn(5, 16, device=buf.device), mode="normal")
    same = MoE(buf, 8, overlap=True)
    same(torch.randn(5, 16, device=buf.device), mode="normal")  # the group is still in step
    buf.close()


# ---- decode ----------------------------------------------------------------------------------------
def _two_micro_batches(moe: MoE, xa: torch.Tensor, xb: torch.Tensor,
                       between: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A's tokens travel while B's `between` runs; B's travel while A's outputs do."""
    pa = moe.start(xa)
    hb = between(xb)
    pa.compute()
    pb = moe.start(hb)
    ya = pa.finish()
    return ya, pb.finish()


def _one_call(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The one-call low-latency path through the custom ops (no receive hooks), plus the shared expert."""
    tokens = x.reshape(-1, moe.hidden)
    out = moe._low_latency(tokens, moe.router(tokens)).to(x.dtype)
    shared = moe.shared_forward(tokens)
    return (out if shared is None else out + shared.to(x.dtype)).view(x.shape)


def _decode_case(rank: int, world: int, use_fp8: bool, opts: dict) -> None:
    case = Case(31, [5, 0, 7], 128 if use_fp8 else 32, 12, 2, 24, dict(score_func="sigmoid"), shared=16)
    buf = moe_ep.Buffer(None, device=device(), hidden=case.hidden, num_experts=case.experts, num_topk=case.topk,
                        max_tokens_per_rank=16, low_latency=True, **opts)
    moe, full = _build(case, buf)
    moe.low_latency_fp8 = use_fp8
    ref_router, ref_shared = _reference_modules(case, moe, None)
    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    xa = torch.randn(case.n(rank), case.hidden, generator=g).to(buf.device)
    xb = torch.randn(case.n(rank + 1), case.hidden, generator=g).to(buf.device)
    with torch.no_grad():
        ya, yb = _two_micro_batches(moe, xa, xb, lambda t: t * 0.5)
        for x, y, what in ((xa, ya, "A"), (xb * 0.5, yb, "B")):
            assert torch.equal(y, _one_call(moe, x)), f"micro-batch {what}: start/finish vs one call"
            r = ref_router(x)
            _close(y, _dense(x, r, full) + _shared_f64(x, ref_shared), f"micro-batch {what} vs dense",
                   FP8_TOL if use_fp8 else TOL)
        again = _two_micro_batches(moe, xa, xb, lambda t: t * 0.5)
        assert torch.equal(again[0], ya) and torch.equal(again[1], yb), "decode differs run to run"
        assert torch.equal(moe(xa, mode="low_latency"), ya), "forward(mode='low_latency') vs start/finish"
        # phases out of order raise on every rank before any communication; the step then completes
        pa = moe.start(xa)
        with pytest.raises(RuntimeError, match="still in flight"):
            moe.start(xb)
        pa.compute()
        with pytest.raises(RuntimeError, match="already ran"):
            pa.compute()
        assert torch.equal(pa.finish(), ya)
        with pytest.raises(RuntimeError, match="already ran"):
            pa.finish()
    with pytest.raises(RuntimeError, match="no backward"):
        moe.start(xa.clone().requires_grad_(True))
    buf.close()


def _worker(rank: int, world: int, opts: Optional[dict] = None) -> None:
    """opts: the Buffer arguments every case adds (backend, ranks_per_node)."""
    opts = opts or {"backend": "reference"}
    gpu = device().type == "cuda"
    for index, case in enumerate(CASES):  # one Buffer per case, every variant of it inside
        buf = moe_ep.Buffer(None, device=device(), hidden=case.hidden, num_experts=case.experts, num_topk=case.topk,
                            max_tokens_per_rank=max(case.n(r) for r in range(world)) or 1, **opts)
        for layer_opts in (o for i, o in VARIANTS if i == index):
            if not gpu or not layer_opts:  # float32 experts against the dense MoE: every variant on the CPU
                _normal_case(buf, rank, case, layer_opts, torch.float32)
            if gpu:  # bf16 experts: the grouped-GEMM path (sm90), every variant
                _normal_case(buf, rank, case, layer_opts, torch.bfloat16)
        buf.close()
    _setting_must_agree(rank, world, opts)
    _decode_case(rank, world, use_fp8=False, opts=opts)
    _decode_case(rank, world, use_fp8=True, opts=opts)


@pytest.mark.parametrize("world", [2, 4])
def test_overlap(world: int) -> None:
    run_workers(world, _worker)


# ---- GPU: the native backend, random delays on both streams, the decode API in a CUDA graph ----
def _delayed_streams(seed: int) -> None:
    """Random spin delays on the communication stream before each forward Buffer call, on the compute
    stream before each expert call and each weight-gradient pass (the end of the experts' backward, which
    the backward's combine waits for), so that a missing event shows up as a wrong result."""
    rng = random.Random(seed)
    on_comm, run_experts, weight_grads = overlap._Streams.on_comm, MoE.run_experts, experts_module._weight_grads

    @contextlib.contextmanager
    def slow_comm(self, after, *inputs):
        with on_comm(self, after, *inputs):
            if self.comm is not None:  # inside, the communication stream is the current one
                torch.cuda._sleep(rng.randrange(1, 200_000))
            yield

    def slow_experts(self, d):
        torch.cuda._sleep(rng.randrange(1, 200_000))
        return run_experts(self, d)

    def slow_weight_grads(*args):
        torch.cuda._sleep(rng.randrange(1, 200_000))
        return weight_grads(*args)

    overlap._Streams.on_comm = slow_comm
    MoE.run_experts = slow_experts
    experts_module._weight_grads = slow_weight_grads


def _graph_decode(rank: int, world: int, opts: dict) -> None:
    """start/compute/finish of two micro-batches captured in one CUDA graph, replayed on new inputs."""
    case = Case(41, [6, 3, 8], 128, 8, 2, 32, shared=16)
    buf = moe_ep.Buffer(None, device=device(), hidden=case.hidden, num_experts=case.experts, num_topk=case.topk,
                        max_tokens_per_rank=16, low_latency=True, **opts)
    moe, _ = _build(case, buf)
    xa = torch.randn(case.n(rank), case.hidden, device=buf.device)
    xb = torch.randn(case.n(rank + 1), case.hidden, device=buf.device)
    with torch.no_grad():
        for _ in range(2):  # warm up eagerly (allocator, Triton, the native engine)
            _two_micro_batches(moe, xa, xb, torch.tanh)
        torch.cuda.synchronize()
        dist.barrier()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ya, yb = _two_micro_batches(moe, xa, xb, torch.tanh)
        for step in range(3):
            xa.copy_(torch.randn_like(xa).mul_(step + 1))
            xb.copy_(torch.randn_like(xb))
            ya.fill_(float("nan"))  # poisoned: the replay must write every row
            yb.fill_(float("nan"))
            graph.replay()
            want_a, want_b = _one_call(moe, xa), _one_call(moe, torch.tanh(xb))
            assert torch.equal(ya, want_a) and torch.equal(yb, want_b), f"replay {step}"
    buf.close()


def _gpu_worker(rank: int, world: int, ranks_per_node: Optional[int]) -> None:
    _delayed_streams(1234 + rank)
    opts = {"backend": "auto", "ranks_per_node": ranks_per_node}
    _worker(rank, world, opts)
    _graph_decode(rank, world, opts)


@requires_gpus()
@pytest.mark.parametrize("world,ranks_per_node", [(2, None), (4, None), (4, 2)], ids=["ep2", "ep4", "2x2"])
def test_overlap_gpu(world: int, ranks_per_node: Optional[int]) -> None:
    """EP2 and EP4 on one node; 2 nodes x 2 ranks, so the cross-node kernels carry the rows. Ranks share the GPU."""
    run_workers(world, _gpu_worker, ranks_per_node, backend="gpu", timeout_s=900)
