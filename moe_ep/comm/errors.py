"""The errors moe_ep raises beyond Python's own (docs/api.md, Errors).

- CommTimeoutError: a wait for a peer gave up (any backend); names this rank, the peer and the phase.
- ValueError / TypeError: bad input, raised on the rank that passed it once that rank has taken its
  part in the call on stand-in inputs (an expert id out of range is found by the native kernels
  without a host sync and raised when the call's results reach the host).
- PeerInputError (a ValueError): a peer rejected its input to the call; every other rank of the
  call raises it once the call's exchange is done, where the call checks its stamps
  (moe_ep.comm.call_check), so all ranks stay in step.
- CallMismatchError (a ValueError): the ranks made different calls (kind, order, handle or sizes),
  raised on every rank, naming each rank's call.
- RuntimeError "lost its peers": NVSHMEM in this process cannot be used again after a peer went
  silent (moe_ep.comm.backends.symmetric.NvshmemSession.check_usable).
"""
from __future__ import annotations

from typing import Optional


class CommTimeoutError(RuntimeError):
    """A wait for a peer gave up; names this rank, the peer (-1: not known), the phase and the timeout."""

    def __init__(self, rank: int, peer: int, phase: str, timeout_s: Optional[float]) -> None:
        self.rank, self.peer, self.phase, self.timeout_s = rank, peer, phase, timeout_s
        after = f" after {timeout_s:.1f} s" if timeout_s is not None else ""
        whom = f"rank {peer}" if peer >= 0 else "a peer"
        super().__init__(f"moe_ep rank {rank}: timed out{after} in phase '{phase}' waiting for {whom}")

    def __reduce__(self):
        return CommTimeoutError, (self.rank, self.peer, self.phase, self.timeout_s)


class BadExpertIdError(ValueError):
    """An expert id outside [-1, num_experts) in topk_idx; the call treated it as -1."""


class PeerInputError(ValueError):
    """Peers rejected their input to this call, which every rank then abandoned; names them and why."""

    def __init__(self, ranks: list[int], call: str, reasons: list[str]) -> None:
        self.ranks, self.call, self.reasons = ranks, call, reasons
        told = "; ".join(f"rank {r} rejected its input ({why})" for r, why in zip(ranks, reasons))
        super().__init__(f"{call}: {told}; every rank of the call raises (this rank's own input was valid)")

    def __reduce__(self):
        return PeerInputError, (self.ranks, self.call, self.reasons)


class CallMismatchError(ValueError):
    """The ranks of a Buffer made different calls (e.g. one skipped a call): raised on every rank."""

    def __init__(self, calls: str) -> None:
        self.calls = calls
        super().__init__(f"the ranks made different calls of one Buffer ({calls}); every rank must make the same "
                         "calls in the same order. Every rank raises, and the Buffer stays usable")

    def __reduce__(self):
        return CallMismatchError, (self.calls,)


class PeersLostError(RuntimeError):
    """NVSHMEM in this process lost its peers (one went silent): it cannot be finalized or started again."""
