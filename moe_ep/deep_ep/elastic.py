"""DeepEP V2's `ElasticBuffer` (deepseek-ai/DeepEP `deep_ep/buffers/elastic.py`) on moe_ep's Buffer, so
code written for DeepEP V2 (torchtitan's, vLLM's and SGLang's deepep_v2 paths) switches by import.
Every difference is listed in docs/deep_ep_compat.md.

Each DeepEP layout is one moe_ep dispatch mode, not a second implementation:
- compact rows with a host sync: an exact-size dispatch (rows by source rank, then token);
- compact rows without one: a worst-case dispatch (R * T rows, no host sync), its received rows
  moved to the front on the device, as DeepEP leaves them;
- expanded (token, local expert) rows with a host sync: an expert-major dispatch
  (`expert_major=True`, each expert's block padded to `expert_alignment` with zero rows);
- expanded rows without one: a worst-case expert-major dispatch (moe_ep's static pair bound);
- a dispatch through a handle: moe_ep's cached dispatch, in the handle's layout.
Combine is moe_ep's combine (an unweighted sum; `topk_weights` travel back with the rows).

moe_ep Buffers are made on first use, one per (hidden, num_experts, top-k), sized for the larger of
the constructor's and the first call's `num_max_tokens_per_rank`; DeepEP requires the same values
on every rank, so the collective creation happens at the same call everywhere.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist

import moe_ep
from moe_ep.comm import topology
from moe_ep.comm.config import DEEP_EP_SIZE_ALIGNMENT_BYTES, DEEP_EP_SIZING_TOPK, DEFAULT_NUM_SMS
from moe_ep.comm.fp8 import BLOCK as FP8_BLOCK
from moe_ep.deep_ep.factory import BufferFactory
from moe_ep.deep_ep.v1 import EventHandle, EventOverlap, _gather_rows, _row_bytes, _scatter_rows, _unsupported, add_bias

XType = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def get_physical_domain_size(group: dist.ProcessGroup) -> tuple[int, int]:
    """(nodes, ranks per node) of `group` as moe_ep detects them (collective): DeepEP's
    (RDMA ranks, NVLink ranks)."""
    topo = topology.resolve(group, None, _gpu())
    return topo.num_nodes, topo.ranks_per_node


def get_logical_domain_size(group: dist.ProcessGroup, allow_hybrid_mode: bool = True) -> tuple[int, int]:
    """(1, group size): moe_ep groups received rows by source rank, one scale-up domain of all ranks
    in DeepEP's terms, whatever the mode (its cross-node kernels choose their own path)."""
    return 1, dist.get_world_size(group)


def _gpu() -> Optional[torch.device]:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


@dataclass
class EPHandle:
    """DeepEP V2's dispatch handle: the fields frameworks read, with DeepEP's layouts and meaning
    (docs/deep_ep_compat.md), and the moe_ep Buffer and handle it stands for."""

    do_expand: bool
    num_experts: int
    expert_alignment: int
    num_max_tokens_per_rank: int
    num_sms: int
    topk_idx: torch.Tensor  # [N, K] the dispatch's routing (a clone with do_handle_copy)
    num_recv_tokens: int  # rows of a non-expand recv_x (R * num_max_tokens_per_rank without CPU sync)
    num_expanded_tokens: int  # rows of an expand recv_x (0 for non-expand)
    num_recv_tokens_per_expert_list: list[int]  # aligned rows per local expert; [] without CPU sync
    psum_num_recv_tokens_per_scaleup_rank: torch.Tensor  # [R] int32 inclusive prefix sum of rows per source rank
    psum_num_recv_tokens_per_expert: torch.Tensor  # [E_l] int32, DeepEP's (see _expert_psum)
    num_unaligned_recv_tokens_per_expert: torch.Tensor  # [E_l] int32 rows per local expert
    buffer: moe_ep.Buffer = dataclasses.field(repr=False)
    inner: moe_ep.DispatchHandle = dataclasses.field(repr=False)
    # compact without CPU sync: the moe_ep row of each output row
    rows: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False)
    # compact: [M, K] local expert ids of moe_ep's rows (a combine's weights come from their expert's rank)
    local_idx: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False)

    @property
    def num_scaleup_ranks(self) -> int:
        return self.psum_num_recv_tokens_per_scaleup_rank.shape[0]


