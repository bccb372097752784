"""Any number of tokens per rank through a fixed workspace (streaming normal mode), and async calls
on the Buffer's communication stream (issue 31).

Token counts of 0.5x, 1x, 2.5x and 7x one round's capacity (max_tokens_per_rank), zero tokens on
some ranks, random routing and routing that sends every token to one rank: dispatch (with and without
expert_major), combine (with weights), cached dispatch and get_dispatch_layout against brute force
over all ranks' inputs (tests/oracle.py), bitwise. On CPU the reference backend runs them (gloo, EP2
and 2 nodes x 2); the GPU tests (ranks sharing the GPUs, tests/_dist.py) run the native kernels at
EP2 (NVLink, and 2 nodes x 1 on the cross-node kernels), 2 x 2 and 2 x 4 against brute force and
against the reference backend (tests/test_gpu_intranode.py's checks: FP8, alignment, poisoned
outputs and workspace).

Streams: an async call's kernels run on the communication stream (a kernel queued on the caller's
stream after the call completes while the call, gated behind previous_event, has not), results equal
the synchronous call's bit for bit; the Megatron pattern (shared expert on the compute stream while
dispatch runs) and two micro-batches (one's combine while the other's dispatch runs) against the
same calls made synchronously. On CPU the async arguments are accepted and everything runs in order.
"""
from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.distributed as dist

import moe_ep
from moe_ep.comm import call_check
from moe_ep.comm.backends import intranode
from moe_ep.comm.backends.engine import (
    NormalEngine,
    Notified,
    first_notify,
    streamed_combine,
    streamed_dispatch,
)
from moe_ep.comm.config import DEEP_EP_HINT_TOKENS_PER_RANK
from tests._dist import device, requires_gpus, run_workers
from tests.oracle import (
    assert_same_bits,
    expected_combine,
    expected_combine_weights,
    expected_dispatch,
    expected_layout,
    local_weights,
    make_inputs,
)

T = 32  # one round's capacity (max_tokens_per_rank) in the brute-force cases
HIDDEN, EXPERTS, TOPK = 256, 16, 4
# tokens per rank as multiples of T (cycled over ranks), routing
CASES = [
    ((0.5, 7), "random"),
    ((1, 2.5), "random"),
    ((7, 0), "one_expert"),  # every token to one rank; a rank without tokens
    ((2.5, 1, 0, 7), "skewed"),
    ((0, 0), "random"),
]


def _tokens(case: tuple[float, ...], world: int) -> list[int]:
    return [int(case[r % len(case)] * T) for r in range(world)]


