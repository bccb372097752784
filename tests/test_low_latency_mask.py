"""The rank mask of fault-tolerant low-latency Buffers on CPU (3 ranks, gloo, reference backend): after
a round with every rank, rank 2 leaves for good; the survivors mask it (moe_ep.Buffer.set_rank_masked,
and DeepEP's low_latency_update_mask_buffer on a deep_ep.Buffer(enable_shrink=True)) and go on. Their
dispatch and combine results must equal brute force over the inputs with rank 2's tokens gone and its
experts dropped (their topk_idx entries -1); query / clean, a partition set before a Buffer exists, and
the argument checks are checked too."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import moe_ep
import moe_ep.deep_ep as deep_ep
from tests._dist import device, run_workers
from tests.oracle import Inputs, expected_low_latency_combine, expected_low_latency_dispatch, make_inputs

WORLD, DEAD = 3, 2
HIDDEN, EXPERTS, TOPK, T = 256, 12, 4, 16


def without(inp: Inputs, dead: set[int]) -> Inputs:
    """inp with the dead ranks' tokens removed and every pick of a dead rank's experts set to -1."""
    e_l = EXPERTS // WORLD
    idx = [torch.where(torch.isin(i // e_l, torch.tensor(sorted(dead))) & (i >= 0), -1, i) for i in inp.topk_idx]
    keep = [0 if r in dead else inp.x[r].shape[0] for r in range(WORLD)]
    return Inputs([x[:n] for x, n in zip(inp.x, keep)], [i[:n] for i, n in zip(idx, keep)],
                  [w[:n] for w, n in zip(inp.topk_weights, keep)])


def expert_output(e: int, s: int, n: int, k: int, inp: Inputs) -> torch.Tensor:
    """What local expert e returns for token n of rank s: a function of the row and the expert."""
    return (inp.x[s][n].float() * (e % 7 + 1) + 0.25).to(torch.bfloat16)


def check_round(x: torch.Tensor, src_index: torch.Tensor, count: torch.Tensor, combine, inp: Inputs,
                want: Inputs, me: int, what: str) -> None:
    """Dispatched rows, counts and source indices, then the combine of expert_output, against brute force
    over `want` (the inputs as the survivors see them)."""
    e_l = EXPERTS // WORLD
    expected = expected_low_latency_dispatch(want, me, WORLD, EXPERTS, False, False)
    x, src_index, count = x.cpu(), src_index.cpu(), count.cpu()
    for e in range(e_l):
        c = int(count[e])
        assert c == len(expected.rows[e]), f"{what}: expert {e} got {c} rows, want {len(expected.rows[e])}"
        if c:
            assert torch.equal(x[e, :c].view(torch.int16), torch.stack(expected.rows[e]).view(torch.int16)), what
            assert src_index[e, :c].tolist() == [i for _, i in expected.src[e]], what
    y = torch.zeros(x.shape, dtype=torch.bfloat16)
    for e in range(e_l):
        for slot, (s, n) in enumerate(expected.src[e]):
            y[e, slot] = expert_output(me * e_l + e, s, n, 0, inp)
    got = combine(y.to(device())).cpu()
    ref = expected_low_latency_combine(want, me, WORLD, EXPERTS, lambda e, s, n, k: expert_output(e, s, n, k, inp))
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16)), f"{what}: combine differs"


def moe_ep_round(buf: moe_ep.Buffer, inp: Inputs, me: int, dead: set[int]) -> None:
    dev = device()
    x, idx, w = inp.x[me].to(dev), inp.topk_idx[me].to(dev), inp.topk_weights[me].to(dev)
    d = buf.low_latency_dispatch(x, idx)
    check_round(d.x, d.handle.src_index, d.count, lambda y: buf.low_latency_combine(y, idx, w, d.handle).x, inp,
                without(inp, dead), me, f"moe_ep.Buffer dead={sorted(dead)}")


def drop_in_round(buf: deep_ep.Buffer, inp: Inputs, me: int, dead: set[int]) -> None:
    dev = device()
    x, idx, w = inp.x[me].to(dev), inp.topk_idx[me].to(dev), inp.topk_weights[me].to(dev)
    recv, count, handle, _, hook = buf.low_latency_dispatch(x, idx, T, EXPERTS, use_fp8=False, return_recv_hook=True)
    hook()
    check_round(recv, handle[0], count, lambda y: buf.low_latency_combine(y, idx, w, handle)[0], inp,
                without(inp, dead), me, f"deep_ep.Buffer dead={sorted(dead)}")


def query(buf: deep_ep.Buffer) -> list[int]:
    status = torch.full((WORLD,), 7, dtype=torch.int32, device=device())
    buf.low_latency_query_mask_buffer(status)
    return status.tolist()


def check_local_buffer_tensor(rank: int) -> None:
    """get_local_buffer_tensor (vLLM zeroes it after a fault): the declared bytes as dtype, DeepEP's offset and
    size, the same memory on every call; writing there changes no call (moe_ep's own buffers are apart)."""
    nvl, rdma = 4096 + 64 * rank, 1000
    buf = deep_ep.Buffer(dist.group.WORLD, nvl, rdma, low_latency_mode=True, enable_shrink=True)
    raw = buf.get_local_buffer_tensor(torch.int8, use_rdma_buffer=True)
    assert raw.dtype == torch.int8 and raw.shape == (rdma,) and not raw.any()
    raw.fill_(-3)
    words = buf.get_local_buffer_tensor(torch.int32, size=torch.Size([4, 5]), offset=3, use_rdma_buffer=True)
    assert words.shape == (4, 5) and (words == -0x02020203).all()
    words.zero_()
    assert int((raw == 0).sum()) == 80 and (raw[:12] == -3).all() and (raw[92:] == -3).all()
    nvl_words = buf.get_local_buffer_tensor(torch.float32)
    assert nvl_words.shape == (nvl // 4,) and not nvl_words.any()
    with pytest.raises(ValueError, match="size"):
        buf.get_local_buffer_tensor(torch.int32, size=torch.Size([251]), use_rdma_buffer=True)
    with pytest.raises(ValueError, match="offset"):
        buf.get_local_buffer_tensor(torch.int8, offset=nvl + 1)
    raw.zero_()  # what vLLM does; the next call runs as before
    drop_in_round(buf, make_inputs(53, [5, 12, 3], HIDDEN, EXPERTS, TOPK), rank, set())


def _worker(rank: int, world: int) -> None:
    dev = device()
    first, second = make_inputs(51, [13, 9, 11], HIDDEN, EXPERTS, TOPK), make_inputs(52, [16, 0, 7], HIDDEN, EXPERTS, TOPK)
    kwargs = dict(hidden=HIDDEN, num_experts=EXPERTS, num_topk=TOPK, max_tokens_per_rank=T, low_latency=True, device=dev)
    buf = moe_ep.Buffer(dist.group.WORLD, fault_tolerant=True, **kwargs)
    plain = moe_ep.Buffer(dist.group.WORLD, **kwargs)
    drop = deep_ep.Buffer(dist.group.WORLD, low_latency_mode=True, enable_shrink=True)
    no_shrink = deep_ep.Buffer(dist.group.WORLD, low_latency_mode=True, allow_mnnvl=False, use_fabric=False)
    moe_ep_round(buf, first, rank, set())
    drop_in_round(drop, first, rank, set())  # makes its low-latency Buffer (collective)
    assert buf.masked_ranks == [] and query(drop) == [0, 0, 0]

    # A partition every rank agrees on, set before the drop-in makes its low-latency Buffer (masks reach
    # Buffers made later): ranks 0 and 1 mask rank 2, rank 2 masks both of them and works alone.
    late = deep_ep.Buffer(dist.group.WORLD, low_latency_mode=True, enable_shrink=True)
    apart = {0, 1} if rank == DEAD else {DEAD}
    for r in sorted(apart):
        late.low_latency_update_mask_buffer(r, True)
    drop_in_round(late, second, rank, apart)
    assert query(late) == [int(r in apart) for r in range(WORLD)]
    check_local_buffer_tensor(rank)
    dist.barrier()
    if rank == DEAD:
        return  # gone: no further call of any kind

    buf.set_rank_masked(DEAD)
    drop.low_latency_update_mask_buffer(DEAD, True)
    assert buf.masked_ranks == [DEAD] and buf.rank_mask.tolist() == [0, 0, 1] and query(drop) == [0, 0, 1]
    for inp in (second, first):
        moe_ep_round(buf, inp, rank, {DEAD})
        drop_in_round(drop, inp, rank, {DEAD})
    drop.low_latency_clean_mask_buffer()
    buf.clear_rank_masks()
    assert buf.masked_ranks == [] and query(drop) == [0, 0, 0]

    with pytest.raises(ValueError, match="cannot mask itself"):
        buf.set_rank_masked(rank)
    with pytest.raises(ValueError, match="rank must be an int"):
        buf.set_rank_masked(WORLD)
    with pytest.raises(ValueError, match="fault_tolerant=True"):
        plain.set_rank_masked(DEAD)
    with pytest.raises(ValueError, match="rank_to_mask"):
        drop.low_latency_update_mask_buffer(-1, True)
    with pytest.raises(ValueError, match="cannot mask itself"):
        drop.low_latency_update_mask_buffer(rank, True)
    with pytest.raises(ValueError, match="mask_status"):
        drop.low_latency_query_mask_buffer(torch.zeros(WORLD, dtype=torch.int64))
    for call in (lambda: no_shrink.low_latency_update_mask_buffer(0, True), no_shrink.low_latency_clean_mask_buffer,
                 lambda: no_shrink.low_latency_query_mask_buffer(torch.zeros(WORLD, dtype=torch.int32))):
        with pytest.raises(ValueError, match="enable_shrink=True"):
            call()


def test_masked_rank_is_left_out() -> None:
    run_workers(WORLD, _worker)
