"""`torchrun -m moe_ep.bench` runs on CPU (gloo, reference backend) and writes its table and JSON, cold
calls and the MoE layer case included; the low-latency bench leaves out the CUDA-graph rows on a
backend that cannot be captured; the N1 plot draws the link limit. Structure only: no timing asserts."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moe_ep
from moe_ep import bench

from tests._dist import run_workers

LAYER_OPS = {"forward", "backward", "forward_backward"}


def _positive(value: object) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_bench_runs_on_cpu(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "moe_ep.bench",
           "--cases", "cpu,layer", "--iters", "2", "--warmup", "1", "--out", str(tmp_path),
           "--layer-tokens", "32", "--layer-hidden", "128", "--layer-experts", "8", "--layer-topk", "2",
           "--layer-ffn", "64"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 0, run.stderr[-3000:]
    assert all(word in run.stdout for word in ("dispatch_bf16", "combine_bf16", "cold us", "overhead",
                                               "forward_backward"))
    result = json.loads((tmp_path / "bench_cpu_layer.json").read_text())
    assert (tmp_path / "bench_cpu_layer.png").stat().st_size > 0
    rows = result["rows"]
    assert all({"call_us", "cold_us", "overhead_us", "kernel_us", "gbps", "remote_gbps"} <= r.keys() for r in rows)
    assert all(r["backend"] == "reference" and _positive(r["call_us"]) for r in rows)
    cpu = [r for r in rows if r["case"] == "cpu"]
    assert {r["op"] for r in cpu} == {"dispatch_bf16", "dispatch_fp8", "combine_bf16"}
    for r in cpu:
        assert r["recv_bytes"] > 0 and _positive(r["cold_us"]), r
        assert math.isclose(r["overhead_us"], r["cold_us"] - r["call_us"]), r
    layer = [r for r in rows if r["case"] == "layer"]
    assert sorted(r["op"] for r in layer) == sorted(LAYER_OPS)
    assert all((r["tokens"], r["hidden"], r["cold_us"], r["overhead_us"]) == (32, 128, None, None) for r in layer)


def _low_latency_rows(rank: int, world: int) -> None:
    with moe_ep.Buffer(hidden=256, num_experts=8, num_topk=2, max_tokens_per_rank=16, backend="reference",
                       low_latency=True) as buf:
        rows = bench.bench_low_latency(buf, bench.Timer(torch.device("cpu"), warmup=1, iters=2), tokens=16)
    ops = [r.op for r in rows]
    assert not any(op.endswith("_graph") for op in ops), ops
    assert sorted(ops) == sorted(["ll_combine_bf16", "ll_dispatch_fp8", "ll_combine_bf16_send", "ll_combine_bf16_recv",
                                  "ll_dispatch_fp8_send", "ll_dispatch_fp8_recv"])
    assert all(r.backend == "reference" and r.call_us > 0 for r in rows)
    eager = [r for r in rows if r.op in ("ll_combine_bf16", "ll_dispatch_fp8")]
    assert all(_positive(r.cold_us) and r.overhead_us == r.cold_us - r.call_us for r in eager)
    assert all(r.cold_us is None for r in rows if r not in eager)
    if rank == 0:
        bench.print_table(rows)


def test_low_latency_bench_skips_graph_rows_on_the_reference_backend() -> None:
    run_workers(2, _low_latency_rows)


def test_n1_plot_draws_the_link_limit(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    rows = [bench.Row("N1", op, "nvshmem", sms, 4096, 7168, 300.0, None, 100_000_000, 58_000_000, deepep[i],
                      cold_us=400.0, topology="1x2")
            for sms, deepep in bench.DEEPEP_N1.items()
            for i, op in ((1, "dispatch_bf16"), (0, "dispatch_fp8"), (2, "combine_bf16"))]
    assert all(r.link_us == r.remote_bytes / (bench.NVLINK_LIMIT_GBPS[r.sms] * 1e3) for r in rows)
    bench.plot(rows, tmp_path / "n1.png")
    assert (tmp_path / "n1.png").stat().st_size > 0
    import matplotlib.pyplot as plt

    lines = {line.get_label(): list(line.get_ydata()) for line in plt.gcf().axes[0].lines}
    plt.close("all")
    for op in ("dispatch_bf16", "dispatch_fp8", "combine_bf16"):
        assert lines[f"link limit {op}"] == [r.link_us for r in sorted(rows, key=lambda r: r.sms) if r.op == op]
