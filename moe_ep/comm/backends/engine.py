"""The engine interface the native backend delegates to, and the one normal-mode dispatch flow.

`NvshmemBackend` (backends/nvshmem.py) picks a normal-mode engine — `IntranodeEngine` (NVLink loads
and stores, one node: backends/intranode.py) or `InternodeEngine` (NVSHMEM puts across nodes, NVLink
forwarding inside each: backends/internode.py) — and, for low_latency Buffers, a `LowLatencyEngine`
(backends/low_latency.py). Every engine owns its kernels' context and symmetric memory and says how
much heap it needs before the session is made.

A normal dispatch, on either engine (`normal_dispatch`):
  1. notify (unless cached): the engine's layout and count-exchange kernels, the count rows carrying
     the call's stamp (moe_ep.comm.call_check); the handle state and the aligned tokens per local
     expert stay on the device;
  2. outputs: R * T rows in worst-case mode, or outside it when R * T rows fit Config.eager_output_bytes
     (the dispatch kernel then starts before the host knows the counts; results are views of the
     first M rows), else the host waits for the counts and allocates exactly M rows;
  3. the dispatch kernel (it reads the counts on the device);
  4. outside worst-case mode, the host waits for the counts (if it has not yet) and trims; with the
     counts come every rank's stamps;
  5. the call's checks, once every kernel of the call is launched, so a rank that raises made the
     same launches as its peers (a rank may wait for the counts where its peers do not): the stamps
     (call_check.verify raises on every rank alike when the ranks made different calls or one
     rejected its input), then the error record;
  6. an expert-major dispatch (expert_major): the engine's expansion of the rows into pairs
     (NormalEngine.expand; the NVLink engine copies them from the workspace its kernel left them in).

Streaming (`streamed_dispatch`, `streamed_combine`): outside worst-case mode a call may carry any
number of tokens. The number of rounds J = ceil(max N / T) (T = max_tokens_per_rank: the workspace
holds one round) comes from the call's stamp exchange, which carries every rank's N (the host waits
for it: backends/stamp_exchange.py; a silent peer or a different call raises there, before any
round); J = 1 is the flow above, unchanged (its notify, the first round's, is queued behind the
exchange before the host waits). With J > 1 round j carries tokens [jT, jT + T) of every rank (none
where a rank has fewer): the notify of every round runs first (J count exchanges, back to back:
the kernels' two count sets allow that, csrc/kernels/*/notify.cu), the host waits once for all the
counts and allocates the exact output, then each round's first output row per source is patched on
the device to its final place (source rank, then source token: source s's rows of round j follow
its rows of rounds < j) and the round's dispatch kernel writes straight there. Each round's
dispatch must start only after every peer finished the previous round (it rewrites their
workspace): round 0 follows the last notify, which is that start barrier, and every later round
repeats its own notify first for the same reason (same counts; a cached dispatch and every combine
open with their own start barrier). Combine runs the rounds in the same order, each on its rows of
the whole received x. Every round's notify carries the call's stamp; the host compares them once,
after its one wait for the counts and the launch of every round.
"""
from __future__ import annotations

import abc
import dataclasses
import uuid
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .. import expert_major as pairs
from ..call_check import STAMP_WORDS, CallStamp, OwnRejection, verify
from ..config import Config
from ..types import DispatchHandle, DispatchLayout, DispatchResult, ExpertMajorLayout
from .base import BufferConfig, DispatchOutputs, align_up_device, native_dispatch_result


class Engine(abc.ABC):
    """One kernel family of a native Buffer: its context, symmetric memory and lifetime."""

    cfg: BufferConfig

    @staticmethod
    @abc.abstractmethod
    def heap_bytes(cfg: BufferConfig) -> int:
        """Symmetric heap bytes the engine allocates for `cfg` (asked before the session is made)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Frees what the engine holds outside the symmetric heap (the heap goes with the session)."""


