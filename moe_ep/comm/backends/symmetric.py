"""NVSHMEM for the native backends: one process-wide session (bootstrap over a torch.distributed group,
symmetric heap) shared by every Buffer and zero-copy torch views of symmetric memory. The host-mapped
error state that turns a kernel's timeout into CommTimeoutError is moe_ep.comm.errors.ErrorWatch."""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from types import ModuleType
from typing import ClassVar, Optional

import torch
import torch.distributed as dist

from .. import _native, topology
from ..config import HEAP_GRANULARITY_BYTES, HEAP_HEADROOM_BYTES
from ..errors import ErrorWatch, PeersLostError

logger = logging.getLogger("moe_ep")

# The NVSHMEM variables that decide how traffic between nodes runs: reported when NVSHMEM starts
# and by `python -m moe_ep.info`.
TRANSPORT_VARS = ("NVSHMEM_REMOTE_TRANSPORT", "NVSHMEM_IB_ENABLE_IBGDA", "NVSHMEM_IBGDA_NIC_HANDLER",
                  "NVSHMEM_ENABLE_NIC_PE_MAPPING", "NVSHMEM_HCA_LIST", "NVSHMEM_HCA_PE_MAPPING",
                  "NVSHMEM_DISABLE_NVLS")


# Set by moe_ep.comm._C just before NVSHMEM's init where the environment has no value (its one owner:
# csrc/runtime/bootstrap.cpp): NVLink multicast stays off unless the user asks for it.
NATIVE_DEFAULTS = {"NVSHMEM_DISABLE_NVLS": "1"}


def nvshmem_defaults(spans_hosts: bool) -> dict[str, str]:
    """What moe_ep sets here before NVSHMEM's init where the environment has no value. Across hosts:
    IBGDA, so the kernels' puts and signals go from the GPU to the NIC, not through NVSHMEM's CPU
    proxy thread."""
    return {"NVSHMEM_IB_ENABLE_IBGDA": "1"} if spans_hosts else {}


def apply_nvshmem_defaults(spans_hosts: bool) -> str:
    """Sets nvshmem_defaults where the user's environment has none (the user's value wins) and
    returns one line saying what moe_ep sets and what it leaves as the user had it."""
    users = {key: os.environ[key] for key in TRANSPORT_VARS if key in os.environ}
    for key, value in nvshmem_defaults(spans_hosts).items():
        os.environ.setdefault(key, value)
    ours = {k: v for k, v in {**nvshmem_defaults(spans_hosts), **NATIVE_DEFAULTS}.items() if k not in users}
    return (f"moe_ep: starting NVSHMEM {'across hosts' if spans_hosts else 'on one host'}; set by moe_ep: "
            + (", ".join(f"{k}={v}" for k, v in ours.items()) or "nothing")
            + "; as the user had them: " + (", ".join(f"{k}={v}" for k, v in users.items()) or "nothing"))


class _DeviceMemory:
    """Raw device bytes offered to torch through __cuda_array_interface__ (version 3)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "strides": None, "version": 3,
            "stream": None,
        }


def device_view(ptr: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A torch tensor over existing device memory at `ptr` (no copy; the caller keeps the memory alive).

    The bytes go through __cuda_array_interface__ as uint8 and are reinterpreted in torch, since the
    interface cannot express bf16 or fp8.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    raw = torch.as_tensor(_DeviceMemory(ptr, nbytes), device=device)
    if nbytes and (raw.data_ptr() != ptr or raw.device != device):
        raise RuntimeError(f"torch did not view device memory 0x{ptr:x} in place on {device} "
                           f"(got 0x{raw.data_ptr():x} on {raw.device})")
    return raw.view(dtype).view(shape)


@dataclass
class SymmetricTensor:
    """A symmetric-heap allocation: this rank's torch view and its address at every rank."""

    tensor: torch.Tensor  # zero-copy torch view of this rank's symmetric allocation
    ptr: int  # its device address
    peer_ptrs: list[int]  # address of the same allocation at every rank, as seen from this GPU (own at [rank])


