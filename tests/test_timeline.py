"""moe_ep.timeline: a profiled step's busy time and gaps against a brute-force timeline (every microsecond of
random traces: which streams run, where the holes are, which op ends each), each gap's cause and host context on
hand-made traces, steps split by their annotations, and the CLI on CPU (no device: nothing to attribute). On a
GPU, real torch.profiler traces: a host sleep between two kernels is a `host` gap, a `.item()` between them a
`sync` gap."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moe_ep import timeline
from moe_ep.timeline import CAUSES, SYNC_CALLS, Trace, analyze, kernel_name

from tests._dist import requires_gpus

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict[str, str]:
    """This process's environment for a CLI run on CPU from this checkout."""
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", **extra,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _device(name: str, stream: int, start: int, end: int, corr: int | None) -> dict:
    args = {"stream": stream} if corr is None else {"stream": stream, "correlation": corr}
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": f"stream {stream}", "ts": start,
            "dur": end - start, "args": args}


def _call(name: str, thread: int, start: int, end: int, corr: int | None = None) -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "pid": 1, "tid": thread, "ts": start, "dur": end - start,
            "args": {} if corr is None else {"correlation": corr}}


def _op(name: str, thread: int, start: int, end: int) -> dict:
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": thread, "ts": start, "dur": end - start}


def _random_trace(rng: random.Random) -> tuple[list[dict], list[tuple[str, int, int, int]], dict, list]:
    """Device ops on 1-3 streams (integer us, none overlapping on its stream, no two starting together), a launch
    call for most of them (on one of two threads, some before the op's stream could start it, some late), some
    synchronising calls. Returns (events, ops as (name, stream, start, end), launches by op name, syncs)."""
    events, ops, launches, syncs = [], [], {}, []
    starts: set[int] = set()
    for stream in range(rng.randint(1, 3)):
        t = rng.randint(0, 40)
        for _ in range(rng.randint(1, 8)):
            t += rng.randint(0, 30)
            while t in starts:
                t += 1
            end = t + rng.randint(1, 25)
            ops.append((f"k{len(ops)}", stream, t, end))
            starts.add(t)
            t = end
    for corr, (name, stream, start, end) in enumerate(ops):
        events.append(_device(name, stream, start, end, corr))
        if rng.random() < 0.85:
            at = max(0, start - rng.randint(0, 60))
            launches[name] = (at, rng.randint(0, 1))
            events.append(_call("cudaLaunchKernel", launches[name][1], at, at + rng.randint(0, 3), corr))
    for _ in range(rng.randint(0, 3)):
        at = rng.randint(0, 250)
        syncs.append((at, at + rng.randint(1, 60)))
        events.append(_call(rng.choice(sorted(SYNC_CALLS)), rng.randint(0, 1), *syncs[-1]))
    events.append(_call("cudaEventRecord", 0, 5, 6))  # a call that launches nothing
    return events, ops, launches, syncs


def _brute_force(ops: list[tuple[str, int, int, int]], launches: dict, syncs: list) -> dict:
    """Busy time, span, per-stream time and gaps, microsecond by microsecond."""
    first, last = min(o[2] for o in ops), max(o[3] for o in ops)
    covered = [any(s <= t < e for _, _, s, e in ops) for t in range(first, last)]
    gaps, t = [], 0
    while t < len(covered):
        if covered[t]:
            t += 1
            continue
        u = t
        while u < len(covered) and not covered[u]:
            u += 1
        start, end = first + t, first + u
        nxt = next(o for o in ops if o[2] == end)
        if nxt[0] not in launches:
            cause, before = "unknown", 0
        elif launches[nxt[0]][0] < start:
            cause, before = "device", 0
        else:
            waiting = any(s <= start <= e + 1 for s, e in syncs)
            cause, before = ("sync" if waiting else "host"), min(launches[nxt[0]][0], end) - start
        gaps.append((start, end, cause, before, nxt[0]))
        t = u
    streams: dict[int, int] = {}
    for _, stream, s, e in ops:
        streams[stream] = streams.get(stream, 0) + e - s
    return {"busy": sum(covered), "span": last - first, "streams": streams, "gaps": gaps}