@dataclasses.dataclass(frozen=True)
class Notified:
    """What a normal engine's notify launched: the routing and the handle state, on the device."""

    is_token_in_rank: torch.Tensor  # [N, R] bool
    state: Any  # the engine's handle state (a frozen dataclass with a tokens_per_expert field, None so far)
    tokens_per_expert: torch.Tensor  # [E_l] int32, aligned to expert_alignment


class NormalEngine(Engine):
    """A normal-mode engine (one node or across nodes): the steps `normal_dispatch` runs, and combine."""

    path: str  # which kernels: "nvlink" or "cross-node"
    _ctx: Any  # the native context (moe_ep.comm._C IntranodeContext / InternodeContext): launches, count mailbox

    def close(self) -> None:
        """Frees the context's host-mapped count mailbox (the symmetric memory goes with the session)."""
        self._ctx.close()

    @abc.abstractmethod
    def layout(self, topk_idx: torch.Tensor, stream: torch.cuda.Stream) -> DispatchLayout:
        """get_dispatch_layout on the device (no host sync)."""

    @abc.abstractmethod
    def notify(self, topk_idx: torch.Tensor, expert_alignment: int, worst_case: bool,
               stream: torch.cuda.Stream, stamp: list[int]) -> Notified:
        """Launch the layout and the count exchange of a fresh dispatch; the count rows carry `stamp`."""

    @abc.abstractmethod
    def raw_expert_counts(self, state: Any) -> torch.Tensor:
        """A handle state's received rows per local expert on the device ([E_l] int32, not aligned)."""

    def dispatch_outputs(self, m: int, dtype: torch.dtype, handle: Optional[DispatchHandle],
                         expert_major: bool) -> DispatchOutputs:
        """The tensors the dispatch kernel writes, m rows each (the received rows too: an engine whose
        expert-major dispatch leaves them in its workspace overrides this)."""
        return DispatchOutputs.allocate(self.cfg, m, dtype, handle)

    @abc.abstractmethod
    def launch_dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], topk_idx: Optional[torch.Tensor],
                        topk_weights: Optional[torch.Tensor], state: Any, out: DispatchOutputs, *, cached: bool,
                        worst_case: bool, expert_major: bool, num_sms: int, knobs: Config,
                        stream: torch.cuda.Stream) -> None:
        """Launch the dispatch kernel into `out` (rows no source fills, in worst-case mode, are zero)."""

    def pair_rows(self, result: DispatchResult, layout: ExpertMajorLayout
                  ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """An expert-major dispatch's pairs (x [P, H], scales [P, H / 128] or None), on the current
        stream (the dispatch's): one gather of the received rows, unless the engine copies them from
        where its kernel left them."""
        return pairs.gather_rows(result, layout)

    def expand(self, result: DispatchResult, alignment: int) -> DispatchResult:
        """A dispatch's result as (row, local expert) pairs grouped by expert (moe_ep.comm.expert_major)."""
        layout, handle, weights = pairs.layout_of(result, alignment)
        return pairs.as_pairs(result, layout, handle, weights, *self.pair_rows(result, layout))

    def host_counts(self) -> tuple[list[int], list[int]]:
        """(rows from each source, raw rows per local expert) of the last notify, once it has run."""
        return self._ctx.host_info()

    def host_stamps(self) -> list[list[int]]:
        """Every rank's stamp words as the last notify outside worst-case mode received them, once it has run."""
        words = self._ctx.host_stamps()
        return [words[s * STAMP_WORDS:(s + 1) * STAMP_WORDS] for s in range(self.cfg.world_size)]

    @abc.abstractmethod
    def combine(self, x: torch.Tensor, handle: DispatchHandle, out: torch.Tensor,
                topk_weights: Optional[torch.Tensor], out_topk_weights: Optional[torch.Tensor], *, num_sms: int,
                knobs: Config, stream: torch.cuda.Stream) -> None:
        """Launch the combine kernel: rows (and topk_weights, when given) back, summed into out."""

    @abc.abstractmethod
    def fill_workspace(self, value: int) -> None:
        """Sets every byte of the engine's symmetric data areas (not its signal words) to `value`."""


def normal_dispatch(engine: NormalEngine, x: torch.Tensor, x_scales: Optional[torch.Tensor],
                    topk_idx: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor], *,
                    handle: Optional[DispatchHandle], expert_alignment: int, worst_case: bool, num_sms: int,
                    knobs: Config, stream: torch.cuda.Stream, async_op: bool,
                    check: Callable[..., None], stamp: CallStamp, expert_major: bool = False,
                    notified: Optional[Notified] = None) -> DispatchResult:
    """The normal-mode dispatch flow of every normal engine (this module's docstring says the steps).
    `check` is the Buffer's ErrorWatch.check; `stamp` the call's (compared where the host waits for
    the counts). expert_major: the result is the engine's pairs (step 6). `notified`: the call's
    notify, already launched (first_notify)."""
    cfg = engine.cfg
    r, t = cfg.world_size, cfg.max_tokens_per_rank
    cached = handle is not None
    counts_ready: Optional[torch.cuda.Event] = None  # recorded after notify, outside worst-case mode
    recv_counts: Optional[list[int]] = None
    stamps: Optional[list[list[int]]] = None  # every rank's, once the host has the counts
    if cached:
        state, worst_case, recv_counts = handle.state, handle.worst_case, handle.recv_counts
        in_rank = handle.is_token_in_rank
        tokens_per_expert = align_up_device(engine.raw_expert_counts(state), expert_alignment)
    else:
        if notified is None:
            notified = engine.notify(topk_idx, expert_alignment, worst_case, stream, stamp.words)
        in_rank, state, tokens_per_expert = notified.is_token_in_rank, notified.state, notified.tokens_per_expert
        if not worst_case:
            counts_ready = torch.cuda.Event()
            counts_ready.record(stream)
    row_bytes = cfg.hidden * x.element_size() + 16 * cfg.num_topk
    eager = counts_ready is not None and r * t * row_bytes <= knobs.eager_output_bytes

    def wait_counts() -> list[int]:
        """Rows from each source; the handle state learns the raw rows per local expert."""
        nonlocal state, stamps
        counts_ready.synchronize()
        check(timeouts_only=True)  # a bad id is raised once every kernel of the call is launched
        from_source, raw = engine.host_counts()
        state = dataclasses.replace(state, tokens_per_expert=raw)
        stamps = engine.host_stamps()
        return from_source

    if counts_ready is not None and not eager:
        recv_counts = wait_counts()
    m = r * t if worst_case or eager else sum(recv_counts)
    out = engine.dispatch_outputs(m, x.dtype, handle, expert_major)
    engine.launch_dispatch(x, x_scales, topk_idx, topk_weights, state, out, cached=cached, worst_case=worst_case,
                           expert_major=expert_major, num_sms=num_sms, knobs=knobs, stream=stream)
    if eager:
        recv_counts = wait_counts()
        out = out.head(sum(recv_counts))
    verify_stamps(engine.cfg.rank, stamp, stamps, check, stream)  # every kernel of the call is launched: raising keeps the ranks in step
    result = native_dispatch_result(
        cfg, handle, out, num_tokens=x.shape[0], is_token_in_rank=in_rank, recv_counts=recv_counts,
        worst_case=worst_case, state=state, tokens_per_expert_raw=state.tokens_per_expert,
        expert_alignment=expert_alignment, tokens_per_expert_tensor=tokens_per_expert, async_op=async_op, check=check)
    return engine.expand(result, expert_alignment) if expert_major else result


