"""Normal-mode dispatch/combine across nodes on the hierarchical kernels (csrc/kernels/internode/).

A token crosses the network once per destination node (NVSHMEM puts to the rank of the same local
index there), which forwards it over NVLink to the ranks of its node that hold its experts; combine
sums inside the node first and sends one bf16 partial per (token, node) back. The symmetric memory
is bounded by rounds of C token slots (csrc/kernels/internode/internode.h owns the layout and picks C
for the budget below), not by R * T rows. The NvshmemBackend uses this engine for its normal-mode
calls when the group spans several nodes (or when asked to, with one node, to run the forwarding leg).

A call's routing (is_token_in_rank, each token's position among the tokens for each rank, the nodes
it goes to) comes from the route kernel, then the notify kernel exchanges counts; the dispatch flow
around them is the one of every normal engine (backends/engine.py `normal_dispatch`). Calls of one
Buffer must be ordered on the device (one stream, or events between streams), and every rank must
pass the same num_sms to a call: block q of every rank is channel q of that call (at most
INTERNODE_MAX_CHANNELS); a rank that launched fewer blocks leaves its peers' extra channels waiting
until the timeout names it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from .. import _native
from ..config import ALLOCATION_SLACK_BYTES, Config
from ..types import DispatchHandle, DispatchLayout
from .base import BufferConfig, DispatchOutputs, ptr_or_null
from .engine import NormalEngine, Notified

if TYPE_CHECKING:
    from .symmetric import NvshmemSession


@dataclass(frozen=True)
class Layout:
    """One call's routing (csrc/kernels/internode/route.cu)."""

    in_rank: torch.Tensor  # [N, R] bool
    pos: torch.Tensor  # [N, R] int32: position of token n among the tokens for rank r, -1 if not sent
    in_node: torch.Tensor  # [N, N_n] bool
    tokens_per_rank: torch.Tensor  # [R] int32
    tokens_per_expert: torch.Tensor  # [E] int32 (a token naming an expert twice counts once)


@dataclass(frozen=True)
class NodeDispatchState:
    """Backend-private part of a DispatchHandle made by the cross-node path."""

    pos: torch.Tensor
    in_node: torch.Tensor
    recv_info: torch.Tensor  # [2R + E_l + 1] int32 (internode.h recv_info_entries)
    forward_mask: torch.Tensor  # [N_n, T] int32: as forwarder, the local ranks each token went to
    own_row: torch.Tensor  # [N_n, T] int32: as forwarder, my output row of each token I forwarded to myself
    tokens_per_expert: Optional[list[int]]  # raw received rows per local expert; None in worst-case mode


def workspace_plan(cfg: BufferConfig) -> tuple[int, int]:
    """(round_tokens, workspace bytes) of this Buffer's cross-node workspace, within its budget
    (Config.internode_workspace_bytes); the round size follows from it."""
    return _native.load().internode_plan(cfg.world_size, cfg.ranks_per_node, cfg.max_tokens_per_rank, cfg.hidden,
                                         cfg.num_topk, cfg.num_experts, cfg.config.internode_workspace_bytes)


