"""The DeepEP V1 low-latency paths of vLLM 0.33.0 and SGLang 0.5.23, their own code unchanged, on
moe_ep.deep_ep.Buffer (through moe_ep's installed `deep_ep` package: `pip install ./deep_ep_compat`), 2 ranks on
CPU (gloo, reference backend) and, marked gpu, 2 ranks sharing one GPU. Every received row is checked
against brute force over every rank's inputs (tests/oracle.py's row order, quantisers written from the
formats' definitions), and every token's combined output against the float64 sum over its experts (known
functions: tests/_frameworks.py) of the inputs as the dispatch's format carries them.

- vLLM: `DeepEPLLPrepareAndFinalize.prepare` / `finalize` / `finalize_async` (fused_moe/prepare_finalize/
  deepep_ll.py) on the Buffer that `DeepEPLLAll2AllManager.get_handle` makes (distributed/device_communicators/
  all2all.py, fault tolerance on: `enable_shrink=True`): bf16; FP8 with a block-FP8 quant config (the
  column-major per-128 scales handed to the experts as they are) and with an unquantised one (vLLM's
  dequant_fp8 reads them); FP8 with UE8M0 scales (`round_scale=use_ue8m0=True` once `post_init_setup` sees
  experts that take packed UE8M0 scales); NVFP4 (`use_nvfp4=True, x_global_scale=a1_gscale`,
  VLLM_DEEPEPLL_NVFP4_DISPATCH=1). The dispatch always takes the receive hook (vLLM's prepare runs it);
  the combine without it (finalize) and with it (finalize_async). The manager's mask calls:
  `query_active_mask` / `query_fault` (low_latency_query_mask_buffer) after the ranks mask each other
  (low_latency_update_mask_buffer: what DeepEP's timeout would do), a round without the masked rank, then
  `clean_buffers` (get_local_buffer_tensor(...).zero_(), low_latency_clean_mask_buffer) and a full round.
- SGLang: `DeepEPDispatcher(deepep_mode=LOW_LATENCY)` (layers/moe/token_dispatcher/deepep.py) dispatch and
  combine, with and without the receive hook (without it: async_finish and the event): bf16, FP8, FP8 with
  UE8M0 scales (DeepGEMM's Blackwell flags set), NVFP4 (quant config with input_global_scale); and the
  single-batch overlap: `compute_overlap_args` (batch_overlap/single_batch_overlap.py) with DeepGEMM as
  the runner on Hopper, `set_overlap_args`, so the combine passes `overlap=True, packed_recv_count,
  comp_signal, block_m, threshold, num_sms`.

What cannot run here: the experts. vLLM's and SGLang's grouped GEMMs (DeepGEMM, FlashInfer's CuteDSL, Triton)
need CUDA, so the tests' experts stand in for them; for SBO that includes the down GEMM that raises
comp_signal block by block while the combine waits. The reference backend cannot wait on the device: the
stand-in raises every signal word to the threshold before the combine is called, so on CPU the combine's
waiting is not exercised, only that SGLang's arguments arrive and are honoured (tests/test_low_latency_overlap.py
covers the waiting on the native backend). SGLang 0.5.23's `initialize_moe_config` refuses
`--enable-single-batch-overlap` on SM90 GPUs, so a server reaches this Hopper comp_signal path only with the
flags set as the test sets them. The GPU variants skip unless torch is the version the framework's wheel
pins (their CUDA platforms load extensions built for it).

Stubs and shims, none about communication, are named where they are made. The frameworks are read from
$MOE_EP_FRAMEWORKS as tests/_frameworks.py says; a test whose framework is not there skips, naming it.
"""
from __future__ import annotations

import contextlib
import os
import types
from typing import Iterator, Optional

import pytest
import torch
import torch.distributed as dist

import moe_ep.deep_ep
from moe_ep.comm.nvfp4 import NvFp4Layout
from tests._dist import device, requires_gpus, run_workers
from tests._frameworks import (SGLANG_STUBS, VLLM_STUBS, close, import_path, needs, scale, skip_unless_its_torch,
                               weighted)
