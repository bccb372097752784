"""The one normal-mode dispatch flow (moe_ep.comm.backends.engine.normal_dispatch) on the CPU, with a recording
engine in place of the kernels: which steps run in which order, how big the outputs are, when the host
waits for the counts, and which error checks come before and after the launch (timeouts only before it,
everything once every kernel of the call is launched), for fresh, exact-size, worst-case and cached calls,
and where the call's stamps are compared (once the counts are in and every kernel is launched).
The GPU tests run the same flow on the real engines."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import pytest
import torch

from moe_ep import CallMismatchError, Config, PeerInputError
from moe_ep.comm import call_check
from moe_ep.comm.backends import engine as flow
from moe_ep.comm.backends.base import BufferConfig, DispatchOutputs
from moe_ep.comm.types import DispatchLayout

R, T, H, K, E = 2, 6, 16, 2, 4  # ranks, max tokens per rank, hidden, top-k, experts (E_l = 2)
RECV = [3, 5]  # rows this rank receives from each source
RAW = [7, 1]  # raw rows per local expert


@dataclasses.dataclass(frozen=True)
class _State:
    """An engine's handle state: the flow fills in tokens_per_expert once the host has the counts."""

    tokens_per_expert: Optional[list[int]] = None


class _Event:
    """torch.cuda.Event without CUDA: recording and waiting are steps of the log."""

    log: list[str] = []

    def record(self, stream: Any = None) -> None:
        self.log.append("record counts")

    def synchronize(self) -> None:
        self.log.append("wait counts")


