"""The sm90 CUTLASS FP8 grouped GEMM (moe_ep.moe.fp8_grouped_gemm_sm90, each tile config and raster order) beside
our Triton FP8 grouped GEMM (moe_ep.moe.fp8_experts.grouped_gemm, default tiles), torch's bf16 torch._grouped_mm and
torch's FP8 torch._scaled_grouped_mm (rowwise scales, where this torch accepts it) on the MoE shapes: gate/up
(N 4096, K 7168) and down (N 7168, K 2048) over 128 experts (router-like counts: top-8 of random scores for 4096
tokens; and equal counts), and over 8 and 16 experts with thousands of rows each. M = 32768 rows in every case.

Timing: CUDA events around each call, 5 warm-up calls, the median of 20, a 256 MB write before every call (so L2
holds none of the operands). TFLOP/s = 2 M N K / t. Each case also reports the largest difference between the
CUTLASS and Triton outputs relative to the largest Triton value (a check at full size). One GPU, one process:
`python3 bench/fp8_grouped_gemm_sm90.py [--out results.json] [--cases gate_up_e128,down_e128]`."""
from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

from moe_ep.moe import fp8_experts
from moe_ep.moe import fp8_grouped_gemm_sm90 as sm90

ROWS = 32768
WARMUP, ITERS = 5, 20
FLUSH_BYTES = 256 << 20


@dataclass(frozen=True)
class Shape:
    """One GEMM: `experts` weights of [n, k]; router-like counts route `tokens` tokens top-`topk`."""

    name: str
    experts: int
    n: int
    k: int
    tokens: int
    topk: int


SHAPES = [Shape(f"{part}_e{e}", e, n, k, ROWS // topk, topk)
          for e, topk in ((128, 8), (16, 4), (8, 2)) for part, n, k in (("gate_up", 4096, 7168), ("down", 7168, 2048))]


@dataclass
class Row:
    """One timed kernel on one shape and one set of counts."""

    shape: str
    counts: str
    kernel: str
    ms: Optional[float]
    tflops: Optional[float]
    note: str = ""


def router_counts(shape: Shape, device: torch.device) -> torch.Tensor:
    """Rows per expert of shape.tokens tokens sent to the top-k of random scores (a fresh router's imbalance)."""
    g = torch.Generator(device=device).manual_seed(0)
    idx = torch.randn(shape.tokens, shape.experts, generator=g, device=device).topk(shape.topk, dim=1).indices
    return torch.bincount(idx.flatten(), minlength=shape.experts).to(torch.int32)


def time_ms(fn: Callable[[], object], flush: torch.Tensor) -> float:
    """Median over ITERS calls (after WARMUP) of fn's CUDA-event time, L2 flushed before each call."""
    times = []
    for i in range(WARMUP + ITERS):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        if i >= WARMUP:
            times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times)


def kernels(a: torch.Tensor, a_scale: torch.Tensor, counts: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
            a_bf16: torch.Tensor, b_bf16: torch.Tensor) -> dict[str, Callable[[], object]]:
    """name -> one call on these operands (the bf16 copies for torch._grouped_mm)."""
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    out = torch.empty(a.shape[0], b.shape[1], dtype=torch.bfloat16, device=a.device)
    calls: dict[str, Callable[[], object]] = {}
    for tiles in ("cooperative_128x128", "pingpong_64x128"):
        for raster in ("along_m", "along_n"):
            config = sm90.GemmConfig(tiles, raster)
            calls[f"cutlass {tiles} {raster}"] = lambda c=config: sm90.grouped_gemm(a, a_scale, counts, b, b_scale,
                                                                                    out=out, config=c)
    calls["triton fp8_experts.grouped_gemm"] = lambda: fp8_experts.grouped_gemm(a, a_scale, None, counts, b, b_scale,
                                                                                tiles=fp8_experts.TILES, out=out)
    calls["torch._grouped_mm bf16"] = lambda: torch._grouped_mm(a_bf16, b_bf16.transpose(1, 2), offs=offs)
    row_scale = torch.ones(a.shape[0], device=a.device)
    col_scale = torch.ones(b.shape[0], b.shape[1], device=a.device)
    calls["torch._scaled_grouped_mm fp8 rowwise"] = lambda: torch._scaled_grouped_mm(
        a, b.transpose(1, 2), row_scale, col_scale, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True)
    return calls


