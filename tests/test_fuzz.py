"""Fuzz: hundreds of random calls on one Buffer, every kind interleaved, each checked bit for bit
against brute force (tests/oracle.py) over all ranks' inputs. CPU, gloo, reference backend, 2 and 3 ranks.

One Buffer (low_latency=True) per topology serves, in a random order: normal dispatch (N from 0 to
T per rank, random / skewed (duplicates) / one-expert / no-expert routing with -1 entries, bf16 or
FP8, expert_alignment, worst-case mode, NaN and Inf in x, async_op), combine and cached dispatch
through the handle of one of the last few dispatches, get_dispatch_layout, low-latency dispatch and
combine (FP8, round_scale, receive hooks), and bad inputs that must raise a TypeError or ValueError
naming the culprit, after which the Buffer keeps working. Rows a result leaves unspecified (padding)
are NaN in the inputs of combines, so a backend that reads them fails.

The call sequence is a pure function of a seed (`fuzz_calls`), the same on every rank, and
`call_inputs` builds every rank's inputs of a call on any device, so a GPU fuzz can replay the same
calls. The seed is random per run; MOE_EP_FUZZ_SEED repeats one, and every failure names it.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Optional

import pytest
import torch
import torch.distributed as dist

import moe_ep
from moe_ep.comm import fp8
from tests._dist import run_workers
from tests.oracle import (
    ExpectedDispatch,
    Inputs,
    assert_same_bits,
    expected_combine,
    expected_dispatch,
    expected_layout,
    expected_low_latency_combine,
    expected_low_latency_dispatch,
    random_topk,
)


@dataclass(frozen=True)
class FuzzShape:
    """What a Buffer fixes: hidden size, experts, top-k, max tokens per rank."""

    hidden: int
    experts: int
    topk: int
    max_tokens: int


@dataclass(frozen=True)
class Call:
    """One fuzz call, the same on every rank; its inputs come from `call_inputs`."""

    kind: str  # a key of KIND_WEIGHTS
    seed: int  # of every rank's inputs
    tokens: tuple[int, ...]  # N per rank
    routing: str = "random"  # a tests.oracle.random_topk kind
    fp8: bool = False
    alignment: int = 1
    worst_case: bool = False
    specials: bool = False  # NaN and +-Inf entries in x
    async_op: bool = False
    hook: bool = False  # low-latency: receive hooks for dispatch and combine
    round_scale: bool = False
    source: int = -1  # combine, cached and some bad calls: the index of the dispatch call whose handle they use
    bad: str = ""  # kind "bad": a key of BAD_INPUTS


@dataclass(frozen=True)
class BadInput:
    """A rule a bad call breaks: the exception it must raise, a pattern of its message, and what the
    call needs ("fp8": FP8 allowed, "no_fp8": FP8 not allowed, "handle": a live dispatch handle)."""

    error: type
    match: str
    needs: str = ""


BAD_INPUTS = {
    "x_dtype": BadInput(TypeError, r"\bx\b"),
    "topk_dtype": BadInput(TypeError, "topk_idx"),
    "weights_dtype": BadInput(TypeError, "topk_weights"),
    "expert_too_large": BadInput(ValueError, "topk_idx"),
    "expert_below_minus_one": BadInput(ValueError, "topk_idx"),
    "too_many_tokens": BadInput(ValueError, "max_tokens_per_rank"),
    "misaligned": BadInput(ValueError, "aligned"),
    "non_contiguous": BadInput(ValueError, "contiguous"),
    "event_type": BadInput(TypeError, "previous_event"),
    "expert_alignment": BadInput(ValueError, "expert_alignment"),
    "scales_without_fp8": BadInput(ValueError, "x_scales"),
    "fp8_without_scales": BadInput(ValueError, "x_scales", "fp8"),
    "fp8_hidden": BadInput(ValueError, "128", "no_fp8"),
    "round_scale_without_fp8": BadInput(ValueError, "round_scale"),
    "low_latency_expert_too_large": BadInput(ValueError, "topk_idx"),
    "combine_rows": BadInput(ValueError, r"\bx\b", "handle"),
    "cached_with_topk": BadInput(ValueError, "topk", "handle"),
    "low_latency_normal_handle": BadInput(TypeError, "handle", "handle"),
}
KIND_WEIGHTS = {"dispatch": 6, "combine": 3, "cached": 2, "layout": 2, "low_latency": 4, "bad": 3}
ROUTINGS = ("random", "random", "skewed", "one_expert", "none")
ALIGNMENTS = (1, 1, 1, 2, 4, 7, 16)
LIVE_HANDLES = 4  # combine and cached dispatch use the handle of one of the last LIVE_HANDLES dispatches
SPECIALS = (float("nan"), float("inf"), float("-inf"))


# ---- the call sequence ------------------------------------------------------------------------
def _tokens(rng: random.Random, world: int, most: int, least: int = 0) -> tuple[int, ...]:
    """N per rank: `least` or `most` one time in six each, otherwise anything between."""
    return tuple(rng.choice((least, most, *(rng.randint(least, most) for _ in range(4)))) for _ in range(world))


def fuzz_calls(seed: int, count: int, world: int, shape: FuzzShape,
               bad_inputs: tuple[str, ...] = tuple(BAD_INPUTS)) -> Iterator[Call]:
    """`count` calls for a Buffer of `shape` on `world` ranks, a pure function of `seed`; bad calls
    break one of `bad_inputs`."""
    rng = random.Random(seed)
    fp8_ok = shape.hidden % fp8.BLOCK == 0
    t = shape.max_tokens
    live: list[Call] = []  # the last dispatches, with `source` set to their own index
    for index in range(count):
        kind = rng.choices(list(KIND_WEIGHTS), weights=list(KIND_WEIGHTS.values()))[0]
        if kind in ("combine", "cached") and not live:
            kind = "dispatch"
        use_fp8 = fp8_ok and rng.random() < 0.3
        call = Call(kind, rng.getrandbits(31), _tokens(rng, world, t), rng.choice(ROUTINGS), use_fp8,
                    rng.choice(ALIGNMENTS), specials=not use_fp8 and rng.random() < 0.2,
                    async_op=rng.random() < 0.25)
        if kind == "dispatch":
            call = replace(call, worst_case=rng.random() < 0.3)
            live = (live + [replace(call, source=index)])[-LIVE_HANDLES:]
        elif kind in ("combine", "cached"):
            source = rng.choice(live)
            call = replace(call, tokens=source.tokens, source=source.source, specials=False)
        elif kind == "low_latency":
            call = replace(call, hook=rng.random() < 0.5, round_scale=use_fp8 and rng.random() < 0.5)
        elif kind == "bad":
            allowed = [name for name in bad_inputs if BAD_INPUTS[name].needs in ("", "fp8" if fp8_ok else "no_fp8")
                       or (BAD_INPUTS[name].needs == "handle" and live)]
            bad = rng.choice(allowed)
            tokens = (t + 1,) * world if bad == "too_many_tokens" else _tokens(rng, world, t, least=1)
            call = replace(call, tokens=tokens, bad=bad, source=rng.choice(live).source if live else -1)
        yield call


def call_inputs(call: Call, shape: FuzzShape, device: str = "cpu") -> Inputs:
    """Every rank's x (bf16), topk_idx and topk_weights for `call`, drawn on the CPU from call.seed
    (so the same bits on every device), then moved to `device`."""
    g = torch.Generator().manual_seed(call.seed)
    xs, idxs, ws = [], [], []
    for n in call.tokens:
        x = (torch.randn(n, shape.hidden, generator=g) * 2).to(torch.bfloat16)
        if call.specials and n:
            spots = torch.randint(0, x.numel(), (len(SPECIALS),), generator=g)
            x.view(-1)[spots] = torch.tensor(SPECIALS, dtype=torch.bfloat16)
        xs.append(x.to(device))
        idxs.append(random_topk(call.routing, n, shape.experts, shape.topk, g, "cpu").to(device))
        ws.append(torch.rand(n, shape.topk, generator=g).to(device))
    return Inputs(xs, idxs, ws)


def fp8_payloads(xs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every rank's rows quantized as docs/api.md defines it, and their scales."""
    out = [fp8.quantize(x) for x in xs]
    return [q for q, _ in out], [s for _, s in out]


