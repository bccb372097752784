"""Faults with 2 ranks (on 2 GPUs, or sharing one: tests/_dist.py): a rank killed (SIGKILL) or stalled past the timeout in the middle of a run, and
expert ids out of range. Each rank reports what it saw (exception, message, seconds) to the parent,
which checks it: normal mode raises CommTimeoutError naming the silent rank within the timeout, a
fault-tolerant low-latency Buffer masks it and keeps computing without its experts (checked against
the combine rule computed here on the host), a plain low-latency Buffer raises in the call, and a bad
expert id raises ValueError naming token and value on its rank (PeerInputError naming that rank on the
other) with the Buffer still usable. Calls that differ between the ranks raise CallMismatchError on
both at once, and every call kind whose peer stays away raises in the call itself.

The ranks run without torchrun, and a killed rank takes nothing else down; survivors leave with
os._exit so that no teardown waits for the dead peer. The ranks synchronise on events, not sleeps:
a survivor starts its call once the killed rank's process is gone, a stalled rank resumes once its
peer has signalled (a file) that it gave up on or masked it. A timeout's elapsed time is bounded from
below as well (an error raised at once is no timeout)."""
from __future__ import annotations

import os
import signal
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests._dist import device, join_group, rendezvous, requires_gpus, setup_gpu_rank

pytestmark = requires_gpus()

TIMEOUT_S = 3.0
SLACK_S = 4.0  # launch, polling granularity and the host's own work on top of the kernel timeout
WAIT_S = 60.0  # the longest a rank waits for its peer's signal or death
H, E, K, T = 1024, 16, 4, 64


def _run(rank: int, port: int, fn: Callable, reports: Any, scratch: str) -> None:
    """One rank: a group of 2 (NCCL, or gloo when they share a GPU), then fn(rank, report, scratch)
    (scratch: a directory both ranks see, for _signal / _wait_for); leaves without any teardown."""
    def report(key: str, value: Any) -> None:
        reports.put((rank, key, value))

    try:
        dev, backend = setup_gpu_rank(rank, 2)
        join_group(backend, rank, 2, port, dev)
        fn(rank, report, Path(scratch))
        torch.cuda.synchronize()
        report("done", True)
    except BaseException:
        report("error", traceback.format_exc())
    os._exit(0)


def _launch(fn: Callable, wait_s: float = 150) -> dict[tuple[int, str], Any]:
    """Runs fn on 2 fresh processes; returns {(rank, key): value} of everything they reported."""
    ctx = mp.get_context("spawn")
    reports = ctx.SimpleQueue()
    store = rendezvous()  # held here until both ranks have ended
    scratch = tempfile.mkdtemp()
    procs = [ctx.Process(target=_run, args=(r, store.port, fn, reports, scratch)) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + wait_s
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    seen: dict[tuple[int, str], Any] = {}
    while not reports.empty():
        rank, key, value = reports.get()
        seen[(rank, key)] = value
    errors = {k: v for k, v in seen.items() if k[1] == "error"}
    assert not errors, "\n".join(f"--- rank {r} ---\n{tb}" for (r, _), tb in errors.items())
    return seen


def _kill_peer_and_wait(rank: int) -> None:
    """Rank 1 kills itself (SIGKILL); rank 0 returns once the kernel has torn it down (its /proc entry
    gone or a zombie), not after a guessed sleep."""
    pids: list[Any] = [None, None]
    dist.all_gather_object(pids, os.getpid())
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    stat = Path(f"/proc/{pids[1]}/stat")
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            state = stat.read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.01)
    raise AssertionError(f"rank 1 (pid {pids[1]}) still alive {WAIT_S} s after SIGKILL")


def _signal(scratch: Path, name: str) -> None:
    """Tells the other rank that `name` happened (a file in the shared scratch directory)."""
    (scratch / name).touch()


def _wait_for(scratch: Path, name: str) -> None:
    """Waits until the other rank has signalled `name` (at most WAIT_S)."""
    deadline = time.monotonic() + WAIT_S
    while not (scratch / name).exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {WAIT_S} s for the peer's '{name}'")
        time.sleep(0.01)


def _inputs(rank: int, step: int, n: int = T) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(1000 * step + rank)
    x = torch.randn(n, H, generator=g, device="cuda").to(torch.bfloat16)
    idx = torch.rand(n, E, generator=g, device="cuda").topk(K, dim=1).indices
    w = torch.rand(n, K, generator=g, device="cuda")
    return x, idx, w


