"""Why the experts' GEMMs cost more on a router's groups than on equal ones: torch._grouped_mm, each
GEMM of the layer's forward and backward (moe_ep.bench.gemm_cases), on equal groups and on the groups
of a fresh router's top-k over random tokens, at issue 21's shape. One GPU, one process:
`python3 bench/grouped_mm_groups.py [--tokens 4096 --experts 128 --topk 8 --hidden 7168 --ffn 2048]`.

On sm90, ATen runs groups averaging more than 128 rows on 128 x 256 tiles in 2 x 1 clusters, which
(our reading of the timings) computes every group in blocks of 256 rows: a group of 257-297 rows costs
what 512 do. The last column forces ATen's other kernel (64 x 128 ping-pong tiles, picked when
groups average 128 rows or fewer) on the router's groups by listing three empty groups after each
expert's (the weights viewed at a quarter of an expert's stride): it is slower, not faster.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from moe_ep.bench import Timer, tflops

SPREAD = 4  # groups per expert in the forced-kernel column: the expert's, then SPREAD - 1 empty ones


def router_groups(tokens: int, experts: int, topk: int, hidden: int, device: torch.device) -> torch.Tensor:
    """[E] int64 rows per expert from a fresh router's softmax top-k of random tokens (weights std 0.02,
    as moe_ep.moe.router initialises them)."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g, device=device)
    w = torch.randn(experts, hidden, generator=g, device=device) * 0.02
    idx = (x @ w.t()).softmax(-1).topk(topk, dim=-1).indices
    return torch.bincount(idx.reshape(-1), minlength=experts)


def spread(weights: torch.Tensor) -> torch.Tensor:
    """[E, A, B] contiguous -> [SPREAD (E - 1) + 1, A, B]: expert e's weights at group SPREAD * e, the
    groups between them reading into e's (they are given no rows)."""
    e, a, b = weights.shape
    step = weights.stride(0) // SPREAD
    return weights.as_strided((SPREAD * (e - 1) + 1, a, b), (step, weights.stride(1), weights.stride(2)))


def spread_offsets(counts: torch.Tensor) -> torch.Tensor:
    rows = torch.zeros(SPREAD * (counts.shape[0] - 1) + 1, dtype=torch.int64, device=counts.device)
    rows[::SPREAD] = counts
    return torch.cumsum(rows, 0).to(torch.int32)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    for name, default in (("tokens", 4096), ("experts", 128), ("topk", 8), ("hidden", 7168), ("ffn", 2048),
                          ("iters", 20)):
        p.add_argument(f"--{name}", type=int, default=default)
    args = p.parse_args()
    dev, bf = torch.device("cuda"), torch.bfloat16
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # the Timer's barriers
    timer = Timer(dev, warmup=5, iters=args.iters)
    e, h, f = args.experts, args.hidden, args.ffn
    counts = router_groups(args.tokens, e, args.topk, h, dev)
    pairs = int(counts.sum())
    print(f"torch {torch.__version__}; {pairs} pairs over {e} experts; router's groups: "
          f"{int(counts.min())}-{int(counts.max())} rows, {int((counts > 256).sum())} above 256")
    w13 = torch.randn(e, 2 * f, h, device=dev, dtype=bf) * 0.02
    w2 = torch.randn(e, h, f, device=dev, dtype=bf) * 0.02
    rows = {n: torch.randn(pairs, n, device=dev, dtype=bf) for n in (h, 2 * f, f)}
    cases = {  # name: (rows [P, K], weights [E, ., .], transposed, FLOPs): the GEMMs whose groups split the rows
        "fwd gate/up [P,H]x[H,2F]": (rows[h], w13, True, 4.0 * pairs * h * f),
        "fwd down [P,F]x[F,H]": (rows[f], w2, True, 2.0 * pairs * h * f),
        "bwd dA = dY w2": (rows[h], w2, False, 2.0 * pairs * h * f),
        "bwd dX = dH13 w13": (rows[2 * f], w13, False, 4.0 * pairs * h * f),
    }
    offsets = {"equal": torch.full((e,), pairs // e, device=dev), "router": counts}
    print(f"{'GEMM':26s} {'equal ms':>9s} {'router ms':>10s} {'TFLOP/s':>8s} {'router, 64x128 forced ms':>25s}")
    for name, (a, w, transposed, flop) in cases.items():
        def run(weights: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
            return torch._grouped_mm(a, weights.transpose(1, 2) if transposed else weights, offs=offs)

        t = {kind: timer.call_us(lambda c=c: run(w, torch.cumsum(c, 0).to(torch.int32))) for kind, c in offsets.items()}
        forced = timer.call_us(lambda: run(spread(w), spread_offsets(counts)))
        print(f"{name:26s} {t['equal'] / 1e3:9.3f} {t['router'] / 1e3:10.3f} {tflops(flop, t['router']):8.0f} "
              f"{forced / 1e3:25.3f}")


if __name__ == "__main__":
    main()