from tests.oracle import Inputs, expected_low_latency_dispatch, fp8_dequantize, fp8_quantize, make_inputs
from tests.test_nvfp4 import check_received, dequantize_float64, expected_nvfp4

# HIDDEN: the smallest hidden size vLLM's DeepEPLLPrepareAndFinalize accepts (its SUPPORTED_HIDDEN_SIZES)
WORLD, HIDDEN, EXPERTS, TOPK, T = 2, 2048, 8, 3, 64
NUM_LOCAL = EXPERTS // WORLD


# ---- formats: what the experts read, what the brute force sums ----------------------------------
def _global_scale(inp: Inputs, recipe: Optional[str], seed: int) -> float:
    """The NVFP4 global scale every rank uses (a model's static one, float32): DeepEP's test recipe, 448 * 6 /
    amax over every rank's rows ("amax"), or drawn in [0.5, 200] ("drawn"); 0.0 for other formats (unread)."""
    if recipe == "amax":
        value = 448 * 6 / max(float(x.float().abs().max()) for x in inp.x if x.numel())
    elif recipe == "drawn":
        value = 0.5 + 199.5 * float(torch.rand((), generator=torch.Generator().manual_seed(seed)))
    else:
        return 0.0
    return float(torch.tensor(value, dtype=torch.float32))


def _as_carried(inp: Inputs, fmt: str, g: list[float]) -> list[torch.Tensor]:
    """Each rank's rows as the dispatch's format carries them, float64 (the brute force's input): bf16 as
    is, FP8 and NVFP4 through the oracle's quantisers from the formats' definitions, dequantised."""
    if fmt == "bf16":
        return [x.double() for x in inp.x]
    if fmt in ("fp8", "ue8m0"):
        return [fp8_dequantize(*fp8_quantize(x, fmt == "ue8m0")) if x.numel() else x.double() for x in inp.x]
    return [dequantize_float64(*expected_nvfp4(x, g[s]), g[s]) for s, x in enumerate(inp.x)]


def _ue8m0_scales(packed: torch.Tensor) -> torch.Tensor:
    """DeepEP's packed UE8M0 scales [E_l, R*T, H/512] int32 -> float64 [E_l, R*T, H/128]: byte j of word i
    is the biased exponent of block 4i + j's power-of-two scale."""
    exponent = packed.contiguous().view(torch.uint8).double()
    return torch.pow(2.0, exponent - 127)


def _received_rows(fmt: str, x: torch.Tensor, x_scale: Optional[torch.Tensor], g: float) -> torch.Tensor:
    """What the experts read: the received rows [E_l, R*T, H] as float64, dequantised from the received
    bytes and scales (x in the storage order [E_l, R*T, ...]; NVFP4 scales in DeepEP's view, g this rank's)."""
    x = x.cpu()
    if fmt == "bf16":
        return x.double()
    if fmt == "fp8":
        return fp8_dequantize(x, x_scale.cpu())
    if fmt == "ue8m0":
        return x.double() * _ue8m0_scales(x_scale.cpu()).repeat_interleave(128, dim=-1)
    layout = NvFp4Layout(x.shape[0], x.shape[1], HIDDEN)
    scales = layout.unswizzle(NvFp4Layout.scales_storage(x_scale.cpu())).view(torch.uint8)
    return torch.stack([dequantize_float64(x[e], scales[e], g) for e in range(x.shape[0])])


