"""Result and handle types shared by every backend (the public contract of docs/api.md)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch


@dataclass(frozen=True)
class DispatchLayout:
    """Where each token goes: counts per rank and per expert, and the token->rank mask."""

    num_tokens_per_rank: torch.Tensor  # [R] int32: tokens (not token-expert pairs) sent to each rank
    num_tokens_per_expert: torch.Tensor  # [E] int32: tokens that selected each expert (once per token)
    is_token_in_rank: torch.Tensor  # [N, R] bool
    event: Optional["EventHandle"] = None  # get_dispatch_layout(async_op=True): recorded on the communication stream


@dataclass(frozen=True)
class ExpertMajorLayout:
    """Where an expert-major dispatch put each (received row, local expert) pair (moe_ep.comm.expert_major).

    Pairs are grouped by local expert in ascending order, each expert's block padded up to a multiple
    of `alignment` with pairs of no row; inside a block, pairs follow the received rows (source rank,
    then source token). A row that names one local expert in several top-k slots has one pair for it.
    In worst-case mode (no host sync) the number of pairs is the static bound worst_case_pairs and
    the pairs after the last expert's block are padding too; the counts are known on the device only.
    """

    rows: torch.Tensor  # [P] int64: the received row of each pair, -1 for alignment padding
    positions: torch.Tensor  # [M, K] int64: the pair of top-k slot (m, k), -1 where topk_idx[m, k] is -1
    slots: torch.Tensor  # [M, K] int64: positions with each pair at its first slot only (-1 elsewhere)
    counts: Optional[list[int]]  # [E_l] pairs per local expert, padding included; None in worst-case mode
    counts_tensor: torch.Tensor  # [E_l] int32 on the device, the same values (the only ones in worst-case mode)
    alignment: int  # the dispatch's expert_alignment

    @property
    def num_pairs(self) -> int:
        return self.rows.shape[0]


@dataclass
class DispatchHandle:
    """What combine (and a cached dispatch) needs to send rows back the way they came.

    `recv_counts` is None in worst-case mode (no host sync); there, source s's rows sit at
    [s * max_tokens_per_rank, s * max_tokens_per_rank + count) and the rest are padding.
    """

    buffer_id: int
    num_tokens: int  # N on this rank
    num_recv_rows: int  # rows of the dispatch output (R * max_tokens_per_rank in worst-case mode)
    is_token_in_rank: torch.Tensor  # [N, R] bool
    recv_counts: Optional[list[int]]  # rows received from each rank
    src_rank: torch.Tensor  # [M] int32, -1 for padding rows
    src_index: torch.Tensor  # [M] int32, -1 for padding rows
    worst_case: bool = False
    state: Any = None  # backend-private
    expert_major: Optional[ExpertMajorLayout] = None  # set by an expert-major dispatch: combine takes pairs
    call: int = 0  # the number of the Buffer call that made it (Buffer sets it; moe_ep.comm.call_check)


@dataclass
class DispatchResult:
    """Rows received by this rank, ordered by source rank then source token index; with
    expert_major=True, x and x_scales hold (row, local expert) pairs grouped by expert instead
    (handle.expert_major says where each pair came from), and the other fields still describe rows."""

    x: torch.Tensor  # [M, H] bf16, or e4m3 for FP8 dispatch; [P, H] pairs when expert-major
    x_scales: Optional[torch.Tensor]  # [M, H / 128] float32 for FP8 dispatch ([P, H / 128] when expert-major)
    topk_idx: Optional[torch.Tensor]  # [M, K] int64 local expert ids, -1 where the expert is elsewhere
    topk_weights: Optional[torch.Tensor]  # [M, K] float32, 0 where topk_idx is -1
    tokens_per_expert: Optional[list[int]]  # [E_l], aligned up to expert_alignment; None in worst-case mode
    tokens_per_expert_tensor: torch.Tensor  # [E_l] int32 on x's device, same values
    src_rank: torch.Tensor  # [M] int32
    src_index: torch.Tensor  # [M] int32
    handle: DispatchHandle
    event: Optional["EventHandle"] = None
    pair_weights: Optional[torch.Tensor] = None  # [P] float32 router weight of each pair (fresh expert-major dispatch)


@dataclass
class LowLatencyHandle:
    """Where each low-latency row came from, for low_latency_combine."""

    buffer_id: int
    num_tokens: int
    src_rank: torch.Tensor  # [E_l, R * T] int32 (valid below count[e])
    src_index: torch.Tensor  # [E_l, R * T] int32
    count: torch.Tensor  # [E_l] int32
    state: Any = None  # backend-private
    topk_idx: Optional[torch.Tensor] = None  # [num_tokens, K], as the dispatch exchanged it (Buffer sets it)
    call: int = 0  # the number of the Buffer call that made it (Buffer sets it; moe_ep.comm.call_check)


@dataclass
class LowLatencyDispatchResult:
    """Expert-major receive buffers: local expert e holds count[e] rows, by source rank then index."""

    # [E_l, R * T, H] bf16 or e4m3; use_nvfp4: [R * T, H / 2, E_l] uint8, the view of [E_l, R * T, H / 2]
    # storage (moe_ep.comm.nvfp4.NvFp4Layout)
    x: torch.Tensor
    # [E_l, R * T, H / 128] float32 when use_fp8 ([E_l, R * T, H / 512] int32 with use_ue8m0); use_nvfp4:
    # (32, 4, rm, 4, rk, E_l) float8_e4m3fn, the view of (E_l, rm, rk, 32, 4, 4) storage
    x_scales: Optional[torch.Tensor]
    count: torch.Tensor  # [E_l] int32 on device
    handle: LowLatencyHandle
    hook: Optional[Callable[[], None]] = None
    event: Optional["EventHandle"] = None  # async_op=True: recorded on the communication stream


@dataclass(frozen=True)
class LowLatencyOverlap:
    """Buffer.low_latency_combine(overlap=True)'s arguments past validation (SGLang's single-batch overlap):
    the combine reads rows [j * block_m, (j + 1) * block_m) of local expert e only once the GEMM writing
    x beside it has brought comp_signal[e * ceil(R*T / block_m) + j] to threshold, and runs on at most
    num_sms SMs (the GEMM is persistent on the others)."""

    comp_signal: torch.Tensor  # int32, at least E_l * signal_blocks words
    block_m: int
    threshold: int
    num_sms: int
    signal_blocks: int  # words per local expert: ceil(R*T / block_m)


@dataclass
class LowLatencyCombineResult:
    """Combined [N, H] bf16 rows; with return_recv_hook, valid only after hook() ran."""

    x: torch.Tensor
    hook: Optional[Callable[[], None]] = None
    event: Optional["EventHandle"] = None  # async_op=True: recorded on the communication stream


@dataclass
class EventHandle:
    """A CUDA event recorded on the stream that did the work; wait() orders the current stream.
    synchronize() waits for the work and then raises what its kernels recorded (CommTimeoutError for
    a peer that went silent, ValueError for an expert id out of range)."""

    event: Optional[torch.cuda.Event] = field(default=None)
    check: Optional[Callable[[], None]] = field(default=None, repr=False)

    def wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def synchronize(self) -> None:
        if self.event is not None:
            self.event.synchronize()
        if self.check is not None:
            self.check()
