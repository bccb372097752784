"""The stamp exchange of a native Buffer (csrc/kernels/call_check/stamp_exchange.cu): the first kernel of
every call, in which every rank gives every rank its call stamp (moe_ep.comm.call_check) and token count.

Ranks that make different calls (a combine against a dispatch, a skipped call) therefore find out on
the device within one round trip, before any kernel of the call writes to a peer; the call's other
kernels then do nothing, so the ranks stay in step, and each rank raises CallMismatchError naming every
rank's call (`raise_mismatch`, called by ErrorWatch.check once the device is idle). A fresh dispatch
reads the most tokens any rank brings from it, for its token rounds (`max_tokens`), where a host
all-reduce used to be. A call that is neither async nor being captured waits for its exchange before it
returns (NvshmemBackend), so it never returns after its peers made another call or never came.
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

    @staticmethod
    def heap_bytes(cfg: BufferConfig) -> int:
        return _native.load().stamp_exchange_heap_bytes(cfg.world_size) + ALLOCATION_SLACK_BYTES

    def launch(self, stamp: CallStamp, num_tokens: int, stream: torch.cuda.Stream,
               masked: Optional[torch.Tensor] = None) -> torch.cuda.Event:
        """The call's exchange on `stream`, first of its kernels; the event completes with it (its verdict:
        the ErrorState, and max_tokens). `masked`: a fault-tolerant low-latency Buffer's rank mask."""
        self._order = stamp.order
        self._ctx.exchange(stamp.words, num_tokens, 0 if masked is None else masked.data_ptr(), stream.cuda_stream)
        verdict = torch.cuda.Event()
        verdict.record(stream)
        return verdict

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
