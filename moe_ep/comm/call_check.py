"""Calls checked in order, errors made collective (docs/api.md, Errors).

Every communicating call of a Buffer carries a stamp of STAMP_WORDS small ints inside an exchange it
already makes (the reference backend's count all_to_all, the native notify's count rows): the call's
kind, its number among the Buffer's calls, the number of the call whose handle it uses, the sizes
that every rank must agree on, and whether this rank rejected its input (and why). Once every
rank's stamp is in, `verify` raises on every rank alike: each rejecting rank's own error and
PeerInputError on its peers, else CallMismatchError when the ranks made different calls. A native
Buffer made with check_calls=True also compares every call's stamps on the host first (`HostCheck`),
for the calls that make no such exchange.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional, Sequence, TypeVar

import torch
import torch.distributed as dist

from .errors import BadExpertIdError, CallMismatchError, CommTimeoutError, PeerInputError

STAMP_WORDS = 6  # kind, call, handle call, size, status, reason; each fits an int32 (the native count rows)
_WRAP = 1 << 30  # call numbers wrap below int32's range

KINDS = ("?", "dispatch", "cached dispatch", "combine", "low-latency dispatch", "low-latency combine")
DISPATCH, CACHED, COMBINE, LL_DISPATCH, LL_COMBINE = 1, 2, 3, 4, 5
NVFP4_ROWS = 2  # a low-latency dispatch's size word: 0 bf16 rows, 1 FP8, 2 NVFP4

# status: what the rank rejected (0: nothing); reason: argument * 16 + check, the codes its error carries
# (input_error), so peers learn why without reading the message. Append only: the words index these.
STATUS = (None, TypeError, ValueError, BadExpertIdError)
ARGUMENTS = ("?", "x", "x_scales", "topk_idx", "topk_weights", "pair_weights", "expert_alignment", "expert_major",
             "round_scale", "num_sms", "config", "previous_event", "x_global_scale", "use_nvfp4", "overlap",
             "packed_recv_count", "comp_signal", "block_m", "threshold", "handle", "use_fp8", "use_ue8m0",
             "return_recv_hook", "low_latency")
CHECKS = ("?", "value", "type", "dtype", "shape", "device", "contiguity", "alignment", "token count", "expert ids")
_Error = TypeVar("_Error", bound=Exception)


class OwnRejection(Exception):
    """Internal: this rank rejected its input and every rank has its stamp; Buffer raises the rank's error."""


@dataclass(frozen=True)
class InputCode:
    """Why a rank rejected its input, as its stamp's reason word carries it: the argument and the failed check."""

    argument: str
    check: str

    @property
    def word(self) -> int:
        return ARGUMENTS.index(self.argument) * 16 + CHECKS.index(self.check)


def input_error(cls: type[_Error], argument: str, check: str, message: str) -> _Error:
    """`cls(message)` carrying its InputCode (attribute `input_code`): how buffer.py makes every error of a
    call's validation, so the rank's stamp says which argument failed which check."""
    if argument not in ARGUMENTS or check not in CHECKS:
        raise KeyError(f"no stamp code for argument {argument!r} or check {check!r} (moe_ep.comm.call_check)")
    error = cls(message)
    error.input_code = InputCode(argument, check)
    return error


def _reason(error: Exception) -> tuple[int, int]:
    """(status, reason) of a rejected input: the error's class and its InputCode (0, "?", without one)."""
    status = next((i for i in range(len(STATUS) - 1, 0, -1) if isinstance(error, STATUS[i])), 2)
    code = getattr(error, "input_code", None)
    return status, code.word if isinstance(code, InputCode) else 0


def describe_reason(status: int, reason: int) -> str:
    """What a peer's (status, reason) words say, e.g. "TypeError: x (dtype)" (a bad expert id that the
    native kernels found has no reason word: it is always topk_idx's)."""
    kind = STATUS[status].__name__ if 0 < status < len(STATUS) else f"status {status}"
    if status == STATUS.index(BadExpertIdError):
        return f"{kind}: topk_idx (expert ids)"
    argument, check = divmod(reason, 16)
    name = ARGUMENTS[argument] if 0 <= argument < len(ARGUMENTS) else "?"
    what = CHECKS[check] if 0 <= check < len(CHECKS) else "?"
    return f"{kind}: {what}" if name == "?" else f"{kind}: {name} ({what})"


