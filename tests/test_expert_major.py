"""Expert-major dispatch and combine (moe_ep.comm.expert_major) against brute force over all ranks' inputs,
and the MoE layer on them against the layer's previous formula, bit for bit.

CPU (reference backend, gloo, R = 1, 2, 4): per case, every rank's rows and routing come from one seed
(random routing with -1 entries, skewed routing with repeated experts, one expert, a rank with no
tokens); the oracle (plain loops, tests/oracle.py style) lists each rank's pairs: for local expert e
ascending, every source rank's tokens in order that name e, with the sum of the weights of their
slots naming e. Checked bitwise: pairs (bf16 and FP8 with scales), per-pair weights, counts (host
and device, with expert_alignment padding), the row each pair came from; combine of bf16 and float32
pairs, with per-pair weights and with per-pair topk_weights returned to [N, K]; cached dispatch
(pairs, and rows with expert_major=False); the differentiable op's gradients; bad input on one
rank (it raises ValueError/TypeError, the others complete with results as if it sent nothing).
The layer: forward and every gradient bitwise equal to the old path (row dispatch, experts.forward
with its route/gather/row sum, row combine), for float32 and bf16 experts.

GPU (backend="gpu", 2 ranks on the GPUs present, sharing one if need be): the native backend
against the reference backend on the same inputs, every output of dispatch, combine and cached
dispatch bitwise (FP8, alignment padding, repeated experts, a rank without tokens, async events),
with the caching allocator poisoned before each native call; and the layer on the native backend
(bf16 experts: grouped GEMMs and Triton row sums on sm90) bitwise equal to the reference backend's
and to the old formula's, forward and every gradient.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import pytest
import torch

import moe_ep
from moe_ep.comm import fp8
from moe_ep.comm.expert_major import worst_case_pairs
from moe_ep.moe import autograd
from tests._dist import device, requires_gpus, run_workers
from tests._interpret import run_interpreted
from tests.oracle import (
    Inputs,
    assert_same_bits,
    expected_combine,
    expected_combine_weights,
    expected_dispatch,
    make_inputs,
    random_topk,
)
from tests.test_layer import GRAD_CASES, _build, _inputs
from tests.test_layer import Case as LayerCase


@dataclass(frozen=True)
class Case:
    seed: int
    tokens: tuple[int, ...]  # per rank, cycled
    hidden: int
    experts: int
    topk: int
    routing: str = "random"
    alignment: int = 1
    use_fp8: bool = False

    def n(self, rank: int) -> int:
        return self.tokens[rank % len(self.tokens)]


CASES = [
    Case(1, (13, 0, 9), 32, 8, 3),
    Case(2, (17, 11), 16, 16, 4, "skewed"),  # repeated experts in a row
    Case(3, (7, 19, 0), 24, 8, 2, "random", alignment=4),
    Case(4, (9, 9), 32, 8, 3, "one_expert"),
    Case(5, (0, 5, 12), 16, 32, 1, "random", alignment=3),
    Case(6, (10, 3), 128, 8, 4, "skewed", alignment=2, use_fp8=True),
    Case(7, (6, 6), 16, 16, 3, "first_experts", alignment=4),  # at R = 2 every token to rank 0, 3 pairs each
]


@dataclass
class Pairs:
    """One rank's expected pairs: (source rank, source token, global expert), None for padding."""

    src: list[Optional[tuple[int, int, int]]]
    weights: list[torch.Tensor]  # float32 scalars
    counts: list[int]  # per local expert, padding included

    def index(self) -> dict[tuple[int, int, int], int]:
        return {s: p for p, s in enumerate(self.src) if s is not None}


def expected_pairs(inp: Inputs, me: int, world: int, num_experts: int, alignment: int) -> Pairs:
    e_l = num_experts // world
    src: list[Optional[tuple[int, int, int]]] = []
    weights: list[torch.Tensor] = []
    counts = []
    for local in range(e_l):
        e = me * e_l + local
        found = 0
        for s in range(world):
            for n, row in enumerate(inp.topk_idx[s].tolist()):
                if e not in row:
                    continue
                acc = torch.zeros((), dtype=torch.float32)
                for k, v in enumerate(row):
                    if v == e:
                        acc = acc + inp.topk_weights[s][n, k]
                src.append((s, n, e))
                weights.append(acc)
                found += 1
        pad = -found % alignment
        src += [None] * pad
        weights += [torch.zeros((), dtype=torch.float32)] * pad
        counts.append(found + pad)
    return Pairs(src, weights, counts)