@dataclass
class _Received:
    """One fresh dispatch in DeepEP's layout: what it returns, and the moe_ep result behind it."""

    x: torch.Tensor
    scales: Optional[torch.Tensor]
    topk_idx: Optional[torch.Tensor]  # None when expanded
    topk_weights: torch.Tensor
    result: moe_ep.DispatchResult
    rows: Optional[torch.Tensor] = None  # compact without CPU sync: the moe_ep row of each output row


def _per_source(src_rank: torch.Tensor, world: int) -> torch.Tensor:
    """[R] int32: received rows per source rank (padding rows, src_rank -1, left out); device only."""
    at = torch.where(src_rank >= 0, src_rank.long(), world)
    counts = torch.zeros(world + 1, dtype=torch.int32, device=src_rank.device)
    counts.scatter_add_(0, at, torch.ones_like(at, dtype=torch.int32))
    return counts[:world]


def _per_expert(local_idx: torch.Tensor, num_local: int) -> torch.Tensor:
    """[E_l] int32: received rows per local expert (a row naming one twice counts once); device only."""
    hit = torch.zeros(local_idx.shape[0], num_local + 1, dtype=torch.bool, device=local_idx.device)
    hit.scatter_(1, torch.where(local_idx >= 0, local_idx, num_local), True)
    return hit[:, :num_local].sum(0, dtype=torch.int32)


def _expert_psum(raw: torch.Tensor, alignment: int, do_expand: bool) -> torch.Tensor:
    """DeepEP's psum_num_recv_tokens_per_expert: the inclusive prefix sum of the aligned counts;
    expanded, each entry is its expert's aligned start plus its actual count instead."""
    aligned = (raw + alignment - 1) // alignment * alignment
    psum = torch.cumsum(aligned, 0, dtype=torch.int32)
    return psum - aligned + raw if do_expand else psum


