"""moe_ep.launch.plan: where each torchrun rank goes, and topology.ranks_per_gpu (no processes needed); and
programs that use moe_ep.launch exit with status 0 when every rank succeeded."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_ep.comm import topology
from moe_ep.launch import plan
from tests._dist import rendezvous

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


EXIT_RUNS = 2
EXIT_WORLD = 2


def _run_ranks(failing_rank: int, *flags: str) -> list[subprocess.CompletedProcess]:
    """Starts EXIT_WORLD ranks of tests/launch_program.py as torchrun would (its environment variables) and waits for all."""
    script = ROOT / "tests" / "launch_program.py"
    store = rendezvous()  # served here, as torchrun's agent serves it, until every rank has ended
    base = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
            "WORLD_SIZE": str(EXIT_WORLD), "LOCAL_WORLD_SIZE": str(EXIT_WORLD),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    fail = ["--fail-rank", str(failing_rank)] if failing_rank >= 0 else []
    procs = [subprocess.Popen([sys.executable, str(script), *fail, *flags], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**base, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(EXIT_WORLD)]
    done = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


@pytest.mark.parametrize("flags, group_at_exit", [((), "destroyed"), (("--plain",), "up")], ids=["launch", "plain"])
def test_ranks_that_succeed_exit_zero(flags: tuple[str, ...], group_at_exit: str) -> None:
    """Every rank of every run checks its combine and exits 0, though the program leaves its Buffer and
    group open (gloo used to abort at interpreter shutdown now and then: "terminate called without an
    active exception"; a program that made its own group without moe_ep.launch did so in 4 of 10
    runs until moe_ep.comm.at_exit). moe_ep.launch destroys the group at exit; a plain program's stays."""
    for run in range(EXIT_RUNS):
        for rank, done in enumerate(_run_ranks(-1, *flags)):
            assert done.returncode == 0, f"run {run} rank {rank}: exit status {done.returncode}\n{done.stderr[-3000:]}"
            assert "combine matches" in done.stdout, done.stdout
            assert done.stdout.rstrip().endswith(f"at exit: group {group_at_exit}, NVSHMEM down"), done.stdout


def test_a_failing_rank_fails_and_its_peers_do_not_hang() -> None:
    """Rank 1 raises at the end: its status is non-zero and rank 0 leaves without waiting for it."""
    done = _run_ranks(failing_rank=1)
    assert done[1].returncode != 0 and "fails on purpose" in done[1].stderr, done[1].stderr[-3000:]
    assert "not every rank reached exit" in done[0].stderr, done[0].stderr[-3000:]
