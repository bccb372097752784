"""A program as a user writes it on moe_ep.launch (run it under torchrun, or with torchrun's environment
variables): each rank dispatches random tokens, combines them back unchanged and checks the result
against a brute-force computation, then ends without closing its Buffer or destroying the group, which
moe_ep.launch's exit does (a last line says what is still up after it). --plain: a program that does not
use moe_ep.launch (its own gloo group, never destroyed; on GPU 0 where there is one). --contract (GPU) also runs tests/test_gpu_crossnode.py's cases, the native
kernels against the reference backend as two nodes of R / 2 ranks; --fail-rank N makes rank N raise
at the end. tests/test_launch.py and tests/run_gpu_scale.sh check that every rank exits 0."""
from __future__ import annotations

import argparse
import atexit
import os

import torch
import torch.distributed as dist

import moe_ep
from moe_ep.launch import init_distributed, plan

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--contract", action="store_true", help="also run the cross-node contract cases (GPU)")
parser.add_argument("--fail-rank", type=int, default=None, help="this rank raises at the end (default: none)")
parser.add_argument("--plain", action="store_true",
                    help="init_process_group('gloo') itself, no moe_ep.launch (every rank on GPU 0 where there is one)")
args = parser.parse_args()

# Registered before init_distributed registers its shutdown, so it runs after it (atexit runs last-in first-out).
atexit.register(lambda: print(f"at exit: group {'up' if dist.is_initialized() else 'destroyed'}, NVSHMEM "
                              f"{'up' if moe_ep.symmetric_heap_usage() else 'down'}", flush=True))
if args.plain:  # as a user's script: one gloo group, every rank on GPU 0 where there is one (ranks share it)
    dist.init_process_group("gloo")
    placement = plan(0, 1, min(torch.cuda.device_count(), 1))
else:
    placement = init_distributed()
rank, world = dist.get_rank(), dist.get_world_size()
if args.contract:  # first: their Buffers size the NVSHMEM heap, which the one left open below then shares
    os.environ["MOE_EP_TEST_DEVICE"] = str(placement.device)  # tests._dist.device()
    from tests.test_gpu_crossnode import _cases

    _cases(rank, world, {"ranks_per_node": max(world // 2, 1)})
buf = moe_ep.Buffer(hidden=64, num_experts=2 * world, num_topk=2, max_tokens_per_rank=16, device=placement.device)
g = torch.Generator().manual_seed(rank)
x = torch.randn(16, 64, generator=g).to(torch.bfloat16)
idx = torch.randn(16, 2 * world, generator=g).topk(2).indices
recv = buf.dispatch(x.to(placement.device), idx.to(placement.device), torch.rand(16, 2, generator=g).to(placement.device))
out = buf.combine(recv.x, recv.handle).cpu()
ranks = 1 + (idx[:, 0] // 2 != idx[:, 1] // 2).unsqueeze(1)  # a token comes back once per rank it went to
assert torch.equal(out, (x.float() * ranks).to(torch.bfloat16)), f"rank {rank}: combine differs"
print(f"rank {rank} of {world} ({buf.backend_name} on {placement.device}): combine matches", flush=True)
if rank == args.fail_rank:
    raise RuntimeError("this rank fails on purpose")
