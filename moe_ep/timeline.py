"""`torchrun --nproc-per-node 1 -m moe_ep.timeline`: where one MoE step's device time goes, gap by gap.

A step's device span runs from the start of its first kernel, copy or memset to the end of its last. Inside it
the device is busy (some stream runs something) or idle, in gaps. A gap ends when an op starts, and that op's
launch call on the host (the same correlation id in torch.profiler's trace) says why the device waited:
  host     the launch call began after the gap began: the device ran dry while the host was still issuing
           (Python, allocations, argument checks); `launched by` names the torch ops around the launch call.
  sync     as `host`, and the host sat in a synchronising call (stream, event or device synchronize, a
           blocking copy, a copy to pageable host memory) when the gap began: it waited for the device to
           drain, then issued the next op (a count read such as `.item()` or `.tolist()`, an exact-size
           dispatch's receive sizes).
  device   the op was launched before the gap began and still waited (on another stream's event, say).
  unknown  the trace has no launch call for the op.
Each gap also says what the launching thread was running when the device went idle (`host was in`), its CUDA
calls before the launch (a cudaMalloc, say) and, in a trace with Python frames (--python: torch.profiler's
with_stack, which slows the host), the moe_ep code running when the gap began and at the launch.

The CLI profiles the layer case of moe_ep.bench (moe_ep.MoE, normal mode, one rank's shape; issue 44's
defaults: 4096 tokens x top-8 over 128 experts, hidden 7168, ffn 2048) pass by pass, each step after an L2
flush and a device sync, and prints, per pass, the span, busy and idle time of every step, the idle time by
cause, the kernels by device time and the largest gaps of the median step; --out keeps each pass's trace.
`--trace FILE` analyses a trace saved elsewhere instead (a framework's training step under torch.profiler, say),
step by step where its steps carry a record_function label (--step-label). With several ranks on one GPU the
gaps include the other ranks' time slices: read them with one rank per GPU.
"""
from __future__ import annotations

import argparse
import bisect
import json
import os
import re
import statistics
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Optional

import torch

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
CALL_CATEGORIES = ("cuda_runtime", "cuda_driver")
OP_CATEGORIES = ("cpu_op", "user_annotation")
SYNC_CALLS = frozenset({"cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy",
                        "cuStreamSynchronize", "cuEventSynchronize", "cuCtxSynchronize", "cuMemcpyDtoH_v2"})
CAUSES = ("host", "sync", "device", "unknown")
STEP_LABEL = "moe_ep.timeline step"


@dataclass(frozen=True)
class DeviceOp:
    """A kernel, copy or memset as the device ran it (times in us, the trace's clock)."""

    name: str
    stream: int
    start: float
    end: float
    correlation: Optional[int]


@dataclass(frozen=True)
class HostSpan:
    """A host-side interval on one thread: a CUDA runtime or driver call (with the correlation id of what it
    launched) or a torch op / annotation (correlation None)."""

    name: str
    thread: object  # the trace's thread id
    start: float
    end: float
    correlation: Optional[int] = None


@dataclass
class Trace:
    """The events of a torch.profiler Chrome trace that the analysis reads."""

    device: list[DeviceOp]
    calls: list[HostSpan]  # runtime and driver calls
    ops: list[HostSpan]  # torch ops and record_function annotations
    python: list[HostSpan] = field(default_factory=list)  # Python frames (a profile made with_stack=True)

    @classmethod
    def from_events(cls, events: Iterable[dict]) -> "Trace":
        device, calls, ops, python = [], [], [], []
        for e in events:
            if e.get("ph") != "X" or "dur" not in e:
                continue
            cat, args = e.get("cat"), e.get("args", {})
            start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
            if cat in DEVICE_CATEGORIES:
                device.append(DeviceOp(e["name"], int(args.get("stream", -1)), start, end, args.get("correlation")))
            elif cat in CALL_CATEGORIES:
                calls.append(HostSpan(e["name"], e.get("tid", 0), start, end, args.get("correlation")))
            elif cat in OP_CATEGORIES:
                ops.append(HostSpan(e["name"], e.get("tid", 0), start, end))
            elif cat == "python_function":
                python.append(HostSpan(e["name"], e.get("tid", 0), start, end))
        return cls(sorted(device, key=lambda d: (d.start, d.end)), calls, ops, python)

    @classmethod
    def from_profiler(cls, prof: "torch.profiler.profile", keep: Optional[str] = None) -> "Trace":
        """The trace of a finished torch.profiler run (written to `keep` when given, else to a temporary file)."""
        with tempfile.TemporaryDirectory() as folder:
            path = keep or os.path.join(folder, "trace.json")
            prof.export_chrome_trace(path)
            return cls.from_file(path)

    @classmethod
    def from_file(cls, path: str) -> "Trace":
        """A Chrome trace saved by torch.profiler's export_chrome_trace."""
        with open(path) as fh:
            return cls.from_events(json.load(fh)["traceEvents"])

    def steps(self, label: str = STEP_LABEL) -> list["Trace"]:
        """One Trace per `label` annotation, in order: the device ops launched inside it and the host spans
        within it."""
        windows = sorted((o.start, o.end) for o in self.ops if o.name == label)
        launched = {c.correlation: c.start for c in self.calls if c.correlation is not None}
        parts = []
        for lo, hi in windows:
            def inside(t: float) -> bool:
                return lo <= t <= hi

            parts.append(Trace([d for d in self.device if inside(launched.get(d.correlation, d.start))],
                               [c for c in self.calls if inside(c.start)],
                               [o for o in self.ops if inside(o.start) and o.name != label],
                               [f for f in self.python if inside(f.start)]))
        return parts


