"""low_latency_combine(overlap=True): SGLang's single-batch overlap, where the combine reads local expert
e's rows [j * block_m, (j + 1) * block_m) of x only once the GEMM writing x beside it brought
comp_signal[e * ceil(R*T / block_m) + j] to the threshold, on at most num_sms SMs.

CPU (2 ranks, gloo, reference backend, the oracle): with every signal covering rows at the threshold the
result is the plain combine's bits (with and without the receive hook, and with blocks holding no rows
left unsignalled); a short signal raises ValueError naming the word, the expert and the block on its
rank and PeerInputError on the other; each bad argument raises its message on every rank that passed
it, and the Buffer stays usable.

GPU (2 ranks on one GPU or two, native backend): x starts as NaN everywhere; the combine starts on a side
stream (num_sms=2, with and without the hook), then the caller's stream writes each expert's true rows
and raises its signals, expert by expert in a random order with GPU sleeps between: the result must be
the bits of the plain combine of the true x (a row read before its signal shows as NaN). A signal that
never comes makes the call's rank raise CommTimeoutError naming the phase.

Every kernel the caller's stream runs while the combine waits must have run once before in the process
(_warm_up): CUDA loads a kernel at its first launch (lazy loading, the default) and that load may wait
for the context's running kernels, here the combine, which waits for the signals that kernel raises,
until its timeout; then every row arrives as NaN (the first run, 2026-12-03: NaN on both ranks at the
first iteration, ~100 s, the default timeout; a later run's cold run below: NaN and CommTimeoutError after
its 5 s on both ranks, while every warm run passed). First, with the signals at the threshold and x true
before the launch, the kernel must give the plain combine's bits (its logic with 2 blocks running the G
virtual send blocks, apart from any concurrency); a cold run (before the warm-up, on a Buffer of its own
with a 5 s timeout) prints its duration and result (pytest -s) and is not checked; the last warm
iteration raises the signals on a third stream instead of the caller's (legacy default) stream.
"""
from __future__ import annotations

import time
from typing import Optional

import pytest
import torch
import torch.distributed as dist

import moe_ep
from tests._dist import device, requires_gpus, run_workers
from tests.oracle import random_topk

WORLD = 2
HIDDEN, EXPERTS, TOPK, T = 256, 8, 4, 24  # E_l = 4, R*T = 48 rows per expert
BLOCK_M, THRESHOLD = 8, 3  # 6 signal words per expert