def check_against_brute_force(buf: moe_ep.Buffer, seed: int, tokens: list[int], routing: str, what: str) -> None:
    """Layout, dispatch (rows and expert-major pairs), combine with weights and cached dispatch of one
    case against tests/oracle.py, bitwise (outputs compared on the CPU)."""
    me, world, dev = buf.rank, buf.group_size, buf.device
    inp = make_inputs(seed, tokens, HIDDEN, EXPERTS, TOPK, routing)
    x, idx, w = (t.to(dev) for t in (inp.x[me], inp.topk_idx[me], inp.topk_weights[me]))

    layout = buf.get_dispatch_layout(idx)
    want_rank, want_expert, want_in = expected_layout(inp, me, world, EXPERTS)
    assert_same_bits(layout.num_tokens_per_rank.cpu(), want_rank, f"{what}: layout per rank")
    assert_same_bits(layout.num_tokens_per_expert.cpu(), want_expert, f"{what}: layout per expert")
    assert_same_bits(layout.is_token_in_rank.cpu(), want_in, f"{what}: layout in rank")

    got = buf.dispatch(x, idx, w)
    want = expected_dispatch(inp, me, world, EXPERTS)
    assert_same_bits(got.x.cpu(), want.x, f"{what}: x")
    assert_same_bits(got.topk_idx.cpu(), want.topk_idx, f"{what}: topk_idx")
    assert_same_bits(got.topk_weights.cpu(), want.topk_weights, f"{what}: topk_weights")
    assert got.src_rank.tolist() == want.src_rank, f"{what}: src_rank"
    assert got.src_index.tolist() == want.src_index, f"{what}: src_index"
    assert got.tokens_per_expert == want.tokens_per_expert, f"{what}: tokens_per_expert"
    assert got.handle.recv_counts == [want.src_rank.count(s) for s in range(world)], f"{what}: recv_counts"

    # combine: rank r returns its rows times (r + 1), and weights times (r + 2)
    y = (got.x.float() * (me + 1)).to(torch.bfloat16)
    out, out_w = buf.combine(y, got.handle, topk_weights=got.topk_weights * (me + 2))

    def row_of(r: int, s: int, i: int) -> torch.Tensor:
        return (inp.x[s][i].float() * (r + 1)).to(torch.bfloat16)

    def weights_of(r: int, s: int, i: int) -> torch.Tensor:
        return local_weights(inp, r, s, i, EXPERTS, world) * (r + 2)

    rpn = buf.ranks_per_node
    assert_same_bits(out.cpu(), expected_combine(inp, me, world, EXPERTS, row_of, rpn), f"{what}: combine")
    assert_same_bits(out_w.cpu(), expected_combine_weights(inp, me, world, EXPERTS, weights_of, rpn),
                     f"{what}: combined weights")

    # combine's backward: a cached dispatch of other rows lands where the first one's did
    x2 = (x.float() * -3).to(torch.bfloat16)
    cached = buf.dispatch(x2, handle=got.handle)
    assert_same_bits(cached.x.cpu(), (want.x.float() * -3).to(torch.bfloat16), f"{what}: cached dispatch")

    # expert-major: the pairs of each local expert are the rows that name it, in row order; their
    # combine sums each row's pairs (one per distinct local expert: exact in float32) before sending
    pairs = buf.dispatch(x, idx, w, expert_major=True)
    rows = pairs.handle.expert_major.rows.cpu()
    want_pairs = torch.where((rows >= 0).unsqueeze(1), want.x[rows.clamp_min(0)], torch.zeros((), dtype=want.x.dtype))
    assert_same_bits(pairs.x.cpu(), want_pairs, f"{what}: expert-major pairs")
    num_local = EXPERTS // world

    def pairs_of(r: int, s: int, i: int) -> torch.Tensor:
        named = {e for e in inp.topk_idx[s][i].tolist() if e >= 0 and e // num_local == r}
        return (inp.x[s][i].float() * len(named)).to(torch.bfloat16)

    assert_same_bits(buf.combine(pairs.x, pairs.handle).cpu(), expected_combine(inp, me, world, EXPERTS, pairs_of, rpn),
                     f"{what}: expert-major combine")


def _worst_case_cap(buf: moe_ep.Buffer) -> None:
    """A static-shape dispatch (worst_case=True) still holds at most T tokens: the rank that passed more
    raises; its peers take part in the stand-in call and raise PeerInputError where the call compares
    stamps (the reference backend), else return (a native worst-case dispatch never reads the counts)."""
    n = 2 * T if buf.rank == 0 else T // 2
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, HIDDEN, generator=g).to(torch.bfloat16).to(buf.device)
    idx = torch.randint(0, EXPERTS, (n, TOPK), generator=g).to(buf.device)
    w = torch.rand(n, TOPK, generator=g).to(buf.device)
    if buf.rank == 0:
        with pytest.raises(ValueError, match="max_tokens_per_rank"):
            buf.dispatch(x, idx, w, worst_case=True)
    elif buf.backend_name == "reference":
        with pytest.raises(moe_ep.PeerInputError, match="rank 0 rejected its input"):
            buf.dispatch(x, idx, w, worst_case=True)
    else:
        buf.dispatch(x, idx, w, worst_case=True)


