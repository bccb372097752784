"""DeepEP V1's public Python API on top of `moe_ep.Buffer`, so code written for DeepEP switches with
one import: `import moe_ep.deep_ep as deep_ep`. Every difference is listed in docs/deep_ep_compat.md.

The DeepEP constructor gives byte budgets, not shapes, so this module creates its moe_ep Buffers
lazily from the calls' shapes and caches them: one normal-mode Buffer per (hidden, num_experts) and
one low-latency Buffer per (hidden, num_experts, num_topk, num_max_dispatch_tokens_per_rank). Both
keys are equal on every rank (DeepEP requires that too), so the collective creation stays in step.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, TypeVar, Union

import torch
import torch.distributed as dist

import moe_ep
from moe_ep.comm import _native
from moe_ep.comm.backends.base import align_up, record_event
from moe_ep.comm.config import DEEP_EP_HINT_TOKENS_PER_RANK, DEEP_EP_NORMAL_TOPK, DEFAULT_NUM_SMS, DEFAULT_TIMEOUT_S
from moe_ep.comm.streams import CommStream, tensors_in
from moe_ep.comm.fp8 import BLOCK as FP8_BLOCK
from moe_ep.deep_ep.factory import BufferFactory

topk_idx_t = torch.int64

# Normal mode: about this many bytes per received row and source rank (bf16 row, FP8 scales, top-k
# ids and weights padded to DEEP_EP_NORMAL_TOPK, source index, flag) turn num_nvl_bytes into max_tokens_per_rank.
_ROW_META_BYTES = 12 * DEEP_EP_NORMAL_TOPK + 16

XType = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


def _row_bytes(hidden: int) -> int:
    return 2 * hidden + 4 * (hidden // FP8_BLOCK) + _ROW_META_BYTES


# Why multi-node NVLink is refused.
_MNNVL = ("moe_ep has no multi-node NVLink (MNNVL) path: its NVLink domain is the ranks of one host, and ranks on "
          "other hosts are reached through NVSHMEM's network transport")


def _unsupported(option: str, why: str) -> NotImplementedError:
    return NotImplementedError(f"moe_ep.deep_ep does not support {option}: {why} (docs/deep_ep_compat.md)")


@dataclass
class Config:
    """DeepEP's tuning config. moe_ep uses `num_sms` only (default: moe_ep's one SM default,
    moe_ep.comm.config); the chunk sizes are kept so code that sets them still runs."""

    num_sms: int = DEFAULT_NUM_SMS
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """A default num_nvl_bytes: rounds of DEEP_EP_HINT_TOKENS_PER_RANK tokens per rank (bf16 rows); calls
        with more tokens stream through it (not a token limit)."""
        return num_ranks * DEEP_EP_HINT_TOKENS_PER_RANK * _row_bytes(hidden_bytes // 2)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """0: moe_ep sizes its cross-node workspace itself (docs/design.md, at most 2 GiB)."""
        return 0


class EventHandle(moe_ep.EventHandle):
    """DeepEP's EventHandle: `EventHandle()` records an event on the current CUDA stream (an empty
    one without CUDA), as Megatron-Core's `EventOverlap(EventHandle())` expects."""

    def __init__(self) -> None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        super().__init__(record_event(True, device).event)

    def current_stream_wait(self) -> None:
        """The current stream waits for the event."""
        self.wait()


@dataclass
class EventOverlap:
    """DeepEP's event wrapper around a `moe_ep.EventHandle` (None when the call was not async_finish)."""

    event: Optional[moe_ep.EventHandle] = None
    extra_tensors: Optional[tuple[torch.Tensor, ...]] = None  # DeepEP's stream-lifetime hint; moe_ep needs none
    hooks: list[Callable[[], None]] = field(default_factory=list)

    def current_stream_wait(self, release_handle: bool = False) -> None:
        """Make the current stream wait for the event (there must be one: async_finish=True, or V2's
        async_with_compute_stream=True), then run the hooks registered after it. release_handle
        (DeepEP V2's) has nothing to release here: moe_ep keeps no tensors alive through events."""
        if self.event is None:
            raise RuntimeError("this EventOverlap holds no event: pass async_finish=True (V2: "
                               "async_with_compute_stream=True) to get one")
        self.event.wait()
        for hook in self.hooks:
            hook()

    def register_hook_after_wait(self, hook: Callable[[], None]) -> None:
        """DeepEP V2: run `hook` after current_stream_wait."""
        self.hooks.append(hook)

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.event is not None:
            self.event.wait()


