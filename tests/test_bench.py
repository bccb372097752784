"""`torchrun -m moe_ep.bench` runs on CPU (gloo, reference backend): its table shows only the columns
that apply there and says why the others are left out, the layer case has ms and TFLOP/s rows without
and with overlap, its communication alone and a decode step's rows, no kernel knobs are printed (the
reference backend has none), its JSON has every key and each row's spread over its calls, its PNG has
one panel per case that ran (bars with percentile whiskers, labelled host-timed), and without --out it
writes under $XDG_DATA_HOME, not into the folder it runs in. `--help` of moe_ep.bench names its
command and every option's default; moe_ep.info has a --help.
The low-latency bench leaves out the CUDA-graph rows on a backend that cannot be captured; the N1
plot draws the link limit, except for rows measured on a shared GPU. Issue 44's reporting: the decode
steps beside their weight-read floor, the layer's figures beside their references (stand-in rows), the
sm-efficiency case's pairing, table and targets (stand-in rows), skipped on CPU with its reasons and run
on a GPU at EP1, and its SM-bounded copy bit for bit in Triton's interpreter. Structure only: no timing
asserts."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import struct
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch

import moe_ep
from moe_ep import bench
from moe_ep.launch import Placement, plan

from tests._dist import requires_gpus, run_workers
from tests._interpret import run_interpreted

ROOT = Path(__file__).resolve().parents[1]  # the checkout under test, whatever folder a rank starts in
PASSES = ("forward", "backward", "forward_backward")
LAYER_OPS = ({f"{op}{mode}" for op in PASSES for mode in ("", " overlap", " row path")}
             | {f"comm alone {op}" for op in PASSES} | {"forward FP8", "forward FP8 train", "backward FP8",
                                                       "forward_backward FP8"})
DECODE_STEPS = {"2 in sequence", "2 interleaved"}
NOT_REFERENCE = {"HBM read: sum of bf16": "torch", "HBM copy: dst.copy_(src)": "torch", "weight-read floor": "floor"}
DECODE_OPS = DECODE_STEPS | {"comm only (2 x d + c)"} | set(NOT_REFERENCE)
GPU_ONLY_COLUMNS = ("SMs", "cold us", "overhead", "kernel us", "%link", "DeepEP", "speedup")


def _positive(value: object) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def _png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", data[16:24])


def test_bench_runs_on_cpu(tmp_path: Path) -> None:
    cwd, data_home = tmp_path / "cwd", tmp_path / "data"
    cwd.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "moe_ep.bench", "--cases", "cpu,layer,calls,sm-efficiency", "--iters", "2", "--warmup", "1",
           "--layer-tokens", "32", "--layer-hidden", "128", "--layer-experts", "8", "--layer-topk", "2",
           "--layer-ffn", "128", "--layer-shared-ffn", "64", "--layer-decode-tokens", "8"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=cwd,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "XDG_DATA_HOME": str(data_home),
                              "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert run.returncode == 0, run.stderr[-3000:]
    assert not list(cwd.iterdir()), "the bench wrote into the folder it ran in"
    (json_path,) = data_home.glob("moe_ep/bench/*/bench_cpu_layer_calls_sm-efficiency.json")
    png_path = json_path.with_suffix(".png")
    assert f"wrote {json_path} and {png_path}" in run.stdout

    head = next(line for line in run.stdout.splitlines() if line.startswith("case "))
    for column in ("call us", "GB/s", "remote", "ms", "TFLOP/s", "%hidden"):
        assert column in head, head
    lines = run.stdout.splitlines()
    (config,) = [line for line in lines if line.startswith("config")]
    assert lines.index(config) < lines.index(head)
    # the reference backend takes none of the native kernels' knobs: none are printed
    assert config == "config: none (moe_ep.Config holds the native kernels' knobs; no row ran them)", config
    assert not any(f"{f.name}=" in run.stdout for f in dataclasses.fields(moe_ep.Config))
    for note in ("no grouped-GEMM or dense-ceiling rows:", "forward FP8 experts (reference): relative error", "%hidden = ",
                 'layer rows "... overlap" ran MoE(overlap=True)'):
        assert any(line.startswith(note) for line in lines), note
    assert "meaningless for links" in run.stdout
    # sm-efficiency needs one rank and the native kernels: skipped with both reasons, nothing measured
    (skipped,) = [line for line in lines if line.startswith("no sm-efficiency rows: ")]
    assert "not 2" in skipped and "native" in skipped, skipped
    calls = [line for line in lines if line.startswith("calls  dispatch+combine")]  # both Buffers, both sizes
    assert len(calls) == 4 and sum("check_calls=True" in line for line in calls) == 2, calls
    (left_out,) = [line for line in run.stdout.splitlines() if line.startswith("not shown: ")]
    for column in GPU_ONLY_COLUMNS:
        assert column not in head, head
        assert column in left_out, left_out
    assert "device time per kernel" not in run.stdout
    assert all(word in run.stdout for word in ("dispatch_bf16", "combine_bf16", *LAYER_OPS, *DECODE_OPS))

    # Four panels (cpu; layer; its decode step; calls), 6.5 inches each at 120 dpi.
    assert _png_size(png_path)[0] == 4 * 6.5 * 120

    result = json.loads(json_path.read_text())
    meta = result["meta"]
    assert meta["ranks_per_gpu"] == 0 and meta["world_size"] == 2 and "env" not in meta
    assert meta["config"] is None  # no native Buffer ran
    rows = result["rows"]
    keys = {"call_us", "cold_us", "overhead_us", "kernel_us", "gbps", "remote_gbps", "link_us", "shared_gpu",
            "ranks_per_gpu", "experts", "topk", "topology", "flop", "tflops"}
    assert all(keys <= r.keys() and "config" not in r for r in rows)
    assert all(r["backend"] == NOT_REFERENCE.get(r["op"], "reference") and _positive(r["call_us"]) for r in rows)
    # every timed row's spread over its calls brackets its median; the weight-read floor is computed, not timed
    assert all(r["spread_us"][0] <= r["call_us"] <= r["spread_us"][1] for r in rows if r["op"] != "weight-read floor")
    assert all(r["spread_us"] is None for r in rows if r["op"] == "weight-read floor")
    assert all((r["cold_us"], r["overhead_us"], r["kernel_us"], r["link_us"], r["shared_gpu"], r["ranks_per_gpu"])
               == (None, None, None, None, False, 0) for r in rows)
    cpu = [r for r in rows if r["case"] == "cpu"]
    assert {r["op"] for r in cpu} == {"dispatch_bf16", "dispatch_fp8", "combine_bf16"}
    assert all(r["recv_bytes"] > 0 and (r["tokens"], r["hidden"], r["experts"], r["topk"]) == (512, 2048, 64, 8)
               for r in cpu)
    layer = [r for r in rows if r["case"] == "layer"]
    assert sorted(r["op"] for r in layer) == sorted(LAYER_OPS)
    assert all((r["tokens"], r["hidden"], r["experts"], r["topk"]) == (32, 128, 8, 2) for r in layer)
    assert all(r["extra"]["overlap"] == r["op"].endswith(" overlap") for r in layer if "overlap" in r["extra"])
    assert all("comm_hidden" not in r["extra"] for r in layer)  # a GPU per rank only
    assert all(r["extra"]["same_bits"] is True for r in layer if r["extra"].get("overlap"))  # same bits as without
    # FLOPs from the routing that ran (rank 0's experts' pairs, the same routing for every row).
    assert len({r["extra"]["pairs"] for r in layer}) == 1 and 0 < layer[0]["extra"]["pairs"] <= 2 * 32 * 2
    for r in layer:
        if r["op"].startswith("comm alone"):
            assert r["flop"] is None and _positive(r["call_us"])
            continue
        passes = {"forward": 1, "backward": 2, "forward_backward": 3}[r["op"].split()[0]]
        shared = 0.0 if "FP8" in r["op"] else bench.layer_flop(32, 128, 64)  # the FP8 rows: routed experts only
        assert r["flop"] == passes * (bench.layer_flop(r["extra"]["pairs"], 128, 128) + shared)
        assert _positive(r["tflops"])
    decode = {r["op"]: r for r in rows if r["case"] == "decode"}
    assert set(decode) == DECODE_OPS
    assert all((r["tokens"], r["flop"], r["tflops"]) == (8, None, None) for r in decode.values())
    seq, inter, comm = (decode[op]["call_us"] for op in ("2 in sequence", "2 interleaved", "comm only (2 x d + c)"))
    assert decode["2 interleaved"]["extra"]["comm_hidden"] == pytest.approx((seq - inter) / comm)
    # the weight-read floor: rank 0's experts that got a token in each micro-batch (4 local of 8; hidden 128, ffn
    # 128, bf16) and the shared expert (ffn 64), read once per micro-batch at the faster HBM figure of the run
    floor = decode["weight-read floor"]
    active = floor["extra"]["active_experts"]
    assert len(active) == 2 and all(0 < a <= 4 for a in active), active
    assert floor["recv_bytes"] == sum(a * 3 * 128 * 128 * 2 + 3 * 128 * 64 * 2 for a in active)
    assert floor["extra"]["hbm_gbps"] == max(decode[op]["gbps"] for op in ("HBM read: sum of bf16",
                                                                           "HBM copy: dst.copy_(src)"))
    assert floor["call_us"] == pytest.approx(floor["recv_bytes"] / (floor["extra"]["hbm_gbps"] * 1e3))
    for op in DECODE_STEPS:
        assert decode[op]["extra"]["vs_floor"] == pytest.approx(decode[op]["call_us"] / floor["call_us"])
    assert "vs floor" in head
    # each decode step beside its floor; no layer targets without the GPU's GEMM rows; no sm-efficiency rows
    targets = result["targets"]
    assert sorted(t["figure"] for t in targets) == sorted(f"decode {op} (reference)" for op in DECODE_STEPS)
    assert all(t["goal"] == bench.DECODE_FLOOR_GOAL and t["ratio"] == pytest.approx(t["value"] / t["reference_value"])
               for t in targets)
    assert result["sm_efficiency"] == []
    assert "figures beside their references (issue 44):" in lines


def _pairs(rank: int, world: int) -> None:
    with moe_ep.Buffer(hidden=128, num_experts=4, num_topk=2, max_tokens_per_rank=4, backend="reference") as buf:
        # Rank r's tokens pick experts (0, 1), (r + 2, -1 dropped), (1, 3): over both ranks expert 0 gets 2
        # pairs, 1 gets 4, 2 gets 1, 3 gets 3; rank 0 owns experts 0 and 1, rank 1 experts 2 and 3.
        topk_idx = torch.tensor([[0, 1], [rank + 2, -1], [1, 3]])
        got = bench.expert_counts(buf, topk_idx).tolist()
    assert got == [[2, 4], [1, 3]][rank], got


def test_expert_pairs_counts_the_rows_this_ranks_experts_compute() -> None:
    run_workers(2, _pairs)


def _low_latency_rows(rank: int, world: int) -> None:
    with moe_ep.Buffer(hidden=256, num_experts=8, num_topk=2, max_tokens_per_rank=16, backend="reference",
                       low_latency=True) as buf:
        rows = bench.bench_low_latency(buf, bench.Timer(torch.device("cpu"), warmup=1, iters=2), tokens=16)
    ops = [r.op for r in rows]
    assert not any(op.endswith("_graph") for op in ops), ops
    assert sorted(ops) == sorted(["ll_combine_bf16", "ll_dispatch_fp8", "ll_combine_bf16_send", "ll_combine_bf16_recv",
                                  "ll_dispatch_fp8_send", "ll_dispatch_fp8_recv"])
    assert all(r.backend == "reference" and r.call_us > 0 and r.recv_bytes > 0 for r in rows)
    assert all(r.cold_us is None and r.overhead_us is None and r.link_us is None for r in rows)  # CPU
    assert all((r.hidden, r.experts, r.topk, r.ranks_per_gpu, r.topology) == (256, 8, 2, 0, "1x2") for r in rows)


def test_low_latency_bench_skips_graph_rows_on_the_reference_backend() -> None:
    run_workers(2, _low_latency_rows)


def _n1_rows(ranks_per_gpu: int) -> list[bench.Row]:
    return [bench.Row("N1", op, "nvshmem", sms, 4096, 7168, 300.0, 250.0, 100_000_000, 58_000_000,
                      deepep[i] if ranks_per_gpu == 1 else None, cold_us=[290.0, 400.0][i % 2], topology="1x2",
                      experts=256, topk=8, ranks_per_gpu=ranks_per_gpu)
            for sms, deepep in bench.DEEPEP_N1.items()
            for i, op in ((1, "dispatch_bf16"), (0, "dispatch_fp8"), (2, "combine_bf16"))]


def test_n1_plot_draws_the_link_limit(tmp_path: Path) -> None:
    rows = _n1_rows(ranks_per_gpu=1)
    assert all(r.link_us == r.remote_bytes / (bench.NVLINK_LIMIT_GBPS[r.sms] * 1e3) for r in rows)
    fig = bench.plot(rows, tmp_path / "n1.png")
    assert (tmp_path / "n1.png").stat().st_size > 0
    (ax,) = fig.axes
    lines = {line.get_label(): list(line.get_ydata()) for line in ax.lines}
    assert ax.get_title() == "N1: EP2, 4096 tokens, hidden 7168, top-8/256"
    for op in ("dispatch_bf16", "dispatch_fp8", "combine_bf16"):
        pts = sorted((r for r in rows if r.op == op), key=lambda r: r.sms)
        assert lines[f"link limit {op}"] == [r.link_us for r in pts]
        assert lines[f"DeepEP {op}"] == [r.deepep_us for r in pts]


def test_shared_gpu_rows_are_labelled_and_never_against_the_link(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rows = _n1_rows(ranks_per_gpu=2)
    assert all(r.shared_gpu and r.link_us is None for r in rows)
    fig = bench.plot(rows, tmp_path / "shared.png")
    (ax,) = fig.axes
    labels = [line.get_label() for line in ax.lines]
    assert labels and all(label.startswith("moe_ep ") for label in labels), labels
    assert "2 ranks share one GPU" in ax.get_title()
    bench.print_table(rows, ["a note"])
    out = capsys.readouterr().out.splitlines()
    head = out[0]
    assert "GPU" in head and "%link" not in head and "DeepEP" not in head, head
    assert all("2-way" in line for line in out[2:2 + len(rows)])
    assert any(line.startswith("GPU N-way:") for line in out) and "a note" in out


def test_overhead_is_never_negative() -> None:
    rows = _n1_rows(ranks_per_gpu=1)
    assert {r.overhead_us for r in rows} == {0.0, 100.0}  # cold 290 < call 300 is noise, not a gain


def test_cpu_case_plot_titles_come_from_the_sizes_that_ran(tmp_path: Path) -> None:
    rows = [bench.Row("cpu", op, "reference", None, 512, 2048, 900.0 + i, None, 10_000, 5_000, topology="1x2",
                      experts=64, topk=8, ranks_per_gpu=0, spread_us=(850.0 + i, 1000.0 + 2 * i))
            for i, op in enumerate(("dispatch_bf16", "dispatch_fp8", "combine_bf16"))]
    (ax,) = bench.plot(rows, tmp_path / "cpu.png").axes
    assert ax.get_title() == "cpu: EP2, 512 tokens, hidden 2048, top-8/64"
    assert [p.get_width() for p in ax.patches] == [r.call_us for r in rows]
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"{r.op} (reference)" for r in rows]
    # whiskers from each row's 10th to its 90th percentile, and the axis says the host clock timed them
    (whiskers,) = [c for c in ax.collections if c.get_segments()]
    assert [(seg[0][0], seg[1][0]) for seg in whiskers.get_segments()] == [r.spread_us for r in rows]
    assert "whiskers 10th-90th percentile" in ax.get_xlabel() and "host-timed (CPU)" in ax.get_xlabel()


def test_timer_spread_brackets_the_median() -> None:
    assert bench._deciles([5.0]) == (5.0, 5.0)
    values = [float(v) for v in range(1, 12)]  # 1..11: inclusive deciles 2 and 10
    assert bench._deciles(values) == (2.0, 10.0)


def _help(module: str) -> str:
    run = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": "",
                              "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def test_bench_help_names_itself_and_every_default() -> None:
    text = _help("moe_ep.bench")
    assert text.startswith("usage: torchrun --nproc-per-node R -m moe_ep.bench "), text[:200]
    options = text.split("\noptions:\n", 1)[1]
    blocks = [b.split() for b in re.split(r"\n(?=  -)", options) if not b.startswith("  -h, --help")]
    names = [b[0].lstrip("-") for b in blocks]
    assert {"cases", "sms", "sm-efficiency-sms", "warmup", "iters", "out", "ranks-per-node", "ranks-per-gpu",
            "layer-tokens"} <= set(names)
    for name, block in zip(names, blocks):
        assert "(default" in " ".join(block), f"--{name} does not say its default: {' '.join(block)}"


def test_parse_args_reads_the_cases_and_sm_budgets() -> None:
    args = bench.parse_args(["--cases", "sm-efficiency,layer", "--sm-efficiency-sms", "4,8", "--sms", "16"])
    assert (args.cases, args.sm_efficiency_sms, args.sms) == (["sm-efficiency", "layer"], [4, 8], [16])
    default = bench.parse_args([])
    assert (default.cases, default.sm_efficiency_sms, default.sms) == (None, [4, 8, 16, 24], [8, 16, 24, 32])
    with pytest.raises(SystemExit):
        bench.parse_args(["--cases", "sm-efficiency,nope"])


def _sm_rows(copied_exactly: bool = True) -> list[bench.Row]:
    """Stand-in rows of the sm-efficiency case at 4 and 8 SMs: its three ops, sm_copy of their two byte counts
    at both budgets, and the copy engine's copy of each (times made up: assembly only)."""
    bf16, fp8 = 4096 * 14336, 4096 * 7392

    def row(op: str, backend: str, sms: object, us: float, kernel_us: float, nbytes: int, **extra: object) -> bench.Row:
        return bench.Row("sm-efficiency", op, backend, sms, 4096, 7168, us, kernel_us, nbytes, 0, topology="1x1",
                         experts=256, topk=8, extra=dict(extra))

    def split(op: str, kernel_us: float) -> dict:
        """The op's kernels as the profiler splits them: a stamp exchange, a dispatch's notify, the rest one kernel."""
        fixed = {"exchange_kernel": 4.5, **({"notify_kernel": 14.0} if op.startswith("dispatch") else {})}
        return {**fixed, "main_kernel": kernel_us - sum(fixed.values())}

    rows = [row(op, "nvshmem", sms, 100.0 * i + sms, 90.0 * i + sms, nbytes, kernels=split(op, 90.0 * i + sms),
                **({"metadata_bytes": 4096 * 104} if op.startswith("dispatch") else {}))
            for sms in (4, 8)
            for i, (op, nbytes) in enumerate((("dispatch_bf16", bf16), ("dispatch_fp8", fp8), ("combine_bf16", bf16)),
                                             start=1)]
    for nbytes in (fp8, bf16):
        rows += [row(bench.SM_COPY_OP, "triton", sms, nbytes / 1e6 + sms, nbytes / 1.1e6 + sms, nbytes,
                     copied_exactly=copied_exactly or sms == 4) for sms in (4, 8)]
        rows.append(row(bench.COPY_ENGINE_OP, "torch", None, nbytes / 2e6, nbytes / 2e6, nbytes, copied_exactly=True))
    return rows


