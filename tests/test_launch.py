"""moe_ep.launch.plan: where each torchrun rank goes, and topology.ranks_per_gpu (no processes needed)."""
from __future__ import annotations

import pytest
import torch

from moe_ep.comm import topology
from moe_ep.launch import plan


@pytest.mark.parametrize("local_world, gpus, per_gpu, want", [
    (2, 2, None, [("cuda:0", 1, "nccl"), ("cuda:1", 1, "nccl")]),
    (4, 1, None, [("cuda:0", 4, "gloo")] * 4),
    (4, 2, None, [("cuda:0", 2, "gloo"), ("cuda:0", 2, "gloo"), ("cuda:1", 2, "gloo"), ("cuda:1", 2, "gloo")]),
    (4, 8, 2, [("cuda:0", 2, "gloo"), ("cuda:0", 2, "gloo"), ("cuda:1", 2, "gloo"), ("cuda:1", 2, "gloo")]),
    (8, 1, 8, [("cuda:0", 8, "gloo")] * 8),
])
def test_ranks_spread_over_the_gpus(local_world, gpus, per_gpu, want) -> None:
    got = [plan(r, local_world, gpus, "auto", per_gpu) for r in range(local_world)]
    assert [(str(p.device), p.ranks_per_gpu, p.backend) for p in got] == want
    assert all(p.shared_gpu == (p.ranks_per_gpu > 1) for p in got)


def test_cpu_and_bad_requests() -> None:
    assert plan(1, 2, 0) == plan(0, 2, 4, "cpu")
    assert plan(0, 2, 0).device == torch.device("cpu") and plan(0, 2, 0).backend == "gloo"
    with pytest.raises(ValueError, match="must divide the ranks on this host"):
        plan(0, 4, 1, "auto", 3)
    with pytest.raises(ValueError, match="need 4 GPUs; this host has 2"):
        plan(0, 4, 2, "auto", 1)
    with pytest.raises(ValueError, match="needs CUDA devices"):
        plan(0, 2, 0, "auto", 2)
    with pytest.raises(RuntimeError, match="sees no CUDA device"):
        plan(0, 2, 0, "cuda")
    with pytest.raises(ValueError, match="positive int"):
        plan(0, 2, 1, "auto", 0)


def test_ranks_per_gpu_counts_same_host_and_uuid() -> None:
    places = [("a", "GPU-1"), ("a", "GPU-1"), ("a", "GPU-2"), ("b", "GPU-1"), ("b", "GPU-1"), ("b", "GPU-1")]
    assert topology.ranks_per_gpu(places) == 3  # host b's GPU-1 is another GPU than host a's
    assert topology.ranks_per_gpu([("a", "GPU-1"), ("a", "GPU-2")]) == 1
    assert topology.ranks_per_gpu([("a", None), ("a", None)]) == 0