class InternodeEngine(NormalEngine):
    """The cross-node normal-mode kernels of one Buffer and their symmetric workspace."""

    path = "cross-node"

    def __init__(self, cfg: BufferConfig, session: "NvshmemSession", runtime: Any) -> None:
        native = _native.load()
        self._native: Any = native  # the launch argument structs (InternodeDispatchArgs, ...)
        self.cfg = cfg
        self._session = session
        round_tokens, workspace_bytes = workspace_plan(cfg)
        self._epochs = torch.zeros(native.INTERNODE_NUM_EPOCHS, dtype=torch.int64, device=cfg.device)
        self._block_counters = torch.zeros(2, dtype=torch.int32, device=cfg.device)
        torch.cuda.synchronize(cfg.device)  # the zeros land before any kernel, on any stream
        self._workspace = session.alloc((workspace_bytes,), torch.uint8)
        first = cfg.node * cfg.ranks_per_node
        node_peers = self._workspace.peer_ptrs[first:first + cfg.ranks_per_node]
        unreachable = [first + j for j, addr in enumerate(node_peers) if addr == 0]
        if unreachable:
            raise RuntimeError(f"moe_ep rank {cfg.rank}: ranks {unreachable} of its node (ranks_per_node="
                               f"{cfg.ranks_per_node}) are not reachable by NVLink loads/stores (nvshmem_ptr is 0)")
        self._ctx = native.InternodeContext(
            runtime=runtime, ranks_per_node=cfg.ranks_per_node,
            max_tokens=cfg.max_tokens_per_rank, hidden=cfg.hidden, num_topk=cfg.num_topk,
            num_experts=cfg.num_experts, round_tokens=round_tokens,
            epochs=self._epochs.data_ptr(), block_counters=self._block_counters.data_ptr(),
            workspace=self._workspace.ptr, node_peers=list(node_peers),
        )

    @staticmethod
    def heap_bytes(cfg: BufferConfig) -> int:
        return workspace_plan(cfg)[1] + ALLOCATION_SLACK_BYTES  # one allocation

    @property
    def round_tokens(self) -> int:
        """Token slots per round (C)."""
        return self._ctx.round_tokens

    def route(self, topk_idx: torch.Tensor, stream: torch.cuda.Stream) -> Layout:
        """Where each token goes, from its expert ids (the route kernel; no host sync)."""
        cfg, n, dev = self.cfg, topk_idx.shape[0], self.cfg.device
        layout = Layout(
            in_rank=torch.empty(n, cfg.world_size, dtype=torch.bool, device=dev),
            pos=torch.empty(n, cfg.world_size, dtype=torch.int32, device=dev),
            in_node=torch.empty(n, cfg.num_nodes, dtype=torch.bool, device=dev),
            tokens_per_rank=torch.empty(cfg.world_size, dtype=torch.int32, device=dev),
            tokens_per_expert=torch.empty(cfg.num_experts, dtype=torch.int32, device=dev),
        )
        self._ctx.route(self._native.InternodeRouteArgs(
            topk_idx=topk_idx.data_ptr(), num_tokens=n, in_rank=layout.in_rank.data_ptr(), pos=layout.pos.data_ptr(),
            in_node=layout.in_node.data_ptr(), tokens_per_rank=layout.tokens_per_rank.data_ptr(),
            tokens_per_expert=layout.tokens_per_expert.data_ptr(),
        ), stream.cuda_stream)
        return layout

    def layout(self, topk_idx: torch.Tensor, stream: torch.cuda.Stream) -> DispatchLayout:
        layout = self.route(topk_idx, stream)
        return DispatchLayout(num_tokens_per_rank=layout.tokens_per_rank,
                              num_tokens_per_expert=layout.tokens_per_expert, is_token_in_rank=layout.in_rank)

    def notify(self, topk_idx: torch.Tensor, expert_alignment: int, worst_case: bool,
               stream: torch.cuda.Stream, stamp: list[int]) -> Notified:
        cfg, n, dev, t = self.cfg, topk_idx.shape[0], self.cfg.device, self.cfg.max_tokens_per_rank
        layout = self.route(topk_idx, stream)
        recv_info = torch.empty(2 * cfg.world_size + cfg.num_local_experts + 1, dtype=torch.int32, device=dev)
        tokens_per_expert = torch.empty(cfg.num_local_experts, dtype=torch.int32, device=dev)
        self._ctx.notify(self._native.InternodeNotifyArgs(
            tokens_per_rank=layout.tokens_per_rank.data_ptr(), tokens_per_expert=layout.tokens_per_expert.data_ptr(),
            num_tokens=n, recv_info=recv_info.data_ptr(), tokens_per_expert_aligned=tokens_per_expert.data_ptr(),
            expert_alignment=expert_alignment, worst_case=worst_case,
        ), stream.cuda_stream, stamp)
        state = NodeDispatchState(layout.pos, layout.in_node, recv_info,
                                  torch.zeros(cfg.num_nodes, t, dtype=torch.int32, device=dev),
                                  torch.empty(cfg.num_nodes, t, dtype=torch.int32, device=dev), None)
        return Notified(layout.in_rank, state, tokens_per_expert)

    def raw_expert_counts(self, state: NodeDispatchState) -> torch.Tensor:
        r = self.cfg.world_size
        return state.recv_info[2 * r:2 * r + self.cfg.num_local_experts]

    def launch_dispatch(self, x, x_scales, topk_idx, topk_weights, state: NodeDispatchState, out: DispatchOutputs, *,
                        cached, worst_case, expert_major, num_sms, knobs, stream) -> None:
        """expert_major changes nothing here: the rows land in the output as usual and pair_rows gathers them."""
        cfg = self.cfg
        fp8 = x.dtype == torch.float8_e4m3fn
        self._ctx.dispatch(self._native.InternodeDispatchArgs(
            x=x.data_ptr(), x_scales=ptr_or_null(x_scales), topk_idx=ptr_or_null(topk_idx),
            topk_weights=ptr_or_null(topk_weights), pos=state.pos.data_ptr(), in_node=state.in_node.data_ptr(),
            recv_info=state.recv_info.data_ptr(), num_tokens=x.shape[0], row_bytes=cfg.hidden * x.element_size(),
            num_scales=cfg.num_scales if fp8 else 0, num_rows=out.x.shape[0], out_x=out.x.data_ptr(),
            out_scales=ptr_or_null(out.scales), out_topk_idx=ptr_or_null(out.topk_idx),
            out_topk_weights=ptr_or_null(out.topk_weights), out_src_rank=0 if cached else out.src_rank.data_ptr(),
            out_src_index=0 if cached else out.src_index.data_ptr(), forward_mask=state.forward_mask.data_ptr(),
            own_row=state.own_row.data_ptr(), worst_case=worst_case, cached=cached, num_blocks=num_sms,
        ), stream.cuda_stream)

    def fill_workspace(self, value: int) -> None:
        """The workspace's data areas (rows, metadata, counts), without its signal words."""
        self._workspace.tensor[self._ctx.data_offset:].fill_(value)

    def combine(self, x: torch.Tensor, handle: DispatchHandle, out: torch.Tensor, topk_weights: Optional[torch.Tensor],
                out_topk_weights: Optional[torch.Tensor], *, num_sms: int, knobs: Config,
                stream: torch.cuda.Stream) -> None:
        """Rows (with their topk_weights, when given) back to their sources' forwarders, node partials back
        to the sources, summed into out (and out_topk_weights)."""
        state: NodeDispatchState = handle.state
        self._ctx.combine(self._native.InternodeCombineArgs(
            x=x.data_ptr(), src_index=handle.src_index.data_ptr(), recv_info=state.recv_info.data_ptr(),
            forward_mask=state.forward_mask.data_ptr(), own_row=state.own_row.data_ptr(),
            in_node=state.in_node.data_ptr(), num_tokens=handle.num_tokens, num_rows=x.shape[0], out=out.data_ptr(),
            with_weights=topk_weights is not None, topk_weights=ptr_or_null(topk_weights),
            out_topk_weights=ptr_or_null(out_topk_weights), num_blocks=num_sms,
        ), stream.cuda_stream)