def agreement(a: torch.Tensor, a_scale: torch.Tensor, counts: torch.Tensor, b: torch.Tensor,
              b_scale: torch.Tensor) -> str:
    """max |CUTLASS - Triton| / max |Triton| on these operands (the default config)."""
    want = fp8_experts.grouped_gemm(a, a_scale, None, counts, b, b_scale, tiles=fp8_experts.TILES).float()
    got = sm90.grouped_gemm(a, a_scale, counts, b, b_scale).float()
    return f"max|cutlass - triton| / max|triton| = {((got - want).abs().max() / want.abs().max()).item():.2e}"


def bench_shape(shape: Shape, device: torch.device, flush: torch.Tensor) -> list[Row]:
    """Every kernel on `shape` at router-like and at equal counts."""
    g = torch.Generator(device=device).manual_seed(1)
    b_bf16 = torch.randn(shape.experts, shape.n, shape.k, generator=g, device=device, dtype=torch.bfloat16)
    b = b_bf16.to(torch.float8_e4m3fn)
    b_scale = torch.rand(shape.experts, shape.n // 128, shape.k // 128, generator=g, device=device) * 1e-2
    a_bf16 = torch.randn(ROWS, shape.k, generator=g, device=device, dtype=torch.bfloat16)
    a = a_bf16.to(torch.float8_e4m3fn)
    a_scale = torch.rand(ROWS, shape.k // 128, generator=g, device=device) * 1e-2
    flop = 2.0 * ROWS * shape.n * shape.k
    rows = []
    equal = torch.full((shape.experts,), ROWS // shape.experts, dtype=torch.int32, device=device)
    for label, counts in (("router", router_counts(shape, device)), ("equal", equal)):
        assert int(counts.sum()) == ROWS
        label = f"{label} (min {int(counts.min())}, max {int(counts.max())})"
        note = agreement(a, a_scale, counts, b, b_scale)
        print(f"{shape.name} {label}: {note}", flush=True)
        for name, call in kernels(a, a_scale, counts, b, b_scale, a_bf16, b_bf16).items():
            try:
                ms = time_ms(call, flush)
            except (RuntimeError, NotImplementedError, ValueError, TypeError) as error:
                why = str(error).strip().splitlines()[0][:160] if str(error).strip() else type(error).__name__
                rows.append(Row(shape.name, label, name, None, None, f"not run: {why}"))
                print(f"  {name:44} not run: {why}", flush=True)
                continue
            rows.append(Row(shape.name, label, name, ms, flop / ms / 1e9, note if name.startswith("cutlass") else ""))
            print(f"  {name:44} {ms:8.3f} ms {flop / ms / 1e9:8.0f} TFLOP/s", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--cases", default=",".join(s.name for s in SHAPES), help="comma-separated shape names")
    args = p.parse_args()
    if not sm90.available():
        raise SystemExit(f"the sm90 FP8 grouped GEMM cannot run here: {sm90.unavailable_reason()}")
    device = torch.device("cuda")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device)}, M = {ROWS}")
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
    wanted = args.cases.split(",")
    rows: list[Row] = []
    for shape in (s for s in SHAPES if s.name in wanted):
        rows += bench_shape(shape, device, flush)
        torch.cuda.empty_cache()
        if args.out:  # after every shape, so a run cut short keeps what it measured
            with open(args.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "rows": ROWS,
                           "warmup": WARMUP, "iters": ITERS, "results": [asdict(r) for r in rows]}, f, indent=2)
    print(f"\n{'shape':12} {'counts':26} {'kernel':44} {'ms':>8} {'TFLOP/s':>8}")
    for r in rows:
        timing = f"{r.ms:8.3f} {r.tflops:8.0f}" if r.ms is not None else f"{'-':>8} {'-':>8}  {r.note}"
        print(f"{r.shape:12} {r.counts:26} {r.kernel:44} {timing}")


if __name__ == "__main__":
    main()
