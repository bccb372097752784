"""Where a torchrun rank runs: its device and its torch.distributed backend, for the entry points
(moe_ep.train, moe_ep.bench) and for users' scripts.

With at least one GPU per local rank every rank gets its own GPU and an NCCL group. With fewer GPUs
than local ranks, `ranks_per_gpu` ranks share each GPU (NVSHMEM runs several processes on one GPU)
over a gloo group, since NCCL refuses two ranks on one GPU: correct, and good for development and CI,
but the ranks are time-sliced, so timings there say nothing about links (docs/one_gpu.md).

init_distributed also registers `shutdown` to run at exit: PyTorch's gloo aborts the process
("terminate called without an active exception", SIGABRT) when its group and threads are still alive
while the interpreter shuts down, and a rank that destroys its group while a peer is still in a
collective makes that peer fail; so every rank waits for the others, closes its open Buffers,
finalizes NVSHMEM and only then destroys the group.
"""
from __future__ import annotations

import atexit
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import Optional

import torch
import torch.distributed as dist

from .comm import at_exit

# The NVSHMEM settings a machine without InfiniBand needs (the native module keeps NVLink multicast
# off by itself): set where the environment has no value when ranks share a GPU.
SHARED_GPU_ENV = {"NVSHMEM_REMOTE_TRANSPORT": "none", "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo"}

# How long a rank that reached exit waits there for its peers before it gives up the collective steps
# of shutdown (a peer that died is seen at once: its connections close).
EXIT_BARRIER_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Placement:
    """One rank's device and process-group backend."""

    device: torch.device  # cuda:i, or cpu
    ranks_per_gpu: int  # ranks sharing this rank's GPU (1: a GPU of its own); 0 on CPU
    backend: str  # the torch.distributed backend of the default group: "nccl" or "gloo"

    @property
    def shared_gpu(self) -> bool:
        """Ranks share this GPU: results are valid, timings say nothing about links."""
        return self.ranks_per_gpu > 1


def plan(local_rank: int, local_world: int, num_gpus: int, device: str = "auto",
         ranks_per_gpu: Optional[int] = None) -> Placement:
    """The placement of local rank `local_rank` of `local_world` on a host with `num_gpus` GPUs.

    device "auto" takes CUDA when there is a GPU, "cpu" never does. ranks_per_gpu None gives each rank
    its own GPU when there are enough, else spreads the local ranks evenly over the GPUs."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if ranks_per_gpu is not None and (not isinstance(ranks_per_gpu, int) or ranks_per_gpu < 1):
        raise ValueError(f"ranks_per_gpu must be a positive int, got {ranks_per_gpu!r}")
    use_cuda = device == "cuda" or (device == "auto" and num_gpus > 0)
    if not use_cuda:
        if ranks_per_gpu is not None:
            raise ValueError("ranks_per_gpu needs CUDA devices; this rank runs on cpu")
        return Placement(torch.device("cpu"), 0, "gloo")
    if num_gpus == 0:
        raise RuntimeError("device='cuda' but torch sees no CUDA device")
    if ranks_per_gpu is None:
        ranks_per_gpu = -(-local_world // num_gpus)
    if local_world % ranks_per_gpu:
        raise ValueError(f"ranks_per_gpu ({ranks_per_gpu}) must divide the ranks on this host ({local_world})")
    gpus = local_world // ranks_per_gpu
    if gpus > num_gpus:
        raise ValueError(f"{local_world} ranks at {ranks_per_gpu} per GPU need {gpus} GPUs; this host has {num_gpus}")
    return Placement(torch.device("cuda", local_rank // ranks_per_gpu), ranks_per_gpu,
                     "nccl" if ranks_per_gpu == 1 else "gloo")


def init_distributed(device: str = "auto", ranks_per_gpu: Optional[int] = None) -> Placement:
    """Initialises the default process group for this torchrun rank (one rank without torchrun) and
    makes its GPU the current device; returns where it runs."""
    if "RANK" not in os.environ:  # plain `python -m ...`: one rank, no torchrun
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    placement = plan(local_rank, local_world, num_gpus, device, ranks_per_gpu)
    if placement.device.type == "cuda":
        torch.cuda.set_device(placement.device)
    if placement.shared_gpu:
        for key, value in SHARED_GPU_ENV.items():
            os.environ.setdefault(key, value)
    dist.init_process_group(placement.backend)
    _register_shutdown(placement.backend)
    return placement


@dataclass
class _ExitState:
    """What shutdown needs: the gloo group its barrier uses, and whether this rank raised."""

    group: Optional[dist.ProcessGroup] = None  # None: the default group (gloo)
    failed: bool = False


_exit = _ExitState()


def _register_shutdown(backend: str) -> None:
    """Runs shutdown at exit, and notes an uncaught exception (that rank then leaves without the
    collective steps, which its peers would wait for in vain). Collective (an NCCL default group gets a
    gloo group for the exit barrier, which is where monitored_barrier's timeout exists)."""
    _exit.group = dist.new_group(backend="gloo") if backend != "gloo" else None
    _exit.failed = False
    previous = sys.excepthook

    def note_failure(kind: type[BaseException], value: BaseException, tb: Optional[TracebackType]) -> None:
        _exit.failed = True
        previous(kind, value, tb)

    sys.excepthook = note_failure
    atexit.register(shutdown)


def shutdown(timeout_s: float = EXIT_BARRIER_TIMEOUT_S) -> None:
    """Collective: leaves the default group in a safe order. Waits (at most timeout_s) until every rank
    got here, closes this rank's open Buffers in creation order, finalizes NVSHMEM and destroys the
    process groups. Runs at exit after init_distributed (a no-op once the group is gone); call it
    earlier to end the group before other work. A rank that raised, or whose peers did not all
    arrive, only leaves: its exit status already tells the failure."""
    if not dist.is_initialized() or _exit.failed:
        return
    try:
        dist.monitored_barrier(group=_exit.group, timeout=timedelta(seconds=timeout_s))
    except RuntimeError as error:
        print(f"moe_ep.launch: rank {dist.get_rank()} leaves without closing its Buffers or the group: not every "
              f"rank reached exit within {timeout_s} s ({error})", file=sys.stderr)
        return
    at_exit.leave_open_buffers(timeout_s, finalize=True)  # every rank passed the barrier above
    dist.destroy_process_group()
