"""DeepEP's HybridEP API (`deep_ep.HybridEPBuffer` and `deep_ep.hybrid_ep_buffer.indices_to_map`, DeepEP
branch hybrid-ep) served by moe_ep, so Megatron-Core's and torchtitan's "hybridep" paths run unchanged.

`dispatch_with_permute` is one expert-major `moe_ep.Buffer.dispatch` (each received token once per
local expert it selected, grouped by local expert, each group padded to `pad_multiple` with zero
rows; inside a group, source rank then source token: HybridEP's order), `combine_with_unpermute`
the matching combine (an unweighted sum per token; with per-row probs, their dense [N, E] gradient).
Blocking mode is moe_ep's exact-size mode (one host sync, as HybridEP's); `non_blocking` is its
worst-case mode (no host sync): the pairs come in a static bound and the first
`num_permuted_tokens` are returned, the rest dropped and flagged in the handle's overflow_flag. A
call with a handle (the backward of combine) is a cached dispatch. Every difference:
docs/deep_ep_compat.md, HybridEP.

HybridEP takes a routing map (or top-k indices) and the constructor gives no top-k, so the moe_ep
Buffers carry min(E, 16) top-k columns (16 = moe_ep's top-k limit); they are made lazily from the
first call's shapes, one per (hidden, num_experts), as every rank makes the same calls.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist

import moe_ep
from moe_ep.comm import _native
from moe_ep.comm.buffer import _device_of
from moe_ep.deep_ep.factory import BufferFactory
from moe_ep.deep_ep.v1 import _unsupported

# What HybridEP's dispatch_with_permute returns: (hidden, probs, scaling_factor, tokens_per_expert, handle).
DispatchResult = tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], torch.Tensor, "HybridEPHandle"]


def indices_to_map(topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor], num_of_tokens: int,
                   num_of_experts: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(routing_map [N, E] bool, probs [N, E] float32 or None) from top-k ids and weights, on topk_idx's
    device; a -1 id selects nothing (DeepEP's scatter fails on it)."""
    if topk_idx.shape[0] != num_of_tokens:
        raise ValueError(f"topk_idx has {topk_idx.shape[0]} rows, num_of_tokens is {num_of_tokens}")
    at = torch.where(topk_idx >= 0, topk_idx, num_of_experts).long()  # -1 goes to a spare column
    dev = topk_idx.device
    routing_map = torch.zeros(num_of_tokens, num_of_experts + 1, dtype=torch.bool, device=dev)
    routing_map.scatter_(1, at, True)
    probs = None
    if topk_weights is not None:
        probs = torch.zeros(num_of_tokens, num_of_experts + 1, dtype=torch.float32, device=dev)
        probs.scatter_(1, at, topk_weights.float())
        probs = probs[:, :num_of_experts]
    return routing_map[:, :num_of_experts], probs


@dataclass
class BufferConfig:
    """The sizes a HybridEPBuffer was made for (DeepEP's `configurer.buffer_config`, which frameworks
    compare to decide whether to make a new buffer)."""

    hidden_dim: int
    max_num_of_tokens_per_rank: int
    num_of_experts_per_rank: int
    num_of_ranks_per_node: int
    num_of_nodes: int


@dataclass
class Configurer:
    """DeepEP's `HybridEPBuffer.configurer`: only `buffer_config` is kept (moe_ep compiles no kernel per config)."""

    buffer_config: BufferConfig


@dataclass(frozen=True)
class HybridEpConfigInstance:
    """One call's configuration, as the 10th element of a dispatch handle."""

    hidden_dim: int
    num_of_tokens_per_rank: int
    num_of_experts_per_rank: int
    num_of_ranks_per_node: int
    num_of_nodes: int
    pad_multiple: int


