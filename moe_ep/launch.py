"""Where a torchrun rank runs: its device and its torch.distributed backend, for the entry points
(moe_ep.train, moe_ep.bench) and for users' scripts.

With at least one GPU per local rank every rank gets its own GPU and an NCCL group. With fewer GPUs
than local ranks, `ranks_per_gpu` ranks share each GPU (NVSHMEM runs several processes on one GPU)
over a gloo group, since NCCL refuses two ranks on one GPU: correct, and good for development and CI,
but the ranks are time-sliced, so timings there say nothing about links (docs/one_gpu.md).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

# The NVSHMEM settings a machine without InfiniBand needs (the native module keeps NVLink multicast
# off by itself): set where the environment has no value when ranks share a GPU.
SHARED_GPU_ENV = {"NVSHMEM_REMOTE_TRANSPORT": "none", "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo"}


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
    return placement