def _multipliers(g: torch.Generator, n: int) -> torch.Tensor:
    """n factors +-2^-8, +-1 or +-2^12. One token's rows scaled by them cancel exactly or differ
    widely in size, so a float32 sum in another order than the contract's gives other bits (sums of
    rows of similar size are exact in any order)."""
    sign = torch.randint(0, 2, (n,), generator=g) * 2 - 1
    return sign * 2.0 ** torch.tensor((-8.0, 0.0, 12.0))[torch.randint(0, 3, (n,), generator=g)]


def _finite(x: torch.Tensor) -> torch.Tensor:
    """x as float32 with NaN and +-Inf replaced: expert outputs derived from it stay finite."""
    return torch.nan_to_num(x.float(), nan=0.0, posinf=1.0, neginf=-1.0)


# ---- the checks --------------------------------------------------------------------------------
@dataclass
class Dispatched:
    """A checked dispatch whose handle later calls use."""

    inputs: Inputs
    result: moe_ep.DispatchResult
    want: ExpectedDispatch


class Fuzzer:
    """Runs calls on one Buffer (every rank runs the same sequence) and checks each result."""

    def __init__(self, buf: moe_ep.Buffer, shape: FuzzShape) -> None:
        self.buf, self.shape = buf, shape
        self.me, self.world = buf.rank, buf.group_size
        self.num_local = shape.experts // self.world
        self.dispatched: dict[int, Dispatched] = {}

    def run(self, index: int, call: Call) -> None:
        getattr(self, f"_{call.kind}")(index, call)

    def _check_dispatch(self, got: moe_ep.DispatchResult, want: ExpectedDispatch, alignment: int, worst_case: bool,
                        cached: bool) -> None:
        """Rows, metadata and counts of a (cached) dispatch result; worst-case rows sit at
        [s * T, s * T + count_s) and the rest is padding."""
        t, m = self.shape.max_tokens, len(want.src_rank)
        aligned = [-(-c // alignment) * alignment for c in want.tokens_per_expert]
        assert got.tokens_per_expert_tensor.tolist() == aligned, "tokens_per_expert_tensor"
        rows = torch.arange(m)
        if worst_case:
            rows = torch.tensor([s * t + want.src_rank[:j].count(s) for j, s in enumerate(want.src_rank)],
                                dtype=torch.int64)
            pad = torch.ones(self.world * t, dtype=torch.bool)
            pad[rows] = False
            assert got.x.shape[0] == self.world * t and got.tokens_per_expert is None, "worst-case size"
            assert (got.src_rank[pad] == -1).all() and (got.src_index[pad] == -1).all(), "padding source"
            if not cached:
                assert (got.topk_idx[pad] == -1).all() and (got.topk_weights[pad] == 0).all(), "padding routing"
        else:
            assert got.x.shape[0] == m and got.tokens_per_expert == aligned, "tokens_per_expert"
            assert got.handle.recv_counts == [want.src_rank.count(s) for s in range(self.world)], "recv_counts"
        assert_same_bits(got.x[rows], want.x, "x")
        assert_same_bits(None if got.x_scales is None else got.x_scales[rows], want.scales, "x_scales")
        assert got.src_rank[rows].tolist() == want.src_rank and got.src_index[rows].tolist() == want.src_index
        if cached:
            assert got.topk_idx is None and got.topk_weights is None, "cached dispatch returns no routing"
        else:
            assert_same_bits(got.topk_idx[rows], want.topk_idx, "topk_idx")
            assert_same_bits(got.topk_weights[rows], want.topk_weights, "topk_weights")

    def _dispatch_payload(self, call: Call, inp: Inputs) -> tuple[Inputs, Optional[list[torch.Tensor]]]:
        """The rows a call sends (FP8 or the bf16 inputs) and their scales."""
        if not call.fp8:
            return inp, None
        q, scales = fp8_payloads(inp.x)
        return Inputs(q, inp.topk_idx, inp.topk_weights), scales

    def _dispatch(self, index: int, call: Call) -> None:
        inp = call_inputs(call, self.shape)
        sent, scales = self._dispatch_payload(call, inp)
        me = self.me
        got = self.buf.dispatch(sent.x[me], inp.topk_idx[me], inp.topk_weights[me],
                                x_scales=None if scales is None else scales[me], expert_alignment=call.alignment,
                                worst_case=call.worst_case, async_op=call.async_op)
        if call.async_op:
            got.event.wait()
        want = expected_dispatch(sent, me, self.world, self.shape.experts, scales=scales)
        self._check_dispatch(got, want, call.alignment, call.worst_case, cached=False)
        self.dispatched[index] = Dispatched(inp, got, want)
        for old in sorted(self.dispatched)[:-LIVE_HANDLES]:
            del self.dispatched[old]

    def _cached(self, index: int, call: Call) -> None:
        source = self.dispatched[call.source]
        grads = call_inputs(call, self.shape)
        sent, scales = self._dispatch_payload(call, Inputs(grads.x, source.inputs.topk_idx, source.inputs.topk_weights))
        got = self.buf.dispatch(sent.x[self.me], x_scales=None if scales is None else scales[self.me],
                                handle=source.result.handle, expert_alignment=call.alignment)
        want = expected_dispatch(sent, self.me, self.world, self.shape.experts, scales=scales)
        self._check_dispatch(got, want, call.alignment, source.result.handle.worst_case, cached=True)

    def _combine(self, index: int, call: Call) -> None:
        """Rank r returns bf16(finite(x) * a_r) for each row it received (a_r from _multipliers);
        padding rows are NaN."""
        source = self.dispatched[call.source]
        a = _multipliers(torch.Generator().manual_seed(call.seed), self.world)

        def row_of(r: int, s: int, i: int) -> torch.Tensor:
            return (_finite(source.inputs.x[s][i]) * a[r]).to(torch.bfloat16)

        handle, want = source.result.handle, source.want
        y = torch.full((handle.num_recv_rows, self.shape.hidden), float("nan"), dtype=torch.bfloat16)
        rows = [row_of(self.me, s, i) for s, i in zip(want.src_rank, want.src_index)]
        if rows:
            y[source.result.src_rank >= 0] = torch.stack(rows)
        got = self.buf.combine(y, handle, async_op=call.async_op)
        if call.async_op:
            got, event = got
            event.wait()
        expected = expected_combine(source.inputs, self.me, self.world, self.shape.experts, row_of,
                                    ranks_per_node=self.buf.ranks_per_node)
        assert_same_bits(got, expected, "combine")

    def _layout(self, index: int, call: Call) -> None:
        inp = call_inputs(call, self.shape)
        layout = self.buf.get_dispatch_layout(inp.topk_idx[self.me])
        per_rank, per_expert, in_rank = expected_layout(inp, self.me, self.world, self.shape.experts)
        assert_same_bits(layout.num_tokens_per_rank, per_rank, "num_tokens_per_rank")
        assert_same_bits(layout.num_tokens_per_expert, per_expert, "num_tokens_per_expert")
        assert_same_bits(layout.is_token_in_rank, in_rank, "is_token_in_rank")

    def _low_latency(self, index: int, call: Call) -> None:
        """Dispatch (with a layout call between send and receive when hooked), then combine of
        bf16(finite(x) * c_e) per expert e (c_e from _multipliers), rows past each count NaN."""
        inp = call_inputs(call, self.shape)
        me, buf = self.me, self.buf
        x, idx, w = inp.x[me], inp.topk_idx[me], inp.topk_weights[me]
        got = buf.low_latency_dispatch(x, idx, use_fp8=call.fp8, round_scale=call.round_scale,
                                       return_recv_hook=call.hook)
        if call.hook:
            buf.get_dispatch_layout(idx)
            got.hook()
        want = expected_low_latency_dispatch(inp, me, self.world, self.shape.experts, call.fp8, call.round_scale)
        slots = self.world * self.shape.max_tokens
        assert got.x.shape == (self.num_local, slots, self.shape.hidden), "low-latency x shape"
        c = _multipliers(torch.Generator().manual_seed(call.seed), self.shape.experts)

        def expert_row(e: int, s: int, n: int, k: int) -> torch.Tensor:
            return (_finite(inp.x[s][n]) * c[e]).to(torch.bfloat16)

        y = torch.full((self.num_local, slots, self.shape.hidden), float("nan"), dtype=torch.bfloat16)
        for e in range(self.num_local):
            count = int(got.count[e])
            src = list(zip(got.handle.src_rank[e, :count].tolist(), got.handle.src_index[e, :count].tolist()))
            assert count == len(want.rows[e]) and src == want.src[e], f"expert {e}: count or sources"
            if count:
                assert_same_bits(got.x[e, :count], torch.stack(want.rows[e]), f"expert {e}: x")
                if call.fp8:
                    assert_same_bits(got.x_scales[e, :count], torch.stack(want.scales[e]), f"expert {e}: x_scales")
                y[e, :count] = torch.stack([expert_row(me * self.num_local + e, s, n, 0) for s, n in src])
        out = buf.low_latency_combine(y, idx, w, got.handle, return_recv_hook=call.hook)
        if call.hook:
            out.hook()
        expected = expected_low_latency_combine(inp, me, self.world, self.shape.experts, expert_row)
        assert_same_bits(out.x, expected, "low-latency combine")

    def _bad(self, index: int, call: Call) -> None:
        rule = BAD_INPUTS[call.bad]
        with pytest.raises(rule.error, match=rule.match):
            self._bad_call(call)()

    def _bad_call(self, call: Call) -> Callable[[], Any]:
        """The call that breaks rule call.bad (every rank makes it, so none reaches communication)."""
        inp = call_inputs(call, self.shape)
        buf, me, h = self.buf, self.me, self.shape.hidden
        x, idx, w = inp.x[me], inp.topk_idx[me], inp.topk_weights[me]
        handle = self.dispatched[call.source].result.handle if call.source in self.dispatched else None

        def with_expert(value: int) -> torch.Tensor:
            bad = idx.clone()
            bad[0, 0] = value
            return bad

        store = torch.empty(x.numel() + 8, dtype=torch.bfloat16)
        misaligned = store[1 : 1 + x.numel()].view_as(x).copy_(x)
        calls = {
            "x_dtype": lambda: buf.dispatch(x.float(), idx, w),
            "topk_dtype": lambda: buf.dispatch(x, idx.int(), w),
            "weights_dtype": lambda: buf.dispatch(x, idx, w.double()),
            "expert_too_large": lambda: buf.dispatch(x, with_expert(self.shape.experts), w),
            "expert_below_minus_one": lambda: buf.get_dispatch_layout(with_expert(-2)),
            "too_many_tokens": lambda: buf.dispatch(x, idx, w, worst_case=True),  # static shapes hold at most T
            "misaligned": lambda: buf.dispatch(misaligned, idx, w),
            "non_contiguous": lambda: buf.dispatch(torch.stack([x, x], dim=-1)[..., 0], idx, w),
            "event_type": lambda: buf.dispatch(x, idx, w, previous_event=object()),
            "expert_alignment": lambda: buf.dispatch(x, idx, w, expert_alignment=0),
            "scales_without_fp8": lambda: buf.dispatch(x, idx, w, x_scales=torch.ones(x.shape[0], 1)),
            "fp8_without_scales": lambda: buf.dispatch(x.to(torch.float8_e4m3fn), idx, w),
            "fp8_hidden": lambda: buf.low_latency_dispatch(x, idx, use_fp8=True),
            "round_scale_without_fp8": lambda: buf.low_latency_dispatch(x, idx, round_scale=True),
            "low_latency_expert_too_large": lambda: buf.low_latency_dispatch(x, with_expert(self.shape.experts)),
            "combine_rows": lambda: buf.combine(torch.zeros(handle.num_recv_rows + 1, h, dtype=torch.bfloat16), handle),
            "cached_with_topk": lambda: buf.dispatch(x, idx, w, handle=handle),
            "low_latency_normal_handle": lambda: buf.low_latency_combine(
                torch.zeros(self.num_local, self.world * self.shape.max_tokens, h, dtype=torch.bfloat16), idx, w, handle),
        }
        return calls[call.bad]


# ---- the runs ---------------------------------------------------------------------------------
CALLS = 400
# per group size: (shape, Buffer topology arguments); hidden 72 takes no FP8 (its calls must raise)
CONFIGS = {
    2: [(FuzzShape(256, 8, 4, 24), {}), (FuzzShape(128, 12, 6, 17), {"ranks_per_node": 1})],
    3: [(FuzzShape(256, 12, 5, 16), {"ranks_per_node": 1}), (FuzzShape(72, 6, 3, 20), {})],
}


def _worker(rank: int, world: int, seed: int) -> None:
    for number, (shape, topo) in enumerate(CONFIGS[world]):
        with moe_ep.Buffer(dist.group.WORLD, hidden=shape.hidden, num_experts=shape.experts, num_topk=shape.topk,
                           max_tokens_per_rank=shape.max_tokens, backend="reference", low_latency=True,
                           **topo) as buf:
            fuzzer = Fuzzer(buf, shape)
            for index, call in enumerate(fuzz_calls(seed + number, CALLS, world, shape)):
                try:
                    fuzzer.run(index, call)
                except (Exception, pytest.fail.Exception) as e:
                    raise AssertionError(f"MOE_EP_FUZZ_SEED={seed}, rank {rank}, {shape} {topo}, call {index}: "
                                         f"{call}: {type(e).__name__}: {e}") from e


@pytest.mark.parametrize("world", [2, 3])
def test_fuzz_matches_oracle(world: int) -> None:
    seed = int(os.environ.get("MOE_EP_FUZZ_SEED", random.randrange(2**31)))
    print(f"fuzz seed {seed} (MOE_EP_FUZZ_SEED={seed} repeats this run)")
    run_workers(world, _worker, seed, timeout_s=300)