@dataclass(frozen=True)
class Gap:
    """Time inside the device span when no stream ran anything, up to the start of `next_op`."""

    start: float
    end: float
    cause: str  # one of CAUSES
    next_op: str
    before_launch_us: float  # of the gap, the part before the launch call began (0 for "device" and "unknown")
    launched_by: str  # torch ops around the launch call, outermost first ("" when none)
    host_was_in: str  # what the launching thread ran when the gap began ("" when between ops)
    host_calls: str = ""  # the launching thread's longest CUDA calls between the gap's start and the launch
    python: str = ""  # with Python frames in the trace: the code running when the gap began -> at the launch

    @property
    def us(self) -> float:
        return self.end - self.start


@dataclass
class Report:
    """One step: its device span, busy time (any stream running), per-stream busy time, device time per kernel
    name and every gap."""

    start: float  # the span's first instant (the trace's clock, us)
    span_us: float
    busy_us: float
    issue_us: float = 0.0  # from the first launch call of the step's device ops to the end of the last
    streams: dict[int, float] = field(default_factory=dict)
    kernels: dict[str, tuple[int, float]] = field(default_factory=dict)  # kernel_name -> (launches, total us)
    gaps: list[Gap] = field(default_factory=list)

    @property
    def idle_us(self) -> float:
        return self.span_us - self.busy_us

    def idle_by_cause(self) -> dict[str, float]:
        return {cause: sum(g.us for g in self.gaps if g.cause == cause) for cause in CAUSES}

    def summary(self) -> str:
        causes = ", ".join(f"{c} {us / 1e3:.3f}" for c, us in self.idle_by_cause().items() if us > 0)
        return (f"span {self.span_us / 1e3:.3f} ms, busy {self.busy_us / 1e3:.3f}, idle {self.idle_us / 1e3:.3f}"
                f" ({len(self.gaps)} gaps{': ' + causes if causes else ''}); host issued in {self.issue_us / 1e3:.3f}")

    def lines(self, top_kernels: int = 12, top_gaps: int = 15) -> list[str]:
        out = [self.summary(), "busy ms per stream: " + ", ".join(f"{s}: {us / 1e3:.3f}"
                                                                  for s, us in sorted(self.streams.items()))]
        out.append(f"kernels by device time (top {top_kernels}): launches, ms, name")
        for name, (n, us) in sorted(self.kernels.items(), key=lambda kv: -kv[1][1])[:top_kernels]:
            out.append(f"  {n:5d} {us / 1e3:8.3f}  {name}")
        out.append(f"largest gaps (top {top_gaps}): at ms, us, cause, us before the launch call, next op | "
                   "launched by | host was in | its CUDA calls before the launch (us)"
                   + (" | Python when the gap began -> at the launch" if any(g.python for g in self.gaps) else ""))
        for g in sorted(self.gaps, key=lambda g: -g.us)[:top_gaps]:
            out.append(f"  {(g.start - self.start) / 1e3:8.3f} {g.us:8.1f} {g.cause:7s} {g.before_launch_us:8.1f}  "
                       f"{kernel_name(g.next_op)} | {g.launched_by or '-'} | {g.host_was_in or '-'} | "
                       f"{g.host_calls or '-'}" + (f" | {g.python}" if g.python else ""))
        return out