class DispatchHandle(tuple):
    """DeepEP's intranode handle tuple (rank_prefix_matrix, channel_prefix_matrix,
    recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head); moe_ep has no channels,
    so positions 1, 2 and 5 are None. The moe_ep Buffer and handle it stands for ride along."""

    buffer: moe_ep.Buffer
    inner: moe_ep.DispatchHandle
    rows: Optional[torch.Tensor]  # num_worst_tokens: which moe_ep row fills each output row, else None

    def __new__(cls, fields: tuple, buffer: moe_ep.Buffer, inner: moe_ep.DispatchHandle,
                rows: Optional[torch.Tensor]) -> "DispatchHandle":
        self = super().__new__(cls, fields)
        self.buffer, self.inner, self.rows = buffer, inner, rows
        return self


class LowLatencyHandle(tuple):
    """DeepEP's low-latency handle tuple (src_info, layout_range, num_max_dispatch_tokens_per_rank,
    hidden, num_experts), carrying the moe_ep Buffer and handle it stands for."""

    buffer: moe_ep.Buffer
    inner: moe_ep.LowLatencyHandle

    def __new__(cls, fields: tuple, buffer: moe_ep.Buffer, inner: moe_ep.LowLatencyHandle) -> "LowLatencyHandle":
        self = super().__new__(cls, fields)
        self.buffer, self.inner = buffer, inner
        return self


_Method = TypeVar("_Method", bound=Callable[..., Any])


def _on_comm_stream(method: _Method) -> _Method:
    """DeepEP's stream rule for a Buffer method with previous_event / async_finish (moe_ep.comm.streams):
    with async_finish the whole call (every moe_ep call, gather and collective in it) runs on the
    Buffer's communication stream after previous_event (else after the current stream), and its
    EventOverlap is recorded there; without it the call runs on the current stream after
    previous_event. allocate_on_comm_stream needs no action: outputs are made on the communication
    stream and kept alive for the caller's stream too, which covers both of its values."""
    signature = inspect.signature(method)

    @functools.wraps(method)
    def call(self: "Buffer", *args: Any, **kwargs: Any) -> Any:
        given = signature.bind(self, *args, **kwargs).arguments
        async_finish = bool(given.get("async_finish", False))
        if async_finish and given.get("return_recv_hook", False):
            raise ValueError("async_finish=True and return_recv_hook=True exclude each other (as in DeepEP)")
        previous: Optional[EventOverlap] = given.get("previous_event")
        inputs = tuple(v for k, v in given.items() if k != "self")
        device = next((t.device for t in tensors_in(inputs) if t.is_cuda), torch.device("cpu"))
        result = self._comm_stream(device).run(
            lambda: method(self, *args, **kwargs), previous_event=None if previous is None else previous.event,
            async_op=async_finish, inputs=(inputs, *_handle_parts(inputs)))
        if async_finish and device.type == "cuda":
            keep = torch.cuda.current_stream(device)
            for t in tensors_in(_handle_parts(result)):
                t.record_stream(keep)
        return result

    return call  # type: ignore[return-value]


def _handle_parts(values: tuple) -> list[Any]:
    """The moe_ep handles (and row maps) that the drop-in's handle tuples carry beside their fields."""
    return [(v.inner, getattr(v, "rows", None)) for v in values if isinstance(v, (DispatchHandle, LowLatencyHandle))]


def _gather_rows(t: Optional[torch.Tensor], rows: torch.Tensor, num_rows: int, fill: float) -> Optional[torch.Tensor]:
    """t's rows at `rows` (the valid ones first), then `fill` up to num_rows rows (num_worst_tokens)."""
    if t is None:
        return None
    raw = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
    out = raw.new_full((num_rows, *t.shape[1:]), fill)
    take = min(num_rows, rows.numel())
    out[:take] = raw[rows[:take]]
    return out.view(t.dtype)


def _scatter_rows(t: torch.Tensor, rows: torch.Tensor, num_inner: int) -> torch.Tensor:
    """Inverse of _gather_rows: a [num_worst_tokens, ...] tensor back into moe_ep's R * T rows."""
    out = t.new_zeros((num_inner, *t.shape[1:]))
    take = min(t.shape[0], rows.numel())
    out[rows[:take]] = t[:take]
    return out


def add_bias(out: torch.Tensor, bias: Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor], None]) -> torch.Tensor:
    """A combine's bf16 rows plus DeepEP's `bias` (one tensor or two), added in float32, rounded once more."""
    biases = bias if isinstance(bias, tuple) else (bias,) if bias is not None else ()
    if not biases:
        return out
    acc = out.float()
    for b in biases:
        acc = acc + b.float()
    return acc.to(torch.bfloat16)