def _aligned(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """t contiguous and 16-byte aligned, as moe_ep's kernels read it (DeepEP asks contiguity only):
    a view at an odd offset is copied."""
    if t is None:
        return None
    t = t.contiguous()
    return t.clone() if t.data_ptr() % 16 else t


def _col_major(sf: torch.Tensor) -> torch.Tensor:
    """DeepEP's TMA-aligned column-major scales: the same values, column stride align(rows, 4)."""
    rows, packs = sf.shape
    out = torch.empty(packs, _align(max(rows, 1), 4), dtype=sf.dtype, device=sf.device).t()[:rows]
    out.copy_(sf)
    return out


class ElasticBuffer:
    """DeepEP V2's `deep_ep.ElasticBuffer` served by moe_ep. Creating it is collective over `group`.

    Keyword-only extensions (not in DeepEP): `backend` (moe_ep's) and `ranks_per_node`."""

    def __init__(self, group: dist.ProcessGroup, num_bytes: Optional[int] = None, num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0,
                 use_fp8_dispatch: bool = False, deterministic: bool = False, allow_hybrid_mode: bool = True,
                 allow_multiple_reduction: bool = True, prefer_overlap_with_compute: bool = True, sl_idx: int = 3,
                 num_allocated_qps: int = 0, num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100,
                 explicitly_destroy: bool = False, *, backend: str = "auto",
                 ranks_per_node: Optional[int] = None) -> None:
        if num_cpu_bytes:
            raise _unsupported(f"num_cpu_bytes={num_cpu_bytes}", "moe_ep's buffers live in GPU memory only")
        for name, value in (("num_max_tokens_per_rank", num_max_tokens_per_rank), ("hidden", hidden),
                            ("num_topk", num_topk), ("num_allocated_qps", num_allocated_qps)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if not num_gpu_timeout_secs > 0:
            raise ValueError(f"num_gpu_timeout_secs must be positive, got {num_gpu_timeout_secs!r}")
        self.group = group
        self.rank_idx, self.num_ranks = dist.get_rank(group), dist.get_world_size(group)
        self.num_max_tokens_per_rank, self.hidden, self.num_topk = num_max_tokens_per_rank, hidden, num_topk
        self.use_fp8_dispatch, self.deterministic = use_fp8_dispatch, deterministic
        self.allow_hybrid_mode, self.allow_multiple_reduction = allow_hybrid_mode, allow_multiple_reduction
        self.prefer_overlap_with_compute, self.sl_idx = prefer_overlap_with_compute, sl_idx
        self.num_allocated_qps, self.explicitly_destroy = num_allocated_qps, explicitly_destroy
        self._timeout_s = float(num_gpu_timeout_secs)
        self.num_bytes = num_bytes if num_bytes is not None else self.get_buffer_size_hint(
            group, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch, allow_hybrid_mode,
            allow_multiple_reduction)
        self._factory = BufferFactory(group, backend, ranks_per_node)  # collective
        self.num_rdma_ranks, self.num_nvlink_ranks = self._factory.num_nodes, self._factory.ranks_per_node
        self.num_scaleout_ranks, self.num_scaleup_ranks = 1, self.num_ranks
        self.scaleout_rank_idx, self.scaleup_rank_idx = 0, self.rank_idx
        self._buffers: dict[tuple[int, int, int], moe_ep.Buffer] = {}

    @property
    def moe_ep_buffers(self) -> list[moe_ep.Buffer]:
        """The moe_ep Buffers made so far (one per (hidden, num_experts, top-k); moe_ep's own API)."""
        return list(self._buffers.values())

    # ---- static helpers and queries -------------------------------------------------------
    @staticmethod
    def get_buffer_size_hint(group: dist.ProcessGroup, num_max_tokens_per_rank: int, hidden: int,
                             num_topk: int = 0, use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """About the bytes moe_ep's normal-mode workspace takes for these shapes (a received bf16 row,
        FP8 scales and metadata per source rank and token; top-k 0 counts as 32), aligned to 2 MiB.
        The moe_ep Buffers size themselves; this number only bounds `num_max_tokens_per_rank`."""
        k = num_topk or DEEP_EP_SIZING_TOPK
        row = _row_bytes(hidden) + 12 * max(0, k - 16)
        return _align(max(1, dist.get_world_size(group) * num_max_tokens_per_rank * row), DEEP_EP_SIZE_ALIGNMENT_BYTES)

    def get_theoretical_num_sms(self, num_experts: Optional[int] = None, num_topk: Optional[int] = None,
                                num_scaleout_topk: int = 0, rdma_gbs: float = 0, nvlink_gbs: float = 0,
                                sm_read_gbs: float = 200, sm_write_gbs: float = 50) -> int:
        """moe_ep's SM budget for a normal-mode call (MOE_EP_NUM_SMS, else its default), at most the
        GPU's SMs: moe_ep has no bandwidth model, so the arguments do not change it."""
        sms = moe_ep.Config.from_env().num_sms or DEFAULT_NUM_SMS
        if torch.cuda.is_available():
            sms = min(sms, torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count)
        return sms

    def get_physical_domain_size(self) -> tuple[int, int]:
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self) -> tuple[int, int]:
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    @staticmethod
    def capture() -> EventHandle:
        """An event recorded on the current stream (an empty one without CUDA)."""
        return EventHandle()

    def get_comm_stream(self) -> Optional[torch.cuda.Stream]:
        """moe_ep works on the caller's current stream: that one (None without CUDA)."""
        return torch.cuda.current_stream() if torch.cuda.is_available() else None

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """A barrier over the group; with_cpu_sync also waits for this device's work first."""
        if with_cpu_sync and torch.cuda.is_available():
            torch.cuda.synchronize()
        dist.barrier(group=self.group)

    # ---- buffers --------------------------------------------------------------------------
    def _buffer(self, x: torch.Tensor, num_experts: int, num_topk: int, max_tokens: int) -> moe_ep.Buffer:
        """The moe_ep Buffer for x's hidden size, num_experts and top-k, created on first use."""
        key = (x.shape[1], num_experts, num_topk)
        if key not in self._buffers:
            needed = self.get_buffer_size_hint(self.group, max_tokens, x.shape[1], num_topk)
            if needed > self.num_bytes:
                raise ValueError(f"num_bytes={self.num_bytes} is too small for num_max_tokens_per_rank={max_tokens}, "
                                 f"hidden={x.shape[1]}, num_topk={num_topk}: get_buffer_size_hint gives {needed}")
            t = max(max_tokens, self.num_max_tokens_per_rank)
            self._buffers[key] = self._factory.create(x, num_experts, num_topk, t, timeout_s=self._timeout_s)
        buf = self._buffers[key]
        if max_tokens > buf.max_tokens_per_rank:
            raise ValueError(f"num_max_tokens_per_rank={max_tokens} exceeds the {buf.max_tokens_per_rank} this "
                             "buffer's first dispatch of these shapes was sized for; create the ElasticBuffer with "
                             "the largest value")
        return buf

    @staticmethod
    def _wait(*events: Optional[EventOverlap]) -> None:
        for event in events:
            if event is not None and event.event is not None:
                event.event.wait()

    @staticmethod
    def _event(async_with_compute_stream: bool) -> EventOverlap:
        """DeepEP's result event: one recorded after the call's work when async, else none (the
        call already ran on the current stream)."""
        return EventOverlap(EventHandle() if async_with_compute_stream else None)

    @staticmethod
    def _split_x(x: XType) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(rows, float32 scales or None): DeepEP's x or (x_e4m3, sf)."""
        if not isinstance(x, tuple):
            return x, None
        rows, sf = x
        if sf.dtype != torch.float32:
            raise _unsupported(f"FP8 scales of dtype {sf.dtype} (e.g. packed UE8M0)",
                               f"moe_ep moves float32 scales, one per {FP8_BLOCK} values")
        return rows, _aligned(sf)

    # ---- dispatch -------------------------------------------------------------------------
    def dispatch(self, x: XType, topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None, num_experts: Optional[int] = None,
                 num_max_tokens_per_rank: Optional[int] = None, expert_alignment: Optional[int] = None,
                 num_sms: int = 0, num_qps: int = 0, previous_event: Optional[EventOverlap] = None,
                 previous_event_before_epilogue: Optional[EventOverlap] = None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 handle: Optional[EPHandle] = None, do_handle_copy: bool = True, do_cpu_sync: Optional[bool] = None,
                 do_expand: bool = False, do_zero_padding: bool = False, use_tma_aligned_col_major_sf: bool = False
                 ) -> tuple[XType, Optional[torch.Tensor], Optional[torch.Tensor], EPHandle, EventOverlap]:
        """(recv_x, recv_topk_idx, recv_topk_weights, handle, event) in DeepEP V2's layouts (module
        docstring; docs/deep_ep_compat.md). recv_x is (e4m3, scales) for a tuple x."""
        rows, sf = self._split_x(x)
        rows, topk_idx, topk_weights = _aligned(rows), _aligned(topk_idx), _aligned(topk_weights)
        self._wait(previous_event, previous_event_before_epilogue)
        if do_zero_padding and not do_expand:
            raise ValueError("do_zero_padding=True needs do_expand=True (it zeroes the expanded layout's padding rows)")
        if handle is not None:
            recv_x, recv_sf = self._cached_dispatch(rows, sf, handle, topk_idx, topk_weights, num_experts,
                                                    num_max_tokens_per_rank, expert_alignment, num_sms, do_expand)
            if recv_sf is not None and use_tma_aligned_col_major_sf:
                recv_sf = _col_major(recv_sf)
            return (recv_x, recv_sf) if sf is not None else recv_x, None, None, handle, self._event(
                async_with_compute_stream)
        if topk_idx is None or num_experts is None:
            raise ValueError("dispatch needs topk_idx and num_experts (or a handle for a cached dispatch)")
        t = num_max_tokens_per_rank if num_max_tokens_per_rank is not None else self.num_max_tokens_per_rank
        if not isinstance(t, int) or t <= 0:
            raise ValueError(f"num_max_tokens_per_rank must be a positive int (here or in the constructor), got {t!r}")
        too_many = None
        if rows.shape[0] > t:  # this rank takes part without tokens, then raises: its peers are not left waiting
            too_many = ValueError(f"x has {rows.shape[0]} tokens, above num_max_tokens_per_rank={t}")
            rows, sf = rows[:0], None if sf is None else sf[:0]
            topk_idx, topk_weights = topk_idx[:0], None if topk_weights is None else topk_weights[:0]
        alignment = 1 if expert_alignment is None else expert_alignment
        sms = num_sms or self.get_theoretical_num_sms(num_experts, topk_idx.shape[1])
        weights = topk_weights if topk_weights is not None else torch.zeros(topk_idx.shape, dtype=torch.float32,
                                                                            device=topk_idx.device)
        buf = self._buffer(rows, num_experts, topk_idx.shape[1], t)
        sync = True if do_cpu_sync is None else bool(do_cpu_sync)
        call = functools.partial(buf.dispatch, rows, topk_idx, weights, x_scales=sf, expert_alignment=alignment,
                                 num_sms=sms)
        got = self._expand(call, sync) if do_expand else self._compact(call, sync, t)
        inner = got.result
        raw = _per_expert(inner.topk_idx, buf.num_local_experts)
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats.add_(raw.to(cumulative_local_expert_recv_stats.dtype))
        new = EPHandle(
            do_expand=bool(do_expand), num_experts=num_experts, expert_alignment=alignment,
            num_max_tokens_per_rank=t, num_sms=sms, topk_idx=topk_idx.clone() if do_handle_copy else topk_idx,
            num_recv_tokens=0 if do_expand else got.x.shape[0],
            num_expanded_tokens=got.x.shape[0] if do_expand else 0,
            num_recv_tokens_per_expert_list=list(inner.tokens_per_expert) if sync else [],
            psum_num_recv_tokens_per_scaleup_rank=torch.cumsum(_per_source(inner.src_rank, self.num_ranks), 0,
                                                               dtype=torch.int32),
            psum_num_recv_tokens_per_expert=_expert_psum(raw, alignment, bool(do_expand)),
            num_unaligned_recv_tokens_per_expert=raw, buffer=buf, inner=inner.handle, rows=got.rows,
            local_idx=None if do_expand else inner.topk_idx)
        if too_many is not None:
            raise too_many
        recv_sf = _col_major(got.scales) if got.scales is not None and use_tma_aligned_col_major_sf else got.scales
        recv = (got.x, recv_sf) if sf is not None else got.x
        recv_w = got.topk_weights if topk_weights is not None else None
        return recv, got.topk_idx, recv_w, new, self._event(async_with_compute_stream)

    def _compact(self, call: Callable[..., moe_ep.DispatchResult], sync: bool, t: int) -> _Received:
        """Non-expand: one row per received token. With sync, moe_ep's exact-size rows; without, its
        worst-case rows with the received ones moved to the front (DeepEP's R * t rows, the rest zero)."""
        got = call(worst_case=not sync)
        if sync:
            return _Received(got.x, got.x_scales, got.topk_idx, got.topk_weights, got)
        m = self.num_ranks * t
        rows = torch.argsort((got.src_rank < 0).to(torch.int8), stable=True)  # received rows first, in order
        return _Received(_gather_rows(got.x, rows, m, 0), _gather_rows(got.x_scales, rows, m, 0.0),
                         _gather_rows(got.topk_idx, rows, m, -1), _gather_rows(got.topk_weights, rows, m, 0.0),
                         got, rows)

    @staticmethod
    def _expand(call: Callable[..., moe_ep.DispatchResult], sync: bool) -> _Received:
        """Expand: one row per (received token, local expert), grouped by expert, each block padded to
        the alignment with zero rows: moe_ep's expert-major dispatch, exact-size with sync, else
        worst-case (its static pair bound, the rows past the last block zero)."""
        got = call(expert_major=True, worst_case=not sync)
        return _Received(got.x, got.x_scales, None, got.pair_weights, got)

    def _cached_dispatch(self, rows: torch.Tensor, sf: Optional[torch.Tensor], handle: EPHandle,
                         topk_idx: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor],
                         num_experts: Optional[int], num_max_tokens_per_rank: Optional[int],
                         expert_alignment: Optional[int], num_sms: int, do_expand: bool
                         ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """x (and scales) sent the way the handle's dispatch went, in its layout (an expanded handle's
        cached dispatch gives pairs)."""
        if not isinstance(handle, EPHandle):
            raise TypeError(f"handle must come from moe_ep.deep_ep ElasticBuffer.dispatch, got {type(handle).__name__}")
        if topk_idx is not None:
            raise ValueError("a cached dispatch (handle=...) takes its topk_idx from the handle: pass topk_idx=None")
        if topk_weights is not None:
            raise _unsupported("topk_weights with a handle", "a cached dispatch moves rows only")
        for name, given, kept in (("num_experts", num_experts, handle.num_experts),
                                  ("num_max_tokens_per_rank", num_max_tokens_per_rank, handle.num_max_tokens_per_rank),
                                  ("expert_alignment", expert_alignment, handle.expert_alignment),
                                  ("do_expand", bool(do_expand), handle.do_expand)):
            if given is not None and given != kept:
                raise ValueError(f"a cached dispatch keeps its handle's {name} ({kept}), got {given}")
        got = handle.buffer.dispatch(rows, x_scales=sf, handle=handle.inner, num_sms=num_sms or handle.num_sms)
        if handle.rows is not None:
            m = handle.num_recv_tokens
            return _gather_rows(got.x, handle.rows, m, 0), _gather_rows(got.x_scales, handle.rows, m, 0.0)
        return got.x, got.x_scales

    # ---- combine --------------------------------------------------------------------------
    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor], None] = None, num_sms: int = 0,
                num_qps: int = 0, previous_event: Optional[EventOverlap] = None,
                previous_event_before_epilogue: Optional[EventOverlap] = None,
                async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False
                ) -> tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """(combined_x [N, H] bf16, combined_topk_weights [N, K] or None, event): each token's rows
        summed back on its source rank, unweighted (moe_ep's fixed-order float32 sums, docs/api.md);
        topk_weights ([rows, K], or [rows] expanded) travel back with them, each top-k slot's value
        from the rank holding its expert (0 where topk_idx is -1); then `bias` added."""
        if not isinstance(handle, EPHandle):
            raise TypeError(f"handle must come from moe_ep.deep_ep ElasticBuffer.dispatch, got {type(handle).__name__}")
        self._wait(previous_event, previous_event_before_epilogue)
        x = _aligned(x)
        weights = None if topk_weights is None else _aligned(topk_weights.float())
        if not handle.do_expand and weights is not None:  # a slot's value comes from its expert's rank only
            local = handle.local_idx if handle.rows is None else _gather_rows(
                handle.local_idx, handle.rows, handle.num_recv_tokens, -1)
            if weights.shape != local.shape:
                raise ValueError(f"topk_weights must have shape {list(local.shape)}, got {list(weights.shape)}")
            weights = torch.where(local >= 0, weights, 0.0)
        if handle.rows is not None:  # back into moe_ep's worst-case rows; rows past the received ones are zero
            m, inner_rows = handle.num_recv_tokens, handle.inner.num_recv_rows
            if x.shape[0] != m:
                raise ValueError(f"x must have the dispatch's {m} rows, got {x.shape[0]}")
            valid = (torch.arange(m, device=x.device) < handle.psum_num_recv_tokens_per_scaleup_rank[-1]).unsqueeze(1)
            x = _scatter_rows(torch.where(valid, x, 0), handle.rows, inner_rows)
            weights = None if weights is None else _scatter_rows(weights, handle.rows, inner_rows)
        sms = num_sms or handle.num_sms
        if weights is None:
            out, out_w = handle.buffer.combine(x, handle.inner, num_sms=sms), None
        else:
            out, out_w = handle.buffer.combine(x, handle.inner, topk_weights=weights, num_sms=sms)
        return add_bias(out, bias), out_w, self._event(async_with_compute_stream)

    # ---- lifetime -------------------------------------------------------------------------
    def destroy(self) -> None:
        """Close every moe_ep Buffer this one created (collective); needs explicitly_destroy=True."""
        if not self.explicitly_destroy:
            raise RuntimeError("destroy() needs an ElasticBuffer created with explicitly_destroy=True")
        for buf in self._buffers.values():
            buf.close()
        self._buffers.clear()
