"""Low-latency (decode) dispatch/combine on the native kernels (csrc/kernels/low_latency/).

Fixed-capacity expert-major receive buffers, no host synchronisation (both calls capture into a CUDA
graph), in-kernel FP8 and NVFP4 casts, and an optional receive hook that splits each call into a send
half and a receive half. The NvshmemBackend creates one LowLatencyEngine per low_latency Buffer and
forwards the low-latency calls to it (the engine interface: backends/engine.py).

Lifetimes: dispatch results are views of two alternating output sets, so a result (x, x_scales,
count and its handle) stays valid until the second low_latency_dispatch after it: at most two
dispatch results may be held at once. A CUDA graph replays into the set it captured. Combine
results are fresh tensors. With return_recv_hook=True the hook must run before the next call of
the same kind (the buffer-reuse protocol in the kernels relies on it); the engine enforces that.
Issue all calls of one Buffer on one stream; a hook launches on the stream of its call.

Across nodes (cfg.ranks_per_node < R): ranks of this rank's node are reached by NVLink stores, all
others only by NVSHMEM puts and signals (csrc/kernels/low_latency/dispatch.cu, protocol comment);
the decision follows ranks_per_node, so ranks_per_node=1 on one machine runs the network code.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from .. import _native, fp8, nvfp4
from ..config import ALLOCATION_SLACK_BYTES, LL_MAX_BLOCKS_PER_EXPERT, LL_PER_EXPERT_GRID
from ..types import LowLatencyCombineResult, LowLatencyDispatchResult, LowLatencyHandle, LowLatencyOverlap
from .base import BufferConfig
from .engine import Engine

if TYPE_CHECKING:
    from ..errors import ErrorWatch
    from .symmetric import NvshmemSession, SymmetricTensor

def blocks_per_expert(cfg: BufferConfig) -> int:
    """P of the per-expert kernels (the combine send grid is P * E_l blocks; its sizing: moe_ep.comm.config)."""
    return max(1, min(LL_MAX_BLOCKS_PER_EXPERT, LL_PER_EXPERT_GRID // cfg.num_local_experts))


@dataclass(frozen=True)
class SymmetricLayout:
    """Byte offsets of the areas in the one symmetric allocation (staging areas hold both buffer sets);
    csrc/kernels/low_latency/low_latency.h region_layout owns them."""

    dispatch_payload: int  # [2][R][T][2H] bytes: bf16 row, e4m3 row + H/128 float32 scales, or NVFP4 row + scales
    dispatch_meta: int  # [2][R][T][LL_META_BYTES]: int16 global expert ids, epoch tag
    combine_payload: int  # [2][T][K][H] bf16
    combine_scratch: int  # [P * E_l][LL_SCRATCH_ROWS][H] bf16, only when the group spans several nodes
    signals: int  # [LL_NUM_SIGNALS][R] uint64
    total: int

    @classmethod
    def of(cls, cfg: BufferConfig) -> "SymmetricLayout":
        """The layout of a Buffer's region, from moe_ep.comm._C."""
        scratch_blocks = blocks_per_expert(cfg) * cfg.num_local_experts if cfg.num_nodes > 1 else 0
        return cls(**_native.load().ll_region_layout(cfg.world_size, cfg.max_tokens_per_rank, cfg.hidden,
                                                     cfg.num_topk, scratch_blocks))


@dataclass(frozen=True)
class LowLatencyState:
    """Backend-private part of a LowLatencyHandle: per row, the first k of its token naming the expert
    (where combine stages that row at the token's rank)."""

    src_k: torch.Tensor  # [E_l, R * T] int32


