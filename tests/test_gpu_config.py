"""Every kernel knob of moe_ep.Config changes speed only: the native NVLink and cross-node kernels give
the same bits for each changed knob, per Buffer and per call, as with the defaults (2 ranks on the GPUs
present, sharing one where there is one)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import moe_ep
from moe_ep import Config
from tests._dist import device, requires_gpus, run_workers
from tests.oracle import random_topk
from tests.test_gpu_intranode import _same, _same_dispatch

pytestmark = requires_gpus()

CHANGES = [dict(send_warps=1), dict(send_warps=32), dict(combine_send_warps=1), dict(combine_send_warps=31),
           dict(unroll=4), dict(flag_batch=1), dict(flag_batch=32), dict(recv_run=3), dict(recv_run=32),
           dict(num_sms=3), dict(eager_output_bytes=0)]


def _worker(rank: int, world: int) -> None:
    hidden, experts, k, t = 2048, 16, 4, 200
    g = torch.Generator(device="cuda").manual_seed(rank)
    n = (200, 77)[rank]
    x = torch.randn(n, hidden, generator=g, device="cuda").to(torch.bfloat16)
    idx, w = random_topk("random", n, experts, k, g), torch.rand(n, k, generator=g, device="cuda")
    for topo in ({}, {"ranks_per_node": 1}):
        common = dict(hidden=hidden, num_experts=experts, num_topk=k, max_tokens_per_rank=t, backend="nvshmem",
                      device=device(), **topo)
        with moe_ep.Buffer(dist.group.WORLD, **common) as buf:
            want = buf.dispatch(x, idx, w)
            y = torch.randn(want.x.shape, generator=g, device="cuda").to(torch.bfloat16)
            want_out = buf.combine(y, want.handle)
            for change in CHANGES:
                what = f"{topo or 'one node'} per call {change}"
                got = buf.dispatch(x, idx, w, config=buf.config.replace(**change))
                _same_dispatch(got, want, what)
                _same(buf.combine(y, got.handle, config=buf.config.replace(**change)), want_out, f"{what}: combine")
        for change in CHANGES[:3]:
            with moe_ep.Buffer(dist.group.WORLD, config=Config(**change), **common) as buf:
                got = buf.dispatch(x, idx, w)
                _same_dispatch(got, want, f"{topo or 'one node'} per Buffer {change}")
                _same(buf.combine(y, got.handle), want_out, f"{topo or 'one node'} per Buffer {change}: combine")


def test_every_knob_gives_the_same_bits() -> None:
    run_workers(2, _worker, backend="gpu", timeout_s=300)
