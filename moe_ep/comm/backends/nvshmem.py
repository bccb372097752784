"""Native backend: picks its engines (backends/engine.py) and delegates every call to them.

Normal mode runs on `IntranodeEngine` (NVLink kernels, backends/intranode.py) when every rank is
reachable by NVLink loads and stores, else on `InternodeEngine` (puts across nodes,
backends/internode.py), both through the one normal-mode dispatch flow (engine.normal_dispatch);
a low_latency Buffer adds a `LowLatencyEngine` (backends/low_latency.py). The backend owns what
the engines share: the NVSHMEM session, the error word and the device epoch counters.

Every call runs on the current stream (the caller's, or the Buffer's communication stream for an
async call: moe_ep.comm.streams); all calls of one Buffer must be ordered on the device (one
stream, or events between streams), because each call reuses the Buffer's symmetric memory once the
peers have signalled that they finished the previous call. In worst-case mode outputs have R * T
rows and the host never waits, so the calls capture into a CUDA graph. After a CommTimeoutError the
Buffer is unusable.
"""
from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any, Optional

import torch

from .. import _native
from .. import expert_major as pairs
from ..call_check import COMBINE, CallOrder, CallStamp, OwnRejection
from ..types import (
    DispatchLayout,
    DispatchResult,
    LowLatencyCombineResult,
    LowLatencyDispatchResult,
    LowLatencyHandle,
    LowLatencyOverlap,
)
from .base import Backend, BufferConfig, record_event
from .engine import (
    NormalEngine,
    StreamedState,
    first_notify,
    normal_dispatch,
    round_bounds,
    own_group,
    streamed_combine,
    streamed_dispatch,
)
from .internode import InternodeEngine
from .intranode import IntranodeEngine
from .low_latency import LowLatencyEngine
from .stamp_exchange import StampExchange
from .symmetric import NvshmemSession