@dataclass(frozen=True)
class _OutputSet:
    """One of the two alternating sets of dispatch outputs (ordinary device memory)."""

    x_bf16: torch.Tensor  # [E_l, R*T, H]
    x_fp8: torch.Tensor  # [E_l, R*T, H] e4m3, aliasing the first half of x_bf16's storage
    scales: Optional[torch.Tensor]  # [E_l, R*T, H/128] float32 token-major per expert; None when hidden % 128 != 0
    ue8m0: Optional[torch.Tensor]  # [E_l, R*T, H/512] int32 the same way, aliasing scales' storage; None unless % 512
    nvfp4_values: Optional[torch.Tensor]  # [E_l, R*T, H/2] uint8, aliasing x_bf16's storage; None unless H % 16 == 0
    nvfp4_scales: Optional[torch.Tensor]  # (E_l, rm, rk, 32, 4, 4) e4m3 scale tiles (nvfp4.NvFp4Layout), own storage
    src_rank: torch.Tensor  # [E_l, R*T] int32
    src_index: torch.Tensor
    src_k: torch.Tensor
    count: torch.Tensor  # [E_l] int32
    recv_ptrs: tuple[int, int, int, int, int, int]  # the dispatch receive half's outputs: x, scales, src_*, count
    nvfp4_scales_ptr: int  # the receive half's scales with use_nvfp4 (0 where there are none)

    @classmethod
    def allocate(cls, cfg: BufferConfig) -> "_OutputSet":
        e_l, slots, h, dev = cfg.num_local_experts, cfg.world_size * cfg.max_tokens_per_rank, cfg.hidden, cfg.device
        x_bf16 = torch.empty(e_l, slots, h, dtype=torch.bfloat16, device=dev)
        x_fp8 = x_bf16.view(-1).view(torch.uint8)[: e_l * slots * h].view(torch.float8_e4m3fn).view(e_l, slots, h)
        scales = fp8.expert_major_scales(e_l, slots, h // 128, torch.float32, dev) if h % 128 == 0 else None
        ue8m0 = None
        if h % 512 == 0:  # the first E_l * H/512 * R*T words of scales' storage, in the same layout
            words = scales.transpose(1, 2).reshape(-1)[: e_l * (h // 512) * slots].view(torch.int32)
            ue8m0 = words.view(e_l, h // 512, slots).transpose(1, 2)
        nvfp4_values = nvfp4_scales = None
        if h % nvfp4.constants().block == 0:  # the scale tiles need more bytes than FP8's scales: their own
            layout = nvfp4.NvFp4Layout(e_l, slots, h)
            nvfp4_values = x_bf16.view(-1).view(torch.uint8)[: e_l * slots * h // 2].view(e_l, slots, h // 2)
            nvfp4_scales = layout.empty_scales(dev)

        def rows() -> torch.Tensor:
            return torch.empty(e_l, slots, dtype=torch.int32, device=dev)

        src_rank, src_index, src_k, count = rows(), rows(), rows(), torch.zeros(e_l, dtype=torch.int32, device=dev)
        ptrs = (x_bf16.data_ptr(), 0 if scales is None else scales.data_ptr(), src_rank.data_ptr(),
                src_index.data_ptr(), src_k.data_ptr(), count.data_ptr())
        return cls(x_bf16, x_fp8, scales, ue8m0, nvfp4_values, nvfp4_scales, src_rank, src_index, src_k, count, ptrs,
                   0 if nvfp4_scales is None else nvfp4_scales.data_ptr())


@dataclass
class _Hook:
    """The receive half of one call: runs once, on the stream of its call."""

    engine: "LowLatencyEngine"
    kind: str  # "dispatch" or "combine"
    launch: Callable[[int], None]
    stream: int
    ran: bool = False

    def __call__(self) -> None:
        self.engine._receive(self)


class LowLatencyEngine(Engine):
    """Runs the low-latency kernels of one Buffer; owns its symmetric region (staging and signal
    words, R per slot for any R: not the Buffer's comm.h signal array) and output sets."""

    def __init__(self, cfg: BufferConfig, session: NvshmemSession, epochs: torch.Tensor, error: ErrorWatch,
                 runtime: Any) -> None:
        self.cfg = cfg
        self._session = session
        self._epochs, self._error = epochs, error  # kept alive: the kernels use them
        self._native: Any = _native.load()
        layout = SymmetricLayout.of(cfg)
        self._sym: Optional[SymmetricTensor] = session.alloc((layout.total,), torch.uint8)
        self._sets = [_OutputSet.allocate(cfg), _OutputSet.allocate(cfg)]
        self._done_counters = torch.zeros(2, dtype=torch.int32, device=cfg.device)
        t_k = cfg.max_tokens_per_rank * cfg.num_topk
        self._stash = torch.zeros(t_k * (8 + 4), dtype=torch.uint8, device=cfg.device)  # int64 ids, float32 weights
        # fault-tolerant mode: 1 per rank the kernels stopped waiting for (comm.h Comm::masked)
        self._masked = torch.zeros(cfg.world_size, dtype=torch.int32, device=cfg.device) if cfg.fault_tolerant else None
        node_first = cfg.node * cfg.ranks_per_node  # node ranks: NVLink addresses; the others: PE + symmetric address
        self._ctx = self._native.LowLatencyContext(
            runtime=runtime, ranks_per_node=cfg.ranks_per_node,
            num_local_experts=cfg.num_local_experts, num_topk=cfg.num_topk, hidden=cfg.hidden,
            max_tokens=cfg.max_tokens_per_rank, epochs=epochs.data_ptr(), masked=0 if self._masked is None else self._masked.data_ptr(), sym=self._sym.ptr,
            node_sym=self._sym.peer_ptrs[node_first:node_first + cfg.ranks_per_node],
            dispatch_payload_offset=layout.dispatch_payload, dispatch_meta_offset=layout.dispatch_meta,
            combine_payload_offset=layout.combine_payload, combine_scratch_offset=layout.combine_scratch,
            signals_offset=layout.signals, done_counters=self._done_counters.data_ptr(),
            combine_stash=self._stash.data_ptr(), blocks_per_expert=blocks_per_expert(cfg),
            num_sms=cfg.config.low_latency_num_sms or torch.cuda.get_device_properties(cfg.device).multi_processor_count,
        )
        torch.cuda.synchronize(cfg.device)  # the zeros above land before any kernel, on any stream
        self._device_index = torch.device(cfg.device).index
        if self._device_index is None:
            self._device_index = torch.cuda.current_device()
        self._dispatches = 0
        # called with the stream handle after every launch of this engine's kernels (NvshmemBackend: the
        # stamp exchange orders the next call's exchange after them, StampExchange.launched)
        self.launched: Optional[Callable[[int], None]] = None
        self._pending: dict[str, Optional[_Hook]] = {"dispatch": None, "combine": None}

    @property
    def rank_mask(self) -> torch.Tensor:
        """int32 [R], 1 per masked rank (comm.h Comm::masked; fault-tolerant mode only): the kernels read it
        and set a rank that misses the timeout; the host may set or clear entries between calls."""
        if self._masked is None:
            raise RuntimeError("this low-latency engine is not fault-tolerant")
        return self._masked

    def masked_ranks(self) -> list[int]:
        """The ranks masked so far (fault-tolerant mode); reads the device mask after the current stream's work."""
        if self._masked is None:
            return []
        return torch.nonzero(self._masked).flatten().tolist()

    @staticmethod
    def heap_bytes(cfg: BufferConfig) -> int:
        """Symmetric heap bytes this engine allocates for `cfg` (call before acquiring the session)."""
        return SymmetricLayout.of(cfg).total + ALLOCATION_SLACK_BYTES  # one allocation

    def _begin(self, kind: str) -> int:
        """Checks for a recorded kernel timeout and an unfinished hook; returns the current stream.
        A recorded bad id is raised once the call's launch is made (ErrorWatch.check)."""
        self._error.check(timeouts_only=True)
        self.check_ready(kind)
        return torch._C._cuda_getCurrentRawStream(self._device_index)  # the current stream's handle, no Stream object

    def check_ready(self, kind: str) -> None:
        """RuntimeError unless a call of `kind` may start: the engine is open and the kind's last hook ran
        (checked before the call's stamp exchange launches, so a refused call sends nothing)."""
        if self._sym is None:
            raise RuntimeError("this low-latency engine is closed")
        if self._pending[kind] is not None:
            raise RuntimeError(f"call the hook of the previous low_latency_{kind} before the next low_latency_{kind}")

    def _launch(self, kind: str, launch: Callable[[int, bool, bool], None], stream: int,
                return_recv_hook: bool) -> Optional[_Hook]:
        """One launch of the kind's kernel for the whole call, or its send half now and its receive
        half as the hook; launch(stream, send, receive)."""
        if not return_recv_hook:
            launch(stream, True, True)
            self._mark_launched(stream)
            self._error.check()  # bad ids of this call (if its kernel got there) or of earlier ones
            return None
        launch(stream, True, False)
        self._mark_launched(stream)
        hook = _Hook(self, kind, lambda s: launch(s, False, True), stream)
        self._pending[kind] = hook
        return hook

    def _mark_launched(self, stream: int) -> None:
        if self.launched is not None:
            self.launched(stream)

    def drop_hook(self, kind: str) -> None:
        """The call that made the kind's pending hook raised (its stamp exchange said the peers made
        another call or never came): its receive half must never run, and the next call may start."""
        hook = self._pending[kind]
        if hook is not None:
            hook.ran = True
            self._pending[kind] = None

    def _receive(self, hook: _Hook) -> None:
        """Runs a hook's receive half once."""
        if hook.ran:
            raise RuntimeError(f"this low_latency_{hook.kind} hook already ran")
        self._error.check(timeouts_only=True)
        hook.launch(hook.stream)
        self._mark_launched(hook.stream)
        hook.ran = True
        self._pending[hook.kind] = None
        self._error.check()

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, *, use_fp8: bool, round_scale: bool,
                 use_ue8m0: bool, use_nvfp4: bool, x_global_scale: Optional[torch.Tensor],
                 return_recv_hook: bool) -> LowLatencyDispatchResult:
        """Send each token once per destination rank; expand into expert-major rows on receipt. use_nvfp4:
        the kernel casts each row with x_global_scale's first element, read on the device."""
        stream = self._begin("dispatch")
        out = self._sets[self._dispatches & 1]
        self._dispatches += 1
        n = x.shape[0]
        ctx, args_of = self._ctx, self._native.LowLatencyDispatchArgs
        recv_x, scales, src_rank, src_index, src_k, count = out.recv_ptrs
        fields = dict(x=x.data_ptr(), topk_idx=topk_idx.data_ptr(), num_tokens=n, recv_x=recv_x,
                      recv_scales=out.nvfp4_scales_ptr if use_nvfp4 else scales if use_fp8 else 0,
                      src_rank=src_rank, src_index=src_index, src_k=src_k, count=count, use_fp8=use_fp8,
                      round_scale=round_scale, ue8m0=use_ue8m0, use_nvfp4=use_nvfp4,
                      x_global_scale=0 if x_global_scale is None else x_global_scale.data_ptr())

        def launch(s: int, send: bool, receive: bool) -> None:
            ctx.dispatch(args_of(**fields, send=send, receive=receive), s)

        hook = self._launch("dispatch", launch, stream, return_recv_hook)
        handle = LowLatencyHandle(self.cfg.buffer_id, n, out.src_rank, out.src_index, out.count,
                                  LowLatencyState(out.src_k))
        if use_nvfp4:  # DeepEP's views of the storage
            x_out = nvfp4.NvFp4Layout.values_view(out.nvfp4_values)
            scales_out = nvfp4.NvFp4Layout.scales_view(out.nvfp4_scales)
        else:
            x_out = out.x_fp8 if use_fp8 else out.x_bf16
            scales_out = (out.ue8m0 if use_ue8m0 else out.scales) if use_fp8 else None
        return LowLatencyDispatchResult(x_out, scales_out, out.count, handle, hook)

    def combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: LowLatencyHandle,
                *, return_recv_hook: bool, overlap: Optional[LowLatencyOverlap]) -> LowLatencyCombineResult:
        """Send expert outputs back to their tokens' ranks; reduce them there in ascending k. With `overlap`
        both launches run on at most overlap.num_sms blocks and the send half reads each block of rows once
        its comp_signal word reached the threshold (combine.cu's file comment)."""
        stream = self._begin("combine")
        n = topk_idx.shape[0]
        out = torch.empty(n, self.cfg.hidden, dtype=torch.bfloat16, device=self.cfg.device)
        ctx, args_of = self._ctx, self._native.LowLatencyCombineArgs
        fields = dict(y=x.data_ptr(), src_rank=handle.src_rank.data_ptr(), src_index=handle.src_index.data_ptr(),
                      src_k=handle.state.src_k.data_ptr(), count=handle.count.data_ptr(),
                      topk_idx=topk_idx.data_ptr(), topk_weights=topk_weights.data_ptr(), num_tokens=n,
                      out=out.data_ptr())
        if overlap is not None:
            fields.update(num_sms=overlap.num_sms, comp_signal=overlap.comp_signal.data_ptr(),
                          block_m=overlap.block_m, threshold=overlap.threshold)

        def launch(s: int, send: bool, receive: bool) -> None:
            ctx.combine(args_of(**fields, send=send, receive=receive), s)

        return LowLatencyCombineResult(out, self._launch("combine", launch, stream, return_recv_hook))

    def close(self) -> None:
        """Frees the symmetric staging (collective); waits for this rank's kernels first."""
        if self._sym is None:
            return
        torch.cuda.current_stream(self.cfg.device).synchronize()
        self._session.free(self._sym)
        self._sym = None
