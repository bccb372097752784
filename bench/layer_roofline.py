"""moe_ep.MoE on one GPU and one rank beside its GEMM roofline (issue 21's measurement).

Times, in one process, with CUDA events (L2 flushed by a 256 MB write before each iteration,
warm-ups, then the median): the MoE layer's forward, backward and forward + backward (gradients set
to None before every step), the grouped experts alone on the received rows, the layer's grouped
GEMMs alone (equal groups), and a dense bf16 matmul ceiling; TFLOP/s count the expert GEMMs only
(forward 6 P H F, backward twice that, P = tokens x top-k rows). Writes a JSON file and, with
--profile, the top kernels of one forward + backward.

    python3 bench/layer_roofline.py --out DIR [--tag after] [--backend reference|auto] [--recompute]

The functions are importable (moe_ep.bench can call layer_case, gemm_cases, dense_ceiling).
Run it with PYTHONPATH pointing at another checkout's package to time that tree (the "before").
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import traceback
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

import moe_ep


@dataclass
class Shape:
    """Issue 21's shape: one rank with the per-rank load of EP2 (4096 tokens x top-8 over 128 local experts)."""

    tokens: int = 4096
    hidden: int = 7168
    experts: int = 128
    topk: int = 8
    ffn: int = 2048

    @property
    def rows(self) -> int:
        return self.tokens * self.topk

    def forward_flop(self) -> float:
        """Gate/up (2 P H 2F) and down (2 P F H): the expert GEMMs of one forward."""
        return 6.0 * self.rows * self.hidden * self.ffn


class Timer:
    """Median milliseconds of calls made in turn each iteration, with an L2 flush (and `setup`) before each."""

    def __init__(self, warmup: int = 20, iters: int = 30) -> None:
        self.warmup, self.iters = warmup, iters
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def medians(self, calls: list[Callable[[], object]], setup: Optional[Callable[[], None]] = None) -> list[float]:
        """[median ms of each call, median ms of their per-iteration sum]."""
        samples = []
        for i in range(self.warmup + self.iters):
            if setup is not None:
                setup()
            self.flush.zero_()
            events = [torch.cuda.Event(enable_timing=True) for _ in range(len(calls) + 1)]
            events[0].record()
            for fn, ev in zip(calls, events[1:]):
                fn()
                ev.record()
            if i >= self.warmup:
                samples.append(events)
        torch.cuda.synchronize()
        ms = [[a.elapsed_time(b) for a, b in zip(ev, ev[1:])] for ev in samples]
        return [statistics.median(col) for col in [*zip(*ms), [sum(t) for t in ms]]]


def _tflops(flop: float, ms: float) -> float:
    return flop / (ms * 1e-3) / 1e12


def dense_ceiling(timer: Timer, n: int = 8192) -> dict:
    """bf16 n^3 matmul on random data: the GPU's practical matrix rate."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms = timer.medians([lambda: a @ b])[0]
    return {"case": f"dense bf16 {n}^3", "ms": ms, "tflops": _tflops(2.0 * n ** 3, ms)}


def gemm_cases(timer: Timer, shape: Shape) -> list[dict]:
    """The layer's grouped GEMMs alone, equal groups: the forward's (fused gate/up and down; and the
    three unfused ones of the issue), the backward's (dA, dW2, dX, dW1 + dW3)."""
    s, e, h, f, p = shape, shape.experts, shape.hidden, shape.ffn, shape.rows
    dev, bf = "cuda", torch.bfloat16
    offs = torch.arange(1, e + 1, device=dev, dtype=torch.int32) * (p // e)
    x, dy = (torch.randn(p, h, device=dev, dtype=bf) for _ in range(2))
    h13, a = torch.randn(p, 2 * f, device=dev, dtype=bf), torch.randn(p, f, device=dev, dtype=bf)
    w13 = torch.randn(e, 2 * f, h, device=dev, dtype=bf) * 0.02
    w2 = torch.randn(e, h, f, device=dev, dtype=bf) * 0.02
    gmm = torch._grouped_mm
    cases = {
        "fwd gate/up fused [P,H]x[H,2F]": (lambda: gmm(x, w13.transpose(1, 2), offs=offs), 4 * p * h * f),
        "fwd down [P,F]x[F,H]": (lambda: gmm(a, w2.transpose(1, 2), offs=offs), 2 * p * h * f),
        "fwd gate, up, down unfused (issue)": (lambda: (gmm(x, w13[:, :f].transpose(1, 2), offs=offs),
                                                        gmm(x, w13[:, f:].transpose(1, 2), offs=offs),
                                                        gmm(a, w2.transpose(1, 2), offs=offs)), 6 * p * h * f),
        "bwd dA = dY w2": (lambda: gmm(dy, w2, offs=offs), 2 * p * h * f),
        "bwd dW2 = dY^T a": (lambda: gmm(dy.t(), a, offs=offs), 2 * p * h * f),
        "bwd dX = dH13 w13": (lambda: gmm(h13, w13, offs=offs), 4 * p * h * f),
        "bwd dW1, dW3 = dH^T X": (lambda: (gmm(h13[:, :f].t(), x, offs=offs), gmm(h13[:, f:].t(), x, offs=offs)),
                                  4 * p * h * f),
    }
    rows = []
    for name, (fn, flop) in cases.items():
        ms = timer.medians([fn])[0]
        rows.append({"case": name, "ms": ms, "tflops": _tflops(flop, ms)})
    fwd = sum(r["ms"] for r in rows[:2])
    bwd = sum(r["ms"] for r in rows[3:])
    rows.append({"case": "GEMMs alone: forward (fused)", "ms": fwd, "tflops": _tflops(s.forward_flop(), fwd)})
    rows.append({"case": "GEMMs alone: forward + backward", "ms": fwd + bwd,
                 "tflops": _tflops(3 * s.forward_flop(), fwd + bwd)})
    return rows


def _group() -> None:
    """A one-process NCCL group (the Buffer needs one)."""
    if dist.is_initialized():
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))