def _chain(first: Callable[[], None], then: Callable[[], None]) -> Callable[[], None]:
    """A receive hook that runs moe_ep's hook, then this module's follow-up on the received data."""
    def hook() -> None:
        first()
        then()

    return hook


def _layout_range(src_rank: torch.Tensor, count: torch.Tensor, world: int) -> torch.Tensor:
    """[E_l, R] int64, (first row << 32) | rows, per local expert and source rank (rows are
    ordered by source rank). Device ops only: no host sync."""
    slots = torch.arange(src_rank.shape[1], device=src_rank.device)
    src = torch.where(slots < count.unsqueeze(1), src_rank.long(), world)
    per = torch.zeros(src.shape[0], world + 1, dtype=torch.int64, device=src.device)
    per.scatter_add_(1, src, torch.ones_like(src))
    per = per[:, :world]
    return ((per.cumsum(1) - per) << 32) | per


class Buffer:
    """DeepEP's `deep_ep.Buffer` (V1) served by moe_ep. Creating it is collective over `group`.

    Keyword-only extensions (not in DeepEP): `backend` (moe_ep's), `max_tokens_per_rank` (normal
    mode's round of tokens per rank, streamed for larger calls; default: what fits in num_nvl_bytes),
    `ranks_per_node` and `timeout_s` (moe_ep's: how long a call waits for a peer; with enable_shrink a
    low-latency call then masks it)."""

    num_sms: int = DEFAULT_NUM_SMS  # the SMs of the default configs (moe_ep.comm.config: one default per mode)

    def __init__(self, group: Optional[dist.ProcessGroup], num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False, use_fabric: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False, comm: Optional[Any] = None, *,
                 backend: str = "auto", max_tokens_per_rank: Optional[int] = None,
                 ranks_per_node: Optional[int] = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if comm is not None:
            raise _unsupported("comm (an mpi4py communicator)", "pass a torch.distributed process group")
        if not allow_nvlink_for_low_latency_mode:
            raise _unsupported("allow_nvlink_for_low_latency_mode=False",
                               "the low-latency kernels use NVLink inside a node")
        if allow_mnnvl:
            raise _unsupported("allow_mnnvl=True", _MNNVL)
        if use_fabric:
            raise _unsupported("use_fabric=True", "fabric memory handles serve multi-node NVLink; " + _MNNVL +
                               ", and its buffers come from NVSHMEM's symmetric heap")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.group_size = dist.get_world_size(self.group)
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.explicitly_destroy = low_latency_mode, explicitly_destroy
        self.enable_shrink = enable_shrink  # low-latency Buffers are fault-tolerant: the mask API below
        self._masked: set[int] = set()  # ranks masked by low_latency_update_mask_buffer (for Buffers made later)
        self._max_tokens, self._timeout_s = max_tokens_per_rank, timeout_s
        self._factory = BufferFactory(self.group, backend, ranks_per_node)
        self._normal: dict[tuple[int, int], moe_ep.Buffer] = {}
        self._low_latency: dict[tuple[int, int, int, int], moe_ep.Buffer] = {}
        self._zero_copy: dict[moe_ep.Buffer, torch.Tensor] = {}
        self._raw: dict[tuple[bool, torch.device], torch.Tensor] = {}  # get_local_buffer_tensor's memory
        self._comm: dict[torch.device, CommStream] = {}

    @property
    def moe_ep_buffers(self) -> list[moe_ep.Buffer]:
        """The moe_ep Buffers this Buffer made so far (one per shape it was called with; moe_ep's own API)."""
        return [*self._normal.values(), *self._low_latency.values()]

    # ---- static helpers -------------------------------------------------------------------
    @staticmethod
    def is_sm90_compiled() -> bool:
        """True: moe_ep's FP8 paths work on every backend (DeepEP's tests gate FP8 on this)."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """SMs of the normal-mode kernels in the default configs (even, as DeepEP requires)."""
        if not isinstance(new_num_sms, int) or new_num_sms <= 0 or new_num_sms % 2:
            raise ValueError(f"the SM count must be a positive even int, got {new_num_sms!r}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event recorded on the current stream (an empty one without CUDA)."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """moe_ep's low-latency symmetric region for these shapes at top-k 16 on one node (an upper bound
        there; its owner: csrc/kernels/low_latency/low_latency.h region_layout), or, without moe_ep.comm._C, its two
        staging sets: a payload and a meta row per (source, slot), a bf16 row per (slot, top-k)."""
        t = num_max_dispatch_tokens_per_rank
        if _native.available()[0]:
            return _native.load().ll_region_layout(num_ranks, t, hidden, DEEP_EP_NORMAL_TOPK, 0)["total"]
        return (2 * num_ranks * t * (2 * hidden + _native.constant("LL_META_BYTES"))
                + 4 * t * DEEP_EP_NORMAL_TOPK * hidden)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """Config(Buffer.num_sms): moe_ep tunes nothing else per rank count."""
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """Config(Buffer.num_sms), as for dispatch."""
        return Config(Buffer.num_sms)

    # ---- buffers --------------------------------------------------------------------------
    def _new_buffer(self, x: torch.Tensor, num_experts: int, num_topk: int, max_tokens: int,
                    low_latency: bool) -> moe_ep.Buffer:
        return self._factory.create(x, num_experts, num_topk, max_tokens, low_latency, timeout_s=self._timeout_s,
                                    fault_tolerant=low_latency and self.enable_shrink)

    def _normal_buffer(self, x: torch.Tensor, num_experts: int) -> moe_ep.Buffer:
        """The normal-mode Buffer for x's hidden size and device (top-k padded to 16), created on first use."""
        hidden = x.shape[1]
        key = (hidden, num_experts)
        if key not in self._normal:
            t = self._max_tokens
            if t is None:
                t = self.num_nvl_bytes // (self.group_size * _row_bytes(hidden))
                if t <= 0:
                    raise ValueError(f"num_nvl_bytes={self.num_nvl_bytes} leaves no room for a token of hidden {hidden}"
                                     f" (about {self.group_size * _row_bytes(hidden)} bytes per token): raise it or "
                                     "pass max_tokens_per_rank")
            self._normal[key] = self._new_buffer(x, num_experts, DEEP_EP_NORMAL_TOPK, t, low_latency=False)
        return self._normal[key]

    def _low_latency_buffer(self, x: torch.Tensor, num_experts: int, num_topk: int, max_tokens: int) -> moe_ep.Buffer:
        if not self.low_latency_mode:
            raise ValueError("low-latency calls need a Buffer created with low_latency_mode=True")
        key = (x.shape[1], num_experts, num_topk, max_tokens)
        if key not in self._low_latency:
            buf = self._new_buffer(x, num_experts, num_topk, max_tokens, low_latency=True)
            for rank in self._masked:
                buf.set_rank_masked(rank)
            self._low_latency[key] = buf
        return self._low_latency[key]

    @staticmethod
    def _finish(async_finish: bool) -> EventOverlap:
        """The call's event: recorded after all of its work on the current stream (the communication
        stream, under _on_comm_stream) when async_finish."""
        return EventOverlap(EventHandle() if async_finish else None)

    def get_comm_stream(self) -> torch.cuda.Stream:
        """The communication stream async calls run on (on the current CUDA device)."""
        return self._comm_stream(torch.device("cuda", torch.cuda.current_device())).stream

    def _comm_stream(self, device: torch.device) -> CommStream:
        """This Buffer's communication stream on `device` (DeepEP has one per Buffer; a CPU one runs in order)."""
        if device not in self._comm:
            self._comm[device] = CommStream(device)
        return self._comm[device]

    # ---- normal mode ----------------------------------------------------------------------
    @_on_comm_stream
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False
                            ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, EventOverlap]:
        """(num_tokens_per_rank [R], num_tokens_per_rdma_rank [nodes] or None on one node,
        num_tokens_per_expert [E], is_token_in_rank [N, R], event), int32 counts of tokens (a token
        that names a rank or expert twice counts once)."""
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dtype != topk_idx_t or topk_idx.dim() != 2:
            raise TypeError("topk_idx must be a 2-D torch.int64 tensor (deep_ep.topk_idx_t)")
        if num_experts <= 0 or num_experts % self.group_size:
            raise ValueError(f"num_experts ({num_experts}) must be a positive multiple of the group size")
        r, e_l = self.group_size, num_experts // self.group_size
        hit = torch.zeros(topk_idx.shape[0], num_experts + 1, dtype=torch.bool, device=topk_idx.device)
        hit.scatter_(1, torch.where(topk_idx >= 0, topk_idx, num_experts), True)
        per_expert = hit[:, :num_experts]
        in_rank = per_expert.reshape(-1, r, e_l).any(dim=2)
        per_node = None
        nodes = self._factory.num_nodes
        if nodes > 1:
            per_node = in_rank.view(-1, nodes, self._factory.ranks_per_node).any(dim=2).sum(0, dtype=torch.int32)
        return (in_rank.sum(0, dtype=torch.int32), per_node, per_expert.sum(0, dtype=torch.int32), in_rank,
                self._finish(async_finish))

    def _rank_prefix_matrix(self, buf: moe_ep.Buffer, is_token_in_rank: torch.Tensor) -> torch.Tensor:
        """[R, R] int32: entry [s, j] counts the tokens ranks 0..s sent to rank j (one all_gather)."""
        sent = is_token_in_rank.sum(0, dtype=torch.int32)
        rows = [torch.empty_like(sent) for _ in range(self.group_size)]
        dist.all_gather(rows, sent, group=buf.cfg.group)
        return torch.stack(rows).cumsum(0, dtype=torch.int32)

    @_on_comm_stream
    def dispatch(self, x: XType, handle: Optional[DispatchHandle] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None, num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event).

        recv_x is a tensor, or (e4m3, scales) for a tuple x. With `handle` (cached dispatch) the
        four middle results are None. With num_worst_tokens the outputs have that many rows, the
        received ones first, and the list is empty (no host sync)."""
        x, scales = x if isinstance(x, tuple) else (x, None)
        scales = scales.contiguous() if scales is not None else None  # DeepEP accepts column-major scales
        sms = (config or self.get_dispatch_config(self.group_size)).num_sms
        if handle is not None:
            if not isinstance(handle, DispatchHandle):
                raise TypeError(f"handle must come from moe_ep.deep_ep dispatch, got {type(handle).__name__}")
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("a cached dispatch (handle=...) takes no topk_idx or topk_weights")
            got = handle.buffer.dispatch(x, x_scales=scales, handle=handle.inner, num_sms=sms)
            recv = self._recv_rows(got.x, got.x_scales, handle.rows, handle[3].shape[0])
            return recv, None, None, None, None, self._finish(async_finish)

        if num_tokens_per_rank is None or is_token_in_rank is None or num_tokens_per_expert is None:
            raise ValueError("dispatch needs num_tokens_per_rank, is_token_in_rank and num_tokens_per_expert "
                             "(from get_dispatch_layout), or a handle")
        buf = self._normal_buffer(x, num_tokens_per_expert.shape[0])
        idx, weights = self._routing(buf, is_token_in_rank, topk_idx, topk_weights)
        worst = num_worst_tokens > 0
        got = buf.dispatch(x, idx, weights, x_scales=scales,
                           expert_alignment=expert_alignment if topk_idx is not None else 1,
                           worst_case=worst, num_sms=sms)
        inner = got.handle
        rows = None
        if worst:
            rows = torch.argsort((got.src_rank < 0).to(torch.int8), stable=True)  # received rows first, in order
        recv_topk = recv_weights = None
        if topk_idx is not None:
            k = topk_idx.shape[1]
            recv_topk = got.topk_idx[:, :k]
            recv_weights = got.topk_weights[:, :k]
            if worst:
                recv_topk = _gather_rows(recv_topk, rows, num_worst_tokens, -1)
                recv_weights = _gather_rows(recv_weights, rows, num_worst_tokens, 0.0)
            else:
                recv_topk, recv_weights = recv_topk.contiguous(), recv_weights.contiguous()
        if worst:
            counts: list[int] = []
        elif topk_idx is not None:
            counts = got.tokens_per_expert
        else:  # DeepEP's list comes from num_tokens_per_expert, summed over the source ranks
            total = num_tokens_per_expert.to(torch.int64).clone()
            dist.all_reduce(total, group=buf.cfg.group)
            e_l = buf.num_local_experts
            counts = align_up(total[buf.rank * e_l:(buf.rank + 1) * e_l].tolist(), expert_alignment)
        src_idx = _gather_rows(inner.src_index, rows, num_worst_tokens, -1) if worst else inner.src_index
        prefix = self._rank_prefix_matrix(buf, inner.is_token_in_rank)
        fields = (prefix, None, None, src_idx, inner.is_token_in_rank, None)
        new_handle = DispatchHandle(fields, buf, inner, rows)
        recv = self._recv_rows(got.x, got.x_scales, rows, num_worst_tokens)
        if worst and num_worst_tokens < rows.numel():  # after every collective; on the device: no host sync
            torch._assert_async((got.src_rank >= 0).sum() <= num_worst_tokens,
                                "num_worst_tokens is smaller than the number of received tokens")
        return recv, recv_topk, recv_weights, counts, new_handle, self._finish(async_finish)

    def _routing(self, buf: moe_ep.Buffer, is_token_in_rank: torch.Tensor, topk_idx: Optional[torch.Tensor],
                 topk_weights: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """moe_ep's topk_idx and topk_weights, DEEP_EP_NORMAL_TOPK wide: the caller's padded with -1 and 0, or
        without top-k one stand-in expert per destination rank (its first local expert)."""
        if topk_idx is not None:
            if topk_weights is None:
                raise ValueError("dispatch with topk_idx needs topk_weights")
            k = topk_idx.shape[1]
            if k > DEEP_EP_NORMAL_TOPK:
                raise ValueError(f"topk_idx has {k} columns, at most {DEEP_EP_NORMAL_TOPK} are supported")
            pad = (0, DEEP_EP_NORMAL_TOPK - k)
            return (torch.nn.functional.pad(topk_idx, pad, value=-1),
                    torch.nn.functional.pad(topk_weights, pad, value=0.0))
        r = self.group_size
        if r > DEEP_EP_NORMAL_TOPK:
            raise _unsupported(f"dispatch without topk_idx on {r} ranks",
                               f"it routes by rank, at most {DEEP_EP_NORMAL_TOPK}")
        first = torch.arange(r, device=is_token_in_rank.device) * buf.num_local_experts
        idx = torch.nn.functional.pad(torch.where(is_token_in_rank, first, -1), (0, DEEP_EP_NORMAL_TOPK - r), value=-1)
        return idx, torch.zeros(idx.shape, dtype=torch.float32, device=idx.device)

    @staticmethod
    def _recv_rows(x: torch.Tensor, scales: Optional[torch.Tensor], rows: Optional[torch.Tensor],
                   num_rows: int) -> XType:
        """DeepEP's recv_x: moe_ep's rows (compacted to num_rows for num_worst_tokens), a tuple for FP8."""
        if rows is not None:
            x, scales = _gather_rows(x, rows, num_rows, 0), _gather_rows(scales, rows, num_rows, 0.0)
        return (x, scales) if scales is not None else x

    @_on_comm_stream
    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor], None] = None,
                config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False
                ) -> tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """(combined_x, combined_topk_weights, event): each token's rows, and topk_weights rows with
        them, summed back on its source rank by one moe_ep combine (fixed-order float32 sums,
        docs/api.md), then `bias` (one tensor or two) added in float32 and rounded once more."""
        if not isinstance(handle, DispatchHandle):
            raise TypeError(f"handle must come from moe_ep.deep_ep dispatch, got {type(handle).__name__}")
        sms = (config or self.get_combine_config(self.group_size)).num_sms
        inner = handle.inner
        weights, k = None, 0
        if topk_weights is not None:  # DEEP_EP_NORMAL_TOPK wide, as the dispatch's weights (results cut back to k)
            k = topk_weights.shape[-1]
            if k > DEEP_EP_NORMAL_TOPK:
                raise ValueError(f"topk_weights has {k} columns, at most {DEEP_EP_NORMAL_TOPK} are supported")
            weights = torch.nn.functional.pad(topk_weights.float(), (0, DEEP_EP_NORMAL_TOPK - k))
        if handle.rows is not None:
            x = _scatter_rows(x, handle.rows, inner.num_recv_rows)
            weights = _scatter_rows(weights, handle.rows, inner.num_recv_rows) if weights is not None else None
        if weights is None:
            out, out_w = handle.buffer.combine(x, inner, num_sms=sms), None
        else:
            out, out_w = handle.buffer.combine(x, inner, topk_weights=weights, num_sms=sms)
            out_w = out_w[:, :k].contiguous()
        return add_bias(out, bias), out_w, self._finish(async_finish)

    # ---- low-latency mode -----------------------------------------------------------------
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Nothing to clean: moe_ep's low-latency rows carry the call's epoch, so stale data is ignored."""
        if not self.low_latency_mode:
            raise ValueError("clean_low_latency_buffer needs a Buffer created with low_latency_mode=True")

    @_on_comm_stream
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False, *, use_nvfp4: bool = False,
                             x_global_scale: Optional[torch.Tensor] = None, use_ue8m0_for_sf: bool = False):
        """(recv_x or (e4m3, scales), recv_count, handle, event, hook), expert-major [E_l, R * T, ...]; the
        scales in DeepEP's token-major layout per expert (float32, or UE8M0 int32 with use_ue8m0). use_nvfp4
        (DeepEP's hybrid-ep branch, as vLLM calls it: use_fp8=False, x_global_scale): ((uint8 values
        [R * T, H / 2, E_l], e4m3 scales (32, 4, rm, 4, rk, E_l)), ...) in DeepEP's views
        (moe_ep.comm.nvfp4); x_global_scale without use_nvfp4 is ignored, as DeepEP does."""
        if use_ue8m0_for_sf:
            raise _unsupported("use_ue8m0_for_sf=True (NVFP4 with UE8M0 block scales)",
                               "moe_ep's NVFP4 scales are e4m3, as vLLM's CuteDSL GEMM reads them")
        if use_nvfp4 and use_fp8:
            raise ValueError("use_nvfp4=True needs use_fp8=False (DeepEP asserts they exclude each other; use_fp8 "
                             "defaults to True)")
        if use_ue8m0 and not (use_fp8 and round_scale and x.shape[1] % (4 * FP8_BLOCK) == 0):
            raise ValueError("use_ue8m0=True needs use_fp8=True, round_scale=True and hidden % 512 == 0")
        if dispatch_wait_recv_cost_stats is not None:
            raise _unsupported("dispatch_wait_recv_cost_stats", "moe_ep records no per-peer wait times")
        t = num_max_dispatch_tokens_per_rank
        buf = self._low_latency_buffer(x, num_experts, topk_idx.shape[1], t)
        got = buf.low_latency_dispatch(x, topk_idx, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
                                       use_nvfp4=use_nvfp4, x_global_scale=x_global_scale if use_nvfp4 else None,
                                       return_recv_hook=return_recv_hook)
        layout_range = torch.empty(buf.num_local_experts, self.group_size, dtype=torch.int64, device=x.device)

        def received() -> None:
            layout_range.copy_(_layout_range(got.handle.src_rank, got.count, self.group_size))
            if cumulative_local_expert_recv_stats is not None:
                cumulative_local_expert_recv_stats.add_(got.count)

        hook = _chain(got.hook, received) if return_recv_hook else None
        if not return_recv_hook:
            received()
        handle = LowLatencyHandle((got.handle.src_index, layout_range, t, x.shape[1], num_experts), buf, got.handle)
        recv = (got.x, got.x_scales) if use_fp8 or use_nvfp4 else got.x
        return recv, got.count, handle, self._finish(async_finish), hook

    @_on_comm_stream
    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: LowLatencyHandle, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None, *, overlap: bool = False,
                            packed_recv_count: Optional[torch.Tensor] = None,
                            comp_signal: Optional[torch.Tensor] = None, block_m: int = 64, threshold: int = 0,
                            num_sms: int = 0, src_signals: Optional[torch.Tensor] = None,
                            src_signal_expect_value: int = 0
                            ) -> tuple[torch.Tensor, EventOverlap, Optional[Callable[[], None]]]:
        """(combined_x, event, hook): moe_ep's weighted sum over k ascending, one rounding (docs/api.md).
        zero_copy=True combines what get_next_low_latency_combine_buffer's tensor holds instead of x.
        overlap=True (SGLang's single-batch overlap on Hopper): packed_recv_count, comp_signal, block_m,
        threshold and num_sms go to moe_ep's Buffer.low_latency_combine, which checks them and reads each
        expert's block of rows once the GEMM beside it signalled it; without overlap they are ignored.
        Blackwell's src_signals / src_signal_expect_value raise NotImplementedError."""
        if overlap and (src_signals is not None or src_signal_expect_value):
            raise _unsupported("src_signals / src_signal_expect_value (Blackwell's single-batch overlap)",
                               "moe_ep's overlap combine waits on Hopper's comp_signal per expert block; pass "
                               "packed_recv_count, comp_signal, block_m, threshold and num_sms")
        if use_logfmt:
            raise _unsupported("use_logfmt=True", "moe_ep has no LogFMT combine; it sends bf16 rows")
        if combine_wait_recv_cost_stats is not None:
            raise _unsupported("combine_wait_recv_cost_stats", "moe_ep records no per-peer wait times")
        if not isinstance(handle, LowLatencyHandle):
            raise TypeError(f"handle must come from moe_ep.deep_ep low_latency_dispatch, got {type(handle).__name__}")
        if zero_copy:
            if handle.buffer not in self._zero_copy:
                raise ValueError("zero_copy=True needs get_next_low_latency_combine_buffer(handle) filled first")
            x = self._zero_copy[handle.buffer]
        signals = dict(overlap=True, packed_recv_count=packed_recv_count, comp_signal=comp_signal, block_m=block_m,
                       threshold=threshold, num_sms=num_sms) if overlap else {}
        got = handle.buffer.low_latency_combine(x, topk_idx, topk_weights, handle.inner,
                                                return_recv_hook=return_recv_hook, **signals)

        def received() -> None:
            if out is not None:
                out.copy_(got.x)

        hook = _chain(got.hook, received) if return_recv_hook else None
        if not return_recv_hook:
            received()
        return got.x if out is None else out, self._finish(async_finish), hook

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """A [E_l, R * T, H] bf16 tensor to fill for the next combine with zero_copy=True (ordinary
        memory that the combine reads as its x: the API works, no copy is saved)."""
        buf = handle.buffer
        if buf not in self._zero_copy:
            self._zero_copy[buf] = torch.empty(*handle.inner.src_index.shape, handle[3], dtype=torch.bfloat16,
                                               device=handle.inner.src_index.device)
        return self._zero_copy[buf]

    def _check_shrink(self, what: str) -> None:
        if not self.enable_shrink:
            raise ValueError(f"{what} needs a Buffer created with enable_shrink=True")

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (mask=True) or unmask `rank_to_mask` in every low-latency call from now on: moe_ep's
        Buffer.set_rank_masked on each low-latency Buffer (and on those made later). Stream-ordered."""
        self._check_shrink("low_latency_update_mask_buffer")
        if not isinstance(rank_to_mask, int) or not 0 <= rank_to_mask < self.group_size:
            raise ValueError(f"rank_to_mask must be an int in [0, {self.group_size}), got {rank_to_mask!r}")
        if rank_to_mask == self.rank:
            raise ValueError(f"rank {self.rank} cannot mask itself")
        (self._masked.add if mask else self._masked.discard)(rank_to_mask)
        for buf in self._low_latency.values():
            buf.set_rank_masked(rank_to_mask, mask)

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """mask_status [R] int32 := 1 per masked rank: set by update_mask_buffer or masked by a low-latency
        Buffer after a timeout (its rank_mask). Device ops only: no host sync."""
        self._check_shrink("low_latency_query_mask_buffer")
        if not isinstance(mask_status, torch.Tensor) or mask_status.shape != (self.group_size,) or \
                mask_status.dtype != torch.int32:
            raise ValueError(f"mask_status must be an int32 tensor of shape ({self.group_size},)")
        status = torch.zeros(self.group_size, dtype=torch.int32, device=mask_status.device)
        if self._masked:
            status[sorted(self._masked)] = 1
        for buf in self._low_latency.values():
            status = torch.maximum(status, buf.rank_mask.to(mask_status.device))
        mask_status.copy_(status)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank (each low-latency Buffer's clear_rank_masks)."""
        self._check_shrink("low_latency_clean_mask_buffer")
        self._masked.clear()
        for buf in self._low_latency.values():
            buf.clear_rank_masks()

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """DeepEP's raw local buffer (num_rdma_bytes with use_rdma_buffer, else num_nvl_bytes) as a 1-D `dtype`
        tensor from element `offset`, or its first `size` elements viewed as `size`. An emulation: ordinary
        memory of that many bytes on the current CUDA device (the CPU without CUDA), made on first use, not
        moe_ep's communication buffers (their epoch state must not be overwritten), so what is written there
        reaches no peer and changes no call. vLLM zeroes it after a fault (DeepEPLLAll2AllManager.clean_buffers);
        moe_ep needs no zeroing: its low-latency rows carry the call's epoch."""
        nbytes = self.num_rdma_bytes if use_rdma_buffer else self.num_nvl_bytes
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        key = (use_rdma_buffer, device)
        if key not in self._raw:
            self._raw[key] = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        start, itemsize = offset * dtype.itemsize, dtype.itemsize
        if offset < 0 or start > nbytes:
            raise ValueError(f"offset {offset} is outside the {nbytes}-byte buffer ({dtype})")
        tensor = self._raw[key][start:start + (nbytes - start) // itemsize * itemsize].view(dtype)
        if size is None:
            return tensor
        size = torch.Size(size)
        if tensor.numel() < size.numel():
            raise ValueError(f"size {tuple(size)} needs {size.numel()} elements, the buffer has {tensor.numel()} "
                             f"from offset {offset}")
        return tensor[:size.numel()].view(size)

    # ---- lifetime -------------------------------------------------------------------------
    def destroy(self) -> None:
        """Close every moe_ep Buffer this one created (collective); needs explicitly_destroy=True."""
        if not self.explicitly_destroy:
            raise RuntimeError("destroy() needs a Buffer created with explicitly_destroy=True")
        for buf in self.moe_ep_buffers:
            buf.close()
        self._normal.clear()
        self._low_latency.clear()
        self._zero_copy.clear()
        self._raw.clear()