def test_sm_efficiency_pairs_each_op_with_the_copy_of_its_bytes_and_sms() -> None:
    rows = _sm_rows()
    effs = bench.sm_efficiency(rows)
    assert sorted((e.op, e.sms) for e in effs) == sorted((op, sms) for op in bench.SM_EFFICIENCY_OPS for sms in (4, 8))
    copies = {(r.sms, r.recv_bytes): r for r in rows if r.op == bench.SM_COPY_OP}
    ops = {(r.op, r.sms): r for r in rows if r.op in bench.SM_EFFICIENCY_OPS}
    for e in effs:
        op, copy = ops[e.op, e.sms], copies[e.sms, e.bytes]
        assert (e.bytes, e.call_us, e.kernel_us, e.copy_us, e.copy_kernel_us) == (
            op.recv_bytes, op.call_us, op.kernel_us, copy.call_us, copy.kernel_us)
        assert e.kept == copy.call_us / op.call_us and e.kept_kernels == copy.kernel_us / op.kernel_us
        fixed = 18.5 if e.op.startswith("dispatch") else 4.5  # the stand-in's exchange (and notify)
        assert e.longest_kernel_us == op.kernel_us - fixed
        assert math.isclose(e.kept_longest, copy.kernel_us / (op.kernel_us - fixed))
        assert math.isclose(e.kept_at_copy_rate, copy.kernel_us / (copy.kernel_us + fixed))
        assert e.metadata_bytes == (4096 * 104 if e.op.startswith("dispatch") else 0)
        assert e.goal == (bench.SM_EFFICIENCY_GOAL if e.sms == bench.SM_EFFICIENCY_GOAL_SMS else None)
        assert {"kept", "kept_kernels", "kept_longest", "kept_at_copy_rate", "goal"} <= e.as_json().keys()
    # the goal's SM budget only: whole call and kernels alone for each op, as floors on copy / op
    targets = bench.sm_efficiency_targets(rows)
    assert len(targets) == 2 * len(bench.SM_EFFICIENCY_OPS)
    assert all(t.at_least and t.goal == bench.SM_EFFICIENCY_GOAL and f"at {bench.SM_EFFICIENCY_GOAL_SMS} SMs" in t.figure
               for t in targets)
    assert sorted(t.ratio for t in targets) == sorted(
        v for e in effs if e.goal is not None for v in (e.kept, e.kept_kernels))


