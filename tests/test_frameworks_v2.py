"""The DeepEP V2 paths of torchtitan 0.3.0, vLLM 0.33.0 and SGLang 0.5.23, their own code unchanged,
on moe_ep.deep_ep.ElasticBuffer, through moe_ep's installed `deep_ep` package (`pip install ./deep_ep_compat`;
the tests skip without it). Each is checked against brute force over every rank's inputs (the experts are known
functions, so each token's output is a sum over its experts wherever they live), 2 ranks on CPU
(gloo, reference backend) and, marked gpu, 2 ranks sharing one GPU (native kernels).

The frameworks are not installed: the tests read the files of their wheels they use from
$MOE_EP_FRAMEWORKS (tests/_frameworks.py, shared with the other framework tests); tests/fetch_frameworks.py
fills it (.ci/run: torchtitan and Megatron-Core; vLLM and SGLang without --training-only). A test whose framework is not there
skips, naming it. Stubs and shims, each for something unrelated to communication, are named where
they are made.
"""
from __future__ import annotations

import os
import types

import torch
import torch.distributed as dist

import moe_ep.deep_ep
from tests._dist import device, requires_gpus, run_workers
from tests._frameworks import (SGLANG_STUBS, VLLM_STUBS, close, import_path, needs, reduced_experts, scale,
                               skip_unless_its_torch, weighted)

WORLD, HIDDEN, EXPERTS, TOPK, T = 2, 256, 8, 3, 32
NUM_LOCAL = EXPERTS // WORLD


# ---- inputs -------------------------------------------------------------------------------------
def _routing(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank inputs: x [n, H] bf16, distinct expert ids [n, K] int64, scores [n, K] float32 (~15% 0)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, HIDDEN, generator=g).to(torch.bfloat16)
    idx = torch.rand(n, EXPERTS, generator=g).topk(TOPK, dim=1).indices
    scores = torch.rand(n, TOPK, generator=g) + 0.1
    scores = torch.where(torch.rand(n, TOPK, generator=g) < 0.15, 0.0, scores)
    return x, idx, scores


def _grouped_experts(rows: torch.Tensor, counts: torch.Tensor, first_expert: int) -> torch.Tensor:
    """Expert-major rows [P, H], counts[e] rows of local expert e first, the rest untouched: each
    block times its expert's scale (what torchtitan's grouped GEMM would be)."""
    counts = counts.cpu().long()
    scales = torch.ones(rows.shape[0], dtype=rows.dtype)
    used = int(counts.sum())
    scales[:used] = torch.repeat_interleave(
        torch.tensor([scale(first_expert + e) for e in range(counts.shape[0])], dtype=rows.dtype), counts)
    return rows * scales.to(rows.device).unsqueeze(1)


# ---- torchtitan 0.3.0: DeepEPTokenDispatcher ---------------------------------------------------
def _torchtitan_worker(rank: int, world: int) -> None:
    # stub (when absent): tyro is torchtitan.config's command-line parser (imported by torchtitan.distributed)
    import_path(("tyro",))
    from torch.distributed.device_mesh import DeviceMesh
    from torchtitan.distributed.deepep import deepep
    from torchtitan.models.common.token_dispatcher import DeepEPTokenDispatcher

    dev = device()
    if dev.type == "cpu":  # shim: torchtitan registers its ops for CUDA only; its same functions serve CPU
        torch.library.impl(deepep._lib, "dispatch", "CPU")(deepep._dispatch_op_impl)
        torch.library.impl(deepep._lib, "combine", "CPU")(deepep._combine_op_impl)
    mesh = DeviceMesh.from_group(dist.group.WORLD, dev.type)
    for case, (n, cudagraphable) in enumerate([(T, False), (13, False), (T, True), (7, True)]):
        config = DeepEPTokenDispatcher.Config(num_experts=EXPERTS, top_k=TOPK, num_max_tokens_per_rank=T,
                                              hidden_dim=HIDDEN, cudagraphable=cudagraphable)
        dispatcher = DeepEPTokenDispatcher(config)
        dispatcher.wire_meshes(ep_mesh=mesh)
        x, idx, scores = _routing(100 * case + rank, n)
        g = torch.Generator().manual_seed(7 + rank)
        grad_out = torch.randn(n, HIDDEN, generator=g)
        xd = x.to(dev).requires_grad_(not cudagraphable)
        sd = scores.to(dev).requires_grad_(not cudagraphable)
        with torch.set_grad_enabled(not cudagraphable):
            routed, counts, meta = dispatcher.dispatch(xd, sd, idx.to(dev), torch.zeros(EXPERTS, device=dev))
            assert meta.state.cudagraphable == cudagraphable
            out = dispatcher.combine(_grouped_experts(routed, counts, rank * NUM_LOCAL), meta, xd)
        live = torch.where(scores == 0, -1, idx)
        close(out, weighted(x, live, scores), f"torchtitan out (n={n}, cudagraphable={cudagraphable})")
        if cudagraphable:
            continue
        (out.float() * grad_out.to(dev)).sum().backward()
        want_dx = weighted(grad_out.to(torch.bfloat16), live, scores)
        close(xd.grad, want_dx, "torchtitan grad x")
        per_slot = torch.stack([(x.float() * grad_out).sum(1) * torch.tensor([scale(int(e)) for e in idx[:, k]])
                                for k in range(TOPK)], 1)
        want_ds = torch.where(live >= 0, per_slot, 0.0)
        torch.testing.assert_close(sd.grad.cpu(), want_ds, rtol=3e-2, atol=0.5, msg=lambda m: f"grad scores: {m}")


