"""Communication overlapped with computation inside moe_ep.MoE (docs/api.md, "Overlap"; docs/design.md says why).

Normal mode (`normal`), with MoE(overlap=True): every kernel of the layer is the one it runs without
overlap, on the same inputs, so outputs and gradients keep their bits and each expert's grouped GEMM
stays whole; only the streams change. The dispatch and the combine run on one communication stream
per Buffer, the router, the shared expert and the experts on the caller's (compute) stream, and CUDA
events order the two. What runs beside the communication:
- forward: the shared expert beside the dispatch (notify, the count sync, the rows);
- backward: autograd runs each backward op on its forward op's stream, so the combine's backward (a
  cached dispatch) and the dispatch's backward (a combine) land on the communication stream and the
  engine adds the events; the dispatch's backward runs beside the shared expert's backward, after the
  experts' whole backward (docs/design.md says why).
Where nothing runs beside it (one rank, no shared expert) the mode costs a few events. On the CPU,
while torch.compile traces, and with overlap=False everything runs on the caller's stream.

Decode (`PendingMoE`): low-latency calls with receive hooks split a step into start / compute /
finish so that another micro-batch's work runs while this one's rows travel, with no host sync.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Protocol

import torch
import torch.distributed as dist

from ..comm import fp8
from ..comm.buffer import Buffer
from ..comm.types import LowLatencyCombineResult, LowLatencyDispatchResult
from . import autograd
from .experts import GroupedExperts
from .router import RouterOutput


class MoE(Protocol):
    """The members of moe_ep.moe.layer.MoE that overlap drives (a protocol, so overlap never imports
    the layer that imports it)."""
    buffer: Buffer
    experts: GroupedExperts
    overlap: bool
    low_latency_fp8: bool

    def dispatch(self, tokens: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
                 ) -> "autograd.Dispatched | autograd.ExpertMajorDispatched": ...

    def run_experts(self, d: "autograd.Dispatched | autograd.ExpertMajorDispatched") -> torch.Tensor: ...

    def shared_forward(self, tokens: torch.Tensor) -> Optional[torch.Tensor]: ...


def check_setting(buffer: Buffer, overlap: bool) -> None:
    """Collective (one all_gather_object over the Buffer's group): ValueError on every rank, naming
    each rank's value, unless all ranks use the same overlap setting."""
    everyone: list[Optional[bool]] = [None] * buffer.cfg.world_size
    dist.all_gather_object(everyone, overlap, group=buffer.cfg.group)
    if any(o != overlap for o in everyone):
        raise ValueError("every rank must build its MoE with the same overlap setting; got "
                         + ", ".join(f"overlap={o} on rank {r}" for r, o in enumerate(everyone)))


class _Streams:
    """The compute (current) stream, the Buffer's communication stream and the events between them;
    on the CPU, while torch.compile traces, and when not `enabled`, both streams are None and every
    method a no-op (everything runs on the caller's stream)."""

    def __init__(self, buffer: Buffer, enabled: bool = True) -> None:
        self.compute: Optional[torch.cuda.Stream] = None
        self.comm: Optional[torch.cuda.Stream] = None
        if enabled and buffer.device.type == "cuda" and not torch.compiler.is_compiling():
            self.compute = torch.cuda.current_stream(buffer.device)
            self.comm = buffer.comm_stream.stream  # the one async Buffer calls use

    def mark(self, comm: bool = False) -> Optional[torch.cuda.Event]:
        """An event after the work so far of the compute stream (or of the communication stream)."""
        stream = self.comm if comm else self.compute
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    @contextlib.contextmanager
    def on_comm(self, after: Optional[torch.cuda.Event], *inputs: torch.Tensor) -> Iterator[None]:
        """Run the block on the communication stream once `after` completed; `inputs` (made on the
        compute stream) stay allocated until the block's kernels are done with them."""
        if self.comm is None:
            yield
            return
        self.comm.wait_event(after)
        for t in inputs:
            t.record_stream(self.comm)
        with torch.cuda.stream(self.comm):
            yield

    def wait(self, event: Optional[torch.cuda.Event], *outputs: torch.Tensor) -> None:
        """The compute stream waits for `event` (communication), whose `outputs` it then reads."""
        if self.compute is None:
            return
        self.compute.wait_event(event)
        for t in outputs:
            t.record_stream(self.compute)


def normal(moe: "MoE", tokens: torch.Tensor, routing: RouterOutput,
           shared: Optional[Callable[[], torch.Tensor]]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Normal mode over `tokens` [N, H]: (routed output [N, H] bf16, the shared expert's output or None).
    The shared expert is queued first, so with moe.overlap it runs while the dispatch moves rows; the
    kernels and their order on each stream are the same either way."""
    streams = _Streams(moe.buffer, enabled=moe.overlap)
    x = tokens.to(torch.bfloat16).contiguous()
    routed = streams.mark()  # the dispatch waits for the router only, not for the shared expert
    shared_out = shared() if shared is not None else None
    with streams.on_comm(routed, x, routing.topk_idx, routing.topk_weights):
        d = moe.dispatch(x, routing.topk_idx, routing.topk_weights)
    streams.wait(streams.mark(comm=True), *d.tensors())
    rows = moe.run_experts(d)
    with streams.on_comm(streams.mark(), rows):
        out = autograd.combine(rows, d.ref)
    streams.wait(streams.mark(comm=True), out)
    return out, shared_out


# ---- decode: start / compute / finish --------------------------------------------------------------
_open_hooks: dict[int, dict[str, "PendingMoE"]] = {}  # buffer_id -> kind -> the micro-batch whose receive is due


def _claim(buffer: Buffer, kind: str, pending: "PendingMoE") -> None:
    """A micro-batch sends its `kind` ("dispatch" or "combine") half: the previous one's receive of the
    same kind must have run (the native kernels reuse the buffers; this makes every backend say so)."""
    open_ = _open_hooks.setdefault(buffer.cfg.buffer_id, {})
    if kind in open_:
        step = "compute() (or finish())" if kind == "dispatch" else "finish()"
        raise RuntimeError(f"a micro-batch's low-latency {kind} is still in flight on this Buffer: call its "
                           f"{step} before starting the {kind} of another")
    open_[kind] = pending


def _release(buffer: Buffer, kind: str) -> None:
    _open_hooks.get(buffer.cfg.buffer_id, {}).pop(kind, None)


@dataclass
class PendingMoE:
    """One micro-batch of a low-latency MoE step between its phases (MoE.start).

    start():   router; low_latency_dispatch send half; the shared expert (while the tokens travel).
    compute(): dispatch receive; the experts; low_latency_combine send half.
    finish():  compute() if not done; combine receive; + shared expert -> [..., H] in x's dtype.
    No host sync in any phase on the native backend (CUDA-graph capturable); all three on the
    caller's stream, as the low-latency calls of one Buffer must be.
    """

    moe: "MoE"
    shape: torch.Size
    dtype: torch.dtype
    routing: RouterOutput
    dispatched: LowLatencyDispatchResult
    shared: Optional[torch.Tensor]
    combined: Optional[LowLatencyCombineResult] = None
    done: bool = False

    def compute(self) -> "PendingMoE":
        """Receive this micro-batch's rows, run the local experts, send their outputs back."""
        if self.combined is not None or self.done:
            raise RuntimeError("compute() already ran for this micro-batch")
        moe, d = self.moe, self.dispatched
        _claim(moe.buffer, "combine", self)
        try:
            d.hook()
        finally:
            _release(moe.buffer, "dispatch")
        recv = fp8.dequantize(d.x, d.x_scales) if moe.low_latency_fp8 else d.x
        y = moe.experts.forward_padded(recv, d.count).to(torch.bfloat16)
        self.combined = moe.buffer.low_latency_combine(y, self.routing.topk_idx, self.routing.topk_weights,
                                                       d.handle, return_recv_hook=True)
        return self

    def finish(self) -> torch.Tensor:
        """Receive the combined outputs; the layer's output for this micro-batch."""
        if self.done:
            raise RuntimeError("finish() already ran for this micro-batch")
        if self.combined is None:
            self.compute()
        self.done = True
        try:
            self.combined.hook()
        finally:
            _release(self.moe.buffer, "combine")
        out = self.combined.x.to(self.dtype)
        if self.shared is not None:
            out = out + self.shared.to(self.dtype)
        return out.view(self.shape)


def start(moe: "MoE", x: torch.Tensor, tokens: torch.Tensor, routing: RouterOutput) -> PendingMoE:
    """Send a micro-batch's tokens (low-latency dispatch, send half), then run the shared expert."""
    pending = PendingMoE(moe, x.shape, x.dtype, routing, None, None)  # type: ignore[arg-type]
    _claim(moe.buffer, "dispatch", pending)
    try:
        pending.dispatched = moe.buffer.low_latency_dispatch(
            tokens.to(torch.bfloat16).contiguous(), routing.topk_idx, use_fp8=moe.low_latency_fp8,
            return_recv_hook=True)
    except BaseException:
        _release(moe.buffer, "dispatch")
        raise
    pending.shared = moe.shared_forward(tokens)
    return pending
