"""Multi-process test harness: spawn R ranks once and run many cases inside them.

backend="gpu" places R ranks on the G GPUs present, R / G per GPU: an NCCL group when every rank has
a GPU of its own, else a gloo group with ranks sharing GPUs (NVSHMEM's multi-process-per-GPU mode,
docs/one_gpu.md). Tests build their Buffers with device=device(), which is right in both cases.
"""
from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import sys
import time
import traceback
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_ep.launch import plan

_GPU_ENV = {
    "NVSHMEM_REMOTE_TRANSPORT": "none",
    "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo",
    "NVSHMEM_DISABLE_NVLS": "1",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
}


# The most ranks sharing a GPU whose host waits spin (CUDA's default with a CPU each); beyond it (the
# 32- and 64-rank runs, more processes than the machine has CPUs) they sleep: _sleeping_host_waits.
SPINNING_RANKS_PER_GPU = 8

# After a rank fails, how long its peers get to finish (or fail) before they are killed.
FAILED_PEER_GRACE_S = 20.0

_STACKS_FILE: list = []  # a worker's stack-dump file, open while the worker lives (faulthandler needs it)


def rendezvous() -> dist.TCPStore:
    """The ranks' rendezvous store, served by the parent for the run's whole life on a port the OS
    picks: a port found free and then let go could be taken by another run's sockets (NVSHMEM's
    bootstrap, another lane's store) before rank 0 binds it, as seen once in the GPU suite (EADDRINUSE)."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def join_group(backend: str, rank: int, world_size: int, port: int, dev: Optional[torch.device]) -> None:
    """This rank joins the default process group through the parent's rendezvous store at `port`."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            device_id=dev if backend == "nccl" else None)


def device() -> torch.device:
    """This worker's device: its GPU in a backend="gpu" or "nccl" run, else the CPU."""
    return torch.device(os.environ.get("MOE_EP_TEST_DEVICE", "cpu"))


def _sleeping_host_waits(index: int) -> None:
    """Host waits for GPU `index` sleep instead of spinning (CU_CTX_SCHED_BLOCKING_SYNC on its primary
    context, before torch makes it): with more ranks than CPUs, spinning ranks would take the CPUs
    from the ranks whose host work (gloo, launches) everyone waits for."""
    cuda = ctypes.CDLL("libcuda.so.1")
    set_flags = getattr(cuda, "cuDevicePrimaryCtxSetFlags_v2", None) or cuda.cuDevicePrimaryCtxSetFlags
    dev = ctypes.c_int()
    if cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(dev), index) == 0:
        set_flags(dev, 4)


def setup_gpu_rank(rank: int, world_size: int, backend: str = "gpu") -> tuple[torch.device, str]:
    """In a fresh rank process: the GPU environment, this rank's GPU as the current device (what
    device() returns) and the process-group backend to use; backend "gpu" or "nccl" as in run_workers."""
    for key, value in _GPU_ENV.items():
        os.environ.setdefault(key, value)
    # moe_ep.launch.plan places the ranks as torchrun's would be: R / G per GPU, or one each for "nccl"
    placement = plan(rank, world_size, torch.cuda.device_count(), "cuda", 1 if backend == "nccl" else None)
    dev, backend = placement.device, placement.backend
    if placement.ranks_per_gpu > SPINNING_RANKS_PER_GPU:
        _sleeping_host_waits(dev.index)
    torch.cuda.set_device(dev)
    os.environ["MOE_EP_TEST_DEVICE"] = str(dev)
    return dev, backend