def test_sm_efficiency_lines_show_every_op_the_copy_engine_and_a_bad_copy() -> None:
    lines = bench.sm_efficiency_lines(_sm_rows())
    (head,) = [line for line in lines if line.startswith("op ")]
    for column in ("SMs", "bytes", "meta B", "call us", "copy us", "kept", "kernel us", "longest", "at copy", "goal"):
        assert column in head, head
    body = lines[lines.index(head) + 2:]
    assert sum(line.startswith(bench.SM_EFFICIENCY_OPS) for line in body) == 6
    assert sum(line.startswith("copy engine (dst.copy_(src), no SM budget)") for line in body) == 2
    assert not any(line.startswith("WARNING") for line in lines)
    warnings = [line for line in bench.sm_efficiency_lines(_sm_rows(copied_exactly=False)) if line.startswith("WARNING")]
    assert len(warnings) == 2 and all("at 8 SMs" in line for line in warnings), warnings
    assert bench.sm_efficiency_lines([]) == []


def interpreted_copy_cases() -> None:
    """Entry of the interpreter subprocess: sm_copy reproduces its source bit for bit, a tail shorter than a
    block and grids of one, two and three programs included, and writes nothing past its destination."""
    g = torch.Generator().manual_seed(0)
    for nbytes, sms in ((3 * bench.COPY_BLOCK * 4 + 40, 2), (bench.COPY_BLOCK * 4, 3), (8, 1)):
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
        dst = torch.zeros(nbytes + 16, dtype=torch.uint8)
        bench.sm_copy(src, dst[:nbytes], sms)
        assert torch.equal(dst[:nbytes], src), (nbytes, sms)
        assert not dst[nbytes:].any(), (nbytes, sms)
    with pytest.raises(ValueError):
        bench.sm_copy(torch.zeros(6, dtype=torch.uint8), torch.zeros(6, dtype=torch.uint8), 1)