def _check_received(fmt: str, inp: Inputs, me: int, g: list[float], x: torch.Tensor,
                    x_scale: Optional[torch.Tensor], count: torch.Tensor, what: str) -> None:
    """Counts, rows and scales below the count (oracle order: source rank, then token) against brute force;
    NVFP4 through test_nvfp4.check_received (DeepEP's views, padding zero). x in the storage order."""
    if fmt == "nvfp4":
        check_received(inp, me, EXPERTS, T, HIDDEN, g, NvFp4Layout.values_view(x), x_scale, count, 0)
        return
    want = expected_low_latency_dispatch(inp, me, WORLD, EXPERTS, fmt != "bf16", fmt == "ue8m0")
    assert count.cpu().tolist() == [len(rows) for rows in want.rows], f"{what}: counts"
    scales = None
    if fmt == "fp8":
        assert x_scale.dtype == torch.float32 and x_scale.stride()[1:] == (1, WORLD * T), f"{what}: scale layout"
        scales = x_scale.cpu()
    elif fmt == "ue8m0":
        assert x_scale.dtype == torch.int32 and x_scale.shape[-1] == HIDDEN // 512, f"{what}: packed scales"
        assert x_scale.stride()[1:] == (1, WORLD * T), f"{what}: scale layout"
        scales = _ue8m0_scales(x_scale.cpu()).float()
    for e, rows in enumerate(want.rows):
        if rows:
            got = x[e, :len(rows)].cpu()
            assert torch.equal(got.view(torch.uint8), torch.stack(rows).view(torch.uint8)), f"{what}: expert {e} rows"
            if scales is not None:
                assert torch.equal(scales[e, :len(rows)], torch.stack(want.scales[e])), f"{what}: expert {e} scales"


def _experts(rows: torch.Tensor, count: torch.Tensor, me: int) -> torch.Tensor:
    """Local expert e's output [E_l, R*T, H] bf16: scale(e) times its received rows below the count, NaN past
    it (a combine that read them would show)."""
    out = torch.full(rows.shape, float("nan"), dtype=torch.bfloat16)
    for e, c in enumerate(count.cpu().tolist()):
        out[e, :c] = (rows[e, :c] * scale(me * NUM_LOCAL + e)).to(torch.bfloat16)
    return out