def own_group(group: dist.ProcessGroup, timeout_s: float) -> dist.ProcessGroup:
    """Collective (at Buffer creation): a gloo group of `group`'s ranks that is the Buffer's own, for its
    host-side meetings (leaving at exit: NvshmemBackend.leave; with check_calls=True, call_check.HostCheck).
    Its own, so that an operation a silent peer leaves waiting can give up without touching any group
    the caller uses; gloo, so that meeting needs no device sync. Built on the default store under a key
    the group's first rank draws (one broadcast over `group`), outside torch's group registry:
    dist.new_group(use_local_synchronization=True), which names every group of the same ranks alike,
    hung in its creation on the H200 machine (torch 2.11, 2026-12-03) once such a group existed, and
    left every Buffer's group registered."""
    key = [uuid.uuid4().hex]
    dist.broadcast_object_list(key, src=dist.get_process_group_ranks(group)[0], group=group)
    store = dist.PrefixStore(f"moe_ep/own/{key[0]}/", dist.distributed_c10d._get_default_store())
    return dist.ProcessGroupGloo(store, dist.get_rank(group), dist.get_world_size(group), timedelta(seconds=timeout_s))


def verify_stamps(rank: int, stamp: CallStamp, stamps: Optional[list[list[int]]], check: Callable[..., None],
                  stream: torch.cuda.Stream) -> None:
    """A dispatch's checks once its kernels are launched: every rank's stamps, when the host read them
    (call_check.verify; a bad id this rank's kernels found raises, named, from its error record, once
    they finished: a dispatch kernel still reading the bad id would record it again for the next call),
    then the error record."""
    if stamps is not None:
        try:
            verify(stamp, stamps, rank)
        except OwnRejection:
            stream.synchronize()
            check()
            raise
    check()




