"""Expert-major dispatch and combine (moe_ep.expert_major) against brute force over all ranks' inputs,
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
with its route/gather/row sum, row combine), for float32 and bf16 experts, chunked and not.

GPU (backend="gpu", 2 ranks on the GPUs present): the native backend against the reference backend
on the same inputs, every output bitwise, with the caching allocator poisoned before native calls.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pytest
import torch
import torch.distributed as dist

import moe_ep
from moe_ep import autograd, fp8
from tests._dist import device, requires_gpus, run_workers
from tests.oracle import (
    Inputs,
    assert_same_bits,
    expected_combine,
    expected_combine_weights,
    expected_dispatch,
    make_inputs,
)
from tests.test_layer import GRAD_CASES, _build, _inputs


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

        def row_of(r: int, s: int, i: int) -> torch.Tensor:
            row = inp.topk_idx[s][i].tolist()
            acc = torch.zeros(h, dtype=torch.float32)
            for k, v in enumerate(row):
                if v >= 0 and v // e_l == r and v not in row[:k]:
                    p = index[r][(s, i, v)]
                    term = ys[r][p].float()
                    acc = acc + (pws[r][p] * term if weighted else term)
            return acc.to(torch.bfloat16)

        def weights_of(r: int, s: int, i: int) -> torch.Tensor:
            return torch.tensor([float(tws[r][index[r][(s, i, v)]]) if v >= 0 and v // e_l == r else 0.0
                                 for v in inp.topk_idx[s][i].tolist()], dtype=torch.float32)

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

    def row_of(r: int, s: int, i: int) -> torch.Tensor:
        row = inp.topk_idx[s][i].tolist()
        acc = torch.zeros(h, dtype=torch.float32)
        for k, v in enumerate(row):
            if v >= 0 and v // e_l == r and v not in row[:k]:
                acc = acc + gs[r][index[r][(s, i, v)]]
        return acc.to(torch.bfloat16)

    def weights_of(r: int, s: int, i: int) -> torch.Tensor:
        return torch.tensor([float(gws[r][index[r][(s, i, v)]]) if v >= 0 and v // e_l == r else 0.0
                             for v in inp.topk_idx[s][i].tolist()], dtype=torch.float32)

    assert_same_bits(x.grad.cpu(), expected_combine(inp, me, world, e, row_of), f"rank {me}: x.grad")
    assert_same_bits(w.grad.cpu(), expected_combine_weights(inp, me, world, e, weights_of), f"rank {me}: w.grad")


# ---- one rank's bad input -------------------------------------------------------------------------
def _check_bad_input(buf: moe_ep.Buffer, me: int, world: int) -> None:
    """The bad rank raises; the others' results are those of the call with the bad rank's stand-in
    (no tokens for a dispatch, zero pairs for a combine)."""
    case = Case(8, (9, 5, 7), 16, 8, 3)
    dev, h, e = buf.device, case.hidden, case.experts
    e_l = e // world
    bad = world - 1
    inp = make_inputs(case.seed, [case.n(r) for r in range(world)], h, e, case.topk, case.routing)
    x, idx, w = _on(dev, inp.x[me], inp.topk_idx[me], inp.topk_weights[me])
    empty = Inputs([t[:0] if r == bad else t for r, t in enumerate(inp.x)],
                   [t[:0] if r == bad else t for r, t in enumerate(inp.topk_idx)],
                   [t[:0] if r == bad else t for r, t in enumerate(inp.topk_weights)])

    for kwargs, error, match in ((dict(expert_major=True, worst_case=True), ValueError, "needs exact sizes"),
                                 (dict(expert_major="yes"), TypeError, "expert_major must be")):
        if me == bad:
            with pytest.raises(error, match=match):
                buf.dispatch(x, idx, w, **kwargs)
            continue
        got = buf.dispatch(x, idx, w, expert_major=True)
        pairs = expected_pairs(empty, me, world, e, 1)
        assert_same_bits(got.x.cpu(), _pair_rows(pairs, empty.x), f"rank {me}: pairs beside a bad rank ({match})")

    good = buf.dispatch(x, idx, w, expert_major=True)
    plain = buf.dispatch(x, idx, w)
    pairs = expected_pairs(inp, me, world, e, 1)
    index = [expected_pairs(inp, r, world, e, 1).index() for r in range(world)]
    ys = [_rows(81, r, len(expected_pairs(inp, r, world, e, 1).src), h) for r in range(world)]

    def row_of(r: int, s: int, i: int) -> torch.Tensor:
        row = inp.topk_idx[s][i].tolist()
        acc = torch.zeros(h, dtype=torch.float32)
        for k, v in enumerate(row):
            if r != bad and v >= 0 and v // e_l == r and v not in row[:k]:
                acc = acc + ys[r][index[r][(s, i, v)]].float()
        return acc.to(torch.bfloat16)

    want = expected_combine(inp, me, world, e, row_of)
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
            assert_same_bits(buf.combine(y, good.handle).cpu(), want, f"rank {me}: combine beside a bad rank ({match})")
    # a cached dispatch: a plain handle named expert-major, or another expert_alignment
    for kwargs, match in ((dict(handle=plain.handle, expert_major=True), "handle of an expert-major dispatch"),
                          (dict(handle=good.handle, expert_alignment=2), "keeps its handle's layout"),
                          (dict(handle=good.handle, expert_major="yes"), "expert_major must be")):
        if me == bad:
            with pytest.raises((ValueError, TypeError), match=match):
                buf.dispatch(x, **kwargs)
        else:
            buf.dispatch(x, handle=good.handle)
    buf.combine(y, good.handle)  # the group is still in step


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
        out = moe(x, mode="normal")
        aux = moe.aux_loss
    ((out.float() * grad_out).sum() + aux).backward()
    got = {"out": out.detach(), "x.grad": x.grad}
    for name, p in moe.named_parameters():
        got[name] = p.grad if p.grad is not None else torch.zeros_like(p)
    return got


def _check_layer(me: int, world: int) -> None:
    for case in GRAD_CASES:
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