@dataclass
class _Heap:
    """The process-wide NVSHMEM state that sessions share."""

    native: ModuleType
    ranks: tuple[int, ...]  # global ranks of the group NVSHMEM was started over, in group order
    device: torch.device
    capacity: int  # NVSHMEM_SYMMETRIC_SIZE it was started with
    reserved: int = 0  # sum of the open sessions' heap_bytes
    holders: int = 0  # open sessions
    lost: Optional[str] = None  # why NVSHMEM can no longer be used in this process (a peer went silent)


@dataclass(frozen=True)
class SymmetricHeapUsage:
    """This process's NVSHMEM symmetric heap: its size and what the open native Buffers reserved of it."""

    capacity_bytes: int  # NVSHMEM_SYMMETRIC_SIZE it was started with
    reserved_bytes: int  # the open Buffers' heap_bytes, summed
    buffers: int  # open native Buffers


def symmetric_heap_usage() -> Optional[SymmetricHeapUsage]:
    """The heap of this process's NVSHMEM, or None while NVSHMEM is not started (local; no sync)."""
    heap = NvshmemSession._heap
    return None if heap is None else SymmetricHeapUsage(heap.capacity, heap.reserved, heap.holders)


def _cuda_device(device: torch.device) -> torch.device:
    device = torch.device(device)
    return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())


def _native_for_session() -> ModuleType:
    """moe_ep.comm._C, or a RuntimeError naming everything that rules NVSHMEM out on this machine."""
    reasons = []
    if not torch.cuda.is_available():
        reasons.append("no CUDA device is available (torch.cuda.is_available() is False)")
    ok, why = _native.available()
    if not ok:
        reasons.append(why)
    if reasons:
        raise RuntimeError("moe_ep: cannot start an NVSHMEM session: " + "; ".join(reasons))
    return _native.load()