def experts_breakdown(timer: Timer, experts: torch.nn.Module, x: torch.Tensor, topk_idx: torch.Tensor,
                      topk_weights: torch.Tensor) -> list[dict]:
    """Each pass of GroupedExperts' forward and backward alone, on the routing the layer produced
    (unequal groups): where the experts' time goes."""
    from moe_ep.expert_kernels import sum_rows, swiglu, swiglu_backward
    from moe_ep.experts import _groups, route

    f, p = experts.ffn_hidden, int((topk_idx >= 0).sum())
    r = route(topk_idx, experts.num_local_experts)
    scale = topk_weights.reshape(-1)[r.pairs].contiguous()
    xs = x.index_select(0, r.rows)
    groups, w13, w2 = _groups(xs, r.counts), experts.fused_w13, experts.w2.detach()
    h13 = groups.mm(xs, w13.transpose(1, 2))
    a = swiglu(h13, scale)
    y = groups.mm(a, w2.transpose(1, 2))
    dy, da = torch.randn_like(y), torch.randn_like(a)
    dh13 = swiglu_backward(h13, da, scale)[0]
    hfl = 2.0 * p * experts.hidden * f
    stages = {
        "route (sort pairs, one sync)": (lambda: route(topk_idx, experts.num_local_experts), 0),
        "gather rows": (lambda: x.index_select(0, r.rows), 0),
        "gate/up GEMM": (lambda: groups.mm(xs, w13.transpose(1, 2)), 2 * hfl),
        "swiglu (scaled)": (lambda: swiglu(h13, scale), 0),
        "down GEMM": (lambda: groups.mm(a, w2.transpose(1, 2)), hfl),
        "sum rows (also the backward's dX sum)": (lambda: sum_rows(y, r.slots), 0),
        "bwd gather dY": (lambda: dy.index_select(0, r.rows), 0),
        "bwd dA GEMM": (lambda: groups.mm(dy, w2), hfl),
        "bwd swiglu": (lambda: swiglu_backward(h13, da, scale), 0),
        "bwd dX GEMM": (lambda: groups.mm(dh13, w13), 2 * hfl),
        "bwd dW1 GEMM": (lambda: groups.mm_t(dh13[:, :f], xs), hfl),
        "bwd dW3 GEMM": (lambda: groups.mm_t(dh13[:, f:], xs), hfl),
        "bwd dW2 GEMM": (lambda: groups.mm_t(dy, a), hfl),
    }
    rows = []
    for name, (fn, flop) in stages.items():
        ms = timer.medians([fn])[0]
        rows.append({"case": f"  stage: {name}", "ms": ms, "tflops": _tflops(flop, ms) if flop else 0.0})
    return rows


def _repeatable(step: Callable[[], None], tensors: Callable[[], list], zero: Callable[[], None]) -> bool:
    """Whether two forward + backward steps give the same bits (x.grad and every parameter's grad)."""
    got = []
    for _ in range(2):
        zero()
        step()
        got.append([t.clone() for t in tensors()])
    return all(torch.equal(a, b) for a, b in zip(*got))