@needs("torchtitan", "0.3.0")
def test_torchtitan_deepep_cpu() -> None:
    run_workers(WORLD, _torchtitan_worker)


@needs("torchtitan", "0.3.0")
@requires_gpus(1)
def test_torchtitan_deepep_gpu() -> None:
    run_workers(WORLD, _torchtitan_worker, backend="gpu")


# ---- vLLM 0.33.0: DeepEPV2PrepareAndFinalize -------------------------------------------------
def _vllm_worker(rank: int, world: int) -> None:
    import_path(VLLM_STUBS)
    from vllm.forward_context import DPMetadata, override_forward_context
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
    from vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_v2 import DeepEPV2PrepareAndFinalize
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP

    dev = device()
    if dev.type == "cpu":  # shim: vLLM pins its host-side count tensors, which needs CUDA; unpinned on CPU
        tensor = torch.tensor
        torch.tensor = lambda *args, pin_memory=False, **kwargs: tensor(*args, **kwargs)
    # the buffer as vLLM's DeepEPV2All2AllManager makes it (all2all.py, its default environment)
    buffer = moe_ep.deep_ep.ElasticBuffer(
        group=dist.group.WORLD, num_max_tokens_per_rank=T, hidden=HIDDEN, num_topk=TOPK, use_fp8_dispatch=False,
        allow_hybrid_mode=True, prefer_overlap_with_compute=False, allow_multiple_reduction=False,
        explicitly_destroy=True)
    offset = rank * NUM_LOCAL
    for case, (tokens, use_cudagraph) in enumerate([([13, 9], False), ([0, 17], False), ([13, 9], True),
                                                    ([1, 5], True), ([T, 0], True)]):
        pf = DeepEPV2PrepareAndFinalize(buffer, num_dispatchers=world, dp_size=world, rank_expert_offset=offset,
                                        num_experts=EXPERTS, num_topk=TOPK, use_cudagraph=use_cudagraph)
        # on CPU its Triton kernel cannot run: its own option hands globalising the ids to the experts
        pf.defer_globalize = dev.type == "cpu"
        x, idx, weights = _routing(200 * case + rank, tokens[rank])
        # the forward context vLLM's model runner sets: only dp_metadata is read
        context = types.SimpleNamespace(dp_metadata=DPMetadata(torch.tensor(tokens)))
        with override_forward_context(context):
            expert_x, _, meta, recv_ids, recv_w = pf.prepare(
                x.to(dev), weights.to(dev), idx.to(dev), EXPERTS, None, False, FUSED_MOE_UNQUANTIZED_CONFIG)
            if use_cudagraph:
                assert meta.expert_num_tokens is None and meta.psum_recv_per_rank is not None
                if pf.defer_globalize:  # what the experts do: local ids to global, rows past the received -1
                    rows = torch.arange(recv_ids.shape[0], device=dev).unsqueeze(1)
                    live = (recv_ids >= 0) & (rows < meta.psum_recv_per_rank[-1])
                    recv_ids = torch.where(live, recv_ids + meta.rank_expert_offset, -1)
            else:
                assert recv_ids.shape == recv_w.shape == (expert_x.shape[0], 1)
                every_idx = torch.cat([_routing(200 * case + s, tokens[s])[1] for s in range(world)])
                want_counts = [int((every_idx == offset + e).sum()) for e in range(NUM_LOCAL)]
                assert meta.expert_num_tokens.tolist() == want_counts
            fused = reduced_experts(expert_x, recv_ids, recv_w)
            output = torch.full((tokens[rank], HIDDEN), float("nan"), dtype=torch.bfloat16, device=dev)
            pf.finalize(output, fused, weights.to(dev), idx.to(dev), False, TopKWeightAndReduceNoOP())
        close(output, weighted(x, idx, weights), f"vLLM output (tokens={tokens}, use_cudagraph={use_cudagraph})")
    buffer.destroy()