# ---- the stream patterns (the same code on CPU and GPU) ------------------------------------------
def _shared_expert(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (x.float() @ weight).to(torch.bfloat16)


def _experts(x: torch.Tensor, r: int) -> torch.Tensor:
    return (x.float() * (r + 1) - 0.5).to(torch.bfloat16)


def _capture() -> moe_ep.EventHandle:
    """An event after the caller's work so far (an empty one on CPU)."""
    if not torch.cuda.is_available() or device().type != "cuda":
        return moe_ep.EventHandle(None)
    event = torch.cuda.Event()
    event.record()
    return moe_ep.EventHandle(event)


def check_patterns(buf: moe_ep.Buffer, seed: int, tokens: int) -> None:
    """Megatron's (shared expert on the compute stream while dispatch runs) and two micro-batches
    (micro-batch 1's dispatch while micro-batch 0's experts and combine run), async, against the same
    calls made synchronously, bitwise."""
    me, dev = buf.rank, buf.device
    g = torch.Generator().manual_seed(seed + me)
    xs = [torch.randn(tokens + 7 * b, HIDDEN, generator=g).to(torch.bfloat16).to(dev) for b in range(2)]
    idxs = [torch.randint(-1, EXPERTS, (x.shape[0], TOPK), generator=g).to(dev) for x in xs]
    ws = [torch.rand(x.shape[0], TOPK, generator=g).to(dev) for x in xs]
    shared_w = (torch.randn(HIDDEN, HIDDEN, generator=g) / 16).to(dev)

    def sync_layer(b: int) -> torch.Tensor:
        d = buf.dispatch(xs[b], idxs[b], ws[b])
        return buf.combine(_experts(d.x, me), d.handle) + _shared_expert(xs[b], shared_w)

    want = [sync_layer(b) for b in range(2)]

    # Megatron: dispatch on the communication stream, the shared expert meanwhile on the caller's
    d = buf.dispatch(xs[0], idxs[0], ws[0], previous_event=_capture(), async_op=True)
    shared = _shared_expert(xs[0], shared_w)
    d.event.wait()
    out, event = buf.combine(_experts(d.x, me), d.handle, previous_event=_capture(), async_op=True)
    event.wait()
    assert_same_bits((out + shared).cpu(), want[0].cpu(), "Megatron pattern")

    # two micro-batches: 1's dispatch overlaps 0's experts, 0's combine overlaps 1's experts
    d0 = buf.dispatch(xs[0], idxs[0], ws[0], async_op=True)
    d1 = buf.dispatch(xs[1], idxs[1], ws[1], previous_event=d0.event, async_op=True)
    d0.event.wait()
    y0 = _experts(d0.x, me)
    out0, e0 = buf.combine(y0, d0.handle, previous_event=_capture(), async_op=True)
    d1.event.wait()
    y1 = _experts(d1.x, me)
    out1, e1 = buf.combine(y1, d1.handle, previous_event=_capture(), async_op=True)
    shared0, shared1 = _shared_expert(xs[0], shared_w), _shared_expert(xs[1], shared_w)
    e0.wait()
    e1.wait()
    assert_same_bits((out0 + shared0).cpu(), want[0].cpu(), "two micro-batches: 0")
    assert_same_bits((out1 + shared1).cpu(), want[1].cpu(), "two micro-batches: 1")


def check_drop_in_hint_budget(backend: str, tokens: int = 16384) -> None:
    """moe_ep.deep_ep.Buffer sized by Config.get_nvl_buffer_size_hint (Megatron's and SGLang's budget:
    rounds of DEEP_EP_HINT_TOKENS_PER_RANK tokens) takes `tokens` tokens per rank: its dispatch and combine
    equal a one-round reference Buffer's bit for bit."""
    import moe_ep.deep_ep as deep_ep

    dev, me, world = device(), dist.get_rank(), dist.get_world_size()
    hidden, experts, k = 256, 4 * world, 4
    buf = deep_ep.Buffer(dist.group.WORLD, deep_ep.Config().get_nvl_buffer_size_hint(2 * hidden, world),
                         backend=backend, explicitly_destroy=True)
    g = torch.Generator().manual_seed(31 + me)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).to(dev)
    idx = torch.rand(tokens, experts, generator=g).topk(k, dim=1).indices.to(dev)
    w = torch.rand(tokens, k, generator=g).to(dev)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
    recv, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx,
        topk_weights=w)
    assert [b.max_tokens_per_rank for b in buf.moe_ep_buffers] == [DEEP_EP_HINT_TOKENS_PER_RANK]
    out, out_w, _ = buf.combine(recv, handle, topk_weights=recv_w)
    with moe_ep.Buffer(dist.group.WORLD, hidden=hidden, num_experts=experts, num_topk=k, max_tokens_per_rank=tokens,
                       backend="reference", device=dev) as ref:
        want = ref.dispatch(x, idx, w)
        assert_same_bits(recv.cpu(), want.x.cpu(), "drop-in at the hint budget: rows")
        assert_same_bits(recv_idx.cpu(), want.topk_idx.cpu(), "drop-in at the hint budget: topk_idx")
        assert counts == want.tokens_per_expert, "drop-in at the hint budget: tokens per expert"
        want_out, want_w = ref.combine(want.x, want.handle, topk_weights=want.topk_weights)
        assert_same_bits(out.cpu(), want_out.cpu(), "drop-in at the hint budget: combine")
        assert_same_bits(out_w.cpu(), want_w.cpu(), "drop-in at the hint budget: combined weights")
    buf.destroy()


