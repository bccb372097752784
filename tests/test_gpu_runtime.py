"""The NVSHMEM runtime on 2 GPUs: bootstrap over a torch.distributed group, zero-filled symmetric
tensors, a write through a peer pointer seen by its owner, shared sessions, a heap that is too small,
timeout reports, and three session lifetimes (init, shutdown, init again) in one process."""
from __future__ import annotations

import ctypes

import pytest
import torch
import torch.distributed as dist

from tests._dist import device as rank_device, requires_gpus, run_workers

pytestmark = requires_gpus()

HEAP_BYTES = 64 << 20
CUDA_MEMCPY_DEFAULT = 4


def _cudart() -> ctypes.CDLL:
    """The CUDA runtime library torch loaded, for a raw cudaMemcpy to a peer address."""
    torch.cuda.init()
    return ctypes.CDLL(f"libcudart.so.{torch.version.cuda.split('.')[0]}")


def _one_session(rank: int, world_size: int, round_: int) -> None:
    from moe_ep.comm import _native
    from moe_ep.comm.backends.symmetric import NvshmemSession
    from moe_ep.comm.errors import CommTimeoutError

    native = _native.load()
    device = rank_device()
    group = dist.group.WORLD
    session = NvshmemSession.acquire(group, device, HEAP_BYTES)
    assert native.is_initialized()
    assert (native.my_pe(), native.n_pes()) == (rank, world_size) == (session.rank, session.nranks)

    rows, hidden = 37 + 11 * round_, 96
    x = session.alloc((rows, hidden), torch.bfloat16)
    assert x.tensor.shape == (rows, hidden) and x.tensor.dtype == torch.bfloat16 and x.tensor.device == device
    assert x.tensor.data_ptr() == x.ptr and x.peer_ptrs[rank] == x.ptr
    assert all(p != 0 for p in x.peer_ptrs), "GPUs of one node must reach each other's symmetric heap"
    assert torch.count_nonzero(x.tensor.view(torch.int16)).item() == 0, "sym_malloc must zero-fill"
    native.barrier_all()  # every rank checked its zeros before rank 0 writes into rank 1's allocation

    # Every rank draws the same random payload; rank 0 copies it into rank 1's allocation through the
    # peer address (cudaMemcpy on rank 0's GPU), rank 1 reads it through its own torch view.
    gen = torch.Generator().manual_seed(1000 + round_)
    payload = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16).to(device)
    if rank == 0:
        cudart = _cudart()
        nbytes = payload.numel() * payload.element_size()
        assert cudart.cudaMemcpy(ctypes.c_void_p(x.peer_ptrs[1]), ctypes.c_void_p(payload.data_ptr()),
                                 ctypes.c_size_t(nbytes), CUDA_MEMCPY_DEFAULT) == 0
        assert cudart.cudaDeviceSynchronize() == 0
    native.barrier_all()
    if rank == 1:
        assert torch.equal(x.tensor, payload)
    else:
        assert torch.count_nonzero(x.tensor.view(torch.int16)).item() == 0, "rank 0's own copy was not written"

    flags = session.alloc((16,), torch.int64)
    assert torch.count_nonzero(flags.tensor).item() == 0
    session.free(flags)

    second = NvshmemSession.acquire(group, device, 1 << 20)
    assert (second.rank, second.nranks, second.device) == (rank, world_size, device)
    with pytest.raises(RuntimeError, match="heap has"):
        NvshmemSession.acquire(group, device, 1 << 40)
    second.release()
    assert native.is_initialized(), "NVSHMEM must stay up while a session is open"

    watch = session.error_state(timeout_s=2.5)
    assert watch.device_ptr != 0
    watch.check()
    state = ctypes.cast(watch._host_ptr, ctypes.POINTER(ctypes.c_int * 4)).contents
    state[1], state[2], state[3] = rank, 3, 1 - rank
    state[0] = 1
    with pytest.raises(CommTimeoutError, match=rf"^moe_ep rank {rank}: timed out after 2.5 s in phase "
                                               rf"'dispatch: waiting for a peer's rows to land' waiting for rank {1 - rank}$"):
        watch.check()
    watch.check()

    assert native.sm_count(device.index) == torch.cuda.get_device_properties(device).multi_processor_count
    session.release()
    session.release()
    assert native.is_initialized(), "an idle heap stays up for the next Buffer"
    NvshmemSession.shutdown()
    assert not native.is_initialized()


def _three_lifetimes(rank: int, world_size: int) -> None:
    for round_ in range(3):
        _one_session(rank, world_size, round_)


def test_nvshmem_runtime_two_ranks() -> None:
    run_workers(2, _three_lifetimes, backend="gpu")
