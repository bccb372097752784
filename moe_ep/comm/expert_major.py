"""Expert-major dispatch and combine: received rows as (row, local expert) pairs grouped by expert.

`Buffer.dispatch(..., expert_major=True)` hands the experts their rows already grouped, so the layer
runs no permutation of its own (no sort, no gather, no sum of each row's pairs), and the matching
`Buffer.combine` takes the experts' pair outputs and sums each received row's pairs before sending
it back. Both backends call this module, after their dispatch exchange and before their combine
exchange, so they give the same bits by construction: the exchange itself is the normal one and
moves each token once per destination rank. The expansion to pairs follows it, done by each engine
(NormalEngine.expand): on the NVLink kernels, the rows stay in the symmetric workspace they landed in
(DispatchArgs::expert_major) and one kernel copies each into its pairs (csrc/kernels/intranode/expand.cu),
so a row is copied once, into the experts' input; on the reference backend and across nodes, one
gather of the received rows (gather_rows). The reduction is one pass
before the combine (docs/api.md says what that costs).

Layout (types.ExpertMajorLayout): local expert e's pairs sit at [offset[e], offset[e] + count[e]),
offset the exclusive prefix sum of the per-expert counts, which are the dispatch's
tokens_per_expert (rows per local expert, aligned up to expert_alignment: known on the host in
exact-size mode, so no sync is added). Inside an expert, pairs follow the received rows (source
rank, then source token), which is the order a stable sort of the pairs by expert gives. A pair's
position is offset[e] plus the number of earlier rows that hit e: a prefix sum over the rows of the
[M, E_l] hit mask, on the device, with no sort and no host sync.

Worst-case mode (no host sync): the per-expert counts exist on the device only, so the layout
holds the static bound worst_case_pairs (every received row slot hitting min(K, E_l) experts, plus
each expert's alignment gap); the pairs after the last expert's block are padding (row -1, zero).

A row that names one local expert in several top-k slots has ONE pair for it (rows per expert are
counted that way), whose router weight is the sum of those slots' weights (float32, ascending k,
from +0.0); a combine's per-pair topk_weights go back to every slot of their pair.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .backends.base import record_event
from .row_sum import sum_rows, use_triton
from .types import DispatchHandle, DispatchResult, ExpertMajorLayout

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch layout serves
    triton = None


def worst_case_pairs(num_rows: int, num_topk: int, num_local_experts: int, alignment: int) -> int:
    """The most pairs num_rows received rows can give: each hits min(K, E_l) local experts, and each
    expert's block may end in alignment - 1 padding pairs."""
    return num_rows * min(num_topk, num_local_experts) + (alignment - 1) * num_local_experts


def build_layout(topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor], counts: Optional[list[int]],
                 counts_tensor: torch.Tensor, alignment: int) -> tuple[ExpertMajorLayout, Optional[torch.Tensor]]:
    """The layout of received rows with local expert ids topk_idx [M, K] (-1: elsewhere) and
    `counts` pairs per local expert (aligned; counts_tensor the same on the device; counts None in
    worst-case mode: worst_case_pairs pairs, the tail padding), and with topk_weights [M, K] each
    pair's router weight [P] float32 (the sum of its slots' weights in ascending k from +0.0; 0 for
    padding). On the device, without a host sync: one Triton kernel on CUDA (one program per local
    expert scans the rows), torch elsewhere; the same integers and bits."""
    m, k = topk_idx.shape
    tail = counts is None
    p = worst_case_pairs(m, k, counts_tensor.shape[0], alignment) if tail else sum(counts)
    if use_triton(topk_idx):
        rows, positions, slots, weights = _layout_triton(topk_idx, topk_weights, counts_tensor, p, tail)
    else:
        rows, positions, slots = _layout_torch(topk_idx, counts_tensor, p)
        weights = None if topk_weights is None else _pair_weights_torch(topk_weights, positions, p)
    return ExpertMajorLayout(rows, positions, slots, None if tail else list(counts), counts_tensor, alignment), weights


