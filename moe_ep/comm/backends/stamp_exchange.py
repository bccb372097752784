"""The stamp exchange of a native Buffer (csrc/kernels/call_check/stamp_exchange.cu): the first kernel of
every call, in which every rank gives every rank its call stamp (moe_ep.comm.call_check) and token count.

Ranks that make different calls (a combine against a dispatch, a skipped call) therefore find out on
the device within one round trip, before any kernel of the call writes to a peer; the call's other
kernels then do nothing, so the ranks stay in step, and each rank raises CallMismatchError naming every
rank's call (`raise_mismatch`, called by ErrorWatch.check once the device is idle). A fresh dispatch
reads the most tokens any rank brings from it, for its token rounds (`max_tokens`), where a host
all-reduce used to be. A call that is neither async nor being captured waits for its exchange before it
returns (NvshmemBackend), so it never returns after its peers made another call or never came.

Where an exchange runs: on its call's stream, after everything queued there; or, for a call made eagerly
(`off_stream`: every normal-mode call, and the low-latency calls of a Buffer that is not fault-tolerant), on a
high-priority stream of its own, after only this Buffer's earlier kernels (the launches the backend reports
to `launched`: the low-latency engine after each launch, a normal-mode call once its last kernel is out),
and the call's stream waits for it. The host's wait for the verdict then does not wait for the caller's own
work queued before the call (a decode step's expert GEMMs, the layer's GEMMs before its combine), so the host
runs ahead and keeps the GPU fed. Every exchange still runs after every earlier kernel of the Buffer, so no
exchange overwrites the verdict word before the kernels of an earlier call read it (a hook's receive half
included), and the exchanges' epochs stay in order. A Buffer falls back to the call's stream for good once
one of its calls was captured (a replay's kernels are launched without the host), and for the next call
when the latest one was not reported (it raised before its last launch).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from .. import _native
from ..call_check import CallOrder, CallStamp, OwnRejection, describe_call, verify
from ..config import ALLOCATION_SLACK_BYTES
from ..errors import CallMismatchError
from .base import BufferConfig

if TYPE_CHECKING:
    from .symmetric import NvshmemSession


class StampExchange:
    """One Buffer's exchange: its symmetric table and flags, its device epoch, its native context."""

    def __init__(self, cfg: BufferConfig, session: "NvshmemSession", runtime: Any) -> None:
        native = _native.load()
        self.cfg = cfg
        self._epoch = torch.zeros(1, dtype=torch.int64, device=cfg.device)
        torch.cuda.synchronize(cfg.device)  # the zero lands before any kernel, on any stream
        self._memory = session.alloc((native.stamp_exchange_heap_bytes(cfg.world_size),), torch.uint8)
        self._table_bytes = native.stamp_exchange_table_bytes(cfg.world_size)
        self._row_words = native.STAMP_ROW_WORDS
        self._stamp_words = native.STAMP_WORDS
        self._ctx: Any = native.StampExchangeContext(runtime=runtime, epoch=self._epoch.data_ptr(),
                                                     symmetric=self._memory.ptr)
        self._order: Optional[CallOrder] = None  # the Buffer's call counter (from the calls' stamps)
        self._own_stream: Optional[torch.cuda.Stream] = None  # off_stream exchanges run here (made on first use)
        self._after: Optional[torch.cuda.Event] = None  # recorded after the Buffer's latest reported launch
        self._unreported = False  # kernels of the Buffer may have gone out since the latest report
        self._captured = False  # a call of the Buffer was captured: exchanges stay on their calls' streams
        self._streams: dict[int, torch.cuda.ExternalStream] = {}  # launched's handles as torch streams

    @staticmethod
    def heap_bytes(cfg: BufferConfig) -> int:
        return _native.load().stamp_exchange_heap_bytes(cfg.world_size) + ALLOCATION_SLACK_BYTES

    def launch(self, stamp: CallStamp, num_tokens: int, stream: torch.cuda.Stream,
               masked: Optional[torch.Tensor] = None, off_stream: bool = False) -> torch.cuda.Event:
        """The call's exchange, first of its kernels on `stream`; the event completes with it (its verdict:
        the ErrorState, and max_tokens). `masked`: a fault-tolerant low-latency Buffer's rank mask.
        off_stream: the call reports its kernels' launches to `launched`; its exchange may then run on the
        exchange's own stream (module comment), which `stream` waits for."""
        self._order = stamp.order
        self._captured = self._captured or torch.cuda.is_current_stream_capturing()
        runs_on = stream
        if off_stream and not self._unreported and not self._captured:
            runs_on = self._own()
            if self._after is not None:
                runs_on.wait_event(self._after)
        self._unreported = True
        self._ctx.exchange(stamp.words, num_tokens, 0 if masked is None else masked.data_ptr(), runs_on.cuda_stream)
        verdict = torch.cuda.Event()
        verdict.record(runs_on)
        if runs_on is not stream:
            stream.wait_event(verdict)
        return verdict

    def launched(self, stream: int) -> None:
        """The latest call's kernels were launched on `stream` (a raw handle) up to here: the next exchange
        waits for them. Nothing is recorded while a capture runs (that Buffer's exchanges stay on their
        calls' streams from then on)."""
        if self._captured or torch.cuda.is_current_stream_capturing():
            self._captured = True
            return
        if stream not in self._streams:
            self._streams[stream] = torch.cuda.ExternalStream(stream, device=self.cfg.device)
        if self._after is None:  # one event, re-recorded: a stream's wait takes its latest record
            self._after = torch.cuda.Event()
        self._after.record(self._streams[stream])
        self._unreported = False

    def _own(self) -> torch.cuda.Stream:
        if self._own_stream is None:  # high priority (torch maps -1 into the device's range): its one block
            self._own_stream = torch.cuda.Stream(self.cfg.device, priority=-1)  # starts between a GEMM's blocks
        return self._own_stream

    def max_tokens(self) -> int:
        """The most tokens any rank brought to the last exchange (once its event completed)."""
        return self._ctx.max_tokens()

    def raise_mismatch(self, slot: int) -> None:
        """ErrorWatch.on_mismatch: every rank's stamp from table slot `slot` (the device is idle), then
        call_check.verify's error: PeerInputError where a peer rejected its input, else CallMismatchError
        naming each rank's call (the call counter resumes past every rank's). Nothing is raised where this
        rank rejected its own input: its call raised that already."""
        r, words = self.cfg.world_size, self._stamp_words
        table = self._memory.tensor[:self._table_bytes].view(torch.int32)
        rows = table[:2 * r * self._row_words].view(2, r, self._row_words)[slot, :, :words].tolist()
        order = self._order if self._order is not None else CallOrder()
        mine = CallStamp(order, *rows[self.cfg.rank])
        try:
            verify(mine, rows, self.cfg.rank)
        except OwnRejection:
            return
        raise CallMismatchError(", ".join(f"rank {q}: {describe_call(c)}" for q, c in enumerate(rows)))

    def close(self) -> None:
        """Frees the host mailbox (the symmetric memory goes with the session)."""
        self._ctx.close()