def _mangled_function(name: str) -> Optional[str]:
    """The function's own name in an Itanium-mangled one (`_ZN6moe_ep2ll8dispatchI...` -> `dispatch`; a static
    kernel's `__nv_static_..._ZN...` too), or None when there is none to read."""
    nested = name.find("_ZN")
    at = nested + 3 if nested >= 0 else name.find("_Z") + 2
    if at < 2:
        return None
    last = None
    while at < len(name) and name[at].isdigit():
        digits = at
        while at < len(name) and name[at].isdigit():
            at += 1
        length = int(name[digits:at])
        last, at = name[at:at + length], at + length
        if nested < 0:
            break
    return last or None


def kernel_name(name: str) -> str:
    """A kernel's own name: demangled names lose return type, namespaces and arguments (`void a::b::f<4>(...)` ->
    `f<4>`), mangled ones are read (_mangled_function)."""
    if name.startswith(("_Z", "__nv_static_")):
        return (_mangled_function(name) or name)[:80]
    text = re.sub(r"^void\s+", "", name.replace("(anonymous namespace)", "anon"))
    depth, cut, end = 0, 0, len(text)
    for i, ch in enumerate(text):  # the argument list and the last "::", both outside template brackets
        depth += (ch == "<") - (ch == ">")
        if depth == 0 and ch == "(":
            end = i
            break
        if depth == 0 and text.startswith("::", i):
            cut = i + 2
    return text[cut:end].strip()[:80] or name[:80]


class _HostIndex:
    """A trace's host spans by thread, in start order: "which spans contain time t" for many (thread, t) at once
    (one sweep per thread with a stack of the spans that may still be open), and "which spans ran between t0 and
    t1" (a bisection over their starts)."""

    def __init__(self, spans: Iterable[HostSpan]) -> None:
        self.by_thread: dict[object, list[HostSpan]] = defaultdict(list)
        for s in spans:
            self.by_thread[s.thread].append(s)
        for thread_spans in self.by_thread.values():
            thread_spans.sort(key=lambda s: (s.start, -s.end))
        self.starts = {thread: [s.start for s in spans] for thread, spans in self.by_thread.items()}
        self.longest = {thread: max(s.end - s.start for s in spans) for thread, spans in self.by_thread.items()}

    def containing(self, queries: Iterable[tuple[object, float]]) -> dict[tuple[object, float], list[HostSpan]]:
        """{(thread, t): the spans of that thread that contain t, outermost (earliest start) first}. A span leaves
        the stack only when it ended before a later span began, so before t: the stack holds every container."""
        times: dict[object, set[float]] = defaultdict(set)
        for thread, t in queries:
            times[thread].add(t)
        answers = {}
        for thread, wanted in times.items():
            spans, stack, i = self.by_thread.get(thread, []), [], 0
            for t in sorted(wanted):
                while i < len(spans) and spans[i].start <= t:
                    while stack and stack[-1].end < spans[i].start:
                        stack.pop()
                    stack.append(spans[i])
                    i += 1
                answers[(thread, t)] = [s for s in stack if s.end >= t]
        return answers

    def during(self, thread: object, t0: float, t1: float, shown: int = 3, min_us: float = 5.0) -> str:
        """The spans of `thread` overlapping [t0, t1), their overlap summed by name, the `shown` longest of at least
        min_us: "cudaMalloc 292, cudaEventSynchronize 13"."""
        if thread not in self.by_thread or t1 <= t0:
            return ""
        spent: dict[str, float] = defaultdict(float)
        first = bisect.bisect_left(self.starts[thread], t0 - self.longest[thread])
        for c in self.by_thread[thread][first:bisect.bisect_left(self.starts[thread], t1)]:
            spent[c.name] += max(0.0, min(c.end, t1) - max(c.start, t0))
        top = sorted(((us, name) for name, us in spent.items() if us >= min_us), reverse=True)[:shown]
        return ", ".join(f"{name} {us:.0f}" for us, name in top)


def _own_frame(frames: list[HostSpan]) -> str:
    """Of Python frames outermost first, the innermost in moe_ep, else the innermost outside torch and builtins."""
    for test in (lambda n: "moe_ep/" in n, lambda n: not n.startswith("<") and "torch/" not in n):
        for f in reversed(frames):
            if test(f.name):
                return f.name
    return ""


def _chain(spans: list[HostSpan]) -> str:
    names = [s.name for s in spans]
    keep = names if len(names) <= 3 else [names[0], names[-2], names[-1]]
    return " > ".join(keep)


