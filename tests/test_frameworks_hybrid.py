"""The frameworks' own HybridEP code, unchanged, over moe_ep.deep_ep, against brute force over all ranks' inputs:
torchtitan 0.3.0's HybridEPTokenDispatcher and Megatron-Core 0.19.2's flex dispatcher with backend "hybridep",
and Megatron's "deepep" backend (DeepEP V1's Buffer), forward and backward. 2 ranks on CPU (gloo, reference
backend) and 2 ranks sharing one GPU (native kernels).

The frameworks are not installed: the tests read the files of their wheels they use from $MOE_EP_FRAMEWORKS,
else <repo>/.frameworks (git-ignored), their dependencies from its deps/ folder; a test skips when its
framework is not there. tests/fetch_frameworks.py fills it (.ci/run does, with --training-only).

`deep_ep` (and `deep_ep.utils`, `deep_ep.hybrid_ep_buffer`) are aliased to moe_ep.deep_ep before the
frameworks' modules are imported. Shims, none about communication:
- torch: torchtitan's hybridep.py imports `CustomClassBase` from torch._library.opaque_object, which this
  torch calls `OpaqueBase`; the name is added when missing.
- torchtitan (CPU only): its hybridep ops are registered for CUDA only; the same functions are registered
  for the CPU key.
- Megatron (CPU only): _HybridEPManager allocates its over_budget flag with device="cuda"; that one
  allocation is made on the CPU.
- Megatron: its jit_fuser compiles dispatch_preprocess with torch.compile; TorchDynamo is disabled
  (compiling changes no result and takes long on a shared CPU).
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import pytest
import torch
import torch._dynamo
import torch.distributed as dist

import moe_ep.deep_ep
from moe_ep.deep_ep import hybrid_ep_buffer
from tests._dist import device, requires_gpus, run_workers
from tests.oracle import Inputs, assert_same_bits, expected_combine

ROOT = Path(__file__).resolve().parents[1]
FRAMEWORKS = Path(os.environ.get("MOE_EP_FRAMEWORKS", ROOT / ".frameworks"))
WORLD, HIDDEN, EXPERTS, TOPK, T = 2, 64, 8, 3, 32
NUM_LOCAL = EXPERTS // WORLD


def _use_frameworks() -> None:
    """The unpacked frameworks on sys.path and `deep_ep` aliased to moe_ep.deep_ep (before their import)."""
    for path in (FRAMEWORKS / "deps", FRAMEWORKS):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    sys.modules["deep_ep"] = sys.modules["deep_ep.utils"] = moe_ep.deep_ep
    sys.modules["deep_ep.hybrid_ep_buffer"] = hybrid_ep_buffer
    from torch._library import opaque_object

    if not hasattr(opaque_object, "CustomClassBase"):  # shim: the torch name torchtitan imports
        opaque_object.CustomClassBase = getattr(opaque_object, "OpaqueBase", object)
    torch._dynamo.config.disable = True  # shim: Megatron's jit_fuser (torch.compile)


def _have(package: str) -> bool:
    return (FRAMEWORKS / package).is_dir()


needs_torchtitan = pytest.mark.skipif(not _have("torchtitan"), reason=f"torchtitan 0.3.0 is not unpacked in {FRAMEWORKS}")


def _skip_unless_torchtitan_imports() -> None:
    """Skip when torchtitan's HybridEP modules do not import on this torch (torchtitan 0.3.0 follows torch
    nightly, e.g. its opaque-object API), tried in a fresh interpreter so this one keeps no alias."""
    code = ("from tests.test_frameworks_hybrid import _use_frameworks; _use_frameworks(); "
            "import torchtitan.distributed.deepep.hybridep, torchtitan.models.common.token_dispatcher")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"torchtitan 0.3.0 does not import with torch {torch.__version__}: {last}")


needs_megatron = pytest.mark.skipif(not _have("megatron"), reason=f"megatron-core 0.19.2 is not unpacked in {FRAMEWORKS}")


# ---- every rank's inputs and the brute-force results ------------------------------------------------
def _inputs(seed: int, tokens: list[int]) -> Inputs:
    """Fresh rows; top-k of distinct experts (HybridEP's routing maps hold no -1) and weights in (0, 1]."""
    g = torch.Generator().manual_seed(seed)
    xs, idxs, ws = [], [], []
    for n in tokens:
        xs.append((torch.randn(n, HIDDEN, generator=g) * 2).to(torch.bfloat16))
        idxs.append(torch.rand(n, EXPERTS, generator=g).topk(TOPK, dim=1).indices.contiguous())
        ws.append(1.0 - torch.rand(n, TOPK, generator=g))
    return Inputs(xs, idxs, ws)


def _scale(e: int) -> float:
    """Expert e multiplies its rows by (e + 1) / 8 (exact in bf16)."""
    return (e + 1) / 8


@dataclass
class Layout:
    """Rank me's expert-major rows as HybridEP lays them out: per local expert, (source rank, token)
    ascending, padded to `align`; only the first `rows` kept (pairs past them dropped)."""

    src: list[Optional[tuple[int, int, int]]]  # (source rank, token, global expert) or None for padding
    counts: list[int]  # rows per local expert (padded), after the cut
    kept: set[tuple[int, int, int]]  # (source rank, token, global expert) pairs within the rows


def _layout(inp: Inputs, me: int, align: int, rows: Optional[int]) -> Layout:
    src: list[Optional[tuple[int, int, int]]] = []
    for e in range(me * NUM_LOCAL, (me + 1) * NUM_LOCAL):
        block = [(s, i, e) for s in range(WORLD) for i, row in enumerate(inp.topk_idx[s].tolist()) if e in row]
        block += [None] * (-len(block) % align)
        src.append(block)
    flat = [p for block in src for p in block]
    limit = len(flat) if rows is None else rows
    counts, start = [], 0
    for block in src:
        counts.append(max(0, min(start + len(block), limit) - start))
        start += len(block)
    flat = (flat + [None] * limit)[:limit]
    return Layout(flat, counts, {p for p in flat if p is not None})


def _pair_rows(inp: Inputs, layout: Layout, value: Callable[[int, int, int], torch.Tensor]) -> torch.Tensor:
    return torch.stack([value(*p) if p is not None else torch.zeros_like(value(0, 0, 0)) for p in layout.src]) \
        if layout.src else torch.zeros(0, HIDDEN, dtype=torch.bfloat16)


def _weight(inp: Inputs, s: int, i: int, e: int) -> torch.Tensor:
    return inp.topk_weights[s][i][inp.topk_idx[s][i].tolist().index(e)]


def _combined(inp: Inputs, me: int, kept: list[set], pair: Callable[[int, int, int], torch.Tensor]) -> torch.Tensor:
    """Brute-force combine: each receiving rank sums its kept pairs of the token in ascending expert order
    (float32 from +0.0, one bf16 rounding), then the ranks' rows are summed (expected_combine)."""
    def row_of(r: int, s: int, i: int) -> torch.Tensor:
        acc = torch.zeros(HIDDEN, dtype=torch.float32)
        for e in sorted(inp.topk_idx[s][i].tolist()):
            if e // NUM_LOCAL == r:
                acc = acc + (pair(s, i, e).float() if (s, i, e) in kept[r] else 0.0)
        return acc.to(torch.bfloat16)

    return expected_combine(inp, me, WORLD, EXPERTS, row_of)


def _check_grads(inp: Inputs, me: int, kept: list[set], probe: torch.Tensor, grad_x: torch.Tensor,
                 grad_w: torch.Tensor, what: str) -> None:
    """d(sum(out * probe)) against the dense formula out[t] = sum over kept pairs of w * scale(e) * x[t],
    within bf16 roundings (gradient rows cross ranks as bf16)."""
    x = inp.x[me].float()
    want_x = torch.zeros_like(x)
    want_w = torch.zeros(inp.topk_weights[me].shape)
    for t, row in enumerate(inp.topk_idx[me].tolist()):
        for k, e in enumerate(row):
            if (me, t, e) in kept[e // NUM_LOCAL]:
                want_x[t] += float(inp.topk_weights[me][t, k]) * _scale(e) * probe[t]
                want_w[t, k] = _scale(e) * float((probe[t] * x[t]).sum())
    for got, want, name in ((grad_x.float().cpu(), want_x, "x"), (grad_w.float().cpu(), want_w, "weights")):
        err = float((got - want).abs().max()) if want.numel() else 0.0
        assert err <= 2 ** -6 * float(want.abs().max()), f"{what}: gradient of {name}: max error {err:.3e}"


def _experts(hidden: torch.Tensor, counts: list[int], me: int, probs: Optional[torch.Tensor]) -> torch.Tensor:
    """Grouped 'experts': local expert e's rows times scale(e) (times each row's prob when given), in float32."""
    out, start = [], 0
    for e, c in enumerate(counts):
        rows = hidden[start:start + c].float() * _scale(me * NUM_LOCAL + e)
        out.append(rows * probs[start:start + c].unsqueeze(1) if probs is not None else rows)
        start += c
    out.append(hidden[start:].float() * 0)  # rows past the counts (none, or a non-blocking output's tail)
    return torch.cat(out).to(torch.bfloat16)


# ---- torchtitan 0.3.0: HybridEPTokenDispatcher ------------------------------------------------------
@contextlib.contextmanager
def _torchtitan_dispatcher(capacity: Optional[float], pad: Optional[int]) -> Iterator[object]:
    from torch.distributed.device_mesh import DeviceMesh
    from torchtitan.distributed.deepep import hybridep
    from torchtitan.models.common.token_dispatcher import HybridEPTokenDispatcher

    if device().type == "cpu":  # shim: the same op functions for the CPU key
        for op in (hybridep._dispatch_impl, hybridep._combine_impl, hybridep._dispatch_bwd_impl,
                   hybridep._combine_bwd_impl):
            if "cpu" not in op._backend_fns:
                op.register_kernel("cpu", op._init_fn)
    config = HybridEPTokenDispatcher.Config(num_experts=EXPERTS, top_k=TOPK, non_blocking_capacity_factor=capacity,
                                            pad_multiple=pad, hidden_dim=HIDDEN, num_max_tokens_per_rank=T)
    dispatcher = HybridEPTokenDispatcher(config)
    dispatcher.wire_meshes(ep_mesh=DeviceMesh.from_group(dist.group.WORLD, device().type))
    yield dispatcher


def _check_torchtitan(me: int, seed: int, tokens: list[int], capacity: Optional[float], pad: Optional[int]) -> None:
    what = f"torchtitan hybridep capacity={capacity} pad={pad} rank {me}"
    inp = _inputs(seed, tokens)
    dev = device()
    def rows(n: int) -> Optional[int]:
        """The non-blocking output's rows, as torchtitan's docstring gives them."""
        if capacity is None:
            return None
        r = int(n * WORLD * min(NUM_LOCAL, TOPK) * capacity)
        return r + -r % (pad or 1)

    layouts = [_layout(inp, r, pad or 1, rows(tokens[r])) for r in range(WORLD)]
    mine = layouts[me]
    with _torchtitan_dispatcher(capacity, pad) as dispatcher:
        x = inp.x[me].to(dev).requires_grad_()
        w = inp.topk_weights[me].to(dev).requires_grad_()
        hidden, counts, metadata = dispatcher.dispatch(x, w, inp.topk_idx[me].to(dev), torch.zeros(EXPERTS))
        assert_same_bits(hidden.detach().cpu(), _pair_rows(inp, mine, lambda s, i, e: inp.x[s][i]), f"{what}: rows")
        assert counts.tolist() == mine.counts, f"{what}: tokens per expert {counts.tolist()} != {mine.counts}"
        scores = metadata.state.permuted_scores
        want_scores = [float(_weight(inp, *p)) if p is not None else 0.0 for p in mine.src]
        assert_same_bits(scores.detach().cpu(), torch.tensor(want_scores).to(torch.bfloat16), f"{what}: scores")
        y = _experts(hidden, mine.counts, me, None)
        out = dispatcher.combine(y, metadata, x)

    def pair(s: int, i: int, e: int) -> torch.Tensor:
        expert = (inp.x[s][i].float() * _scale(e)).to(torch.bfloat16)
        return (expert.float() * _weight(inp, s, i, e).to(torch.bfloat16).float()).to(torch.bfloat16)

    kept = [layout.kept for layout in layouts]
    assert_same_bits(out.detach().cpu(), _combined(inp, me, kept, pair), f"{what}: combined")
    probe = torch.linspace(-1.0, 1.0, out.numel()).view(out.shape)
    (out.float() * probe.to(dev)).sum().backward()
    _check_grads(inp, me, kept, probe, x.grad, w.grad, what)


# ---- Megatron-Core 0.19.2: MoEFlexTokenDispatcher ---------------------------------------------------
@contextlib.contextmanager
def _cpu_over_budget() -> Iterator[None]:
    """Shim (CPU only): _HybridEPManager's over_budget flag, allocated with device="cuda", on the CPU."""
    if device().type != "cpu":
        yield
        return
    zeros = torch.zeros

    def on_cpu(*args, **kwargs):
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return zeros(*args, **kwargs)

    torch.zeros = on_cpu
    try:
        yield
    finally:
        torch.zeros = zeros


def _megatron_dispatcher(backend: str, **knobs: object) -> object:
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=1, num_moe_experts=EXPERTS,
                               moe_router_topk=TOPK, moe_token_dispatcher_type="flex",
                               moe_flex_dispatcher_backend=backend, moe_router_dtype="fp32",
                               expert_model_parallel_size=WORLD, **knobs)
    groups = ProcessGroupCollection(ep=dist.group.WORLD, expt_tp=None, tp_ep=dist.group.WORLD)
    with _cpu_over_budget():
        return MoEFlexTokenDispatcher(NUM_LOCAL, list(range(dist.get_rank() * NUM_LOCAL, (dist.get_rank() + 1) * NUM_LOCAL)),
                                      config, pg_collection=groups)


def _combined_rows(inp: Inputs, me: int, tokens: list[int], rows: torch.Tensor) -> torch.Tensor:
    """Brute-force combine of the rows each rank hands the combine (every rank's, gathered): rank r's
    rows are its received tokens, source rank then token ascending."""
    every: list = [None] * WORLD
    dist.all_gather_object(every, rows.detach().cpu())
    received = [[(s, i) for s in range(WORLD) for i in range(tokens[s])
                 if any(e >= 0 and e // NUM_LOCAL == r for e in inp.topk_idx[s][i].tolist())] for r in range(WORLD)]
    return expected_combine(inp, me, WORLD, EXPERTS, lambda r, s, i: every[r][received[r].index((s, i))])


def _check_megatron(me: int, seed: int, tokens: list[int], backend: str, **knobs: object) -> None:
    what = f"megatron {backend} {knobs} rank {me}"
    inp = _inputs(seed, tokens)
    dev = device()
    dispatcher = _megatron_dispatcher(backend, **knobs)
    routing_map = torch.zeros(tokens[me], EXPERTS, dtype=torch.bool)
    probs = torch.zeros(tokens[me], EXPERTS)
    for t, row in enumerate(inp.topk_idx[me].tolist()):
        for k, e in enumerate(row):
            routing_map[t, e], probs[t, e] = True, inp.topk_weights[me][t, k]
    x = inp.x[me].to(dev).requires_grad_()
    probs = probs.to(dev).requires_grad_()
    hidden, p = dispatcher.dispatch_preprocess(x, routing_map.to(dev), probs)
    hidden, p = dispatcher.token_dispatch(hidden, p)
    hidden, counts, permuted_probs = dispatcher.dispatch_postprocess(hidden, p)
    counts = [int(c) for c in counts.tolist()]
    layouts = [_layout(inp, r, 1, None) for r in range(WORLD)]
    assert counts == layouts[me].counts, f"{what}: tokens per expert {counts} != {layouts[me].counts}"
    assert_same_bits(hidden.detach().cpu(), _pair_rows(inp, layouts[me], lambda s, i, e: inp.x[s][i]), f"{what}: rows")
    want_probs = torch.tensor([float(_weight(inp, *q)) for q in layouts[me].src])
    assert_same_bits(permuted_probs.detach().float().cpu(), want_probs, f"{what}: probs")
    y = _experts(hidden, counts, me, permuted_probs.float())
    rows = dispatcher.combine_preprocess(y)
    out = dispatcher.combine_postprocess(dispatcher.token_combine(rows))

    def pair(s: int, i: int, e: int) -> torch.Tensor:
        return (inp.x[s][i].float() * _scale(e) * _weight(inp, s, i, e)).to(torch.bfloat16)

    kept = [layout.kept for layout in layouts]
    if backend == "deepep":  # Megatron sums a token's pairs on each rank itself (unpermute: on the GPU one
        # bf16 ulp off the float32 model in a few elements); the combine must sum exactly those rows
        want = _combined_rows(inp, me, tokens, rows)
    else:
        want = _combined(inp, me, kept, pair)
    assert_same_bits(out.detach().cpu(), want, f"{what}: combined")
    probe = torch.linspace(-1.0, 1.0, out.numel()).view(out.shape)
    (out.float() * probe.to(dev)).sum().backward()
    grad_w = probs.grad.gather(1, inp.topk_idx[me].to(dev))
    _check_grads(inp, me, kept, probe, x.grad, grad_w, what)
    assert bool((probs.grad.cpu()[~routing_map] == 0).all()), f"{what}: probs gradient off the routing map"


# ---- the workers ------------------------------------------------------------------------------------
TORCHTITAN_CASES = [  # (seed, tokens per rank, non_blocking_capacity_factor, pad_multiple)
    (1, [13, 9], None, None), (2, [11, 16], None, 4), (3, [12, 12], 1.0, 4), (4, [16, 16], 0.3, None),
]
MEGATRON_CASES = [  # (seed, tokens per rank, backend, TransformerConfig knobs)
    (5, [13, 9], "hybridep", {}), (6, [10, 14], "hybridep", {"moe_hybridep_pad_uneven_dispatch_inputs": True}),
    (7, [13, 9], "deepep", {}),
]


def _worker(rank: int, world: int, framework: str) -> None:
    _use_frameworks()
    if framework == "torchtitan":
        for seed, tokens, capacity, pad in TORCHTITAN_CASES:
            _check_torchtitan(rank, seed, tokens, capacity, pad)
    else:
        for seed, tokens, backend, knobs in MEGATRON_CASES:
            _check_megatron(rank, seed, tokens, backend, **knobs)


@needs_torchtitan
def test_torchtitan_hybridep() -> None:
    _skip_unless_torchtitan_imports()
    run_workers(WORLD, _worker, "torchtitan")


@needs_megatron
def test_megatron_flex() -> None:
    run_workers(WORLD, _worker, "megatron")


@needs_torchtitan
@requires_gpus()
def test_torchtitan_hybridep_gpu() -> None:
    _skip_unless_torchtitan_imports()
    run_workers(WORLD, _worker, "torchtitan", backend="gpu", timeout_s=300)


@needs_megatron
@requires_gpus()
def test_megatron_flex_gpu() -> None:
    run_workers(WORLD, _worker, "megatron", backend="gpu", timeout_s=300)