class _Recorder(flow.NormalEngine):
    path = "test"

    def __init__(self, cfg: BufferConfig, log: list[str], peer: Optional[list[int]] = None) -> None:
        self.cfg, self.log, self.peer = cfg, log, peer  # peer: rank 1's stamp words (None: the same as ours)
        self.sent: Optional[list[int]] = None

    @staticmethod
    def heap_bytes(cfg: BufferConfig) -> int:
        return 0

    def close(self) -> None:
        raise AssertionError("normal_dispatch does not close the engine")

    def layout(self, topk_idx: torch.Tensor, stream: Any) -> DispatchLayout:
        raise AssertionError("normal_dispatch does not call layout")

    def notify(self, topk_idx, expert_alignment, worst_case, stream, stamp) -> flow.Notified:
        self.log.append(f"notify worst_case={worst_case}")
        self.sent = stamp
        aligned = torch.tensor([-(-c // expert_alignment) * expert_alignment for c in RAW], dtype=torch.int32)
        return flow.Notified(torch.ones(topk_idx.shape[0], R, dtype=torch.bool), _State(), aligned)

    def raw_expert_counts(self, state: _State) -> torch.Tensor:
        return torch.tensor(RAW, dtype=torch.int32)

    def dispatch_outputs(self, m, dtype, handle, expert_major) -> DispatchOutputs:
        """As the NVLink engine: an expert-major dispatch leaves its rows in the workspace."""
        return DispatchOutputs.allocate(self.cfg, m, dtype, handle, rows=not expert_major)

    def launch_dispatch(self, x, x_scales, topk_idx, topk_weights, state, out: DispatchOutputs, *, cached, worst_case,
                        expert_major, num_sms, knobs, stream) -> None:
        assert (out.x is None) == expert_major
        where = "" if out.x is not None else " in workspace"
        self.log.append(f"launch rows={out.src_rank.shape[0]}{where} cached={cached} worst_case={worst_case}")
        if out.x is not None:
            assert out.x.shape[0] == out.src_rank.shape[0]
            out.x.fill_(1.0)

    def expand(self, result, alignment):
        """The engine's expansion is its own step, after the call's check."""
        self.log.append(f"expand alignment={alignment}")
        return result

    def host_counts(self) -> tuple[list[int], list[int]]:
        self.log.append("host counts")
        return list(RECV), list(RAW)

    def host_stamps(self) -> list[list[int]]:
        self.log.append("host stamps")
        return [self.sent, self.peer if self.peer is not None else self.sent]

    def combine(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("not part of dispatch")

    def fill_workspace(self, value: int) -> None:
        raise AssertionError("not part of dispatch")


class _CrossNodeRecorder(_Recorder):
    """As the cross-node engine: the kernel lands the rows in the output whatever the receive layout, and
    NormalEngine's own expand gathers them into pairs. Received row m holds the value m; rows 0..6 name
    local expert 0, row 7 local expert 1 (RAW), the rest no local expert."""

    dispatch_outputs = flow.NormalEngine.dispatch_outputs
    expand = flow.NormalEngine.expand

    def launch_dispatch(self, x, x_scales, topk_idx, topk_weights, state, out: DispatchOutputs, *, cached, worst_case,
                        expert_major, num_sms, knobs, stream) -> None:
        m = out.src_rank.shape[0]
        self.log.append(f"launch rows={m} cached={cached} worst_case={worst_case}")
        out.x.copy_(torch.arange(m, dtype=torch.bfloat16).unsqueeze(1).expand(m, H))
        ids = torch.full((m, K), -1, dtype=torch.int64)
        ids[:RAW[0], 0], ids[RAW[0]:sum(RAW), 0] = 0, 1
        out.topk_idx.copy_(ids)
        out.topk_weights.fill_(0.5)


def _cfg() -> BufferConfig:
    return BufferConfig(group=None, rank=0, world_size=R, hidden=H, num_experts=E, num_topk=K, max_tokens_per_rank=T,
                        low_latency=False, num_sms=4, timeout_s=1.0, buffer_id=7, device=torch.device("cpu"),
                        ranks_per_node=R, config=Config(num_sms=4))


def _dispatch(monkeypatch: pytest.MonkeyPatch, knobs: Config, handle=None, worst_case=False, expert_major=False,
              peer: Optional[list[int]] = None, log: Optional[list[str]] = None, engine: type = _Recorder):
    log = [] if log is None else log
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(_Event, "log", log)
    eng = engine(_cfg(), log, peer)

    def check(timeouts_only: bool = False) -> None:
        log.append("check timeouts" if timeouts_only else "check all")

    n = 4
    x = torch.randn(n, H).to(torch.bfloat16)
    idx, w = (None, None) if handle is not None else (torch.zeros(n, K, dtype=torch.int64), torch.rand(n, K))
    res = flow.normal_dispatch(eng, x, None, idx, w, handle=handle, expert_alignment=4, worst_case=worst_case,
                               num_sms=4, knobs=knobs, stream=None, async_op=False, check=check,
                               stamp=call_check.CallOrder().stamp(call_check.DISPATCH), expert_major=expert_major)
    return res, log


def test_eager_outputs_start_the_kernel_before_the_host_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    res, log = _dispatch(monkeypatch, Config())
    assert log == ["notify worst_case=False", "record counts", f"launch rows={R * T} cached=False worst_case=False",
                   "wait counts", "check timeouts", "host counts", "host stamps", "check all"]
    assert res.x.shape[0] == sum(RECV) and res.handle.recv_counts == RECV
    assert res.tokens_per_expert == [8, 4] and res.handle.state.tokens_per_expert == RAW
    assert res.handle.num_recv_rows == sum(RECV) and res.handle.buffer_id == 7


def test_exact_outputs_after_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    res, log = _dispatch(monkeypatch, Config(eager_output_bytes=0))
    assert log == ["notify worst_case=False", "record counts", "wait counts", "check timeouts", "host counts",
                   "host stamps", f"launch rows={sum(RECV)} cached=False worst_case=False", "check all"]
    assert res.x.shape[0] == sum(RECV) and res.tokens_per_expert == [8, 4]


def test_worst_case_never_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    res, log = _dispatch(monkeypatch, Config(), worst_case=True)
    assert log == ["notify worst_case=True", f"launch rows={R * T} cached=False worst_case=True", "check all"]
    assert res.x.shape[0] == R * T and res.tokens_per_expert is None and res.handle.recv_counts is None
    assert res.tokens_per_expert_tensor.tolist() == [8, 4]


@pytest.mark.parametrize("worst_case", [False, True])
def test_cached_reuses_the_handle(monkeypatch: pytest.MonkeyPatch, worst_case: bool) -> None:
    first, _ = _dispatch(monkeypatch, Config(), worst_case=worst_case)
    again, log = _dispatch(monkeypatch, Config(), handle=first.handle)
    rows = R * T if worst_case else sum(RECV)
    assert log == [f"launch rows={rows} cached=True worst_case={worst_case}", "check all"]
    assert again.handle is first.handle and again.topk_idx is None and again.topk_weights is None
    assert again.x.shape[0] == rows and again.tokens_per_expert_tensor.tolist() == [8, 4]
    assert again.tokens_per_expert == (None if worst_case else [8, 4])


@pytest.mark.parametrize("eager", [True, False])
def test_expert_major_allocate_no_rows(monkeypatch: pytest.MonkeyPatch, eager: bool) -> None:
    """An expert-major NVLink dispatch leaves its rows in the workspace: the same steps, no x allocated or
    returned (the engine's expand copies the pairs out, last), every other output at the received size."""
    res, log = _dispatch(monkeypatch, Config() if eager else Config(eager_output_bytes=0), expert_major=True)
    want, _ = _dispatch(monkeypatch, Config() if eager else Config(eager_output_bytes=0))
    rows = R * T if eager else sum(RECV)
    assert f"launch rows={rows} in workspace cached=False worst_case=False" in log and len(log) == 9
    assert log[-2:] == ["check all", "expand alignment=4"]
    assert res.x is None and res.handle.num_recv_rows == sum(RECV) == res.src_rank.shape[0]
    assert res.topk_idx.shape == (sum(RECV), K) and res.tokens_per_expert == want.tokens_per_expert == [8, 4]
    again, log = _dispatch(monkeypatch, Config(), handle=res.handle, expert_major=True)
    assert log == [f"launch rows={sum(RECV)} in workspace cached=True worst_case=False", "check all",
                   "expand alignment=4"]
    assert again.x is None and again.src_rank is res.src_rank


@pytest.mark.parametrize("eager", [True, False])
def test_cross_node_engine_honours_expert_major(monkeypatch: pytest.MonkeyPatch, eager: bool) -> None:
    """The receive layout on an engine whose kernel ignores it (the cross-node engine): the rows land as
    usual and the flow's last step gathers them into pairs grouped by local expert, each expert's block
    padded to expert_alignment (4) with zero pairs of no row."""
    res, log = _dispatch(monkeypatch, Config() if eager else Config(eager_output_bytes=0), expert_major=True,
                         engine=_CrossNodeRecorder)
    assert log[-1] == "check all" and res.handle.expert_major is not None
    want_rows = [0, 1, 2, 3, 4, 5, 6, -1, 7, -1, -1, -1]  # expert 0: 7 rows + 1 pad; expert 1: 1 row + 3 pads
    assert res.handle.expert_major.rows.tolist() == want_rows and res.tokens_per_expert == [8, 4]
    assert res.x[:, 0].tolist() == [max(r, 0) for r in want_rows] and torch.equal(res.x, res.x[:, :1].expand(-1, H))
    assert res.pair_weights.tolist() == [0.5 if r >= 0 else 0.0 for r in want_rows]


@pytest.mark.parametrize("eager", [True, False])
def test_stamps_are_checked_with_the_counts(monkeypatch: pytest.MonkeyPatch, eager: bool) -> None:
    """A peer that rejected its input, or made another call: this rank raises once the counts are in
    and the dispatch kernel is launched (a peer in worst-case mode launches it without waiting)."""
    knobs = Config() if eager else Config(eager_output_bytes=0)
    launch = f"launch rows={sum(RECV)} cached=False worst_case=False"
    error = call_check.input_error(TypeError, "x", "dtype", "x must have dtype torch.bfloat16")
    rejected = call_check.CallOrder().stamp(call_check.DISPATCH, error=error)
    log: list[str] = []
    with pytest.raises(PeerInputError, match=r"dispatch #1: rank 1 rejected its input \(TypeError: x \(dtype\)\)"):
        _dispatch(monkeypatch, knobs, peer=rejected.words, log=log)
    assert log[-1] == (launch if not eager else "host stamps") and any(e.startswith("launch") for e in log)
    other = call_check.CallOrder().stamp(call_check.COMBINE, handle=1)
    log = []
    with pytest.raises(CallMismatchError, match=r"rank 0: dispatch #1, rank 1: combine #1 \(handle of call #1\)"):
        _dispatch(monkeypatch, knobs, peer=other.words, log=log)
    assert log[-1] == (launch if not eager else "host stamps") and any(e.startswith("launch") for e in log)
