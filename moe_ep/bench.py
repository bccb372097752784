"""`torchrun --nproc-per-node R -m moe_ep.bench`: time dispatch/combine as docs/benchmarks.md says.

On GPUs (NCCL group): N1 (normal mode, native backend at several SM budgets, the reference backend
on NCCL, and raw NCCL all_to_all_single moving the same bytes), L1 (low-latency) and optionally a
hidden x tokens sweep. Normal and eager low-latency calls are also timed "cold" (right after a
device sync and a host barrier, so the host's own time counts). The "layer" case times moe_ep.MoE
forward, backward and both (ms and TFLOP/s of the routing it ran) without and with overlap=True,
alternating in every iteration, the layer's communication alone (the share of it overlap hides, where
each rank has its own GPU), the row path (expert_major=False) and the FP8 experts (forward, and forward +
backward), on the native and the reference backend, beside (GPU only) the layer's grouped GEMMs alone (equal
groups, and the router's; bf16, FP8 forward and dgrad with the bf16 wgrad, the FP8 wgrad, and torch's own FP8
grouped GEMM) and a dense bf16 matmul ceiling, and a decode step of two micro-batches (MoE.start/compute/finish) interleaved and in sequence, alternating, beside the time its
expert weights take to read once per micro-batch at the HBM bandwidth measured in the same run; it runs
with one rank too. The "sm-efficiency" case (one rank, EP1) times the normal-mode dispatch and combine at
several SM budgets beside a copy of the same bytes on as many SMs (a persistent Triton kernel) and by the
copy engine. Issue 44's figures are printed, and written to the JSON ("targets"), beside their references
and goals. With --ranks-per-node K the native
N1 and L1 rows are measured a second time with the group cut into nodes of K ranks (K=1 on one
machine: every byte between GPUs takes the cross-node kernels' network leg), next to the NVLink
rows in the same table. Without GPUs (gloo): the reference backend on a small case (and the layer
case, at sizes given by --layer-*). With --ranks-per-gpu N (or fewer GPUs than ranks) N ranks share
each GPU over gloo (moe_ep.launch): such rows are labelled "shared GPU", say nothing about links and
are never drawn against the link limit. Prints the Buffers' moe_ep.Config and a table, writes JSON
(the Config recorded) and a PNG plot (by default to ~/.local/share/moe_ep/bench/<date>/, not into the
folder it runs in).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.distributed as dist

from .comm import fp8
from .moe import autograd, fp8_experts, fp8_wgrad
from .comm.buffer import Buffer, auto_backend
from .launch import init_distributed, shutdown
from .moe.experts import groups_of
from .moe.layer import MoE

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: no SM-bounded copy (the sm-efficiency case runs on a GPU only)
    triton = None

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# DeepEP V1 on our 2xH200, N1 (docs/benchmarks.md, Method): SMs -> (FP8 dispatch, BF16 dispatch, BF16 combine) us.
DEEPEP_N1 = {8: (647.9, 972.6, 999.7), 16: (344.2, 500.4, 532.3), 24: (245.1, 343.7, 400.0), 32: (193.1, 292.7, 318.1)}
# DeepEP V1 low-latency, EP2 (docs/benchmarks.md, Method): tokens -> (dispatch, combine) us.
DEEPEP_L1 = {128: (30.5, 41.2), 256: (44.8, 72.0)}
# NVLink limit per direction with int4 stores, 1024 threads, 4 loads in flight (docs/benchmarks.md), GB/s.
NVLINK_LIMIT_GBPS = {8: 349.0, 16: 343.0, 24: 346.0, 32: 349.0}
NVLINK_LIMIT_ANY_GBPS = 365.0  # 132 SMs through nvshmem_ptr
# Issue 44's goals: the layer over its grouped GEMMs alone (forward, forward + backward), a grouped GEMM's time at
# the router's groups over equal groups, the FP8 grouped GEMMs' rate, a decode step over its weight-read floor,
# and the fraction of an SM-bounded copy's rate the normal-mode kernels keep at SM_EFFICIENCY_GOAL_SMS SMs.
LAYER_FORWARD_GOAL, LAYER_FORWARD_BACKWARD_GOAL, GEMM_IMBALANCE_GOAL = 1.08, 1.05, 1.10
FP8_GEMM_TFLOPS_GOAL = 1000.0
DECODE_FLOOR_GOAL = 1.15
SM_EFFICIENCY_GOAL, SM_EFFICIENCY_GOAL_SMS = 0.8, 8


@dataclass
class Row:
    """One measured configuration (times are medians in microseconds, max over ranks)."""

    case: str
    op: str
    backend: str
    sms: Optional[int]
    tokens: int
    hidden: int
    call_us: float
    kernel_us: Optional[float]
    recv_bytes: int
    remote_bytes: int
    deepep_us: Optional[float] = None
    cold_us: Optional[float] = None  # after a device sync and a host barrier (Timer.cold_us); GPU only
    extra: dict = field(default_factory=dict)
    topology: str = ""  # "nodes x ranks per node" of the Buffer
    experts: int = 0
    topk: int = 0
    ranks_per_gpu: int = 1  # ranks sharing the GPU (Buffer.ranks_per_gpu): 0 on CPU, above 1 a shared GPU
    flop: Optional[float] = None  # floating-point operations of the call (layer case), for TFLOP/s
    spread_us: Optional[tuple[float, float]] = None  # 10th and 90th percentile of the timed calls, max over ranks
    config: Optional[dict] = None  # dataclasses.asdict of the Buffer's moe_ep.Config (None: not the native backend)

    @property
    def tflops(self) -> Optional[float]:
        return None if self.flop is None else tflops(self.flop, self.call_us)

    @property
    def shared_gpu(self) -> bool:
        """Measured with ranks time-sliced on one GPU: valid results, timings that say nothing about links."""
        return self.ranks_per_gpu > 1

    @property
    def gbps(self) -> float:
        return self.recv_bytes / (self.call_us * 1e3)

    @property
    def remote_gbps(self) -> float:
        return self.remote_bytes / (self.call_us * 1e3)

    @property
    def overhead_us(self) -> Optional[float]:
        """What the host adds to a cold call over the pipelined one (0 where noise made the cold call faster)."""
        return None if self.cold_us is None else max(self.cold_us - self.call_us, 0.0)

    @property
    def link_us(self) -> Optional[float]:
        """The time the remote bytes take at the NVLink limit for this SM budget, the floor for the call;
        None where no link is measured (CPU, a shared GPU, no remote bytes)."""
        if self.ranks_per_gpu != 1 or not self.remote_bytes:
            return None
        return self.remote_bytes / (NVLINK_LIMIT_GBPS.get(self.sms or 0, NVLINK_LIMIT_ANY_GBPS) * 1e3)


@dataclass
class LayerShape:
    """Sizes of the "layer" case (one flag --layer-<field> each), the canonical N1 layer by default."""

    tokens: int = 4096  # per rank
    hidden: int = 7168
    experts: int = 256
    topk: int = 8
    ffn: int = 2048  # each expert's SwiGLU hidden size
    shared_ffn: int = 0  # the shared expert's SwiGLU hidden size (0: none)
    decode_tokens: int = 128  # per rank in each of the decode step's two micro-batches


@dataclass(frozen=True)
class Target:
    """One of issue 44's figures next to its reference and the goal for their ratio, so that a run's
    output shows each figure against what it is judged by."""

    figure: str  # what `value` is
    value: float
    reference: str  # what `value` is compared with
    reference_value: float
    unit: str  # of both values
    goal: Optional[float] = None  # for ratio; None: shown for comparison only
    at_least: bool = False  # the goal is a floor (ratio >= goal), else a ceiling

    @property
    def ratio(self) -> float:
        return self.value / self.reference_value

    @property
    def met(self) -> Optional[bool]:
        if self.goal is None:
            return None
        return self.ratio >= self.goal if self.at_least else self.ratio <= self.goal

    def line(self) -> str:
        text = (f"{self.figure}: {self.value:.4g} {self.unit} / {self.reference} {self.reference_value:.4g} "
                f"{self.unit} = {self.ratio:.3f}")
        if self.goal is None:
            return text
        return text + f" (goal {'>=' if self.at_least else '<='} {self.goal:g}: {'met' if self.met else 'NOT met'})"

    def as_json(self) -> dict:
        return {**asdict(self), "ratio": self.ratio, "met": self.met}


def tflops(flop: float, us: float) -> float:
    return flop / (us * 1e-6) / 1e12


def layer_flop(pairs: int, hidden: int, ffn: int) -> float:
    """FLOPs of the experts' GEMMs in one forward: gate/up (2 P H 2F) and down (2 P F H) over P
    (row, local expert) pairs; a backward does twice as many (dX and dW of each GEMM)."""
    return 6.0 * pairs * hidden * ffn


def expert_counts(buf: Buffer, topk_idx: torch.Tensor) -> torch.Tensor:
    """[E_l] int64: the (row, local expert) pairs each of this rank's experts computed for the routing
    `topk_idx` [N, K] of every rank (collective: one all_reduce of per-expert counts); dropped slots
    (-1) count nothing."""
    cfg = buf.cfg
    counts = torch.bincount(topk_idx[topk_idx >= 0].reshape(-1), minlength=cfg.num_experts).to(buf.device)
    dist.all_reduce(counts)
    first = buf.rank * cfg.num_local_experts
    return counts[first:first + cfg.num_local_experts]


class Timer:
    """Median time of a collective call: CUDA events on GPU (L2 flushed before each call), perf_counter on CPU."""

    def __init__(self, device: torch.device, warmup: int, iters: int) -> None:
        self.device, self.warmup, self.iters = device, warmup, iters
        self.last_spread: list[tuple[float, float]] = []  # parts_us's percentiles, per column
        self.flush_buf = torch.empty(256 << 20, dtype=torch.uint8, device=device) if device.type == "cuda" else None

    def _align(self) -> None:
        """Start a measurement with every rank idle and released together."""
        if self.flush_buf is not None:
            torch.cuda.synchronize()
        dist.barrier()

    def _run(self, calls: list[Callable[[], object]], cold: bool = False,
             setup: Optional[Callable[[], None]] = None) -> list[list[float]]:
        """Warm up, then time each of `calls` in turn per iteration; returns [iteration][call] us.
        `setup` (untimed) runs before each iteration, e.g. to set gradients to None.

        On GPU, as DeepEP's tests do: no host barrier between iterations (the collective calls
        keep the ranks in step by themselves), the 256 MB flush is enqueued before each iteration,
        and CUDA events bracket each call. cold=True adds a device sync and a host barrier after
        the flush, so the first call starts on an idle device and its host time counts. On CPU
        (either way): a barrier and the host clock per iteration."""
        samples = []
        self._align()
        for i in range(self.warmup + self.iters):
            if setup is not None:
                setup()
            if self.flush_buf is None:
                dist.barrier()
                stamps = [time.perf_counter()]
                for fn in calls:
                    fn()
                    stamps.append(time.perf_counter())
                times = [(b - a) * 1e6 for a, b in zip(stamps, stamps[1:])]
            else:
                self.flush_buf.zero_()
                if cold:
                    self._align()
                events = [torch.cuda.Event(enable_timing=True) for _ in range(len(calls) + 1)]
                events[0].record()
                for fn, ev in zip(calls, events[1:]):
                    fn()
                    ev.record()
                times = events  # resolved below, after one synchronisation
            if i >= self.warmup:
                samples.append(times)
        if self.flush_buf is not None:
            torch.cuda.synchronize()
            samples = [[a.elapsed_time(b) * 1e3 for a, b in zip(ev, ev[1:])] for ev in samples]
        return samples

    def parts_us(self, calls: list[Callable[[], object]], cold: bool = False,
                 setup: Optional[Callable[[], None]] = None,
                 sums: Optional[list[tuple[int, ...]]] = None) -> list[float]:
        """Median time of each of `calls` (made in turn every iteration, after `setup`), then of the
        per-iteration sum of each group of calls in `sums` (default: one group, all of them); each the
        maximum over ranks. Their 10th and 90th percentiles (also the maximum over ranks) go to
        `last_spread`, in the same order."""
        samples = self._run(calls, cold, setup)
        groups = sums if sums is not None else [tuple(range(len(calls)))]
        cols = [*zip(*samples), *([sum(t[i] for i in g) for t in samples] for g in groups)]
        self.last_spread = [(_max_over_ranks(lo), _max_over_ranks(hi)) for lo, hi in map(_deciles, cols)]
        return [_max_over_ranks(statistics.median(col)) for col in cols]

    def call_us(self, fn: Callable[[], object]) -> float:
        return self.parts_us([fn])[0]

    def cold_us(self, fn: Callable[[], object]) -> Optional[float]:
        """Median time of a call made right after a device sync and a host barrier, so the host's
        own time counts, as for the first MoE layer after any sync (docs/benchmarks.md, Method).
        None on CPU, where every timed call already starts after a barrier (call_us is that time)."""
        return None if self.flush_buf is None else self.parts_us([fn], cold=True)[0]

    def split_us(self, send: Callable[[], object]) -> tuple[float, float]:
        """Median times of a hooked call's send half (the call) and receive half (its hook())."""
        pending: list = []
        send_us, recv_us, _ = self.parts_us([lambda: pending.append(send()), lambda: pending.pop().hook()])
        return send_us, recv_us

    def kernel_us(self, fn: Callable[[], object], calls: int = 10, idle: bool = False) -> Optional[float]:
        """Device time per call of every kernel and copy the call launched (torch.profiler); the L2
        flush is left out. The per-kernel split goes to `last_kernels`. idle=True syncs the device after each
        flush, so no kernel of the call (an eager call's stamp exchange runs off the caller's stream) overlaps
        the flush and counts its contention; for one rank only (with peers the sync would move the ranks' skew
        into the kernels' waits)."""
        self.last_kernels: dict[str, float] = {}
        if self.flush_buf is None:
            return None
        from torch.profiler import ProfilerActivity, profile

        self._align()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                self.flush_buf.zero_()
                if idle:
                    torch.cuda.synchronize()
                fn()
            torch.cuda.synchronize()
        for ev in prof.key_averages():
            name = ev.key.lower()
            if ev.device_type == torch.autograd.DeviceType.CUDA and "fill" not in name:
                self.last_kernels[_short_name(ev.key)] = ev.self_device_time_total / calls
        return _max_over_ranks(sum(self.last_kernels.values()))

    def graph(self, fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
        """fn captured in a CUDA graph, after one eager call (GPU only)."""
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph

    def graph_us(self, fn: Callable[[], object]) -> Optional[float]:
        """Median time of replaying fn captured in a CUDA graph (no host time inside)."""
        if self.flush_buf is None:
            return None
        return self.call_us(self.graph(fn).replay)


def _row(buf: Buffer, case: str, op: str, sms: Optional[int], tokens: int, call_us: float, **values: object) -> Row:
    """A Row with the Buffer's sizes, backend, placement and Config; `values` sets the other fields."""
    cfg = buf.cfg
    values.setdefault("backend", buf.backend_name)
    # the kernel knobs exist only for the native kernels: none for the reference backend or raw NCCL
    values.setdefault("config", dataclasses.asdict(buf.config) if values["backend"] == "nvshmem" else None)
    values.setdefault("kernel_us", None)
    values.setdefault("recv_bytes", 0)
    values.setdefault("remote_bytes", 0)
    return Row(case=case, op=op, sms=sms, tokens=tokens, hidden=cfg.hidden, call_us=call_us,
               topology=f"{buf.num_nodes}x{buf.ranks_per_node}", experts=cfg.num_experts, topk=cfg.num_topk,
               ranks_per_gpu=buf.ranks_per_gpu, **values)


def _short_name(kernel: str) -> str:
    """A readable kernel name: mangled names keep their tail (the function), others their head."""
    return kernel[-48:] if kernel.startswith("__nv_static") or kernel.startswith("_Z") else kernel[:48]


def _deciles(values: list[float]) -> tuple[float, float]:
    """The 10th and 90th percentile of values (inclusive: within their range; one value is both)."""
    if len(values) < 2:
        return values[0], values[0]
    cuts = statistics.quantiles(values, n=10, method="inclusive")
    return cuts[0], cuts[-1]


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device="cuda" if torch.cuda.is_available() and
                     dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def compares_to_deepep(buf: Buffer) -> bool:
    """DeepEP's figures (DEEPEP_N1, DEEPEP_L1) were measured at EP2 on one node, a GPU per rank."""
    return buf.group_size == 2 and buf.num_nodes == 1 and buf.ranks_per_gpu == 1


def n1_inputs(tokens: int, hidden: int, experts: int, topk: int, device: torch.device, seed: int):
    """The canonical routing (docs/benchmarks.md): topk of |randn| + 1 scores; random bf16 rows; random weights."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, device=device).to(torch.bfloat16)
    scores = torch.randn(tokens, experts, generator=g, device=device).abs() + 1
    topk_idx = torch.topk(scores, topk, dim=1).indices
    weights = torch.rand(tokens, topk, generator=g, device=device)
    return x, topk_idx, weights


def bench_normal(buf: Buffer, timer: Timer, case: str, tokens: int, sms_list: list[Optional[int]],
                 with_fp8: bool, deepep: bool, idle_kernels: bool = False) -> list[Row]:
    """Whole-call and kernel-only times of BF16/FP8 dispatch and BF16 combine on one Buffer (kernels on an idle
    device with idle_kernels: Timer.kernel_us)."""
    cfg = buf.cfg
    x, idx, w = n1_inputs(tokens, cfg.hidden, cfg.num_experts, cfg.num_topk, buf.device, seed=buf.rank)
    q, scales = fp8.quantize(x)
    rows: list[Row] = []
    probe = buf.dispatch(x, idx, w)
    recv = probe.x.shape[0]
    remote = int((probe.src_rank != buf.rank).sum())
    row_bf16, row_fp8 = 2 * cfg.hidden, cfg.hidden + 4 * cfg.num_scales
    y = probe.x
    for sms in sms_list:
        ref = DEEPEP_N1.get(sms) if deepep else None
        ops = [("dispatch_bf16", lambda: buf.dispatch(x, idx, w, num_sms=sms), row_bf16, ref[1] if ref else None)]
        if with_fp8:
            ops.append(("dispatch_fp8", lambda: buf.dispatch(q, idx, w, x_scales=scales, num_sms=sms), row_fp8,
                        ref[0] if ref else None))
        ops.append(("combine_bf16", lambda: buf.combine(y, probe.handle, num_sms=sms), row_bf16, ref[2] if ref else None))
        for op, fn, row_bytes, ref_us in ops:
            call_us = timer.call_us(fn)
            spread = timer.last_spread[0]
            rows.append(_row(buf, case, op, sms, tokens, call_us, kernel_us=timer.kernel_us(fn, idle=idle_kernels),
                             recv_bytes=recv * row_bytes, remote_bytes=remote * row_bytes, deepep_us=ref_us,
                             cold_us=timer.cold_us(fn), spread_us=spread, extra={"kernels": timer.last_kernels}))
    return rows


SM_EFFICIENCY_OPS = ("dispatch_bf16", "dispatch_fp8", "combine_bf16")
SM_COPY_OP, COPY_ENGINE_OP = "sm_copy", "copy engine"
COPY_WARPS = 16  # 512 threads per block
COPY_BLOCK = 16384  # int32 words a block loads per step: 64 KB in flight per SM, 8 loads of 16 bytes per thread

if triton is not None:

    @triton.jit
    def _sm_copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
        """Program i copies tiles i, i + grid, ... of BLOCK int32 words; a tile's loads all issue before its stores."""
        for tile in range(tl.program_id(0), tl.cdiv(n, BLOCK), tl.num_programs(0)):
            offs = tile * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def sm_copy(src: torch.Tensor, dst: torch.Tensor, num_sms: int) -> None:
    """dst <- src (contiguous, as many bytes, a multiple of 4) by a persistent Triton kernel of num_sms blocks:
    a plain copy on at most num_sms SMs, the rate the normal-mode kernels are measured against."""
    if src.nbytes != dst.nbytes or src.nbytes % 4 or src.nbytes // 4 + COPY_BLOCK >= 2 ** 31:
        raise ValueError(f"sm_copy copies equal sizes, a multiple of 4 bytes below 8 GiB: {src.nbytes} -> {dst.nbytes}")
    words = src.view(-1).view(torch.int32)
    _sm_copy_kernel[(num_sms,)](words, dst.view(-1).view(torch.int32), words.numel(), BLOCK=COPY_BLOCK,
                                num_warps=COPY_WARPS)


def time_copies(buf: Buffer, timer: Timer, tokens: int, nbytes: int, sms_list: list[int]) -> list[Row]:
    """Rows of copying nbytes random bytes by sm_copy at each SM budget and by the copy engine (dst.copy_(src),
    no SM budget), each with extra["copied_exactly"]: whether dst came out equal to src. Kernels timed on an idle
    device, as the ops they are held against."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=buf.device)
    dst = torch.empty_like(src)
    copies: list[tuple[str, Optional[int], str, Callable[[], object]]] = [
        (SM_COPY_OP, sms, "triton", lambda sms=sms: sm_copy(src, dst, sms)) for sms in sms_list]
    copies.append((COPY_ENGINE_OP, None, "torch", lambda: dst.copy_(src)))
    rows = []
    for op, sms, backend, fn in copies:
        dst.zero_()
        us = timer.call_us(fn)
        spread = timer.last_spread[0]
        rows.append(_row(buf, "sm-efficiency", op, sms, tokens, us, backend=backend, config=None,
                         kernel_us=timer.kernel_us(fn, idle=True), recv_bytes=nbytes, spread_us=spread,
                         extra={"kernels": timer.last_kernels, "copied_exactly": torch.equal(src, dst)}))
    return rows


def bench_sm_efficiency(buf: Buffer, timer: Timer, tokens: int, sms_list: list[int]) -> list[Row]:
    """Issue 44's per-SM efficiency of the normal-mode kernels at EP1 (a one-rank Buffer: every row goes to this
    rank): BF16/FP8 dispatch and BF16 combine at each SM budget (bench_normal), and in the same run a copy of each
    op's bytes on as many SMs and by the copy engine (time_copies). At EP1 a dispatch reads each row once and
    writes it once, and so does a combine, so the copy moves rows x row bytes (recv_bytes); dispatch rows record in
    extra["metadata_bytes"] what they write besides (every row's topk_idx, weights, src_rank and src_index), which
    the copy leaves out."""
    if buf.group_size != 1:
        raise ValueError(f"the sm-efficiency case runs at EP1 (a one-rank Buffer), got {buf.group_size} ranks")
    cfg = buf.cfg
    rows = bench_normal(buf, timer, "sm-efficiency", tokens, sms_list, with_fp8=True, deepep=False, idle_kernels=True)
    x, idx, w = n1_inputs(tokens, cfg.hidden, cfg.num_experts, cfg.num_topk, buf.device, seed=buf.rank)
    d = buf.dispatch(x, idx, w)
    metadata = sum(t.nbytes for t in (d.topk_idx, d.topk_weights, d.src_rank, d.src_index))
    for r in rows:
        if r.op.startswith("dispatch"):
            r.extra["metadata_bytes"] = metadata
    for nbytes in sorted({r.recv_bytes for r in rows}):
        rows += time_copies(buf, timer, tokens, nbytes, sms_list)
    return rows


@dataclass(frozen=True)
class SmEfficiency:
    """One op of the sm-efficiency case at one SM budget beside sm_copy of its bytes on as many SMs; kept = copy
    time / op time, the fraction of the copy's rate the op keeps (whole calls, and kernels alone)."""

    op: str
    sms: int
    bytes: int  # rows x row bytes: what the op and the copy each read once and write once
    metadata_bytes: int  # what a dispatch writes besides (not in the copy); 0 for combine
    call_us: float
    copy_us: float
    kernel_us: Optional[float]  # device time of the op's kernels (profiler); None on CPU
    copy_kernel_us: Optional[float]
    longest_kernel_us: Optional[float] = None  # of those kernels, the longest (the one that moves the rows)

    @property
    def kept(self) -> float:
        return self.copy_us / self.call_us

    @property
    def kept_kernels(self) -> Optional[float]:
        if self.kernel_us is None or self.copy_kernel_us is None:
            return None
        return self.copy_kernel_us / self.kernel_us

    @property
    def kept_longest(self) -> Optional[float]:
        """What the op's longest kernel alone keeps of the copy's rate."""
        if self.longest_kernel_us is None or self.copy_kernel_us is None:
            return None
        return self.copy_kernel_us / self.longest_kernel_us

    @property
    def kept_at_copy_rate(self) -> Optional[float]:
        """kept_kernels if the longest kernel ran at the copy's rate and the op's other kernels (its stamp
        exchange, a dispatch's notify) took what they took: how far a faster row kernel alone can go."""
        if self.longest_kernel_us is None or self.copy_kernel_us is None or self.kernel_us is None:
            return None
        return self.copy_kernel_us / (self.copy_kernel_us + self.kernel_us - self.longest_kernel_us)

    @property
    def goal(self) -> Optional[float]:
        return SM_EFFICIENCY_GOAL if self.sms == SM_EFFICIENCY_GOAL_SMS else None

    def as_json(self) -> dict:
        return {**asdict(self), "kept": self.kept, "kept_kernels": self.kept_kernels, "kept_longest": self.kept_longest,
                "kept_at_copy_rate": self.kept_at_copy_rate, "goal": self.goal}


def sm_efficiency(rows: list[Row]) -> list[SmEfficiency]:
    """Each sm-efficiency op row paired with the sm_copy row of its SM budget and bytes."""
    case = [r for r in rows if r.case == "sm-efficiency"]
    copies = {(r.sms, r.recv_bytes): r for r in case if r.op == SM_COPY_OP}
    return [SmEfficiency(r.op, r.sms, r.recv_bytes, r.extra.get("metadata_bytes", 0), r.call_us, c.call_us,
                         r.kernel_us, c.kernel_us, max(r.extra["kernels"].values()) if r.extra.get("kernels") else None)
            for r in case if r.op in SM_EFFICIENCY_OPS and (c := copies.get((r.sms, r.recv_bytes))) is not None]


def sm_efficiency_lines(rows: list[Row]) -> list[str]:
    """The sm-efficiency case as its own table (op, SMs, bytes, times, kept, goal), the copy engine's rate under
    it, and a warning for any copy whose destination came out unlike its source; none without the case."""
    effs = sm_efficiency(rows)
    if not effs:
        return []
    head = (f"{'op':<14}{'SMs':>5}{'bytes':>11}{'meta B':>9}{'call us':>9}{'copy us':>9}{'kept':>6}"
            f"{'kernel us':>11}{'copy kern':>10}{'kept':>6}{'longest':>9}{'kept':>6}{'at copy':>8}{'goal':>6}")
    lines = ["sm-efficiency, EP1 (every row to this rank): each op beside sm_copy of its bytes on as many SMs; "
             "kept = copy us / op us, whole calls, then kernels alone (profiler), then the op's longest kernel "
             "alone; at copy: what kernels alone would keep with that kernel at the copy's rate and the others "
             "as they are; meta B: what a dispatch writes besides, not copied", head, "-" * len(head)]
    lines += [f"{e.op:<14}{e.sms:>5}{e.bytes:>11}{e.metadata_bytes:>9}{e.call_us:>9.1f}{e.copy_us:>9.1f}"
              f"{e.kept:>6.2f}{_num(e.kernel_us) or '-':>11}{_num(e.copy_kernel_us) or '-':>10}"
              f"{_num(e.kept_kernels, '.2f') or '-':>6}{_num(e.longest_kernel_us) or '-':>9}"
              f"{_num(e.kept_longest, '.2f') or '-':>6}{_num(e.kept_at_copy_rate, '.2f') or '-':>8}"
              f"{_num(e.goal, 'g') or '-':>6}" for e in effs]
    case = [r for r in rows if r.case == "sm-efficiency"]
    lines += [f"copy engine (dst.copy_(src), no SM budget): {r.recv_bytes} bytes in {r.call_us:.1f} us "
              f"({r.gbps:.0f} GB/s)" for r in case if r.op == COPY_ENGINE_OP]
    lines += [f"WARNING: {r.op} at {r.sms} SMs left its destination unlike its source ({r.recv_bytes} bytes)"
              for r in case if r.extra.get("copied_exactly") is False]
    return lines


def sm_efficiency_targets(rows: list[Row]) -> list[Target]:
    """The sm-efficiency ops at the goal's SM budget: sm_copy's time over the op's, whole calls and kernels alone."""
    targets = []
    for e in sm_efficiency(rows):
        if e.goal is None:
            continue
        targets.append(Target(f"sm_copy at {e.sms} SMs", e.copy_us, e.op, e.call_us, "us", e.goal, at_least=True))
        if e.kept_kernels is not None:
            targets.append(Target(f"sm_copy at {e.sms} SMs (kernels alone)", e.copy_kernel_us, f"{e.op} (kernels alone)",
                                  e.kernel_us, "us", e.goal, at_least=True))
    return targets


def bench_async_pattern(buf: Buffer, timer: Timer, case: str, tokens: int) -> list[Row]:
    """Megatron's pattern, a dispatch, a shared-expert GEMM [tokens, H] x [H, 2H] and a combine, timed
    as one step: serial (every call on the caller's stream) and overlapped (async calls on the
    Buffer's communication stream, the GEMM on the caller's meanwhile). Valid only with one GPU per rank."""
    cfg = buf.cfg
    x, idx, w = n1_inputs(tokens, cfg.hidden, cfg.num_experts, cfg.num_topk, buf.device, seed=buf.rank)
    shared_w = torch.randn(cfg.hidden, 2 * cfg.hidden, device=buf.device).to(torch.bfloat16) / 64

    def serial() -> object:
        d = buf.dispatch(x, idx, w)
        shared = x @ shared_w
        return buf.combine(d.x, d.handle), shared

    def overlapped() -> object:
        d = buf.dispatch(x, idx, w, async_op=True)
        shared = x @ shared_w
        d.event.wait()
        out, event = buf.combine(d.x, d.handle, async_op=True)
        event.wait()
        return out, shared

    return [_row(buf, case, op, None, tokens, timer.call_us(fn)) for op, fn in
            (("dispatch+shared+combine serial", serial), ("dispatch+shared+combine async", overlapped))]


def bench_call_checks(timer: Timer, device: torch.device) -> list[Row]:
    """What checking calls in order costs: a dispatch + combine on a Buffer of default arguments (on the
    native backend each call opens with its stamp exchange, one device round trip, and waits for it
    unless async) and on one made with check_calls=True (one host all_gather per call before it
    launches), at a decode-sized and a prefill-sized token count; on the native backend also the stamp
    exchange alone, whole call and kernel."""
    gpu = device.type == "cuda"
    hidden, sizes = (7168, (128, 4096)) if gpu else (512, (32, 256))
    rows: list[Row] = []
    for check in (False, True):
        with Buffer(hidden=hidden, num_experts=256, num_topk=8, max_tokens_per_rank=max(sizes), check_calls=check,
                    device=device) as buf:
            for tokens in sizes:
                x, idx, w = n1_inputs(tokens, hidden, 256, 8, buf.device, seed=buf.rank)

                def step() -> torch.Tensor:
                    d = buf.dispatch(x, idx, w)
                    return buf.combine(d.x, d.handle)

                op = "dispatch+combine" + (", check_calls=True" if check else ", stamps exchanged on the device")
                call_us = timer.call_us(step)
                rows.append(_row(buf, "calls", op, None, tokens, call_us, spread_us=timer.last_spread[0]))
            if buf.backend_name == "nvshmem" and not check:  # what the device check adds to every native call
                exchange = buf.backend.stamp_exchange_alone
                rows.append(_row(buf, "calls", "stamp exchange alone (each native call's first kernel)", None, 0,
                                 timer.call_us(exchange), kernel_us=timer.kernel_us(exchange)))
    return rows


def bench_nccl_a2a(buf: Buffer, timer: Timer, case: str, tokens: int) -> Row:
    """Raw all_to_all_single moving the rows a BF16 dispatch moves (own rows included)."""
    cfg = buf.cfg
    x, idx, w = n1_inputs(tokens, cfg.hidden, cfg.num_experts, cfg.num_topk, buf.device, seed=buf.rank)
    layout = buf.get_dispatch_layout(idx)
    send = layout.num_tokens_per_rank.tolist()
    recv_t = torch.empty_like(layout.num_tokens_per_rank)
    dist.all_to_all_single(recv_t, layout.num_tokens_per_rank)
    recv = recv_t.tolist()
    inp = torch.randn(sum(send), cfg.hidden, device=buf.device).to(torch.bfloat16)
    out = torch.empty(sum(recv), cfg.hidden, dtype=torch.bfloat16, device=buf.device)
    fn = lambda: dist.all_to_all_single(out, inp, recv, send)  # noqa: E731
    remote = sum(r for s, r in enumerate(recv) if s != buf.rank)
    return _row(buf, case, "all_to_all_single", None, tokens, timer.call_us(fn), backend="nccl",
                kernel_us=timer.kernel_us(fn), recv_bytes=sum(recv) * 2 * cfg.hidden, remote_bytes=remote * 2 * cfg.hidden)


def _graph_capturable(buf: Buffer) -> bool:
    """Whether the Buffer's calls can be captured in a CUDA graph: only the native backend's can (the
    reference backend's NCCL collectives and host syncs stop a capture)."""
    return buf.backend_name == "nvshmem"


def bench_low_latency(buf: Buffer, timer: Timer, tokens: int) -> list[Row]:
    """L1: FP8 dispatch and BF16 combine, whole calls (also replayed from a CUDA graph where the
    backend can be captured) and the hook's send/receive halves."""
    cfg = buf.cfg
    x, idx, w = n1_inputs(tokens, cfg.hidden, cfg.num_experts, cfg.num_topk, buf.device, seed=buf.rank)
    d = buf.low_latency_dispatch(x, idx, use_fp8=True)
    y = torch.randn(d.x.shape, device=buf.device).to(torch.bfloat16)
    pairs = int(d.count.sum())
    row_fp8, row_bf16 = cfg.hidden + 4 * cfg.num_scales, 2 * cfg.hidden
    ref = DEEPEP_L1.get(tokens) if compares_to_deepep(buf) else None
    rows = []
    graph = _graph_capturable(buf)

    def add(op: str, fn: Callable[[], object], row_bytes: int, ref_us: Optional[float]) -> None:
        rows.append(_row(buf, "L1", op, None, tokens, timer.call_us(fn), kernel_us=timer.kernel_us(fn),
                         recv_bytes=pairs * row_bytes, deepep_us=ref_us, cold_us=timer.cold_us(fn),
                         extra={"kernels": timer.last_kernels}))
        if graph:
            rows.append(_row(buf, "L1", op + "_graph", None, tokens, timer.graph_us(fn), recv_bytes=pairs * row_bytes,
                             deepep_us=ref_us))

    # Combine first: a low-latency dispatch result (and its handle) stays valid for two dispatches only.
    add("ll_combine_bf16", lambda: buf.low_latency_combine(y, idx, w, d.handle), row_bf16, ref[1] if ref else None)
    halves = [
        ("ll_combine_bf16", lambda: buf.low_latency_combine(y, idx, w, d.handle, return_recv_hook=True), row_bf16),
        ("ll_dispatch_fp8", lambda: buf.low_latency_dispatch(x, idx, use_fp8=True, return_recv_hook=True), row_fp8),
    ]
    for op, send, row_bytes in halves:
        send_us, recv_us = timer.split_us(send)
        for half, us in (("send", send_us), ("recv", recv_us)):
            rows.append(_row(buf, "L1", f"{op}_{half}", None, tokens, us, recv_bytes=pairs * row_bytes))
    add("ll_dispatch_fp8", lambda: buf.low_latency_dispatch(x, idx, use_fp8=True), row_fp8, ref[0] if ref else None)
    return rows


LAYER_PASSES = (("forward", 1), ("backward", 2), ("forward_backward", 3))  # (op, FLOPs in forwards' FLOPs)


def layer_inputs(shape: LayerShape, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer input x [tokens, H] bf16 (requires grad) and the gradient its output gets back."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(shape.tokens, shape.hidden, generator=g, device=device).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(shape.tokens, shape.hidden, generator=g, device=device).to(torch.bfloat16)
    return x, grad


def time_layer(timer: Timer, moe: MoE, x: torch.Tensor, grad: torch.Tensor,
               modes: tuple[bool, ...] = (False, True)) -> dict[bool, list[float]]:
    """{overlap: [forward, backward, both] us} of moe's normal-mode forward and backward without and with
    overlap, alternating in every iteration (so both see the same machine), with every gradient set to
    None before each mode's forward (as after optimizer.zero_grad()): no backward accumulates into .grad
    (at the bench's shape, accumulating into the experts' 11 GB of gradients costs ~7.5 ms). Setting
    them to None is host work only, done while the device still runs the previous call. `overlap` is
    set alike on every rank before each forward."""
    outputs: list[torch.Tensor] = []
    calls = [c for on in modes
             for c in (lambda on=on: outputs.append(fresh_forward(moe, x, on)), lambda: outputs.pop().backward(grad))]
    return by_mode(timer.parts_us(calls, sums=[(2 * i, 2 * i + 1) for i in range(len(modes))]), modes)


def fresh_forward(moe: MoE, x: torch.Tensor, overlap: bool) -> torch.Tensor:
    """moe's normal-mode forward with `overlap`, every gradient (x's too) set to None first, as after
    optimizer.zero_grad(), so its backward accumulates into nothing."""
    moe.zero_grad(set_to_none=True)
    x.grad = None
    moe.overlap = overlap
    return moe(x, mode="normal")


def overlap_same_bits(moe: MoE, x: torch.Tensor, grad: torch.Tensor) -> bool:
    """One forward + backward of moe without and with overlap on the same input: True when the outputs, the
    input's gradient and every parameter's gradient are the same bits (the mode's promise, checked at the
    bench's own shape)."""
    results = []
    for on in (False, True):
        out = fresh_forward(moe, x, on)
        out.backward(grad)
        results.append([out.detach(), x.grad, *(p.grad for p in moe.parameters())])
    moe.overlap = False
    return all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
               for a, b in zip(*results))


def by_mode(columns: list, modes: tuple[bool, ...]) -> dict[bool, list]:
    """time_layer's parts_us columns (its times, or the timer's last_spread) as {overlap: [forward,
    backward, both]}."""
    return {on: [columns[2 * i], columns[2 * i + 1], columns[2 * len(modes) + i]] for i, on in enumerate(modes)}


def time_communication(timer: Timer, moe: MoE, x: torch.Tensor, grad: torch.Tensor) -> list[float]:
    """[forward, backward, both] us of the layer's communication alone: its dispatch and combine on its own
    routing with no experts between (the pairs go straight back) and their backward (a cached dispatch
    and a combine; the router weights' gradient, K floats per token beside H bf16, left out)."""
    routing = moe.router(x.detach())
    idx, w = routing.topk_idx, routing.topk_weights.detach()
    xb = x.detach().to(torch.bfloat16).requires_grad_()
    outputs: list[torch.Tensor] = []

    def forward() -> None:
        d = moe.dispatch(xb, idx, w)
        outputs.append(autograd.combine(d.x, d.ref))

    def zero() -> None:
        xb.grad = None

    return timer.parts_us([forward, lambda: outputs.pop().backward(grad)], setup=zero)


def group_sizes(pairs: int, local_experts: int, device: torch.device,
                counts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[E_l] int32 rows per expert on `device`: `counts` (the router's groups), or None: `pairs` rows in equal
    groups (at least one row each, the remainder left out)."""
    if counts is not None:
        return counts.to(device=device, dtype=torch.int32)
    return torch.full((local_experts,), max(pairs // local_experts, 1), device=device, dtype=torch.int32)


def gemm_cases(pairs: int, local_experts: int, hidden: int, ffn: int, device: torch.device,
               counts: Optional[torch.Tensor] = None) -> dict[str, tuple[Callable[[], object], float]]:
    """Each grouped GEMM of the experts alone (torch._grouped_mm: sm90 GPUs), on `pairs` rows in equal
    groups, or in groups of `counts` [E_l] rows (the router's): name -> (call, FLOPs). "fwd" names are a
    forward's GEMMs (gate/up fused, down), "bwd" a backward's (dA, dW2, dX, dW1 + dW3); "cmp" the
    forward with gate and up unfused, for comparison."""
    e, h, f, bf = local_experts, hidden, ffn, torch.bfloat16
    sizes = group_sizes(pairs, e, device, counts)
    p = int(sizes.sum())
    offs = torch.cumsum(sizes, 0, dtype=torch.int32)
    x, dy = (torch.randn(p, h, device=device, dtype=bf) for _ in range(2))
    h13, a = torch.randn(p, 2 * f, device=device, dtype=bf), torch.randn(p, f, device=device, dtype=bf)
    w13 = torch.randn(e, 2 * f, h, device=device, dtype=bf) * 0.02
    w2 = torch.randn(e, h, f, device=device, dtype=bf) * 0.02
    gmm = torch._grouped_mm
    return {
        "fwd gate/up fused [P,H]x[H,2F]": (lambda: gmm(x, w13.transpose(1, 2), offs=offs), 4.0 * p * h * f),
        "fwd down [P,F]x[F,H]": (lambda: gmm(a, w2.transpose(1, 2), offs=offs), 2.0 * p * h * f),
        "cmp gate, up, down unfused": (lambda: (gmm(x, w13[:, :f].transpose(1, 2), offs=offs),
                                                gmm(x, w13[:, f:].transpose(1, 2), offs=offs),
                                                gmm(a, w2.transpose(1, 2), offs=offs)), 6.0 * p * h * f),
        "bwd dA = dY w2": (lambda: gmm(dy, w2, offs=offs), 2.0 * p * h * f),
        "bwd dW2 = dY^T a": (lambda: gmm(dy.t(), a, offs=offs), 2.0 * p * h * f),
        "bwd dX = dH13 w13": (lambda: gmm(h13, w13, offs=offs), 4.0 * p * h * f),
        "bwd dW1, dW3 = dH^T X": (lambda: (gmm(h13[:, :f].t(), x, offs=offs), gmm(h13[:, f:].t(), x, offs=offs)),
                                  4.0 * p * h * f),
    }


def time_gemms(timer: Timer, cases: dict[str, tuple[Callable[[], object], float]]) -> dict[str, tuple[float, float]]:
    """name -> (us, FLOPs) of each of gemm_cases alone, then "GEMMs <op>" for each of LAYER_PASSES:
    the sums of the fwd GEMMs, of the bwd GEMMs, and of both."""
    timed = {name: (timer.call_us(fn), flop) for name, (fn, flop) in cases.items()}
    sums = {kind: [sum(v[i] for n, v in timed.items() if n.startswith(kind)) for i in (0, 1)] for kind in ("fwd", "bwd")}
    sums["both"] = [sums["fwd"][i] + sums["bwd"][i] for i in (0, 1)]
    for (op, _), kind in zip(LAYER_PASSES, ("fwd", "bwd", "both")):
        timed[f"GEMMs {op}"] = (sums[kind][0], sums[kind][1])
    return timed


def fp8_gemm_cases(pairs: int, local_experts: int, hidden: int, ffn: int, device: torch.device,
                   counts: Optional[torch.Tensor] = None) -> dict[str, tuple[Callable[[], object], float]]:
    """The FP8 experts' grouped GEMMs alone as MoE(fp8_experts=True) runs them (moe_ep.moe.fp8_experts), on `pairs`
    rows in equal groups, or in groups of `counts` [E_l] rows (the router's): "fwd" the forward's two (FP8, block
    scales, the pairs' rows read where the dispatch put them), "dgrad" the backward's two data-gradient GEMMs
    (FP8, against the transposed weights), "wgrad" its two weight-gradient GEMMs (bf16), and where the CUTLASS sm90
    kernel runs, "fp8wgrad" the same weight gradients in FP8 (moe_ep.moe.fp8_wgrad: the four operands' K-grouped
    quantization, then the two K-grouped GEMMs; not yet what the layer runs): name -> (call, FLOPs)."""
    e, h, f, bf = local_experts, hidden, ffn, torch.bfloat16
    counts = group_sizes(pairs, e, device, counts)
    p = int(counts.sum())
    x, dy = (torch.randn(p, h, device=device, dtype=bf) for _ in range(2))
    a, dh13 = torch.randn(p, f, device=device, dtype=bf), torch.randn(p, 2 * f, device=device, dtype=bf)
    (xq, xs), (aq, as_), (dyq, dys), (dhq, dhs) = (fp8.quantize(t) for t in (x, a, dy, dh13))
    w13, w13s = fp8_experts.quantize_weight_blocks(torch.randn(e, 2 * f, h, device=device) * 0.02)
    w2, w2s = fp8_experts.quantize_weight_blocks(torch.randn(e, h, f, device=device) * 0.02)
    t = fp8_experts.FP8ExpertWeights(w13, w13s, w2, w2s).transposed()
    gemm, groups = fp8_experts.grouped_gemm, groups_of(dy, counts)
    cases = {"fwd fp8 gate/up": (lambda: gemm(xq, xs, None, counts, w13, w13s), 4.0 * p * h * f),
             "fwd fp8 down": (lambda: gemm(aq, as_, None, counts, w2, w2s), 2.0 * p * h * f),
             "dgrad fp8 dA = dY w2": (lambda: gemm(dyq, dys, None, counts, t.w2, t.w2_scale), 2.0 * p * h * f),
             "dgrad fp8 dX = dH13 w13": (lambda: gemm(dhq, dhs, None, counts, t.w13, t.w13_scale), 4.0 * p * h * f),
             "wgrad bf16 dW2 = dY^T a": (lambda: groups.mm_t(dy, a), 2.0 * p * h * f),
             "wgrad bf16 dW1, dW3 = dH^T X": (lambda: (groups.mm_t(dh13[:, :f], x), groups.mm_t(dh13[:, f:], x)),
                                              4.0 * p * h * f)}
    if fp8_experts.gemm_kernel(device) == "cutlass_sm90":
        k_grouped = {name: fp8_wgrad.quantize_k_grouped(t, counts) for name, t in
                     (("dy", dy), ("a", a), ("dh13", dh13), ("x", x))}
        cases |= {"fp8wgrad quantize dY, a, dH13, X": (
                      lambda: [fp8_wgrad.quantize_k_grouped(t, counts) for t in (dy, a, dh13, x)], 0.0),
                  "fp8wgrad dW2 = dY^T a": (
                      lambda: fp8_wgrad.k_grouped_gemm(*k_grouped["dy"], *k_grouped["a"], counts, p), 2.0 * p * h * f),
                  "fp8wgrad dW13 = dH13^T X": (
                      lambda: fp8_wgrad.k_grouped_gemm(*k_grouped["dh13"], *k_grouped["x"], counts, p), 4.0 * p * h * f)}
    return cases


def torch_fp8_gemm_cases(sizes: torch.Tensor, hidden: int, ffn: int,
                         device: torch.device) -> dict[str, tuple[Callable[[], object], float]]:
    """The FP8 experts' two forward GEMMs in torch's own FP8 grouped GEMM (torch._scaled_grouped_mm, rowwise
    float32 scales, fast accumulation as torchao's FP8 MoE training calls it), on groups of `sizes` [E_l] rows,
    rows not gathered: name -> (call, FLOPs), the FLOPs of fp8_gemm_cases."""
    e, h, f = sizes.numel(), hidden, ffn
    p = int(sizes.sum())
    offs = torch.cumsum(sizes, 0, dtype=torch.int32)

    def fp8_randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=torch.bfloat16).to(torch.float8_e4m3fn)

    def gemm(a: torch.Tensor, b: torch.Tensor) -> Callable[[], object]:
        """a [P, K] times each expert's b [N, K]^T (b given [E, N, K]: column-major, as torch asks)."""
        scale_a, scale_b = torch.ones(a.shape[0], device=device), torch.ones(e, b.shape[1], device=device)
        return lambda: torch._scaled_grouped_mm(a, b.transpose(1, 2), scale_a, scale_b, offs=offs,
                                                out_dtype=torch.bfloat16, use_fast_accum=True)

    return {"torch fp8 gate/up": (gemm(fp8_randn(p, h), fp8_randn(e, 2 * f, h)), 4.0 * p * h * f),
            "torch fp8 down": (gemm(fp8_randn(p, f), fp8_randn(e, h, f)), 2.0 * p * h * f)}


def gemm_sum_row(buf: Buffer, op: str, tokens: int, timed: dict[str, tuple[float, float]], backend: str,
                 extra: dict, recv_bytes: int = 0) -> Row:
    """A layer row of GEMMs timed one by one (name -> (us, FLOPs)): the sum of their times and FLOPs, each part's
    time in extra["parts_us"]; recv_bytes, where given, the bytes they write (the GB/s column)."""
    return _row(buf, "layer", op, None, tokens, sum(v[0] for v in timed.values()), backend=backend,
                flop=sum(v[1] for v in timed.values()), config=None, recv_bytes=recv_bytes,
                extra={**extra, "parts_us": {name: v[0] for name, v in timed.items()}})


def bench_fp8_gemms(buf: Buffer, timer: Timer, tokens: int, pairs: int, hidden: int, ffn: int,
                    counts: torch.Tensor) -> list[Row]:
    """At equal groups and at the router's `counts`, fp8_gemm_cases timed one by one, as rows "FP8 GEMMs forward
    <groups>", "FP8 GEMMs dgrad <groups>", "bf16 wgrad of FP8 experts <groups>" (its GB/s: the bytes of dW it
    writes, what bounds it at the bench's shape), "FP8 GEMMs forward_backward <groups>" (those six), where the
    CUTLASS kernel runs "FP8 wgrad of FP8 experts <groups>" (quantization and GEMMs, beside the bf16 one), and
    torch_fp8_gemm_cases as "torch FP8 GEMMs forward <groups>". Where torch's FP8 grouped GEMM refuses (this
    torch or GPU lacks it), the forward row says why in extra["torch_fp8"] instead."""
    rows: list[Row] = []
    e = buf.num_local_experts
    kernel = fp8_experts.gemm_kernel(buf.device)
    dw_bytes = 2 * e * 3 * hidden * ffn  # bf16 dW13 [E_l, 2F, H] and dW2 [E_l, H, F]
    for label, groups in (("equal groups", None), ("router's groups", counts)):
        extra = ({"tiles": asdict(fp8_experts.TILES)} if kernel == "triton" else {}) | (
            {} if groups is None else {"groups": counts.tolist()})
        cases = fp8_gemm_cases(pairs, e, hidden, ffn, buf.device, counts=groups)
        timed = {name: (timer.call_us(fn), flop) for name, (fn, flop) in cases.items()}
        del cases
        part = {kind: {n: v for n, v in timed.items() if n.split()[0] == kind}
                for kind in ("fwd", "dgrad", "wgrad", "fp8wgrad")}
        forward = gemm_sum_row(buf, f"FP8 GEMMs forward {label}", tokens, part["fwd"], kernel, extra)
        rows += [forward,
                 gemm_sum_row(buf, f"FP8 GEMMs dgrad {label}", tokens, part["dgrad"], kernel, extra),
                 gemm_sum_row(buf, f"bf16 wgrad of FP8 experts {label}", tokens, part["wgrad"], "torch", extra,
                              recv_bytes=dw_bytes),
                 gemm_sum_row(buf, f"FP8 GEMMs forward_backward {label}", tokens,
                              {**part["fwd"], **part["dgrad"], **part["wgrad"]}, kernel, extra)]
        if part["fp8wgrad"]:
            rows.append(gemm_sum_row(buf, f"FP8 wgrad of FP8 experts {label}", tokens, part["fp8wgrad"], kernel,
                                     extra, recv_bytes=dw_bytes))
        try:
            cases = torch_fp8_gemm_cases(group_sizes(pairs, e, buf.device, groups), hidden, ffn, buf.device)
            for fn, _ in cases.values():
                fn()
        except (AttributeError, NotImplementedError, RuntimeError, TypeError) as error:
            forward.extra["torch_fp8"] = f"not available: {type(error).__name__}: {str(error).splitlines()[0][:160]}"
            continue
        timed = {name: (timer.call_us(fn), flop) for name, (fn, flop) in cases.items()}
        rows.append(gemm_sum_row(buf, f"torch FP8 GEMMs forward {label}", tokens, timed, "torch",
                                 {"scales": "rowwise float32", "use_fast_accum": True}))
    return rows


def bench_fp8_layer(timer: Timer, buf: Buffer, shape: LayerShape, x: torch.Tensor, grad: torch.Tensor,
                    sms: Optional[int]) -> list[Row]:
    """MoE(fp8_experts=True) with the weights of the bf16 rows: its forward under no_grad (serving, row "forward
    FP8") with its error against the bf16 experts' forward on the same input (||y8 - y16|| / ||y16||), then its
    forward and backward in training (rows "forward FP8 train", "backward FP8", "forward_backward FP8";
    time_layer), and where CUTLASS's sm90 GEMMs run, again with the weight gradients in FP8 (MoE(fp8_wgrad=True):
    the same rows with ", FP8 wgrad")."""
    models = []
    for fp8_on in (False, True):  # the same seed: the same router and expert weights
        torch.manual_seed(0)
        models.append(MoE(buf, shape.ffn, dtype=torch.bfloat16, fp8_experts=fp8_on))
    with torch.no_grad():
        want = models[0](x, mode="normal").float()
        got = models[1](x, mode="normal").float()
        error = float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want).clamp_min(1e-30))
        pairs = int(expert_counts(buf, models[1].last_routing.topk_idx).sum())
        us = timer.call_us(lambda: models[1](x, mode="normal"))
        spread = timer.last_spread[0]
    moe = models.pop()
    del want, got, models  # the bf16 model's 11 GB (at the bench's shape) are not needed for training's
    gc.collect()
    flop = layer_flop(pairs, shape.hidden, shape.ffn)
    rows = [_row(buf, "layer", "forward FP8", sms, shape.tokens, us, spread_us=spread, flop=flop,
                 extra={"pairs": pairs, "fp8_relative_error": _max_over_ranks(error)})]
    for fp8_wgrad in (False, True) if fp8_experts.gemm_kernel(x.device) == "cutlass_sm90" else (False,):
        moe.fp8_wgrad = fp8_wgrad
        times = time_layer(timer, moe, x, grad, modes=(False,))
        spreads = by_mode(timer.last_spread, (False,))
        for (op, k), us, spread in zip(LAYER_PASSES, times[False], spreads[False]):
            name = ("forward FP8 train" if op == "forward" else f"{op} FP8") + (", FP8 wgrad" if fp8_wgrad else "")
            rows.append(_row(buf, "layer", name, sms, shape.tokens, us, spread_us=spread, flop=k * flop,
                             extra={"pairs": pairs}))
    del moe
    gc.collect()
    return rows


def dense_ceiling(timer: Timer, device: torch.device, n: int = 8192) -> tuple[float, float]:
    """(us, FLOPs) of a bf16 n^3 matmul on random data: the GPU's practical matrix rate."""
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    return timer.call_us(lambda: a @ b), 2.0 * n ** 3


def bench_layer(timer: Timer, shape: LayerShape, backend: str, device: torch.device, gemms: bool) -> list[Row]:
    """moe_ep.MoE forward, backward and both (normal mode, bf16 experts, the default expert-major dispatch)
    on one backend without and with overlap (rows "forward", "forward overlap", ...; time_layer), its
    communication alone ("comm alone ..."), and on the row path ("... row path": expert_major=False), with
    FLOPs from the pairs this rank's experts computed (plus the shared expert's). Where each rank has its
    own GPU the overlap rows carry "comm_hidden": (no overlap - overlap) / communication alone. With
    `gemms`, the layer's grouped GEMMs alone on as many pairs in equal groups and in the router's groups,
    the FP8 experts' forward GEMMs alone likewise, beside torch's own FP8 grouped GEMM (bench_fp8_gemms), and
    the dense bf16 ceiling (rows of backend "torch"; layer_targets sets each figure beside its reference).
    What it allocates is garbage once it returns (the caller collects it before the next case)."""
    rows: list[Row] = []
    with Buffer(hidden=shape.hidden, num_experts=shape.experts, num_topk=shape.topk,
                max_tokens_per_rank=shape.tokens, backend=backend, device=device) as buf:
        sms = buf.config.num_sms if buf.backend_name == "nvshmem" else None
        x, grad = layer_inputs(shape, buf.device, seed=buf.rank)
        link = buf.device.type == "cuda" and buf.ranks_per_gpu == 1  # a GPU per rank: the hidden share means something
        for expert_major in (True, False):
            torch.manual_seed(0)  # the same weights for both paths, the router's the same on every rank
            moe = MoE(buf, shape.ffn, dtype=torch.bfloat16, expert_major=expert_major,
                      shared_ffn_hidden=shape.shared_ffn)
            modes = (False, True) if expert_major else (False,)
            times = time_layer(timer, moe, x, grad, modes=modes)
            spreads = by_mode(timer.last_spread, modes)
            if expert_major:
                comm = time_communication(timer, moe, x, grad)
                comm_spreads = timer.last_spread
                same_bits = overlap_same_bits(moe, x, grad)
            counts = expert_counts(buf, moe.last_routing.topk_idx)
            pairs = int(counts.sum())
            flop = layer_flop(pairs, shape.hidden, shape.ffn) + layer_flop(shape.tokens, shape.hidden, shape.shared_ffn)
            for on, passes in times.items():
                for i, ((op, k), us, spread) in enumerate(zip(LAYER_PASSES, passes, spreads[on])):
                    extra = {"overlap": on, "pairs": pairs, "expert_major": expert_major}
                    if on:
                        extra["same_bits"] = same_bits
                    if on and link:
                        extra["comm_hidden"] = (times[False][i] - us) / comm[i]
                    name = op + (" overlap" if on else "") + ("" if expert_major else " row path")
                    rows.append(_row(buf, "layer", name, sms, shape.tokens, us, flop=k * flop, spread_us=spread,
                                     extra=extra))
            if expert_major:
                rows += [_row(buf, "layer", f"comm alone {op}", sms, shape.tokens, us, spread_us=spread,
                              extra={"pairs": pairs})
                         for (op, _), us, spread in zip(LAYER_PASSES, comm, comm_spreads)]
            del moe
            gc.collect()
        fp8_shapes = shape.hidden % fp8.BLOCK == 0 and shape.ffn % fp8.BLOCK == 0
        if fp8_shapes:
            rows += bench_fp8_layer(timer, buf, shape, x, grad, sms)
        if gemms:
            for label, groups in (("equal groups", None), ("router's groups", counts)):
                cases = gemm_cases(pairs, buf.num_local_experts, shape.hidden, shape.ffn, buf.device, counts=groups)
                timed = time_gemms(timer, {name: case for name, case in cases.items() if not name.startswith("cmp")})
                rows += [_row(buf, "layer", f"{name} {label}", None, shape.tokens, us, backend="torch",
                              flop=flop, config=None, extra={} if groups is None else {"groups": counts.tolist()})
                         for name, (us, flop) in timed.items() if name.startswith("GEMMs")]
            if fp8_shapes:
                rows += bench_fp8_gemms(buf, timer, shape.tokens, pairs, shape.hidden, shape.ffn, counts)
            us, flop = dense_ceiling(timer, buf.device)
            rows.append(_row(buf, "layer", "dense bf16 8192^3", None, shape.tokens, us, backend="torch", flop=flop,
                             config=None))
    return rows


def bench_decode(timer: Timer, shape: LayerShape, backend: str, device: torch.device) -> list[Row]:
    """A decode step of two micro-batches of shape.decode_tokens tokens through MoE.start / compute /
    finish (low-latency Buffer): in sequence, interleaved (A's compute, then B's start before A's
    finish, as docs/integrations.md section 5), and their communication alone (each micro-batch's
    whole low-latency dispatch + combine), the three alternating in every iteration so that they see the
    same machine; where the backend can be captured, the two orders again as CUDA-graph replays (no host
    time). The interleaved rows' extra "comm_hidden" is (sequential - interleaved) / communication
    alone: the share of communication the order hides."""
    t = shape.decode_tokens
    with Buffer(hidden=shape.hidden, num_experts=shape.experts, num_topk=shape.topk, max_tokens_per_rank=t,
                backend=backend, low_latency=True, device=device) as buf, torch.no_grad():
        torch.manual_seed(0)
        moe = MoE(buf, shape.ffn, dtype=torch.bfloat16, shared_ffn_hidden=shape.shared_ffn)
        g = torch.Generator(device=buf.device).manual_seed(buf.rank)
        xa, xb = (torch.randn(t, shape.hidden, generator=g, device=buf.device).to(torch.bfloat16) for _ in range(2))
        routes = [moe.router(x) for x in (xa, xb)]
        y = torch.zeros_like(buf.low_latency_dispatch(xa, routes[0].topk_idx).x)

        def sequential() -> None:
            moe.start(xa).finish()
            moe.start(xb).finish()

        def interleaved() -> None:
            a = moe.start(xa).compute()
            b = moe.start(xb)
            a.finish()
            b.finish()

        def communication() -> None:
            for x, r in zip((xa, xb), routes):
                d = buf.low_latency_dispatch(x, r.topk_idx)
                buf.low_latency_combine(y, r.topk_idx, r.topk_weights, d.handle)

        seq_us, inter_us, comm_us, _ = timer.parts_us([sequential, interleaved, communication])
        seq_sp, inter_sp, comm_sp = timer.last_spread[:3]
        rows = [_row(buf, "decode", "2 in sequence", None, t, seq_us, spread_us=seq_sp),
                _row(buf, "decode", "2 interleaved", None, t, inter_us, spread_us=inter_sp,
                     extra={"comm_hidden": (seq_us - inter_us) / comm_us}),
                _row(buf, "decode", "comm only (2 x d + c)", None, t, comm_us, spread_us=comm_sp)]
        if _graph_capturable(buf):
            graphs = [timer.graph(fn) for fn in (sequential, interleaved)]
            seq_us, inter_us, _ = timer.parts_us([graph.replay for graph in graphs])
            seq_sp, inter_sp = timer.last_spread[:2]
            rows += [_row(buf, "decode", "2 in sequence, graph", None, t, seq_us, spread_us=seq_sp),
                     _row(buf, "decode", "2 interleaved, graph", None, t, inter_us, spread_us=inter_sp,
                          extra={"comm_hidden": (seq_us - inter_us) / comm_us})]
        hbm = time_hbm(buf, timer, t)
        gbps = max(r.gbps for r in hbm)
        per_expert, shared = expert_weight_bytes(moe)
        active = [int((expert_counts(buf, r.topk_idx) > 0).sum()) for r in routes]
        weight_bytes = sum(n * per_expert + shared for n in active)
        floor_us = weight_bytes / (gbps * 1e3)
        for r in rows:
            if r.op.startswith("2 "):
                r.extra.update(weight_floor_us=floor_us, vs_floor=r.call_us / floor_us)
        return rows + hbm + [_row(buf, "decode", "weight-read floor", None, t, floor_us, backend="floor", config=None,
                                  recv_bytes=weight_bytes, extra={"active_experts": active, "hbm_gbps": gbps})]


def time_hbm(buf: Buffer, timer: Timer, tokens: int) -> list[Row]:
    """Rows "HBM read" (a float32 sum of a bf16 tensor: bytes read) and "HBM copy" (dst.copy_(src): bytes read +
    written), each moving 2 GiB through device memory (64 MiB on CPU, where they only check the bench runs),
    alternating in one loop; their GB/s column is the memory's bandwidth measured now."""
    total = (2 << 30) if buf.device.type == "cuda" else (64 << 20)
    src = torch.ones(total // 2, dtype=torch.bfloat16, device=buf.device)
    half = src[: src.numel() // 2]
    dst = torch.empty_like(half)
    read_us, copy_us, _ = timer.parts_us([lambda: src.sum(dtype=torch.float32), lambda: dst.copy_(half)])
    return [_row(buf, "decode", op, None, tokens, us, backend="torch", config=None, recv_bytes=total, spread_us=spread)
            for op, us, spread in (("HBM read: sum of bf16", read_us, timer.last_spread[0]),
                                   ("HBM copy: dst.copy_(src)", copy_us, timer.last_spread[1]))]


def expert_weight_bytes(moe: MoE) -> tuple[int, int]:
    """(bytes of one routed expert's weights, bytes of the shared expert's: 0 without one)."""
    experts = moe.experts
    per_expert = sum(w[0].numel() * w.element_size() for w in (experts.w1, experts.w3, experts.w2))
    shared = 0 if moe.shared is None else sum(w.numel() * w.element_size() for w in moe.shared.parameters())
    return per_expert, shared


def decode_targets(rows: list[Row]) -> list[Target]:
    """The decode steps of the first backend that ran them, each over its weight-read floor."""
    decode = [r for r in rows if r.case == "decode" and "weight_floor_us" in r.extra]
    return [Target(f"decode {r.op} ({r.backend})", r.call_us / 1e3, "weight-read floor", r.extra["weight_floor_us"] / 1e3,
                   "ms", DECODE_FLOOR_GOAL) for r in decode if r.backend == decode[0].backend]


# (figure, its op, reference, the reference's op, goal): issue 44's layer figures, from the layer case's rows
LAYER_TARGETS = (
    ("layer forward", "forward", "its GEMMs alone (router's groups)", "GEMMs forward router's groups",
     LAYER_FORWARD_GOAL),
    ("layer forward+backward", "forward_backward", "its GEMMs alone (router's groups)",
     "GEMMs forward_backward router's groups", LAYER_FORWARD_BACKWARD_GOAL),
    ("GEMMs forward, router's groups", "GEMMs forward router's groups", "equal groups", "GEMMs forward equal groups",
     GEMM_IMBALANCE_GOAL),
    ("GEMMs forward_backward, router's groups", "GEMMs forward_backward router's groups", "equal groups",
     "GEMMs forward_backward equal groups", GEMM_IMBALANCE_GOAL),
    ("layer forward, FP8 experts", "forward FP8", "its FP8 GEMMs alone (router's groups)",
     "FP8 GEMMs forward router's groups", LAYER_FORWARD_GOAL),
    ("layer forward+backward, FP8 experts", "forward_backward FP8", "its GEMMs alone (router's groups)",
     "FP8 GEMMs forward_backward router's groups", LAYER_FORWARD_BACKWARD_GOAL),
    ("FP8 GEMMs forward, router's groups", "FP8 GEMMs forward router's groups", "equal groups",
     "FP8 GEMMs forward equal groups", GEMM_IMBALANCE_GOAL),
    ("FP8 GEMMs forward, equal groups", "FP8 GEMMs forward equal groups", "torch's FP8 grouped GEMM",
     "torch FP8 GEMMs forward equal groups", None),
    ("FP8 GEMMs forward, router's groups", "FP8 GEMMs forward router's groups", "torch's FP8 grouped GEMM",
     "torch FP8 GEMMs forward router's groups", None),
)


def layer_targets(rows: list[Row]) -> list[Target]:
    """LAYER_TARGETS found among the layer case's rows of the first backend that ran it (the one timed beside its
    GEMMs alone) in ms, and the FP8 GEMMs' TFLOP/s against FP8_GEMM_TFLOPS_GOAL; none where a figure is absent."""
    layer = [r for r in rows if r.case == "layer"]
    if not layer:
        return []
    by_op = {r.op: r for r in layer if r.backend in (layer[0].backend, "torch", *fp8_experts.GEMM_KERNELS)}
    targets = [Target(figure, by_op[op].call_us / 1e3, reference, by_op[ref].call_us / 1e3, "ms", goal)
               for figure, op, reference, ref, goal in LAYER_TARGETS if op in by_op and ref in by_op]
    targets += [Target(f"{op} rate", by_op[op].tflops, "issue 44's goal", FP8_GEMM_TFLOPS_GOAL, "TFLOP/s", 1.0,
                       at_least=True)
                for op in ("FP8 GEMMs forward equal groups", "FP8 GEMMs forward router's groups",
                           "FP8 GEMMs dgrad equal groups", "FP8 GEMMs dgrad router's groups",
                           "FP8 wgrad of FP8 experts equal groups", "FP8 wgrad of FP8 experts router's groups")
                if op in by_op]
    return targets


@dataclass(frozen=True)
class Column:
    """One table column: its header, width, the cell of a row (None: nothing to show for that row) and,
    for a column no row has a value in, why it is left out."""

    head: str
    width: int
    cell: Callable[[Row], Optional[str]]
    absent: str = ""
    left: bool = False


def _num(value: Optional[float], fmt: str = ".1f") -> Optional[str]:
    return None if value is None else format(value, fmt)


_LAYER = "only the layer case counts FLOPs (and is given in ms)"
_GPU_ONLY = "GPU only (on CPU every timed call starts after a barrier: call us is the cold time)"
_DEEPEP = "DeepEP's figures exist for N1 and L1 at EP2 on one node with a GPU per rank"
COLUMNS = [
    Column("case", 6, lambda r: r.case, left=True),
    Column("op", 22, lambda r: r.op, left=True),
    Column("backend", 9, lambda r: r.backend, left=True),
    Column("nodes", 5, lambda r: r.topology or None),
    Column("GPU", 10, lambda r: f"{r.ranks_per_gpu}-way" if r.shared_gpu else None),
    Column("SMs", 4, lambda r: _num(r.sms, "d"), "only the native backend takes an SM budget"),
    Column("tokens", 6, lambda r: str(r.tokens)),
    Column("hidden", 6, lambda r: str(r.hidden)),
    Column("call us", 9, lambda r: _num(r.call_us)),
    Column("ms", 8, lambda r: _num(r.call_us / 1e3, ".3f") if r.flop is not None else None, _LAYER),
    Column("TFLOP/s", 7, lambda r: _num(r.tflops, ".4g"), _LAYER),
    Column("%hidden", 7, lambda r: None if "comm_hidden" not in r.extra else f"{100 * r.extra['comm_hidden']:.1f}%",
           "only the decode case's interleaved rows and, with a GPU per rank, the layer's overlap rows hide "
           "communication"),
    Column("cold us", 9, lambda r: _num(r.cold_us), _GPU_ONLY),
    Column("overhead", 8, lambda r: _num(r.overhead_us), _GPU_ONLY),
    Column("kernel us", 9, lambda r: _num(r.kernel_us), "device time from the CUDA profiler, GPU only"),
    Column("vs floor", 8, lambda r: None if "vs_floor" not in r.extra else f"{r.extra['vs_floor']:.2f}x",
           "only the decode steps have a weight-read floor"),
    Column("GB/s", 7, lambda r: _num(r.gbps) if r.recv_bytes else None, "no row moved bytes it could count"),
    Column("remote", 7, lambda r: _num(r.remote_gbps) if r.recv_bytes else None, "no row moved bytes it could count"),
    Column("%link", 6, lambda r: None if r.link_us is None else f"{100 * r.link_us / r.call_us:.1f}%",
           "the NVLink limit applies only to rows with a GPU per rank"),
    Column("DeepEP", 8, lambda r: _num(r.deepep_us), _DEEPEP),
    Column("speedup", 7, lambda r: None if r.deepep_us is None else f"{r.deepep_us / r.call_us:.2f}x", _DEEPEP),
]


def table(rows: list[Row]) -> tuple[list[str], Optional[str]]:
    """The table's lines (only the columns some row has a value in) and one line naming the columns
    left out and why they do not apply to what ran (None when none is)."""
    shown = [c for c in COLUMNS if any(c.cell(r) is not None for r in rows)]

    def line(cells: list[str]) -> str:
        return " ".join(f"{v:<{c.width}}" if c.left else f"{v:>{c.width}}" for c, v in zip(shown, cells))

    head = line([c.head for c in shown])
    reasons: dict[str, list[str]] = {}
    for c in COLUMNS:
        if c not in shown and c.absent:
            reasons.setdefault(c.absent, []).append(c.head)
    left_out = "; ".join(f"{', '.join(heads)}: {why}" for why, heads in reasons.items())
    return [head, "-" * len(head)] + [line([c.cell(r) or "-" for c in shown]) for r in rows], (
        f"not shown: {left_out}" if left_out else None)


def kernel_lines(rows: list[Row]) -> list[str]:
    """Rank 0's device time per kernel for each measured call (from the profiler); none on CPU."""
    lines = []
    for r in rows:
        kernels = r.extra.get("kernels")
        if kernels:
            split = ", ".join(f"{name} {us:.1f}" for name, us in sorted(kernels.items(), key=lambda kv: -kv[1]))
            lines.append(f"  {r.case} {r.op} {r.backend} {r.topology} sms={r.sms or '-'}: {split}")
    return ["device time per kernel (us, rank 0):"] + lines if lines else []


def target_lines(targets: list[Target]) -> list[str]:
    """Issue 44's figures, each beside its reference and goal (Target.line); none when none was measured."""
    return ["figures beside their references (issue 44):"] + ["  " + t.line() for t in targets] if targets else []


def print_table(rows: list[Row], notes: Optional[list[str]] = None) -> None:
    """The table, then why columns or rows are missing, then the per-kernel times where measured."""
    lines, left_out = table(rows)
    if left_out:
        lines.append(left_out)
    if any(r.shared_gpu for r in rows):
        lines.append("GPU N-way: N ranks time-sliced on one GPU: results are valid, timings say nothing about "
                     "links (no link limit, no DeepEP comparison)")
    print("\n".join(lines + (notes or []) + kernel_lines(rows)))


def _ep_title(case: str, rows: list[Row]) -> str:
    """A panel title from the sizes that ran: EP size, tokens, hidden, top-k/experts (each where the
    rows agree on it) and the shared-GPU label."""
    first = rows[0]
    nodes, per_node = (int(v) for v in first.topology.split("x"))
    parts = [f"EP{nodes * per_node}" + (f" ({first.topology} nodes)" if nodes > 1 else "")]
    if len({r.tokens for r in rows}) == 1:
        parts.append(f"{first.tokens} tokens")
    if len({r.hidden for r in rows}) == 1:
        parts.append(f"hidden {first.hidden}")
    parts.append(f"top-{first.topk}/{first.experts}")
    title = f"{case}: " + ", ".join(parts)
    if first.shared_gpu:
        title += f"\n{first.ranks_per_gpu} ranks share one GPU: not link timings"
    return title


def _bar_label(r: Row, rows: list[Row]) -> str:
    label = f"{r.op} ({r.backend}"
    if r.sms:
        label += f", {r.sms} SMs"
    if len({x.topology for x in rows}) > 1:
        label += f", {r.topology}"
    if len({x.tokens for x in rows}) > 1:
        label += f", {r.tokens} tok"
    return label + ")"


def bar_axis_label(rows: list[Row]) -> str:
    """What a bar panel's times are: medians (max over ranks), the whiskers' percentiles, and how they
    were taken (the host's clock on CPU; CUDA events on a GPU)."""
    label = "us per call: median, max over ranks"
    if any(r.spread_us is not None for r in rows):
        label += "; whiskers 10th-90th percentile of the calls"
    if all(r.ranks_per_gpu == 0 for r in rows):
        label += "\nhost-timed (CPU): perf_counter around each call, after a barrier"
    return label


def plot(rows: list[Row], path: Path) -> "Figure":
    """Writes the PNG and returns its matplotlib Figure: one panel per thing that ran. N1 on the native
    backend as times per SM budget against DeepEP and the link limit (the remote bytes at
    NVLINK_LIMIT_GBPS for that SM budget; neither on a shared GPU), for the first topology measured;
    the sweep's bandwidth per token count; every other case as bars of its call times, with whiskers
    from the 10th to the 90th percentile of the calls where they were recorded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n1 = [r for r in rows if r.case == "N1" and r.sms]
    n1 = [r for r in n1 if r.topology == n1[0].topology]  # the --ranks-per-node pass gets bars
    sweep = [r for r in rows if r.case == "sweep"]
    others: dict[str, list[Row]] = {}
    for r in rows:
        if r not in n1 and r not in sweep:
            others.setdefault(r.case, []).append(r)
    panels = (["n1"] if n1 else []) + (["sweep"] if sweep else []) + list(others)
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel == "n1":
            for op, color in (("dispatch_bf16", "C0"), ("dispatch_fp8", "C1"), ("combine_bf16", "C2")):
                pts = sorted((r for r in n1 if r.op == op), key=lambda r: r.sms)
                if pts:
                    sms = [r.sms for r in pts]
                    ax.plot(sms, [r.call_us for r in pts], "o-", color=color, label=f"moe_ep {op}")
                    if all(r.deepep_us is not None for r in pts):
                        ax.plot(sms, [r.deepep_us for r in pts], "x:", color=color, alpha=0.6, label=f"DeepEP {op}")
                    if all(r.link_us is not None for r in pts):
                        ax.plot(sms, [r.link_us for r in pts], "--", color=color, lw=1, alpha=0.8,
                                label=f"link limit {op}")
            ax.set(xlabel="SMs", ylabel="us per call (lower is better)", title=_ep_title("N1", n1))
            ax.legend(fontsize=7)
        elif panel == "sweep":
            for hidden in sorted({r.hidden for r in sweep}):
                for op, style in (("dispatch_bf16", "o-"), ("combine_bf16", "s--")):
                    pts = sorted((r.tokens, r.gbps) for r in sweep if r.hidden == hidden and r.op == op)
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{op} H={hidden}")
            ax.set_xscale("log", base=2)
            ax.set(xlabel="tokens per rank", ylabel="GB/s (received bytes / call time)",
                   title=_ep_title(f"sweep ({sweep[0].backend})", sweep))
            ax.legend(fontsize=7)
        else:
            group = others[panel]
            lo_hi = [r.spread_us or (r.call_us, r.call_us) for r in group]  # no whisker where none was recorded
            whiskers = ([[max(r.call_us - lo, 0.0) for r, (lo, _) in zip(group, lo_hi)],
                         [max(hi - r.call_us, 0.0) for r, (_, hi) in zip(group, lo_hi)]]
                        if any(r.spread_us for r in group) else None)
            ax.barh(range(len(group)), [r.call_us for r in group], color="C0", xerr=whiskers, capsize=3)
            ax.set_yticks(range(len(group)), [_bar_label(r, group) for r in group], fontsize=7)
            ax.invert_yaxis()
            ax.set(xlabel=bar_axis_label(group), title=_ep_title(panel, group))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return fig


def shared_config(rows: list[Row]) -> Optional[dict]:
    """The Config every native row ran with, or None when they differ (or no row ran the native kernels)."""
    configs = [r.config for r in rows if r.config is not None]
    return configs[0] if configs and all(c == configs[0] for c in configs) else None


def config_line(rows: list[Row]) -> str:
    """One line naming the moe_ep.Config the native Buffers ran with (per-call SM budgets are in the SMs column)."""
    configs = list({json.dumps(r.config, sort_keys=True): r.config for r in rows if r.config is not None}.values())
    if not configs:
        return "config: none (moe_ep.Config holds the native kernels' knobs; no row ran them)"
    text = " | ".join(" ".join(f"{k}={v}" for k, v in c.items()) for c in configs)
    return f"config ({'every Buffer' if len(configs) == 1 else f'{len(configs)} different, per row in the JSON'}): {text}"


TILE_ROWS = (64, 128, 256)  # row-tile heights the tile floor is printed for (WGMMA's M is 64 per warpgroup)


def tile_floor(groups: list[int], equal: int, tile_rows: int) -> float:
    """Row tiles of tile_rows rows that `groups` (rows per expert) need, over those of as many groups of `equal`
    rows: what the router's groups cost a grouped GEMM that computes whole tiles, from tile height alone."""
    return sum(-(-g // tile_rows) for g in groups) / (len(groups) * -(-equal // tile_rows))


def tile_floor_notes(rows: list[Row]) -> list[str]:
    """For each grouped-GEMM row at the router's groups (their sizes in extra["groups"]), the tile floor at each of
    TILE_ROWS beside as many rows in equal groups (group_sizes)."""
    notes = []
    for r in rows:
        groups = r.extra.get("groups")
        if not groups or not r.op.startswith(("GEMMs forward ", "FP8 GEMMs forward ")):
            continue
        equal = int(group_sizes(sum(groups), len(groups), torch.device("cpu"))[0])
        floors = ", ".join(f"{t} rows {tile_floor(groups, equal, t):.3f}" for t in TILE_ROWS)
        notes.append(f"{r.op}: row tiles these groups need over equal groups of {equal} rows (the loss tile height "
                     f"alone explains): {floors}")
    return notes


def layer_notes(use_gpu: bool, shared_gpu: bool, rows: list[Row]) -> list[str]:
    """What the layer case's table leaves out or how to read it, one line each."""
    notes = [f"forward FP8 experts ({r.backend}): relative error against the bf16 experts' forward, same weights "
             f"and input: ||y8 - y16|| / ||y16|| = {r.extra['fp8_relative_error']:.4f}"
             for r in rows if "fp8_relative_error" in r.extra]
    if not notes:
        notes.append(f"no FP8 layer rows: FP8 experts need hidden and ffn to be multiples of {fp8.BLOCK}")
    notes += ["%hidden = (2 in sequence - 2 interleaved) / comm only: the share of the decode step's communication "
             "that interleaving two micro-batches hides"
             + ("; meaningless for links here (CPU or shared GPU: no link carries the rows)"
                if not use_gpu or shared_gpu else ""),
              "layer rows \"... overlap\" ran MoE(overlap=True), alternating with the rows without it in every "
              "iteration; its output and every gradient the same bits as without overlap: "
              + (", ".join(sorted({"yes" if r.extra["same_bits"] else "NO" for r in rows if "same_bits" in r.extra}))
                 or "not run") + "; "
              + ("%hidden = (no overlap - overlap) / comm alone, the share of the layer's communication overlap hides"
                 if use_gpu and not shared_gpu else
                 "no %hidden for them: it is measured only with a GPU per rank (CPU or shared GPU here)")]
    notes += [f"{r.op}: torch's FP8 grouped GEMM (torch._scaled_grouped_mm) {r.extra['torch_fp8']}"
              for r in rows if "torch_fp8" in r.extra]
    notes += tile_floor_notes(rows)
    if not use_gpu:
        notes.insert(0, "no grouped-GEMM or dense-ceiling rows: torch._grouped_mm needs an sm90 GPU, and a CPU "
                        "matmul rate says nothing about a GPU's roofline")
    return notes


CASES = ("n1", "n1-native", "l1", "sweep", "stream", "cpu", "layer", "calls", "sm-efficiency")


def default_out_dir(stamp: str) -> Path:
    """Where results go without --out: a folder per run under $XDG_DATA_HOME (~/.local/share), so a run
    never leaves files in whatever folder it was started from (a checkout's bench/results/ holds only
    the results someone chose to keep)."""
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return base / "moe_ep" / "bench" / stamp


def int_list(text: str) -> list[int]:
    """A comma list of ints, as --sms and --sm-efficiency-sms take them."""
    return [int(v) for v in text.split(",")]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The command line (sys.argv[1:] by default); cases is a list checked against CASES (None: auto)."""
    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node R -m moe_ep.bench",
                                description=__doc__.split("\n", 1)[1].strip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="auto",
                   help=f"comma list of {', '.join(CASES)}: n1 normal mode (n1-native: without the NCCL baselines), "
                        "l1 low latency, sweep hidden x tokens, stream 16384 tokens per rank in one round and in "
                        "rounds of 4096 and the async Megatron pattern, cpu the reference backend's small case, "
                        "layer moe_ep.MoE forward/backward at the --layer-* sizes, calls a dispatch + combine "
                        "without and with check_calls=True, sm-efficiency the normal-mode kernels at EP1 (one rank) "
                        "beside a copy of their bytes on as many SMs (default %(default)s: n1,l1 on GPU, cpu "
                        "otherwise)")
    p.add_argument("--sms", default="8,16,24,32", type=int_list,
                   help="comma list of SM budgets for the native backend's normal-mode calls (default %(default)s)")
    p.add_argument("--sm-efficiency-sms", default="4,8,16,24", type=int_list,
                   help="comma list of SM budgets for the sm-efficiency case (default %(default)s)")
    p.add_argument("--warmup", type=int, default=20, help="untimed calls before each measurement (default %(default)s)")
    p.add_argument("--iters", type=int, default=50,
                   help="timed calls per measurement; the median is reported (default %(default)s)")
    p.add_argument("--out", default=None,
                   help="folder for the JSON and PNG (default: ~/.local/share/moe_ep/bench/<date-time>/)")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="also measure native N1/L1 with nodes of this many ranks, 1: the network leg between GPUs "
                        "(default: only the detected nodes)")
    p.add_argument("--ranks-per-gpu", type=int, default=None,
                   help="ranks sharing each GPU over gloo (docs/one_gpu.md): valid results, timings that say "
                        "nothing about links (default: 1 when there are enough GPUs, else the ranks spread evenly)")
    for f in fields(LayerShape):
        p.add_argument(f"--layer-{f.name.replace('_', '-')}", type=int, default=f.default,
                       help=f"layer case: {f.name.replace('_', ' ')} (default %(default)s)")
    args = p.parse_args(argv)
    args.cases = None if args.cases == "auto" else args.cases.split(",")
    if args.cases is not None and not set(args.cases) <= set(CASES):
        p.error(f"--cases: unknown {sorted(set(args.cases) - set(CASES))}; choose from {', '.join(CASES)}")
    return args


def sm_efficiency_skipped(world: int, device: torch.device) -> Optional[str]:
    """Why the sm-efficiency case cannot run here (it needs one rank and the native backend), or None."""
    backend, why = auto_backend(device)
    reasons = ([f"it runs at EP1, one rank (torchrun --nproc-per-node 1), not {world}"] if world != 1 else []) + (
        [f"it times the native kernels: {why}"] if backend != "nvshmem" else [])
    return f"no sm-efficiency rows: {'; '.join(reasons)}" if reasons else None


def main() -> None:
    args = parse_args()
    placement = init_distributed(ranks_per_gpu=args.ranks_per_gpu)
    device, use_gpu = placement.device, placement.device.type == "cuda"
    rank, world = dist.get_rank(), dist.get_world_size()
    cases = args.cases or (["n1", "l1"] if use_gpu else ["cpu"])
    timer = Timer(device, args.warmup, args.iters)
    sms_list = args.sms
    rows: list[Row] = []
    notes: list[str] = []

    if "cpu" in cases:
        with Buffer(hidden=2048, num_experts=64, num_topk=8, max_tokens_per_rank=512, backend="reference",
                    low_latency=True, device=device) as buf:
            rows += bench_normal(buf, timer, "cpu", 512, [None], with_fp8=True, deepep=False)
    if "layer" in cases:
        shape = LayerShape(**{f.name: getattr(args, f"layer_{f.name}") for f in fields(LayerShape)})
        for i, backend in enumerate(dict.fromkeys([auto_backend(device)[0], "reference"])):  # native first where built
            rows += bench_layer(timer, shape, backend, device, gemms=use_gpu and i == 0)
            rows += bench_decode(timer, shape, backend, device)
            gc.collect()  # the MoE's weights, gradients and autograd state, before the next case allocates
            if use_gpu:
                torch.cuda.empty_cache()
        notes += layer_notes(use_gpu, placement.shared_gpu, rows)
    topologies = [None] + ([args.ranks_per_node] if args.ranks_per_node is not None else [])
    if "n1" in cases or "n1-native" in cases:
        for rpn in topologies:
            with Buffer(hidden=7168, num_experts=256, num_topk=8, max_tokens_per_rank=4096, ranks_per_node=rpn,
                        device=device) as buf:
                rows += bench_normal(buf, timer, "N1", 4096, sms_list, with_fp8=True, deepep=compares_to_deepep(buf))
    if "n1" in cases:
        with Buffer(hidden=7168, num_experts=256, num_topk=8, max_tokens_per_rank=4096, backend="reference",
                    device=device) as buf:
            rows += bench_normal(buf, timer, "N1", 4096, [None], with_fp8=True, deepep=False)
            if placement.backend == "nccl":
                rows.append(bench_nccl_a2a(buf, timer, "N1", 4096))
            else:
                notes.append("no NCCL all_to_all_single row: NCCL refuses two ranks on one GPU, so this group is gloo")
    if "l1" in cases:
        for rpn in topologies:
            for tokens in (128, 256):
                with Buffer(hidden=7168, num_experts=256, num_topk=8, max_tokens_per_rank=tokens, low_latency=True,
                            ranks_per_node=rpn, device=device) as buf:
                    rows += bench_low_latency(buf, timer, tokens)
    if "stream" in cases:  # 16384 tokens per rank in one round, and in rounds of the default budget's 4096
        for round_tokens in (16384, 4096):
            with Buffer(hidden=7168, num_experts=256, num_topk=8, max_tokens_per_rank=round_tokens,
                        device=device) as buf:
                rows += bench_normal(buf, timer, f"stream T={round_tokens}", 16384, [None], with_fp8=True,
                                     deepep=False)
                if round_tokens == 4096:
                    rows += bench_async_pattern(buf, timer, "async", 4096)
    if "calls" in cases:
        rows += bench_call_checks(timer, device)
    if "sm-efficiency" in cases:
        skipped = sm_efficiency_skipped(world, device)
        if skipped:
            notes.append(skipped)
        else:
            with Buffer(hidden=7168, num_experts=256, num_topk=8, max_tokens_per_rank=4096, backend="nvshmem",
                        device=device) as buf:
                rows += bench_sm_efficiency(buf, timer, 4096, args.sm_efficiency_sms)
    if "sweep" in cases:
        for hidden in (2048, 4096, 7168):
            with Buffer(hidden=hidden, num_experts=256, num_topk=8, max_tokens_per_rank=16384, device=device) as buf:
                for tokens in (128, 512, 2048, 4096, 8192, 16384):
                    rows += bench_normal(buf, timer, "sweep", tokens, [None], with_fp8=False, deepep=False)

    if rank == 0:
        now = datetime.datetime.now()
        out = Path(args.out) if args.out else default_out_dir(now.strftime("%Y-%m-%d_%H%M%S"))
        out.mkdir(parents=True, exist_ok=True)
        meta = {
            "date": now.isoformat(timespec="seconds"),
            "world_size": world,
            "device": torch.cuda.get_device_name(device) if use_gpu else "cpu",
            "ranks_per_gpu": placement.ranks_per_gpu,
            "torch": torch.__version__,
            "timing": f"median of {args.iters} calls after {args.warmup} warm-up"
                      + (", L2 flushed (256 MB) between calls" if use_gpu else ", host clock"),
            # The native Buffers' moe_ep.Config, once when all had the same (else None and one per row).
            "config": shared_config(rows),
            "notes": notes,
        }
        stem = "bench_" + "_".join(cases)
        targets = layer_targets(rows) + decode_targets(rows) + sm_efficiency_targets(rows)
        (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": [
            {**{k: v for k, v in asdict(r).items() if k != "config" or (meta["config"] is None and v is not None)},
             "gbps": r.gbps, "remote_gbps": r.remote_gbps, "overhead_us": r.overhead_us, "link_us": r.link_us,
             "shared_gpu": r.shared_gpu, "tflops": r.tflops} for r in rows],
            "targets": [t.as_json() for t in targets],
            "sm_efficiency": [e.as_json() for e in sm_efficiency(rows)]}, indent=1))
        shared = f", {placement.ranks_per_gpu} ranks per GPU" if placement.shared_gpu else ""
        print(f"# {meta['device']} x{world}{shared}, {meta['date']}, {meta['timing']}")
        if not rows:  # every case asked for was skipped (notes say why): nothing to tabulate or draw
            print("\n".join(["no rows"] + notes))
            print(f"wrote {out / stem}.json")
        else:
            plot(rows, out / f"{stem}.png")
            print(config_line(rows))
            print_table(rows, notes)
            print("\n".join(sm_efficiency_lines(rows) + target_lines(targets)))
            print(f"wrote {out / stem}.json and {out / stem}.png")
    shutdown()  # every rank done: finalize NVSHMEM and destroy the group in a safe order (moe_ep.launch)


if __name__ == "__main__":
    main()
