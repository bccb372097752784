"""The frameworks' own HybridEP code, unchanged, over moe_ep.deep_ep, against brute force over all ranks' inputs:
torchtitan 0.3.0's HybridEPTokenDispatcher and Megatron-Core 0.19.2's flex dispatcher with backend "hybridep",
and Megatron's "deepep" backend (DeepEP V1's Buffer), forward and backward; "deepep" also with 16384 tokens per
rank on the Buffer Megatron's fused_a2a sizes by Config.get_nvl_buffer_size_hint (rounds of 4096 tokens: the
native backend streams them). 2 ranks on CPU (gloo, reference backend) and 2 ranks sharing one GPU (native
kernels). The brute force is vectorized over all ranks' tokens, so it keeps up with 16384 per rank.

The frameworks are not installed: the tests read the files of their wheels they use from $MOE_EP_FRAMEWORKS,
else <repo>/.frameworks (git-ignored; tests/_frameworks.py), their dependencies from its deps/ folder; a test skips when its
framework is not there. tests/fetch_frameworks.py fills it (.ci/run does, with --training-only).

The frameworks import `deep_ep`, `deep_ep.utils` and `deep_ep.hybrid_ep_buffer` from moe_ep's installed
package (`pip install ./deep_ep_compat`; the tests skip without it). Shims, none about communication:
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
import itertools
import subprocess
import sys
from dataclasses import dataclass
from typing import Iterator, Optional, Union

import pytest
import torch
import torch._dynamo
import torch.distributed as dist

import moe_ep.deep_ep
from moe_ep.comm.config import DEEP_EP_HINT_TOKENS_PER_RANK
from tests._dist import device, requires_gpus, run_workers
from tests._frameworks import ROOT, import_path, needs
from tests.oracle import Inputs, assert_same_bits

WORLD, HIDDEN, EXPERTS, TOPK, T = 2, 64, 8, 3, 32
NUM_LOCAL = EXPERTS // WORLD


def _use_frameworks() -> None:
    """The unpacked frameworks on sys.path and the torch shims (before their import)."""
    import_path(())
    from torch._library import opaque_object

    if not hasattr(opaque_object, "CustomClassBase"):  # shim: the torch name torchtitan imports
        opaque_object.CustomClassBase = getattr(opaque_object, "OpaqueBase", object)
    torch._dynamo.config.disable = True  # shim: Megatron's jit_fuser (torch.compile)


needs_torchtitan = needs("torchtitan", "0.3.0")


def _skip_unless_torchtitan_imports() -> None:
    """Skip when torchtitan's HybridEP modules do not import on this torch (torchtitan 0.3.0 follows torch
    nightly, e.g. its opaque-object API), tried in a fresh interpreter so this one imports no framework."""
    code = ("from tests.test_frameworks_hybrid import _use_frameworks; _use_frameworks(); "
            "import torchtitan.distributed.deepep.hybridep, torchtitan.models.common.token_dispatcher")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"torchtitan 0.3.0 does not import with torch {torch.__version__}: {last}")


needs_megatron = needs("megatron", "0.19.2")


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


def _scale(e: Union[int, torch.Tensor]) -> Union[float, torch.Tensor]:
    """Expert e multiplies its rows by (e + 1) / 8 (exact in bf16; float32 for a tensor of expert ids)."""
    return (e + 1) / 8


def _starts(inp: Inputs) -> list[int]:
    """Where each rank's tokens begin in the ranks' tokens concatenated (rank, then token ascending)."""
    return [0, *torch.tensor([x.shape[0] for x in inp.x]).cumsum(0).tolist()]


@dataclass
class Layout:
    """Rank me's expert-major rows as the dispatchers lay them out: per local expert, (source rank, token)
    ascending, padded to `align`; only the first `rows` kept (pairs past them dropped). Rows are named by
    pair: a token of all ranks' concatenated (_starts) and the top-k slot of the expert."""

    src: torch.Tensor  # [rows] the pair's token in the concatenation, -1 for padding
    slot: torch.Tensor  # [rows] the pair's top-k slot, -1 for padding
    counts: list[int]  # rows per local expert (padded), after the cut
    kept: torch.Tensor  # [all ranks' tokens, K] bool: the pairs within the rows