class HybridEPHandle(tuple):
    """HybridEP's 11-element handle tuple (sparse_to_dense_map, rdma_to_attn_map, attn_to_rdma_map,
    num_dispatched_tokens_tensor, local_expert_routing_map, dense_chunk_layout, dense_to_expert_map,
    tokens_per_expert, num_of_tokens_per_rank, config, overflow_flag). moe_ep has no chunk maps, so
    positions 0-2 and 4-6 are None; `overflow_flag` (last, int32 [1] on the device) is 1 when pairs past
    num_permuted_tokens were dropped. The moe_ep Buffer and handle it stands for ride along."""

    buffer: moe_ep.Buffer
    inner: moe_ep.DispatchHandle
    topk_idx: torch.Tensor  # [N, K] the dispatch's global expert ids (-1: none), for the dense probs gradient
    num_experts: int
    num_permuted_tokens: int  # rows of the dispatch's output

    def __new__(cls, fields: tuple, buffer: moe_ep.Buffer, inner: moe_ep.DispatchHandle, topk_idx: torch.Tensor,
                num_experts: int, num_permuted_tokens: int) -> "HybridEPHandle":
        self = super().__new__(cls, fields)
        self.buffer, self.inner, self.topk_idx = buffer, inner, topk_idx
        self.num_experts, self.num_permuted_tokens = num_experts, num_permuted_tokens
        return self


def _fit(t: Optional[torch.Tensor], rows: int) -> Optional[torch.Tensor]:
    """t's first `rows` rows, zero rows appended when it has fewer."""
    if t is None or t.shape[0] == rows:
        return t
    if t.shape[0] > rows:
        return t[:rows].contiguous()
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])


def _kept(counts: torch.Tensor, limit: int) -> torch.Tensor:
    """Per-expert counts int64 after keeping the first `limit` rows of their concatenated blocks."""
    end = torch.cumsum(counts.to(torch.int64), 0)
    return end.clamp(max=limit) - (end - counts).clamp(max=limit)


def _as_rows(n: Union[int, torch.Tensor, None], what: str) -> Optional[int]:
    """A row count given as an int or a one-element tensor (Megatron passes tokens_per_expert.sum())."""
    if n is None:
        return None
    n = int(n.item()) if isinstance(n, torch.Tensor) else n
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"{what} must be a non-negative int, got {n!r}")
    return n


