"""Every kernel knob of moe_ep.Config changes speed only: the native NVLink and cross-node kernels give
the reference backend's bits (an independent implementation that ignores the knobs) for the default
knobs and for each changed knob they run, per call and per Buffer (2 ranks on the GPUs present, sharing
one where there is one); a knob of the other path is refused on every rank (moe_ep.comm.config
KNOB_PATHS). Before every native call the workspace and the allocator's free blocks are poisoned, so a
knob under which a kernel skips rows cannot pass."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import moe_ep
from moe_ep import Config
from tests._dist import device, requires_gpus, run_workers
from tests.oracle import random_topk
from tests.test_gpu_intranode import _poison_allocator, _poison_workspace, _same, _same_dispatch, _w

pytestmark = requires_gpus()

# per call: every per-call knob, at or near both ends of its range
PER_CALL = [dict(send_warps=1), dict(send_warps=32), dict(combine_send_warps=1), dict(combine_send_warps=31),
            dict(unroll=4), dict(flag_batch=1), dict(flag_batch=32), dict(recv_run=3), dict(recv_run=32),
            dict(num_sms=1), dict(num_sms=3), dict(eager_output_bytes=0)]
# per Buffer: each knob once, internode_workspace_bytes (per Buffer only) small enough for many token rounds
PER_BUFFER = [dict(send_warps=1), dict(combine_send_warps=31), dict(unroll=4), dict(flag_batch=32),
              dict(recv_run=32), dict(num_sms=3), dict(eager_output_bytes=0), dict(internode_workspace_bytes=4 << 20)]


def _check(nat: moe_ep.Buffer, ref: moe_ep.Buffer, args: tuple, y: torch.Tensor, wy: torch.Tensor,
           config: Config | None, what: str) -> None:
    """dispatch, combine (with and without weights) and a cached dispatch on `nat` under `config`, bitwise
    against the same calls on the reference Buffer."""
    x, idx, w = args
    want = ref.dispatch(x, idx, w)
    _poison_workspace(nat)
    _poison_allocator()
    got = nat.dispatch(x, idx, w, config=config)
    _same_dispatch(got, want, f"{what}: dispatch")
    _poison_workspace(nat)
    _poison_allocator()
    _same(nat.combine(y, got.handle, config=config), ref.combine(y, want.handle), f"{what}: combine")
    _poison_workspace(nat)
    _poison_allocator()
    (got_y, got_w), (want_y, want_w) = (nat.combine(y, got.handle, topk_weights=wy, config=config),
                                        ref.combine(y, want.handle, topk_weights=wy))
    _same(got_y, want_y, f"{what}: combine with weights: rows")
    _same(got_w, want_w, f"{what}: combine with weights: weights")
    _poison_workspace(nat)
    _poison_allocator()
    _same_dispatch(nat.dispatch(x, handle=got.handle, config=config), ref.dispatch(x, handle=want.handle),
                   f"{what}: cached dispatch")


def _worker(rank: int, world: int) -> None:
    hidden, experts, k, t = 2048, 16, 4, 200
    g = torch.Generator(device="cuda").manual_seed(rank)
    n = (200, 77)[rank]
    x = torch.randn(n, hidden, generator=g, device="cuda").to(torch.bfloat16)
    args = (x, random_topk("random", n, experts, k, g), torch.rand(n, k, generator=g, device="cuda"))
    for topo, path in (({}, "nvlink"), ({"ranks_per_node": 1}, "cross-node")):
        common = dict(hidden=hidden, num_experts=experts, num_topk=k, max_tokens_per_rank=t, device=device(), **topo)
        with moe_ep.Buffer(dist.group.WORLD, backend="reference", **common) as ref:
            m = ref.dispatch(*args).x.shape[0]
            y = torch.randn(m, hidden, generator=g, device="cuda").to(torch.bfloat16)
            wy = _w(m, k, g)
            with moe_ep.Buffer(dist.group.WORLD, backend="nvshmem", **common) as nat:
                _check(nat, ref, args, y, wy, None, f"{path} defaults")
                for change in PER_CALL:
                    config = nat.config.replace(**change)
                    if config.off_path(path):
                        with pytest.raises(ValueError, match="tunes kernels this Buffer's normal mode does not run"):
                            nat.dispatch(*args, config=config)
                        continue
                    _check(nat, ref, args, y, wy, config, f"{path} per call {change}")
            for change in PER_BUFFER:
                if Config(**change).off_path(path):
                    with pytest.raises(ValueError, match="tunes kernels this Buffer's normal mode does not run"):
                        moe_ep.Buffer(dist.group.WORLD, backend="nvshmem", config=Config(**change), **common)
                    continue
                with moe_ep.Buffer(dist.group.WORLD, backend="nvshmem", config=Config(**change), **common) as nat:
                    _check(nat, ref, args, y, wy, None, f"{path} per Buffer {change}")


def test_every_knob_gives_the_reference_bits() -> None:
    run_workers(2, _worker, backend="gpu", timeout_s=400)