@needs("vllm", "0.33.0")
def test_vllm_deepep_v2_cpu() -> None:
    run_workers(WORLD, _vllm_worker)


@needs("vllm", "0.33.0")
@requires_gpus(1)
def test_vllm_deepep_v2_gpu() -> None:
    skip_unless_its_torch("vllm", "0.33.0")
    run_workers(WORLD, _vllm_worker, backend="gpu")


# ---- SGLang 0.5.23: DeepEPv2Dispatcher -------------------------------------------------------
def _sglang_worker(rank: int, world: int) -> None:
    import_path(SGLANG_STUBS)
    os.environ["SGLANG_DEEPEP_V2_NUM_MAX_DISPATCH_TOKENS_PER_RANK"] = str(T)
    from sglang.srt.layers.moe.token_dispatcher import deepep_v2
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.layers.moe.utils import DeepEPv2Fp8ScaleFormat

    dev = device()
    # stand-ins for the server's runtime state the dispatcher reads (scheduler batch kind, resources,
    # --deepep-v2-mode, the attention-DP layout) and for DeepGEMM's scale-format probe (bf16 dispatch)
    state = types.SimpleNamespace(extend=False)
    resources = types.SimpleNamespace(buffers={})
    deepep_v2.get_is_extend_in_batch = lambda: state.extend
    deepep_v2.get_resources = lambda: resources
    deepep_v2.get_exec = lambda: types.SimpleNamespace(moe=types.SimpleNamespace(deepep_v2_mode="direct"))
    deepep_v2.get_parallel = lambda: types.SimpleNamespace(attn_dp_size=world, attn_cp_size=1, tp_size=1,
                                                           tp_group=None)
    deepep_v2.get_deepep_v2_fp8_scale_format = lambda: DeepEPv2Fp8ScaleFormat(tma_aligned=False, ue8m0=False)
    offset = rank * NUM_LOCAL
    cases = [([13, 9], False, None), ([1, 6], False, None), ([13, 9], True, "1"), ([0, 9], True, "1"),
             ([13, 9], True, "0"), ([5, 0], True, "0")]
    for case, (tokens, extend, prefill_expand) in enumerate(cases):
        state.extend = extend
        os.environ["SGLANG_DEEPEP_V2_ENABLE_PREFILL_EXPAND"] = prefill_expand or "1"
        dispatcher = deepep_v2.DeepEPv2Dispatcher(dist.group.WORLD, router_topk=TOPK, num_experts=EXPERTS,
                                                  num_local_experts=NUM_LOCAL, hidden_size=HIDDEN,
                                                  params_dtype=torch.bfloat16, use_fp8_dispatch=False)
        x, idx, weights = _routing(300 * case + rank, tokens[rank])
        out = dispatcher.dispatch(x.to(dev), StandardTopKOutput(weights.to(dev), idx.to(dev), None))
        assert out.is_expanded == (not extend or prefill_expand == "1") and out.use_masked_gemm == (not extend)
        if out.is_expanded:  # experts read their blocks from psum (DeepGEMM's contiguous/masked layout)
            psum = out.psum_num_recv_tokens_per_expert.cpu().tolist()
            scales = torch.zeros(out.hidden_states.shape[0])
            start = 0
            for e, end in enumerate(psum):
                scales[start:end] = scale(offset + e) * out.topk_weights[start:end].float().cpu()
                start = -(-end // out.expert_alignment) * out.expert_alignment
            y = (out.hidden_states.float() * scales.to(dev).unsqueeze(1)).to(torch.bfloat16)
            combine_input = deepep_v2.DeepEPv2CombineInput(y, None)
        else:  # experts weight and sum each received token's local experts (ep_gather), weights sent too
            ids = torch.where(out.topk_ids >= 0, out.topk_ids + offset, -1)
            combine_input = deepep_v2.DeepEPv2CombineInput(reduced_experts(out.hidden_states, ids, out.topk_weights),
                                                           out.topk_weights)
        combined = dispatcher.combine(combine_input)
        close(combined, weighted(x, idx, weights), f"SGLang output (tokens={tokens}, extend={extend}, "
                                                     f"prefill_expand={prefill_expand})")


@needs("sglang", "0.5.23")
def test_sglang_deepep_v2_cpu() -> None:
    run_workers(WORLD, _sglang_worker)


@needs("sglang", "0.5.23")
@requires_gpus(1)
def test_sglang_deepep_v2_gpu() -> None:
    skip_unless_its_torch("sglang", "0.5.23")
    run_workers(WORLD, _sglang_worker, backend="gpu")
