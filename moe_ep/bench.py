"""`torchrun --nproc-per-node R -m moe_ep.bench`: time dispatch/combine as docs/benchmarks.md says.

On GPUs (NCCL group): N1 (normal mode, native backend at several SM budgets, the reference backend
on NCCL, and raw NCCL all_to_all_single moving the same bytes), L1 (low-latency) and optionally a
hidden x tokens sweep. Normal and eager low-latency calls are also timed "cold" (right after a
device sync and a host barrier, so the host's own time counts). The "layer" case times moe_ep.MoE
forward and backward on the native and the reference backend. With --ranks-per-node K the native
N1 and L1 rows are measured a second time with the group cut into nodes of K ranks (K=1 on one
machine: every byte between GPUs takes the cross-node kernels' network leg), next to the NVLink
rows in the same table. Without GPUs (gloo): the reference backend on a small case (and the layer
case, at sizes given by --layer-*). Prints a table, writes JSON and a PNG plot.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from . import fp8
from .buffer import Buffer, auto_backend
from .layer import MoE

# DeepEP V1 on our 2xH200, N1 (docs/benchmarks.md, Method): SMs -> (FP8 dispatch, BF16 dispatch, BF16 combine) us.
DEEPEP_N1 = {8: (647.9, 972.6, 999.7), 16: (344.2, 500.4, 532.3), 24: (245.1, 343.7, 400.0), 32: (193.1, 292.7, 318.1)}
# DeepEP V1 low-latency, EP2 (docs/benchmarks.md, Method): tokens -> (dispatch, combine) us.
DEEPEP_L1 = {128: (30.5, 41.2), 256: (44.8, 72.0)}
# NVLink limit per direction with int4 stores, 1024 threads, 4 loads in flight (docs/benchmarks.md), GB/s.
NVLINK_LIMIT_GBPS = {8: 349.0, 16: 343.0, 24: 346.0, 32: 349.0}
NVLINK_LIMIT_ANY_GBPS = 365.0  # 132 SMs through nvshmem_ptr


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
    cold_us: Optional[float] = None  # after a device sync and a host barrier (Timer.cold_us)
    extra: dict = field(default_factory=dict)
    topology: str = ""  # "nodes x ranks per node" of the Buffer

    @property
    def gbps(self) -> float:
        return self.recv_bytes / (self.call_us * 1e3)

    @property
    def remote_gbps(self) -> float:
        return self.remote_bytes / (self.call_us * 1e3)

    @property
    def overhead_us(self) -> Optional[float]:
        """What the host adds to a cold call over the pipelined one."""
        return None if self.cold_us is None else self.cold_us - self.call_us

    @property
    def link_us(self) -> float:
        """The time the remote bytes take at the NVLink limit for this SM budget: the floor for the call."""
        return self.remote_bytes / (NVLINK_LIMIT_GBPS.get(self.sms or 0, NVLINK_LIMIT_ANY_GBPS) * 1e3)


@dataclass
class LayerShape:
    """Sizes of the "layer" case (one flag --layer-<field> each), the canonical N1 layer by default."""

    tokens: int = 4096  # per rank
    hidden: int = 7168
    experts: int = 256
    topk: int = 8
    ffn: int = 2048  # each expert's SwiGLU hidden size


class Timer:
    """Median time of a collective call: CUDA events on GPU (L2 flushed before each call), perf_counter on CPU."""

    def __init__(self, device: torch.device, warmup: int, iters: int) -> None:
        self.device, self.warmup, self.iters = device, warmup, iters
        self.flush_buf = torch.empty(256 << 20, dtype=torch.uint8, device=device) if device.type == "cuda" else None

    def _align(self) -> None:
        """Start a measurement with every rank idle and released together."""
        if self.flush_buf is not None:
            torch.cuda.synchronize()
        dist.barrier()

    def _run(self, calls: list[Callable[[], object]], cold: bool = False) -> list[list[float]]:
        """Warm up, then time each of `calls` in turn per iteration; returns [iteration][call] us.

        On GPU, as DeepEP's tests do: no host barrier between iterations (the collective calls
        keep the ranks in step by themselves), the 256 MB flush is enqueued before each iteration,
        and CUDA events bracket each call. cold=True adds a device sync and a host barrier after
        the flush, so the first call starts on an idle device and its host time counts. On CPU
        (either way): a barrier and the host clock per iteration."""
        samples = []
        self._align()
        for i in range(self.warmup + self.iters):
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

    def parts_us(self, calls: list[Callable[[], object]], cold: bool = False) -> list[float]:
        """Median time of each of `calls` (made in turn every iteration), then of their per-iteration
        sum; each the maximum over ranks."""
        samples = self._run(calls, cold)
        return [_max_over_ranks(statistics.median(col)) for col in [*zip(*samples), [sum(t) for t in samples]]]

    def call_us(self, fn: Callable[[], object]) -> float:
        return self.parts_us([fn])[0]

    def cold_us(self, fn: Callable[[], object]) -> float:
        """Median time of a call made right after a device sync and a host barrier, so the host's
        own time counts, as for the first MoE layer after any sync (docs/benchmarks.md, Method)."""
        return self.parts_us([fn], cold=True)[0]

    def split_us(self, send: Callable[[], object]) -> tuple[float, float]:
        """Median times of a hooked call's send half (the call) and receive half (its hook())."""
        pending: list = []
        send_us, recv_us, _ = self.parts_us([lambda: pending.append(send()), lambda: pending.pop().hook()])
        return send_us, recv_us

    def kernel_us(self, fn: Callable[[], object], calls: int = 10) -> Optional[float]:
        """Device time per call of every kernel and copy the call launched (torch.profiler); the L2
        flush is left out. The per-kernel split goes to `last_kernels`."""
        self.last_kernels: dict[str, float] = {}
        if self.flush_buf is None:
            return None
        from torch.profiler import ProfilerActivity, profile

        self._align()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                self.flush_buf.zero_()
                fn()
            torch.cuda.synchronize()
        for ev in prof.key_averages():
            name = ev.key.lower()
            if ev.device_type == torch.autograd.DeviceType.CUDA and "fill" not in name:
                self.last_kernels[_short_name(ev.key)] = ev.self_device_time_total / calls
        return _max_over_ranks(sum(self.last_kernels.values()))

    def graph_us(self, fn: Callable[[], object]) -> Optional[float]:
        """Median time of replaying fn captured in a CUDA graph (no host time inside)."""
        if self.flush_buf is None:
            return None
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return self.call_us(graph.replay)


