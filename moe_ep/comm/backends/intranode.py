"""Normal-mode dispatch/combine inside one node on the NVLink kernels (csrc/kernels/intranode/).

The notify kernel computes the layout and exchanges counts with every peer (the start barrier);
then at once the dispatch kernel, whose warps store rows into the peers' symmetric workspace over
NVLink while other warps copy the rows that already landed here (per-row flags) into the output
tensors. The combine kernel sends each received row back and reduces a token's rows in ascending
rank order. Every rank of the group must be reachable by NVLink loads and stores (nvshmem_ptr).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from .. import _native
from ..config import ALLOCATION_SLACK_BYTES, Config
from ..types import DispatchHandle, DispatchLayout, DispatchResult, ExpertMajorLayout
from .base import BufferConfig, DispatchOutputs, ptr_or_null
from .engine import NormalEngine, Notified

if TYPE_CHECKING:
    from .symmetric import NvshmemSession

NUM_ALLOCATIONS = 3  # signals, workspace, row flags


@dataclass(frozen=True)
class DispatchState:
    """Backend-private part of a DispatchHandle made on one node: what combine and a cached dispatch reuse."""

    pos: torch.Tensor  # [N, R] int32: row of token n among the tokens sent to rank r, -1 if not sent
    recv_info: torch.Tensor  # [2R + E_l] int32: rows per source, first output row per source, raw rows per expert
    tokens_per_expert: Optional[list[int]]  # raw received rows per local expert; None in worst-case mode


def _row_flags_shape(cfg: BufferConfig) -> tuple[int, int, int]:
    """[dispatch | combine][source][row] uint64 (csrc/kernels/intranode/ workspace protocol)."""
    return 2, cfg.world_size, cfg.max_tokens_per_rank


def _workspace_bytes(cfg: BufferConfig) -> int:
    return _native.load().intranode_workspace_bytes(cfg.world_size, cfg.max_tokens_per_rank, cfg.hidden,
                                                    cfg.num_topk, cfg.num_experts)


class IntranodeEngine(NormalEngine):
    """The NVLink normal-mode kernels of one Buffer and their symmetric memory (signals, workspace, row flags)."""

    path = "nvlink"

    def __init__(self, cfg: BufferConfig, session: "NvshmemSession", epochs: torch.Tensor,
                 runtime: Any) -> None:
        native = _native.load()
        self._native: Any = native  # the launch argument structs (IntranodeDispatchArgs, ...)
        self.cfg = cfg
        dev, r, e = cfg.device, cfg.world_size, cfg.num_experts
        self._epochs = epochs  # kept alive: the kernels use it
        self._block_counters = torch.zeros(native.INTRANODE_BLOCK_COUNTERS, dtype=torch.int32, device=dev)
        self._layout_scratch = torch.zeros(native.intranode_layout_scratch_words(r, e), dtype=torch.int32, device=dev)
        torch.cuda.synchronize(dev)  # the zeros land before any kernel, on any stream
        self._signals = session.alloc((native.SIGNAL_WORDS,), torch.int64)
        self._workspace = session.alloc((_workspace_bytes(cfg),), torch.uint8)
        self._row_flags = session.alloc(_row_flags_shape(cfg), torch.int64)
        unreachable = [p for p, addr in enumerate(self._workspace.peer_ptrs) if addr == 0]
        if unreachable:
            raise RuntimeError(f"moe_ep rank {cfg.rank}: ranks {unreachable} are not reachable by NVLink loads/stores "
                               "(nvshmem_ptr is 0); give Buffer the node size (ranks_per_node) so the cross-node "
                               "path serves them")
        self._ctx: Any = native.IntranodeContext(
            runtime=runtime, max_tokens=cfg.max_tokens_per_rank, hidden=cfg.hidden, num_topk=cfg.num_topk,
            num_experts=e, epochs=epochs.data_ptr(),
            block_counters=self._block_counters.data_ptr(), layout_scratch=self._layout_scratch.data_ptr(),
            signals=list(self._signals.peer_ptrs), workspace=list(self._workspace.peer_ptrs),
            row_flags=list(self._row_flags.peer_ptrs),
        )
        self._tuning: Optional[tuple[int, ...]] = None  # the context's (send_warps, ..., recv_run)
        self._device_sms = torch.cuda.get_device_properties(dev).multi_processor_count  # the expand kernel's grid

    @staticmethod
    def heap_bytes(cfg: BufferConfig) -> int:
        r, t = cfg.world_size, cfg.max_tokens_per_rank
        return (_workspace_bytes(cfg) + (_native.load().SIGNAL_WORDS + 2 * r * t) * 8
                + NUM_ALLOCATIONS * ALLOCATION_SLACK_BYTES)

    def _tune(self, knobs: Config) -> None:
        """The kernels' tuning for the next launch (set on the context only when it changed)."""
        tuning = (knobs.send_warps, knobs.combine_send_warps, knobs.unroll, knobs.flag_batch, knobs.recv_run)
        if tuning != self._tuning:
            self._ctx.set_tuning(*tuning)
            self._tuning = tuning

    def layout(self, topk_idx: torch.Tensor, stream: torch.cuda.Stream) -> DispatchLayout:
        cfg, n = self.cfg, topk_idx.shape[0]
        per_rank = torch.empty(cfg.world_size, dtype=torch.int32, device=cfg.device)
        per_expert = torch.empty(cfg.num_experts, dtype=torch.int32, device=cfg.device)
        in_rank = torch.empty(n, cfg.world_size, dtype=torch.bool, device=cfg.device)
        self._ctx.layout(self._native.IntranodeLayoutArgs(
            topk_idx=topk_idx.data_ptr(), num_tokens=n, tokens_per_rank=per_rank.data_ptr(),
            tokens_per_expert=per_expert.data_ptr(), is_token_in_rank=in_rank.data_ptr(),
        ), stream.cuda_stream)
        return DispatchLayout(num_tokens_per_rank=per_rank, num_tokens_per_expert=per_expert, is_token_in_rank=in_rank)

    def notify(self, topk_idx: torch.Tensor, expert_alignment: int, worst_case: bool,
               stream: torch.cuda.Stream, stamp: list[int]) -> Notified:
        cfg, n, r = self.cfg, topk_idx.shape[0], self.cfg.world_size
        dev = cfg.device
        in_rank = torch.empty(n, r, dtype=torch.bool, device=dev)
        pos = torch.empty(n, r, dtype=torch.int32, device=dev)
        recv_info = torch.empty(2 * r + cfg.num_local_experts, dtype=torch.int32, device=dev)
        tokens_per_expert = torch.empty(cfg.num_local_experts, dtype=torch.int32, device=dev)
        self._ctx.notify(self._native.IntranodeNotifyArgs(
            topk_idx=topk_idx.data_ptr(), num_tokens=n, is_token_in_rank=in_rank.data_ptr(), pos=pos.data_ptr(),
            recv_info=recv_info.data_ptr(), tokens_per_expert=tokens_per_expert.data_ptr(),
            expert_alignment=expert_alignment, worst_case=worst_case,
        ), stream.cuda_stream, stamp)
        return Notified(in_rank, DispatchState(pos, recv_info, None), tokens_per_expert)

    def raw_expert_counts(self, state: DispatchState) -> torch.Tensor:
        return state.recv_info[2 * self.cfg.world_size:]

    def dispatch_outputs(self, m: int, dtype: torch.dtype, handle: Optional[DispatchHandle],
                         expert_major: bool) -> DispatchOutputs:
        """An expert-major dispatch leaves its rows in the workspace (pair_rows copies them out): no x."""
        return DispatchOutputs.allocate(self.cfg, m, dtype, handle, rows=not expert_major)

    def launch_dispatch(self, x, x_scales, topk_idx, topk_weights, state: DispatchState, out: DispatchOutputs, *,
                        cached, worst_case, expert_major, num_sms, knobs, stream) -> None:
        cfg = self.cfg
        fp8 = x.dtype == torch.float8_e4m3fn
        self._tune(knobs)
        self._ctx.dispatch(self._native.IntranodeDispatchArgs(
            x=x.data_ptr(), x_scales=ptr_or_null(x_scales), topk_idx=ptr_or_null(topk_idx),
            topk_weights=ptr_or_null(topk_weights), pos=state.pos.data_ptr(), recv_info=state.recv_info.data_ptr(),
            num_tokens=x.shape[0], row_bytes=cfg.hidden * x.element_size(), num_scales=cfg.num_scales if fp8 else 0,
            num_rows=out.src_rank.shape[0], out_x=ptr_or_null(out.x), out_scales=ptr_or_null(out.scales),
            out_topk_idx=ptr_or_null(out.topk_idx), out_topk_weights=ptr_or_null(out.topk_weights),
            out_src_rank=0 if cached else out.src_rank.data_ptr(),
            out_src_index=0 if cached else out.src_index.data_ptr(), worst_case=worst_case, cached=cached,
            expert_major=expert_major, num_blocks=num_sms,
        ), stream.cuda_stream)

    def pair_rows(self, result: DispatchResult,
                  layout: ExpertMajorLayout) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The expand kernel, from the workspace slots the rows landed in, over every SM: it runs on the
        caller's stream between the exchange and the experts, with nothing to overlap, so the Buffer's
        communication SM budget does not bound it. FP8 rows are the ones that came with scales."""
        cfg = self.cfg
        p, fp8 = layout.rows.shape[0], result.x_scales is not None
        x = torch.empty(p, cfg.hidden, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16, device=cfg.device)
        scales = torch.empty(p, cfg.num_scales, dtype=torch.float32, device=cfg.device) if fp8 else None
        self._ctx.expand(self._native.IntranodeExpandArgs(
            rows=layout.rows.data_ptr(), num_pairs=p, num_rows=result.src_rank.shape[0],
            expert_alignment=layout.alignment,
            src_rank=result.src_rank.data_ptr(), recv_info=result.handle.state.recv_info.data_ptr(),
            row_bytes=cfg.hidden * x.element_size(), num_scales=cfg.num_scales if fp8 else 0,
            scales=ptr_or_null(result.x_scales), out_x=x.data_ptr(), out_scales=ptr_or_null(scales),
            num_blocks=self._device_sms,
        ), torch.cuda.current_stream(cfg.device).cuda_stream)
        return x, scales

    def combine(self, x: torch.Tensor, handle: DispatchHandle, out: torch.Tensor,
                topk_weights: Optional[torch.Tensor], out_topk_weights: Optional[torch.Tensor], *, num_sms: int,
                knobs: Config, stream: torch.cuda.Stream) -> None:
        state: DispatchState = handle.state
        self._tune(knobs)
        self._ctx.combine(self._native.IntranodeCombineArgs(
            x=x.data_ptr(), num_rows=x.shape[0], src_rank=handle.src_rank.data_ptr(),
            src_index=handle.src_index.data_ptr(), is_token_in_rank=handle.is_token_in_rank.data_ptr(),
            pos=state.pos.data_ptr(), recv_info=state.recv_info.data_ptr(), num_tokens=handle.num_tokens,
            out=out.data_ptr(), with_weights=topk_weights is not None, topk_weights=ptr_or_null(topk_weights),
            out_topk_weights=ptr_or_null(out_topk_weights), num_blocks=num_sms,
        ), stream.cuda_stream)

    def fill_workspace(self, value: int) -> None:
        self._workspace.tensor.fill_(value)