def _worker(rank: int, world_size: int, port: int, backend: str, fn: Callable, args: tuple, errors: Any) -> None:
    # _stop: where a rank that did not finish waits, to stderr or to the file run_gpu_suite.sh keeps
    stacks = os.environ.get("MOE_EP_TEST_STACKS")
    _STACKS_FILE.append(open(stacks, "a") if stacks else sys.stderr)
    faulthandler.register(signal.SIGUSR1, file=_STACKS_FILE[-1], all_threads=True)
    try:
        dev: Optional[torch.device] = None
        if backend in ("gpu", "nccl"):
            dev, backend = setup_gpu_rank(rank, world_size, backend)
        else:
            torch.set_num_threads(1)
        join_group(backend, rank, world_size, port, dev)
        fn(rank, world_size, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise SystemExit(1)
    # Done: leave without tearing the group down. Interpreter and library teardown after a peer has
    # gone can abort inside gloo ("terminate called without an active exception", seen once in CI's
    # ~200 spawns), which would fail a rank whose work all passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _stop(procs: list) -> list[int]:
    """Ranks still running print every thread's stack to stderr (the test's captured output), then are
    killed; returns their ranks."""
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        os.kill(procs[r].pid, signal.SIGUSR1)
    if hung:
        time.sleep(2.0)
        where = os.environ.get("MOE_EP_TEST_STACKS", "above")
        print(f"ranks {hung} did not finish: their stacks are {where}", file=sys.stderr, flush=True)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return hung


def _ended(procs: list) -> dict[int, int]:
    """rank -> exit code of each rank that has ended unsuccessfully so far (negative: killed by that signal)."""
    return {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}


def _causes(ended: dict[int, int], reported: set[int]) -> str:
    """'rank R was killed by SIGNAME' / 'rank R exited with code C' for the ranks that left no traceback,
    e.g. one the kernel's OOM killer took."""
    def cause(code: int) -> str:
        return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    return ", ".join(f"rank {r} {cause(code)}" for r, code in sorted(ended.items()) if r not in reported)


def run_workers(world_size: int, fn: Callable, *args: Any, backend: str = "gloo", timeout_s: float = 600) -> None:
    """Run fn(rank, world_size, *args) in `world_size` fresh processes; re-raise any failure.

    backend: "gloo" (CPU), "gpu" (ranks on the GPUs present, sharing them when fewer than the ranks)
    or "nccl" (a GPU per rank)."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    store = rendezvous()  # held here until every rank has ended
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, store.port, backend, fn, args, errors), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):  # a rank failed: its peers may wait for it
                deadline = min(deadline, time.monotonic() + FAILED_PEER_GRACE_S)
            time.sleep(0.1)
    finally:  # also when pytest is interrupted (run_gpu_suite.sh's per-file limit sends SIGINT)
        ended = _ended(procs)  # before _stop kills the rest
        hung = _stop(procs)
    reports = []
    while not errors.empty():
        reports.append(errors.get())
    silent = _causes(ended, {r for r, _ in reports})
    if reports:
        reports.sort()
        raise AssertionError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in reports)
                             + (f"--- without a traceback: {silent}" if silent else ""))
    if hung:
        raise AssertionError(f"ranks {hung} did not finish within {timeout_s} s (or {FAILED_PEER_GRACE_S} s after "
                             f"a peer failed){'; before that ' + silent if silent else ''}")
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise AssertionError(f"ranks exited with codes {bad}")


def _native_built() -> bool:
    try:
        from moe_ep.comm import _native
    except ImportError:
        return False
    return _native.available()[0]


def requires_gpus(n: int = 1) -> pytest.MarkDecorator:
    """Skip unless n CUDA devices are present and moe_ep.comm._C is built. Ranks of a backend="gpu" run
    share the GPUs, so one GPU serves every world size."""
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < n:
        return pytest.mark.skip(reason=f"needs {n} GPU(s), found {have}")
    if not _native_built():
        return pytest.mark.skip(reason="moe_ep.comm._C is not built")
    return pytest.mark.gpu


def requires_separate_gpus(n: int, why: str) -> pytest.MarkDecorator:
    """Skip unless n CUDA devices are present (a GPU per rank, NCCL) and moe_ep.comm._C is built; `why`
    says what needs them."""
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < n:
        return pytest.mark.skip(reason=f"needs {n} separate GPUs ({why}), found {have}")
    return requires_gpus(n)
