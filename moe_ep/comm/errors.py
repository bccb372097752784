"""The errors moe_ep raises beyond Python's own (docs/api.md, Errors), and where a kernel's record of a
failure becomes one of them (ErrorWatch: the host-mapped ErrorState of csrc/runtime/comm.h, which every
native kernel writes a timeout, a stamp mismatch or a bad expert id into, read by the host after the
call's launches).

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

import ctypes
from types import ModuleType
from typing import Callable, Optional

import torch


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


class _ErrorState(ctypes.Structure):
    """Host view of comm.h's ErrorState (same fields, same order: ErrorWatch checks each field's offset and
    size against _C's error_state_fields)."""

    _fields_ = [("code", ctypes.c_int), ("rank", ctypes.c_int), ("phase", ctypes.c_int), ("peer", ctypes.c_int),
                ("stamp_slot", ctypes.c_int), ("bad_claim", ctypes.c_int), ("bad_id", ctypes.c_int),
                ("bad_token", ctypes.c_int), ("bad_k", ctypes.c_int), ("bad_value", ctypes.c_longlong)]


def check_error_state_layout(native: ModuleType) -> None:
    """RuntimeError unless every field of the mirror has the name, offset and size of _C's ErrorState, in order
    (a mirror that only had the right size could still read each field from the wrong place)."""
    mirror = [(name, getattr(_ErrorState, name).offset, getattr(_ErrorState, name).size)
              for name, _ in _ErrorState._fields_]
    theirs = [(str(name), int(offset), int(size)) for name, offset, size in native.error_state_fields()]
    if mirror != theirs or native.error_state_bytes() != ctypes.sizeof(_ErrorState):
        raise RuntimeError(f"moe_ep.comm._C's ErrorState is {theirs} ({native.error_state_bytes()} bytes), the Python "
                           f"mirror {mirror} ({ctypes.sizeof(_ErrorState)} bytes): reinstall moe_ep so both come from "
                           "one build")


class ErrorWatch:
    """One host-mapped ErrorState: kernels get `device_ptr` (Comm::error) and record in it the first
    timeout, the first stamp exchange that found the ranks' calls differ, and the first expert id outside
    [-1, num_experts) they read. `on_mismatch(slot)` (set by the backend that owns the stamp exchange)
    raises the mismatch from every rank's stamp in that slot of its table."""

    def __init__(self, native: ModuleType, device: Optional[torch.device] = None, timeout_s: Optional[float] = None,
                 num_experts: Optional[int] = None) -> None:
        check_error_state_layout(native)
        self._native = native
        self._host_ptr, self.device_ptr = native.alloc_error_state()
        self._state = _ErrorState.from_address(self._host_ptr)
        self._phase_names: list[str] = native.phase_names()
        self._mismatch_code: int = native.ERROR_MISMATCH
        self.device = device
        self.timeout_s = timeout_s
        self.num_experts = num_experts
        self.on_mismatch: Optional[Callable[[int], None]] = None

    def check(self, timeouts_only: bool = False) -> None:
        """Raises what a kernel recorded and clears the record: CommTimeoutError for a timeout, what
        on_mismatch raises for calls that differ (CallMismatchError, PeerInputError), else (unless
        `timeouts_only`) BadExpertIdError for an expert id out of range.

        Before it raises a timeout or a mismatch it waits for the device (outside a CUDA graph capture):
        every kernel of the failed call still queued then returns at once, seeing the record, and none
        can find it cleared. A call checks before it launches anything and once all of its kernels are
        launched, so a rank that raises has made the same launches as its peers and the next call finds
        them in step. Bad ids are read once the kernels that may record them finished (a kernel writes
        `code` first).
        """
        if self._host_ptr == 0:
            return
        state = self._state
        if state.code != 0:
            if self.device is not None and self.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
                torch.cuda.synchronize(self.device)
            code, rank, phase, peer, slot = state.code, state.rank, state.phase, state.peer, state.stamp_slot
            ctypes.memset(self._host_ptr, 0, ctypes.sizeof(_ErrorState))
            name = self._phase_names[phase] if 0 <= phase < len(self._phase_names) else f"unknown phase {phase}"
            if code == self._mismatch_code and self.on_mismatch is not None:
                self.on_mismatch(slot)
                return
            raise CommTimeoutError(rank, peer, name, self.timeout_s)
        if state.bad_id != 0 and not timeouts_only:
            token, k, value = state.bad_token, state.bad_k, state.bad_value
            ctypes.memset(self._host_ptr, 0, ctypes.sizeof(_ErrorState))
            bound = f"[-1, {self.num_experts})" if self.num_experts is not None else "[-1, num_experts)"
            raise BadExpertIdError(f"topk_idx[{token}, {k}] = {value}: expert ids must lie in {bound} (the kernels "
                                   "treated it as -1; this call's results are not valid)")

    def close(self) -> None:
        """Frees the ErrorState (once no kernel uses it); later checks are no-ops."""
        if self._host_ptr:
            self._native.free_error_state(self._host_ptr)
            self._host_ptr, self.device_ptr, self._state = 0, 0, None