@dataclass
class CallOrder:
    """A Buffer's call counter (the same on every rank while the ranks make the same calls)."""

    last: int = 0

    def stamp(self, kind: int, handle: int = 0, size: int = 0, error: Optional[Exception] = None) -> "CallStamp":
        """The next call's stamp; `handle`: the number of the call that made the handle it uses."""
        self.last = self.last % _WRAP + 1
        status, reason = _reason(error) if error is not None else (0, 0)
        return CallStamp(self, kind, self.last, handle, size, status, reason)


@dataclass(frozen=True)
class CallStamp:
    """One rank's stamp for one call (module docstring); `words` is what travels."""

    order: CallOrder = field(repr=False, compare=False)
    kind: int
    call: int
    handle: int
    size: int
    status: int
    reason: int

    @property
    def words(self) -> list[int]:
        return [self.kind, self.call, self.handle, self.size, self.status, self.reason]

    def rejecting(self, error: Exception) -> "CallStamp":
        """This stamp saying that the rank rejected its input for `error` (a backend that finds it only
        once the call is under way, before its exchange)."""
        status, reason = _reason(error)
        return dataclasses.replace(self, status=status, reason=reason)


def describe_call(words: Sequence[int]) -> str:
    """A call as its stamp names it, e.g. "combine #8 (handle of call #7, with topk_weights)"."""
    kind, call, handle, size = (int(w) for w in words[:4])
    name = KINDS[kind] if 0 <= kind < len(KINDS) else f"call kind {kind}"
    extra = []
    if handle:
        extra.append(f"handle of call #{handle}")
    if size == NVFP4_ROWS and kind == LL_DISPATCH:
        extra.append("NVFP4 rows")
    elif size and kind in (DISPATCH, CACHED, LL_DISPATCH):
        extra.append("FP8 rows")
    elif size and kind == COMBINE:
        extra.append("with topk_weights")
    return f"{name} #{call}" + (f" ({', '.join(extra)})" if extra else "")


def verify(mine: CallStamp, everyone: Sequence[Sequence[int]], rank: int) -> None:
    """Every rank's stamp words for this call (rank order, this rank's, `rank`, included): raises
    OwnRejection if this rank rejected its input (its host said so, or its kernels found a bad id in
    the words they sent), else PeerInputError naming each peer that did (a rejected input may also
    make the call differ, e.g. a wrong handle), else CallMismatchError if the ranks made different
    calls. Every rank sees the same words, so every rank raises; after different calls the counters
    resume past every rank's, so the Buffer stays usable."""
    calls = [[int(w) for w in words[:4]] for words in everyone]
    if any(c != calls[0] for c in calls):
        mine.order.last = max(c[1] for c in calls)
    if mine.status or int(everyone[rank][4]):
        raise OwnRejection()
    peers = [(r, int(w[4]), int(w[5])) for r, w in enumerate(everyone) if int(w[4])]
    if peers:
        raise PeerInputError([r for r, _, _ in peers], describe_call(mine.words),
                             [describe_reason(s, why) for _, s, why in peers])
    if any(c != calls[0] for c in calls):
        raise CallMismatchError(", ".join(f"rank {r}: {describe_call(c)}" for r, c in enumerate(calls)))


class HostCheck:
    """Stamps compared on the host before every call of a native Buffer made with check_calls=True
    (its combine, cached, worst-case and low-latency calls carry theirs in no exchange): one
    all_gather of STAMP_WORDS int64 per rank over a gloo group, before the call launches anything,
    so a rejected input or a different call stops every rank before any kernel waits for a peer.
    Costs a host round trip per call (the ranks' hosts meet; their GPUs do not wait)."""

    def __init__(self, group: dist.ProcessGroup, rank: int, timeout_s: float) -> None:
        self.group, self.rank, self.timeout_s = group, rank, timeout_s

    def verify(self, stamp: CallStamp) -> None:
        """call_check.verify on every rank's stamp; CommTimeoutError when a peer does not come."""
        mine = torch.tensor(stamp.words, dtype=torch.int64)
        everyone = [torch.empty_like(mine) for _ in range(self.group.size())]
        try:
            self.group.allgather([everyone], [mine]).wait(timedelta(seconds=self.timeout_s))
        except RuntimeError as error:
            if "timeout" in str(error).lower() or "timed out" in str(error).lower():
                raise CommTimeoutError(self.rank, -1, "host call check", self.timeout_s) from error
            raise
        verify(stamp, [t.tolist() for t in everyone], self.rank)