def analyze(trace: Trace) -> Report:
    """The device span, busy time and gaps of the device ops in `trace`, each gap's cause from the host side of
    the trace (module docstring)."""
    ops = trace.device
    if not ops:
        return Report(0.0, 0.0, 0.0)
    launches = {c.correlation: c for c in trace.calls if c.correlation is not None}
    blocking = {d.correlation for d in ops if d.name.startswith("Memcpy DtoH") and "Pageable" in d.name}
    syncs = [c for c in trace.calls if c.name in SYNC_CALLS or c.correlation in blocking]  # a copy to pageable
    # host memory returns once it is done, so its call is a synchronisation too (torch's .item() makes one)
    streams: dict[int, float] = {}
    kernels: dict[str, tuple[int, float]] = {}
    for d in ops:
        streams[d.stream] = streams.get(d.stream, 0.0) + (d.end - d.start)
        name = kernel_name(d.name)
        n, us = kernels.get(name, (0, 0.0))
        kernels[name] = (n + 1, us + d.end - d.start)

    span = max(d.end for d in ops) - ops[0].start
    busy, holes, reach = 0.0, [], ops[0].start
    for d in ops:  # sorted by start: the union of [start, end) and the holes between
        if d.start > reach:
            holes.append((reach, d, launches.get(d.correlation)))
        busy += max(0.0, d.end - max(d.start, reach))
        reach = max(reach, d.end)
    queries = [(launch.thread, t) for start, _, launch in holes if launch is not None for t in (start, launch.start)]
    context = _HostIndex([*trace.ops, *trace.calls]).containing(queries)
    frames = _HostIndex(trace.python).containing(queries)
    calls = _HostIndex(trace.calls)
    gaps = [_gap(start, nxt, launch, syncs, context, calls, frames) for start, nxt, launch in holes]
    issued = [launches[d.correlation] for d in ops if d.correlation in launches]
    issue = max(c.end for c in issued) - min(c.start for c in issued) if issued else 0.0
    return Report(ops[0].start, span, busy, issue, streams, kernels, gaps)


def _gap(start: float, nxt: DeviceOp, launch: Optional[HostSpan], syncs: list[HostSpan],
         context: dict[tuple[object, float], list[HostSpan]], calls: _HostIndex,
         frames: dict[tuple[object, float], list[HostSpan]]) -> Gap:
    """The gap [start, nxt.start) and its cause (module docstring); `context` and `frames` hold the host spans and
    Python frames around the launch call and around the gap's start on the launching thread, `calls` that
    thread's CUDA calls."""
    if launch is None:
        return Gap(start, nxt.start, "unknown", nxt.name, 0.0, "", "")
    launched_by = _chain([s for s in context[(launch.thread, launch.start)] if s.correlation is None])
    was_in = context[(launch.thread, start)]
    was_in_name = was_in[-1].name if was_in else ""
    if launch.start < start:
        return Gap(start, nxt.start, "device", nxt.name, 0.0, launched_by, was_in_name)
    waiting = any(s.start <= start <= s.end + 1.0 for s in syncs)
    python = " -> ".join((_own_frame(frames[(launch.thread, start)]) or "-",
                          _own_frame(frames[(launch.thread, launch.start)]) or "-"))
    return Gap(start, nxt.start, "sync" if waiting else "host", nxt.name, min(launch.start, nxt.start) - start,
               launched_by, was_in_name, calls.during(launch.thread, start, launch.start),
               python if python != "- -> -" else "")


def profile_steps(step: Callable[[], object], steps: int, before: Optional[Callable[[], None]] = None,
                  keep: Optional[str] = None, python: bool = False) -> list[Report]:
    """Runs step() `steps` times under torch.profiler (CPU and CUDA), each after before() (untimed, e.g. an L2
    flush) and a device sync and followed by one, and returns each step's Report (empty on CPU: no device).
    python=True records Python frames too (with_stack), which names the code behind each gap but slows the
    host, so its gaps grow: read causes from it, sizes from a run without."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, with_stack=python) as prof:
        for _ in range(steps):
            if before is not None:
                before()
            sync()
            with record_function(STEP_LABEL):
                step()
                sync()
    return [analyze(part) for part in Trace.from_profiler(prof, keep).steps()]


def median_step(reports: list[Report]) -> Report:
    """The step whose span is the median one (the lower middle for an even count)."""
    ranked = sorted(reports, key=lambda r: r.span_us)
    return ranked[(len(ranked) - 1) // 2]


def pass_lines(name: str, reports: list[Report], min_gap_us: float) -> list[str]:
    """The printout of one pass: every step's summary, the idle time by cause (median over steps), then the
    median step's kernels and gaps of at least min_gap_us."""
    if not any(r.span_us for r in reports):
        return [f"=== {name}: no device work recorded (CPU run: nothing to attribute)"]
    out = [f"=== {name}: {len(reports)} steps"]
    out += [f"step {i}: {r.summary()}" for i, r in enumerate(reports)]
    med = {c: statistics.median(r.idle_by_cause()[c] for r in reports) for c in CAUSES}
    out.append("median idle ms by cause: " + ", ".join(f"{c} {us / 1e3:.3f}" for c, us in med.items()))
    chosen = median_step(reports)
    chosen = replace(chosen, gaps=[g for g in chosen.gaps if g.us >= min_gap_us])
    return out + ["median step:"] + ["  " + line for line in chosen.lines()]


