"""moe_ep.Config: checks, environment defaults, a Buffer's resolved knobs, per-call overrides, and that
every rank must pass the same knobs (CPU ranks over gloo, reference backend). The reference backend
ignores the knobs, so what reaches the backend is recorded (_Recording) and compared with what each
call asked for; that the native kernels give the same bits under every knob is tests/test_gpu_config.py's."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import moe_ep
from moe_ep import Config
from tests._dist import run_workers
from tests.oracle import random_topk
from tests.test_gpu_config import PER_BUFFER, PER_CALL


def test_defaults_and_checks() -> None:
    c = Config()
    assert (c.send_warps, c.combine_send_warps, c.unroll, c.flag_batch, c.recv_run) == (24, 16, 6, 4, 1)
    assert c.replace(unroll=4).unroll == 4 and c.unroll == 6
    for field, bad in (("send_warps", 0), ("send_warps", 33), ("combine_send_warps", -1), ("unroll", 5), ("unroll", 7),
                       ("flag_batch", 33), ("recv_run", 0), ("num_sms", 0), ("internode_workspace_bytes", 1),
                       ("send_warps", True), ("flag_batch", 2.0), ("low_latency_num_sms", 0)):
        with pytest.raises(ValueError, match=rf"Config\.{field}"):
            Config(**{field: bad})


def test_environment_gives_defaults_only() -> None:
    env = {"MOE_EP_SEND_WARPS": "20", "MOE_EP_UNROLL": "4", "MOE_EP_NUM_SMS": "", "OTHER": "1"}
    assert Config.from_env(env) == Config(send_warps=20, unroll=4)
    assert Config.from_env({}) == Config()
    with pytest.raises(ValueError, match="MOE_EP_FLAG_BATCH='many': expected an integer"):
        Config.from_env({"MOE_EP_FLAG_BATCH": "many"})
    with pytest.raises(ValueError, match=r"Config\.recv_run .* \(from the MOE_EP_\* environment\)"):
        Config.from_env({"MOE_EP_RECV_RUN": "99"})


def test_gpu_test_covers_every_knob() -> None:
    """tests/test_gpu_config.py changes every normal-mode knob of Config (a new knob must be added there);
    the low-latency grid knob, per low-latency Buffer, is changed by tests/test_gpu_low_latency.py."""
    fields = {f.name for f in dataclasses.fields(Config)}
    per_buffer_only = {"internode_workspace_bytes", "low_latency_num_sms"}
    assert {name for change in PER_CALL for name in change} == fields - per_buffer_only
    assert {name for change in PER_BUFFER for name in change} == fields - {"low_latency_num_sms"}
    low_latency_test = (Path(__file__).parent / "test_gpu_low_latency.py").read_text()
    assert "Config(low_latency_num_sms=" in low_latency_test


class _Recording:
    """Stands in for a Buffer's backend: records each normal-mode call's SM budget and knobs, then runs
    the real backend."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[tuple[str, int, Config]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def dispatch(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(("dispatch", kwargs["num_sms"], kwargs["knobs"]))
        return self.inner.dispatch(*args, **kwargs)

    def combine(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(("combine", kwargs["num_sms"], kwargs["knobs"]))
        return self.inner.combine(*args, **kwargs)


def _plumbing_case(rank: int, common: dict) -> None:
    """The knobs a Buffer is made with, and each call's override, reach the backend as given: the
    Buffer's config (num_sms resolved), a call's config (its num_sms, else the Buffer's), num_sms= over both;
    MOE_EP_* variables give a Buffer made without a config its knobs."""
    knobs = Config(send_warps=8, combine_send_warps=3, unroll=4, flag_batch=2, recv_run=5, num_sms=5,
                   eager_output_bytes=0)
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(9, 64, generator=g).to(torch.bfloat16)
    idx, w = random_topk("random", 9, 8, 2, g, device="cpu"), torch.rand(9, 2, generator=g)
    with moe_ep.Buffer(**common, config=knobs) as buf:
        assert buf.backend.cfg.config == knobs
        rec = buf._backend = _Recording(buf.backend)
        res = buf.dispatch(x, idx, w)
        buf.combine(res.x, res.handle)
        call = Config(send_warps=31, flag_batch=32, recv_run=1)
        buf.dispatch(x, idx, w, config=call)
        buf.combine(res.x, res.handle, config=call.replace(num_sms=2))
        buf.dispatch(x, idx, w, config=call.replace(num_sms=2), num_sms=4)
        buf.dispatch(x, handle=res.handle, config=call)
        assert rec.calls == [("dispatch", 5, knobs), ("combine", 5, knobs), ("dispatch", 5, call),
                             ("combine", 2, call.replace(num_sms=2)), ("dispatch", 4, call.replace(num_sms=2)),
                             ("dispatch", 5, call)], rec.calls
    os.environ.update(MOE_EP_UNROLL="4", MOE_EP_RECV_RUN="9")
    try:
        with moe_ep.Buffer(**common) as buf:
            assert buf.backend.cfg.config == Config(unroll=4, recv_run=9, num_sms=24)
    finally:
        del os.environ["MOE_EP_UNROLL"], os.environ["MOE_EP_RECV_RUN"]


def _worker(rank: int, world: int) -> None:
    common = dict(hidden=64, num_experts=8, num_topk=2, max_tokens_per_rank=16, backend="reference")
    with moe_ep.Buffer(**common) as buf:
        assert buf.config == Config(num_sms=24)  # resolved: the default SM budget filled in
    knobs = Config(send_warps=8, flag_batch=2, num_sms=5)
    with moe_ep.Buffer(**common, config=knobs) as buf:
        assert buf.config == knobs
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(11, 64, generator=g).to(torch.bfloat16)
        idx = random_topk("random", 11, 8, 2, g, device="cpu")
        w = torch.rand(11, 2, generator=g)
        want = buf.dispatch(x, idx, w)
        for call in (Config(unroll=4), Config(recv_run=7, num_sms=3)):
            got = buf.dispatch(x, idx, w, config=call)
            assert torch.equal(got.x.view(torch.int16), want.x.view(torch.int16))
            assert torch.equal(buf.combine(got.x, got.handle, config=call), buf.combine(want.x, want.handle))
        with pytest.raises(ValueError, match="internode_workspace_bytes is fixed when the Buffer is made"):
            buf.dispatch(x, idx, w, config=Config(internode_workspace_bytes=1 << 30))
        with pytest.raises(TypeError, match="config must be a moe_ep.Config"):
            buf.combine(want.x, want.handle, config={"unroll": 4})
    with moe_ep.Buffer(**common, num_sms=7, config=knobs) as buf:
        assert buf.config.num_sms == 7  # num_sms= wins over the config's
    with pytest.raises(ValueError, match="low_latency_num_sms needs low_latency=True"):  # honoured or refused
        moe_ep.Buffer(**common, config=Config(low_latency_num_sms=4))
    with moe_ep.Buffer(**common, low_latency=True, config=Config(low_latency_num_sms=4)) as buf:
        with pytest.raises(ValueError, match="low_latency_num_sms is fixed when the Buffer is made"):
            buf.dispatch(x, idx, w, config=Config(low_latency_num_sms=8))
    # every rank must pass the same knobs: all raise, naming each rank's Config
    with pytest.raises(ValueError, match="same config; got Config"):
        moe_ep.Buffer(**common, config=Config(send_warps=8 + rank))
    _plumbing_case(rank, common)
    dist.barrier()


def test_buffer_config_on_two_ranks() -> None:
    run_workers(2, _worker)