def test_sm_copy_in_triton_interpreter() -> None:
    run_interpreted("tests.test_bench", "interpreted_copy_cases")


def _layer_rows() -> list[bench.Row]:
    """Stand-in rows of the layer case on one GPU (times made up): the native backend's passes, a reference-backend
    forward that layer_targets must not take, the GEMMs alone at both groups (bf16, FP8 forward, dgrad and both
    passes, torch's FP8)."""
    def row(op: str, backend: str, us: float, flop: Optional[float] = None) -> bench.Row:
        return bench.Row("layer", op, backend, None, 4096, 7168, us, None, 0, 0, topology="1x1", experts=128, topk=8,
                         flop=flop)

    rows = [row("forward", "nvshmem", 7360.0), row("forward_backward", "nvshmem", 21930.0),
            row("forward FP8", "nvshmem", 6190.0), row("forward_backward FP8", "nvshmem", 17000.0),
            row("forward", "reference", 90000.0)]
    for label, k in (("equal groups", 1.0), ("router's groups", 1.3)):
        rows += [row(f"GEMMs forward {label}", "torch", 4560.0 * k), row(f"GEMMs forward_backward {label}", "torch",
                                                                           16110.0 * k),
                 row(f"FP8 GEMMs forward {label}", "triton", 2400.0 * k, flop=1.4e15),
                 row(f"FP8 GEMMs dgrad {label}", "triton", 2500.0 * k, flop=1.4e15),
                 row(f"FP8 GEMMs forward_backward {label}", "triton", 12000.0 * k, flop=4.2e15),
                 row(f"torch FP8 GEMMs forward {label}", "torch", 2000.0 * k, flop=1.4e15)]
    return rows


