"""What happens to a process's open Buffers when it exits, with or without moe_ep.launch.

A two-rank gloo script that made a Buffer, called it and exited aborted in 4 of 10 runs on
2026-12-05 ("terminate called without an active exception", SIGABRT in the interpreter's teardown);
a gc.collect() before the teardown, or deleting the Buffer and collecting, made 10 of 10 exit cleanly
(objects in reference cycles are otherwise finalized while torch.distributed is being torn down).
So the first Buffer a process makes registers `leave_open_buffers` at exit: every open Buffer is
left in creation order (the same on every rank), each rank waiting a bounded time for its peers
(Backend.leave); NVSHMEM is finalized where the hook closed Buffers and every one closed cleanly;
then the cycles are collected, all before the interpreter's teardown begins.
"""
from __future__ import annotations

import atexit
import gc
import sys
import weakref
from typing import Optional, Protocol

# How long a Buffer waits at exit for its peers to reach exit too before it gives itself up alone.
EXIT_WAIT_S = 300.0


class _Leaving(Protocol):
    """What this module needs of a Buffer (moe_ep.comm.buffer.Buffer)."""

    rank: int

    def leave(self, timeout_s: float) -> bool: ...


# The Buffers not yet closed, by buffer_id (creation order, the same on every rank of a group).
_open: "weakref.WeakValueDictionary[int, _Leaving]" = weakref.WeakValueDictionary()
_registered = False  # leave_open_buffers runs at exit


def track(buffer_id: int, buf: _Leaving) -> None:
    """Notes an open Buffer; the first one registers leave_open_buffers at exit (local, no collective)."""
    global _registered
    if not _registered:
        atexit.register(leave_open_buffers)
        _registered = True
    _open[buffer_id] = buf


def untrack(buffer_id: int) -> None:
    """A Buffer closed, aborted or left: nothing to do for it at exit."""
    _open.pop(buffer_id, None)


def open_buffers() -> list[_Leaving]:
    """This process's Buffers that are still referenced and not closed, in creation order."""
    return [_open[i] for i in sorted(_open.keys())]


def leave_open_buffers(timeout_s: float = EXIT_WAIT_S, finalize: Optional[bool] = None) -> bool:
    """Leaves this process's open Buffers in creation order: each closes with its peers, or, where they
    do not come within timeout_s, gives itself up alone (Buffer.abort); then collects the cycles left.
    NVSHMEM is finalized (collective over its PEs) where every Buffer closed with its peers and
    `finalize` says so; None: only where this call closed any, since every peer then got here too (a
    program that closed its Buffers itself may have peers that leave without this, e.g. by os._exit:
    finalizing would wait for them forever, as a test worker did on 2026-12-05). Returns whether every
    Buffer closed with its peers."""
    from .backends.symmetric import NvshmemSession

    left = open_buffers()
    clean = True
    for buf in left:
        if not buf.leave(timeout_s):
            clean = False
            print(f"moe_ep: rank {buf.rank} gave its Buffer up at exit: not every rank of its group reached exit "
                  f"within {timeout_s} s", file=sys.stderr)
    if clean and (finalize if finalize is not None else bool(left)):
        try:
            NvshmemSession.shutdown()
        except RuntimeError as error:  # a Buffer dropped without close() still holds NVSHMEM
            print(f"moe_ep: NVSHMEM stays up at exit: {error}", file=sys.stderr)
    gc.collect()  # the cycles left (ctypes' loader of NVSHMEM's host library among them), while torch is whole
    return clean
