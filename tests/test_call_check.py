"""moe_ep.comm.call_check on its own: what a stamp says about a rejected input (from the codes the
errors buffer.py raises carry, never their messages), the verdict of verify on every rank's stamps (own rejection, peers' rejections,
different calls), the counter that resumes past a mismatch, and the host-side check of a native
Buffer made with check_calls=True. The multi-rank tests (tests/test_one_rank_bad_input.py) run the
same through both backends."""
from __future__ import annotations

import ast
import pickle
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import moe_ep
from moe_ep.comm import call_check as cc
from moe_ep.comm.backends.engine import own_group
from moe_ep.comm.errors import BadExpertIdError, CallMismatchError, PeerInputError
from tests._dist import run_workers

H, E, K, T = 256, 8, 2, 4


@pytest.fixture(scope="module")
def messages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Exception]:
    """Real rejections from a one-rank reference Buffer, by what was wrong."""
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    found: dict[str, Exception] = {}
    try:
        with moe_ep.Buffer(hidden=H, num_experts=E, num_topk=K, max_tokens_per_rank=T, backend="reference") as buf:
            x = torch.randn(3, H).to(torch.bfloat16)
            idx = torch.randint(0, E, (3, K))
            w = torch.rand(3, K)
            wide = torch.zeros(3, 2 * H, dtype=torch.bfloat16)
            bad_ids = idx.clone()
            bad_ids[0, 0] = E
            for name, kwargs in {
                "dtype": dict(x=x.float(), topk_idx=idx, topk_weights=w),
                "shape": dict(x=x[:, :8].contiguous(), topk_idx=idx, topk_weights=w),
                "contiguity": dict(x=wide[:, ::2], topk_idx=idx, topk_weights=w),
                "type": dict(x=x, topk_idx=idx.tolist(), topk_weights=w),
                "token count": dict(x=torch.zeros(T + 1, H, dtype=torch.bfloat16), topk_idx=torch.zeros(T + 1, K).long(),
                                    topk_weights=torch.rand(T + 1, K), worst_case=True),
                "expert ids": dict(x=x, topk_idx=bad_ids, topk_weights=w),
                "value": dict(x=x, topk_idx=idx, topk_weights=w, expert_alignment=0),
            }.items():
                with pytest.raises((TypeError, ValueError)) as raised:
                    buf.dispatch(**kwargs)
                found[name] = raised.value
    finally:
        dist.destroy_process_group()
    return found


@pytest.mark.parametrize("check, argument, kind", [
    ("dtype", "x", "TypeError"), ("shape", "x", "ValueError"), ("contiguity", "x", "ValueError"),
    ("type", "topk_idx", "TypeError"), ("token count", "x", "ValueError"),
    ("expert ids", "topk_idx", "BadExpertIdError"), ("value", "expert_alignment", "ValueError"),
])
def test_a_stamp_names_the_argument_and_the_check(messages: dict[str, Exception], check: str, argument: str,
                                                   kind: str) -> None:
    stamp = cc.CallOrder().stamp(cc.DISPATCH, error=messages[check])
    assert cc.describe_reason(stamp.status, stamp.reason) == f"{kind}: {argument} ({check})"
    assert all(-(2 ** 31) <= w < 2 ** 31 for w in stamp.words) and len(stamp.words) == cc.STAMP_WORDS


def _ranks(*stamps: cc.CallStamp) -> list[list[int]]:
    return [s.words for s in stamps]


def test_verify_gives_every_rank_its_verdict() -> None:
    orders = [cc.CallOrder(), cc.CallOrder(), cc.CallOrder()]
    good = [o.stamp(cc.COMBINE, handle=7, size=1) for o in orders]
    cc.verify(good[0], _ranks(*good), 0)  # the same call everywhere: nothing raised
    error = cc.input_error(TypeError, "x", "dtype", "x must have dtype torch.bfloat16, got torch.float32")
    rejected = [o.stamp(cc.DISPATCH, error=error if r == 2 else None) for r, o in enumerate(orders)]
    with pytest.raises(cc.OwnRejection):
        cc.verify(rejected[2], _ranks(*rejected), 2)
    for me in (0, 1):
        with pytest.raises(PeerInputError, match=r"^dispatch #2: rank 2 rejected its input \(TypeError: x \(dtype\)\)"):
            cc.verify(rejected[me], _ranks(*rejected), me)


def test_bad_ids_found_by_the_kernels_are_the_rank_own_rejection() -> None:
    """A native notify sends status BadExpertIdError where its host gave 0 (the kernels found the id):
    that rank raises its own error (from its record, which the check then clears), its peers
    PeerInputError; before, the sending rank named itself as a peer and left its record set."""
    orders = [cc.CallOrder() for _ in range(2)]
    stamps = [o.stamp(cc.DISPATCH) for o in orders]
    sent = _ranks(*stamps)
    sent[1][4] = cc.STATUS.index(BadExpertIdError)
    with pytest.raises(cc.OwnRejection):
        cc.verify(stamps[1], sent, 1)
    with pytest.raises(PeerInputError, match=r"rank 1 rejected its input \(BadExpertIdError: topk_idx \(expert ids\)\)"):
        cc.verify(stamps[0], sent, 0)