def _timed(call: Callable[[], Any]) -> tuple[str, str, float]:
    """(exception type, message, seconds) of a call expected to raise (after a device sync)."""
    start = time.monotonic()
    try:
        call()
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - the type is what the parent checks
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "none", "", time.monotonic() - start


def _normal_round(buf: Any, rank: int, step: int) -> None:
    """Dispatch + combine; the combine's event raises what its kernel recorded once it completed."""
    x, idx, w = _inputs(rank, step)
    res = buf.dispatch(x, idx, w)
    _, event = buf.combine(res.x, res.handle, async_op=True)
    event.synchronize()


def _normal_kill(rank: int, report: Callable, scratch: Path) -> None:
    import moe_ep

    buf = moe_ep.Buffer(device=device(), hidden=H, num_experts=E, num_topk=K, max_tokens_per_rank=T, backend="nvshmem",
                        timeout_s=TIMEOUT_S)
    for step in range(3):
        _normal_round(buf, rank, step)
    _kill_peer_and_wait(rank)
    report("first", _timed(lambda: _normal_round(buf, rank, 3)))
    report("second", _timed(lambda: _normal_round(buf, rank, 4)))
    start = time.monotonic()
    buf.abort()
    report("abort_s", time.monotonic() - start)
    report("rebuild", _timed(lambda: moe_ep.Buffer(device=device(), hidden=H, num_experts=E, num_topk=K, max_tokens_per_rank=T,
                                                    backend="nvshmem")))
    # a new group of the survivors: the reference backend serves it
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/store", rank=0, world_size=1)
    x, idx, w = (t.cpu() for t in _inputs(rank, 5))
    with moe_ep.Buffer(hidden=H, num_experts=E, num_topk=K, max_tokens_per_rank=T, backend="reference") as new:
        res = new.dispatch(x, idx, w)
        report("new_group", torch.equal(new.combine(res.x, res.handle), x))  # one rank: every row comes back


def test_killed_rank_normal_mode() -> None:
    seen = _launch(_normal_kill)
    assert (1, "done") not in seen, "rank 1 was to be killed"
    for key in ("first", "second"):
        kind, msg, secs = seen[(0, key)]
        assert kind == "CommTimeoutError" and "waiting for rank 1" in msg and msg.startswith("moe_ep rank 0"), msg
        assert secs < TIMEOUT_S + SLACK_S, (key, secs)
    assert seen[(0, "first")][2] >= TIMEOUT_S * 0.9, seen[(0, "first")]  # it waited out the timeout first
    assert seen[(0, "abort_s")] < TIMEOUT_S + SLACK_S  # waits for kernels still giving up, frees nothing
    kind, msg, _ = seen[(0, "rebuild")]
    assert kind == "PeersLostError" and "lost its peers" in msg, msg
    assert seen[(0, "new_group")]
    assert seen[(0, "done")]


def _normal_stall(rank: int, report: Callable, scratch: Path) -> None:
    import moe_ep

    buf = moe_ep.Buffer(device=device(), hidden=H, num_experts=E, num_topk=K, max_tokens_per_rank=T, backend="nvshmem",
                        timeout_s=TIMEOUT_S)
    _normal_round(buf, rank, 0)
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 1:  # stalls until rank 0 has given up on the call
        _wait_for(scratch, "rank 0 gave up")
    report("stalled", _timed(lambda: _normal_round(buf, rank, 1)))
    if rank == 0:
        _signal(scratch, "rank 0 gave up")


def test_stalled_rank_normal_mode() -> None:
    seen = _launch(_normal_stall)
    kind, msg, secs = seen[(0, "stalled")]
    assert kind == "CommTimeoutError" and "waiting for rank 1" in msg, msg
    assert TIMEOUT_S * 0.9 <= secs < TIMEOUT_S + SLACK_S, secs
    kind, msg, _ = seen[(1, "stalled")]  # rank 0 gave up on this call long before rank 1 came back
    assert kind == "CommTimeoutError" and "waiting for rank 0" in msg, msg