def test_layer_targets_set_each_figure_beside_its_reference() -> None:
    rows = _layer_rows()
    by_op = {r.op: r for r in rows if r.backend != "reference"}
    targets = {(t.figure, t.reference): t for t in bench.layer_targets(rows)}
    assert len(targets) == len(bench.LAYER_TARGETS) + 4
    for figure, op, reference, ref, goal in bench.LAYER_TARGETS:
        t = targets[figure, reference]
        assert (t.value, t.reference_value, t.unit, t.goal, t.at_least) == (
            by_op[op].call_us / 1e3, by_op[ref].call_us / 1e3, "ms", goal, False)
    for label in ("equal groups", "router's groups"):
        for kind in ("forward", "dgrad"):
            t = targets[f"FP8 GEMMs {kind} {label} rate", "issue 44's goal"]
            assert (t.value, t.reference_value, t.goal, t.at_least) == (
                by_op[f"FP8 GEMMs {kind} {label}"].tflops, bench.FP8_GEMM_TFLOPS_GOAL, 1.0, True)
    # without torch's FP8 rows (it refused) those comparisons are left out, the rest stay
    no_torch = [r for r in rows if not r.op.startswith("torch FP8")]
    assert len(bench.layer_targets(no_torch)) == len(targets) - 2
    assert bench.layer_targets([]) == []


