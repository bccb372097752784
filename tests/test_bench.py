"""`torchrun -m moe_ep.bench` runs on CPU (gloo, reference backend) and writes its table and JSON; the
low-latency bench leaves out the CUDA-graph rows on a backend that cannot be captured."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import moe_ep
from moe_ep import bench

from tests._dist import run_workers


def test_bench_runs_on_cpu(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "moe_ep.bench",
           "--cases", "cpu", "--iters", "2", "--warmup", "1", "--out", str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "dispatch_bf16" in run.stdout and "combine_bf16" in run.stdout
    result = json.loads((tmp_path / "bench_cpu.json").read_text())
    assert {r["op"] for r in result["rows"]} == {"dispatch_bf16", "dispatch_fp8", "combine_bf16"}
    assert all(r["backend"] == "reference" and r["recv_bytes"] > 0 for r in result["rows"])


def _low_latency_rows(rank: int, world: int) -> None:
    with moe_ep.Buffer(hidden=256, num_experts=8, num_topk=2, max_tokens_per_rank=16, backend="reference",
                       low_latency=True) as buf:
        rows = bench.bench_low_latency(buf, bench.Timer(torch.device("cpu"), warmup=1, iters=2), tokens=16)
    ops = [r.op for r in rows]
    assert not any(op.endswith("_graph") for op in ops), ops
    assert sorted(ops) == sorted(["ll_combine_bf16", "ll_dispatch_fp8", "ll_combine_bf16_send", "ll_combine_bf16_recv",
                                  "ll_dispatch_fp8_send", "ll_dispatch_fp8_recv"])
    assert all(r.backend == "reference" and r.call_us > 0 for r in rows)
    if rank == 0:
        bench.print_table(rows)


def test_low_latency_bench_skips_graph_rows_on_the_reference_backend() -> None:
    run_workers(2, _low_latency_rows)