def first_notify(engine: NormalEngine, topk_idx: torch.Tensor, expert_alignment: int,
                 stream: torch.cuda.Stream, stamp: CallStamp) -> Notified:
    """The count exchange of an exact-size call's first round (its first T tokens, the call's stamp in
    its count rows), launched before the host waits for the rounds, so that the GPU runs it meanwhile."""
    return engine.notify(topk_idx[:engine.cfg.max_tokens_per_rank], expert_alignment, False, stream, stamp.words)


@dataclasses.dataclass(frozen=True)
class StreamedState:
    """Handle state of a call streamed in rounds (this module's docstring): each round's engine state,
    its first output row per source patched to the whole output, and this rank's tokens of each round."""

    rounds: tuple[Any, ...]
    bounds: tuple[tuple[int, int], ...]  # [first, last) token of this rank in each round
    raw_expert_counts: torch.Tensor  # [E_l] int32 on the device: received rows per local expert, all rounds
    tokens_per_expert: Optional[list[int]]  # the same on the host


def round_bounds(num_tokens: int, rounds: int, round_tokens: int) -> tuple[tuple[int, int], ...]:
    """This rank's tokens [first, last) of each round (empty once its tokens ran out)."""
    return tuple((min(num_tokens, j * round_tokens), min(num_tokens, (j + 1) * round_tokens)) for j in range(rounds))


def _first_rows(counts: torch.Tensor) -> torch.Tensor:
    """[J, R] int64 first output row of source s's rows of round j, from counts [J, R]: sources in
    rank order, each source's rounds in order (so rows follow source rank, then source token)."""
    per_source = counts.sum(0)
    return (per_source.cumsum(0) - per_source).unsqueeze(0) + counts.cumsum(0) - counts


