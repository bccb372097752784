"""Multi-process test harness: spawn R ranks once and run many cases inside them."""
from __future__ import annotations

import os
import socket
import traceback
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_GPU_ENV = {
    "NVSHMEM_REMOTE_TRANSPORT": "none",
    "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo",
    "NVSHMEM_DISABLE_NVLS": "1",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, backend: str, fn: Callable, args: tuple, errors: Any) -> None:
    try:
        if backend == "nccl":
            for key, value in _GPU_ENV.items():
                os.environ.setdefault(key, value)
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(1)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            device_id=torch.device("cuda", rank) if backend == "nccl" else None,
        )
        try:
            fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise SystemExit(1)


def run_workers(world_size: int, fn: Callable, *args: Any, backend: str = "gloo", timeout_s: float = 600) -> None:
    """Run fn(rank, world_size, *args) in `world_size` fresh processes; re-raise any failure."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, backend, fn, args, errors), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    reports = []
    while not errors.empty():
        reports.append(errors.get())
    if reports:
        reports.sort()
        raise AssertionError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in reports))
    if hung:
        raise AssertionError(f"ranks {hung} did not finish within {timeout_s} s")
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise AssertionError(f"ranks exited with codes {bad}")


def _native_built() -> bool:
    try:
        from moe_ep import _native
    except ImportError:
        return False
    return _native.available()[0]


def requires_gpus(n: int) -> pytest.MarkDecorator:
    """Skip unless n CUDA devices are present and moe_ep._C is built."""
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < n:
        return pytest.mark.skip(reason=f"needs {n} GPUs, found {have}")
    if not _native_built():
        return pytest.mark.skip(reason="moe_ep._C is not built")
    return pytest.mark.gpu
