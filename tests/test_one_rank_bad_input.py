"""Misuse on one rank leaves the group in step (docs/api.md, Errors). One rank passes bad input to a
call: that rank raises its own error and, where the call checks its stamps (moe_ep.comm.call_check:
every call on the reference backend, fresh dispatches on the native one, every call of a native
Buffer with check_calls=True), every other rank raises PeerInputError naming it; elsewhere the other ranks' results are right against brute force (the bad
rank counting as its stand-in: no tokens, zero rows, or its bad expert ids as -1). Every rank's next
calls are right. Ranks that make different calls raise CallMismatchError on every rank, naming each
rank's call, and the Buffer stays usable. Buffer arguments that differ between ranks raise on every
rank. On the reference backend, a call that a peer skips altogether raises CommTimeoutError within
timeout_s plus a bound."""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

import moe_ep
from moe_ep.comm import fp8
from moe_ep.comm.errors import CallMismatchError, CommTimeoutError, PeerInputError
from tests._dist import device, requires_gpus, run_workers
from tests.oracle import (
    Inputs,
    assert_same_bits,
    expected_combine,
    expected_combine_weights,
    expected_dispatch,
    expected_layout,
    expected_low_latency_combine,
    expected_low_latency_dispatch,
    local_weights,
    make_inputs,
)
from tests.test_validation import misaligned

H, K, T = 256, 4, 24
IDS = r"must lie in \[-1, \d+\)"  # the reference backend's message and the native kernels' both say it
Args = dict[str, Any]


@dataclass(frozen=True)
class Case:
    """One kind of bad input to one call. effect: what the peers get from the bad rank, "none" (no
    tokens, or zero rows where a handle fixes the rows), "ids" (its ids outside [-1, E) as -1) or
    "same" (what it would have sent anyway)."""

    call: str
    name: str
    spoil: Callable[[Args, int], Args]  # (the bad rank's arguments, E) -> what it passes instead
    error: type
    match: str
    effect: str = "none"
    native: bool = True  # False: the native kernels report this only later (no host sync in the call)


def _put(key: str, value: Callable[[Any, int], Any]) -> Callable[[Args, int], Args]:
    return lambda args, e: {**args, key: value(args[key], e)}


def _high_id(idx: torch.Tensor, e: int) -> torch.Tensor:
    out = idx.clone()
    out[1, K - 1] = e
    return out


def _minus_two(idx: torch.Tensor, e: int) -> torch.Tensor:
    out = idx.clone()
    out[0, 1] = -2
    return out


def _grow(args: Args, e: int) -> Args:
    """T + 1 tokens (the first ones repeated)."""
    rows = torch.arange(T + 1) % args["x"].shape[0]
    return {**args, **{k: args[k][rows.to(args[k].device)].contiguous() for k in ("x", "topk_idx", "topk_weights")
                       if isinstance(args.get(k), torch.Tensor)}}


def _elsewhere(t: torch.Tensor) -> torch.Tensor:
    """t on a device the Buffer does not use."""
    return t.to("meta" if t.device.type == "cpu" else "cpu")


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values, not contiguous."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    wide[..., ::2] = t
    return wide[..., ::2]