def _parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m moe_ep.timeline", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="tokens on this rank")
    p.add_argument("--hidden", type=int, default=7168, help="hidden size")
    p.add_argument("--experts", type=int, default=128, help="experts in all (one rank holds them all)")
    p.add_argument("--topk", type=int, default=8, help="experts per token")
    p.add_argument("--ffn", type=int, default=2048, help="each expert's SwiGLU hidden size")
    p.add_argument("--passes", default="forward,forward_backward", help="comma-separated: forward, forward_backward")
    p.add_argument("--fp8", action="store_true", help="MoE(fp8_experts=True) instead of bf16 experts")
    p.add_argument("--overlap", action="store_true", help="MoE(overlap=True)")
    p.add_argument("--warmup", type=int, default=3, help="unprofiled steps of each pass first")
    p.add_argument("--steps", type=int, default=5, help="profiled steps of each pass")
    p.add_argument("--min-gap-us", type=float, default=5.0, help="gaps shorter than this are counted, not listed")
    p.add_argument("--python", action="store_true",
                   help="record Python frames (slows the host: gaps grow) to name the code running in each gap")
    p.add_argument("--out", default=None, help="folder for each pass's Chrome trace and the printout")
    p.add_argument("--trace", default=None,
                   help="analyse this torch.profiler Chrome trace (export_chrome_trace) instead of profiling the layer")
    p.add_argument("--step-label", default=STEP_LABEL,
                   help="with --trace: the record_function label of each step (none found: the whole trace is one)")
    return p.parse_args(argv)


def trace_lines(path: str, label: str, min_gap_us: float) -> list[str]:
    """The printout for a saved Chrome trace: one step per `label` annotation, or the whole trace as one."""
    trace = Trace.from_file(path)
    steps = trace.steps(label) or [trace]
    return pass_lines(f"{path}, {len(steps)} step(s) labelled {label!r}" if steps[0] is not trace
                      else f"{path}, the whole trace (no {label!r} annotation)", [analyze(t) for t in steps],
                      min_gap_us)


def main(argv: Optional[list[str]] = None) -> None:
    from .bench import LayerShape, fresh_forward, layer_inputs
    from .comm.buffer import Buffer
    from .launch import init_distributed, shutdown
    from .moe.layer import MoE

    args = _parse_args(argv)
    if args.trace:
        print("\n".join(trace_lines(args.trace, args.step_label, args.min_gap_us)), flush=True)
        return
    placement = init_distributed()
    device = placement.device
    shape = LayerShape(tokens=args.tokens, hidden=args.hidden, experts=args.experts, topk=args.topk, ffn=args.ffn)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) if device.type == "cuda" else None
    lines = [f"moe_ep.timeline: {shape}, fp8_experts={args.fp8}, overlap={args.overlap}, device {device}"
             + (" (ranks share this GPU: gaps include their time slices)" if placement.shared_gpu else "")]
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    with Buffer(hidden=shape.hidden, num_experts=shape.experts, num_topk=shape.topk,
                max_tokens_per_rank=shape.tokens, device=device) as buf:
        torch.manual_seed(0)
        moe = MoE(buf, shape.ffn, dtype=torch.bfloat16, fp8_experts=args.fp8)
        x, grad = layer_inputs(shape, buf.device, seed=buf.rank)
        passes = {"forward": lambda: fresh_forward(moe, x, args.overlap),
                  "forward_backward": lambda: fresh_forward(moe, x, args.overlap).backward(grad)}
        for name in args.passes.split(","):
            if name not in passes:
                raise SystemExit(f"--passes: unknown pass {name!r} (forward, forward_backward)")
            for _ in range(args.warmup):
                passes[name]()
            keep = os.path.join(args.out, f"trace_{name}_rank{buf.rank}.json") if args.out else None
            reports = profile_steps(passes[name], args.steps, before=None if flush is None else flush.zero_,
                                    keep=keep, python=args.python)
            lines += pass_lines(f"{name} (rank {buf.rank})", reports, args.min_gap_us)
    if buf.rank == 0:
        print("\n".join(lines), flush=True)
        if args.out:
            with open(os.path.join(args.out, "timeline.txt"), "w") as fh:
                fh.write("\n".join(lines) + "\n")
    shutdown()


if __name__ == "__main__":
    main()
