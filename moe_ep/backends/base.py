"""The interface every backend implements; `moe_ep.buffer.Buffer` validates, then calls it."""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..types import (
    DispatchHandle,
    DispatchLayout,
    DispatchResult,
    EventHandle,
    LowLatencyCombineResult,
    LowLatencyDispatchResult,
    LowLatencyHandle,
)


def align_up(counts: list[int], alignment: int) -> list[int]:
    """Each count rounded up to a multiple of `alignment` (tokens_per_expert with expert_alignment)."""
    return [-(-c // alignment) * alignment for c in counts]


def record_event(async_op: bool, device: torch.device) -> Optional[EventHandle]:
    """For async_op: an EventHandle recorded on `device`'s current stream (an empty one on CPU)."""
    if not async_op:
        return None
    if device.type != "cuda":
        return EventHandle(None)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return EventHandle(event)


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
    """Moves already-validated tensors; nothing below Buffer re-checks its inputs."""

    name: str = "?"

    def __init__(self, cfg: BufferConfig) -> None:
        self.cfg = cfg

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
        num_sms: int,
        previous_event: Optional[EventHandle],
        async_op: bool,
    ) -> DispatchResult:
        """Normal-mode dispatch. With `handle`, reuse its layout (cached dispatch: topk_* are None
        and the result's topk_idx/topk_weights are None)."""

    @abc.abstractmethod
    def combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        *,
        num_sms: int,
        previous_event: Optional[EventHandle],
        async_op: bool,
    ) -> tuple[torch.Tensor, Optional[EventHandle]]: ...

    @abc.abstractmethod
    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        *,
        use_fp8: bool,
        round_scale: bool,
        return_recv_hook: bool,
    ) -> LowLatencyDispatchResult: ...

    @abc.abstractmethod
    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle,
        *,
        return_recv_hook: bool,
    ) -> LowLatencyCombineResult: ...

    def close(self) -> None:
        """Release communication resources (collective: every rank calls it)."""