def test_busy_time_and_gaps_match_a_brute_force_timeline() -> None:
    rng = random.Random(20261207)
    for _ in range(200):
        events, ops, launches, syncs = _random_trace(rng)
        rng.shuffle(events)
        report = analyze(Trace.from_events(events))
        want = _brute_force(ops, launches, syncs)
        assert report.busy_us == want["busy"] and report.span_us == want["span"]
        assert report.idle_us == want["span"] - want["busy"]
        assert report.streams == want["streams"]
        got = [(g.start, g.end, g.cause, g.before_launch_us, g.next_op) for g in report.gaps]
        assert got == want["gaps"]
        assert sum(report.idle_by_cause().values()) == report.idle_us
        assert sum(n for n, _ in report.kernels.values()) == len(ops)


def test_host_context_matches_a_scan_of_every_span() -> None:
    """The sweep that finds the host spans around a time gives what checking every span gives, nested or not."""
    rng = random.Random(7)
    for _ in range(100):
        spans = []
        for i in range(rng.randint(0, 40)):
            start = rng.randint(0, 200)
            spans.append(timeline.HostSpan(f"s{i}", rng.randint(0, 2), start, start + rng.randint(0, 60)))
        queries = [(rng.randint(0, 2), rng.randint(-5, 270)) for _ in range(30)]
        got = timeline._HostIndex(spans).containing(queries)
        for thread, t in queries:
            want = [s for s in spans if s.thread == thread and s.start <= t <= s.end]
            assert sorted(got[(thread, t)], key=id) == sorted(want, key=id)
            assert [s.start for s in got[(thread, t)]] == sorted(s.start for s in want)


def test_a_gap_names_its_cause_and_host_context() -> None:
    """Three kernels, two gaps. The first: the host sat in a stream sync (inside `aten::item`) when it began and
    launched the next kernel 45 us later, from inside `launcher` inside `moe_ep::dispatch_expert_major` (the
    finished `aten::empty` before it is no context). The second: its kernel was launched before the gap began, so
    the device waited (on another stream, say)."""
    events = [
        _device("void ns::(anonymous namespace)::first_kernel<4>(int)", 7, 100, 200, 1),
        _device("second", 7, 260, 300, 2),
        _device("third", 9, 350, 400, 3),
        _call("cudaLaunchKernel", 11, 90, 92, 1),
        _op("aten::item", 11, 150, 215),
        _call("cudaStreamSynchronize", 11, 152, 214),
        _op("moe_ep::dispatch_expert_major", 11, 230, 258),
        _op("aten::empty", 11, 232, 236),
        _call("cudaMalloc", 11, 233, 236),
        _call("cudaStreamIsCapturing", 11, 237, 238),
        _op("launcher", 11, 240, 257),
        _call("cudaLaunchKernel", 11, 245, 250, 2),
        _call("cudaLaunchKernel", 11, 251, 252, 3),
    ]
    report = analyze(Trace.from_events(events))
    assert [(g.start, g.end, g.cause, g.before_launch_us) for g in report.gaps] == [(200, 260, "sync", 45),
                                                                                     (300, 350, "device", 0)]
    first, second = report.gaps
    assert first.host_was_in == "cudaStreamSynchronize"
    assert first.launched_by == "moe_ep::dispatch_expert_major > launcher"
    assert first.host_calls == "cudaStreamSynchronize 14"  # the 3 us cudaMalloc and 1 us check fall under 5 us
    assert second.launched_by == "moe_ep::dispatch_expert_major > launcher" and second.host_was_in == ""
    assert report.idle_by_cause() == {"host": 0, "sync": 60, "device": 50, "unknown": 0}
    assert report.streams == {7: 140, 9: 50} and report.issue_us == 252 - 90
    lines = "\n".join(report.lines())
    assert "first_kernel<4>" in lines and "second" in lines and "sync" in lines


