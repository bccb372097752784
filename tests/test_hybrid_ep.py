"""moe_ep.deep_ep.HybridEPBuffer's own surface against brute force over all ranks' inputs (the frameworks run
through it in tests/test_frameworks_hybrid.py): both routing inputs, num_permuted_tokens above and below
the pairs with the overflow flag, non-blocking mode, the dense probs gradient, FP8 rows, and bad input.
2 ranks on CPU (reference backend) and 2 ranks sharing one GPU (native kernels)."""
from __future__ import annotations

from typing import Optional

import pytest
import torch

from moe_ep.deep_ep import HybridEPBuffer
from moe_ep.deep_ep.hybrid_ep_buffer import indices_to_map
from tests._dist import device, requires_gpus, run_workers
from tests.oracle import Inputs, assert_same_bits
from tests.test_frameworks_hybrid import (EXPERTS, HIDDEN, NUM_LOCAL, T, WORLD, Layout, _combined, _inputs, _kept, _layout,
                                          _pair_rows, _per_pair, _starts)

TOKENS = [13, 9]
PAD = 4


def _rows_of(seed: int, r: int, n: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Rank r's expert outputs or probs gradient: fresh values, the same on every rank."""
    g = torch.Generator().manual_seed(seed * 100 + r)
    return torch.randn(n, HIDDEN, generator=g).to(dtype) if dtype == torch.bfloat16 else torch.randn(n, generator=g)


def _rows_at_pairs(inp: Inputs, me: int, layouts: list[Layout], rows: list[torch.Tensor]) -> torch.Tensor:
    """[N_me, K, ...]: for each of rank me's pairs some rank kept, the row that rank's `rows` has at the pair's
    place in its layout (zeros elsewhere): what each expert returned for the pair."""
    begin, end = _starts(inp)[me:me + 2]
    out = torch.zeros(end - begin, inp.topk_idx[me].shape[1], *rows[0].shape[1:], dtype=rows[0].dtype)
    for layout, theirs in zip(layouts, rows):
        at = ((layout.src >= begin) & (layout.src < end)).nonzero().squeeze(1)
        out[layout.src[at] - begin, layout.slot[at]] = theirs[at]
    return out


def _check_map(inp: Inputs, me: int) -> None:
    routing_map, probs = indices_to_map(inp.topk_idx[me], inp.topk_weights[me], TOKENS[me], EXPERTS)
    for t, row in enumerate(inp.topk_idx[me].tolist()):
        assert sorted(routing_map[t].nonzero().squeeze(1).tolist()) == sorted(row)
        for k, e in enumerate(row):
            assert probs[t, e] == inp.topk_weights[me][t, k]
    assert probs[~routing_map].eq(0).all()
    with_none, no_probs = indices_to_map(torch.tensor([[2, -1]]), None, 1, EXPERTS)
    assert with_none[0].nonzero().squeeze(1).tolist() == [2] and no_probs is None


def _check_dispatch(buf: HybridEPBuffer, inp: Inputs, me: int, rows: Optional[list[Optional[int]]],
                    non_blocking: bool) -> None:
    """One dispatch and combine (with per-row probs) against _layout: rows, probs, counts, overflow flag,
    combined rows and the dense probs gradient."""
    dev = device()
    what = f"rank {me} rows={rows} non_blocking={non_blocking}"
    layouts = [_layout(inp, r, PAD, None if rows is None else rows[r]) for r in range(WORLD)]
    full = len(_layout(inp, me, PAD, None).src)
    mine = layouts[me]
    routing_map, probs = indices_to_map(inp.topk_idx[me].to(dev), inp.topk_weights[me].to(dev), TOKENS[me], EXPERTS)
    h, p, sf, tpe, handle = buf.dispatch_with_permute(
        hidden=inp.x[me].to(dev), routing_map=routing_map, probs=probs, num_of_experts_per_rank=NUM_LOCAL,
        pad_multiple=PAD, num_permuted_tokens=None if rows is None else rows[me], non_blocking=non_blocking)
    assert_same_bits(h.cpu(), _pair_rows(mine, _per_pair(inp.x)), f"{what}: rows")
    assert_same_bits(p.cpu(), _pair_rows(mine, torch.cat(inp.topk_weights)), f"{what}: probs")
    assert sf is None and tpe.dtype == torch.int64 and tpe.tolist() == mine.counts, f"{what}: {tpe.tolist()}"
    assert tpe.device.type == (dev.type if non_blocking else "cpu"), f"{what}: tokens_per_expert on {tpe.device}"
    assert len(handle) == 11 and handle[-1].tolist() == [int(full > len(mine.src))], f"{what}: overflow flag"

    ys = [_rows_of(1, r, len(layouts[r].src)) for r in range(WORLD)]
    qs = [_rows_of(2, r, len(layouts[r].src), torch.float32) for r in range(WORLD)]
    out, dense = buf.combine_with_unpermute(hidden=ys[me].to(dev), probs=qs[me].to(dev), handle=handle,
                                            pad_multiple=PAD)
    pairs = _rows_at_pairs(inp, me, layouts, ys)
    assert_same_bits(out.cpu(), _combined(inp, me, _kept(inp, me, layouts), pairs), f"{what}: combined")
    want = torch.zeros(TOKENS[me], EXPERTS).scatter_(1, inp.topk_idx[me], _rows_at_pairs(inp, me, layouts, qs))
    assert_same_bits(dense.cpu(), want, f"{what}: probs gradient")
    assert buf.combine_with_unpermute(hidden=ys[me].to(dev), handle=handle)[1] is None

    grads = [_rows_of(3, r, TOKENS[r]) for r in range(WORLD)]  # the cached dispatch of combine's backward
    g, none_p, _, g_tpe, _ = buf.dispatch_with_permute(hidden=grads[me].to(dev), handle=handle, pad_multiple=PAD,
                                                       num_permuted_tokens=len(mine.src))
    assert_same_bits(g.cpu(), _pair_rows(mine, _per_pair(grads)), f"{what}: cached rows")
    assert none_p is None and g_tpe.tolist() == mine.counts


def _check_topk_and_fp8(buf: HybridEPBuffer, inp: Inputs, me: int) -> None:
    """topk_idx input gives the routing map's rows; e4m3 rows (hidden 128, a second moe_ep Buffer) and
    their scales move as they are."""
    dev = device()
    mine = _layout(inp, me, PAD, None)
    h, *_ = buf.dispatch_with_permute(hidden=inp.x[me].to(dev), topk_idx=inp.topk_idx[me].to(dev),
                                      topk_weights=inp.topk_weights[me].to(dev), num_of_experts=EXPERTS,
                                      pad_multiple=PAD)
    assert_same_bits(h.cpu(), _pair_rows(mine, _per_pair(inp.x)), f"rank {me}: topk input")
    gens = [torch.Generator().manual_seed(7 + r) for r in range(WORLD)]
    rows = [torch.randn(n, 128, generator=g).to(torch.float8_e4m3fn) for n, g in zip(TOKENS, gens)]
    scales = [torch.rand(n, 1, generator=g) for n, g in zip(TOKENS, gens)]
    h, _, sf, _, _ = buf.dispatch_with_permute(hidden=rows[me].to(dev), scaling_factor=scales[me].to(dev),
                                               topk_idx=inp.topk_idx[me].to(dev), num_of_experts=EXPERTS,
                                               pad_multiple=PAD)
    fp8_rows = _pair_rows(mine, _per_pair([r.view(torch.uint8) for r in rows])).view(torch.float8_e4m3fn)
    assert_same_bits(h.cpu(), fp8_rows, f"rank {me}: fp8 rows")
    assert_same_bits(sf.cpu(), _pair_rows(mine, _per_pair(scales)), f"rank {me}: fp8 scales")


def _check_errors(buf: HybridEPBuffer, inp: Inputs, me: int) -> None:
    dev = device()
    x = inp.x[me].to(dev)
    routing_map, probs = indices_to_map(inp.topk_idx[me].to(dev), inp.topk_weights[me].to(dev), TOKENS[me], EXPERTS)
    common = dict(hidden=x, routing_map=routing_map, probs=probs)
    for kwargs, error, match in (
            (dict(non_blocking=True), ValueError, "needs num_permuted_tokens"),
            (dict(num_permuted_tokens=6, pad_multiple=4), ValueError, "multiple of pad_multiple"),
            (dict(num_of_experts_per_rank=3), ValueError, "num_of_experts_per_rank=3"),
            (dict(use_fp8=True), NotImplementedError, "use_fp8=True with bf16 hidden"),
            (dict(topk_idx=inp.topk_idx[me].to(dev)), ValueError, "not both")):
        with pytest.raises(error, match=match):
            buf.dispatch_with_permute(**common, **kwargs)
    with pytest.raises(TypeError, match="handle"):
        buf.dispatch_with_permute(hidden=x, handle=(None,) * 11)
    _, _, _, _, handle = buf.dispatch_with_permute(**common)
    with pytest.raises(ValueError, match="rows"):
        buf.combine_with_unpermute(hidden=torch.zeros(handle.num_permuted_tokens + 1, HIDDEN, dtype=torch.bfloat16,
                                                      device=dev), handle=handle)
    with pytest.raises(ValueError, match="routing_map"):
        buf.dispatch_with_permute(hidden=x, handle=handle, routing_map=routing_map)
    with pytest.raises(NotImplementedError, match="use_mnnvl"):
        HybridEPBuffer(None, HIDDEN, T, NUM_LOCAL, use_mnnvl=True)

    # one rank's routing map selects more experts than moe_ep's top-k (16 of 32): it raises after the call,
    # the other rank's results are those of a call where it sent nothing
    wide = torch.zeros(TOKENS[me], 32, dtype=torch.bool, device=dev)
    wide[:, : (20 if me == 1 else 2)] = True
    if me == 1:
        with pytest.raises(ValueError, match="selects up to 20 experts"):
            buf.dispatch_with_permute(hidden=x, routing_map=wide)
    else:
        h, _, _, tpe, _ = buf.dispatch_with_permute(hidden=x, routing_map=wide)
        assert tpe.tolist() == [TOKENS[0]] * 2 + [0] * 14 and torch.equal(h.cpu(), torch.cat([inp.x[0]] * 2))


def _worker(rank: int, world: int) -> None:
    inp = _inputs(21, TOKENS)
    _check_map(inp, rank)
    buf = HybridEPBuffer(None, hidden_dim=HIDDEN, max_num_of_tokens_per_rank=T, num_local_experts=NUM_LOCAL)
    full = [len(_layout(inp, r, PAD, None).src) for r in range(WORLD)]
    _check_dispatch(buf, inp, rank, None, non_blocking=False)
    for rows in ([f + 8 for f in full], [f // 2 // PAD * PAD for f in full]):
        _check_dispatch(buf, inp, rank, rows, non_blocking=False)
        _check_dispatch(buf, inp, rank, rows, non_blocking=True)
    _check_topk_and_fp8(buf, inp, rank)
    _check_errors(buf, inp, rank)


def test_hybrid_ep() -> None:
    run_workers(WORLD, _worker)


@requires_gpus()
def test_hybrid_ep_gpu() -> None:
    run_workers(WORLD, _worker, backend="gpu", timeout_s=300)