def _layout_torch(topk_idx: torch.Tensor, counts_tensor: torch.Tensor,
                  p: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows [P], positions [M, K], slots [M, K]) in torch ops (no boolean indexing: what has no pair
    is written to a spare entry)."""
    m, k = topk_idx.shape
    e_l, dev = counts_tensor.shape[0], topk_idx.device
    valid = topk_idx >= 0
    ids = topk_idx.clamp_min(0)
    hit = torch.zeros(m, e_l + 1, dtype=torch.bool, device=dev)
    hit.scatter_(1, torch.where(valid, topk_idx, e_l), True)
    # [M, E_l]: earlier rows that hit e, scanned along the last dimension of the transposed mask
    before = (torch.cumsum(hit[:, :e_l].t().contiguous(), 1, dtype=torch.int32) - 1).t()
    offsets = torch.cumsum(counts_tensor.to(torch.int64), 0) - counts_tensor
    positions = torch.where(valid, offsets[ids] + before.gather(1, ids), -1)
    first = valid.clone()
    for j in range(1, k):  # a slot repeating an earlier slot's expert is not its pair's first
        first[:, j] &= ~(topk_idx[:, j : j + 1] == topk_idx[:, :j]).any(1)
    slots = torch.where(first, positions, -1)
    rows = torch.full((p + 1,), -1, dtype=torch.int64, device=dev)
    row_of = torch.arange(m, device=dev).unsqueeze(1).expand(m, k)
    rows.scatter_(0, _or_spare(slots, p).reshape(-1), row_of.reshape(-1))  # each pair once, the rest to p
    return rows[:p], positions, slots


def _pair_weights_torch(topk_weights: torch.Tensor, positions: torch.Tensor, p: int) -> torch.Tensor:
    """[P] float32: each pair's slots' weights summed in ascending k from +0.0; 0 for padding."""
    out = torch.zeros(p + 1, dtype=torch.float32, device=topk_weights.device)
    for j in range(topk_weights.shape[1]):
        at = _or_spare(positions[:, j], p)  # one slot per row: distinct pairs, only p repeats
        out.scatter_(0, at, out[at] + topk_weights[:, j])
    return out[:p]


if triton is not None:

    @triton.jit
    def _layout_kernel(idx_ptr, w_ptr, counts_ptr, rows_ptr, pos_ptr, slots_ptr, pw_ptr, M, E_L, P,
                       K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr, BLOCK: tl.constexpr,
                       WEIGHTS: tl.constexpr):
        """Program e: local expert e's pairs. Its block starts at the sum of the counts before e; the
        rows are scanned in order, BLOCK at a time, and a row hitting e gets the next position (a
        prefix sum of the hits plus the rows before the block), written to every slot naming e
        (positions), to the first of them (slots; -1 to the others), and as the pair's row and
        weight (the slots' weights added in ascending k from +0.0). After the rows, the block's
        alignment padding gets row -1 and weight 0. Program 0 also writes -1 to the slots of no local expert.
        Rows and weights are stored only inside [0, P): counts that do not add up (a call that failed before
        its counts were written, whose layout is never used) cannot make it write out of bounds."""
        e = tl.program_id(0)
        ce = tl.arange(0, EP)
        offset = tl.sum(tl.where(ce < e, tl.load(counts_ptr + ce, mask=ce < E_L, other=0), 0), axis=0).to(tl.int64)
        count = tl.load(counts_ptr + e).to(tl.int64)
        ks = tl.arange(0, KP)
        carry = offset * 0
        for start in range(0, M, BLOCK):
            r = (start + tl.arange(0, BLOCK)).to(tl.int64)
            in_rows = r < M
            at = r[:, None] * K + ks[None, :]
            live = in_rows[:, None] & (ks[None, :] < K)
            idx = tl.load(idx_ptr + at, mask=live, other=-1)
            eq = (idx == e).to(tl.int32)
            hit = tl.max(eq, axis=1)
            pos = offset + carry + tl.cumsum(hit, axis=0).to(tl.int64) - 1
            pos2 = pos[:, None] + at * 0
            first = (eq == 1) & (tl.cumsum(eq, axis=1) == 1)
            mine = live & (eq == 1)
            none = live & (idx < 0) & (idx * 0 + e == 0)  # program 0 only
            tl.store(pos_ptr + at, tl.where(mine, pos2, -1), mask=mine | none)
            tl.store(slots_ptr + at, tl.where(first, pos2, -1), mask=mine | none)
            has = in_rows & (hit == 1) & (pos >= 0) & (pos < P)
            tl.store(rows_ptr + pos, r, mask=has)
            if WEIGHTS:
                acc = tl.zeros([BLOCK], dtype=tl.float32)
                for j in tl.static_range(K):
                    ij = tl.load(idx_ptr + r * K + j, mask=in_rows, other=-1)
                    acc += tl.load(w_ptr + r * K + j, mask=in_rows & (ij == e), other=0.0)
                tl.store(pw_ptr + pos, acc, mask=has)
            carry += tl.sum(hit, axis=0).to(tl.int64)
        for start in range(0, tl.minimum(count - carry, P), BLOCK):  # alignment padding
            q = offset + carry + start + tl.arange(0, BLOCK)
            pad = (q < offset + count) & (q >= 0) & (q < P)
            tl.store(rows_ptr + q, q * 0 - 1, mask=pad)
            if WEIGHTS:
                tl.store(pw_ptr + q, tl.zeros([BLOCK], dtype=tl.float32), mask=pad)


def _layout_triton(topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor], counts_tensor: torch.Tensor,
                   p: int, tail: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """_layout_kernel: (rows [P], positions [M, K], slots [M, K], pair weights [P] or None); with
    `tail` (worst-case mode) the pairs after the last block, which no program writes, are padding."""
    m, k = topk_idx.shape
    e_l = counts_tensor.shape[0]
    dev = topk_idx.device
    rows = torch.full((p,), -1, dtype=torch.int64, device=dev) if tail else torch.empty(p, dtype=torch.int64, device=dev)
    positions, slots = torch.empty_like(topk_idx), torch.empty_like(topk_idx)
    weights = None
    if topk_weights is not None:
        weights = (torch.zeros if tail else torch.empty)(p, dtype=torch.float32, device=dev)
    if e_l and (m or p):
        _layout_kernel[(e_l,)](topk_idx, topk_weights if weights is not None else rows, counts_tensor, rows,
                               positions, slots, weights if weights is not None else rows, m, e_l, p, K=k,
                               KP=triton.next_power_of_2(k), EP=triton.next_power_of_2(e_l), BLOCK=512,
                               WEIGHTS=weights is not None, num_warps=4)
    return rows, positions, slots, weights


def _or_spare(at: torch.Tensor, p: int) -> torch.Tensor:
    """Pair positions with -1 (no pair) sent to the spare entry p of a [P + 1] scatter target."""
    return torch.where(at >= 0, at, p)


def gather(t: Optional[torch.Tensor], layout: ExpertMajorLayout) -> Optional[torch.Tensor]:
    """Rows t [M, ...] as pairs [P, ...] (one pass; one more zeroes padding pairs: alignment gaps,
    and the tail in worst-case mode)."""
    if t is None:
        return None
    out = t.index_select(0, layout.rows.clamp_min(0))
    if layout.alignment > 1 or layout.counts is None:
        bits = out.view(torch.uint8) if out.element_size() == 1 else out  # no masked_fill for e4m3
        bits.masked_fill_((layout.rows < 0).view(-1, *[1] * (t.dim() - 1)), 0)
    return out


def layout_of(result: DispatchResult, alignment: int
              ) -> tuple[ExpertMajorLayout, DispatchHandle, Optional[torch.Tensor]]:
    """A row dispatch's pair layout: its handle's for a cached dispatch, else a new one (with the handle
    that carries it and the per-pair router weights)."""
    layout = result.handle.expert_major
    if layout is not None:
        return layout, result.handle, None
    layout, weights = build_layout(result.topk_idx, result.topk_weights, result.tokens_per_expert,
                                   result.tokens_per_expert_tensor, alignment)
    return layout, dataclasses.replace(result.handle, expert_major=layout), weights


def gather_rows(result: DispatchResult, layout: ExpertMajorLayout) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The received rows (and scales) as pairs, by one gather: the reference backend and the cross-node
    engine (the NVLink engine copies the pairs straight from its workspace instead)."""
    return gather(result.x, layout), gather(result.x_scales, layout)


def as_pairs(result: DispatchResult, layout: ExpertMajorLayout, handle: DispatchHandle,
             weights: Optional[torch.Tensor], x: torch.Tensor, scales: Optional[torch.Tensor]) -> DispatchResult:
    """A row dispatch's result as its expert-major one: the pairs (x, scales) for rows, the layout in
    the handle, the per-pair router weights of a fresh dispatch; the event, when async, recorded again
    after the expansion."""
    event = result.event
    if event is not None:
        event = record_event(True, x.device, event.check)
    return dataclasses.replace(result, x=x, x_scales=scales, tokens_per_expert=layout.counts,
                               tokens_per_expert_tensor=layout.counts_tensor, handle=handle, event=event,
                               pair_weights=weights)


def expand(result: DispatchResult, alignment: int) -> DispatchResult:
    """A row dispatch's result as pairs, gathered from its received rows (the reference backend)."""
    layout, handle, weights = layout_of(result, alignment)
    return as_pairs(result, layout, handle, weights, *gather_rows(result, layout))


def combine_inputs(x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor],
                   pair_weights: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """What a backend's combine exchanges: for an expert-major handle, rows [M, H] bf16, each the sum
    of its pairs of x [P, H] (bf16 or float32; times pair_weights [P] when given) in ascending k, in
    float32 from +0.0, rounded once; and topk_weights [P] as [M, K] (each slot its pair's value, 0
    where the expert is elsewhere). A handle of a row dispatch: x and topk_weights as given."""
    layout = handle.expert_major
    if layout is None:
        return x, topk_weights
    rows = sum_rows(x, layout.slots, torch.bfloat16, pair_weights)
    if topk_weights is not None:
        at = layout.positions
        topk_weights = torch.where(at >= 0, topk_weights[at.clamp_min(0)], topk_weights.new_zeros(()))
    return rows, topk_weights