def _words(block_m: int = BLOCK_M) -> int:
    """Signal words per local expert: ceil(R*T / block_m)."""
    return -(-WORLD * T // block_m)


def _setup(buf: moe_ep.Buffer, rank: int, dev: torch.device) -> tuple:
    """A dispatch of T tokens (random routing), expert outputs y for it and the plain combine of y."""
    g = torch.Generator(device=dev.type).manual_seed(7 + rank)
    x = torch.randn(T, HIDDEN, generator=g, device=dev).to(torch.bfloat16)
    idx = random_topk("random", T, EXPERTS, TOPK, g, device=dev.type)
    w = torch.rand(T, TOPK, generator=g, device=dev)
    disp = buf.low_latency_dispatch(x, idx)
    e_l = EXPERTS // WORLD
    y = (torch.randn(e_l, WORLD * T, HIDDEN, generator=g, device=dev) * 3).to(torch.bfloat16)
    plain = buf.low_latency_combine(y, idx, w, disp.handle).x
    return disp, idx, w, y, plain


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def _differences(got: torch.Tensor, want: torch.Tensor) -> str:
    """What differs, for the failure message: NaN tokens (rows read before their signal) and other tokens."""
    differs = (got.view(torch.int16) != want.view(torch.int16)).any(dim=1)
    nan = torch.isnan(got.float()).any(dim=1)
    return (f"{int(differs.sum())} of {got.shape[0]} tokens differ: NaN in {nan.nonzero().flatten().tolist()}, "
            f"other values in {(differs & ~nan).nonzero().flatten().tolist()}")


def _cpu_worker(rank: int, world: int) -> None:
    dev = device()
    with moe_ep.Buffer(dist.group.WORLD, hidden=HIDDEN, num_experts=EXPERTS, num_topk=TOPK, max_tokens_per_rank=T,
                       low_latency=True, backend="reference") as buf:
        disp, idx, w, y, plain = _setup(buf, rank, dev)
        count, e_l = disp.count, EXPERTS // WORLD
        signal = torch.full((e_l * _words() + 5,), THRESHOLD, dtype=torch.int32, device=dev)
        overlap = dict(overlap=True, packed_recv_count=count, comp_signal=signal, block_m=BLOCK_M,
                       threshold=THRESHOLD, num_sms=3)
        for hook in (False, True):
            got = buf.low_latency_combine(y, idx, w, disp.handle, return_recv_hook=hook, **overlap)
            if hook:
                got.hook()
            assert _same(got.x, plain), f"hook={hook}"
        # blocks without rows are never waited for
        view = signal[: e_l * _words()].view(e_l, _words())
        for e in range(e_l):
            view[e, -(-int(count[e]) // BLOCK_M):] = 0
        assert _same(buf.low_latency_combine(y, idx, w, disp.handle, **overlap).x, plain)
        # a short signal on rank 0: the last block holding rows of its first expert that has rows
        view.fill_(THRESHOLD)
        e = next(e for e in range(e_l) if int(count[e]) > 0) if rank == 0 else None
        if e is not None:
            j = (int(count[e]) - 1) // BLOCK_M
            view[e, j] = THRESHOLD - 1
            with pytest.raises(ValueError, match=rf"comp_signal\[{e * _words() + j}\] = {THRESHOLD - 1} is below "
                                                 rf"threshold {THRESHOLD}: local expert {e}, block {j} "):
                buf.low_latency_combine(y, idx, w, disp.handle, **overlap)
        else:
            with pytest.raises(moe_ep.PeerInputError, match=r"rank 0 rejected its input \(ValueError: comp_signal"):
                buf.low_latency_combine(y, idx, w, disp.handle, **overlap)
        view.fill_(THRESHOLD)
        bad = [
            (ValueError, r"^block_m, threshold apply only with overlap=True", dict(block_m=8, threshold=1)),
            (ValueError, r"^overlap=True needs comp_signal$", {**overlap, "comp_signal": None}),
            (ValueError, r"^threshold must be a positive int, got 0$", {**overlap, "threshold": 0}),
            (ValueError, r"^num_sms must be a positive int, got -1$", {**overlap, "num_sms": -1}),
            (ValueError, r"^block_m must be a positive int, got True$", {**overlap, "block_m": True}),
            (ValueError, rf"^comp_signal must have shape \[\*\] with at least .* = {e_l * _words(4)} words, got",
             {**overlap, "block_m": 4}),
            (TypeError, r"^comp_signal must have dtype torch.int32", {**overlap, "comp_signal": signal.long()}),
            (ValueError, r"^comp_signal must have shape \[\*\]", {**overlap, "comp_signal": view}),
            (ValueError, rf"^packed_recv_count must have shape \[{e_l}\]", {**overlap, "packed_recv_count": count[:1]}),
        ]
        for error, message, kwargs in bad:
            with pytest.raises(error, match=message):
                buf.low_latency_combine(y, idx, w, disp.handle, **kwargs)
        assert _same(buf.low_latency_combine(y, idx, w, disp.handle, **overlap).x, plain)  # still usable


def test_overlap_combine_reference() -> None:
    run_workers(WORLD, _cpu_worker)


def _raise_signals(y: torch.Tensor, signal: torch.Tensor, bump: torch.Tensor, y_true: torch.Tensor,
                   order: list[int]) -> None:
    """The GEMM's part, on the current stream: expert by expert in `order` (GPU sleeps between) the true
    rows, then their signal words brought up in two adds as a GEMM's blocks would."""
    words = _words()
    for e in order:
        torch.cuda._sleep(2_000_000)
        y[e].copy_(y_true[e])
        part = slice(e * words, (e + 1) * words)
        signal[part] += bump[part]
        signal[part] += bump[part] * (THRESHOLD - 1)


def _gemm_tensors(y_true: torch.Tensor, skip: int = -1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the GEMM part writes and adds: y (NaN until written), the signal words (0) and the per-word
    increment (1; word `skip` 0, so it never reaches the threshold)."""
    words = EXPERTS // WORLD * _words()
    bump = torch.ones(words, dtype=torch.int32, device=y_true.device)
    if skip >= 0:
        bump[skip] = 0
    return torch.full_like(y_true, float("nan")), torch.zeros_like(bump), bump


def _warm_up(y_true: torch.Tensor) -> None:
    """Runs every kernel of _overlapped's GEMM part once, on tensors shaped (and so aligned) as there, for
    every expert: each is then loaded before a combine waits for it (the module docstring)."""
    y, signal, bump = _gemm_tensors(y_true)
    _raise_signals(y, signal, bump, y_true, list(range(EXPERTS // WORLD)))
    torch.cuda.synchronize()


def _overlapped(buf: moe_ep.Buffer, disp, idx: torch.Tensor, w: torch.Tensor, y_true: torch.Tensor, hook: bool,
                order: list[int], skip: int = -1, writer: Optional[torch.cuda.Stream] = None,
                presignalled: bool = False) -> moe_ep.LowLatencyCombineResult:
    """The combine on a side stream over NaN rows, then expert by expert in `order` (GPU sleeps between)
    the true rows and their signals on the caller's stream (or on `writer`), brought up in two adds as a
    GEMM's blocks would; word `skip` of the signal stays 0. presignalled: the true rows and every signal
    word at the threshold before the combine launches (no concurrency needed). With the hook, the send
    halves of both ranks are done (device sync, then a group barrier) before it runs. Returns once every
    stream is done."""
    y, signal, bump = _gemm_tensors(y_true, skip)
    if presignalled:
        y.copy_(y_true)
        signal.fill_(THRESHOLD)
    caller, side = torch.cuda.current_stream(), torch.cuda.Stream()
    side.wait_stream(caller)
    with torch.cuda.stream(side):
        got = buf.low_latency_combine(y, idx, w, disp.handle, return_recv_hook=hook, overlap=True,
                                      packed_recv_count=disp.count, comp_signal=signal, block_m=BLOCK_M,
                                      threshold=THRESHOLD, num_sms=2)
    if not presignalled:
        if writer is None:
            _raise_signals(y, signal, bump, y_true, order)
        else:
            writer.wait_stream(caller)
            with torch.cuda.stream(writer):
                _raise_signals(y, signal, bump, y_true, order)
            caller.wait_stream(writer)
    if hook:
        torch.cuda.synchronize()
        dist.barrier()
        with torch.cuda.stream(side):  # the hook's receive half runs on the call's stream
            got.hook()
    caller.wait_stream(side)
    torch.cuda.synchronize()
    return got


def _gpu_worker(rank: int, world: int) -> None:
    dev = device()
    kwargs = dict(hidden=HIDDEN, num_experts=EXPERTS, num_topk=TOPK, max_tokens_per_rank=T, low_latency=True,
                  backend="nvshmem")
    g = torch.Generator().manual_seed(11 + rank)
    # timeout_s: a wait that never ends (e.g. the GEMM's stream held behind the combine) shows in 20 s, as
    # NaN tokens after about that long
    with moe_ep.Buffer(dist.group.WORLD, device=dev, timeout_s=20.0, **kwargs) as buf:
        for hook in (False, True):  # the kernel's logic alone: everything signalled before the launch
            disp, idx, w, y_true, plain = _setup(buf, rank, dev)
            got = _overlapped(buf, disp, idx, w, y_true, hook=hook, order=[], presignalled=True)
            assert _same(got.x, plain), f"presignalled, hook={hook}: {_differences(got.x, plain)}"
    with moe_ep.Buffer(dist.group.WORLD, device=dev, timeout_s=5.0, **kwargs) as buf:
        # a cold run: the GEMM part's kernels are launched for the first time while the combine waits
        disp, idx, w, y_true, plain = _setup(buf, rank, dev)
        began = time.monotonic()
        got = _overlapped(buf, disp, idx, w, y_true, hook=False, order=list(range(EXPERTS // WORLD)))
        cold = f"rank {rank}: cold overlapped run took {time.monotonic() - began:.1f} s: {_differences(got.x, plain)}"
        try:
            buf.low_latency_combine(y_true, idx, w, disp.handle)  # raises here if the cold run timed out
            torch.cuda.synchronize()
        except moe_ep.CommTimeoutError as error:
            cold += f"; then {type(error).__name__}: {error}"
        print(cold, flush=True)
    _warm_up(y_true)  # already warm after the cold run; kept so that the runs below never depend on it
    with moe_ep.Buffer(dist.group.WORLD, device=dev, timeout_s=20.0, **kwargs) as buf:
        third = torch.cuda.Stream()
        for it in range(5):
            disp, idx, w, y_true, plain = _setup(buf, rank, dev)
            order = torch.randperm(EXPERTS // WORLD, generator=g).tolist()
            writer = third if it == 4 else None  # the last: the signals on a third stream, not the default one
            began = time.monotonic()
            got = _overlapped(buf, disp, idx, w, y_true, hook=it % 2 == 1, order=order, writer=writer)
            took = time.monotonic() - began
            assert _same(got.x, plain), (f"it={it} order={order} writer={'third' if writer else 'caller'}, "
                                         f"{took:.1f} s ({cold}): {_differences(got.x, plain)}")
    with moe_ep.Buffer(dist.group.WORLD, device=dev, timeout_s=1.0, **kwargs) as buf:
        disp, idx, w, y_true, _ = _setup(buf, rank, dev)
        torch.cuda.synchronize()
        e = next(e for e in range(EXPERTS // WORLD) if int(disp.count[e]) > 0)
        skip = e * _words() if rank == 0 else -1  # rank 0's first block with rows is never signalled
        order = list(range(EXPERTS // WORLD))
        if rank == 0:
            with pytest.raises(moe_ep.CommTimeoutError, match="waiting for this rank's GEMM to signal comp_signal") \
                    as info:
                _overlapped(buf, disp, idx, w, y_true, hook=True, order=order, skip=skip)
            assert info.value.rank == 0, str(info.value)
        else:
            _overlapped(buf, disp, idx, w, y_true, hook=True, order=order)


@requires_gpus()
def test_overlap_combine_native() -> None:
    """2 ranks (sharing one GPU where there is one), native backend."""
    run_workers(WORLD, _gpu_worker, backend="gpu", timeout_s=600)
