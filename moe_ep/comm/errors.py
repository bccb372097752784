"""The errors moe_ep raises beyond Python's own (docs/api.md, Errors).

- CommTimeoutError: a wait for a peer gave up (any backend); names this rank, the peer and the phase.
- ValueError / TypeError: bad input, raised on the rank that passed it once that rank has taken its
  part in the call on stand-in inputs, so its peers' calls complete (an expert id out of range is
  found by the native kernels without a host sync and raised when the call's results reach the host).
- RuntimeError "lost its peers": NVSHMEM in this process cannot be used again after a peer went
  silent (moe_ep.comm.backends.symmetric.NvshmemSession.check_usable).
"""
from __future__ import annotations

from typing import Optional


def seconds(t: float) -> str:
    """A duration as written in messages: one decimal where that is exact (100.0, 2.5), else three
    significant digits, so that 0.05 s does not print as 0.1 s."""
    return f"{t:.1f}" if round(t, 1) == t else f"{t:.3g}"


class CommTimeoutError(RuntimeError):
    """A wait for a peer gave up; names this rank, the peer (-1: not known), the phase and the timeout,
    and `detail`: what the transport said (e.g. gloo's first line), where it said something."""

    def __init__(self, rank: int, peer: int, phase: str, timeout_s: Optional[float], detail: str = "") -> None:
        self.rank, self.peer, self.phase, self.timeout_s, self.detail = rank, peer, phase, timeout_s, detail
        after = f" after {seconds(timeout_s)} s" if timeout_s is not None else ""
        whom = f"rank {peer}" if peer >= 0 else "a peer"
        said = f" ({detail})" if detail else ""
        super().__init__(f"moe_ep rank {rank}: timed out{after} in phase '{phase}' waiting for {whom}{said}")

    def __reduce__(self):
        return CommTimeoutError, (self.rank, self.peer, self.phase, self.timeout_s, self.detail)


class BadExpertIdError(ValueError):
    """An expert id outside [-1, num_experts) in topk_idx; the call treated it as -1."""


class PeersLostError(RuntimeError):
    """NVSHMEM in this process lost its peers (one went silent): it cannot be finalized or started again."""