def _frame(name: str, thread: int, start: int, end: int) -> dict:
    return {"ph": "X", "cat": "python_function", "name": name, "pid": 1, "tid": thread, "ts": start,
            "dur": end - start}


def test_a_copy_to_pageable_memory_is_a_sync() -> None:
    """A cudaMemcpyAsync into pageable host memory returns once the copy is done (what `.item()` makes), so a gap
    that begins while the host sits in it is `sync`; one into pinned memory returns at once, so it is `host`."""
    for target, cause in (("Pageable", "sync"), ("Pinned", "host")):
        events = [_device("sum", 7, 0, 10, 1), _call("cudaLaunchKernel", 1, 0, 1, 1),
                  {**_device(f"Memcpy DtoH (Device -> {target})", 7, 12, 14, 2), "cat": "gpu_memcpy"},
                  _call("cudaMemcpyAsync", 1, 2, 15, 2),
                  _device("add", 7, 40, 45, 3), _call("cudaLaunchKernel", 1, 30, 31, 3)]
        gaps = analyze(Trace.from_events(events)).gaps
        assert [(g.start, g.end, g.cause) for g in gaps] == [(10, 12, "device"), (14, 40, cause)]
        assert gaps[1].host_was_in == "cudaMemcpyAsync"


def test_python_frames_name_the_code_of_a_gap() -> None:
    """With Python frames in the trace, a host gap names the innermost moe_ep frame when it began and at the
    launch (torch's and builtin frames skipped), else the innermost frame outside torch."""
    kernels = {"a": (100, 200, 90), "b": (300, 310, 280), "c": (400, 410, 390)}  # start, end, launch call
    frames = {"train.py(10): step": (0, 500), "moe_ep/moe/layer.py(270): forward": (150, 290),
              "torch/nn/modules/module.py(1775): _call_impl": (190, 220),
              "<built-in method item of Tensor object>": (195, 215),
              "moe_ep/comm/backends/nvshmem.py(200): dispatch": (270, 285), "torch/_ops.py(1123): __call__": (275, 284)}
    events = [_frame(name, 5, *at) for name, at in frames.items()]
    for corr, (name, (start, end, launch)) in enumerate(kernels.items()):
        events += [_device(name, 7, start, end, corr), _call("cudaLaunchKernel", 5, launch, launch + 1, corr)]
    report = analyze(Trace.from_events(events))
    assert [g.python for g in report.gaps] == [
        "moe_ep/moe/layer.py(270): forward -> moe_ep/comm/backends/nvshmem.py(200): dispatch",
        "train.py(10): step -> train.py(10): step"]
    assert "moe_ep/moe/layer.py(270): forward -> " in "\n".join(report.lines())
    plain = analyze(Trace.from_events([e for e in events if e["cat"] != "python_function"]))
    assert [g.python for g in plain.gaps] == ["", ""] and "Python when" not in "\n".join(plain.lines())


def test_steps_are_split_by_their_annotations() -> None:
    """Device ops belong to the step whose annotation holds their launch call; a flush launched between the
    steps belongs to none."""
    events = [_op(timeline.STEP_LABEL, 1, 0, 100), _op(timeline.STEP_LABEL, 1, 200, 300)]
    for corr, (launch, start) in enumerate([(10, 20), (50, 90), (150, 160), (210, 230), (290, 320)]):
        events += [_call("cudaLaunchKernel", 1, launch, launch + 1, corr),
                   _device(f"k{corr}", 7, start, start + 5, corr)]
    steps = Trace.from_events(events).steps()
    assert [[d.name for d in s.device] for s in steps] == [["k0", "k1"], ["k3", "k4"]]
    assert [analyze(s).span_us for s in steps] == [75, 95]
    assert timeline.median_step([analyze(s) for s in steps]).span_us == 75


