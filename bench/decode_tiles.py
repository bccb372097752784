"""Pick the decode kernel's tiles (moe_ep.moe.decode_experts.TILES): each candidate on one micro-batch's
experts (expert-major rows [E, C, H], counts drawn as a router's top-k of `--tokens` tokens) beside the batched
matmul over every slot (GroupedExperts.forward_padded without counts) and the time to read the experts'
weights once at the HBM bandwidth measured in the same run. One GPU, one process:
`python3 bench/decode_tiles.py [--experts 128 --slots 128 --tokens 128 --topk 8 --hidden 7168 --ffn 2048]`."""
from __future__ import annotations

import argparse
import dataclasses

import torch
import torch.distributed as dist
import triton

from moe_ep.bench import Timer
from moe_ep.moe import decode_experts
from moe_ep.moe.experts import GroupedExperts

CANDIDATES = [decode_experts.DecodeTiles(*t) for t in ((16, 64, 128, 4, 3), (32, 64, 128, 4, 3), (64, 64, 128, 4, 3),
                                                      (16, 128, 128, 4, 3), (16, 64, 128, 4, 4), (16, 32, 256, 4, 3),
                                                      (32, 128, 64, 4, 4), (16, 64, 64, 4, 6))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    for name, default in (("experts", 128), ("slots", 128), ("tokens", 128), ("topk", 8), ("hidden", 7168),
                          ("ffn", 2048), ("iters", 20)):
        p.add_argument(f"--{name}", type=int, default=default)
    args = p.parse_args()
    print(f"triton {triton.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    dev = torch.device("cuda")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # the Timer's barriers
    timer = Timer(dev, warmup=5, iters=args.iters)
    e, c, h = args.experts, args.slots, args.hidden
    torch.manual_seed(0)
    ex = GroupedExperts(e, e, 0, h, args.ffn, dtype=torch.bfloat16, device=dev)
    idx = torch.randn(args.tokens, e, device=dev).topk(args.topk, dim=1).indices
    counts = torch.bincount(idx.flatten(), minlength=e).to(torch.int32)
    x = torch.randn(e, c, h, device=dev, dtype=torch.bfloat16)
    weight_bytes = int((counts > 0).sum()) * sum(w[0].numel() * w.element_size() for w in (ex.w1, ex.w3, ex.w2))
    src = torch.randn(1 << 30, device=dev, dtype=torch.bfloat16)
    read_us = timer.call_us(lambda: src.sum(dtype=torch.float32))
    gbps = src.numel() * 2 / read_us / 1e3
    floor_us = weight_bytes / gbps / 1e3
    print(f"counts: max {int(counts.max())}, mean {float(counts.float().mean()):.1f}; weights {weight_bytes / 1e9:.2f} GB; "
          f"HBM read {gbps:.0f} GB/s -> weight-read floor {floor_us:.0f} us")
    print(f"{'path':44} {'us':>9} {'x floor':>8} {'GB/s':>7}")
    with torch.no_grad():
        us = timer.call_us(lambda: ex.forward_padded(x))
        print(f"{'batched matmul, every slot':44} {us:9.0f} {us / floor_us:8.2f} {weight_bytes / us / 1e3:7.0f}")
        for tiles in CANDIDATES:
            try:
                us = timer.call_us(lambda: decode_experts.run(x, ex.w1, ex.w3, ex.w2, counts, tiles))
            except Exception as error:  # a tile that does not fit (shared memory, registers): say so, go on
                print(f"{str(dataclasses.astuple(tiles)):44} failed: {type(error).__name__}: {str(error)[:80]}")
                continue
            print(f"{str(dataclasses.astuple(tiles)):44} {us:9.0f} {us / floor_us:8.2f} {weight_bytes / us / 1e3:7.0f}")


if __name__ == "__main__":
    main()