def _expected_ll_combine(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, alive: set[int]) -> torch.Tensor:
    """The low-latency combine rule with identity experts, experts of ranks not in `alive` dropped:
    bf16 of the float32 sum over ascending k of w[n, k] * x[n] (each product and sum rounded once)."""
    x, idx, w = x.float().cpu(), idx.cpu(), w.cpu()
    acc = torch.zeros_like(x)
    for k in range(idx.shape[1]):
        keep = torch.tensor([int(e) // (E // 2) in alive for e in idx[:, k]])
        term = w[:, k:k + 1] * x
        acc = torch.where(keep[:, None], acc + term, acc)
    return acc.to(torch.bfloat16)


def _ll_round(buf: Any, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any, Any]:
    x, idx, w = _inputs(rank, step)
    d = buf.low_latency_dispatch(x, idx)
    out = buf.low_latency_combine(d.x, idx, w, d.handle).x
    return x, idx, w, d, out


def _ll_kill(rank: int, report: Callable, scratch: Path) -> None:
    import moe_ep

    buf = moe_ep.Buffer(device=device(), hidden=H, num_experts=E, num_topk=K, max_tokens_per_rank=T, backend="nvshmem",
                        low_latency=True, fault_tolerant=True, timeout_s=TIMEOUT_S)
    for step in range(3):
        x, idx, w, _, out = _ll_round(buf, rank, step)
        assert torch.equal(out.cpu(), _expected_ll_combine(x, idx, w, {0, 1})), f"step {step} before the fault"
    _kill_peer_and_wait(rank)
    for step in (3, 4):
        start = time.monotonic()
        x, idx, w, _, out = _ll_round(buf, rank, step)
        torch.cuda.synchronize()
        secs = time.monotonic() - start
        report(f"step{step}", (buf.masked_ranks, torch.equal(out.cpu(), _expected_ll_combine(x, idx, w, {0})), secs))
    start = time.monotonic()
    buf.abort()
    report("abort_s", time.monotonic() - start)


def test_killed_rank_fault_tolerant_low_latency() -> None:
    seen = _launch(_ll_kill)
    assert (1, "done") not in seen
    masked, equal, secs = seen[(0, "step3")]
    assert masked == [1] and equal and TIMEOUT_S * 0.9 <= secs < TIMEOUT_S + SLACK_S, (masked, equal, secs)
    masked, equal, secs = seen[(0, "step4")]
    assert masked == [1] and equal and secs < TIMEOUT_S / 2, (masked, equal, secs)  # no second wait
    assert seen[(0, "abort_s")] < SLACK_S


def _ll_stall(rank: int, report: Callable, scratch: Path) -> None:
    import moe_ep

    buf = moe_ep.Buffer(device=device(), hidden=H, num_experts=E, num_topk=K, max_tokens_per_rank=T, backend="nvshmem",
                        low_latency=True, fault_tolerant=True, timeout_s=TIMEOUT_S)
    _ll_round(buf, rank, 0)
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 1:  # stalls until rank 0 has masked it
        _wait_for(scratch, "rank 0 masked rank 1")
    x, idx, w, _, out = _ll_round(buf, rank, 1)
    torch.cuda.synchronize()
    report("stalled", (buf.masked_ranks, torch.equal(out.cpu(), _expected_ll_combine(x, idx, w, {rank}))))
    if rank == 0:
        _signal(scratch, "rank 0 masked rank 1")


def test_stalled_rank_fault_tolerant_low_latency() -> None:
    seen = _launch(_ll_stall)
    assert seen[(0, "stalled")] == ([1], True)
    assert seen[(1, "stalled")] == ([0], True)  # rank 0 had moved on: rank 1 masks it in turn


def _ll_dead_peer(rank: int, report: Callable, scratch: Path) -> None:
    import moe_ep

    buf = moe_ep.Buffer(device=device(), hidden=H, num_experts=E, num_topk=K, max_tokens_per_rank=T, backend="nvshmem",
                        low_latency=True, timeout_s=TIMEOUT_S)
    _ll_round(buf, rank, 0)
    _kill_peer_and_wait(rank)
    report("first", _timed(lambda: _ll_round(buf, rank, 1)))
    report("next", _timed(lambda: _ll_round(buf, rank, 2)))


def test_killed_rank_low_latency_raises_in_the_call() -> None:
    """A plain low-latency Buffer whose peer died: the call raises (its stamp exchange waits out the
    timeout for the peer), it does not return rows; so does the next."""
    seen = _launch(_ll_dead_peer)
    for key in ("first", "next"):
        kind, msg, secs = seen[(0, key)]
        assert kind == "CommTimeoutError" and "waiting for rank 1" in msg, msg
        assert TIMEOUT_S * 0.9 <= secs < TIMEOUT_S + SLACK_S, (key, secs)


def _mismatch(rank: int, report: Callable, scratch: Path) -> None:
    """Default arguments (timeout_s 100 s): ranks that make different calls must raise at once."""
    import moe_ep

    kwargs = dict(device=device(), hidden=H, num_experts=E, num_topk=K, max_tokens_per_rank=T, low_latency=True)
    buf = moe_ep.Buffer(backend="nvshmem", **kwargs)
    ref = moe_ep.Buffer(backend="reference", **kwargs)
    x, idx, w = _inputs(rank, 0)
    res = buf.dispatch(x, idx, w)
    buf.combine(res.x, res.handle)
    d = buf.low_latency_dispatch(x, idx)
    buf.low_latency_combine(d.x, idx, w, d.handle)
    torch.cuda.synchronize()
    cases = {  # rank 0's call, rank 1's call
        "combine_vs_dispatch": (lambda: buf.combine(res.x, res.handle), lambda: buf.dispatch(x, idx, w)),
        "skipped_call": (lambda: buf.dispatch(x, handle=res.handle), lambda: buf.combine(res.x, res.handle)),
        "worst_case_vs_combine": (lambda: buf.dispatch(x, idx, w, worst_case=True),
                                  lambda: buf.combine(res.x, res.handle)),
        "low_latency": (lambda: buf.low_latency_combine(d.x, idx, w, d.handle),
                        lambda: buf.low_latency_dispatch(x, idx, return_recv_hook=True)),
        "low_latency_vs_normal": (lambda: buf.low_latency_dispatch(x, idx), lambda: buf.combine(res.x, res.handle)),
    }
    for name, calls in cases.items():
        report(name, _timed(calls[rank]))
    # still usable: clean rounds match the reference backend bit for bit
    x2, idx2, w2 = _inputs(rank, 1)
    got, want = buf.dispatch(x2, idx2, w2), ref.dispatch(x2, idx2, w2)
    y = (want.x.float() * (rank + 1.5)).to(torch.bfloat16)
    same = torch.equal(got.x.view(torch.int16), want.x.view(torch.int16)) and \
        torch.equal(buf.combine(y, got.handle).view(torch.int16), ref.combine(y, want.handle).view(torch.int16))
    d, rd = buf.low_latency_dispatch(x2, idx2), ref.low_latency_dispatch(x2, idx2)
    same = same and torch.equal(d.count, rd.count)
    out = buf.low_latency_combine(rd.x, idx2, w2, d.handle).x
    same = same and torch.equal(out.view(torch.int16), ref.low_latency_combine(rd.x, idx2, w2, rd.handle).x.view(torch.int16))
    report("after", same)


def test_mismatched_calls_raise_on_every_rank() -> None:
    """A combine against a dispatch, a skipped cached dispatch, a worst-case dispatch against a combine,
    low-latency calls of two kinds (one with a receive hook), and a low-latency call against a normal one:
    every rank raises CallMismatchError naming both calls, well within 30 s under the default 100 s
    timeout (the stamp exchange finds it in one round trip), and the Buffer then gives the reference
    backend's bits."""
    seen = _launch(_mismatch)
    want = {"combine_vs_dispatch": ("combine", "dispatch"), "skipped_call": ("cached dispatch", "combine"),
            "worst_case_vs_combine": ("dispatch", "combine"),
            "low_latency": ("low-latency combine", "low-latency dispatch"),
            "low_latency_vs_normal": ("low-latency dispatch", "combine")}
    for name, (call0, call1) in want.items():
        for rank in (0, 1):
            kind, msg, secs = seen[(rank, name)]
            assert kind == "CallMismatchError", (name, rank, kind, msg)
            assert f"rank 0: {call0} #" in msg and f"rank 1: {call1} #" in msg, (name, msg)
            assert secs < 30, (name, rank, secs)
    assert seen[(0, "after")] and seen[(1, "after")]


def _each_kind_alone(rank: int, report: Callable, scratch: Path) -> None:
    """Rank 0 makes each kind of call while rank 1 stays away: the call itself raises CommTimeoutError
    (a CUDA graph's replay: Buffer.synchronize, its first host check). A fresh Buffer per kind."""
    import moe_ep

    kinds = ("combine", "cached_dispatch", "worst_case_dispatch", "low_latency_dispatch", "low_latency_hook",
             "low_latency_combine", "graph_replay")
    for kind in kinds:
        buf = moe_ep.Buffer(device=device(), hidden=H, num_experts=E, num_topk=K, max_tokens_per_rank=T,
                            backend="nvshmem", low_latency=True, timeout_s=TIMEOUT_S)
        x, idx, w = _inputs(rank, 0)
        res = buf.dispatch(x, idx, w)
        buf.combine(res.x, res.handle)
        d = buf.low_latency_dispatch(x, idx)
        buf.low_latency_combine(d.x, idx, w, d.handle)
        graph = torch.cuda.CUDAGraph()
        if kind == "graph_replay":  # captured on both ranks (capture runs nothing)
            side = torch.cuda.Stream()
            with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
                buf.low_latency_dispatch(x, idx)
        torch.cuda.synchronize()
        dist.barrier()
        calls = {
            "combine": lambda: buf.combine(res.x, res.handle),
            "cached_dispatch": lambda: buf.dispatch(x, handle=res.handle),
            "worst_case_dispatch": lambda: buf.dispatch(x, idx, w, worst_case=True),
            "low_latency_dispatch": lambda: buf.low_latency_dispatch(x, idx),
            "low_latency_hook": lambda: buf.low_latency_dispatch(x, idx, return_recv_hook=True),
            "low_latency_combine": lambda: buf.low_latency_combine(d.x, idx, w, d.handle),
            "graph_replay": lambda: (graph.replay(), buf.synchronize()),
        }
        if rank == 0:
            start = time.monotonic()
            try:
                calls[kind]()
                report(kind, ("none", "", time.monotonic() - start))  # returned: no sync here on purpose
            except Exception as exc:  # noqa: BLE001 - the type is what the parent checks
                report(kind, (type(exc).__name__, str(exc), time.monotonic() - start))
        dist.barrier()  # rank 1 never made the call
        buf.close()


def test_a_call_whose_peer_stays_away_raises_in_the_call() -> None:
    """Every call kind (combine, cached and worst-case dispatch, low latency with and without a hook,
    a CUDA graph's replay at its first host check) raises CommTimeoutError naming the absent peer, from
    the call itself, after the timeout: no call returns as if it had succeeded."""
    seen = _launch(_each_kind_alone, wait_s=300)
    for kind in ("combine", "cached_dispatch", "worst_case_dispatch", "low_latency_dispatch", "low_latency_hook",
                 "low_latency_combine", "graph_replay"):
        name, msg, secs = seen[(0, kind)]
        assert name == "CommTimeoutError" and "waiting for rank 1" in msg, (kind, name, msg)
        assert TIMEOUT_S * 0.9 <= secs < TIMEOUT_S + SLACK_S, (kind, secs)


def _bad_ids(rank: int, report: Callable, scratch: Path) -> None:
    import moe_ep

    native = moe_ep.Buffer(device=device(), hidden=H, num_experts=E, num_topk=K, max_tokens_per_rank=T, backend="nvshmem")
    ref = moe_ep.Buffer(device=device(), hidden=H, num_experts=E, num_topk=K, max_tokens_per_rank=T, backend="reference")
    for step, bad in enumerate((E + 5, -7, (1 << 32) + 3)):
        x, idx, w = _inputs(rank, step)
        x[5, :8] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0] * 2, dtype=torch.bfloat16)
        clean = idx.clone()
        if rank == 1:
            idx[3, 2] = bad
            clean[3, 2] = -1
        kind, msg, _ = _timed(lambda: native.dispatch(x, idx, w))
        report(f"bad{step}", (kind, msg))
        # the Buffer stays usable: a clean call matches the reference backend bit for bit (NaN and Inf
        # pass through dispatch unchanged)
        got, want = native.dispatch(x, clean, w), ref.dispatch(x, clean, w)
        same = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in ((got.x, want.x),)) and \
            torch.equal(got.topk_idx, want.topk_idx) and torch.equal(got.src_index, want.src_index)
        y = torch.randn(got.x.shape, device="cuda").to(torch.bfloat16)
        same = same and torch.equal(native.combine(y, got.handle), ref.combine(y, want.handle))
        report(f"after{step}", same)


def test_bad_expert_ids_raise_in_the_call() -> None:
    seen = _launch(_bad_ids)
    for step, bad in enumerate((E + 5, -7, (1 << 32) + 3)):
        kind, msg = seen[(0, f"bad{step}")]  # rank 0's inputs were fine: it learns of rank 1's from the counts
        assert kind == "PeerInputError" and "rank 1 rejected its input (BadExpertIdError" in msg, msg
        kind, msg = seen[(1, f"bad{step}")]
        assert kind == "BadExpertIdError" and f"topk_idx[3, 2] = {bad}" in msg, msg
        assert seen[(0, f"after{step}")] and seen[(1, f"after{step}")]
