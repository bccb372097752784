"""moe_ep.Config: checks, environment defaults, a Buffer's resolved knobs, per-call overrides, and that
every rank must pass the same knobs (CPU ranks over gloo, reference backend)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import moe_ep
from moe_ep import Config
from tests._dist import run_workers
from tests.oracle import random_topk


def test_defaults_and_checks() -> None:
    c = Config()
    assert (c.send_warps, c.combine_send_warps, c.unroll, c.flag_batch, c.recv_run) == (24, 16, 6, 4, 1)
    assert c.replace(unroll=4).unroll == 4 and c.unroll == 6
    for field, bad in (("send_warps", 0), ("send_warps", 33), ("combine_send_warps", -1), ("unroll", 5),
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
    dist.barrier()


def test_buffer_config_on_two_ranks() -> None:
    run_workers(2, _worker)