def _layout(inp: Inputs, me: int, align: int, rows: Optional[int]) -> Layout:
    idx = torch.cat(inp.topk_idx)
    src, slot, sizes = [], [], []
    for e in range(me * NUM_LOCAL, (me + 1) * NUM_LOCAL):
        token, k = (idx == e).nonzero(as_tuple=True)  # row-major: (source rank, token) ascending
        pad = torch.full((-len(token) % align,), -1)
        src += [token, pad]
        slot += [k, pad]
        sizes.append(len(token) + len(pad))
    src, slot = torch.cat(src), torch.cat(slot)
    limit = len(src) if rows is None else rows
    counts = [max(0, min(start + n, limit) - start) for start, n in zip([0, *itertools.accumulate(sizes)], sizes)]
    src = torch.cat([src, torch.full((limit,), -1)])[:limit]
    slot = torch.cat([slot, torch.full((limit,), -1)])[:limit]
    kept = torch.zeros(idx.shape, dtype=torch.bool)
    kept[src[src >= 0], slot[src >= 0]] = True
    return Layout(src, slot, counts, kept)


def _pair_rows(layout: Layout, table: torch.Tensor) -> torch.Tensor:
    """table [all ranks' tokens, K, ...] (a value per pair) at the layout's rows; zeros for padding."""
    pad = layout.src < 0
    got = table[layout.src.clamp(min=0), layout.slot.clamp(min=0)]
    return got.masked_fill(pad.view(-1, *[1] * (got.dim() - 1)), 0)


def _per_pair(rows: list[torch.Tensor]) -> torch.Tensor:
    """[all ranks' tokens, K, ...]: each pair's value is its token's row of `rows` (one tensor per rank; a view)."""
    table = torch.cat(rows).unsqueeze(1)
    return table.expand(-1, TOPK, *table.shape[2:])


def _kept(inp: Inputs, me: int, layouts: list[Layout]) -> torch.Tensor:
    """[N_me, K] bool: rank me's pairs some rank kept."""
    starts = _starts(inp)
    return torch.stack([layout.kept for layout in layouts]).any(0)[starts[me]:starts[me + 1]]


def _sum_over_ranks(partials: torch.Tensor) -> torch.Tensor:
    """partials [WORLD, N, H] bf16 (zeros from ranks a token did not reach) -> bf16 of their float32 sum,
    ranks ascending from +0.0: the combine's sum over receiving ranks (as tests/oracle.expected_combine)."""
    acc = torch.zeros(partials.shape[1:], dtype=torch.float32)
    for r in range(WORLD):
        acc = acc + partials[r].float()
    return acc.to(torch.bfloat16)