def _pair_rows(pairs: Pairs, rows: list[torch.Tensor]) -> torch.Tensor:
    """[P, ...]: rows[s][n] for each pair, zeros for padding (1-byte dtypes such as e4m3 as bytes)."""
    dtype = rows[0].dtype
    raw = [r.view(torch.uint8) if r.element_size() == 1 else r for r in rows]
    zero = raw[0].new_zeros(raw[0].shape[1:])
    out = [raw[s[0]][s[1]] if s is not None else zero for s in pairs.src]
    stacked = torch.stack(out) if out else raw[0][:0]
    return stacked.view(dtype)


def _rows(seed: int, r: int, n: int, h: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Every rank can make every rank's tensor: seeded by (seed, r)."""
    g = torch.Generator().manual_seed(seed * 7919 + r)
    return (torch.randn(n, h, generator=g) * 2).to(dtype)


def _vector(seed: int, r: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 104729 + r)
    w = torch.randn(n, generator=g) * torch.exp2(torch.randint(-6, 7, (n,), generator=g).float())
    w[::5] = -0.0
    return w


def _on(dev: torch.device, *ts: Optional[torch.Tensor]) -> tuple:
    return tuple(None if t is None else t.to(dev) for t in ts)


def _payload(inp: Inputs, case: Case) -> tuple[list[torch.Tensor], Optional[list[torch.Tensor]]]:
    """Every rank's dispatched rows (e4m3 with scales for FP8 cases)."""
    if not case.use_fp8:
        return inp.x, None
    q = [fp8.quantize(x) if x.shape[0] else (x.to(torch.float8_e4m3fn), torch.zeros(0, x.shape[1] // 128))
         for x in inp.x]
    return [a for a, _ in q], [b for _, b in q]


def _summed(inp: Inputs, index: list[dict], e_l: int, ys: list[torch.Tensor],
            weights: Optional[list[torch.Tensor]] = None):
    """row_of(r, s, i) for oracle.expected_combine: the bf16 row rank r sends back for token i of
    rank s, the float32 sum from +0.0 over the token's slots k ascending whose expert lives on r and
    is not an earlier slot's, of ys[r][pair] (times weights[r][pair])."""
    def row_of(r: int, s: int, i: int) -> torch.Tensor:
        row = inp.topk_idx[s][i].tolist()
        acc = torch.zeros(ys[0].shape[1], dtype=torch.float32)
        for k, v in enumerate(row):
            if v >= 0 and v // e_l == r and v not in row[:k]:
                p = index[r][(s, i, v)]
                term = ys[r][p].float()
                acc = acc + (weights[r][p] * term if weights is not None else term)
        return acc.to(torch.bfloat16)
    return row_of


def _slot_values(inp: Inputs, index: list[dict], e_l: int, values: list[torch.Tensor]):
    """weights_of(r, s, i) for oracle.expected_combine_weights: [K] float32, each slot whose expert
    lives on r the value of its pair there, 0 elsewhere."""
    def weights_of(r: int, s: int, i: int) -> torch.Tensor:
        return torch.tensor([float(values[r][index[r][(s, i, v)]]) if v >= 0 and v // e_l == r else 0.0
                             for v in inp.topk_idx[s][i].tolist()], dtype=torch.float32)
    return weights_of


# ---- dispatch / combine ---------------------------------------------------------------------------
def _row_of_token(got: moe_ep.DispatchResult) -> dict[tuple[int, int], int]:
    return {(int(s), int(n)): m for m, (s, n) in enumerate(zip(got.src_rank.tolist(), got.src_index.tolist()))}


def _check_case(buf: moe_ep.Buffer, case: Case, me: int, world: int) -> None:
    dev, h, e = buf.device, case.hidden, case.experts
    e_l = e // world
    what = f"{case} rank {me}"
    inp = make_inputs(case.seed, [case.n(r) for r in range(world)], h, e, case.topk, case.routing)
    xs, scales = _payload(inp, case)
    plan = [expected_pairs(inp, r, world, e, case.alignment) for r in range(world)]
    mine = plan[me]
    x, sc, idx, w = _on(dev, xs[me], None if scales is None else scales[me], inp.topk_idx[me], inp.topk_weights[me])

    got = buf.dispatch(x, idx, w, x_scales=sc, expert_major=True, expert_alignment=case.alignment)
    rows = expected_dispatch(inp, me, world, e, scales)  # the rows the pairs came from
    assert_same_bits(got.topk_idx.cpu(), rows.topk_idx, f"{what}: topk_idx")
    assert_same_bits(got.topk_weights.cpu(), rows.topk_weights, f"{what}: topk_weights")
    assert got.src_rank.tolist() == rows.src_rank and got.src_index.tolist() == rows.src_index, what
    assert_same_bits(got.x.cpu(), _pair_rows(mine, xs).to(got.x.dtype), f"{what}: pairs")
    if scales is not None:
        assert_same_bits(got.x_scales.cpu(), _pair_rows(mine, scales), f"{what}: pair scales")
    assert_same_bits(got.pair_weights.cpu(), torch.stack(mine.weights) if mine.weights else torch.zeros(0),
                     f"{what}: pair weights")
    assert got.tokens_per_expert == mine.counts, f"{what}: {got.tokens_per_expert} != {mine.counts}"
    assert got.tokens_per_expert_tensor.tolist() == mine.counts and got.tokens_per_expert_tensor.dtype == torch.int32
    at = _row_of_token(got)
    want_rows = [-1 if s is None else at[(s[0], s[1])] for s in mine.src]
    assert got.handle.expert_major.rows.tolist() == want_rows, f"{what}: pair rows"

    # combine: bf16 or float32 pairs, optionally weighted per pair, optionally with per-pair topk_weights
    index = [p.index() for p in plan]
    for seed, dtype, weighted in ((1, torch.bfloat16, False), (2, torch.float32, False), (3, torch.float32, True)):
        ys = [_rows(case.seed * 10 + seed, r, len(plan[r].src), h, dtype) for r in range(world)]
        pws = [_vector(case.seed * 10 + seed, r, len(plan[r].src)) for r in range(world)]
        tws = [_vector(case.seed * 10 + seed + 5, r, len(plan[r].src)) for r in range(world)]

        row_of = _summed(inp, index, e_l, ys, pws if weighted else None)
        weights_of = _slot_values(inp, index, e_l, tws)
        y, pw, tw = _on(dev, ys[me], pws[me] if weighted else None, tws[me])
        out, out_w = buf.combine(y, got.handle, topk_weights=tw, pair_weights=pw)
        label = f"{what}: combine {dtype} weighted={weighted}"
        assert_same_bits(out.cpu(), expected_combine(inp, me, world, e, row_of), f"{label}: rows")
        assert_same_bits(out_w.cpu(), expected_combine_weights(inp, me, world, e, weights_of), f"{label}: weights")
        assert_same_bits(buf.combine(y, got.handle, pair_weights=pw).cpu(), out.cpu(), f"{label}: without weights")

    # cached dispatch (combine's backward): the handle's pairs, or with expert_major=False its rows
    grads = [_rows(case.seed * 10 + 9, r, case.n(r), h) for r in range(world)]
    cached = buf.dispatch(grads[me].to(dev), handle=got.handle)
    assert_same_bits(cached.x.cpu(), _pair_rows(mine, grads), f"{what}: cached pairs")
    assert cached.pair_weights is None and cached.tokens_per_expert == mine.counts
    plain = buf.dispatch(grads[me].to(dev), handle=got.handle, expert_major=False)
    assert_same_bits(plain.x.cpu(), expected_dispatch(Inputs(grads, inp.topk_idx, inp.topk_weights), me, world, e).x,
                     f"{what}: cached rows")
    _check_worst_case(buf, case, me, world, got, cached, (x, sc, idx, w), grads[me].to(dev))


def _check_worst_case(buf: moe_ep.Buffer, case: Case, me: int, world: int, exact: moe_ep.DispatchResult,
                      cached: moe_ep.DispatchResult, args: tuple, grad: torch.Tensor) -> None:
    """worst_case=True: the exact dispatch's pairs first, then padding up to the static bound (zero
    rows and weights, row -1); its combine ignores the padding pairs, and its cached dispatch gives the
    exact one's pairs, then zeros."""
    x, sc, idx, w = args
    what = f"{case} rank {me} worst case"
    got = buf.dispatch(x, idx, w, x_scales=sc, expert_major=True, expert_alignment=case.alignment, worst_case=True)
    p = exact.x.shape[0]
    bound = worst_case_pairs(world * buf.max_tokens_per_rank, case.topk, buf.num_local_experts, case.alignment)
    assert got.x.shape[0] == bound and got.tokens_per_expert is None and got.handle.expert_major.counts is None
    assert got.tokens_per_expert_tensor.tolist() == exact.tokens_per_expert, what

    def same_then_padding(t: torch.Tensor, head: torch.Tensor, pad: int, label: str) -> None:
        assert_same_bits(t[:p], head, f"{what}: {label}")
        assert bool((t[p:] == pad).all() if pad else (t[p:].view(torch.uint8) == 0).all()), f"{what}: {label} padding"

    same_then_padding(got.x, exact.x, 0, "pairs")
    if sc is not None:
        same_then_padding(got.x_scales, exact.x_scales, 0, "pair scales")
    same_then_padding(got.pair_weights, exact.pair_weights, 0, "pair weights")
    for src in ("src_rank", "src_index"):  # each pair's source token (rows are numbered differently)
        def of(result: moe_ep.DispatchResult) -> torch.Tensor:
            rows = result.handle.expert_major.rows
            return torch.where(rows >= 0, getattr(result, src)[rows.clamp_min(0)].long(), -1)

        same_then_padding(of(got), of(exact), -1, f"pair {src}")
    g = torch.Generator().manual_seed(case.seed)
    y = torch.randn(bound, case.hidden, generator=g).to(torch.bfloat16).to(x.device)  # padding rows: noise
    assert_same_bits(buf.combine(y, got.handle), buf.combine(y[:p].contiguous(), exact.handle), f"{what}: combine")
    same_then_padding(buf.dispatch(grad, handle=got.handle).x, cached.x, 0, "cached pairs")


def _check_autograd(buf: moe_ep.Buffer, me: int, world: int) -> None:
    """The op's gradients: x gets each pair gradient back, summed per row in float32 and rounded once,
    then over ranks; topk_weights gets every slot its pair weight's gradient (repeated experts too)."""
    case = Case(7, (11, 6, 0), 16, 8, 4, "skewed")
    dev, h, e = buf.device, case.hidden, case.experts
    e_l = e // world
    inp = make_inputs(case.seed, [case.n(r) for r in range(world)], h, e, case.topk, case.routing)
    plan = [expected_pairs(inp, r, world, e, 1) for r in range(world)]
    index = [p.index() for p in plan]
    gs = [_rows(71, r, len(plan[r].src), h, torch.float32) for r in range(world)]
    gws = [_vector(72, r, len(plan[r].src)) for r in range(world)]
    x = inp.x[me].to(dev).requires_grad_(True)
    w = inp.topk_weights[me].to(dev).requires_grad_(True)
    d = autograd.dispatch_expert_major(buf, x, inp.topk_idx[me].to(dev), w, dtype=torch.float32)
    assert d.x.dtype == torch.float32
    ((d.x * gs[me].to(dev)).sum() + (d.weights * gws[me].to(dev)).sum()).backward()

    row_of, weights_of = _summed(inp, index, e_l, gs), _slot_values(inp, index, e_l, gws)
    assert_same_bits(x.grad.cpu(), expected_combine(inp, me, world, e, row_of), f"rank {me}: x.grad")
    assert_same_bits(w.grad.cpu(), expected_combine_weights(inp, me, world, e, weights_of), f"rank {me}: w.grad")


# ---- one rank's bad input -------------------------------------------------------------------------
def _check_bad_input(buf: moe_ep.Buffer, me: int, world: int) -> None:
    """The bad rank raises its error, every other rank PeerInputError naming it (the reference backend
    checks every call's stamps); then the group is still in step: the next calls are right."""
    case = Case(8, (9, 5, 7), 16, 8, 3)
    dev, h, e = buf.device, case.hidden, case.experts
    e_l = e // world
    bad = world - 1
    inp = make_inputs(case.seed, [case.n(r) for r in range(world)], h, e, case.topk, case.routing)
    x, idx, w = _on(dev, inp.x[me], inp.topk_idx[me], inp.topk_weights[me])

    def peer_raises(call: Callable[[], object]) -> None:
        with pytest.raises(moe_ep.PeerInputError, match=f"rank {bad} rejected its input"):
            call()

    for kwargs, error, match in ((dict(expert_major="yes"), TypeError, "expert_major must be"),):
        if me == bad:
            with pytest.raises(error, match=match):
                buf.dispatch(x, idx, w, **kwargs)
            continue
        peer_raises(lambda: buf.dispatch(x, idx, w, expert_major=True))

    good = buf.dispatch(x, idx, w, expert_major=True)
    plain = buf.dispatch(x, idx, w)
    pairs = expected_pairs(inp, me, world, e, 1)
    index = [expected_pairs(inp, r, world, e, 1).index() for r in range(world)]
    ys = [_rows(81, r, len(expected_pairs(inp, r, world, e, 1).src), h) for r in range(world)]

    y = ys[me].to(dev)
    p = len(pairs.src)
    spoiled = [  # (what the bad rank passes instead, the error)
        (dict(x=torch.zeros(p + 1, h, dtype=torch.bfloat16, device=dev)), ValueError, r"must have shape \["),
        (dict(x=y.to(torch.float16)), TypeError, "dtype"),
        (dict(pair_weights=torch.zeros(p, 1, device=dev)), ValueError, "pair_weights must have shape"),
        (dict(handle=plain.handle, pair_weights=torch.zeros(plain.x.shape[0], device=dev)), ValueError,
         "pair_weights needs the handle of an expert-major dispatch"),
    ]
    for kwargs, error, match in spoiled:
        if me == bad:
            args = {"x": y, "handle": good.handle, **kwargs}
            with pytest.raises(error, match=match):
                buf.combine(args.pop("x"), args.pop("handle"), **args)
        else:
            peer_raises(lambda: buf.combine(y, good.handle))
    # a cached dispatch: a plain handle named expert-major, or another expert_alignment
    for kwargs, match in ((dict(handle=plain.handle, expert_major=True), "handle of an expert-major dispatch"),
                          (dict(handle=good.handle, expert_alignment=2), "keeps its handle's layout"),
                          (dict(handle=good.handle, expert_major="yes"), "expert_major must be")):
        if me == bad:
            with pytest.raises((ValueError, TypeError), match=match):
                buf.dispatch(x, **kwargs)
        else:
            peer_raises(lambda: buf.dispatch(x, handle=good.handle))
    want = expected_combine(inp, me, world, e, _summed(inp, index, e_l, ys))
    assert_same_bits(buf.combine(y, good.handle).cpu(), want, f"rank {me}: combine after the bad calls")  # in step


# ---- the layer: the same bits as the previous formula ---------------------------------------------
def _old_layer(moe: moe_ep.MoE, x: torch.Tensor) -> tuple[torch.Tensor, moe_ep.RouterOutput]:
    """The layer before expert-major dispatch: rows dispatched, experts.forward sorting each row's
    pairs by expert (route, gather, fixed-order row sum), rows combined."""
    tokens = x.reshape(-1, moe.hidden)
    routing = moe.router(tokens)
    d = autograd.dispatch(moe.buffer, tokens.to(torch.bfloat16).contiguous(), routing.topk_idx, routing.topk_weights)
    y = moe.experts(d.x, d.topk_idx, d.topk_weights).to(torch.bfloat16)
    out = autograd.combine(y, d.ref).to(x.dtype)
    shared = moe.shared_forward(tokens)
    return (out if shared is None else out + shared.to(x.dtype)).view(x.shape), routing


def _step(moe: moe_ep.MoE, x0: torch.Tensor, grad_out: torch.Tensor, old: bool) -> dict[str, torch.Tensor]:
    moe.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_(True)
    if old:
        out, routing = _old_layer(moe, x)
        aux = routing.aux_loss + routing.z_loss
    else:
        moe.expert_major = True
        out = moe(x, mode="normal")
        aux = moe.aux_loss
    ((out.float() * grad_out).sum() + aux).backward()
    got = {"out": out.detach(), "x.grad": x.grad}
    for name, p in moe.named_parameters():
        got[name] = p.grad if p.grad is not None else torch.zeros_like(p)
    return got


def _check_layer(me: int, world: int) -> None:
    for case in GRAD_CASES:
        if case.layer.get("worst_case"):  # a worst-case layer dispatches rows: no expert-major path to compare
            continue
        for dtype in (torch.float32, torch.bfloat16):
            max_tokens = max(case.n(r) for r in range(world)) or 1
            buf = moe_ep.Buffer(None, device=device(), hidden=case.hidden, num_experts=case.experts,
                                num_topk=case.topk, max_tokens_per_rank=max_tokens, backend="reference")
            moe, _ = _build(case, buf, dtype)
            x0, grad_out = _inputs(case, me, buf.device)
            want = _step(moe, x0, grad_out, old=True)
            got = _step(moe, x0, grad_out, old=False)
            for name, t in want.items():
                assert_same_bits(got[name], t, f"rank {me} case {case.seed} {dtype}: {name}")
            buf.close()


def _worker(rank: int, world: int) -> None:
    buffers = {}
    for case in CASES:
        key = (case.hidden, case.experts, case.topk)
        if key not in buffers:
            buffers[key] = moe_ep.Buffer(None, device=device(), hidden=case.hidden, num_experts=case.experts,
                                         num_topk=case.topk, max_tokens_per_rank=24, backend="reference")
        _check_case(buffers[key], case, rank, world)
    for b in buffers.values():
        b.close()
    for check, topk in ((_check_bad_input, 3), (_check_autograd, 4)):
        buf = moe_ep.Buffer(None, device=device(), hidden=16, num_experts=8, num_topk=topk, max_tokens_per_rank=24,
                            backend="reference")
        check(buf, rank, world)
        buf.close()
    _check_layer(rank, world)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_expert_major(world: int) -> None:
    run_workers(world, _worker)


# ---- the layout itself: torch and Triton against loops ---------------------------------------------
LAYOUT_CASES = [  # (seed, rows, local experts, k, routing, alignment): a BLOCK (512) boundary, padding, no rows
    (1, 700, 16, 8, "random", 1), (2, 600, 8, 6, "skewed", 4), (3, 513, 4, 4, "one_expert", 3),
    (4, 40, 16, 8, "none", 1), (5, 0, 8, 2, "random", 2), (6, 300, 1, 3, "skewed", 8),
    (7, 64, 8, 4, "first_experts", 3),
]


def _layout_oracle(idx: list[list[int]], w: list[list[float]], e_l: int, alignment: int):
    """Plain loops: for local expert e ascending, the rows naming e in order, then padding; each
    pair's weight its slots' weights added in ascending k from +0.0 (float32)."""
    rows, weights, counts = [], [], []
    positions = [[-1] * len(r) for r in idx]
    slots = [[-1] * len(r) for r in idx]
    for e in range(e_l):
        start = len(rows)
        for m, r in enumerate(idx):
            if e not in r:
                continue
            acc = torch.zeros((), dtype=torch.float32)
            for j, v in enumerate(r):
                if v == e:
                    positions[m][j] = len(rows)
                    acc = acc + torch.tensor(w[m][j], dtype=torch.float32)
            slots[m][r.index(e)] = len(rows)
            rows.append(m)
            weights.append(acc)
        while (len(rows) - start) % alignment:
            rows.append(-1)
            weights.append(torch.zeros((), dtype=torch.float32))
        counts.append(len(rows) - start)
    return rows, positions, slots, torch.stack(weights) if weights else torch.zeros(0), counts


def _layout_cases(dev: torch.device, force_torch: bool = False) -> None:
    """Every LAYOUT_CASES case through moe_ep.comm.expert_major's layout (the Triton kernel on CUDA or when
    interpreted; `force_torch` the torch version) against _layout_oracle, bitwise."""
    from moe_ep.comm import expert_major as em

    for seed, m, e_l, k, routing, alignment in LAYOUT_CASES:
        g = torch.Generator().manual_seed(seed)
        idx = random_topk(routing, m, e_l, k, g, device="cpu")
        w = torch.randn(m, k, generator=g)
        rows, positions, slots, weights, counts = _layout_oracle(idx.tolist(), w.tolist(), e_l, alignment)
        ct = torch.tensor(counts, dtype=torch.int32, device=dev)
        p = sum(counts)
        what = f"layout case {seed} on {dev}{' (torch)' if force_torch else ''}"
        if force_torch:
            got_rows, got_pos, got_slots = em._layout_torch(idx.to(dev), ct, p)
            got_w = em._pair_weights_torch(w.to(dev), got_pos, p)
        else:
            got_rows, got_pos, got_slots, got_w = em._layout_triton(idx.to(dev), w.to(dev), ct, p, False)
        assert got_rows.tolist() == rows, f"{what}: rows"
        assert got_pos.tolist() == positions, f"{what}: positions"
        assert got_slots.tolist() == slots, f"{what}: slots"
        assert_same_bits(got_w.cpu(), weights, f"{what}: pair weights")
        if not force_torch:  # worst-case mode: a static P beyond the blocks, the tail padding
            t_rows, t_pos, _, t_w = em._layout_triton(idx.to(dev), w.to(dev), ct, p + 5, True)
            assert t_rows.tolist() == rows + [-1] * 5 and t_pos.tolist() == positions, f"{what}: tail"
            assert_same_bits(t_w.cpu(), torch.cat([weights, torch.zeros(5)]), f"{what}: tail weights")
        if not force_torch:  # counts a failed call never wrote (garbage): the stores stay inside the P pairs
            for junk in ([10 ** 6] * e_l, [-(10 ** 6)] * e_l, [p + 3] + [0] * (e_l - 1)):
                j_rows, _, _, j_w = em._layout_triton(idx.to(dev), w.to(dev), torch.tensor(junk, dtype=torch.int32,
                                                      device=dev), p, True)
                assert j_rows.shape == (p,) and j_w.shape == (p,), f"{what}: junk counts {junk[:2]}"
                assert ((j_rows >= -1) & (j_rows < m)).all(), f"{what}: junk counts {junk[:2]}"


def interpreted_layout_cases() -> None:
    """Entry of the interpreter subprocess: the Triton layout kernel on CPU tensors."""
    _layout_cases(torch.device("cpu"))


def test_layout_torch() -> None:
    _layout_cases(torch.device("cpu"), force_torch=True)


def test_layout_kernel_in_triton_interpreter() -> None:
    run_interpreted("tests.test_expert_major", "interpreted_layout_cases")


# ---- GPU: the native backend against the reference backend ---------------------------------------
GPU_SHAPES = {  # (hidden, experts, topk, max_tokens_per_rank) -> (seed, tokens per rank, routing, alignment, fp8)
    (2048, 32, 8, 256): [(11, (256, 0), "random", 1, False), (12, (77, 200), "skewed", 4, False),
                         (13, (128, 128), "one_expert", 1, True), (14, (5, 256), "skewed", 3, True)],
    # 16: both ranks send all T tokens to rank 0, k pairs each: R * T * K pairs there before the alignment padding
    (128, 16, 4, 256): [(15, (200, 150), "random", 1, False), (16, (256, 256), "first_experts", 3, False)],
}


def _same_expert_major(got: moe_ep.DispatchResult, want: moe_ep.DispatchResult, what: str) -> None:
    for name in ("x", "x_scales", "pair_weights", "topk_idx", "topk_weights", "src_rank", "src_index",
                 "tokens_per_expert_tensor"):
        assert_same_bits(getattr(got, name), getattr(want, name), f"{what}: {name}")
    assert got.tokens_per_expert == want.tokens_per_expert, what
    for name in ("rows", "positions", "slots"):
        assert_same_bits(getattr(got.handle.expert_major, name), getattr(want.handle.expert_major, name),
                         f"{what}: layout {name}")


def _gpu_case(nat: moe_ep.Buffer, ref: moe_ep.Buffer, shape: tuple, case: tuple, rank: int) -> None:
    from tests.test_gpu_intranode import _poison_allocator

    hidden, experts, k, _ = shape
    seed, tokens, routing, alignment, use_fp8 = case
    what = f"shape {shape} case {seed} rank {rank}"
    g = torch.Generator(device="cuda").manual_seed(seed * 1009 + rank)
    n = tokens[rank]
    x = (torch.randn(n, hidden, generator=g, device="cuda") * 2).to(torch.bfloat16)
    idx = random_topk(routing, n, experts, k, g)
    w = torch.rand(n, k, generator=g, device="cuda")
    scales = None
    if use_fp8:
        x, scales = fp8.quantize(x) if n else (x.to(torch.float8_e4m3fn), torch.empty(0, hidden // 128, device="cuda"))
    kw = dict(x_scales=scales, expert_alignment=alignment, expert_major=True)
    _poison_allocator()
    got = nat.dispatch(x, idx, w, **kw)
    want = ref.dispatch(x, idx, w, **kw)
    _same_expert_major(got, want, f"{what}: dispatch")
    p = want.x.shape[0]
    for dtype in (torch.bfloat16, torch.float32):
        y = torch.randn(p, hidden, generator=g, device="cuda").to(dtype)
        pw, tw = torch.randn(p, generator=g, device="cuda"), torch.randn(p, generator=g, device="cuda")
        _poison_allocator()
        got_y, got_w = nat.combine(y, got.handle, topk_weights=tw, pair_weights=pw)
        want_y, want_w = ref.combine(y, want.handle, topk_weights=tw, pair_weights=pw)
        assert_same_bits(got_y, want_y, f"{what}: combine {dtype}: rows")
        assert_same_bits(got_w, want_w, f"{what}: combine {dtype}: weights")
        _poison_allocator()
        assert_same_bits(nat.combine(y, got.handle), ref.combine(y, want.handle), f"{what}: combine {dtype}")
    grad = (torch.randn(n, hidden, generator=g, device="cuda")).to(torch.bfloat16)
    _poison_allocator()
    _same_expert_major(nat.dispatch(grad, handle=got.handle), ref.dispatch(grad, handle=want.handle),
                       f"{what}: cached dispatch")
    worst = dict(kw, worst_case=True)
    _poison_allocator()
    got_wc, want_wc = nat.dispatch(x, idx, w, **worst), ref.dispatch(x, idx, w, **worst)
    _same_expert_major(got_wc, want_wc, f"{what}: worst-case dispatch")
    y = torch.randn(want_wc.x.shape[0], hidden, generator=g, device="cuda").to(torch.bfloat16)
    _poison_allocator()
    assert_same_bits(nat.combine(y, got_wc.handle), ref.combine(y, want_wc.handle), f"{what}: worst-case combine")
    _poison_allocator()
    _same_expert_major(nat.dispatch(grad, handle=got_wc.handle), ref.dispatch(grad, handle=want_wc.handle),
                       f"{what}: worst-case cached dispatch")
    got_a = nat.dispatch(x, idx, w, async_op=True, **kw)  # the event covers the gather after the kernel
    got_a.event.wait()
    _same_expert_major(got_a, want, f"{what}: async dispatch")


def _gpu_worker(rank: int, world: int) -> None:
    if rank == 0:
        _layout_cases(torch.device("cuda"))
    for shape, cases in GPU_SHAPES.items():
        hidden, experts, k, t = shape
        common = dict(hidden=hidden, num_experts=experts, num_topk=k, max_tokens_per_rank=t)
        with moe_ep.Buffer(None, device=device(), backend="nvshmem", **common) as nat, \
                moe_ep.Buffer(None, device=device(), backend="reference", **common) as ref:
            for case in cases:
                _gpu_case(nat, ref, shape, case, rank)
    case = LayerCase(8, [200, 150], 128, 16, 4, 256, dict(aux_loss_coef=0.01))
    steps = {}
    for backend in ("nvshmem", "reference"):
        with moe_ep.Buffer(None, device=device(), hidden=case.hidden, num_experts=case.experts, num_topk=case.topk,
                           max_tokens_per_rank=256, backend=backend) as buf:
            moe, _ = _build(case, buf, torch.bfloat16)
            x0, grad_out = _inputs(case, rank, buf.device)
            steps[backend] = _step(moe, x0, grad_out, old=False)
            if backend == "nvshmem":
                steps["old"] = _step(moe, x0, grad_out, old=True)
    for other in ("reference", "old"):
        for name, t in steps[other].items():
            assert_same_bits(steps["nvshmem"][name], t, f"rank {rank} layer, native vs {other}: {name}")


@requires_gpus()
def test_expert_major_gpu() -> None:
    run_workers(2, _gpu_worker, backend="gpu", timeout_s=300)