def test_target_lines_say_whether_each_goal_is_met() -> None:
    ceiling = bench.Target("layer forward", 7.36, "its GEMMs", 6.18, "ms", 1.08)
    floor = bench.Target("sm_copy at 8 SMs", 85.0, "dispatch_bf16", 100.0, "us", 0.8, at_least=True)
    info = bench.Target("FP8 GEMMs", 2.0, "torch", 2.5, "ms")
    assert (ceiling.met, floor.met, info.met) == (False, True, None)
    assert ceiling.line() == "layer forward: 7.36 ms / its GEMMs 6.18 ms = 1.191 (goal <= 1.08: NOT met)"
    assert floor.line().endswith("= 0.850 (goal >= 0.8: met)") and "goal" not in info.line()
    lines = bench.target_lines([ceiling, floor, info])
    assert lines[0] == "figures beside their references (issue 44):" and len(lines) == 4
    assert bench.target_lines([]) == []
    assert info.as_json() == {**dataclasses.asdict(info), "ratio": 0.8, "met": None}


def test_layer_notes_say_when_torch_has_no_fp8_grouped_gemm() -> None:
    row = _layer_rows()[-2]
    row.extra["torch_fp8"] = "not available: RuntimeError: no"
    notes = bench.layer_notes(True, False, [row])
    assert f"{row.op}: torch's FP8 grouped GEMM (torch._scaled_grouped_mm) not available: RuntimeError: no" in notes