def _combined(inp: Inputs, me: int, kept: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """Brute-force combine of rank me's pairs [N_me, K, H] bf16: each receiving rank sums the token's kept
    pairs in ascending expert order (float32 from +0.0, one bf16 rounding), then _sum_over_ranks."""
    idx = inp.topk_idx[me]
    order = idx.argsort(1)
    partials = torch.zeros(WORLD, *pairs[:, 0].shape)
    for slot in order.T:  # each token's slot of its k-th smallest expert, k ascending
        owner = idx.gather(1, slot[:, None]).squeeze(1) // NUM_LOCAL
        take = kept.gather(1, slot[:, None])
        row = pairs[torch.arange(len(slot)), slot].float()
        for r in range(WORLD):
            partials[r] += torch.where(take & (owner == r)[:, None], row, 0.0)
    return _sum_over_ranks(partials.to(torch.bfloat16))


def _check_grads(inp: Inputs, me: int, kept: torch.Tensor, probe: torch.Tensor, grad_x: torch.Tensor,
                 grad_w: torch.Tensor, what: str) -> None:
    """d(sum(out * probe)) against the dense formula out[t] = sum over kept pairs of w * scale(e) * x[t],
    within bf16 roundings (gradient rows cross ranks as bf16)."""
    scale = torch.where(kept, _scale(inp.topk_idx[me]), 0.0)
    want_x = (inp.topk_weights[me] * scale).sum(1, keepdim=True) * probe
    want_w = scale * (probe * inp.x[me].float()).sum(1, keepdim=True)
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
        assert_same_bits(hidden.detach().cpu(), _pair_rows(mine, _per_pair(inp.x)), f"{what}: rows")
        assert counts.tolist() == mine.counts, f"{what}: tokens per expert {counts.tolist()} != {mine.counts}"
        scores = metadata.state.permuted_scores
        want_scores = _pair_rows(mine, torch.cat(inp.topk_weights)).to(torch.bfloat16)
        assert_same_bits(scores.detach().cpu(), want_scores, f"{what}: scores")
        y = _experts(hidden, mine.counts, me, None)
        out = dispatcher.combine(y, metadata, x)

    # a pair: the expert's bf16 row times the bf16 score, rounded to bf16
    expert = (inp.x[me].float().unsqueeze(1) * _scale(inp.topk_idx[me]).unsqueeze(2)).to(torch.bfloat16)
    pairs = (expert.float() * inp.topk_weights[me].to(torch.bfloat16).float().unsqueeze(2)).to(torch.bfloat16)
    kept = _kept(inp, me, layouts)
    assert_same_bits(out.detach().cpu(), _combined(inp, me, kept, pairs), f"{what}: combined")
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


def _combined_rows(inp: Inputs, me: int, rows: torch.Tensor) -> torch.Tensor:
    """Brute-force combine of the rows each rank hands the combine (every rank's, gathered): rank r's
    rows are its received tokens, source rank then token ascending."""
    every: list = [None] * WORLD
    dist.all_gather_object(every, rows.detach().cpu())
    idx, mine = torch.cat(inp.topk_idx), slice(*_starts(inp)[me:me + 2])
    partials = []
    for r, handed in enumerate(every):
        received = ((idx >= 0) & (idx // NUM_LOCAL == r)).any(1)
        assert handed.shape[0] == int(received.sum()), f"rank {r} handed the combine {handed.shape[0]} rows"
        at = (received.cumsum(0) - 1).clamp(min=0)
        partials.append(torch.where(received[mine, None], handed[at[mine]], 0))
    return _sum_over_ranks(torch.stack(partials))


def _check_hint_budget(what: str) -> None:
    """Megatron's fused_a2a.get_buffer sized its deep_ep.Buffer (module-level `_buffer`) by
    Config.get_nvl_buffer_size_hint at bf16's 2 bytes per channel, so the drop-in's one normal-mode moe_ep
    Buffer holds a round of DEEP_EP_HINT_TOKENS_PER_RANK tokens per rank (larger calls stream through it)."""
    from megatron.core.transformer.moe import fused_a2a

    buf = fused_a2a._buffer
    hint = moe_ep.deep_ep.Config().get_nvl_buffer_size_hint(2 * HIDDEN, WORLD)
    assert buf.num_nvl_bytes == hint, f"{what}: num_nvl_bytes {buf.num_nvl_bytes} != the hint {hint}"
    rounds = [b.max_tokens_per_rank for b in buf.moe_ep_buffers]
    assert rounds == [DEEP_EP_HINT_TOKENS_PER_RANK], f"{what}: moe_ep Buffers' rounds {rounds}"


def _check_megatron(me: int, seed: int, tokens: list[int], backend: str, **knobs: object) -> None:
    what = f"megatron {backend} {knobs} {tokens} tokens rank {me}"
    inp = _inputs(seed, tokens)
    dev = device()
    dispatcher = _megatron_dispatcher(backend, **knobs)
    idx, w = inp.topk_idx[me], inp.topk_weights[me]
    routing_map = torch.zeros(tokens[me], EXPERTS, dtype=torch.bool).scatter_(1, idx, True)
    x = inp.x[me].to(dev).requires_grad_()
    probs = torch.zeros(tokens[me], EXPERTS).scatter_(1, idx, w).to(dev).requires_grad_()
    hidden, p = dispatcher.dispatch_preprocess(x, routing_map.to(dev), probs)
    hidden, p = dispatcher.token_dispatch(hidden, p)
    hidden, counts, permuted_probs = dispatcher.dispatch_postprocess(hidden, p)
    counts = [int(c) for c in counts.tolist()]
    layouts = [_layout(inp, r, 1, None) for r in range(WORLD)]
    mine = layouts[me]
    assert counts == mine.counts, f"{what}: tokens per expert {counts} != {mine.counts}"
    assert_same_bits(hidden.detach().cpu(), _pair_rows(mine, _per_pair(inp.x)), f"{what}: rows")
    want_probs = _pair_rows(mine, torch.cat(inp.topk_weights))
    assert_same_bits(permuted_probs.detach().float().cpu(), want_probs, f"{what}: probs")
    y = _experts(hidden, counts, me, permuted_probs.float())
    rows = dispatcher.combine_preprocess(y)
    out = dispatcher.combine_postprocess(dispatcher.token_combine(rows))

    kept = _kept(inp, me, layouts)
    if backend == "deepep":  # Megatron sums a token's pairs on each rank itself (unpermute: on the GPU one
        # bf16 ulp off the float32 model in a few elements); the combine must sum exactly those rows
        want = _combined_rows(inp, me, rows)
    else:  # a pair: x times the expert's scale times the prob, in float32, rounded to bf16
        pairs = inp.x[me].float().unsqueeze(1) * _scale(idx).unsqueeze(2) * w.unsqueeze(2)
        want = _combined(inp, me, kept, pairs.to(torch.bfloat16))
    assert_same_bits(out.detach().cpu(), want, f"{what}: combined")
    probe = torch.linspace(-1.0, 1.0, out.numel()).view(out.shape)
    (out.float() * probe.to(dev)).sum().backward()
    grad_w = probs.grad.gather(1, idx.to(dev))
    _check_grads(inp, me, kept, probe, x.grad, grad_w, what)
    assert bool((probs.grad.cpu()[~routing_map] == 0).all()), f"{what}: probs gradient off the routing map"
    if backend == "deepep":
        _check_hint_budget(what)


# ---- the workers ------------------------------------------------------------------------------------
TORCHTITAN_CASES = [  # (seed, tokens per rank, non_blocking_capacity_factor, pad_multiple)
    (1, [13, 9], None, None), (2, [11, 16], None, 4), (3, [12, 12], 1.0, 4), (4, [16, 16], 0.3, None),
]
MEGATRON_CASES = [  # (seed, tokens per rank, backend, TransformerConfig knobs)
    (5, [13, 9], "hybridep", {}), (6, [10, 14], "hybridep", {"moe_hybridep_pad_uneven_dispatch_inputs": True}),
    (7, [13, 9], "deepep", {}),
]
# Megatron's "deepep" backend with 16384 tokens per rank on its Buffer sized by the hint: four rounds of
# DEEP_EP_HINT_TOKENS_PER_RANK (streamed on the native backend; the reference backend has no rounds to stream)
HINT_BUDGET_CASES = [(8, [16384, 16384], "deepep", {})]


def _worker(rank: int, world: int, framework: str) -> None:
    _use_frameworks()
    if framework == "torchtitan":
        for seed, tokens, capacity, pad in TORCHTITAN_CASES:
            _check_torchtitan(rank, seed, tokens, capacity, pad)
    else:
        cases = {"megatron": MEGATRON_CASES, "megatron_hint_budget": HINT_BUDGET_CASES}[framework]
        for seed, tokens, backend, knobs in cases:
            _check_megatron(rank, seed, tokens, backend, **knobs)


@needs_torchtitan
def test_torchtitan_hybridep() -> None:
    _skip_unless_torchtitan_imports()
    run_workers(WORLD, _worker, "torchtitan")


@needs_megatron
def test_megatron_flex() -> None:
    run_workers(WORLD, _worker, "megatron")


@needs_megatron
def test_megatron_deepep_hint_budget() -> None:
    run_workers(WORLD, _worker, "megatron_hint_budget")


@needs_torchtitan
@requires_gpus()
def test_torchtitan_hybridep_gpu() -> None:
    _skip_unless_torchtitan_imports()
    run_workers(WORLD, _worker, "torchtitan", backend="gpu", timeout_s=300)


@needs_megatron
@requires_gpus()
def test_megatron_flex_gpu() -> None:
    run_workers(WORLD, _worker, "megatron", backend="gpu", timeout_s=300)


@needs_megatron
@requires_gpus()
def test_megatron_deepep_hint_budget_gpu() -> None:
    run_workers(WORLD, _worker, "megatron_hint_budget", backend="gpu", timeout_s=300)