CASES = [
    Case("dispatch", "expert id E", _put("topk_idx", _high_id), ValueError, IDS, "ids"),
    Case("dispatch", "expert id -2", _put("topk_idx", _minus_two), ValueError, IDS, "ids"),
    Case("dispatch", "x float32", _put("x", lambda x, e: x.float()), TypeError, "x must have dtype"),
    Case("dispatch", "topk_idx int32", _put("topk_idx", lambda t, e: t.int()), TypeError, "topk_idx must have dtype"),
    Case("dispatch", "topk_weights float64", _put("topk_weights", lambda t, e: t.double()), TypeError,
         "topk_weights must have dtype"),
    Case("dispatch", "x of another hidden", _put("x", lambda x, e: x[:, : H // 2].contiguous()), ValueError,
         r"x must have shape \[\*, 256\]"),
    Case("dispatch", "topk_idx of fewer tokens", _put("topk_idx", lambda t, e: t[:-1]), ValueError,
         "topk_idx must have shape"),
    Case("dispatch", "x not contiguous", _put("x", lambda x, e: _strided(x)), ValueError, "x must be contiguous"),
    Case("dispatch", "topk_weights misaligned", _put("topk_weights", lambda t, e: misaligned(t)), ValueError,
         "topk_weights must start at a 16-byte aligned address"),
    Case("dispatch", "x on another device", _put("x", lambda x, e: _elsewhere(x)), ValueError, "x must be on"),
    Case("dispatch", "topk_idx a list", _put("topk_idx", lambda t, e: t.tolist()), TypeError,
         "topk_idx must be a torch.Tensor"),
    Case("dispatch", "no topk_weights", _put("topk_weights", lambda t, e: None), ValueError,
         "dispatch needs topk_idx and topk_weights"),
    Case("dispatch", "expert_alignment 0", lambda a, e: {**a, "expert_alignment": 0}, ValueError,
         "expert_alignment must be a positive int"),
    Case("dispatch", "x_scales with bf16 x", lambda a, e: {**a, "x_scales": torch.ones(a["x"].shape[0], H // 128,
                                                                                      device=a["x"].device)},
         ValueError, "x_scales is only for FP8"),
    Case("fp8_dispatch", "FP8 without scales", _put("x_scales", lambda s, e: None), ValueError, "needs x_scales"),
    Case("fp8_dispatch", "scales of another shape", _put("x_scales", lambda s, e: s[:, :1].contiguous()), ValueError,
         r"x_scales must have shape"),
    Case("fp8_dispatch", "FP8 expert id E", _put("topk_idx", _high_id), ValueError, IDS, "ids"),
    Case("cached", "x float32", _put("x", lambda x, e: x.float()), TypeError, "x must have dtype"),
    Case("cached", "x of fewer tokens", _put("x", lambda x, e: x[:-1]), ValueError, "but the handle was made for"),
    Case("cached", "topk_idx as well", lambda a, e: {**a, "topk_idx": torch.zeros(1)}, ValueError,
         "takes no topk_idx"),
    Case("combine", "x float32", _put("x", lambda x, e: x.float()), TypeError, "x must have dtype"),
    Case("combine", "x of another row count", _put("x", lambda x, e: torch.cat([x, x[:1]])), ValueError,
         "x must have shape"),
    Case("combine", "x not contiguous", _put("x", lambda x, e: _strided(x)), ValueError, "x must be contiguous"),
    Case("combine", "x on another device", _put("x", lambda x, e: _elsewhere(x)), ValueError, "x must be on"),
    Case("combine_weights", "topk_weights float64", _put("topk_weights", lambda t, e: t.double()), TypeError,
         "topk_weights must have dtype"),
    Case("combine_weights", "x misaligned", _put("x", lambda x, e: misaligned(x)), ValueError,
         "x must start at a 16-byte aligned address"),
    Case("layout", "expert id E", _put("topk_idx", _high_id), ValueError, IDS, native=False),
    Case("layout", "topk_idx int32", _put("topk_idx", lambda t, e: t.int()), TypeError, "topk_idx must have dtype"),
    Case("ll_dispatch", "expert id E", _put("topk_idx", _high_id), ValueError, IDS, "ids", native=False),
    Case("ll_dispatch", "x float32", _put("x", lambda x, e: x.float()), TypeError, "x must have dtype"),
    Case("ll_dispatch", "too many tokens", _grow, ValueError, f"above max_tokens_per_rank={T}"),
    Case("ll_dispatch", "topk_idx of fewer tokens", _put("topk_idx", lambda t, e: t[:-1]), ValueError,
         "topk_idx must have shape"),
    Case("ll_dispatch", "round_scale without FP8", lambda a, e: {**a, "round_scale": True}, ValueError,
         "round_scale applies only"),
    Case("ll_hook", "x float32", _put("x", lambda x, e: x.float()), TypeError, "x must have dtype"),
    Case("ll_hook", "expert id -2", _put("topk_idx", _minus_two), ValueError, IDS, "ids", native=False),
    Case("ll_combine", "x of another shape", _put("x", lambda x, e: x[:, :-1].contiguous()), ValueError,
         "x must have shape"),
    Case("ll_combine", "topk_idx int32", _put("topk_idx", lambda t, e: t.int()), TypeError,
         "topk_idx must have dtype"),
    Case("ll_combine", "topk_weights on another device", _put("topk_weights", lambda t, e: _elsewhere(t)), ValueError,
         "topk_weights must be on"),
    Case("ll_combine", "expert id E", _put("topk_idx", _high_id), ValueError, IDS, "same", native=False),
]


def _inputs(seed: int, world: int, e: int) -> Inputs:
    """Fresh routing where every rank's token 0 visits every rank, so every rank receives rows."""
    g = torch.Generator().manual_seed(seed)
    tokens = [int(n) for n in torch.randint(3, T + 1, (world,), generator=g)]
    inp = make_inputs(seed, tokens, H, e, K)
    e_l = e // world
    for s, idx in enumerate(inp.topk_idx):
        idx[0, :world] = torch.arange(world) * e_l + s % e_l
    return inp


def _quantized(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 rows and scales of x on the CPU (also of no rows)."""
    return fp8.quantize(x) if x.shape[0] else (x.to(torch.float8_e4m3fn), torch.empty(0, x.shape[1] // 128))


def _zero_from(bad: int, rank: int, row: torch.Tensor) -> torch.Tensor:
    """row, or zeros where the bad rank sent its stand-in."""
    return torch.zeros_like(row) if rank == bad else row


def _mask_ids(idx: torch.Tensor, e: int) -> torch.Tensor:
    return torch.where((idx >= -1) & (idx < e), idx, -1)


def _as_peers_see(inp: Inputs, bad: int, effect: str, spoiled: Args, e: int) -> Inputs:
    """Every rank's inputs as the call exchanged them, with the bad rank's stand-in."""
    x, idx, w = list(inp.x), list(inp.topk_idx), list(inp.topk_weights)
    if effect == "ids":
        idx[bad] = _mask_ids(spoiled["topk_idx"].cpu(), e)
    elif effect == "none":
        x[bad], idx[bad], w[bad] = x[bad][:0], idx[bad][:0], w[bad][:0]
    return Inputs(x, idx, w)


def _on(dev: torch.device, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(dev) for t in ts)


def _check_dispatch(got: moe_ep.DispatchResult, inp: Inputs, me: int, world: int, e: int,
                    scales: list[torch.Tensor] | None = None) -> None:
    want = expected_dispatch(inp, me, world, e, scales=scales)
    assert_same_bits(got.x.cpu(), want.x, "dispatch x")
    assert_same_bits(None if got.x_scales is None else got.x_scales.cpu(), want.scales, "dispatch x_scales")
    assert_same_bits(got.topk_idx.cpu(), want.topk_idx, "dispatch topk_idx")
    assert_same_bits(got.topk_weights.cpu(), want.topk_weights, "dispatch topk_weights")
    assert (got.src_rank.tolist(), got.src_index.tolist()) == (want.src_rank, want.src_index)
    assert got.tokens_per_expert == want.tokens_per_expert


def _returned(x: torch.Tensor, r: int) -> torch.Tensor:
    """What rank r's experts return for a row x (bf16): an exact function of the row and the rank."""
    return (x.float() * (r + 1) + 0.5).to(torch.bfloat16)


def _check_ll_dispatch(got: moe_ep.LowLatencyDispatchResult, inp: Inputs, me: int, world: int, e: int) -> None:
    want = expected_low_latency_dispatch(inp, me, world, e, False, False)
    for local in range(e // world):
        c = int(got.count[local])
        assert c == len(want.rows[local]), f"expert {local}: {c} rows, want {len(want.rows[local])}"
        if c:
            assert_same_bits(got.x[local, :c].cpu(), torch.stack(want.rows[local]), f"expert {local} rows")
        src = list(zip(got.handle.src_rank[local, :c].tolist(), got.handle.src_index[local, :c].tolist()))
        assert src == want.src[local]


def _ll_outputs(got: moe_ep.LowLatencyDispatchResult, me: int, e_l: int) -> torch.Tensor:
    """Each local expert's output rows: _returned with the global expert id as the rank."""
    factors = (torch.arange(e_l, device=got.x.device) + me * e_l + 1).float().view(-1, 1, 1)
    return (got.x.float() * factors + 0.5).to(torch.bfloat16)


def _normal_round(buf: moe_ep.Buffer, inp: Inputs, me: int, world: int, e: int, dev: torch.device) -> None:
    """A good dispatch and combine on every rank, checked against brute force."""
    got = buf.dispatch(*_on(dev, inp.x[me], inp.topk_idx[me], inp.topk_weights[me]))
    _check_dispatch(got, inp, me, world, e)
    out = buf.combine(_returned(got.x, me), got.handle)
    want = expected_combine(inp, me, world, e, lambda r, s, i: _returned(inp.x[s][i], r))
    assert_same_bits(out.cpu(), want, "combine of the next round")


def _ll_round(buf: moe_ep.Buffer, inp: Inputs, me: int, world: int, e: int, dev: torch.device) -> None:
    """A good low-latency dispatch and combine on every rank, checked against brute force."""
    x, idx, w = _on(dev, inp.x[me], inp.topk_idx[me], inp.topk_weights[me])
    got = buf.low_latency_dispatch(x, idx)
    _check_ll_dispatch(got, inp, me, world, e)
    out = buf.low_latency_combine(_ll_outputs(got, me, e // world), idx, w, got.handle).x
    want = expected_low_latency_combine(inp, me, world, e, lambda ex, s, n, k: _returned(inp.x[s][n], ex))
    assert_same_bits(out.cpu(), want, "low-latency combine of the next round")


def _expect(case: Case, call: Callable[[], Any]) -> None:
    with pytest.raises(case.error, match=case.match):
        call()


def _expect_peer(case: Case, bad: int, call: Callable[[], Any]) -> None:
    """A peer of the bad rank raises PeerInputError naming the bad rank and its error's class."""
    with pytest.raises(PeerInputError, match=f"rank {bad} rejected its input") as raised:
        call()
    kind = "BadExpertIdError" if case.match == IDS else case.error.__name__
    assert raised.value.ranks == [bad] and raised.value.reasons[0].startswith(kind), str(raised.value)


def _collective(case: Case, backend: str, check_calls: bool) -> bool:
    """Whether the call of `case` checks its stamps (docs/api.md, Errors): every communicating call on
    the reference backend; on the native one the fresh dispatches outside worst-case mode (the host
    reads their counts), and every call with check_calls=True (the others meet on the host first).
    get_dispatch_layout communicates nothing, so its errors stay local."""
    if case.call == "layout":
        return False
    return backend == "reference" or check_calls or case.call in ("dispatch", "fp8_dispatch")


def _run_case(buf: moe_ep.Buffer, case: Case, inp: Inputs, me: int, world: int, bad: int, e: int,
              dev: torch.device, collective: bool) -> None:
    """The call of `case` with the bad rank's arguments spoiled; the peers raise PeerInputError where the
    call is `collective`, else their results are checked against brute force."""
    e_l = e // world
    mine = _on(dev, inp.x[me], inp.topk_idx[me], inp.topk_weights[me])
    bad_args = _on(dev, inp.x[bad], inp.topk_idx[bad], inp.topk_weights[bad])
    if case.call in ("dispatch", "fp8_dispatch", "layout", "ll_dispatch", "ll_hook"):
        def args_of(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> Args:
            if case.call == "layout":
                return {"topk_idx": idx}
            if case.call.startswith("ll"):
                return {"x": x, "topk_idx": idx, "return_recv_hook": case.call == "ll_hook"}
            if case.call == "fp8_dispatch":
                q, s = _on(x.device, *_quantized(x.cpu()))
                return {"x": q, "topk_idx": idx, "topk_weights": w, "x_scales": s}
            return {"x": x, "topk_idx": idx, "topk_weights": w}

        spoiled = case.spoil(args_of(*bad_args), e)
        seen = _as_peers_see(inp, bad, case.effect, spoiled, e)
        if case.call == "layout":
            if me == bad:
                _expect(case, lambda: buf.get_dispatch_layout(**spoiled))
            else:
                got = buf.get_dispatch_layout(mine[1])
                per_rank, per_expert, in_rank = expected_layout(inp, me, world, e)
                assert_same_bits(got.num_tokens_per_rank.cpu(), per_rank, "num_tokens_per_rank")
                assert_same_bits(got.num_tokens_per_expert.cpu(), per_expert, "num_tokens_per_expert")
                assert_same_bits(got.is_token_in_rank.cpu(), in_rank, "is_token_in_rank")
        elif case.call.startswith("ll"):
            hook = case.call == "ll_hook"

            def received(args: Args) -> moe_ep.LowLatencyDispatchResult:
                """The call, and its hook when it has one (either may raise: the hook on the reference
                backend, the call where the stamps meet on the host first)."""
                got = buf.low_latency_dispatch(**args)
                if hook:
                    got.hook()
                return got

            if me == bad:
                _expect(case, lambda: received(spoiled))
            elif collective:
                _expect_peer(case, bad, lambda: received(args_of(*mine)))
            else:
                _check_ll_dispatch(received(args_of(*mine)), seen, me, world, e)
        else:
            if me == bad:
                _expect(case, lambda: buf.dispatch(**spoiled))
            elif collective:
                _expect_peer(case, bad, lambda: buf.dispatch(**args_of(*mine)))
            else:
                got = buf.dispatch(**args_of(*mine))
                quantized = [_quantized(t) for t in seen.x] if case.call == "fp8_dispatch" else None
                if quantized is not None:
                    seen = Inputs([q for q, _ in quantized], seen.topk_idx, seen.topk_weights)
                _check_dispatch(got, seen, me, world, e, scales=None if quantized is None else
                                [s for _, s in quantized])
        return

    if case.call.startswith("ll"):  # ll_combine
        got = buf.low_latency_dispatch(mine[0], mine[1])
        _check_ll_dispatch(got, inp, me, world, e)
        args = {"x": _ll_outputs(got, me, e_l), "topk_idx": mine[1], "topk_weights": mine[2], "handle": got.handle}
        if me == bad:
            _expect(case, lambda: buf.low_latency_combine(**case.spoil(args, e)))
            return
        if collective:
            _expect_peer(case, bad, lambda: buf.low_latency_combine(**args))
            return
        out = buf.low_latency_combine(**args).x
        sender = bad if case.effect == "none" else -1
        want = expected_low_latency_combine(
            inp, me, world, e, lambda ex, s, n, k: _zero_from(sender, ex // e_l, _returned(inp.x[s][n], ex)))
        assert_same_bits(out.cpu(), want, "low-latency combine")
        return

    got = buf.dispatch(*mine)
    _check_dispatch(got, inp, me, world, e)
    if case.call == "cached":
        grads = [(torch.randn(t.shape, generator=torch.Generator().manual_seed(s)) * 3).to(torch.bfloat16)
                 for s, t in enumerate(inp.x)]
        args: Args = {"x": grads[me].to(dev), "handle": got.handle}
        if me == bad:
            _expect(case, lambda: buf.dispatch(**case.spoil(args, e)))
            return
        if collective:
            _expect_peer(case, bad, lambda: buf.dispatch(**args))
            return
        cached = buf.dispatch(**args)
        grads[bad] = torch.zeros_like(grads[bad])
        want = expected_dispatch(Inputs(grads, inp.topk_idx, inp.topk_weights), me, world, e)
        assert_same_bits(cached.x.cpu(), want.x, "cached dispatch x")
        return
    weights = case.call == "combine_weights"
    args = {"x": _returned(got.x, me), "handle": got.handle}
    if weights:
        args["topk_weights"] = got.topk_weights * (me + 1)
    if me == bad:
        _expect(case, lambda: buf.combine(**case.spoil(args, e)))
        return
    if collective:
        _expect_peer(case, bad, lambda: buf.combine(**args))
        return
    out = buf.combine(**args)
    out, out_w = out if weights else (out, None)
    want = expected_combine(inp, me, world, e, lambda r, s, i: _zero_from(bad, r, _returned(inp.x[s][i], r)))
    assert_same_bits(out.cpu(), want, "combine")
    if weights:
        want_w = expected_combine_weights(
            inp, me, world, e, lambda r, s, i: _zero_from(bad, r, local_weights(inp, r, s, i, e, world) * (r + 1)))
        assert_same_bits(out_w.cpu(), want_w, "combined weights")


def _mismatched(rank: int, world: int, backend: str, dev: torch.device) -> None:
    """Buffer arguments that differ between ranks, or that one rank rejects: every rank raises, naming
    the field and each rank's value (or the rank that rejected its own); then a good Buffer works."""
    e, last = 4 * world, world - 1
    base = dict(hidden=H, num_experts=e, num_topk=K, max_tokens_per_rank=T, backend=backend, device=dev)
    differ = [
        ("num_experts", 2 * e), ("max_tokens_per_rank", T + 1), ("hidden", 128), ("num_topk", K - 1),
        ("low_latency", True), ("timeout_s", 50.0), ("num_sms", 20), ("ranks_per_node", 1), ("check_calls", True),
    ]
    # as every rank resolves what it does not pass
    resolved = {**base, "low_latency": False, "timeout_s": 100.0, "num_sms": 24, "ranks_per_node": world,
                "check_calls": False}
    for field, value in differ:
        kw = {**base, field: value} if rank == last else base
        values = ", ".join(f"{value if r == last else resolved[field]!r} on rank {r}" for r in range(world))
        with pytest.raises(ValueError, match=f"the same {field}; got {re.escape(values)}$"):
            moe_ep.Buffer(**kw)
    with pytest.raises(ValueError) as raised:  # the rank's own error; the others name it
        moe_ep.Buffer(**{**base, "hidden": 100} if rank == last else base)
    want = "hidden must be a multiple of 8" if rank == last else f"rank {last} rejected its Buffer arguments"
    assert want in str(raised.value)
    alone, reference = dist.new_group([0]), {**base, "backend": "reference"}  # NVSHMEM wants every rank
    if rank == 0:
        with moe_ep.Buffer(alone, **reference) as buf:
            assert buf.group_size == 1
    else:
        with pytest.raises(ValueError, match=r"not a member of the Buffer's group"):
            moe_ep.Buffer(alone, **reference)


def _expect_mismatch(call: Callable[[], Any], *calls: str) -> None:
    """Raises CallMismatchError naming every rank's call (regexes, in rank order), not a timeout."""
    want = ", ".join(f"rank {r}: {c}" for r, c in enumerate(calls))
    with pytest.raises(CallMismatchError, match=want):
        call()


def _call_mismatches(buf: moe_ep.Buffer, me: int, world: int, e: int, dev: torch.device, in_band: bool) -> None:
    """The last rank makes another call than its peers (skips a combine; a normal dispatch against a
    low-latency one; FP8 rows against bf16; the combine of another dispatch): every rank raises
    CallMismatchError naming each rank's call, and a clean round after it is right. in_band (native
    backend without check_calls): only fresh dispatches compare stamps, so only the FP8 one
    (exact-size outputs, so the dispatch kernel writes no more rows than each rank's counts say)."""
    last, n = world - 1, r"#(\d+)"
    for i, scenario in enumerate(["fp8"] if in_band else ["skip combine", "low latency", "fp8", "other handle"]):
        inp = _inputs(5000 + 10 * world + i, world, e)
        x, idx, w = _on(dev, inp.x[me], inp.topk_idx[me], inp.topk_weights[me])
        q, scales = _on(dev, *_quantized(inp.x[me]))
        if scenario == "skip combine":
            got = buf.dispatch(x, idx, w)
            call = (lambda: buf.dispatch(x, idx, w)) if me == last else (lambda: buf.combine(got.x, got.handle))
            calls = [rf"combine {n} \(handle of call {n}\)"] * last + [f"dispatch {n}"]
        elif scenario == "low latency":
            call = (lambda: buf.dispatch(x, idx, w)) if me == last else (lambda: buf.low_latency_dispatch(x, idx))
            calls = [f"low-latency dispatch {n}"] * last + [f"dispatch {n}"]
        elif scenario == "fp8":
            exact = moe_ep.Config(eager_output_bytes=0)
            call = ((lambda: buf.dispatch(q, idx, w, x_scales=scales, config=exact)) if me == last
                    else (lambda: buf.dispatch(x, idx, w, config=exact)))
            calls = [f"dispatch {n}"] * last + [rf"dispatch {n} \(FP8 rows\)"]
        else:
            first, second = buf.dispatch(x, idx, w), buf.dispatch(x, idx, w)
            got = second if me == last else first
            call = lambda: buf.combine(got.x, got.handle)  # noqa: E731
            calls = [rf"combine {n} \(handle of call #{first.handle.call}\)"] * last + [
                rf"combine {n} \(handle of call #{second.handle.call}\)"]
        try:
            _expect_mismatch(call, *calls)
            _normal_round(buf, _inputs(6000 + 10 * world + i, world, e), me, world, e, dev)
        except AssertionError as error:
            raise AssertionError(f"call mismatch / {scenario}, rank {me}: {error}") from error


def _bad_input_worker(rank: int, world: int, backend: str, check_calls: bool = False) -> None:
    dev = device()
    if not check_calls:
        _mismatched(rank, world, backend, dev)
    e = 4 * world
    native = backend == "nvshmem"
    with moe_ep.Buffer(hidden=H, num_experts=e, num_topk=K, max_tokens_per_rank=T, backend=backend,
                       low_latency=True, check_calls=check_calls, device=dev) as buf:
        for i, case in enumerate(CASES):
            if native and not case.native:
                continue
            bad, seed = i % world, 100 * world + i
            try:  # every rank catches its error (pytest.raises) and goes on, as a training loop would
                _run_case(buf, case, _inputs(seed, world, e), rank, world, bad, e, dev,
                          _collective(case, backend, check_calls))
                _normal_round(buf, _inputs(seed + 5000, world, e), rank, world, e, dev)
                if case.call.startswith("ll"):
                    _ll_round(buf, _inputs(seed + 9000, world, e), rank, world, e, dev)
            except AssertionError as error:
                raise AssertionError(f"{case.call} / {case.name} (bad rank {bad}), rank {rank}: {error}") from error
        _call_mismatches(buf, rank, world, e, dev, native and not check_calls)


@pytest.mark.parametrize("world", [2, 3])
def test_one_rank_bad_input_reference(world: int) -> None:
    run_workers(world, _bad_input_worker, "reference", timeout_s=300)


@requires_gpus()
@pytest.mark.parametrize("check_calls", [False, True])
def test_one_rank_bad_input_native(check_calls: bool) -> None:
    run_workers(2, _bad_input_worker, "nvshmem", check_calls, backend="gpu", timeout_s=300)


TIMEOUT_S = 2.0
SKIPS = [("dispatch", "reference dispatch header"), ("combine", "reference combine header"),
         ("ll_dispatch", "reference low-latency dispatch header"),
         ("ll_combine", "reference low-latency combine header")]


def _timeout_worker(rank: int, world: int, store_path: str) -> None:
    """Rank 1 skips one call of each kind (on a fresh group each time: a timeout breaks the group);
    rank 0 raises CommTimeoutError once TIMEOUT_S has passed (within 10 s more), and its Buffer then refuses
    calls at once."""
    store = dist.FileStore(store_path, world)
    e = 4 * world
    for i, (skipped, phase) in enumerate(SKIPS):
        buf = moe_ep.Buffer(dist.new_group(list(range(world))), hidden=H, num_experts=e, num_topk=K,
                            max_tokens_per_rank=T, backend="reference", low_latency=True, timeout_s=TIMEOUT_S)
        inp = _inputs(700 + i, world, e)
        x, idx, w = inp.x[rank], inp.topk_idx[rank], inp.topk_weights[rank]
        low_latency = skipped.startswith("ll")

        def dispatch() -> Any:
            return buf.low_latency_dispatch(x, idx) if low_latency else buf.dispatch(x, idx, w)

        call: Callable[[], Any] = dispatch
        if skipped.endswith("combine"):  # both ranks make the dispatch, rank 1 skips the combine
            got = dispatch()
            call = ((lambda: buf.low_latency_combine(got.x, idx, w, got.handle)) if low_latency
                    else (lambda: buf.combine(got.x, got.handle)))
        if rank == 0:
            start = time.monotonic()
            with pytest.raises(CommTimeoutError) as raised:
                call()
            elapsed = time.monotonic() - start
            # not before the timeout (an error raised at once is no timeout), nor long after it
            assert TIMEOUT_S * 0.9 <= elapsed < TIMEOUT_S + 10, f"{skipped}: raised after {elapsed:.2f} s"
            err = raised.value
            assert (err.rank, err.peer, err.phase, err.timeout_s) == (0, -1, phase, TIMEOUT_S)
            assert str(err).startswith(f"moe_ep rank 0: timed out after 2.0 s in phase '{phase}' waiting for a peer "
                                       "(gloo: "), str(err)  # gloo's text inside ours, its first line only
            assert "\n" not in str(err) and err.__suppress_context__, str(err)
            with pytest.raises(RuntimeError, match="unusable"):
                dispatch()
            store.set(f"timed out {i}", "1")
        else:
            store.wait([f"timed out {i}"], timedelta(seconds=120))  # skips the call, touches nothing of the group
        buf.abort()


def test_reference_honours_timeout(tmp_path: Path) -> None:
    run_workers(2, _timeout_worker, str(tmp_path / "store"), timeout_s=300)


@pytest.mark.parametrize("timeout_s, written", [(0.05, "0.05"), (0.001, "0.001"), (0.15, "0.15"), (2.5, "2.5"),
                                                (100.0, "100.0"), (1 / 3, "0.333")])
def test_timeout_messages_keep_the_digits_of_short_timeouts(timeout_s: float, written: str) -> None:
    err = CommTimeoutError(3, 1, "dispatch rows", timeout_s)
    assert str(err) == f"moe_ep rank 3: timed out after {written} s in phase 'dispatch rows' waiting for rank 1"
