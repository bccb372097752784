"""`torchrun --nproc-per-node 2 bench/ll_probe.py`: where the low-latency calls spend their time (L1 shape).

For 128 and 256 tokens per rank (hidden 7168, top-8 of 256 experts, FP8 dispatch, BF16 combine), on a
native Buffer (backend="nvshmem", low_latency=True):
- per kernel, the device time from torch.profiler over CALLS iterations of (L2 flush, dispatch send,
  its hook, combine send, its hook): return_recv_hook=True makes each half its own launch of the
  direction's one kernel (moe_ep::ll::dispatch / combine), so each kernel's time is its two
  halves together (the receive half includes waiting for the peer);
- the replay time of CUDA graphs holding REPS back-to-back dispatches, combines, or (dispatch,
  combine) pairs, divided by REPS: the ranks keep each other in step inside a replay, so the
  start skew between ranks is amortised and launch gaps between kernels are included.
Every figure is the median over iterations; "max" is the maximum over ranks.
"""
from __future__ import annotations

import os

for _key, _value in (("NVSHMEM_REMOTE_TRANSPORT", "none"), ("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo"),
                     ("NVSHMEM_DISABLE_NVLS", "1"), ("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):
    os.environ.setdefault(_key, _value)

import statistics  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Callable  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import moe_ep  # noqa: E402
from moe_ep.bench import n1_inputs  # noqa: E402

HIDDEN, EXPERTS, TOPK = 7168, 256, 8
TOKENS = (128, 256)
CALLS = 50  # profiled iterations
WARMUP = 5
REPS = 20  # calls captured in one graph
REPLAYS = 10  # timed replays per graph


@dataclass
class Case:
    """Inputs of one shape, and the Buffer they run on."""

    buf: moe_ep.Buffer
    x: torch.Tensor
    idx: torch.Tensor
    w: torch.Tensor
    y: torch.Tensor


def gather(value: object) -> list:
    """The value of every rank, in rank order."""
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def dispatch(c: Case, hook: bool):
    return c.buf.low_latency_dispatch(c.x, c.idx, use_fp8=True, return_recv_hook=hook)


def iteration(c: Case, flush: torch.Tensor) -> None:
    """One profiled iteration: L2 flush, then both calls with their hooks run at once."""
    flush.zero_()
    d = dispatch(c, hook=True)
    d.hook()
    comb = c.buf.low_latency_combine(c.y, c.idx, c.w, d.handle, return_recv_hook=True)
    comb.hook()


def kernel_times(c: Case, flush: torch.Tensor) -> dict[str, list[float]]:
    """Device time of every kernel per launch (us), by full kernel name; the flush is left out."""
    for _ in range(WARMUP):
        iteration(c, flush)
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            iteration(c, flush)
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA or any(f in ev.name.lower() for f in ("fill", "memset")):
            continue
        times.setdefault(ev.name, []).append(ev.time_range.end - ev.time_range.start)
    return times


def graph_us(fn: Callable[[], object]) -> float:
    """Median replay time of a graph of REPS calls of fn, per call (us)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(REPLAYS)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    us = statistics.median(start.elapsed_time(end) * 1e3 for start, end in events) / REPS
    del graph
    return us


def probe(tokens: int, flush: torch.Tensor) -> list[str]:
    """Measures one shape; returns rank 0's table lines."""
    rank = dist.get_rank()
    with moe_ep.Buffer(hidden=HIDDEN, num_experts=EXPERTS, num_topk=TOPK, max_tokens_per_rank=tokens,
                       backend="nvshmem", low_latency=True) as buf:
        x, idx, w = n1_inputs(tokens, HIDDEN, EXPERTS, TOPK, buf.device, seed=rank)
        y = torch.randn(buf.num_local_experts, buf.group_size * tokens, HIDDEN, device=buf.device).to(torch.bfloat16)
        c = Case(buf, x, idx, w, y)
        kernels = gather({name: statistics.median(t) for name, t in kernel_times(c, flush).items()})
        graphs = {"dispatch": graph_us(lambda: dispatch(c, hook=False))}
        held = dispatch(c, hook=False)  # the combine-only graph combines this dispatch's rows
        graphs["combine"] = graph_us(lambda: buf.low_latency_combine(y, idx, w, held.handle))
        graphs["dispatch+combine"] = graph_us(lambda: buf.low_latency_combine(y, idx, w, dispatch(c, hook=False).handle))
        graphs_all = gather(graphs)
    lines = [f"== {tokens} tokens per rank: kernel device time (us, median of {CALLS}, L2 flushed; "
             "send + receive halves; the receive half includes waiting for the peer)",
             f"{'max':>7} " + " ".join(f"{'rank' + str(r):>7}" for r in range(len(kernels))) + "  kernel"]
    names = sorted({n for k in kernels for n in k}, key=lambda n: -max(k.get(n, 0.0) for k in kernels))
    for name in names:
        per_rank = [k.get(name, float("nan")) for k in kernels]
        lines.append(f"{max(per_rank):7.1f} " + " ".join(f"{t:7.1f}" for t in per_rank) + f"  {name}")
    lines.append(f"-- CUDA graph of {REPS} back-to-back calls, replay time / {REPS} (us, median of {REPLAYS} replays)")
    for what in graphs:
        per_rank = [g[what] for g in graphs_all]
        lines.append(f"{max(per_rank):7.1f} " + " ".join(f"{t:7.1f}" for t in per_rank) + f"  {what}")
    return lines


def main() -> None:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    lines = []
    for tokens in TOKENS:
        lines += probe(tokens, flush)
    if dist.get_rank() == 0:
        print(f"# {torch.cuda.get_device_name()} x{dist.get_world_size()}, hidden {HIDDEN}, top-{TOPK} of {EXPERTS}")
        print("\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