# ---- CPU: the streamed flow over an engine that plays the NVLink kernels' contract ---------------
class _PlayedKernels(NormalEngine):
    """The NVLink kernels' contract (csrc/kernels/intranode/intranode.h) played with object collectives
    on CPU, so the streamed flow (engine.streamed_dispatch / streamed_combine: round slices, patched
    first rows, in-round source indices, src_rank masks) runs here: notify gives pos and recv_info
    (rows per source, first output row per source, rows per local expert); dispatch puts row n for rank
    d at d's output row recv_info[R + me] + pos[n][d]; combine returns every row whose src_rank is a
    peer to its src_index and reads its own rows at recv_info[R + me] + pos, summing in rank order."""

    path = "played"

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.max_tokens_seen = 0
        self.stamps: list = []  # every rank's stamp words of the last notify

    @staticmethod
    def heap_bytes(cfg) -> int:
        return 0

    def close(self) -> None:
        pass

    def _everyone(self, mine: object) -> list:
        got: list = [None] * self.cfg.world_size
        dist.all_gather_object(got, mine, group=self.cfg.group)
        return got

    def layout(self, topk_idx, stream):
        raise NotImplementedError

    def notify(self, topk_idx, expert_alignment, worst_case, stream, stamp) -> Notified:
        cfg, r = self.cfg, self.cfg.world_size
        self.max_tokens_seen = max(self.max_tokens_seen, topk_idx.shape[0])
        assert topk_idx.shape[0] <= cfg.max_tokens_per_rank, "a round carries more than T tokens"
        owner = torch.where(topk_idx >= 0, topk_idx // cfg.num_local_experts, -1)
        in_rank = torch.stack([(owner == d).any(1) for d in range(r)], 1) if topk_idx.shape[0] else \
            torch.zeros(0, r, dtype=torch.bool)
        pos = torch.where(in_rank, in_rank.to(torch.int32).cumsum(0, dtype=torch.int32) - 1, -1).to(torch.int32)
        per_expert = [[int(((topk_idx == d * cfg.num_local_experts + e).any(1)).sum()) for e in
                       range(cfg.num_local_experts)] for d in range(r)]
        sent = self._everyone(([int(in_rank[:, d].sum()) for d in range(r)], per_expert, stamp))
        self.stamps = [sent[s][2] for s in range(r)]
        counts = [sent[s][0][cfg.rank] for s in range(r)]
        raw = [sum(sent[s][1][cfg.rank][e] for s in range(r)) for e in range(cfg.num_local_experts)]
        first = [sum(counts[:s]) for s in range(r)]
        recv_info = torch.tensor(counts + first + raw, dtype=torch.int32)
        aligned = torch.tensor([-(-c // expert_alignment) * expert_alignment for c in raw], dtype=torch.int32)
        return Notified(in_rank, intranode.DispatchState(pos, recv_info, None), aligned)

    def raw_expert_counts(self, state):
        return state.recv_info[2 * self.cfg.world_size:]

    def host_stamps(self) -> list:
        return self.stamps

    def launch_dispatch(self, x, x_scales, topk_idx, topk_weights, state, out, *, cached, worst_case, expert_major,
                        num_sms, knobs, stream) -> None:
        cfg, me, r = self.cfg, self.cfg.rank, self.cfg.world_size
        e_l = cfg.num_local_experts
        sends = []
        for d in range(r):
            rows = []
            for n in range(x.shape[0]):
                p = int(state.pos[n, d])
                if p < 0:
                    continue
                meta = None
                if not cached:
                    ids = topk_idx[n]
                    local = torch.where((ids >= 0) & (ids // e_l == d), ids - d * e_l, -1)
                    meta = (local, torch.where(local >= 0, topk_weights[n], 0.0))
                rows.append((p, n, x[n].clone(), meta))
            sends.append(rows)
        everyone = self._everyone(sends)
        first = state.recv_info[r:2 * r]
        for s in range(r):
            for p, n, row, meta in everyone[s][me]:
                at = int(first[s]) + p
                out.x[at] = row
                if not cached:
                    out.topk_idx[at], out.topk_weights[at] = meta
                    out.src_rank[at], out.src_index[at] = s, n

    def combine(self, x, handle, out, topk_weights, out_topk_weights, *, num_sms, knobs, stream) -> None:
        cfg, me, r = self.cfg, self.cfg.rank, self.cfg.world_size
        state = handle.state
        sends = [[] for _ in range(r)]
        for j in range(x.shape[0]):
            s = int(handle.src_rank[j])
            if s >= 0 and s != me:
                i = int(handle.src_index[j])
                assert 0 <= i < cfg.max_tokens_per_rank, "a combine row's index is not inside its round"
                sends[s].append((i, x[j].clone(), None if topk_weights is None else topk_weights[j].clone()))
        everyone = self._everyone(sends)
        acc = torch.zeros(handle.num_tokens, cfg.hidden)
        acc_w = torch.zeros(handle.num_tokens, cfg.num_topk)
        own_first = int(state.recv_info[r + me])
        for s in range(r):
            if s == me:
                for i in range(handle.num_tokens):
                    if handle.is_token_in_rank[i, me]:
                        at = own_first + int(state.pos[i, me])
                        acc[i] += x[at].float()
                        if topk_weights is not None:
                            acc_w[i] += topk_weights[at]
                continue
            for i, row, w in everyone[s][me]:
                acc[i] += row.float()
                if w is not None:
                    acc_w[i] += w
        out.copy_(acc.to(torch.bfloat16))
        if out_topk_weights is not None:
            out_topk_weights.copy_(acc_w)

    def fill_workspace(self, value: int) -> None:
        pass


def _played_worker(rank: int, world: int) -> None:
    """streamed_dispatch / streamed_combine over _PlayedKernels against the reference backend, bitwise:
    fresh, cached and combine (with weights), 0.5x to 7x a round, a rank without tokens."""
    with moe_ep.Buffer(dist.group.WORLD, hidden=HIDDEN, num_experts=EXPERTS, num_topk=TOPK, max_tokens_per_rank=T,
                       backend="reference") as ref:
        engine = _PlayedKernels(ref.cfg)
        order = call_check.CallOrder()  # the stamps the played notifies exchange (every rank's the same)
        for seed, (case, routing) in enumerate(CASES[:4]):
            tokens = _tokens(case, world)
            inp = make_inputs(100 + seed, tokens, HIDDEN, EXPERTS, TOPK, routing)
            x, idx, w = inp.x[rank], inp.topk_idx[rank], inp.topk_weights[rank]
            rounds = max(1, -(-max(tokens) // T))
            run = dict(rounds=rounds, expert_alignment=3, num_sms=1, knobs=ref.config, stream=None, async_op=False,
                       check=lambda **_: None)
            first_stamp = order.stamp(call_check.DISPATCH)
            got = streamed_dispatch(engine, x, None, idx, w, handle=None,
                                    first=first_notify(engine, idx, 3, None, first_stamp),
                                    stamp=first_stamp, **run)
            want = ref.dispatch(x, idx, w, expert_alignment=3)
            what = f"played {case} {routing}"
            for field in ("x", "topk_idx", "topk_weights", "src_rank", "src_index", "tokens_per_expert_tensor"):
                assert_same_bits(getattr(got, field), getattr(want, field), f"{what}: {field}")
            assert got.tokens_per_expert == want.tokens_per_expert, f"{what}: tokens_per_expert"
            assert got.handle.recv_counts == want.handle.recv_counts, f"{what}: recv_counts"
            assert_same_bits(got.handle.is_token_in_rank, want.handle.is_token_in_rank, f"{what}: is_token_in_rank")
            y = (want.x.float() * (rank + 1.5)).to(torch.bfloat16)
            wy = want.topk_weights * (rank + 2)
            out, out_w = ref.combine(y, want.handle, topk_weights=wy)
            got_out = torch.empty_like(out)
            got_w = torch.empty_like(out_w)
            streamed_combine(engine, y, got.handle, got_out, wy, got_w, num_sms=1, knobs=ref.config, stream=None)
            assert_same_bits(got_out, out, f"{what}: combine")
            assert_same_bits(got_w, out_w, f"{what}: combined weights")
            x2 = (x.float() * -2).to(torch.bfloat16)
            cached = streamed_dispatch(engine, x2, None, None, None, handle=got.handle, first=None,
                                       stamp=order.stamp(call_check.CACHED, handle=1), **run)
            assert_same_bits(cached.x, ref.dispatch(x2, handle=want.handle).x, f"{what}: cached dispatch")
        assert engine.max_tokens_seen == T


def test_streamed_flow_over_played_kernels() -> None:
    run_workers(2, _played_worker)


def check_low_latency_async(buf: moe_ep.Buffer) -> None:
    """Low-latency dispatch and combine with async_op equal the synchronous calls (received rows below
    each expert's count, combined rows) bit for bit; async_op with a receive hook is a ValueError."""
    me = buf.rank
    g = torch.Generator().manual_seed(77 + me)
    x = torch.randn(T, HIDDEN, generator=g).to(torch.bfloat16).to(buf.device)
    idx = torch.randint(-1, EXPERTS, (T, TOPK), generator=g).to(buf.device)
    w = torch.rand(T, TOPK, generator=g).to(buf.device)

    def received(d: moe_ep.LowLatencyDispatchResult) -> list[torch.Tensor]:
        return [d.x[e, :int(c)].cpu() for e, c in enumerate(d.count.tolist())]

    sync = buf.low_latency_dispatch(x, idx)
    want_rows = received(sync)
    want_out = buf.low_latency_combine(sync.x, idx, w, sync.handle).x.cpu()
    lazy = buf.low_latency_dispatch(x, idx, async_op=True)
    lazy.event.wait()
    for e, (got, want) in enumerate(zip(received(lazy), want_rows)):
        assert_same_bits(got, want, f"async low-latency dispatch: expert {e}")
    out = buf.low_latency_combine(lazy.x, idx, w, lazy.handle, async_op=True)
    out.event.wait()
    assert_same_bits(out.x.cpu(), want_out, "async low-latency combine")
    with pytest.raises(ValueError, match="exclude each other"):
        buf.low_latency_dispatch(x, idx, async_op=True, return_recv_hook=True)


# ---- CPU: the reference backend ---------------------------------------------------------------
def _cpu_worker(rank: int, world: int, ranks_per_node: Optional[int]) -> None:
    with moe_ep.Buffer(dist.group.WORLD, hidden=HIDDEN, num_experts=EXPERTS, num_topk=TOPK, max_tokens_per_rank=T,
                       backend="reference", ranks_per_node=ranks_per_node, low_latency=True) as buf:
        check_low_latency_async(buf)
        for seed, (case, routing) in enumerate(CASES):
            check_against_brute_force(buf, seed, _tokens(case, world), routing, f"reference {case} {routing}")
        _worst_case_cap(buf)
        check_patterns(buf, 11, 5 * T // 2)
        layout = buf.get_dispatch_layout(torch.zeros(3, TOPK, dtype=torch.int64), async_op=True)
        layout.event.synchronize()  # an empty event on CPU
    check_drop_in_hint_budget("reference")


@pytest.mark.parametrize("world,ranks_per_node", [(2, None), (4, 2)])
def test_reference_streams_any_token_count(world: int, ranks_per_node: Optional[int]) -> None:
    run_workers(world, _cpu_worker, ranks_per_node)


# ---- GPU: the native kernels ------------------------------------------------------------------
def _gpu_cases(rank: int, world: int, topo: dict) -> None:
    from tests.test_gpu_intranode import Case, _run_case

    common = dict(hidden=HIDDEN, num_experts=EXPERTS, num_topk=TOPK, max_tokens_per_rank=T, **topo)
    with moe_ep.Buffer(dist.group.WORLD, device=device(), backend="nvshmem", **common) as nat:
        for seed, (case, routing) in enumerate(CASES):
            check_against_brute_force(nat, seed, _tokens(case, world), routing, f"native {topo} {case} {routing}")
        _worst_case_cap(nat)
        check_patterns(nat, 11, 5 * T // 2)
    # against the reference backend: FP8, alignment, cached, async, poisoned outputs and workspace
    shape = (2048, 32, 8, 64)
    hidden, experts, k, t = shape
    common = dict(hidden=hidden, num_experts=experts, num_topk=k, max_tokens_per_rank=t, **topo)
    with moe_ep.Buffer(dist.group.WORLD, device=device(), backend="nvshmem", **common) as nat, \
            moe_ep.Buffer(dist.group.WORLD, device=device(), backend="reference", **common) as ref:
        for seed, (mult, routing, use_fp8, alignment) in enumerate([
                ((7, 2.5), "random", False, 1), ((0.5, 7, 1, 0), "skewed", True, 16),
                ((2.5, 0), "one_expert", False, 4), ((1, 7), "random", True, 1)]):
            tokens = tuple(int(mult[r % len(mult)] * t) for r in range(world))
            _run_case(nat, ref, shape, Case(100 + seed, tokens, routing, use_fp8, alignment), rank)


@requires_gpus()
def test_native_streams_two_ranks() -> None:
    """EP2 on one node (NVLink kernels) and as 2 nodes x 1 (cross-node kernels)."""
    run_workers(2, _each_topology, [{}, {"ranks_per_node": 1}], backend="gpu", timeout_s=600)


@requires_gpus()
def test_native_streams_two_by_two() -> None:
    run_workers(4, _each_topology, [{"ranks_per_node": 2}], backend="gpu", timeout_s=600)


@requires_gpus()
def test_native_streams_two_by_four() -> None:
    run_workers(8, _each_topology, [{"ranks_per_node": 4}], backend="gpu", timeout_s=600)


def _each_topology(rank: int, world: int, topos: list[dict]) -> None:
    for topo in topos:
        _gpu_cases(rank, world, topo)
    if world == 2:
        check_drop_in_hint_budget("nvshmem")


def _gated_call(rank: int, world: int) -> None:
    """The call's kernels run on the communication stream: rank 0's async dispatch cannot finish before
    rank 1 joins it, and rank 1 joins only after rank 0 saw a kernel it queued on its own stream after
    the call complete (were the call on that stream, the kernel would wait for it, and the call would
    give up after timeout_s, failing the check)."""
    with moe_ep.Buffer(dist.group.WORLD, device=device(), backend="nvshmem", hidden=HIDDEN, num_experts=EXPERTS,
                       num_topk=TOPK, max_tokens_per_rank=T, low_latency=True, timeout_s=20.0) as buf:
        check_low_latency_async(buf)
        g = torch.Generator(device="cuda").manual_seed(rank)
        x = torch.randn(T, HIDDEN, generator=g, device="cuda").to(torch.bfloat16)
        idx = torch.randint(0, EXPERTS, (T, TOPK), generator=g, device="cuda")
        w = torch.rand(T, TOPK, generator=g, device="cuda")
        want = buf.dispatch(x, idx, w, worst_case=True)
        # CUDA loads a kernel on its first launch (lazy loading), which may wait for the kernels running:
        # the caller's kernel below must be loaded before the gated call spins
        twice = x * 2
        torch.cuda.synchronize()
        dist.barrier()
        if rank == 0:
            got = buf.dispatch(x, idx, w, worst_case=True, previous_event=_capture(), async_op=True)
            mine = x * 2  # queued on the caller's stream after the call
            after = torch.cuda.Event()
            after.record()
            after.synchronize()
            assert not got.event.event.query(), "the call finished without its peer: it did not run on its own stream"
            dist.barrier()  # now rank 1 joins the dispatch
        else:
            dist.barrier()
            got = buf.dispatch(x, idx, w, worst_case=True, async_op=True)
            mine = x * 2
        got.event.wait()
        for field in ("x", "topk_idx", "topk_weights", "src_rank", "src_index"):
            assert_same_bits(getattr(got, field).cpu(), getattr(want, field).cpu(), f"gated async dispatch {field}")
        assert_same_bits(mine.cpu(), twice.cpu(), "the caller's kernel")
        # exact-size and streamed calls: async equals synchronous
        for n in (T // 2, 7 * T + 3):
            xs = torch.randn(n, HIDDEN, generator=g, device="cuda").to(torch.bfloat16)
            ids = torch.randint(-1, EXPERTS, (n, TOPK), generator=g, device="cuda")
            ws = torch.rand(n, TOPK, generator=g, device="cuda")
            sync = buf.dispatch(xs, ids, ws)
            lazy = buf.dispatch(xs, ids, ws, async_op=True)
            lazy.event.wait()
            for field in ("x", "topk_idx", "topk_weights", "src_rank", "src_index"):
                assert_same_bits(getattr(lazy, field).cpu(), getattr(sync, field).cpu(), f"async dispatch {field}")
            out, event = buf.combine(lazy.x, lazy.handle, async_op=True)
            event.wait()
            assert_same_bits(out.cpu(), buf.combine(sync.x, sync.handle).cpu(), "async combine")


@requires_gpus()
def test_native_async_calls_run_on_the_communication_stream() -> None:
    run_workers(2, _gated_call, backend="gpu", timeout_s=600)