class HybridEPBuffer:
    """DeepEP's `HybridEPBuffer` served by moe_ep. Creating it is collective over `group` (it resolves
    the node layout); the moe_ep Buffers behind it are made by the first dispatch of each shape.

    Keyword-only extension (not in DeepEP): `backend` (moe_ep's: "auto", "reference" or "nvshmem")."""

    def __init__(self, group: Optional[dist.ProcessGroup], hidden_dim: int, max_num_of_tokens_per_rank: int,
                 num_local_experts: int, use_fp8: bool = False, num_sms_dispatch_api: Optional[int] = None,
                 num_sms_combine_api: Optional[int] = None, num_sms_preprocessing_api: Optional[int] = None,
                 num_blocks_permute: Optional[int] = None, num_blocks_unpermute: Optional[int] = None,
                 load_cached_kernels: bool = False, use_shared_buffer: bool = True,
                 enable_custom_allgather: bool = False, num_of_hybrid_ep_ranks_per_nvlink_domain: Optional[int] = None,
                 use_mnnvl: Optional[bool] = None, *, backend: str = "auto") -> None:
        if use_mnnvl:
            raise _unsupported("use_mnnvl=True", "moe_ep's NVLink domain is one host (multi-node NVLink is not served)")
        for name, value in (("hidden_dim", hidden_dim), ("max_num_of_tokens_per_rank", max_num_of_tokens_per_rank),
                            ("num_local_experts", num_local_experts)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.group_size = dist.get_world_size(self.group)
        domain = num_of_hybrid_ep_ranks_per_nvlink_domain
        if domain is None and os.environ.get("NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN"):
            domain = int(os.environ["NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN"])
        self._factory = BufferFactory(self.group, backend, domain)  # collective, as DeepEP's domain detection
        per_node = self._factory.ranks_per_node
        self.local_rank = self.rank % per_node
        self.node_rank = self.rank // per_node
        self.num_of_nodes = self._factory.num_nodes
        self.configurer = Configurer(BufferConfig(hidden_dim, max_num_of_tokens_per_rank, num_local_experts,
                                                  per_node, self.num_of_nodes))
        self.use_fp8 = use_fp8
        self.num_sms_dispatch_api, self.num_sms_combine_api = num_sms_dispatch_api, num_sms_combine_api
        # DeepEP's kernel-shape and memory knobs: moe_ep has no separate scan or permute kernels, no JIT
        # cache and no allgather of its own, so these change nothing (docs/deep_ep_compat.md).
        self.num_sms_preprocessing_api = num_sms_preprocessing_api
        self.num_blocks_permute, self.num_blocks_unpermute = num_blocks_permute, num_blocks_unpermute
        self.load_cached_kernels, self.use_shared_buffer = load_cached_kernels, use_shared_buffer
        self.enable_custom_allgather = enable_custom_allgather
        self._buffers: dict[tuple[int, int], moe_ep.Buffer] = {}
        self._retired: list[moe_ep.Buffer] = []  # outgrown Buffers, kept for their handles

    @property
    def moe_ep_buffers(self) -> list[moe_ep.Buffer]:
        """The moe_ep Buffers made so far: one per (hidden, num_experts), and those outgrown (moe_ep's own API)."""
        return [*self._buffers.values(), *self._retired]

    def empty_jit_cache(self) -> None:
        """Nothing to empty: moe_ep compiles no kernel per shape."""

    def _buffer(self, x: torch.Tensor, num_experts: int, blocking: bool) -> moe_ep.Buffer:
        """The moe_ep Buffer for x's hidden size and num_experts (collective). Its token limit is the
        largest of every rank's max_num_of_tokens_per_rank and token count; a blocking call whose
        token count exceeds it on some rank (one all_reduce of the counts) makes a larger one, as
        HybridEP grows its buffer (the old one stays open for the handles that use it). A
        non-blocking call communicates nothing here: past the limit, moe_ep raises."""
        key = (x.shape[1], num_experts)
        buf = self._buffers.get(key)
        if buf is not None and not blocking:
            return buf
        cfg = self.configurer.buffer_config
        most = torch.tensor([max(cfg.max_num_of_tokens_per_rank, x.shape[0])], device=_device_of(self.group))
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.group)
        if buf is not None and int(most.item()) <= buf.max_tokens_per_rank:
            return buf
        if buf is not None:
            self._retired.append(buf)
        cfg.max_num_of_tokens_per_rank = int(most.item())
        self._buffers[key] = self._factory.create(x, num_experts, min(num_experts, _native.constant("MAX_TOPK")),
                                                  cfg.max_num_of_tokens_per_rank)
        return self._buffers[key]

    def _routing(self, buf: moe_ep.Buffer, routing_map: torch.Tensor, probs: Optional[torch.Tensor],
                 blocking: bool) -> tuple[torch.Tensor, torch.Tensor, Optional[ValueError]]:
        """moe_ep's topk_idx [N, K] (the selected experts ascending, then -1) and topk_weights [N, K]
        (their probs, 0 without probs) from a routing map, and the error of a row selecting more than
        K experts: checked on the host when blocking (the rank then dispatches no tokens and raises
        after the call, so its peers are not left waiting), else by a device assert."""
        k, e = buf.cfg.num_topk, routing_map.shape[1]
        error = None
        if k < e:
            most = routing_map.sum(1).max() if routing_map.shape[0] else torch.zeros((), dtype=torch.int64)
            if blocking and int(most) > k:
                error = ValueError(f"routing_map selects up to {int(most)} experts for a token; moe_ep serves at most {k}")
                routing_map = torch.zeros_like(routing_map)
            if not blocking:
                torch._assert_async(most <= k, f"routing_map selects more than {k} experts for a token")
        key = routing_map.to(torch.int32) * (e - torch.arange(e, dtype=torch.int32, device=routing_map.device))
        picked, idx = torch.topk(key, k, dim=1)  # selected experts first, ascending (distinct keys)
        valid = picked > 0
        idx = torch.where(valid, idx, -1).contiguous()
        weights = torch.zeros(idx.shape, dtype=torch.float32, device=idx.device)
        if probs is not None:
            weights = torch.where(valid, probs.float().gather(1, idx.clamp_min(0)), weights).contiguous()
        return idx, weights, error

    def dispatch_with_permute(self, *, hidden: torch.Tensor, topk_idx: Optional[torch.Tensor] = None,
                              topk_weights: Optional[torch.Tensor] = None,
                              num_of_experts_per_rank: Optional[int] = None, num_of_experts: Optional[int] = None,
                              use_fp8: Optional[bool] = None, routing_map: Optional[torch.Tensor] = None,
                              probs: Optional[torch.Tensor] = None, scaling_factor: Optional[torch.Tensor] = None,
                              num_permuted_tokens: Union[int, torch.Tensor, None] = None,
                              pad_multiple: Optional[int] = None, handle: Optional[HybridEPHandle] = None,
                              non_blocking: bool = False, fuse_permute_dispatch: bool = False,
                              num_dispatched_tokens: Optional[int] = None,
                              use_host_meta: Optional[bool] = None) -> DispatchResult:
        """(hidden [P, H], probs [P] float32 or None, scaling_factor [P, H / 128] or None,
        tokens_per_expert [E_l] int64, handle): each received token once per local expert it selected,
        grouped by expert, each group padded to pad_multiple with zero rows. Blocking: P exact (or
        num_permuted_tokens), tokens_per_expert on the CPU; non_blocking: P = num_permuted_tokens, no
        host sync, tokens_per_expert on the device. With a handle: the cached dispatch of `hidden`
        (combine's backward). fuse_permute_dispatch gives the same result (moe_ep has one path);
        num_dispatched_tokens and use_host_meta are DeepEP's deprecated arguments, unused."""
        rows = _as_rows(num_permuted_tokens, "num_permuted_tokens")
        align = pad_multiple or 1
        if rows is not None and rows % align:
            raise ValueError(f"num_permuted_tokens ({rows}) must be a multiple of pad_multiple ({align})")
        x, sf = hidden.contiguous(), None if scaling_factor is None else scaling_factor.contiguous()
        if use_fp8 and x.dtype != torch.float8_e4m3fn:
            raise _unsupported("use_fp8=True with bf16 hidden",
                               "moe_ep's HybridEP does not quantize: pass float8_e4m3fn hidden and scaling_factor")
        sms = self.num_sms_dispatch_api
        if handle is not None:
            if not isinstance(handle, HybridEPHandle):
                raise TypeError(f"handle must come from moe_ep.deep_ep dispatch_with_permute, got {type(handle).__name__}")
            if any(a is not None for a in (routing_map, probs, topk_idx, topk_weights)):
                raise ValueError("a dispatch with a handle takes no routing_map, probs, topk_idx or topk_weights")
            got = handle.buffer.dispatch(x, x_scales=sf, handle=handle.inner, num_sms=sms)
            out_rows = handle.num_permuted_tokens if rows is None else rows
            return (_fit(got.x, out_rows), None, _fit(got.x_scales, out_rows), _kept(handle[7], out_rows), handle)

        if routing_map is None:
            if topk_idx is None or num_of_experts is None:
                raise ValueError("dispatch_with_permute needs routing_map (and probs), topk_idx and num_of_experts, "
                                 "or a handle")
            routing_map, probs = indices_to_map(topk_idx, topk_weights, x.shape[0], num_of_experts)
        elif topk_idx is not None or topk_weights is not None:
            raise ValueError("pass routing_map and probs, or topk_idx and topk_weights, not both")
        if routing_map.dim() != 2 or routing_map.shape[0] != x.shape[0]:
            raise ValueError(f"routing_map must be [{x.shape[0]}, num_experts], got {list(routing_map.shape)}")
        e = routing_map.shape[1]
        if e % self.group_size:
            raise ValueError(f"routing_map has {e} experts, not a multiple of the group size {self.group_size}")
        e_l = e // self.group_size
        if num_of_experts_per_rank is not None and num_of_experts_per_rank != e_l:
            raise ValueError(f"num_of_experts_per_rank={num_of_experts_per_rank} but routing_map gives {e} experts "
                             f"over {self.group_size} ranks ({e_l} per rank)")
        if probs is not None and probs.shape != routing_map.shape:
            raise ValueError(f"probs must have routing_map's shape {list(routing_map.shape)}, got {list(probs.shape)}")
        if non_blocking and rows is None:
            raise ValueError("non_blocking=True needs num_permuted_tokens (the output's rows: no host sync)")

        buf = self._buffer(x, e, blocking=not non_blocking)
        idx, weights, error = self._routing(buf, routing_map.bool(), probs, blocking=not non_blocking)
        got = buf.dispatch(x, idx, weights, x_scales=sf, expert_alignment=align, expert_major=True,
                           worst_case=non_blocking, num_sms=sms)
        if error is not None:
            raise error
        pairs = got.x.shape[0]
        out_rows = pairs if rows is None else rows
        counts = got.tokens_per_expert_tensor
        overflow = (counts.sum() > out_rows).to(torch.int32).reshape(1)
        if non_blocking:
            tokens_per_expert = _kept(counts, out_rows)
        else:
            tokens_per_expert = torch.tensor(got.tokens_per_expert, dtype=torch.int64)
            if pairs > out_rows:
                tokens_per_expert = _kept(tokens_per_expert, out_rows)
        received = (got.src_rank >= 0).sum().to(torch.int32).reshape(1)  # tokens this rank received
        config = HybridEpConfigInstance(x.shape[1], x.shape[0], e_l, buf.ranks_per_node, buf.num_nodes, align)
        new_handle = HybridEPHandle(
            (None, None, None, received, None, None, None, counts, x.shape[0], config, overflow),
            buf, got.handle, idx, e, out_rows)
        scores = _fit(got.pair_weights, out_rows) if probs is not None else None
        return _fit(got.x, out_rows), scores, _fit(got.x_scales, out_rows), tokens_per_expert, new_handle

    def combine_with_unpermute(self, *, hidden: torch.Tensor, probs: Optional[torch.Tensor] = None,
                               handle: Optional[HybridEPHandle] = None, pad_multiple: Optional[int] = None,
                               fuse_unpermute_combine: bool = False,
                               num_dispatched_tokens: Optional[int] = None
                               ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(combined [N, H] bf16, probs [N, E] float32 or None): each token's rows of `hidden` (the
        dispatch's layout; padding and dropped rows unread) summed back on its source rank, unweighted
        (moe_ep's fixed-order float32 sum, one rounding); with per-row `probs` [P], each row's value at
        its (token, expert) entry of a dense [N, E] tensor, zeros elsewhere (the gradient of the
        dispatch's dense probs). pad_multiple is the handle's; fuse_unpermute_combine changes nothing."""
        if not isinstance(handle, HybridEPHandle):
            raise TypeError(f"combine_with_unpermute needs the handle of dispatch_with_permute, got "
                            f"{type(handle).__name__}")
        if hidden.shape[0] != handle.num_permuted_tokens:
            raise ValueError(f"hidden has {hidden.shape[0]} rows, the dispatch gave {handle.num_permuted_tokens}")
        pairs = handle.inner.expert_major.num_pairs
        x = _fit(hidden.contiguous(), pairs)
        if probs is None:
            return handle.buffer.combine(x, handle.inner, num_sms=self.num_sms_combine_api), None
        if probs.shape != (handle.num_permuted_tokens,):
            raise ValueError(f"probs must be [{handle.num_permuted_tokens}], got {list(probs.shape)}")
        out, per_slot = handle.buffer.combine(x, handle.inner, topk_weights=_fit(probs.float(), pairs),
                                              num_sms=self.num_sms_combine_api)
        idx, e = handle.topk_idx, handle.num_experts
        dense = torch.zeros(idx.shape[0], e + 1, dtype=torch.float32, device=per_slot.device)
        dense.scatter_(1, torch.where(idx >= 0, idx, e), per_slot)  # each expert once per token; -1 to the spare
        return out, dense[:, :e]
