"""The engine interface the native backend delegates to, and the one normal-mode dispatch flow.

`NvshmemBackend` (backends/nvshmem.py) picks a normal-mode engine — `IntranodeEngine` (NVLink loads
and stores, one node: backends/intranode.py) or `InternodeEngine` (NVSHMEM puts across nodes, NVLink
forwarding inside each: backends/internode.py) — and, for low_latency Buffers, a `LowLatencyEngine`
(backends/low_latency.py). Every engine owns its kernels' context and symmetric memory and says how
much heap it needs before the session is made.

A normal dispatch, on either engine (`normal_dispatch`):
  1. notify (unless cached): the engine's layout and count-exchange kernels, the count rows carrying
     the call's stamp (moe_ep.comm.call_check); the handle state and the aligned tokens per local
     expert stay on the device;
  2. outputs: R * T rows in worst-case mode, or outside it when R * T rows fit Config.eager_output_bytes
     (the dispatch kernel then starts before the host knows the counts; results are views of the
     first M rows), else the host waits for the counts and allocates exactly M rows;
  3. the dispatch kernel (it reads the counts on the device);
  4. outside worst-case mode, the host waits for the counts (if it has not yet) and trims; with the
     counts come every rank's stamps;
  5. the call's checks, once every kernel of the call is launched, so a rank that raises made the
     same launches as its peers (a rank may wait for the counts where its peers do not): the stamps
     (call_check.verify raises on every rank alike when the ranks made different calls or one
     rejected its input), then the error record.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, Optional

import torch

from ..call_check import STAMP_WORDS, CallStamp, OwnRejection, verify
from ..config import Config
from ..types import DispatchHandle, DispatchLayout, DispatchResult, ExpertMajorLayout
from .base import BufferConfig, DispatchOutputs, align_up_device, native_dispatch_result

class Engine(abc.ABC):
    """One kernel family of a native Buffer: its context, symmetric memory and lifetime."""

    cfg: BufferConfig

    @staticmethod
    @abc.abstractmethod
    def heap_bytes(cfg: BufferConfig) -> int:
        """Symmetric heap bytes the engine allocates for `cfg` (asked before the session is made)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Frees what the engine holds outside the symmetric heap (the heap goes with the session)."""


@dataclasses.dataclass(frozen=True)
class Notified:
    """What a normal engine's notify launched: the routing and the handle state, on the device."""

    is_token_in_rank: torch.Tensor  # [N, R] bool
    state: Any  # the engine's handle state (a frozen dataclass with a tokens_per_expert field, None so far)
    tokens_per_expert: torch.Tensor  # [E_l] int32, aligned to expert_alignment


class NormalEngine(Engine):
    """A normal-mode engine (one node or across nodes): the steps `normal_dispatch` runs, and combine."""

    path: str  # which kernels: "nvlink" or "cross-node"
    # Set by engines whose dispatch can leave its rows in the workspace (rows_in_workspace): result,
    # layout -> (x [P, H], scales [P, H / 128] or None), the layout's pairs copied from there, launched
    # on the current stream, which must be the dispatch's, before any other call of this Buffer.
    expand_pairs: Optional[Callable[[DispatchResult, ExpertMajorLayout],
                                    tuple[torch.Tensor, Optional[torch.Tensor]]]] = None
    _ctx: Any  # the native context (moe_ep.comm._C IntranodeContext / InternodeContext): launches, count mailbox

    def close(self) -> None:
        """Frees the context's host-mapped count mailbox (the symmetric memory goes with the session)."""
        self._ctx.close()

    @abc.abstractmethod
    def layout(self, topk_idx: torch.Tensor, stream: torch.cuda.Stream) -> DispatchLayout:
        """get_dispatch_layout on the device (no host sync)."""

    @abc.abstractmethod
    def notify(self, topk_idx: torch.Tensor, expert_alignment: int, worst_case: bool,
               stream: torch.cuda.Stream, stamp: list[int]) -> Notified:
        """Launch the layout and the count exchange of a fresh dispatch; the count rows carry `stamp`."""

    @abc.abstractmethod
    def raw_expert_counts(self, state: Any) -> torch.Tensor:
        """A handle state's received rows per local expert on the device ([E_l] int32, not aligned)."""

    @abc.abstractmethod
    def launch_dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], topk_idx: Optional[torch.Tensor],
                        topk_weights: Optional[torch.Tensor], state: Any, out: DispatchOutputs, *, cached: bool,
                        worst_case: bool, num_sms: int, knobs: Config, stream: torch.cuda.Stream) -> None:
        """Launch the dispatch kernel into `out` (rows no source fills, in worst-case mode, are zero)."""

    def host_counts(self) -> tuple[list[int], list[int]]:
        """(rows from each source, raw rows per local expert) of the last notify, once it has run."""
        return self._ctx.host_info()

    def host_stamps(self) -> list[list[int]]:
        """Every rank's stamp words as the last notify outside worst-case mode received them, once it has run."""
        words = self._ctx.host_stamps()
        return [words[s * STAMP_WORDS:(s + 1) * STAMP_WORDS] for s in range(self.cfg.world_size)]

    @abc.abstractmethod
    def combine(self, x: torch.Tensor, handle: DispatchHandle, out: torch.Tensor,
                topk_weights: Optional[torch.Tensor], out_topk_weights: Optional[torch.Tensor], *, num_sms: int,
                knobs: Config, stream: torch.cuda.Stream) -> None:
        """Launch the combine kernel: rows (and topk_weights, when given) back, summed into out."""

    @abc.abstractmethod
    def fill_workspace(self, value: int) -> None:
        """Sets every byte of the engine's symmetric data areas (not its signal words) to `value`."""


