"""The interface every backend implements; `moe_ep.comm.buffer.Buffer` validates, then calls it."""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..call_check import CallStamp
from ..config import Config
from ..types import (
    DispatchHandle,
    DispatchLayout,
    DispatchResult,
    EventHandle,
    LowLatencyCombineResult,
    LowLatencyDispatchResult,
    LowLatencyHandle,
    LowLatencyOverlap,
)


def align_up(counts: list[int], alignment: int) -> list[int]:
    """Each count rounded up to a multiple of `alignment` (tokens_per_expert with expert_alignment)."""
    return [-(-c // alignment) * alignment for c in counts]


def align_up_device(counts: torch.Tensor, alignment: int) -> torch.Tensor:
    """align_up on the device, with no host sync (a cached dispatch's tokens_per_expert_tensor)."""
    return torch.div(counts + (alignment - 1), alignment, rounding_mode="floor") * alignment


def ptr_or_null(t: Optional[torch.Tensor]) -> int:
    """A tensor's device address for a native launch, 0 for an absent one."""
    return 0 if t is None else t.data_ptr()


def record_event(async_op: bool, device: torch.device,
                 check: Optional[Callable[[], None]] = None) -> Optional[EventHandle]:
    """For async_op: an EventHandle recorded on `device`'s current stream (the Buffer's communication
    stream during an async call: moe_ep.comm.streams; an empty one on CPU);
    `check` raises what the call's kernels recorded, once the event completed."""
    if not async_op:
        return None
    if device.type != "cuda":
        return EventHandle(None)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return EventHandle(event, check)


@dataclass(frozen=True)
class DispatchOutputs:
    """The tensors a native dispatch kernel writes, m rows each. A cached dispatch writes no expert
    ids or weights (None) and reuses its handle's source rows; one whose rows stay in the workspace
    (an expert-major NVLink dispatch: its engine's pair_rows copies them out) writes no x (None)."""

    x: Optional[torch.Tensor]
    scales: Optional[torch.Tensor]
    topk_idx: Optional[torch.Tensor]
    topk_weights: Optional[torch.Tensor]
    src_rank: torch.Tensor
    src_index: torch.Tensor

    @classmethod
    def allocate(cls, cfg: "BufferConfig", m: int, dtype: torch.dtype, handle: Optional[DispatchHandle],
                 rows: bool = True) -> "DispatchOutputs":
        dev, fresh = cfg.device, handle is None
        return cls(
            x=torch.empty(m, cfg.hidden, dtype=dtype, device=dev) if rows else None,
            scales=torch.empty(m, cfg.num_scales, dtype=torch.float32, device=dev)
            if dtype == torch.float8_e4m3fn else None,
            topk_idx=torch.empty(m, cfg.num_topk, dtype=torch.int64, device=dev) if fresh else None,
            topk_weights=torch.empty(m, cfg.num_topk, dtype=torch.float32, device=dev) if fresh else None,
            src_rank=torch.empty(m, dtype=torch.int32, device=dev) if fresh else handle.src_rank,
            src_index=torch.empty(m, dtype=torch.int32, device=dev) if fresh else handle.src_index,
        )

    def head(self, m: int) -> "DispatchOutputs":
        """Views of the first m rows (outputs allocated for R * T rows before the counts were known)."""
        def cut(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if t is None else t[:m]

        return DispatchOutputs(cut(self.x), cut(self.scales), cut(self.topk_idx), cut(self.topk_weights),
                               cut(self.src_rank), cut(self.src_index))


def native_dispatch_result(cfg: "BufferConfig", handle: Optional[DispatchHandle], out: DispatchOutputs, *,
                           num_tokens: int, is_token_in_rank: torch.Tensor, recv_counts: Optional[list[int]],
                           worst_case: bool, state: Any, tokens_per_expert_raw: Optional[list[int]],
                           expert_alignment: int, tokens_per_expert_tensor: torch.Tensor,
                           async_op: bool, check: Callable[[], None]) -> DispatchResult:
    """A native backend's DispatchResult: the kernel's outputs, and a new handle unless cached."""
    new_handle = handle if handle is not None else DispatchHandle(
        buffer_id=cfg.buffer_id, num_tokens=num_tokens, num_recv_rows=out.src_rank.shape[0],
        is_token_in_rank=is_token_in_rank, recv_counts=recv_counts, src_rank=out.src_rank, src_index=out.src_index,
        worst_case=worst_case, state=state,
    )
    return DispatchResult(
        x=out.x, x_scales=out.scales, topk_idx=out.topk_idx, topk_weights=out.topk_weights,
        tokens_per_expert=None if worst_case else align_up(tokens_per_expert_raw, expert_alignment),
        tokens_per_expert_tensor=tokens_per_expert_tensor, src_rank=out.src_rank, src_index=out.src_index,
        handle=new_handle, event=record_event(async_op, cfg.device, check),
    )


@dataclass(frozen=True)
class BufferConfig:
    """The fixed dimensions of one Buffer, shared by all ranks of its group."""

    group: dist.ProcessGroup
    rank: int
    world_size: int
    hidden: int
    num_experts: int
    num_topk: int
    max_tokens_per_rank: int
    low_latency: bool
    num_sms: int
    timeout_s: float
    buffer_id: int
    device: torch.device
    ranks_per_node: int  # ranks of one NVLink domain ("node"); nodes are contiguous rank ranges
    hierarchical: bool = False  # normal mode on the cross-node kernels (always when num_nodes > 1)
    fault_tolerant: bool = False  # low-latency kernels mask a rank that misses the timeout instead of failing
    ranks_per_gpu: int = 1  # the most ranks of the group sharing one GPU (0 on CPU; above 1: gloo, time-sliced)
    config: Optional[Config] = None  # the Buffer's kernel knobs, num_sms resolved (moe_ep.Config)

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def node(self) -> int:
        """This rank's node."""
        return self.rank // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        """This rank's index inside its node."""
        return self.rank % self.ranks_per_node

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.world_size

    @property
    def num_scales(self) -> int:
        """FP8 scales per row: one per 128 channels."""
        return self.hidden // 128


class Backend(abc.ABC):
    """Moves already-validated tensors; nothing below Buffer re-checks its inputs. Every call runs on
    the current stream: the Buffer picks it and orders it after previous_event (moe_ep.comm.streams)."""

    name: str = "?"
    checks_expert_ids = False  # its kernels check every expert id (no host sync; the call raises ValueError)

    def __init__(self, cfg: BufferConfig) -> None:
        self.cfg = cfg

    @property
    def normal_path(self) -> str:
        """Which kernels serve normal mode: "reference", "nvlink" (one node) or "cross-node"."""
        return self.name

    def fill_workspace(self, value: int) -> None:
        """Local: sets every byte of this rank's normal-mode symmetric workspace (signal words excepted)
        to `value`; a testing aid, so data a call fails to write cannot pass for results. None here."""

    def abort(self) -> None:
        """Local: gives the Buffer up after a peer went silent, releasing nothing that waits for peers."""

    def rank_mask(self) -> torch.Tensor:
        """Fault-tolerant low-latency mode only: this rank's mask, int32 [R] on the Buffer's device, 1 per
        rank its low-latency calls skip (neither send to nor wait for). Live: writes to it take effect
        from the next call on the stream (Buffer.set_rank_masked); native kernels also set it on a timeout."""
        raise NotImplementedError(f"the {self.name} backend keeps no rank mask")

    @abc.abstractmethod
    def get_dispatch_layout(self, topk_idx: torch.Tensor) -> DispatchLayout: ...

    @abc.abstractmethod
    def dispatch(
        self,
        x: torch.Tensor,
        x_scales: Optional[torch.Tensor],
        topk_idx: Optional[torch.Tensor],
        topk_weights: Optional[torch.Tensor],
        *,
        handle: Optional[DispatchHandle],
        expert_alignment: int,
        worst_case: bool,
        expert_major: bool,
        num_sms: int,
        knobs: Config,
        async_op: bool,
        stamp: CallStamp,
    ) -> DispatchResult:
        """Normal-mode dispatch. With `handle`, reuse its layout (cached dispatch: topk_* are None
        and the result's topk_idx/topk_weights are None). `knobs`: the call's kernel knobs (speed only).
        expert_major: the received rows as pairs (moe_ep.comm.expert_major.expand, after the exchange).
        `stamp`: what the call's exchange carries where the backend checks it (call_check.verify raises)."""

    @abc.abstractmethod
    def combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        *,
        topk_weights: Optional[torch.Tensor],
        pair_weights: Optional[torch.Tensor],
        num_sms: int,
        knobs: Config,
        async_op: bool,
        stamp: CallStamp,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[EventHandle]]:
        """Normal-mode combine: (rows [N, H], the combined topk_weights [N, K] or None without them, event).
        An expert-major handle's pairs are first summed per row (moe_ep.comm.expert_major.combine_inputs)."""

    @abc.abstractmethod
    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        *,
        use_fp8: bool,
        round_scale: bool,
        use_ue8m0: bool,
        use_nvfp4: bool,
        x_global_scale: Optional[torch.Tensor],
        return_recv_hook: bool,
        async_op: bool,
        stamp: CallStamp,
    ) -> LowLatencyDispatchResult:
        """Expert-major rows [E_l, R*T, H]; FP8 scales [E_l, R*T, H/128] float32 (or with use_ue8m0
        [E_l, R*T, H/512] int32, moe_ep.comm.fp8.pack_ue8m0), both stored token-major per expert
        (moe_ep.comm.fp8.expert_major_scales: DeepEP's layout). use_nvfp4: each rank's rows cast with its
        x_global_scale (its first element, read on the device), in moe_ep.comm.nvfp4.NvFp4Layout's views."""

    @abc.abstractmethod
    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle,
        *,
        return_recv_hook: bool,
        async_op: bool,
        overlap: Optional[LowLatencyOverlap],
        stamp: CallStamp,
    ) -> LowLatencyCombineResult:
        """Weighted sum of each token's expert outputs in ascending k. `overlap`: rows of x are read only
        once their comp_signal words reached the threshold (types.LowLatencyOverlap); same result."""

    def synchronize(self) -> None:
        """Waits for the current stream's work and raises what this Buffer's kernels recorded (a backend
        whose calls raise everything themselves has nothing more to raise)."""
        if self.cfg.device.type == "cuda":
            torch.cuda.current_stream(self.cfg.device).synchronize()

    def close(self) -> None:
        """Release communication resources (collective: every rank calls it)."""

    def leave(self, timeout_s: float) -> bool:
        """At exit (moe_ep.comm.at_exit): close() with the peers, or, where they do not come within
        timeout_s, give the Buffer up alone (abort); whether it closed with them. close() waits for no
        peer here, so it serves as it is."""
        self.close()
        return True
