"""`torchrun -m moe_ep.bench` runs on CPU (gloo, reference backend) and writes its table and JSON."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


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