def test_tile_floor_counts_whole_tiles_like_filling_them_row_by_row() -> None:
    """tile_floor against tiles filled one row at a time; and the note names each router's-groups GEMM row."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    groups = torch.randint(0, 600, (int(torch.randint(1, 40, (), generator=gen)),), generator=gen).tolist()
    equal = int(torch.randint(1, 400, (), generator=gen))

    def tiles(rows: int, height: int) -> int:
        count, free = 0, 0
        for _ in range(rows):
            if free == 0:
                count, free = count + 1, height
            free -= 1
        return count

    for height in bench.TILE_ROWS:
        want = sum(tiles(g, height) for g in groups) / (len(groups) * tiles(equal, height))
        assert bench.tile_floor(groups, equal, height) == pytest.approx(want, rel=1e-12)
    row = _layer_rows()[-2]
    row.op, row.extra["groups"] = "FP8 GEMMs forward router's groups", [300, 200, 256, 268]
    notes = bench.tile_floor_notes([row, dataclasses.replace(row, op="FP8 GEMMs dgrad router's groups")])
    assert notes == ["FP8 GEMMs forward router's groups: row tiles these groups need over equal groups of 256 rows "
                     "(the loss tile height alone explains): 64 rows 1.125, 128 rows 1.250, 256 rows 1.500"]
    assert notes[0] in bench.layer_notes(True, False, [row])


def test_info_help() -> None:
    text = _help("moe_ep.info")
    assert text.startswith("usage: python -m moe_ep.info") and "Buffer(backend=" in text, text


class _Stop(Exception):
    """Ends bench.main once the Buffers under test were asked for."""


def _ranks_per_node_worker(rank: int, world: int, out: str) -> None:
    """bench.main with --ranks-per-node 1 --ranks-per-gpu 3: the placement is asked for 3 ranks per GPU,
    and N1 makes its Buffer once with the detected node (None), then once with ranks_per_node=1
    (recorded by a stand-in Buffer, which stops the run there; no GPU needed)."""
    placements: list = []
    made: list = []

    class FakeBuffer:
        def __init__(self, **kwargs: object) -> None:
            made.append(kwargs.get("ranks_per_node"))
            if kwargs.get("ranks_per_node") is not None:
                raise _Stop

        def __enter__(self) -> "FakeBuffer":
            return self

        def __exit__(self, *exc: object) -> None:
            return None

    def placement(ranks_per_gpu: object = None) -> Placement:
        placements.append(ranks_per_gpu)
        return plan(0, 1, 0, "cpu")

    bench.Buffer, bench.init_distributed = FakeBuffer, placement
    bench.bench_normal, bench.compares_to_deepep = (lambda *a, **k: []), (lambda buf: False)

    def plot(*args: object) -> None:  # reached only when no Buffer stopped the run
        raise _Stop

    bench.plot = plot
    sys.argv = ["moe_ep.bench", "--cases", "n1-native", "--ranks-per-node", "1", "--ranks-per-gpu", "3", "--out", out]
    with pytest.raises(_Stop):
        bench.main()
    assert (placements, made) == ([3], [None, 1]), (placements, made)


def test_ranks_per_node_and_ranks_per_gpu_reach_the_buffers(tmp_path: Path) -> None:
    run_workers(1, _ranks_per_node_worker, str(tmp_path))


def _bench_on_gpu(ranks: int, out: Path, *args: str) -> str:
    """`torchrun --nproc-per-node ranks -m moe_ep.bench *args --out out` on the GPUs, 2 timed calls after 1 warm-up;
    its standard output (the run must succeed)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), "-m",
           "moe_ep.bench", *args, "--iters", "2", "--warmup", "1", "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