def test_different_calls_raise_on_every_rank_and_the_counters_resume() -> None:
    orders = [cc.CallOrder(), cc.CallOrder()]
    orders[1].stamp(cc.DISPATCH)  # rank 1 made one call more
    stamps = [orders[0].stamp(cc.DISPATCH), orders[1].stamp(cc.COMBINE, handle=1, size=1)]
    want = "rank 0: dispatch #1, rank 1: combine #2 (handle of call #1, with topk_weights)"
    for me in (0, 1):
        with pytest.raises(CallMismatchError, match=re.escape(f"({want})")):
            cc.verify(stamps[me], _ranks(*stamps), me)
    assert [o.stamp(cc.DISPATCH).call for o in orders] == [3, 3]


def test_a_peer_rejection_wins_over_the_difference_it_made() -> None:
    """A rank that passed a wrong handle rejects its input and its call differs: its peers learn why."""
    a, b = cc.CallOrder(), cc.CallOrder()
    stamps = [a.stamp(cc.COMBINE, handle=1), b.stamp(cc.COMBINE, handle=2,
                                                           error=cc.input_error(ValueError, "pair_weights", "value", "..."))]
    with pytest.raises(PeerInputError, match=r"rank 1 rejected its input \(ValueError: pair_weights \(value\)\)"):
        cc.verify(stamps[0], _ranks(*stamps), 0)


def _host_check_worker(rank: int, world: int) -> None:
    """Two ranks' stamps meet over gloo: the same call passes; a rejection raises on both; different
    calls raise on both (a check that a peer never joins is the timeout's, tested elsewhere)."""
    check = cc.HostCheck(own_group(dist.group.WORLD, 60.0), rank, timeout_s=60.0)
    order = cc.CallOrder()
    check.verify(order.stamp(cc.DISPATCH))
    stamp = order.stamp(cc.COMBINE, handle=1, error=TypeError("x must have dtype") if rank == 1 else None)
    with pytest.raises(cc.OwnRejection if rank == 1 else PeerInputError):
        check.verify(stamp)
    stamp = order.stamp(cc.LL_DISPATCH if rank == 1 else cc.DISPATCH)
    with pytest.raises(CallMismatchError, match=r"rank 0: dispatch #3, rank 1: low-latency dispatch #3"):
        check.verify(stamp)


def test_host_check_raises_on_every_rank() -> None:
    run_workers(2, _host_check_worker, timeout_s=120)


def test_errors_pickle() -> None:
    for error in (PeerInputError([1], "combine #3", ["TypeError: x (dtype)"]), CallMismatchError("rank 0: a")):
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is type(error) and str(again) == str(error) and isinstance(again, ValueError)
    assert issubclass(BadExpertIdError, ValueError)


def test_a_stamp_reads_codes_not_messages() -> None:
    """The reason word comes from the error's codes: a message naming x says nothing without them, and a
    coded error says its codes whatever its message. The codes survive pickling (errors cross processes)."""
    plain = TypeError("x must have dtype torch.bfloat16, got torch.float32")
    assert cc.describe_reason(*cc._reason(plain)) == "TypeError: ?"
    coded = cc.input_error(ValueError, "comp_signal", "shape", "anything at all")
    assert cc.describe_reason(*cc._reason(coded)) == "ValueError: comp_signal (shape)"
    again = pickle.loads(pickle.dumps(coded))
    assert cc._reason(again) == cc._reason(coded) and str(again) == "anything at all"
    with pytest.raises(KeyError, match="no stamp code"):
        cc.input_error(ValueError, "not_an_argument", "value", "")


def test_validation_raises_only_coded_errors() -> None:
    """Every raise in moe_ep/comm/validate.py builds its error with input_error, and the validate stages of
    Buffer (buffer.py's _validate_* methods) build none of their own: no rejection travels without codes."""
    comm = Path(__file__).resolve().parents[1] / "moe_ep" / "comm"
    for node in ast.walk(ast.parse((comm / "validate.py").read_text())):
        if isinstance(node, ast.Raise):
            assert isinstance(node.exc, ast.Call) and getattr(node.exc.func, "id", None) == "input_error", \
                f"validate.py:{node.lineno} raises an error without codes"
    stages = [f for f in ast.walk(ast.parse((comm / "buffer.py").read_text()))
              if isinstance(f, ast.FunctionDef) and f.name.startswith("_validate")]
    assert len(stages) == 5, [f.name for f in stages]
    for stage in stages:
        for node in ast.walk(stage):
            if isinstance(node, ast.Raise):
                assert isinstance(node.exc, ast.Name), f"buffer.py:{node.lineno} builds an error in {stage.name}"
