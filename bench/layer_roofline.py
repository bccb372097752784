"""moe_ep.MoE on one GPU and one rank beside its GEMM roofline (issue 21's measurement).

Times, in one process, with CUDA events (L2 flushed by a 256 MB write before each iteration,
warm-ups, then the median): the MoE layer's forward, backward and forward + backward (gradients set
to None before every step), the grouped experts alone on the received rows, the layer's grouped
GEMMs alone (equal groups), and a dense bf16 matmul ceiling; TFLOP/s count the expert GEMMs only
(moe_ep.bench.layer_flop: forward 6 P H F, backward twice that, P = the (row, local expert) pairs
the layer's routing gave). Writes a JSON file and, with --profile, the top kernels and the
per-stream timeline of one backward without and with MoE(overlap=True).

    python3 bench/layer_roofline.py --out DIR [--tag after] [--backend reference|auto] [--recompute]

The timer, the GEMMs alone, the dense ceiling and the FLOP count are moe_ep.bench's (the package
ships; bench/ does not), so this script and `moe_ep.bench --cases layer` measure alike. Run it with PYTHONPATH pointing at another checkout's package to time that tree (the "before").
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import traceback
from dataclasses import asdict
from typing import Callable, Optional

import torch
import torch.distributed as dist

import moe_ep
from moe_ep.bench import (LayerShape, Timer, dense_ceiling, expert_counts, gemm_cases, layer_flop, layer_inputs,
                          tflops, time_gemms, time_layer)

ISSUE21 = LayerShape(experts=128)  # one rank with the per-rank load of EP2: 4096 tokens x top-8 over 128 experts
CUDA = torch.device("cuda")


def _entry(case: str, us: float, flop: float) -> dict:
    """One result: ms and TFLOP/s (0 where the pass does no GEMM)."""
    return {"case": case, "ms": us / 1e3, "tflops": tflops(flop, us) if flop else 0.0}


def _group() -> None:
    """A one-process NCCL group (the Buffer and moe_ep.bench.Timer need one)."""
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
    from moe_ep.comm.row_sum import sum_rows
    from moe_ep.moe.expert_kernels import swiglu, swiglu_backward
    from moe_ep.moe.experts import groups_of, route

    f, p = experts.ffn_hidden, int((topk_idx >= 0).sum())
    r = route(topk_idx, experts.num_local_experts)
    scale = topk_weights.reshape(-1)[r.pairs].contiguous()
    xs = x.index_select(0, r.rows)
    groups, w13, w2 = groups_of(xs, r.counts), experts.fused_w13, experts.w2.detach()
    h13 = groups.mm(xs, w13.transpose(1, 2))
    a = swiglu(h13, scale)
    y = groups.mm(a, w2.transpose(1, 2))
    dy, da = torch.randn_like(y), torch.randn_like(a)
    dh13 = swiglu_backward(h13, da, scale)[0]
    hfl = layer_flop(p, experts.hidden, f) / 3  # one [P, H] x [H, F] GEMM
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
    return [_entry(f"  stage: {name}", timer.call_us(fn), flop) for name, (fn, flop) in stages.items()]


def _repeatable(step: Callable[[], None], tensors: Callable[[], list], zero: Callable[[], None]) -> bool:
    """Whether two forward + backward steps give the same bits (x.grad and every parameter's grad)."""
    got = []
    for _ in range(2):
        zero()
        step()
        got.append([t.clone() for t in tensors()])
    return all(torch.equal(a, b) for a, b in zip(*got))


def _timeline(prof: "torch.profiler.profile", min_us: float = 20.0) -> str:
    """Each stream's busy time, then every kernel or copy of at least min_us: start (ms from the first),
    duration, stream, name (from the profiler's Chrome trace)."""
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))["traceEvents"]
    ops = sorted((e for e in trace if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    if not ops:
        return "no device work recorded\n"
    t0, busy = ops[0]["ts"], {}
    for e in ops:
        stream = e.get("args", {}).get("stream", "?")
        busy[stream] = busy.get(stream, 0.0) + e["dur"]
    span = max(e["ts"] + e["dur"] for e in ops) - t0
    idle, reach = 0.0, t0  # time within the span when no stream ran anything
    for e in ops:
        idle += max(0.0, e["ts"] - reach)
        reach = max(reach, e["ts"] + e["dur"])
    lines = [f"span {span / 1e3:.3f} ms, device idle {idle / 1e3:.3f} ms; busy ms per stream: "
             + ", ".join(f"{k}: {v / 1e3:.3f}" for k, v in busy.items())]
    lines += [f"{(e['ts'] - t0) / 1e3:8.3f} {e['dur'] / 1e3:7.3f} ms stream {e.get('args', {}).get('stream', '?')} "
              f"{e['name'][:90]}" for e in ops if e["dur"] >= min_us]
    return "\n".join(lines) + "\n"


def layer_case(timer: Timer, shape: LayerShape, backend: str = "reference", recompute: bool = False,
               profile_to: Optional[str] = None, breakdown: bool = False) -> list[dict]:
    """moe_ep.MoE (normal mode, bf16 experts) forward, backward, forward + backward, and its experts
    alone on the rows dispatch delivered; with profile_to, the top kernels of one step to that file;
    with breakdown, each pass of the experts alone (experts_breakdown)."""
    s = shape
    buf = moe_ep.Buffer(None, hidden=s.hidden, num_experts=s.experts, num_topk=s.topk,
                        max_tokens_per_rank=s.tokens, backend=backend)
    torch.manual_seed(0)
    kw = {"recompute_swiglu": True} if recompute else {}
    moe = moe_ep.MoE(buf, s.ffn, dtype=torch.bfloat16, **kw)
    x, grad = layer_inputs(s, CUDA, seed=1)
    outs: list[torch.Tensor] = []

    def zero() -> None:
        moe.zero_grad(set_to_none=True)
        x.grad = None

    torch.cuda.reset_peak_memory_stats()
    fwd, bwd, both = (us / 1e3 for us in time_layer(timer, moe, x, grad, modes=(False,))[False])
    peak = torch.cuda.max_memory_allocated() / 2 ** 30
    repeat = _repeatable(lambda: moe(x, mode="normal").backward(grad),
                         lambda: [x.grad, *(p.grad for p in moe.parameters() if p.grad is not None)], zero)
    routing = moe.last_routing
    d = moe_ep.moe.autograd.dispatch(buf, x.detach(), routing.topk_idx, routing.topk_weights.detach())
    rx = d.x.detach().requires_grad_()
    rgrad = torch.randn(rx.shape, device="cuda").to(torch.bfloat16)
    rgrads = {torch.bfloat16: rgrad, torch.float32: rgrad.float()}  # the old experts returned float32

    def experts_backward() -> None:
        y = outs.pop()
        y.backward(rgrads[y.dtype])

    def zero_experts() -> None:
        zero()
        rx.grad = None

    e_fwd, e_bwd, e_both = (us / 1e3 for us in timer.parts_us(
        [lambda: outs.append(moe.experts(rx, d.topk_idx, d.topk_weights)), experts_backward], setup=zero_experts))
    stages = experts_breakdown(timer, moe.experts, d.x, d.topk_idx, d.topk_weights) if breakdown else []
    if profile_to:
        from torch.profiler import ProfilerActivity, profile
        with open(profile_to, "w") as fh:
            for on in (False, True):  # MoE(overlap=on): which stream runs what, and when
                moe.overlap = on
                for warm in (3, 2, 1, 0):  # three warm steps first: each stream's allocator pool is filled
                    zero()
                    y = moe(x, mode="normal")
                    if warm:
                        y.backward(grad)
                        continue
                    torch.cuda.synchronize()
                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                        y.backward(grad)
                        torch.cuda.synchronize()
                fh.write(f"=== backward, overlap={on}\n")
                fh.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=90))
                fh.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=90))
                fh.write(_timeline(prof))
            moe.overlap = False
    tag = f"{buf.backend_name}{' recompute' if recompute else ''}"
    flop = layer_flop(int(expert_counts(buf, routing.topk_idx).sum()), s.hidden, s.ffn)
    buf.close()
    timed = [("MoE forward", fwd, 1), ("MoE backward", bwd, 2), ("MoE forward + backward", both, 3),
             ("experts alone forward", e_fwd, 1), ("experts alone backward", e_bwd, 2),
             ("experts alone forward + backward", e_both, 3)]
    rows = [_entry(f"{name} ({tag})", t * 1e3, k * flop) for name, t, k in timed]
    rows[0]["repeatable"], rows[2]["peak_gib"] = repeat, peak
    return rows + stages


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
    _group()
    timer, shape = Timer(CUDA, args.warmup, args.iters), ISSUE21
    rows = []
    if args.gemms:
        rows.append(_entry("dense bf16 8192^3", *dense_ceiling(timer, CUDA)))
        cases = gemm_cases(shape.tokens * shape.topk, shape.experts, shape.hidden, shape.ffn, CUDA)
        rows += [_entry(name, us, flop) for name, (us, flop) in time_gemms(timer, cases).items()]
        del cases
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
