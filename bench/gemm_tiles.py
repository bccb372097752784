"""Pick the FP8 grouped GEMM's tiles (moe_ep.moe.fp8_experts.TILES): each candidate on the layer's two forward
GEMMs beside bf16 torch._grouped_mm on the same groups, at issue 21's shape, in equal groups and in the
unequal groups of a routing drawn like a fresh router's. One GPU, one process:
`python3 bench/gemm_tiles.py [--pairs 32768 --experts 128 --hidden 7168 --ffn 2048]`."""
from __future__ import annotations

import argparse
import dataclasses

import torch
import torch.distributed as dist
import triton

from moe_ep.comm import fp8

from moe_ep.moe import fp8_experts
from moe_ep.bench import Timer, tflops

CANDIDATES = [fp8_experts.GemmTiles(*t) for t in ((64, 128, 4, 4, False), (64, 256, 8, 3, True), (64, 128, 4, 4, True),
                                                  (128, 128, 8, 3, True))]


def groups(pairs: int, experts: int, equal: bool, device: torch.device) -> torch.Tensor:
    """Rows per expert: equal, or a multinomial draw over softmax(N(0, 0.3)) expert shares (unequal)."""
    if equal:
        return torch.full((experts,), pairs // experts, dtype=torch.int32, device=device)
    g = torch.Generator().manual_seed(0)
    share = torch.softmax(torch.randn(experts, generator=g) * 0.3, 0)
    return torch.bincount(torch.multinomial(share, pairs, True, generator=g), minlength=experts).to(torch.int32).to(device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    for name, default in (("pairs", 32768), ("experts", 128), ("hidden", 7168), ("ffn", 2048), ("iters", 20)):
        p.add_argument(f"--{name}", type=int, default=default)
    args = p.parse_args()
    print(f"triton {triton.__version__}, torch {torch.__version__}")
    dev = torch.device("cuda")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # the Timer's barriers
    timer = Timer(dev, warmup=5, iters=args.iters)
    e, h, f = args.experts, args.hidden, args.ffn
    w13, w13s = fp8_experts.quantize_weight_blocks(torch.randn(e, 2 * f, h, device=dev) * 0.02)
    w2, w2s = fp8_experts.quantize_weight_blocks(torch.randn(e, h, f, device=dev) * 0.02)
    w13b, w2b = (torch.randn(e, 2 * f, h, device=dev, dtype=torch.bfloat16),
                 torch.randn(e, h, f, device=dev, dtype=torch.bfloat16))
    print(f"{'groups':8} {'tiles (bm, bn, warps, stages, tma)':44} {'gate/up ms':>10} {'TFLOP/s':>8} {'down ms':>8} {'TFLOP/s':>8} {'both ms':>8}")
    for equal in (True, False):
        counts = groups(args.pairs, e, equal, dev)
        n = int(counts.sum())
        xq, xs = fp8.quantize(torch.randn(n, h, device=dev))
        aq, as_ = fp8.quantize(torch.randn(n, f, device=dev))
        rows = torch.randperm(n, device=dev)
        flop13, flop2 = 4.0 * n * h * f, 2.0 * n * h * f
        label = "equal" if equal else "unequal"
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        xb, ab = torch.randn(n, h, device=dev, dtype=torch.bfloat16), torch.randn(n, f, device=dev, dtype=torch.bfloat16)
        us13 = timer.call_us(lambda: torch._grouped_mm(xb, w13b.transpose(1, 2), offs=offs))
        us2 = timer.call_us(lambda: torch._grouped_mm(ab, w2b.transpose(1, 2), offs=offs))
        print(f"{label:8} {'bf16 torch._grouped_mm':44} {us13 / 1e3:10.3f} {tflops(flop13, us13):8.0f} "
              f"{us2 / 1e3:8.3f} {tflops(flop2, us2):8.0f} {(us13 + us2) / 1e3:8.3f}")
        for tiles in CANDIDATES:
            try:
                us13 = timer.call_us(lambda: fp8_experts.grouped_gemm(xq, xs, rows, counts, w13, w13s, tiles=tiles))
                us2 = timer.call_us(lambda: fp8_experts.grouped_gemm(aq, as_, None, counts, w2, w2s, tiles=tiles))
            except Exception as error:  # a tile that does not fit (shared memory, registers): say so, go on
                print(f"{label:8} {str(dataclasses.astuple(tiles)):44} failed: {type(error).__name__}: {str(error)[:80]}")
                continue
            print(f"{label:8} {str(dataclasses.astuple(tiles)):44} {us13 / 1e3:10.3f} {tflops(flop13, us13):8.0f} "
                  f"{us2 / 1e3:8.3f} {tflops(flop2, us2):8.0f} {(us13 + us2) / 1e3:8.3f}")


if __name__ == "__main__":
    main()