def normal_dispatch(engine: NormalEngine, x: torch.Tensor, x_scales: Optional[torch.Tensor],
                    topk_idx: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor], *,
                    handle: Optional[DispatchHandle], expert_alignment: int, worst_case: bool, num_sms: int,
                    knobs: Config, stream: torch.cuda.Stream, async_op: bool,
                    check: Callable[..., None], stamp: CallStamp, rows_in_workspace: bool = False) -> DispatchResult:
    """The normal-mode dispatch flow of every normal engine (this module's docstring says the steps).
    `check` is the Buffer's ErrorWatch.check; `stamp` the call's (compared where the host waits for
    the counts). rows_in_workspace (engines with expand_pairs): the kernel leaves the rows in the
    workspace and the result's x is None, for expand_pairs."""
    cfg = engine.cfg
    r, t = cfg.world_size, cfg.max_tokens_per_rank
    cached = handle is not None
    counts_ready: Optional[torch.cuda.Event] = None  # recorded after notify, outside worst-case mode
    recv_counts: Optional[list[int]] = None
    stamps: Optional[list[list[int]]] = None  # every rank's, once the host has the counts
    if cached:
        state, worst_case, recv_counts = handle.state, handle.worst_case, handle.recv_counts
        in_rank = handle.is_token_in_rank
        tokens_per_expert = align_up_device(engine.raw_expert_counts(state), expert_alignment)
    else:
        notified = engine.notify(topk_idx, expert_alignment, worst_case, stream, stamp.words)
        in_rank, state, tokens_per_expert = notified.is_token_in_rank, notified.state, notified.tokens_per_expert
        if not worst_case:
            counts_ready = torch.cuda.Event()
            counts_ready.record(stream)
    row_bytes = cfg.hidden * x.element_size() + 16 * cfg.num_topk
    eager = counts_ready is not None and r * t * row_bytes <= knobs.eager_output_bytes

    def wait_counts() -> list[int]:
        """Rows from each source; the handle state learns the raw rows per local expert."""
        nonlocal state, stamps
        counts_ready.synchronize()
        check(timeouts_only=True)  # a bad id is raised once every kernel of the call is launched
        from_source, raw = engine.host_counts()
        state = dataclasses.replace(state, tokens_per_expert=raw)
        stamps = engine.host_stamps()
        return from_source

    if counts_ready is not None and not eager:
        recv_counts = wait_counts()
    m = r * t if worst_case or eager else sum(recv_counts)
    out = DispatchOutputs.allocate(cfg, m, x.dtype, handle, rows=not rows_in_workspace)
    engine.launch_dispatch(x, x_scales, topk_idx, topk_weights, state, out, cached=cached, worst_case=worst_case,
                           num_sms=num_sms, knobs=knobs, stream=stream)
    if eager:
        recv_counts = wait_counts()
        out = out.head(sum(recv_counts))
    if stamps is not None:  # every kernel of the call is launched: raising keeps the ranks in step
        try:
            verify(stamp, stamps)
        except OwnRejection:
            check()  # a bad id the kernels found raises here, naming it
            raise
    check()
    return native_dispatch_result(
        cfg, handle, out, num_tokens=x.shape[0], is_token_in_rank=in_rank, recv_counts=recv_counts,
        worst_case=worst_case, state=state, tokens_per_expert_raw=state.tokens_per_expert,
        expert_alignment=expert_alignment, tokens_per_expert_tensor=tokens_per_expert, async_op=async_op, check=check)