class NvshmemSession:
    """One Buffer's share of the process-wide NVSHMEM state.

    The first acquire bootstraps NVSHMEM over the group; later ones share it while its heap has room.
    Every acquire, release, alloc and free is collective: all ranks of the group call them in the
    same order with the same sizes.
    """

    _heap: ClassVar[Optional[_Heap]] = None

    def __init__(self, heap: _Heap, rank: int, heap_bytes: int) -> None:
        self._shared = heap
        self._heap_bytes = heap_bytes
        self._allocations: list[SymmetricTensor] = []
        self._watches: list[ErrorWatch] = []
        self._released = False
        self.rank = rank
        self.nranks = len(heap.ranks)
        self.device = heap.device

    @classmethod
    def acquire(cls, group: Optional[dist.ProcessGroup], device: torch.device, heap_bytes: int) -> NvshmemSession:
        """Collective: a session over `group` on `device` whose allocations take up to `heap_bytes`."""
        native = _native_for_session()
        group = group if group is not None else dist.group.WORLD
        device = _cuda_device(device)
        ranks = tuple(dist.get_process_group_ranks(group))
        cls.check_usable()
        heap = cls._heap
        if heap is not None and heap.holders == 0 and (
                heap.ranks != ranks or heap.device != device or heap_bytes > heap.capacity):
            cls.shutdown()  # idle and unfit: start again at the size and ranks needed
            heap = None
        if heap is not None:
            if heap.ranks != ranks or heap.device != device:
                raise RuntimeError(
                    f"moe_ep: NVSHMEM already runs over ranks {list(heap.ranks)} on {heap.device} in this process; "
                    f"close its {heap.holders} Buffer(s) before using ranks {list(ranks)} on {device}")
            if heap.reserved + heap_bytes > heap.capacity:
                raise RuntimeError(
                    f"moe_ep: the NVSHMEM heap has {heap.capacity} bytes, {heap.reserved} of them reserved by "
                    f"{heap.holders} open Buffer(s), and this Buffer needs {heap_bytes}: close the other Buffers "
                    "(the heap is then started again at the size needed)")
        else:
            heap = cls._start(native, group, ranks, device, heap_bytes)
        heap.holders += 1
        heap.reserved += heap_bytes
        return cls(heap, dist.get_rank(group), heap_bytes)

    @classmethod
    def check_usable(cls) -> None:
        """Raises RuntimeError when a peer went silent earlier in this process (local: call it before any
        collective, which would wait for that peer)."""
        heap = cls._heap
        if heap is not None and heap.lost is not None:
            raise PeersLostError(
                f"moe_ep: NVSHMEM in this process lost its peers ({heap.lost}); it cannot be finalized or started "
                "again without every PE, so a native Buffer needs a new process (e.g. torchrun --max-restarts); "
                "backend='reference' works on a new group")

    @classmethod
    def _start(cls, native: ModuleType, group: dist.ProcessGroup, ranks: tuple[int, ...], device: torch.device,
               heap_bytes: int) -> _Heap:
        """Bootstraps NVSHMEM: sets its defaults (apply_nvshmem_defaults), then group rank 0 creates the
        unique id and every rank initialises from it."""
        rank = dist.get_rank(group)
        capacity = -(-(heap_bytes + HEAP_HEADROOM_BYTES) // HEAP_GRANULARITY_BYTES) * HEAP_GRANULARITY_BYTES
        with torch.cuda.device(device):
            logger.info(apply_nvshmem_defaults(spans_hosts=len(set(topology.hostnames(group))) > 1))
            uid = [native.get_unique_id() if rank == 0 else None]
            dist.broadcast_object_list(uid, src=dist.get_global_rank(group, 0), group=group)
            native.init(uid[0], rank, len(ranks), device.index, capacity)
        cls._heap = _Heap(native=native, ranks=ranks, device=device, capacity=capacity)
        return cls._heap

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> SymmetricTensor:
        """Collective: a zero-filled symmetric tensor; freed by free() or at release()."""
        native = self._shared.native
        nbytes = math.prod(shape) * dtype.itemsize
        with torch.cuda.device(self.device):
            ptr = native.sym_malloc(max(nbytes, 1))
        peer_ptrs = [native.peer_ptr(ptr, pe) for pe in range(self.nranks)]
        tensor = SymmetricTensor(device_view(ptr, tuple(shape), dtype, self.device), ptr, peer_ptrs)
        self._allocations.append(tensor)
        return tensor

    def free(self, t: SymmetricTensor) -> None:
        """Collective: frees `t` once every rank has stopped using it; its tensor must not be used after."""
        self._allocations = [a for a in self._allocations if a is not t]
        with torch.cuda.device(self.device):
            self._shared.native.sym_free(t.ptr)

    def error_state(self, timeout_s: Optional[float] = None, num_experts: Optional[int] = None) -> ErrorWatch:
        """A fresh ErrorWatch (freed at release); `timeout_s` and `num_experts` go into its errors' messages."""
        watch = ErrorWatch(self._shared.native, self.device, timeout_s, num_experts)
        self._watches.append(watch)
        return watch

    def abandon(self, why: str) -> None:
        """Local (no collective): gives up this session after a peer went silent, without freeing its
        symmetric memory (NVSHMEM's free waits for every PE). NVSHMEM stays up but unusable in this process."""
        if self._released:
            return
        self._released = True
        self._allocations = []
        for watch in self._watches:
            watch.close()
        heap = self._shared
        heap.holders -= 1
        heap.reserved -= self._heap_bytes
        heap.lost = why

    def release(self) -> None:
        """Collective: frees this session's allocations and error states (NVSHMEM stays up: see shutdown)."""
        if self._released:
            return
        self._released = True
        for t in list(self._allocations):
            self.free(t)
        for watch in self._watches:
            watch.close()
        heap = self._shared
        heap.holders -= 1
        heap.reserved -= self._heap_bytes

    @classmethod
    def shutdown(cls) -> None:
        """Collective: finalizes NVSHMEM once no session holds it. NVSHMEM otherwise stays up after
        the last Buffer closes, so the next Buffer that fits starts without a new bootstrap (seconds)."""
        heap = cls._heap
        if heap is None or heap.lost is not None:  # finalize would wait for the lost peers forever
            return
        if heap.holders:
            raise RuntimeError(f"moe_ep: {heap.holders} Buffer(s) still use NVSHMEM; close them first")
        with torch.cuda.device(heap.device):
            heap.native.finalize()
        cls._heap = None
