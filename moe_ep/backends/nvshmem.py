"""Native backend: normal-mode dispatch/combine on the NVLink kernels (csrc/kernels/intranode.h and
notify.cu, dispatch.cu, combine.cu) inside one node, or on the hierarchical cross-node kernels
(InternodeEngine, backends/internode.py) when the group spans several nodes; low-latency calls
forwarded to LowLatencyEngine.

A normal dispatch is one kernel that computes the layout and exchanges counts with every peer (the
start barrier), then at once the dispatch kernel, whose warps store rows into the peers' symmetric
workspace over NVLink while other warps copy the rows that already landed here (per-row flags) into
fresh output tensors; the host waits for the counts only to size the result, while the rows move. In worst-case mode the
output has R * T rows, so the host never waits and the calls capture into a CUDA graph. Every call
runs on the current stream; all calls of one Buffer must be ordered on the device (one stream, or
events between streams), because each call reuses the Buffer's symmetric memory once the peers have
signalled that they finished the previous call. After a CommTimeoutError the Buffer is unusable.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from .. import _native
from ..types import (
    DispatchLayout,
    DispatchResult,
    EventHandle,
    LowLatencyCombineResult,
    LowLatencyDispatchResult,
    LowLatencyHandle,
)
from ..config import Config
from .base import Backend, BufferConfig, DispatchOutputs, align_up_device, native_dispatch_result, record_event
from . import internode
from .internode import InternodeEngine
from .symmetric import ALLOCATION_SLACK_BYTES, NvshmemSession

NUM_ALLOCATIONS = 3  # signals, workspace, row flags


@dataclass(frozen=True)
class DispatchState:
    """Backend-private part of a DispatchHandle: what combine and a cached dispatch reuse."""

    pos: torch.Tensor  # [N, R] int32: row of token n among the tokens sent to rank r, -1 if not sent
    recv_info: torch.Tensor  # [2R + E_l] int32: rows per source, first output row per source, raw rows per expert
    tokens_per_expert: Optional[list[int]]  # raw received rows per local expert; None in worst-case mode


def _ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


class NvshmemBackend(Backend):
    """Device-initiated NVLink dispatch/combine through NVSHMEM peer addresses."""

    name = "nvshmem"
    checks_expert_ids = True

    def __init__(self, cfg: BufferConfig) -> None:
        super().__init__(cfg)
        native = _native.load()
        r, e = cfg.world_size, cfg.num_experts
        t = cfg.max_tokens_per_rank
        if cfg.hierarchical:
            heap_bytes = native.SIGNAL_WORDS * 8 + ALLOCATION_SLACK_BYTES + internode.heap_bytes(cfg)
        else:
            workspace_bytes = native.intranode_workspace_bytes(r, t, cfg.hidden, cfg.num_topk, e)
            row_flags_shape = (2, r, t)  # [dispatch | combine][source][row] uint64 (kernels/intranode.h)
            heap_bytes = workspace_bytes + (native.SIGNAL_WORDS + 2 * r * t) * 8 + NUM_ALLOCATIONS * ALLOCATION_SLACK_BYTES
        engine_cls: Any = None
        if cfg.low_latency:
            from .low_latency import LowLatencyEngine

            engine_cls = LowLatencyEngine
            heap_bytes += engine_cls.heap_bytes(cfg)

        self._epochs = torch.zeros(native.NUM_EPOCHS, dtype=torch.int64, device=cfg.device)
        self._block_counters = torch.zeros(4, dtype=torch.int32, device=cfg.device)
        self._layout_scratch = torch.empty(r + e, dtype=torch.int32, device=cfg.device)
        torch.cuda.synchronize(cfg.device)  # the zeros above land before any kernel, on any stream
        self._session: Optional[NvshmemSession] = NvshmemSession.acquire(cfg.group, cfg.device, heap_bytes)
        self._signals = self._session.alloc((native.SIGNAL_WORDS,), torch.int64)
        self._error = self._session.error_state(cfg.timeout_s, cfg.num_experts)
        self._internode: Optional[InternodeEngine] = None
        self._ctx: Any = None
        self._tuning: Optional[tuple[int, ...]] = None  # the NVLink context's (send_warps, ..., recv_run)
        self._low_latency: Any = None
        try:
            if cfg.hierarchical:
                self._internode = InternodeEngine(cfg, self._session, self._error)
            else:
                self._ctx = self._intranode_context(native, workspace_bytes, row_flags_shape)
            if engine_cls is not None:
                self._low_latency = engine_cls(cfg, self._session, self._epochs, self._error)
        except BaseException:
            self._session.release()
            raise

    def _intranode_context(self, native: Any, workspace_bytes: int, row_flags_shape: tuple[int, ...]) -> Any:
        """The NVLink kernels' context: every rank of the group must be reachable by loads/stores."""
        cfg, e = self.cfg, self.cfg.num_experts
        self._workspace = self._session.alloc((workspace_bytes,), torch.uint8)
        self._row_flags = self._session.alloc(row_flags_shape, torch.int64)
        unreachable = [p for p, addr in enumerate(self._workspace.peer_ptrs) if addr == 0]
        if unreachable:
            raise RuntimeError(f"moe_ep rank {cfg.rank}: ranks {unreachable} are not reachable by NVLink loads/stores "
                               "(nvshmem_ptr is 0); give Buffer the node size (ranks_per_node) so the cross-node "
                               "path serves them")
        r = cfg.world_size
        return native.IntranodeContext(
            rank=cfg.rank, nranks=r, max_tokens=cfg.max_tokens_per_rank, hidden=cfg.hidden, num_topk=cfg.num_topk,
            num_experts=e, timeout_s=cfg.timeout_s, error=self._error.device_ptr, epochs=self._epochs.data_ptr(),
            block_counters=self._block_counters.data_ptr(), layout_scratch=self._layout_scratch.data_ptr(),
            signals=list(self._signals.peer_ptrs), workspace=list(self._workspace.peer_ptrs),
            row_flags=list(self._row_flags.peer_ptrs),
        )

    # ---- normal mode -----------------------------------------------------------------------
    def _tune(self, knobs: Config) -> None:
        """The NVLink kernels' tuning for the next launch (set on the context only when it changed)."""
        tuning = (knobs.send_warps, knobs.combine_send_warps, knobs.unroll, knobs.flag_batch, knobs.recv_run)
        if tuning != self._tuning:
            self._ctx.set_tuning(*tuning)
            self._tuning = tuning

    def _stream(self, previous_event: Optional[EventHandle]) -> torch.cuda.Stream:
        """Raises a timeout recorded by an earlier kernel (a bad id waits for the end of a call:
        ErrorWatch.check), orders after previous_event; the current stream."""
        self._error.check(timeouts_only=True)
        if previous_event is not None:
            previous_event.wait()
        return torch.cuda.current_stream(self.cfg.device)

    def get_dispatch_layout(self, topk_idx: torch.Tensor) -> DispatchLayout:
        cfg, n = self.cfg, topk_idx.shape[0]
        if self._internode is not None:
            layout = self._internode.route(topk_idx, torch.cuda.current_stream(cfg.device))
            return DispatchLayout(num_tokens_per_rank=layout.tokens_per_rank,
                                  num_tokens_per_expert=layout.tokens_per_expert, is_token_in_rank=layout.in_rank)
        per_rank = torch.empty(cfg.world_size, dtype=torch.int32, device=cfg.device)
        per_expert = torch.empty(cfg.num_experts, dtype=torch.int32, device=cfg.device)
        in_rank = torch.empty(n, cfg.world_size, dtype=torch.bool, device=cfg.device)
        self._ctx.layout(topk_idx.data_ptr(), n, per_rank.data_ptr(), per_expert.data_ptr(), in_rank.data_ptr(),
                         torch.cuda.current_stream(cfg.device).cuda_stream)
        self._error.check()  # local call: what earlier calls without a host sync recorded
        return DispatchLayout(num_tokens_per_rank=per_rank, num_tokens_per_expert=per_expert, is_token_in_rank=in_rank)

    def _notify(self, topk_idx: torch.Tensor, expert_alignment: int, worst_case: bool,
                stream: torch.cuda.Stream) -> tuple[torch.Tensor, DispatchState, torch.Tensor]:
        """Launch layout + count exchange. Returns is_token_in_rank, the handle state (its
        tokens_per_expert still unknown to the host) and the aligned tokens per local expert on the device."""
        cfg, n, r = self.cfg, topk_idx.shape[0], self.cfg.world_size
        dev = cfg.device
        in_rank = torch.empty(n, r, dtype=torch.bool, device=dev)
        pos = torch.empty(n, r, dtype=torch.int32, device=dev)
        recv_info = torch.empty(2 * r + cfg.num_local_experts, dtype=torch.int32, device=dev)
        tokens_per_expert = torch.empty(cfg.num_local_experts, dtype=torch.int32, device=dev)
        self._ctx.notify(topk_idx.data_ptr(), n, in_rank.data_ptr(), pos.data_ptr(), recv_info.data_ptr(),
                         tokens_per_expert.data_ptr(), expert_alignment, worst_case, stream.cuda_stream)
        return in_rank, DispatchState(pos, recv_info, None), tokens_per_expert

    def dispatch(self, x, x_scales, topk_idx, topk_weights, *, handle, expert_alignment, worst_case, num_sms, knobs,
                 previous_event, async_op) -> DispatchResult:
        """Notify, then the dispatch kernel straight away: it reads the counts on the device, so the
        host waits for the counts (to size the result) while rows already move. Outputs are
        allocated with R * T rows and returned as views of the first M."""
        cfg = self.cfg
        r, h = cfg.world_size, cfg.hidden
        stream = self._stream(previous_event)
        if self._internode is not None:
            return self._internode.dispatch(x, x_scales, topk_idx, topk_weights, handle=handle,
                                            expert_alignment=expert_alignment, worst_case=worst_case, num_sms=num_sms,
                                            stream=stream, async_op=async_op)
        n, fp8 = x.shape[0], x.dtype == torch.float8_e4m3fn
        cached = handle is not None
        counts_ready: Optional[torch.cuda.Event] = None
        self._tune(knobs)
        if cached:
            state: DispatchState = handle.state
            worst_case, recv_counts = handle.worst_case, handle.recv_counts
            # received rows per local expert, from the original dispatch
            tokens_per_expert_tensor = align_up_device(state.recv_info[2 * r:], expert_alignment)
        else:
            in_rank, state, tokens_per_expert_tensor = self._notify(topk_idx, expert_alignment, worst_case, stream)
            if not worst_case:
                counts_ready = torch.cuda.Event()
                counts_ready.record(stream)
        m = r * cfg.max_tokens_per_rank if worst_case or not cached else sum(recv_counts)
        out = DispatchOutputs.allocate(cfg, m, x.dtype, handle)
        self._ctx.dispatch(
            x.data_ptr(), _ptr(x_scales), _ptr(topk_idx), _ptr(topk_weights), state.pos.data_ptr(),
            state.recv_info.data_ptr(), n, h * x.element_size(), cfg.num_scales if fp8 else 0, out.x.data_ptr(),
            _ptr(out.scales), _ptr(out.topk_idx), _ptr(out.topk_weights), 0 if cached else out.src_rank.data_ptr(),
            0 if cached else out.src_index.data_ptr(), worst_case, cached, num_sms, stream.cuda_stream,
        )
        if counts_ready is not None:
            counts_ready.synchronize()
            self._error.check()  # every kernel of the call is launched: raising keeps the ranks in step
            recv_counts, raw = self._ctx.host_info()
            state = DispatchState(state.pos, state.recv_info, raw)
            m = sum(recv_counts)
            out = out.head(m)
        else:
            self._error.check()  # launched: what earlier calls without a host sync recorded
            if not cached:
                recv_counts = None
        return native_dispatch_result(
            cfg, handle, out, num_tokens=n, is_token_in_rank=handle.is_token_in_rank if cached else in_rank,
            recv_counts=recv_counts, worst_case=worst_case, state=state,
            tokens_per_expert_raw=state.tokens_per_expert, expert_alignment=expert_alignment,
            tokens_per_expert_tensor=tokens_per_expert_tensor, async_op=async_op, check=self._error.check)

    def combine(self, x, handle, *, topk_weights, num_sms, knobs, previous_event, async_op):
        """One kernel: the rows, and topk_weights when given, travel back together (intranode or cross-node)."""
        cfg = self.cfg
        stream = self._stream(previous_event)
        n = handle.num_tokens
        out = torch.empty(n, cfg.hidden, dtype=torch.bfloat16, device=cfg.device)
        out_w = None if topk_weights is None else torch.empty(n, cfg.num_topk, dtype=torch.float32, device=cfg.device)
        if self._internode is not None:
            self._internode.combine(x, handle, out, topk_weights, out_w, num_sms=num_sms, stream=stream)
        else:
            state: DispatchState = handle.state
            self._tune(knobs)
            self._ctx.combine(x.data_ptr(), x.shape[0], handle.src_rank.data_ptr(), handle.src_index.data_ptr(),
                              handle.is_token_in_rank.data_ptr(), state.pos.data_ptr(), state.recv_info.data_ptr(), n,
                              out.data_ptr(), topk_weights is not None, _ptr(topk_weights), _ptr(out_w), num_sms,
                              stream.cuda_stream)
        self._error.check()  # launched: what earlier calls without a host sync recorded
        return out, out_w, record_event(async_op, cfg.device, self._error.check)

    # ---- low-latency mode ------------------------------------------------------------------
    def _engine(self) -> Any:
        if self._low_latency is None:
            raise RuntimeError("this Buffer was created without low_latency=True")
        return self._low_latency

    def low_latency_dispatch(self, x, topk_idx, *, use_fp8, round_scale,
                             return_recv_hook) -> LowLatencyDispatchResult:
        return self._engine().dispatch(x, topk_idx, use_fp8=use_fp8, round_scale=round_scale,
                                       return_recv_hook=return_recv_hook)

    def low_latency_combine(self, x, topk_idx, topk_weights, handle: LowLatencyHandle, *,
                            return_recv_hook) -> LowLatencyCombineResult:
        return self._engine().combine(x, topk_idx, topk_weights, handle, return_recv_hook=return_recv_hook)

    @property
    def normal_path(self) -> str:
        return "nvlink" if self._internode is None else "cross-node"

    def fill_workspace(self, value: int) -> None:
        (self._workspace.tensor if self._internode is None else self._internode.data).fill_(value)

    def masked_ranks(self) -> list[int]:
        return self._engine().masked_ranks()

    def abort(self) -> None:
        """Local: waits for this rank's kernels (each gives up within the timeout), frees host memory
        only and gives the NVSHMEM session up (symmetric memory is freed collectively, with every PE)."""
        if self._session is None:
            return
        torch.cuda.synchronize(self.cfg.device)
        for part in (self._ctx, self._internode):
            if part is not None:
                part.close()
        masked = self._low_latency.masked_ranks() if self._low_latency is not None else []
        self._session.abandon(f"rank {self.cfg.rank} aborted a Buffer" + (f"; ranks {masked} were masked" if masked else ""))
        self._session = None
        self._low_latency = self._internode = self._ctx = None

    # ---- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Collective: waits for this rank's kernels, frees the symmetric memory and the session."""
        if self._session is None:
            return
        torch.cuda.synchronize(self.cfg.device)
        if self._low_latency is not None:
            self._low_latency.close()
            self._low_latency = None
        if self._internode is not None:
            self._internode.close()
            self._internode = None
        if self._ctx is not None:
            self._ctx.close()
        self._session.release()
        self._session = None