@requires_gpus()
def test_sm_efficiency_runs_at_ep1(tmp_path: Path) -> None:
    """On the GPU, one rank: every op at both SM budgets beside sm_copy of its bytes, which copied them exactly,
    the copy engine's copy of each byte count, and the goal's SM budget in the targets."""
    stdout = _bench_on_gpu(1, tmp_path, "--cases", "sm-efficiency", "--sm-efficiency-sms", "4,8")
    result = json.loads((tmp_path / "bench_sm-efficiency.json").read_text())
    rows = result["rows"]
    assert sorted((r["op"], r["sms"]) for r in rows if r["op"] in bench.SM_EFFICIENCY_OPS) == sorted(
        (op, sms) for op in bench.SM_EFFICIENCY_OPS for sms in (4, 8))
    copies = [r for r in rows if r["op"] in (bench.SM_COPY_OP, bench.COPY_ENGINE_OP)]
    assert len(copies) == 2 * 3 and all(r["extra"]["copied_exactly"] for r in copies)
    assert all(r["remote_bytes"] == 0 and r["topology"] == "1x1" for r in rows)
    assert len(result["sm_efficiency"]) == 6 and all(_positive(e["kept"]) for e in result["sm_efficiency"])
    assert all(_positive(e["kept_longest"]) and e["kept_at_copy_rate"] <= 1 for e in result["sm_efficiency"])
    assert len(result["targets"]) == 6 and "sm-efficiency, EP1" in stdout


@requires_gpus()
def test_ranks_per_node_measures_both_topologies(tmp_path: Path) -> None:
    """On the GPU: `--ranks-per-node 1` adds rows of 2 one-rank "nodes" to the one node of 2."""
    _bench_on_gpu(2, tmp_path, "--cases", "l1", "--ranks-per-node", "1")
    rows = json.loads((tmp_path / "bench_l1.json").read_text())["rows"]
    assert {r["topology"] for r in rows} == {"1x2", "2x1"}, {r["topology"] for r in rows}