@pytest.mark.parametrize("name, short", [
    ("void moe_ep::intranode::(anonymous namespace)::dispatch_kernel<4>(moe_ep::intranode::DeviceContext)",
     "dispatch_kernel<4>"),
    ("_route_kernel", "_route_kernel"),
    ("__nv_static_39__f2c3e3b3_17_stamp_exchange_cu_f6ab6c95__ZN6moe_ep10call_check50_GLOBAL__N__f2c3e3b3_17_stamp_"
     "exchange_cu_f6ab6c9515exchange_kernelENS0_7ContextENS0_4ArgsE", "exchange_kernel"),
    ("_Z14plain_function4Args", "plain_function"),
    ("_ZN6moe_ep2ll8dispatchILNS0_9RowFormatE0ELb0EEEvv", "dispatch"),
    ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl<X>(at::TensorIteratorBase&)::"
     "{lambda(int)#1}>(int, T)", "elementwise_kernel<128, 2, at::native::gpu_kernel_impl<X>(at::TensorIteratorBase&)::"
     "{lambda(int)#1}>"),
])
def test_kernel_names_lose_namespaces_and_arguments(name: str, short: str) -> None:
    assert kernel_name(name) == short[:80]


def test_cli_runs_on_cpu(tmp_path: Path) -> None:
    """On CPU the layer runs under the profiler, and each pass says there is no device work to attribute."""
    out = subprocess.run([sys.executable, "-m", "moe_ep.timeline", "--tokens", "32", "--hidden", "256", "--experts",
                          "8", "--ffn", "128", "--warmup", "1", "--steps", "2", "--out", str(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env=_env(MASTER_PORT="29547"))
    assert out.returncode == 0, out.stderr
    for name in ("forward", "forward_backward"):
        assert f"=== {name} (rank 0): no device work recorded" in out.stdout
        assert (tmp_path / f"trace_{name}_rank0.json").is_file()
    assert (tmp_path / "timeline.txt").read_text().startswith("moe_ep.timeline:")


def test_cli_analyses_a_saved_trace(tmp_path: Path) -> None:
    """--trace reads a Chrome trace from elsewhere: by its step annotations when it has them, else as one step."""
    events = [_op("train step", 1, 0, 100), _op("train step", 1, 200, 300)]
    for corr, (launch, start) in enumerate([(10, 20), (50, 90), (210, 230), (290, 320)]):
        events += [_call("cudaLaunchKernel", 1, launch, launch + 1, corr),
                   _device(f"k{corr}", 7, start, start + 5, corr)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    for label, want in (("train step", ["step 0: span 0.075 ms", "step 1: span 0.095 ms"]),
                        ("no such label", ["the whole trace", "step 0: span 0.305 ms"])):
        out = subprocess.run([sys.executable, "-m", "moe_ep.timeline", "--trace", str(path), "--step-label", label],
                             capture_output=True, text=True, timeout=120, env=_env())
        assert out.returncode == 0, out.stderr
        for text in want:
            assert text in out.stdout, out.stdout
        assert "host issued in" in out.stdout and "largest gaps" in out.stdout


@requires_gpus(1)
def test_real_traces_name_host_and_sync_gaps() -> None:
    """torch.profiler's own trace on this GPU: a 30 ms host sleep between two kernels is a `host` gap whose launch
    came after it began; a `.item()` (a copy to the host and a stream sync) between them a `sync` gap."""
    a = torch.randn(1 << 20, device="cuda")

    def slept() -> None:
        a.mul_(1.0001)
        time.sleep(0.03)
        a.add_(1.0)

    def synced() -> None:
        a.mul_(1.0001)
        a.sum().item()
        a.add_(1.0)

    for step in (slept, synced):
        step()
        reports = timeline.profile_steps(step, 2)
        assert len(reports) == 2
        for report in reports:
            assert report.busy_us > 0 and report.span_us > report.busy_us
            assert set(report.idle_by_cause()) == set(CAUSES)
            if step is slept:  # the sleep's gap is the largest by far
                largest = max(report.gaps, key=lambda g: g.us)
                assert largest.cause == "host" and largest.before_launch_us > 0, report.lines()
            else:  # the copy to the host ends, the host returns from its sync, then launches add_
                assert any(g.cause == "sync" and g.host_was_in in SYNC_CALLS | {"cudaMemcpyAsync"}
                           for g in report.gaps), report.lines()
