"""moe_ep.launch.plan: where each torchrun rank goes, and topology.ranks_per_gpu (no processes needed); and
programs that use moe_ep.launch exit with status 0 when every rank succeeded."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_ep.comm import topology
from moe_ep.launch import plan

ROOT = Path(__file__).resolve().parents[1]


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


# A program as a user writes it: moe_ep.launch places the rank, a Buffer dispatches and combines, and
# the program ends without closing the Buffer or destroying the group. Rank argv[1] raises at the end.
PROGRAM = """
import sys, torch, torch.distributed as dist, moe_ep
from moe_ep.launch import init_distributed
placement = init_distributed()
rank, world = dist.get_rank(), dist.get_world_size()
buf = moe_ep.Buffer(hidden=64, num_experts=2 * world, num_topk=2, max_tokens_per_rank=16, device=placement.device)
g = torch.Generator().manual_seed(rank)
x = torch.randn(16, 64, generator=g).to(torch.bfloat16)
idx = torch.randn(16, 2 * world, generator=g).topk(2).indices
recv = buf.dispatch(x, idx, torch.rand(16, 2, generator=g))
out = buf.combine(recv.x, recv.handle)
ranks = 1 + (idx[:, 0] // 2 != idx[:, 1] // 2).unsqueeze(1)  # a token comes back once per rank it went to
assert torch.equal(out, (x.float() * ranks).to(torch.bfloat16))
if rank == int(sys.argv[1]):
    raise RuntimeError("this rank fails on purpose")
"""
EXIT_RUNS = 3
EXIT_WORLD = 2


def _run_ranks(tmp_path: Path, failing_rank: int) -> list[subprocess.CompletedProcess]:
    """Starts EXIT_WORLD ranks of PROGRAM as torchrun would (its environment variables) and waits for all."""
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "WORLD_SIZE": str(EXIT_WORLD), "LOCAL_WORLD_SIZE": str(EXIT_WORLD),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, str(script), str(failing_rank)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**base, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(EXIT_WORLD)]
    done = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


def test_ranks_that_succeed_exit_zero(tmp_path: Path) -> None:
    """Every rank of every run exits 0, though the program leaves its Buffer and group open (gloo used
    to abort at interpreter shutdown now and then: "terminate called without an active exception")."""
    for run in range(EXIT_RUNS):
        for rank, done in enumerate(_run_ranks(tmp_path, failing_rank=-1)):
            assert done.returncode == 0, f"run {run} rank {rank}: exit status {done.returncode}\n{done.stderr[-3000:]}"


def test_a_failing_rank_fails_and_its_peers_do_not_hang(tmp_path: Path) -> None:
    """Rank 1 raises at the end: its status is non-zero and its peers leave without waiting for it."""
    done = _run_ranks(tmp_path, failing_rank=1)
    assert done[1].returncode != 0 and "fails on purpose" in done[1].stderr, done[1].stderr[-3000:]
    for rank in (0,):
        assert "not every rank reached exit" in done[rank].stderr, done[rank].stderr[-3000:]
