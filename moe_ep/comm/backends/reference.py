"""Pure torch.distributed backend: the oracle, the CPU default and the NCCL baseline.

Every exchange is one `all_to_all_single` of packed byte rows after a header exchange of fixed size
(HEADER_WORDS int64 per peer: the rows this rank sends it, then the call's stamp, call_check), so it
runs on gloo (CPU) and NCCL (GPU) alike. Every call opens with the header exchange, whatever its kind:
ranks that make different calls meet there, so call_check.verify raises on every rank before any
exchange whose sizes depend on the call. Dispatches carry their counts in it; combines, which need
no counts, pay one small extra exchange for it (their row exchange's sizes come from the handle).
CUDA tensors over a gloo group (ranks sharing a GPU, docs/one_gpu.md) are staged through host
memory: correct and slow. Arithmetic follows docs/api.md to the bit.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .. import expert_major as pairs
from .. import fp8, nvfp4
from ..call_check import STAMP_WORDS, CallStamp, OwnRejection, input_error, verify
from ..errors import CommTimeoutError
from ..types import (
    DispatchHandle,
    DispatchLayout,
    DispatchResult,
    LowLatencyCombineResult,
    LowLatencyDispatchResult,
    LowLatencyHandle,
    LowLatencyOverlap,
)
from .base import Backend, BufferConfig, align_up, record_event

HEADER_WORDS = 1 + STAMP_WORDS  # per peer: rows sent to it, then the stamp


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """View a [M, ...] tensor as [M, nbytes] uint8 (no copy when contiguous)."""
    row_bytes = t.element_size() * math.prod(t.shape[1:])
    return t.contiguous().view(-1).view(torch.uint8).reshape(t.shape[0], row_bytes)  # view(-1): unit stride


def _pack(parts: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[int, torch.dtype, tuple[int, ...]]]]:
    """Concatenate per-row byte views (one part: its view, no copy); return the packed rows and how to
    unpack them."""
    specs = [(_as_bytes(p).shape[1], p.dtype, tuple(p.shape[1:])) for p in parts]
    if len(parts) == 1:
        return _as_bytes(parts[0]), specs
    return torch.cat([_as_bytes(p) for p in parts], dim=1), specs


def _unpack(rows: torch.Tensor, specs: list[tuple[int, torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
    """The parts of packed rows (one part: a view of them, no copy)."""
    out, col = [], 0
    for nbytes, dtype, shape in specs:
        part = rows[:, col : col + nbytes]
        if len(specs) > 1:
            part = part.clone(memory_format=torch.contiguous_format)  # fresh storage, aligned
        out.append(part.view(dtype).reshape(rows.shape[0], *shape))
        col += nbytes
    return out


@dataclass(frozen=True)
class ReferenceDispatchState:
    """Backend-private part of a DispatchHandle made by the reference backend (the native backends'
    are intranode.DispatchState and internode.NodeDispatchState): what combine and a cached dispatch reuse."""

    recv_counts: list[int]  # rows received from each rank (worst-case mode too)
    tokens_per_expert: list[int]  # raw received rows per local expert


class ReferenceBackend(Backend):
    """All-to-all over the Buffer's process group; fresh tensors for every result."""

    name = "reference"

    def __init__(self, cfg: BufferConfig) -> None:
        super().__init__(cfg)
        # gloo moves host tensors: CUDA tensors go through host memory
        self._staged = cfg.device.type == "cuda" and dist.get_backend(cfg.group) != "nccl"
        self._failed: Optional[str] = None  # the phase of the exchange that failed; the Buffer is then unusable
        # fault-tolerant mode: 1 per rank the low-latency calls skip (set from Python only: a timeout here
        # still raises CommTimeoutError, see docs/api.md)
        self._mask = torch.zeros(cfg.world_size, dtype=torch.int32, device=cfg.device) if cfg.fault_tolerant else None

    # ---- helpers -------------------------------------------------------------------------
    def _all_to_all(self, phase: str, out: torch.Tensor, inp: torch.Tensor, out_split: Optional[list[int]] = None,
                    in_split: Optional[list[int]] = None, dead: Sequence[int] = ()) -> torch.Tensor:
        """all_to_all_single into `out` (returned), through host memory when the group cannot move `inp`;
        with `dead` ranks (masked; splits given) by point-to-point messages among the others, leaving the
        dead ranks' parts of `out` as they were (zero when staged). Gives up after timeout_s with
        CommTimeoutError (peer unknown: -1) naming `phase`."""
        cfg = self.cfg
        if self._failed is not None:
            raise RuntimeError(f"moe_ep rank {cfg.rank}: this Buffer's exchange '{self._failed}' failed, so the "
                               "Buffer and its process group are unusable (docs/api.md, Errors)")
        src = inp.cpu() if self._staged else inp
        host = (torch.zeros if dead else torch.empty)(out.shape, dtype=out.dtype) if self._staged else out
        try:
            if dead:
                self._point_to_point(host, src, out_split, in_split, dead)
            else:
                opts = dist.AllToAllOptions()
                opts.timeout = timedelta(seconds=cfg.timeout_s)  # the op itself gives up: nothing is left waiting
                opts.asyncOp = True
                work = cfg.group.alltoall_base(host, src, out_split or [], in_split or [], opts)  # torch 2.11+
                work.wait(timedelta(seconds=cfg.timeout_s + 1))  # a bound for groups that do not honour opts.timeout
        except RuntimeError as error:
            self._failed = phase
            if "timeout" in str(error).lower() or "timed out" in str(error).lower():
                said = (str(error).strip().splitlines() or [""])[0]  # gloo's first line, not its C++ frames
                raise CommTimeoutError(cfg.rank, -1, phase, cfg.timeout_s, f"{dist.get_backend(cfg.group)}: {said}") \
                    from None
            raise
        return out.copy_(host) if self._staged else out

    def _point_to_point(self, out: torch.Tensor, inp: torch.Tensor, out_split: list[int], in_split: list[int],
                        dead: Sequence[int]) -> None:
        """_all_to_all's exchange as isend/irecv pairs with every live peer (no empty message; nothing to
        or from a dead one), then waits for all of them (timeout_s each)."""
        cfg = self.cfg
        in_at, out_at = [0, *itertools.accumulate(in_split)], [0, *itertools.accumulate(out_split)]
        out[out_at[cfg.rank]:out_at[cfg.rank + 1]] = inp[in_at[cfg.rank]:in_at[cfg.rank + 1]]
        works = []
        for peer in range(cfg.world_size):
            if peer == cfg.rank or peer in dead:
                continue
            peer_global = dist.get_global_rank(cfg.group, peer)
            if in_split[peer]:
                works.append(dist.isend(inp[in_at[peer]:in_at[peer + 1]].contiguous(), peer_global, cfg.group))
            if out_split[peer]:
                works.append(dist.irecv(out[out_at[peer]:out_at[peer + 1]], peer_global, cfg.group))
        for work in works:
            work.wait(timedelta(seconds=cfg.timeout_s))

    def rank_mask(self) -> torch.Tensor:
        if self._mask is None:
            return super().rank_mask()
        return self._mask

    def _dead(self) -> list[int]:
        """The ranks masked in fault-tolerant mode (a host read of the mask)."""
        return [] if self._mask is None else torch.nonzero(self._mask.cpu()).flatten().tolist()

    def _exchange_header(self, phase: str, stamp: CallStamp, send_counts: Optional[torch.Tensor] = None,
                         dead: Sequence[int] = ()) -> list[int]:
        """The call's header exchange (module docstring): rows from each rank (0 to and from dead ranks);
        raises on every rank alike (call_check.verify) when the live ranks made different calls or one
        rejected its input."""
        r = self.cfg.world_size
        header = torch.zeros(r, HEADER_WORDS, dtype=torch.int64)
        if send_counts is not None:
            header[:, 0] = send_counts.cpu()
        header[:, 1:] = torch.tensor(stamp.words, dtype=torch.int64)
        if not self._staged and self.cfg.device.type == "cuda":
            header = header.to(self.cfg.device)
        ones = [1] * r  # one row per rank, in rank order; a dead rank's row is not exchanged and stays 0
        got = self._all_to_all(f"{phase} header", torch.zeros_like(header), header, ones, ones, dead).cpu()
        got[list(dead), 1:] = torch.tensor(stamp.words, dtype=torch.int64)  # masked ranks take no part
        verify(stamp, got[:, 1:].tolist(), self.cfg.rank)
        return got[:, 0].tolist()

    def _all_to_all_rows(self, phase: str, rows: torch.Tensor, send_counts: list[int],
                         recv_counts: list[int], dead: Sequence[int] = ()) -> torch.Tensor:
        return self._all_to_all(f"{phase} rows", rows.new_empty((sum(recv_counts), rows.shape[1])), rows,
                                recv_counts, send_counts, dead)

    def _rank_mask(self, topk_idx: torch.Tensor) -> torch.Tensor:
        """[N, R] bool: token n has at least one expert on rank r."""
        r = self.cfg.world_size
        owner = torch.where(topk_idx >= 0, topk_idx // self.cfg.num_local_experts, r)
        mask = torch.zeros(topk_idx.shape[0], r + 1, dtype=torch.bool, device=topk_idx.device)
        mask.scatter_(1, owner, True)
        return mask[:, :r].contiguous()

    def _local_ids(self, topk_idx: torch.Tensor) -> torch.Tensor:
        """Global expert ids -> this rank's local ids, -1 where the expert lives elsewhere."""
        e_l, me = self.cfg.num_local_experts, self.cfg.rank
        local = topk_idx - me * e_l
        return torch.where((topk_idx >= 0) & (local >= 0) & (local < e_l), local, -1)

    # ---- normal mode -----------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor) -> DispatchLayout:
        e = self.cfg.num_experts
        is_token_in_rank = self._rank_mask(topk_idx)
        per_expert = torch.zeros(topk_idx.shape[0], e + 1, dtype=torch.bool, device=topk_idx.device)
        per_expert.scatter_(1, torch.where(topk_idx >= 0, topk_idx, e), True)
        return DispatchLayout(
            num_tokens_per_rank=is_token_in_rank.sum(0, dtype=torch.int32),
            num_tokens_per_expert=per_expert[:, :e].sum(0, dtype=torch.int32),
            is_token_in_rank=is_token_in_rank,
        )

    def dispatch(self, x, x_scales, topk_idx, topk_weights, *, handle, expert_alignment, worst_case, expert_major,
                 num_sms, knobs, async_op, stamp) -> DispatchResult:
        cfg = self.cfg
        cached = handle is not None
        mask = handle.is_token_in_rank if cached else self._rank_mask(topk_idx)
        worst_case = handle.worst_case if cached else worst_case
        n = x.shape[0]
        token_ids = torch.arange(n, device=x.device, dtype=torch.int32)
        send_idx = torch.cat([token_ids[mask[:, r]] for r in range(cfg.world_size)]).long()
        send_counts = mask.sum(0).to(torch.int64)
        recv_counts = self._exchange_header("reference dispatch", stamp, send_counts)
        parts = [x[send_idx]] + ([x_scales[send_idx]] if x_scales is not None else [])
        parts.append(send_idx.to(torch.int32).unsqueeze(1))
        if not cached:
            parts += [topk_idx[send_idx], topk_weights[send_idx]]
        rows, specs = _pack(parts)
        got = _unpack(self._all_to_all_rows("reference dispatch", rows, send_counts.tolist(), recv_counts), specs)
        recv_x = got.pop(0)
        recv_scales = got.pop(0) if x_scales is not None else None
        recv_src_index = got.pop(0).squeeze(1)
        recv_rank = torch.repeat_interleave(
            torch.arange(cfg.world_size, device=x.device, dtype=torch.int32),
            torch.tensor(recv_counts, device=x.device),
        )
        if cached:
            recv_topk, recv_weights = None, None
            tokens_per_expert_raw = handle.state.tokens_per_expert
        else:
            recv_topk = self._local_ids(got[0])
            recv_weights = torch.where(recv_topk >= 0, got[1], torch.zeros_like(got[1]))
            hit = torch.zeros(recv_topk.shape[0], cfg.num_local_experts + 1, dtype=torch.bool, device=x.device)
            hit.scatter_(1, torch.where(recv_topk >= 0, recv_topk, cfg.num_local_experts), True)
            tokens_per_expert_raw = hit[:, : cfg.num_local_experts].sum(0).tolist()
        tokens_per_expert = align_up(tokens_per_expert_raw, expert_alignment)

        if worst_case:
            t = cfg.max_tokens_per_rank
            rows_at = torch.cat([
                torch.arange(s * t, s * t + c, device=x.device) for s, c in enumerate(recv_counts)
            ]).long()
            m = cfg.world_size * t

            def spread(v: Optional[torch.Tensor], fill: float) -> Optional[torch.Tensor]:
                """Place the packed rows at their worst-case positions; padding gets `fill`."""
                if v is None:
                    return None
                out = torch.full((m, *v.shape[1:]), fill, dtype=v.dtype, device=v.device)
                out[rows_at] = v
                return out

            recv_x = spread(recv_x.view(torch.uint8), 0).view(recv_x.dtype)
            recv_scales = spread(recv_scales, 0)
            recv_topk = spread(recv_topk, -1)
            recv_weights = spread(recv_weights, 0)
            recv_rank = spread(recv_rank, -1)
            recv_src_index = spread(recv_src_index, -1)

        new_handle = handle if cached else DispatchHandle(
            buffer_id=cfg.buffer_id,
            num_tokens=n,
            num_recv_rows=recv_x.shape[0],
            is_token_in_rank=mask,
            recv_counts=None if worst_case else recv_counts,
            src_rank=recv_rank,
            src_index=recv_src_index,
            worst_case=worst_case,
            state=ReferenceDispatchState(recv_counts, tokens_per_expert_raw),
        )
        result = DispatchResult(
            x=recv_x,
            x_scales=recv_scales,
            topk_idx=recv_topk,
            topk_weights=recv_weights,
            tokens_per_expert=None if worst_case else tokens_per_expert,
            tokens_per_expert_tensor=torch.tensor(tokens_per_expert, dtype=torch.int32, device=x.device),
            src_rank=recv_rank,
            src_index=recv_src_index,
            handle=new_handle,
            event=record_event(async_op, x.device),
        )
        return pairs.expand(result, expert_alignment) if expert_major else result

    def combine(self, x, handle, *, topk_weights, pair_weights, num_sms, knobs, async_op, stamp):
        self._exchange_header("reference combine", stamp)
        x, topk_weights = pairs.combine_inputs(x, handle, topk_weights, pair_weights)
        recv_counts = handle.state.recv_counts
        parts = [x] if topk_weights is None else [x, topk_weights]
        if handle.worst_case:
            valid = handle.src_rank >= 0
            parts = [p[valid] for p in parts]
        send_back = handle.is_token_in_rank.sum(0).tolist()
        rows, specs = _pack(parts)
        back = _unpack(self._all_to_all_rows("reference combine", rows, recv_counts, send_back), specs)
        out = self._sum_back(back[0], handle, send_back, round_partials=True).to(torch.bfloat16)
        weights = self._sum_back(back[1], handle, send_back, round_partials=False) if topk_weights is not None else None
        return out, weights, record_event(async_op, x.device)

    def _sum_back(self, back: torch.Tensor, handle: DispatchHandle, send_back: list[int],
                  round_partials: bool) -> torch.Tensor:
        """float32 [N, C]: each token's returned values summed on two levels (docs/api.md): per node, a
        float32 sum over its receiving ranks in ascending order (rounded to bf16 with round_partials: a
        row partial crosses the network as bf16, weights stay float32); then a float32 sum of those
        partials over the receiving nodes in ascending order. Both sums start at +0.0."""
        cfg, mask = self.cfg, handle.is_token_in_rank
        starts = [0, *itertools.accumulate(send_back)]  # rows from rank r: back[starts[r] : starts[r + 1]]
        acc = torch.zeros(handle.num_tokens, back.shape[1], dtype=torch.float32, device=back.device)
        for node in range(cfg.num_nodes):
            ranks = range(node * cfg.ranks_per_node, (node + 1) * cfg.ranks_per_node)
            partial = torch.zeros_like(acc)
            for r in ranks:
                idx = mask[:, r].nonzero().squeeze(1)
                partial[idx] = partial[idx] + back[starts[r] : starts[r + 1]].float()
            if round_partials:
                partial = partial.to(torch.bfloat16).float()
            idx = mask[:, ranks.start : ranks.stop].any(dim=1).nonzero().squeeze(1)
            acc[idx] = acc[idx] + partial[idx]
        return acc

    # ---- low-latency mode -----------------------------------------------------------------
    def low_latency_dispatch(self, x, topk_idx, *, use_fp8, round_scale, use_ue8m0, use_nvfp4, x_global_scale,
                             return_recv_hook, async_op, stamp):
        cfg = self.cfg
        e_l, slots = cfg.num_local_experts, cfg.world_size * cfg.max_tokens_per_rank
        layout = nvfp4.NvFp4Layout(e_l, slots, cfg.hidden)
        out_scales = None
        if use_nvfp4:  # values and scales in their storage order, zeroed; the result holds DeepEP's views
            out_x, out_scales = layout.empty_values(x.device), layout.empty_scales(x.device)
        else:
            out_dtype = torch.float8_e4m3fn if use_fp8 else torch.bfloat16
            out_x = torch.zeros(e_l, slots, cfg.hidden, dtype=out_dtype, device=x.device)
        if use_fp8:  # DeepEP's token-major layout per expert, zeroed
            num, dtype = (cfg.num_scales // 4, torch.int32) if use_ue8m0 else (cfg.num_scales, torch.float32)
            out_scales = fp8.expert_major_scales(e_l, slots, num, dtype, x.device).zero_()
        count = torch.zeros(e_l, dtype=torch.int32, device=x.device)
        src_rank = torch.full((e_l, slots), -1, dtype=torch.int32, device=x.device)
        src_index = torch.full((e_l, slots), -1, dtype=torch.int32, device=x.device)
        handle = LowLatencyHandle(cfg.buffer_id, x.shape[0], src_rank, src_index, count)
        x_in, topk_in = x.clone(), topk_idx.clone()
        scale_in = x_global_scale.clone() if use_nvfp4 else None

        def receive() -> None:
            if use_nvfp4:  # each rank casts its own rows (DeepEP's sender-side cast)
                rows = nvfp4.quantize(x_in, scale_in)
                payload = [rows.values, rows.scales.view(torch.uint8)]
            else:
                payload = list(fp8.quantize(x_in, round_scale)) if use_fp8 else [x_in]
            if use_ue8m0:
                payload[1] = fp8.pack_ue8m0(payload[1])
            dead = self._dead()
            mask = self._rank_mask(topk_in)
            mask[:, dead] = False  # masked ranks get nothing
            token_ids = torch.arange(x_in.shape[0], device=x.device, dtype=torch.int32)
            send_idx = torch.cat([token_ids[mask[:, r]] for r in range(cfg.world_size)]).long()
            send_counts = mask.sum(0).to(torch.int64)
            recv_counts = self._exchange_header("reference low-latency dispatch", stamp, send_counts, dead)
            rows, specs = _pack([p[send_idx] for p in payload] + [send_idx.to(torch.int32).unsqueeze(1), topk_in[send_idx]])
            got = _unpack(self._all_to_all_rows("reference low-latency dispatch", rows, send_counts.tolist(), recv_counts,
                                                dead), specs)
            recv_topk, recv_index = got[-1], got[-2].squeeze(1)
            recv_rank = torch.repeat_interleave(
                torch.arange(cfg.world_size, device=x.device, dtype=torch.int32),
                torch.tensor(recv_counts, device=x.device),
            )
            # One entry per (row, distinct local expert), in (source rank, token) order; a stable
            # sort by expert keeps that order inside each expert.
            local = self._local_ids(recv_topk)
            repeat = torch.zeros_like(local, dtype=torch.bool)
            for k in range(1, cfg.num_topk):
                repeat[:, k] = (local[:, k : k + 1] == local[:, :k]).any(dim=1)
            pairs = ((local >= 0) & ~repeat).flatten().nonzero().squeeze(1)
            experts = local.flatten()[pairs]
            order = torch.argsort(experts, stable=True)
            pairs, experts = pairs[order], experts[order]
            per_expert = torch.bincount(experts, minlength=e_l)
            first = torch.cumsum(per_expert, 0) - per_expert
            slot = torch.arange(pairs.numel(), device=x.device) - first[experts]
            row = pairs // cfg.num_topk
            out_x[experts, slot] = got[0][row]
            if use_fp8:
                out_scales[experts, slot] = got[1][row]
            if use_nvfp4:
                linear = torch.zeros(e_l, slots, layout.num_scales, dtype=torch.uint8, device=x.device)
                linear[experts, slot] = got[1][row]
                out_scales.copy_(layout.swizzle(linear))
            count.copy_(per_expert.to(torch.int32))
            src_rank[experts, slot] = recv_rank[row]
            src_index[experts, slot] = recv_index[row]

        if not return_recv_hook:
            receive()
        views = (layout.values_view(out_x), layout.scales_view(out_scales)) if use_nvfp4 else (out_x, out_scales)
        return LowLatencyDispatchResult(*views, count, handle, receive if return_recv_hook else None)

    def _short_signal(self, handle: LowLatencyHandle, overlap: LowLatencyOverlap) -> Optional[ValueError]:
        """Overlap: the error for the first (local expert, block of block_m rows) holding rows whose
        comp_signal word is below the threshold, after the device's work so far (the native kernel would
        wait for it, DeepEP's forever); None when every such word reached it. Reads the count only."""
        cfg = self.cfg
        if handle.count.is_cuda:
            torch.cuda.synchronize(handle.count.device)
        m, blocks = overlap.block_m, overlap.signal_blocks
        words = overlap.comp_signal[: cfg.num_local_experts * blocks].view(cfg.num_local_experts, blocks).cpu()
        count = handle.count.cpu().long()
        with_rows = torch.arange(blocks) < ((count + m - 1) // m).unsqueeze(1)
        short = (with_rows & (words < overlap.threshold)).nonzero()
        if not short.numel():
            return None
        e, j = short[0].tolist()
        return input_error(ValueError, "comp_signal", "value",
                           f"comp_signal[{e * blocks + j}] = {int(words[e, j])} is below threshold {overlap.threshold}: "
                           f"local expert {e}, block {j} (rows {j * m}..{min((j + 1) * m, int(count[e])) - 1}) "
                           "was not signalled computed when the combine read it (DeepEP's kernel would wait there "
                           "forever)")

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, *, return_recv_hook, async_op, overlap, stamp):
        """With `overlap` the rows are read (cloned) now, so every comp_signal word covering rows must
        already be at the threshold: otherwise this rank takes part as rejecting its input and raises
        ValueError naming the first short word, its peers PeerInputError."""
        cfg = self.cfg
        n, k_top = topk_idx.shape
        out = torch.empty(n, cfg.hidden, dtype=torch.bfloat16, device=x.device)
        short = self._short_signal(handle, overlap) if overlap is not None else None
        if short is not None:
            stamp = stamp.rejecting(short)
        x_in, topk_in, weights_in = x.clone(), topk_idx.clone(), topk_weights.clone()

        def receive() -> None:
            e_all, e_l = cfg.num_experts, cfg.num_local_experts
            dead = self._dead()
            try:
                self._exchange_header("reference low-latency combine", stamp, dead=dead)
            except OwnRejection:
                if short is None:
                    raise
                raise short from None
            slots = torch.arange(x_in.shape[1], device=x.device)
            valid = slots.unsqueeze(0) < handle.count.unsqueeze(1)  # [E_l, R*T]
            valid &= ~torch.isin(handle.src_rank, torch.tensor(dead, dtype=torch.int32, device=x.device))
            experts, slot = valid.nonzero(as_tuple=True)
            src = handle.src_rank[experts, slot].long()
            token = handle.src_index[experts, slot].long()
            # Rows go back to their source in (token, global expert) order.
            key = (src * cfg.max_tokens_per_rank + token) * e_all + experts + cfg.rank * e_l
            order = torch.argsort(key)
            rows = x_in[experts[order], slot[order]]
            send_counts = torch.bincount(src, minlength=cfg.world_size)
            owner = torch.where(topk_in >= 0, topk_in // e_l, -1)
            owner[torch.isin(owner, torch.tensor(dead, dtype=owner.dtype, device=x.device))] = -1  # dropped
            tokens = torch.arange(n, device=x.device).unsqueeze(1).expand(n, k_top)
            pair_key = tokens * e_all + topk_in
            keys = [torch.unique(pair_key[owner == r]) for r in range(cfg.world_size)]
            back = self._all_to_all_rows("reference low-latency combine", _as_bytes(rows), send_counts.tolist(),
                                         [k.numel() for k in keys], dead)
            back = back.view(torch.bfloat16)
            gathered = torch.zeros(n, k_top, cfg.hidden, dtype=torch.bfloat16, device=x.device)
            start = 0
            for r in range(cfg.world_size):
                tok, kk = (owner == r).nonzero(as_tuple=True)
                gathered[tok, kk] = back[start + torch.searchsorted(keys[r], pair_key[tok, kk])]
                start += keys[r].numel()
            acc = torch.zeros(n, cfg.hidden, dtype=torch.float32, device=x.device)
            for kk in range(k_top):
                term = weights_in[:, kk, None] * gathered[:, kk].float()
                acc = torch.where((owner[:, kk] >= 0).unsqueeze(1), acc + term, acc)
            out.copy_(acc.to(torch.bfloat16))

        if not return_recv_hook:
            receive()
        return LowLatencyCombineResult(out, receive if return_recv_hook else None)