class NvshmemBackend(Backend):
    """The native kernels through NVSHMEM: one normal-mode engine, and a low-latency one when asked."""

    name = "nvshmem"
    checks_expert_ids = True

    def __init__(self, cfg: BufferConfig) -> None:
        super().__init__(cfg)
        native = _native.load()
        self._own_group = own_group(cfg.group, cfg.timeout_s)  # the Buffer's own gloo group (leave at exit)
        normal_cls: type[NormalEngine] = InternodeEngine if cfg.hierarchical else IntranodeEngine
        heap_bytes = normal_cls.heap_bytes(cfg) + StampExchange.heap_bytes(cfg)
        if cfg.low_latency:
            heap_bytes += LowLatencyEngine.heap_bytes(cfg)
        self._epochs = torch.zeros(native.NUM_EPOCHS, dtype=torch.int64, device=cfg.device)
        self._verdict = torch.zeros(1, dtype=torch.int32, device=cfg.device)  # the stamp exchange's (RuntimeContext)
        torch.cuda.synchronize(cfg.device)  # the zeros above land before any kernel, on any stream
        self._session: Optional[NvshmemSession] = NvshmemSession.acquire(cfg.group, cfg.device, heap_bytes)
        self._error = self._session.error_state(cfg.timeout_s, cfg.num_experts)
        # what every engine's context shares (csrc/runtime/context.h), checked and built once
        runtime = native.RuntimeContext(rank=cfg.rank, nranks=cfg.world_size, timeout_s=cfg.timeout_s,
                                        error=self._error.device_ptr, verdict=self._verdict.data_ptr())
        self._normal: Optional[NormalEngine] = None
        self._low_latency: Optional[LowLatencyEngine] = None
        try:
            self._stamps = StampExchange(cfg, self._session, runtime)
            self._error.on_mismatch = self._stamps.raise_mismatch
            if cfg.hierarchical:
                self._normal = InternodeEngine(cfg, self._session, runtime)
            else:
                self._normal = IntranodeEngine(cfg, self._session, self._epochs, runtime)
            if cfg.low_latency:
                self._low_latency = LowLatencyEngine(cfg, self._session, self._epochs, self._error, runtime)
                self._low_latency.launched = self._stamps.launched
        except BaseException:
            self._session.release()
            raise

    # ---- every call -------------------------------------------------------------------------
    def _check(self, timeouts_only: bool = False) -> None:
        """ErrorWatch.check where the record may be an earlier call's (one that raised nothing yet: an async
        call, a graph replay): a mismatch that names this rank's own rejected input raises nothing, since
        that call raised the rank's error already."""
        with contextlib.suppress(OwnRejection):
            self._error.check(timeouts_only)

    def _stream(self) -> torch.cuda.Stream:
        """What earlier calls recorded raised (a bad id waits for the end of a call); the current stream
        (the Buffer picked it: moe_ep.comm.streams)."""
        self._check(timeouts_only=True)
        return torch.cuda.current_stream(self.cfg.device)

    def synchronize(self) -> None:
        """Waits for the current stream and raises what this Buffer's kernels recorded."""
        torch.cuda.current_stream(self.cfg.device).synchronize()
        self._check()

    def _begin(self, stamp: CallStamp, num_tokens: int = 0, masked: Optional[torch.Tensor] = None,
               off_stream: bool = False) -> tuple[torch.cuda.Stream, torch.cuda.Event]:
        """A call's start: earlier records raised, then its stamp exchange (backends/stamp_exchange.py)
        launched before the call's kernels on its stream (off_stream: see StampExchange.launch); returns
        the stream and the exchange's event."""
        stream = self._stream()
        return stream, self._stamps.launch(stamp, num_tokens, stream, masked, off_stream)

    def stamp_exchange_alone(self) -> None:
        """A stamp exchange on the current stream with nothing after it (collective; moe_ep.bench times it):
        what the device check costs every native call."""
        self._stamps.launch(CallStamp(CallOrder(), COMBINE, 1, 0, 0, 0, 0), 0,
                            torch.cuda.current_stream(self.cfg.device))

    def _await_exchange(self, verdict: torch.cuda.Event) -> None:
        """Waits for the call's stamp exchange and raises what it recorded (peers that made another call
        or never came)."""
        verdict.synchronize()
        self._error.check(timeouts_only=True)

    def _launched(self, stream: torch.cuda.Stream) -> None:
        """A normal-mode call's last native kernel is launched on `stream`: the next call's stamp exchange may
        run off its stream after it (backends/stamp_exchange.py). A call that raises before this stays
        unreported, and the next exchange runs on its call's stream."""
        self._stamps.launched(stream.cuda_stream)

    def _settle(self, verdict: torch.cuda.Event, async_op: bool) -> None:
        """A call that is neither async nor being captured waits, once all of its kernels are launched, for
        its stamp exchange (_await_exchange), so the call does not return as if it had succeeded. An async
        call's event and the Buffer's next call raise it instead; a captured one's replay raises it at its
        first host check."""
        if not async_op and not torch.cuda.is_current_stream_capturing():
            self._await_exchange(verdict)

    def _rounds(self, verdict: torch.cuda.Event) -> int:
        """A fresh exact-size dispatch's token rounds, ceil(max N / T) over the ranks, from its stamp
        exchange (the host waits for it; a mismatch or a silent peer raises here, before any round)."""
        self._await_exchange(verdict)
        return max(1, -(-self._stamps.max_tokens() // self.cfg.max_tokens_per_rank))

    # ---- normal mode -----------------------------------------------------------------------

    def get_dispatch_layout(self, topk_idx: torch.Tensor) -> DispatchLayout:
        """The layout kernel over rounds of at most T tokens (local: no peer takes part), summed."""
        stream = torch.cuda.current_stream(self.cfg.device)
        bounds = round_bounds(topk_idx.shape[0], max(1, -(-topk_idx.shape[0] // self.cfg.max_tokens_per_rank)),
                              self.cfg.max_tokens_per_rank)
        parts = [self._normal.layout(topk_idx[first:last], stream) for first, last in bounds]
        self._check()  # local call: what earlier calls without a host sync recorded
        if len(parts) == 1:
            return parts[0]
        return DispatchLayout(num_tokens_per_rank=sum(p.num_tokens_per_rank for p in parts),
                              num_tokens_per_expert=sum(p.num_tokens_per_expert for p in parts),
                              is_token_in_rank=torch.cat([p.is_token_in_rank for p in parts]))

    def dispatch(self, x, x_scales, topk_idx, topk_weights, *, handle, expert_alignment, worst_case, expert_major,
                 num_sms, knobs, async_op, stamp) -> DispatchResult:
        """The engine's normal dispatch flow, or its rounds when a call carries more than T tokens on some
        rank (engine.streamed_dispatch). An expert-major result is the engine's own expansion of the rows
        into pairs (NormalEngine.expand); a streamed or worst-case one lands its rows and gathers them
        (each round reuses the workspace; worst-case pairs have static shapes). The stamp rides the
        notifies' count rows: compared for fresh dispatches outside worst-case mode (the host reads
        the counts)."""
        stream, verdict = self._begin(stamp, x.shape[0], off_stream=True)
        engine = self._normal
        static = handle.worst_case if handle is not None else worst_case
        first = None
        if handle is not None:
            rounds = len(handle.state.rounds) if isinstance(handle.state, StreamedState) else 1
        elif worst_case:  # a static-shape call fits one round: Buffer checked it
            rounds = 1
        else:  # round 0's count exchange is queued behind the stamp exchange, which tells the rounds
            first = first_notify(engine, topk_idx, expert_alignment, stream, stamp)
            rounds = self._rounds(verdict)
        if rounds == 1 and not static:
            result = normal_dispatch(engine, x, x_scales, topk_idx, topk_weights, handle=handle,
                                     expert_alignment=expert_alignment, worst_case=worst_case, num_sms=num_sms,
                                     knobs=knobs, stream=stream, async_op=async_op, check=self._check,
                                     stamp=stamp, expert_major=expert_major, notified=first)
            self._launched(stream)
            self._settle(verdict, async_op)
            return result
        if rounds == 1:
            result = normal_dispatch(engine, x, x_scales, topk_idx, topk_weights, handle=handle,
                                     expert_alignment=expert_alignment, worst_case=worst_case, num_sms=num_sms,
                                     knobs=knobs, stream=stream, async_op=async_op, check=self._check,
                                     stamp=stamp)
        else:
            result = streamed_dispatch(engine, x, x_scales, topk_idx, topk_weights, handle=handle, rounds=rounds,
                                       expert_alignment=expert_alignment, num_sms=num_sms, knobs=knobs,
                                       stream=stream, async_op=async_op, check=self._check, stamp=stamp,
                                       first=first)
        self._launched(stream)
        self._settle(verdict, async_op)
        return pairs.expand(result, expert_alignment) if expert_major else result

    def combine(self, x, handle, *, topk_weights, pair_weights, num_sms, knobs, async_op, stamp):
        """One kernel after the stamp exchange: the rows, and topk_weights when given, travel back
        together (an expert-major handle's pairs summed into rows first, on the current stream)."""
        cfg = self.cfg
        stream, verdict = self._begin(stamp, off_stream=True)
        x, topk_weights = pairs.combine_inputs(x, handle, topk_weights, pair_weights)
        n = handle.num_tokens
        out = torch.empty(n, cfg.hidden, dtype=torch.bfloat16, device=cfg.device)
        out_w = None if topk_weights is None else torch.empty(n, cfg.num_topk, dtype=torch.float32, device=cfg.device)
        if isinstance(handle.state, StreamedState):
            streamed_combine(self._normal, x, handle, out, topk_weights, out_w, num_sms=num_sms, knobs=knobs,
                             stream=stream)
        else:
            self._normal.combine(x, handle, out, topk_weights, out_w, num_sms=num_sms, knobs=knobs, stream=stream)
        self._check()  # launched: what earlier calls without a host sync recorded
        self._launched(stream)
        self._settle(verdict, async_op)
        return out, out_w, record_event(async_op, cfg.device, self._check)

    # ---- low-latency mode ------------------------------------------------------------------
    def _engine(self) -> Any:
        if self._low_latency is None:
            raise RuntimeError("this Buffer was created without low_latency=True")
        return self._low_latency

    def _low_latency_begin(self, kind: str, stamp: CallStamp) -> torch.cuda.Event:
        """A low-latency call's stamp exchange, once the engine says the call may start: off the call's
        stream, after the Buffer's earlier kernels only (the engine reports its launches), so the host's
        wait for it leaves the caller's queued work alone; a fault-tolerant Buffer's exchange (which skips
        masked ranks and masks a silent one, as its kernels do) stays on the call's stream, since the
        caller may write the mask there."""
        engine = self._engine()
        engine.check_ready(kind)
        if self.cfg.fault_tolerant:
            return self._begin(stamp, masked=engine.rank_mask)[1]
        return self._begin(stamp, off_stream=True)[1]

    def low_latency_dispatch(self, x, topk_idx, *, use_fp8, round_scale, use_ue8m0, use_nvfp4, x_global_scale,
                             return_recv_hook, async_op, stamp) -> LowLatencyDispatchResult:
        """The stamp exchange, then the engine's send (and receive, without a hook)."""
        verdict = self._low_latency_begin("dispatch", stamp)
        result = self._engine().dispatch(x, topk_idx, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
                                         use_nvfp4=use_nvfp4, x_global_scale=x_global_scale,
                                         return_recv_hook=return_recv_hook)
        self._settle_low_latency("dispatch", verdict, async_op)
        return result

    def low_latency_combine(self, x, topk_idx, topk_weights, handle: LowLatencyHandle, *, return_recv_hook,
                            async_op, overlap: Optional[LowLatencyOverlap], stamp) -> LowLatencyCombineResult:
        """The stamp exchange, then the engine's send (and receive, without a hook)."""
        verdict = self._low_latency_begin("combine", stamp)
        result = self._engine().combine(x, topk_idx, topk_weights, handle, return_recv_hook=return_recv_hook,
                                        overlap=overlap)
        self._settle_low_latency("combine", verdict, async_op)
        return result

    def _settle_low_latency(self, kind: str, verdict: torch.cuda.Event, async_op: bool) -> None:
        """_settle; a call that raises there drops its receive hook (its kernels did nothing)."""
        try:
            self._settle(verdict, async_op)
        except BaseException:
            self._engine().drop_hook(kind)
            raise

    @property
    def normal_path(self) -> str:
        return self._normal.path

    def fill_workspace(self, value: int) -> None:
        self._normal.fill_workspace(value)

    def rank_mask(self) -> torch.Tensor:
        return self._engine().rank_mask

    def abort(self) -> None:
        """Local: waits for this rank's kernels (each gives up within the timeout), frees host memory
        only and gives the NVSHMEM session up (symmetric memory is freed collectively, with every PE)."""
        if self._session is None:
            return
        torch.cuda.synchronize(self.cfg.device)
        self._stamps.close()
        if self._normal is not None:
            self._normal.close()
        masked = self._low_latency.masked_ranks() if self._low_latency is not None else []
        self._session.abandon(f"rank {self.cfg.rank} aborted a Buffer" + (f"; ranks {masked} were masked" if masked else ""))
        self._session = None
        self._low_latency = self._normal = None

    # ---- lifetime --------------------------------------------------------------------------
    def leave(self, timeout_s: float) -> bool:
        """Closes with the peers once all reached this point (a barrier on the Buffer's own gloo group,
        bounded by timeout_s), else aborts: NVSHMEM's frees would wait for a missing peer forever."""
        if self._session is None:
            return True
        try:
            self._own_group.barrier().wait(timedelta(seconds=timeout_s))
        except RuntimeError:
            self.abort()
            return False
        self.close()
        return True

    def close(self) -> None:
        """Collective: waits for this rank's kernels, frees the symmetric memory and the session."""
        if self._session is None:
            return
        torch.cuda.synchronize(self.cfg.device)
        for engine in (self._low_latency, self._normal, self._stamps):
            if engine is not None:
                engine.close()
        self._low_latency = self._normal = None
        self._session.release()
        self._session = None