def _without(inp: Inputs, me: int) -> Inputs:
    """inp as rank me sees it when it has masked every other rank: its own tokens, its own experts only."""
    idx = inp.topk_idx[me]
    mine = torch.where((idx // NUM_LOCAL == me) & (idx >= 0), idx, -1)
    return Inputs([x if s == me else x[:0] for s, x in enumerate(inp.x)],
                  [mine if s == me else i[:0] for s, i in enumerate(inp.topk_idx)],
                  [w if s == me else w[:0] for s, w in enumerate(inp.topk_weights)])


# ---- vLLM 0.33.0: DeepEPLLPrepareAndFinalize on DeepEPLLAll2AllManager's Buffer ---------------------
def _vllm_manager(rank: int, world: int):
    """vLLM's DeepEPLLAll2AllManager with fault tolerance on, and the Buffer its get_handle makes."""
    from vllm.config import ParallelConfig
    from vllm.distributed import parallel_state
    from vllm.distributed.device_communicators import all2all

    # stand-ins for vLLM's runtime state: its DP / TP group coordinators (rank and size are read) and its
    # VllmConfig (parallel_config.enable_fault_tolerance is read; a VllmConfig needs a platform to build)
    parallel_state.get_dp_group = lambda: types.SimpleNamespace(rank_in_group=rank, world_size=world)
    parallel_state.get_tp_group = lambda: types.SimpleNamespace(rank_in_group=0, world_size=1)
    all2all.get_current_vllm_config = lambda: types.SimpleNamespace(
        parallel_config=ParallelConfig(enable_fault_tolerance=True))
    manager = all2all.DeepEPLLAll2AllManager(dist.group.WORLD)
    buffer = manager.get_handle(dict(max_num_tokens_per_dp_rank=T, token_hidden_size=HIDDEN, num_ep_ranks=world,
                                     num_global_experts=EXPERTS, num_local_experts=NUM_LOCAL))
    assert isinstance(buffer, moe_ep.deep_ep.Buffer) and buffer.enable_shrink and buffer.low_latency_mode
    if device().type == "cpu":
        # shims (CPU only): query_active_mask allocates its mask with device="cuda" when its class cache is
        # empty (made here on the CPU instead); clean_buffers synchronizes the accelerator, which the CPU lacks
        all2all.DeepEPLLAll2AllManager._mask = torch.zeros(world, dtype=torch.int32)
        torch.accelerator.synchronize = lambda *args: None
    return manager, buffer


def _vllm_round(pf, fmt: str, inp: Inputs, rank: int, g: list[float], quant_config, use_async: bool, what: str,
                want: Optional[Inputs] = None) -> None:
    """One prepare / experts / finalize of rank `rank`'s tokens; `want`: the inputs as this rank sees them
    (default inp; with ranks masked, without them)."""
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceDelegate

    dev = device()
    want = want or inp
    x, idx, w = inp.x[rank].to(dev), inp.topk_idx[rank].to(dev), inp.topk_weights[rank].to(dev)
    expert_x, expert_x_scale, meta, _, _ = pf.prepare(x, w, idx, EXPERTS, None, False, quant_config)
    count = meta.expert_num_tokens
    carried = _as_carried(want, fmt, g)[rank]
    if fmt == "fp8" and quant_config.block_shape is None:  # vLLM's dequant_fp8 made bf16 rows of the FP8 ones
        assert expert_x.dtype == torch.bfloat16 and expert_x_scale is None
        expected = expected_low_latency_dispatch(want, rank, WORLD, EXPERTS, True, False)
        assert count.cpu().tolist() == [len(rows) for rows in expected.rows], f"{what}: counts"
        for e, rows in enumerate(expected.rows):
            if rows:
                deq = fp8_dequantize(torch.stack(rows), torch.stack(expected.scales[e])).to(torch.bfloat16)
                assert torch.equal(expert_x[e, :len(rows)].cpu(), deq), f"{what}: expert {e} dequantised rows"
        rows = expert_x.double().cpu()
        carried = carried.to(torch.bfloat16).double()
    else:
        _check_received(fmt, want, rank, g, expert_x, expert_x_scale, count, what)
        rows = _received_rows(fmt, expert_x, expert_x_scale, g[rank] if g else 0.0)
    fused = _experts(rows, count, rank).to(dev)
    output = torch.full((x.shape[0], HIDDEN), float("nan"), dtype=torch.bfloat16, device=dev)
    if use_async:
        recv_hook, receiver = pf.finalize_async(output, fused, w, idx, False, TopKWeightAndReduceDelegate())
        assert recv_hook is not None
        recv_hook()
        receiver()
    else:
        pf.finalize(output, fused, w, idx, False, TopKWeightAndReduceDelegate())
    close(output, weighted(carried, want.topk_idx[rank], want.topk_weights[rank]), f"{what}: output")


def _vllm_worker(rank: int, world: int) -> None:
    import_path(VLLM_STUBS)
    os.environ["VLLM_DEEPEPLL_NVFP4_DISPATCH"] = "1"  # vLLM's switch for NVFP4 in the dispatch
    from vllm.model_executor.layers.fused_moe.config import (FUSED_MOE_UNQUANTIZED_CONFIG, fp8_w8a8_moe_quant_config,
                                                             nvfp4_moe_quant_config)
    from vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ll import DeepEPLLPrepareAndFinalize

    dev = device()
    manager, buffer = _vllm_manager(rank, world)
    # the experts' weight scales in the quant configs are never read here (the experts are the test's)
    one = torch.ones(NUM_LOCAL, device=dev)
    block_fp8 = fp8_w8a8_moe_quant_config(w1_scale=one, w2_scale=one, block_shape=[128, 128])
    # experts that take packed UE8M0 activation scales (DeepGEMM's on Blackwell): post_init_setup asks them
    ue8m0_experts = types.SimpleNamespace(supports_packed_ue8m0_act_scales=lambda: True)
    # (format, quant config: unquantised, block FP8, or NVFP4 with its global scale's recipe, finalize_async,
    # tokens per rank)
    cases = [("bf16", "none", False, [13, 9]), ("bf16", "none", True, [0, 64]), ("fp8", "none", False, [41, 7]),
             ("fp8", "block", True, [64, 5]), ("ue8m0", "block", False, [9, 50]), ("nvfp4", "amax", True, [12, 33]),
             ("nvfp4", "drawn", False, [3, 64])]
    for case, (fmt, quant, use_async, tokens) in enumerate(cases):
        inp = make_inputs(700 + case, tokens, HIDDEN, EXPERTS, TOPK)
        g = [_global_scale(inp, quant, 700 + case)] * world
        quant_config = {"none": FUSED_MOE_UNQUANTIZED_CONFIG, "block": block_fp8}.get(quant)
        if fmt == "nvfp4":  # vLLM's a1_gscale: the checkpoint's one static value, repeated per local expert
            gscale = torch.full((NUM_LOCAL,), g[rank], dtype=torch.float32, device=dev)
            quant_config = nvfp4_moe_quant_config(g1_alphas=one, g2_alphas=one, a1_gscale=gscale, a2_gscale=gscale,
                                                  w1_scale=one, w2_scale=one)
        pf = DeepEPLLPrepareAndFinalize(buffer, max_tokens_per_rank=T, num_dispatchers=world,
                                        use_fp8_dispatch=fmt in ("fp8", "ue8m0"))
        if fmt == "ue8m0":
            pf.post_init_setup(ue8m0_experts)
            assert pf.use_ue8m0_dispatch
        _vllm_round(pf, fmt, inp, rank, g, quant_config, use_async,
                    f"vLLM {fmt} tokens={tokens} async={use_async}")

    # fault tolerance: the ranks mask each other (DeepEP's timeout would), each goes on alone
    pf = DeepEPLLPrepareAndFinalize(buffer, max_tokens_per_rank=T, num_dispatchers=world)
    assert not bool(manager.query_fault()) and manager.query_active_mask().tolist() == [0] * world
    buffer.low_latency_update_mask_buffer(1 - rank, True)
    assert bool(manager.query_fault())
    assert manager.query_active_mask().tolist() == [int(r != rank) for r in range(world)]
    inp = make_inputs(790, [30, 64], HIDDEN, EXPERTS, TOPK)
    _vllm_round(pf, "bf16", inp, rank, [], FUSED_MOE_UNQUANTIZED_CONFIG, False, "vLLM with the peer masked",
                want=_without(inp, rank))
    dist.barrier()
    raw = buffer.get_local_buffer_tensor(dtype=torch.int8, use_rdma_buffer=True)
    raw.random_(1, 100)  # stale bytes for clean_buffers to zero
    manager.clean_buffers()
    assert not bool(manager.query_fault()) and manager.query_active_mask().tolist() == [0] * world
    assert raw.numel() == buffer.num_rdma_bytes > 0 and not raw.any()
    _vllm_round(pf, "bf16", inp, rank, [], FUSED_MOE_UNQUANTIZED_CONFIG, True, "vLLM after clean_buffers")
    manager.destroy()


@needs("vllm", "0.33.0")
def test_vllm_deepep_low_latency_cpu() -> None:
    run_workers(WORLD, _vllm_worker)


@needs("vllm", "0.33.0")
@requires_gpus(1)
def test_vllm_deepep_low_latency_gpu() -> None:
    skip_unless_its_torch("vllm", "0.33.0")
    run_workers(WORLD, _vllm_worker, backend="gpu")


# ---- SGLang 0.5.23: DeepEPDispatcher in low-latency mode, and its single-batch overlap ----------------
class _CpuStream:
    """Stand-in (CPU only) for the CUDA stream SGLang's model gives compute_overlap_args (its alt_stream):
    the CPU runs everything in order, so waiting on events and streams has nothing to do."""

    def wait_event(self, event: object) -> None:
        pass

    def wait_stream(self, stream: object) -> None:
        pass


class _CpuEvent:
    """Stand-in (CPU only) for torch.cuda.Event, which compute_overlap_args creates (the down GEMM records it)."""

    def record(self, stream: object = None) -> None:
        pass


@contextlib.contextmanager
def _sbo_flags(flags) -> Iterator[None]:
    """The server flags --enable-single-batch-overlap and --moe-runner-backend deep_gemm (SGLang's runtime
    flags, which its initialize_moe_config would set from them; it refuses SBO on SM90 GPUs, see above)."""
    from sglang.srt.layers.moe.utils import MoeRunnerBackend

    saved = flags.sbo_enabled, flags.runner_backend
    flags.sbo_enabled, flags.runner_backend = True, MoeRunnerBackend.DEEP_GEMM
    try:
        yield
    finally:
        flags.sbo_enabled, flags.runner_backend = saved


def _down_gemm(out, combine_args, down_args, meta: dict, block_m: int, short: bool) -> None:
    """Stand-in for SGLang's DeepGEMM masked down GEMM with overlap (moe_runner/deep_gemm.py): records the
    start event, then raises every comp_signal word covering received rows (block j of local expert e:
    word e * ceil(R*T / block_m) + j) to the threshold it returns with block_m into meta_overlap_args;
    words past the rows stay 0. `short`: the word of the highest block holding rows (a second block of an
    expert, where the data has one) stays one below."""
    down_args.start_event.record()
    assert combine_args.overlap and combine_args.signal is down_args.signal
    signal = down_args.signal
    blocks = -(-WORLD * T // block_m)
    threshold = -(-HIDDEN // 256)  # the GEMM's N blocks of 256 columns, each signalling once
    words = [e * blocks + j for e, c in enumerate(out.masked_m.cpu().tolist()) for j in range(-(-c // block_m))]
    signal.zero_()
    signal[torch.tensor(words, dtype=torch.long, device=signal.device)] = threshold
    if short:
        signal[max(words, key=lambda word: word % blocks)] = threshold - 1
    meta["block_m"], meta["threshold"] = block_m, threshold


def _sglang_worker(rank: int, world: int) -> None:
    import_path(SGLANG_STUBS)
    os.environ["SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK"] = str(T)
    from sglang.srt.batch_overlap import single_batch_overlap
    from sglang.srt.layers import deep_gemm_wrapper
    from sglang.srt.layers.moe.token_dispatcher import deepep
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.layers.moe import utils as moe_utils
    from sglang.srt.layers.moe.utils import DeepEPMode
    from sglang.srt.runtime_context import get_flags

    dev = device()
    if dev.type == "cpu":
        # shims (CPU only): SGLang reads the GPU's SM count when it sizes the Buffer and splits SMs for the
        # overlap (an H200's 132 here), and makes a CUDA event for the overlap
        torch.cuda.get_device_properties = lambda *args, **kwargs: types.SimpleNamespace(multi_processor_count=132)
        torch.cuda.Event = _CpuEvent
    alt_stream = _CpuStream() if dev.type == "cpu" else torch.cuda.Stream()
    # stand-ins for the server's runtime state: the scheduler's batch kind (a decode batch: low-latency mode),
    # and no published server args (no --deepep-dispatcher-output-dtype: the dispatcher's quant config decides)
    deepep.get_is_extend_in_batch = lambda: False
    moe_utils.get_server_args = lambda: None
    dispatchers = {hook: deepep.DeepEPDispatcher(dist.group.WORLD, router_topk=TOPK, num_experts=EXPERTS,
                                                 num_local_experts=NUM_LOCAL, hidden_size=HIDDEN,
                                                 params_dtype=torch.bfloat16, deepep_mode=DeepEPMode.LOW_LATENCY,
                                                 return_recv_hook=hook) for hook in (False, True)}
    # (format, receive hook, tokens, routing, single-batch overlap: (block_m, short signal) or None)
    cases = [("bf16", False, [40, 64], "random", None), ("bf16", True, [0, 23], "random", None),
             ("fp8", False, [64, 31], "random", None), ("fp8", True, [17, 5], "skewed", None),
             ("ue8m0", True, [33, 48], "random", None), ("ue8m0", False, [8, 0], "random", None),
             ("nvfp4", False, [29, 64], "random", None), ("nvfp4", True, [12, 3], "skewed", None),
             ("bf16", False, [64, 60], "skewed", (64, False)), ("fp8", True, [50, 64], "skewed", (128, False)),
             ("ue8m0", False, [64, 64], "skewed", (64, False)), ("bf16", True, [64, 57], "skewed", (64, True))]
    for case, (fmt, hook, tokens, routing, sbo) in enumerate(cases):
        what = f"SGLang {fmt} hook={hook} tokens={tokens} sbo={sbo}"
        inp = make_inputs(900 + case, tokens, HIDDEN, EXPERTS, TOPK, routing)
        g = [_global_scale(inp, "drawn" if fmt == "nvfp4" else None, 900 + case)] * world
        dispatcher = dispatchers[hook]
        # the quant config SGLang's MoE layer hands the dispatcher: bf16 by name, FP8 by default, NVFP4 by
        # its input_global_scale (ModelOpt's w13_input_scale_quant: 1 / the static input scale, per local expert)
        gscale = torch.full((NUM_LOCAL,), g[rank], dtype=torch.float32, device=dev)
        quant = {"bf16": {"dispatcher_output_dtype": "bf16"}, "fp8": {}, "ue8m0": {},
                 "nvfp4": {"input_global_scale": gscale}}[fmt]
        dispatcher.set_quant_config(quant)
        # stand-ins for DeepGEMM's probe (JIT DeepGEMM on Blackwell: UE8M0 scales) for the ue8m0 cases
        deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM = deep_gemm_wrapper.DEEPGEMM_BLACKWELL = fmt == "ue8m0"
        x, idx, w = inp.x[rank].to(dev), inp.topk_idx[rank].to(dev), inp.topk_weights[rank].to(dev)
        out = dispatcher.dispatch(x, StandardTopKOutput(w, idx, None))
        values = out.hidden_states.permute(2, 0, 1) if fmt == "nvfp4" else out.hidden_states
        _check_received(fmt, inp, rank, g, values, out.hidden_states_scale, out.masked_m, what)
        fused = _experts(_received_rows(fmt, values, out.hidden_states_scale, g[rank]), out.masked_m, rank).to(dev)
        combine = deepep.DeepEPLLCombineInput(fused, out.topk_ids, out.topk_weights)
        if sbo is None:
            combined = dispatcher.combine(combine)
            close(combined, weighted(_as_carried(inp, fmt, g)[rank], inp.topk_idx[rank], inp.topk_weights[rank]),
                  what)
            continue
        block_m, short = sbo
        with _sbo_flags(get_flags().moe):
            combine_args, down_args, meta = single_batch_overlap.compute_overlap_args(out, alt_stream)
        assert combine_args is not None and down_args is not None, f"{what}: SGLang chose no down-GEMM overlap"
        dispatcher.set_overlap_args(combine_args, meta)
        _down_gemm(out, combine_args, down_args, meta, block_m, short and rank == 0)
        if short:  # the combine must not read a block before its word is signalled: this rank raises, its peer too
            told = (rf"comp_signal\[\d+\] = {meta['threshold'] - 1} is below threshold {meta['threshold']}"
                    if rank == 0 else r"rank 0 rejected its input \(ValueError: comp_signal")
            with pytest.raises(ValueError, match=told) as raised:
                dispatcher.combine(combine)
            assert isinstance(raised.value, moe_ep.PeerInputError) == (rank == 1), f"{what}: {raised.value!r}"
            break
        combined = dispatcher.combine(combine)
        dispatcher.clear_overlap_args()
        close(combined, weighted(_as_carried(inp, fmt, g)[rank], inp.topk_idx[rank], inp.topk_weights[rank]), what)
    else:
        raise AssertionError("the short-signal case must end the cases")


@needs("sglang", "0.5.23")
def test_sglang_deepep_low_latency_cpu() -> None:
    run_workers(WORLD, _sglang_worker)


@needs("sglang", "0.5.23")
@requires_gpus(1)
def test_sglang_deepep_low_latency_gpu() -> None:
    skip_unless_its_torch("sglang", "0.5.23")
    run_workers(WORLD, _sglang_worker, backend="gpu")