def _topology(buf: Buffer) -> str:
    return f"{buf.cfg.num_nodes}x{buf.cfg.ranks_per_node}"


def _tuning(buf: Buffer) -> dict:
    """The native kernels' tuning knobs (MOE_EP_* environment variables), so results record them."""
    ctx = getattr(buf.backend, "_ctx", None)
    return dict(ctx.tuning) if ctx is not None else {}


def _short_name(kernel: str) -> str:
    """A readable kernel name: mangled names keep their tail (the function), others their head."""
    return kernel[-48:] if kernel.startswith("__nv_static") or kernel.startswith("_Z") else kernel[:48]


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device="cuda" if torch.cuda.is_available() and
                     dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def n1_inputs(tokens: int, hidden: int, experts: int, topk: int, device: torch.device, seed: int):
    """The canonical routing (docs/benchmarks.md): topk of |randn| + 1 scores; random bf16 rows; random weights."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, device=device).to(torch.bfloat16)
    scores = torch.randn(tokens, experts, generator=g, device=device).abs() + 1
    topk_idx = torch.topk(scores, topk, dim=1).indices
    weights = torch.rand(tokens, topk, generator=g, device=device)
    return x, topk_idx, weights


def bench_normal(buf: Buffer, timer: Timer, case: str, tokens: int, sms_list: list[Optional[int]],
                 with_fp8: bool, deepep: bool) -> list[Row]:
    """Whole-call and kernel-only times of BF16/FP8 dispatch and BF16 combine on one Buffer."""
    cfg = buf.cfg
    x, idx, w = n1_inputs(tokens, cfg.hidden, cfg.num_experts, cfg.num_topk, cfg.device, seed=cfg.rank)
    q, scales = fp8.quantize(x)
    rows: list[Row] = []
    probe = buf.dispatch(x, idx, w)
    recv = probe.x.shape[0]
    remote = int((probe.src_rank != cfg.rank).sum())
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
            rows.append(Row(case, op, buf.backend_name, sms, tokens, cfg.hidden, timer.call_us(fn), timer.kernel_us(fn),
                            recv * row_bytes, remote * row_bytes, ref_us, cold_us=timer.cold_us(fn),
                            extra={"kernels": timer.last_kernels, "tuning": _tuning(buf)}, topology=_topology(buf)))
    return rows


def bench_nccl_a2a(buf: Buffer, timer: Timer, case: str, tokens: int) -> Row:
    """Raw all_to_all_single moving the rows a BF16 dispatch moves (own rows included)."""
    cfg = buf.cfg
    x, idx, w = n1_inputs(tokens, cfg.hidden, cfg.num_experts, cfg.num_topk, cfg.device, seed=cfg.rank)
    layout = buf.get_dispatch_layout(idx)
    send = layout.num_tokens_per_rank.tolist()
    recv_t = torch.empty_like(layout.num_tokens_per_rank)
    dist.all_to_all_single(recv_t, layout.num_tokens_per_rank)
    recv = recv_t.tolist()
    inp = torch.randn(sum(send), cfg.hidden, device=cfg.device).to(torch.bfloat16)
    out = torch.empty(sum(recv), cfg.hidden, dtype=torch.bfloat16, device=cfg.device)
    fn = lambda: dist.all_to_all_single(out, inp, recv, send)  # noqa: E731
    remote = sum(r for s, r in enumerate(recv) if s != cfg.rank)
    return Row(case, "all_to_all_single", "nccl", None, tokens, cfg.hidden, timer.call_us(fn), timer.kernel_us(fn),
               sum(recv) * 2 * cfg.hidden, remote * 2 * cfg.hidden)


def _graph_capturable(buf: Buffer) -> bool:
    """Whether the Buffer's calls can be captured in a CUDA graph: only the native backend's can (the
    reference backend's NCCL collectives and host syncs stop a capture)."""
    return buf.backend_name == "nvshmem"


def bench_low_latency(buf: Buffer, timer: Timer, tokens: int) -> list[Row]:
    """L1: FP8 dispatch and BF16 combine, whole calls (also replayed from a CUDA graph where the
    backend can be captured) and the hook's send/receive halves."""
    cfg = buf.cfg
    x, idx, w = n1_inputs(tokens, cfg.hidden, cfg.num_experts, cfg.num_topk, cfg.device, seed=cfg.rank)
    d = buf.low_latency_dispatch(x, idx, use_fp8=True)
    y = torch.randn(d.x.shape, device=cfg.device).to(torch.bfloat16)
    pairs = int(d.count.sum())
    row_fp8, row_bf16 = cfg.hidden + 4 * cfg.num_scales, 2 * cfg.hidden
    ref = DEEPEP_L1.get(tokens)
    rows = []
    graph = _graph_capturable(buf)

    def add(op: str, fn: Callable[[], object], row_bytes: int, ref_us: Optional[float]) -> None:
        rows.append(Row("L1", op, buf.backend_name, None, tokens, cfg.hidden, timer.call_us(fn), timer.kernel_us(fn),
                        pairs * row_bytes, 0, ref_us, cold_us=timer.cold_us(fn), extra={"kernels": timer.last_kernels},
                        topology=_topology(buf)))
        if graph:
            rows.append(Row("L1", op + "_graph", buf.backend_name, None, tokens, cfg.hidden, timer.graph_us(fn), None,
                            pairs * row_bytes, 0, ref_us, topology=_topology(buf)))

    # Combine first: a low-latency dispatch result (and its handle) stays valid for two dispatches only.
    add("ll_combine_bf16", lambda: buf.low_latency_combine(y, idx, w, d.handle), row_bf16, ref[1] if ref else None)
    halves = [
        ("ll_combine_bf16", lambda: buf.low_latency_combine(y, idx, w, d.handle, return_recv_hook=True), row_bf16),
        ("ll_dispatch_fp8", lambda: buf.low_latency_dispatch(x, idx, use_fp8=True, return_recv_hook=True), row_fp8),
    ]
    for op, send, row_bytes in halves:
        send_us, recv_us = timer.split_us(send)
        for half, us in (("send", send_us), ("recv", recv_us)):
            rows.append(Row("L1", f"{op}_{half}", buf.backend_name, None, tokens, cfg.hidden, us, None,
                            pairs * row_bytes, 0, topology=_topology(buf)))
    add("ll_dispatch_fp8", lambda: buf.low_latency_dispatch(x, idx, use_fp8=True), row_fp8, ref[0] if ref else None)
    return rows


def bench_layer(timer: Timer, shape: LayerShape, backend: str) -> list[Row]:
    """moe_ep.MoE forward, backward and both (normal mode, bf16 experts) on one backend; what it
    allocates is garbage once it returns (the caller collects it before the next case)."""
    with Buffer(hidden=shape.hidden, num_experts=shape.experts, num_topk=shape.topk,
                max_tokens_per_rank=shape.tokens, backend=backend) as buf:
        torch.manual_seed(0)  # the router is replicated: the same weights on every rank
        moe = MoE(buf, shape.ffn, dtype=torch.bfloat16)
        g = torch.Generator(device=buf.device).manual_seed(buf.rank)
        x = torch.randn(shape.tokens, shape.hidden, generator=g, device=buf.device).to(torch.bfloat16).requires_grad_()
        grad = torch.randn(shape.tokens, shape.hidden, generator=g, device=buf.device).to(torch.bfloat16)
        outputs: list[torch.Tensor] = []
        times = timer.parts_us([lambda: outputs.append(moe(x, mode="normal")), lambda: outputs.pop().backward(grad)])
        sms = buf.cfg.num_sms if buf.backend_name == "nvshmem" else None
        return [Row("layer", op, buf.backend_name, sms, shape.tokens, shape.hidden, us, None, 0, 0,
                    topology=_topology(buf)) for op, us in zip(("forward", "backward", "forward_backward"), times)]


def _cell(value: Optional[float], width: int, sign: str = "") -> str:
    """A right-aligned table cell with one decimal ("+": always signed), "-" for no value."""
    return f"{value:{sign}{width}.1f}" if value is not None else f"{'-':>{width}}"


def print_table(rows: list[Row]) -> None:
    head = f"{'case':<6} {'op':<22} {'backend':<9} {'nodes':>5} {'SMs':>4} {'tokens':>6} {'hidden':>6} {'call us':>9} " \
           f"{'cold us':>9} {'overhead':>8} {'kernel us':>9} {'GB/s':>7} {'remote':>7} {'%link':>6} {'DeepEP':>8} " \
           f"{'speedup':>7}"
    print(head)
    print("-" * len(head))
    for r in rows:
        link = f"{100 * r.link_us / r.call_us:5.1f}%" if r.remote_bytes and r.case != "cpu" else "     -"
        ref = f"{r.deepep_us:8.1f}" if r.deepep_us else "       -"
        speed = f"{r.deepep_us / r.call_us:6.2f}x" if r.deepep_us else "      -"
        print(f"{r.case:<6} {r.op:<22} {r.backend:<9} {r.topology or '-':>5} {r.sms or '-':>4} {r.tokens:>6} "
              f"{r.hidden:>6} {r.call_us:9.1f} {_cell(r.cold_us, 9)} {_cell(r.overhead_us, 8, '+')} {_cell(r.kernel_us, 9)} "
              f"{_cell(r.gbps if r.recv_bytes else None, 7)} {_cell(r.remote_gbps if r.recv_bytes else None, 7)} "
              f"{link} {ref} {speed}")


def print_kernels(rows: list[Row]) -> None:
    """Rank 0's device time per kernel for each measured call (from the profiler)."""
    for r in rows:
        kernels = r.extra.get("kernels")
        if kernels:
            split = ", ".join(f"{name} {us:.1f}" for name, us in sorted(kernels.items(), key=lambda kv: -kv[1]))
            print(f"  {r.case} {r.op} {r.backend} {r.topology} sms={r.sms or '-'}: {split}")


def plot(rows: list[Row], path: Path) -> None:
    """N1 times per SM budget against DeepEP and the link limit (the remote bytes at NVLINK_LIMIT_GBPS for
    that SM budget), for the first topology measured; and the sweep's bandwidth per token count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n1 = [r for r in rows if r.case == "N1" and r.sms]
    n1 = [r for r in n1 if r.topology == n1[0].topology]  # not the --ranks-per-node pass
    sweep = [r for r in rows if r.case == "sweep"]
    panels = (["n1"] if n1 or not sweep else []) + (["sweep"] if sweep else [])  # no empty N1 panel
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    if "n1" in panels:
        ax = axes[0][panels.index("n1")]
        for op, color in (("dispatch_bf16", "C0"), ("dispatch_fp8", "C1"), ("combine_bf16", "C2")):
            pts = sorted((r for r in n1 if r.op == op), key=lambda r: r.sms)
            if pts:
                sms = [r.sms for r in pts]
                ax.plot(sms, [r.call_us for r in pts], "o-", color=color, label=f"moe_ep {op}")
                ax.plot(sms, [r.deepep_us for r in pts], "x:", color=color, alpha=0.6, label=f"DeepEP {op}")
                ax.plot(sms, [r.link_us for r in pts], "--", color=color, lw=1, alpha=0.8, label=f"link limit {op}")
        ax.set(xlabel="SMs", ylabel="us per call (lower is better)", title="N1: EP2, 4096 tokens, hidden 7168, top-8/256")
        if n1:
            ax.legend(fontsize=7)
    if sweep:
        ax = axes[0][panels.index("sweep")]
        for hidden in sorted({r.hidden for r in sweep}):
            for op, style in (("dispatch_bf16", "o-"), ("combine_bf16", "s--")):
                pts = sorted((r.tokens, r.gbps) for r in sweep if r.hidden == hidden and r.op == op)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{op} H={hidden}")
        ax.set_xscale("log", base=2)
        ax.set(xlabel="tokens per rank", ylabel="GB/s (received bytes / call time)", title="sweep (native)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="auto",
                   help="comma list of n1,n1-native (N1 without the NCCL baselines),l1,sweep,cpu,layer "
                        "(moe_ep.MoE forward/backward, sizes from --layer-*) (auto: n1,l1 on GPU, cpu otherwise)")
    p.add_argument("--sms", default="8,16,24,32", help="SM budgets for the native backend")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default="bench/results", help="folder for the JSON and PNG")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="also measure native N1/L1 with nodes of this many ranks (1: network leg between GPUs)")
    for f in fields(LayerShape):
        p.add_argument(f"--layer-{f.name}", type=int, default=f.default,
                       help=f"layer case: {f.name} (default %(default)s)")
    args = p.parse_args()

    use_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if use_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if use_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if use_gpu else torch.device("cpu")
    cases = (["n1", "l1"] if use_gpu else ["cpu"]) if args.cases == "auto" else args.cases.split(",")
    timer = Timer(device, args.warmup, args.iters)
    sms_list = [int(s) for s in args.sms.split(",")]
    rows: list[Row] = []

    if "cpu" in cases:
        with Buffer(hidden=2048, num_experts=64, num_topk=8, max_tokens_per_rank=512, backend="reference",
                    low_latency=True) as buf:
            rows += bench_normal(buf, timer, "cpu", 512, [None], with_fp8=True, deepep=False)
    if "layer" in cases:
        shape = LayerShape(**{f.name: getattr(args, f"layer_{f.name}") for f in fields(LayerShape)})
        for backend in dict.fromkeys([auto_backend(device)[0], "reference"]):  # native first where built
            rows += bench_layer(timer, shape, backend)
            gc.collect()  # the MoE's weights, gradients and autograd state, before the next case allocates
            if use_gpu:
                torch.cuda.empty_cache()
    topologies = [None] + ([args.ranks_per_node] if args.ranks_per_node is not None else [])
    if "n1" in cases or "n1-native" in cases:
        for rpn in topologies:
            with Buffer(hidden=7168, num_experts=256, num_topk=8, max_tokens_per_rank=4096, ranks_per_node=rpn) as buf:
                rows += bench_normal(buf, timer, "N1", 4096, sms_list, with_fp8=True,
                                     deepep=world == 2 and buf.cfg.num_nodes == 1)
    if "n1" in cases:
        with Buffer(hidden=7168, num_experts=256, num_topk=8, max_tokens_per_rank=4096, backend="reference") as buf:
            rows += bench_normal(buf, timer, "N1", 4096, [None], with_fp8=True, deepep=False)
            rows.append(bench_nccl_a2a(buf, timer, "N1", 4096))
    if "l1" in cases:
        for rpn in topologies:
            for tokens in (128, 256):
                with Buffer(hidden=7168, num_experts=256, num_topk=8, max_tokens_per_rank=tokens, low_latency=True,
                            ranks_per_node=rpn) as buf:
                    rows += bench_low_latency(buf, timer, tokens)
    if "sweep" in cases:
        for hidden in (2048, 4096, 7168):
            with Buffer(hidden=hidden, num_experts=256, num_topk=8, max_tokens_per_rank=16384) as buf:
                for tokens in (128, 512, 2048, 4096, 8192, 16384):
                    rows += bench_normal(buf, timer, "sweep", tokens, [None], with_fp8=False, deepep=False)

    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "world_size": world,
            "device": torch.cuda.get_device_name() if use_gpu else "cpu",
            "torch": torch.__version__,
            "timing": f"median of {args.iters} calls after {args.warmup} warm-up"
                      + (", L2 flushed (256 MB) between calls" if use_gpu else ", host clock"),
        }
        stem = "bench_" + "_".join(cases)
        (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": [
            {**asdict(r), "gbps": r.gbps, "remote_gbps": r.remote_gbps, "overhead_us": r.overhead_us}
            for r in rows]}, indent=1))
        try:
            plot(rows, out / f"{stem}.png")
        except ImportError:
            print("matplotlib is not installed: no plot written")
        print(f"# {meta['device']} x{world}, {meta['date']}, {meta['timing']}")
        print_table(rows)
        print("device time per kernel (us, rank 0):")
        print_kernels(rows)
    if use_gpu:
        from .backends.symmetric import NvshmemSession

        NvshmemSession.shutdown()  # collective; every Buffer above is closed
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