def layer_case(timer: Timer, shape: Shape, backend: str = "reference", recompute: bool = False,
               profile_to: Optional[str] = None, breakdown: bool = False) -> list[dict]:
    """moe_ep.MoE (normal mode, bf16 experts) forward, backward, forward + backward, and its experts
    alone on the rows dispatch delivered; with profile_to, the top kernels of one step to that file;
    with breakdown, each pass of the experts alone (experts_breakdown)."""
    _group()
    s = shape
    buf = moe_ep.Buffer(None, hidden=s.hidden, num_experts=s.experts, num_topk=s.topk,
                        max_tokens_per_rank=s.tokens, backend=backend)
    torch.manual_seed(0)
    kw = {"recompute_swiglu": True} if recompute else {}
    moe = moe_ep.MoE(buf, s.ffn, dtype=torch.bfloat16, **kw)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(s.tokens, s.hidden, generator=g, device="cuda").to(torch.bfloat16).requires_grad_()
    grad = torch.randn(s.tokens, s.hidden, generator=g, device="cuda").to(torch.bfloat16)
    outs: list[torch.Tensor] = []

    def zero() -> None:
        moe.zero_grad(set_to_none=True)
        x.grad = None

    torch.cuda.reset_peak_memory_stats()
    fwd, bwd, both = timer.medians([lambda: outs.append(moe(x, mode="normal")), lambda: outs.pop().backward(grad)],
                                   setup=zero)
    peak = torch.cuda.max_memory_allocated() / 2 ** 30
    repeat = _repeatable(lambda: moe(x, mode="normal").backward(grad),
                         lambda: [x.grad, *(p.grad for p in moe.parameters() if p.grad is not None)], zero)
    routing = moe.last_routing
    d = moe_ep.autograd.dispatch(buf, x.detach(), routing.topk_idx, routing.topk_weights.detach())
    rx = d.x.detach().requires_grad_()
    rgrad = torch.randn(rx.shape, device="cuda").to(torch.bfloat16)
    rgrads = {torch.bfloat16: rgrad, torch.float32: rgrad.float()}  # the old experts returned float32

    def experts_backward() -> None:
        y = outs.pop()
        y.backward(rgrads[y.dtype])

    def zero_experts() -> None:
        zero()
        rx.grad = None

    e_fwd, e_bwd, e_both = timer.medians([lambda: outs.append(moe.experts(rx, d.topk_idx, d.topk_weights)),
                                          experts_backward], setup=zero_experts)
    stages = experts_breakdown(timer, moe.experts, d.x, d.topk_idx, d.topk_weights) if breakdown else []
    if profile_to:
        from torch.profiler import ProfilerActivity, profile
        zero()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            moe(x, mode="normal").backward(grad)
            torch.cuda.synchronize()
        with open(profile_to, "w") as fh:
            fh.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=90))
    tag = f"{buf.backend_name}{' recompute' if recompute else ''}"
    flop = s.forward_flop()
    buf.close()
    return [
        {"case": f"MoE forward ({tag})", "ms": fwd, "tflops": _tflops(flop, fwd), "repeatable": repeat},
        {"case": f"MoE backward ({tag})", "ms": bwd, "tflops": _tflops(2 * flop, bwd)},
        {"case": f"MoE forward + backward ({tag})", "ms": both, "tflops": _tflops(3 * flop, both), "peak_gib": peak},
        {"case": f"experts alone forward ({tag})", "ms": e_fwd, "tflops": _tflops(flop, e_fwd)},
        {"case": f"experts alone backward ({tag})", "ms": e_bwd, "tflops": _tflops(2 * flop, e_bwd)},
        {"case": f"experts alone forward + backward ({tag})", "ms": e_both, "tflops": _tflops(3 * flop, e_both)},
        *stages,
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--tag", default="after")
    p.add_argument("--backend", default="reference")
    p.add_argument("--recompute", action="store_true", help="also time MoE(..., recompute_swiglu=True)")
    p.add_argument("--gemms", action="store_true", help="also time the GEMMs alone and the dense ceiling")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--breakdown", action="store_true", help="time each pass of the experts alone (this tree's experts)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    timer, shape = Timer(args.warmup, args.iters), Shape()
    rows = []
    if args.gemms:
        rows += [dense_ceiling(timer), *gemm_cases(timer, shape)]
        torch.cuda.empty_cache()
    for backend in args.backend.split(","):
        prof = os.path.join(args.out, f"profile_{args.tag}_{backend}.txt") if args.profile else None
        for recompute in (False, True) if args.recompute else (False,):
            try:
                rows += layer_case(timer, shape, backend, recompute=recompute, profile_to=None if recompute else prof,
                                   breakdown=args.breakdown and not recompute)
            except Exception:  # one failing case must not lose the others' numbers
                traceback.print_exc()
            torch.cuda.empty_cache()
    info = {"tag": args.tag, "shape": asdict(shape), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "moe_ep": moe_ep.__file__, "rows": rows}
    with open(os.path.join(args.out, f"layer_roofline_{args.tag}.json"), "w") as fh:
        json.dump(info, fh, indent=1)
    print(f"--- {args.tag}: {torch.cuda.get_device_name()}, torch {torch.__version__}, {asdict(shape)}")
    for r in rows:
        extra = "".join(f"  {k}={v:.2f}" if isinstance(v, float) else f"  {k}={v}" for k, v in r.items()
                        if k not in ("case", "ms", "tflops"))
        print(f"{r['case']:<48} {r['ms']:8.3f} ms {r['tflops']:7.1f} TFLOP/s{extra}")


if __name__ == "__main__":
    main()