def streamed_dispatch(engine: NormalEngine, x: torch.Tensor, x_scales: Optional[torch.Tensor],
                      topk_idx: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor], *,
                      handle: Optional[DispatchHandle], rounds: int, expert_alignment: int, num_sms: int,
                      knobs: Config, stream: torch.cuda.Stream, async_op: bool,
                      check: Callable[..., None], stamp: CallStamp, first: Optional[Notified]) -> DispatchResult:
    """An exact-size dispatch in `rounds` rounds of at most T tokens (this module's docstring): the
    same rows, bits and order as one round would give. A cached one reuses its handle's rounds;
    a fresh one gets round 0's notify, already launched (`first`: first_notify). Every round's notify
    carries `stamp`, compared once every round is launched."""
    cfg = engine.cfg
    r, t, dev = cfg.world_size, cfg.max_tokens_per_rank, cfg.device
    cached = handle is not None
    stamps: Optional[list[list[int]]] = None  # every rank's (a fresh call's, from the last round's notify)

    def cut(v: Optional[torch.Tensor], j: int) -> Optional[torch.Tensor]:
        return None if v is None else v[bounds[j][0]:bounds[j][1]]

    if cached:
        state: StreamedState = handle.state
        bounds, in_rank, recv_counts = state.bounds, handle.is_token_in_rank, handle.recv_counts
        out = DispatchOutputs.allocate(cfg, handle.num_recv_rows, x.dtype, handle)
    else:
        bounds = round_bounds(x.shape[0], rounds, t)
        notified = [first] + [engine.notify(cut(topk_idx, j), expert_alignment, False, stream, stamp.words)
                              for j in range(1, rounds)]
        e_l = cfg.num_local_experts
        info = torch.stack([n.state.recv_info[:2 * r + e_l] for n in notified]).cpu()  # the call's one host sync
        check(timeouts_only=True)
        stamps = engine.host_stamps()
        counts = info[:, :r].to(torch.int64)
        first = _first_rows(counts).to(device=dev, dtype=torch.int32)
        for j, n in enumerate(notified):
            n.state.recv_info[r:2 * r].copy_(first[j])
        raw = torch.stack([engine.raw_expert_counts(n.state) for n in notified]).sum(0, dtype=torch.int32)
        state = StreamedState(tuple(n.state for n in notified), bounds, raw, info[:, 2 * r:].sum(0).tolist())
        in_rank = torch.cat([n.is_token_in_rank for n in notified])
        recv_counts = counts.sum(0).tolist()
        out = DispatchOutputs.allocate(cfg, sum(recv_counts), x.dtype, None)
        row_round = torch.repeat_interleave(torch.arange(rounds, dtype=torch.int32).repeat(r), counts.t().reshape(-1))
    for j in range(rounds):
        if not cached and j > 0:  # the round's start barrier: peers finished reading round j - 1
            engine.notify(cut(topk_idx, j), expert_alignment, False, stream, stamp.words)
        engine.launch_dispatch(cut(x, j), cut(x_scales, j), cut(topk_idx, j), cut(topk_weights, j), state.rounds[j],
                               out, cached=cached, worst_case=False, expert_major=False, num_sms=num_sms, knobs=knobs,
                               stream=stream)
    if not cached:  # the kernels wrote each row's index inside its round
        out.src_index.add_(row_round.to(dev) * t)
    verify_stamps(engine.cfg.rank, stamp, stamps, check, stream)
    return native_dispatch_result(
        cfg, handle, out, num_tokens=x.shape[0], is_token_in_rank=in_rank, recv_counts=recv_counts, worst_case=False,
        state=state, tokens_per_expert_raw=state.tokens_per_expert, expert_alignment=expert_alignment,
        tokens_per_expert_tensor=align_up_device(state.raw_expert_counts, expert_alignment), async_op=async_op,
        check=check)


def streamed_combine(engine: NormalEngine, x: torch.Tensor, handle: DispatchHandle, out: torch.Tensor,
                     topk_weights: Optional[torch.Tensor], out_topk_weights: Optional[torch.Tensor], *, num_sms: int,
                     knobs: Config, stream: torch.cuda.Stream) -> None:
    """Combine of a streamed handle, round by round: each round's kernel reads its rows where they lie
    in the whole x (the round's state), sends only them (other rounds' rows get src_rank -1), and
    sums its tokens into their slice of out."""
    state: StreamedState = handle.state
    t = engine.cfg.max_tokens_per_rank
    row_round = torch.div(handle.src_index, t, rounding_mode="floor")
    local_index = handle.src_index - row_round * t
    for j, (first, last) in enumerate(state.bounds):
        part = dataclasses.replace(
            handle, num_tokens=last - first, is_token_in_rank=handle.is_token_in_rank[first:last],
            src_rank=torch.where(row_round == j, handle.src_rank, -1), src_index=local_index, state=state.rounds[j])
        engine.combine(x, part, out[first:last], topk_weights,
                       None if out_topk_weights is None else out_topk_weights[first:last],
                       num_sms=num_sms, knobs=knobs, stream=stream)
