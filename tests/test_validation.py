"""Bad input raises a clear ValueError/TypeError (one test per rule, on one rank;
tests/test_one_rank_bad_input.py checks what the peers of a rank that passes it get)."""
from __future__ import annotations

import os
from typing import Callable

import pytest
import torch
import torch.distributed as dist

import moe_ep
from moe_ep.comm import _native, call_check
from tests._dist import run_workers

H, E, K, T = 256, 8, 4, 16


@pytest.fixture(scope="module", autouse=True)
def single_rank_group():
    """A one-rank gloo group in this process: validation never needs a peer."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def buf():
    with moe_ep.Buffer(hidden=H, num_experts=E, num_topk=K, max_tokens_per_rank=T, backend="reference",
                       low_latency=True) as b:
        yield b


def _inputs(n: int = 5):
    x = torch.randn(n, H).to(torch.bfloat16)
    idx = torch.randint(0, E, (n, K))
    w = torch.rand(n, K)
    return x, idx, w


def test_valid_call_passes(buf):
    x, idx, w = _inputs()
    assert buf.dispatch(x, idx, w).x.shape == (5, H)


def test_wrong_x_dtype(buf):
    x, idx, w = _inputs()
    with pytest.raises(TypeError, match="x must have dtype"):
        buf.dispatch(x.float(), idx, w)


def test_wrong_topk_dtype(buf):
    x, idx, w = _inputs()
    with pytest.raises(TypeError, match="topk_idx must have dtype"):
        buf.dispatch(x, idx.int(), w)


def test_wrong_weights_dtype(buf):
    x, idx, w = _inputs()
    with pytest.raises(TypeError, match="topk_weights must have dtype"):
        buf.dispatch(x, idx, w.double())


def test_not_a_tensor(buf):
    x, idx, w = _inputs()
    with pytest.raises(TypeError, match="topk_idx must be a torch.Tensor"):
        buf.dispatch(x, idx.tolist(), w)


def test_wrong_rank_of_tensor(buf):
    x, idx, w = _inputs()
    with pytest.raises(ValueError, match=r"x must have shape \[\*, 256\]"):
        buf.dispatch(x.view(5, 2, 128), idx, w)


def test_hidden_mismatch(buf):
    x, idx, w = _inputs()
    with pytest.raises(ValueError, match="x must have shape"):
        buf.dispatch(x[:, :128].contiguous(), idx, w)


def test_token_count_mismatch(buf):
    x, idx, w = _inputs()
    with pytest.raises(ValueError, match="topk_idx must have shape"):
        buf.dispatch(x, idx[:4], w)
    with pytest.raises(ValueError, match="topk_weights must have shape"):
        buf.dispatch(x, idx, w[:4])


def test_topk_width_mismatch(buf):
    x, idx, w = _inputs()
    with pytest.raises(ValueError, match=r"topk_idx must have shape \[5, 4\]"):
        buf.dispatch(x, idx[:, :3].contiguous(), w)


def test_non_contiguous(buf):
    x, idx, w = _inputs()
    with pytest.raises(ValueError, match="x must be contiguous"):
        buf.dispatch(torch.randn(H, 5).to(torch.bfloat16).t(), idx, w)


def test_expert_id_too_large(buf):
    x, idx, w = _inputs()
    idx[2, 1] = E
    with pytest.raises(ValueError, match=r"topk_idx values must lie in \[-1, 8\)"):
        buf.dispatch(x, idx, w)


def test_expert_id_below_minus_one(buf):
    x, idx, w = _inputs()
    idx[0, 0] = -2
    with pytest.raises(ValueError, match="topk_idx values must lie"):
        buf.get_dispatch_layout(idx)


def test_too_many_tokens(buf):
    """max_tokens_per_rank bounds static-shape calls only; exact-size calls stream more (test_streaming.py)."""
    x, idx, w = _inputs(T + 1)
    with pytest.raises(ValueError, match="above max_tokens_per_rank=16"):
        buf.dispatch(x, idx, w, worst_case=True)
    assert buf.dispatch(x, idx, w).x.shape[0] == int((idx >= 0).any(1).sum())


def test_hidden_not_multiple_of_8():
    with pytest.raises(ValueError, match="hidden must be a multiple of 8"):
        moe_ep.Buffer(hidden=100, num_experts=E, num_topk=K, max_tokens_per_rank=T, backend="reference")


@pytest.mark.parametrize("native", [True, False], ids=["as installed", "without _C"])
def test_topk_above_16(native, monkeypatch):
    if not native:  # the pure-Python install: the limit comes from the documented fallback
        monkeypatch.setattr(_native, "_load", lambda: "moe_ep.comm._C is not built")
    with pytest.raises(ValueError, match="num_topk must be at most 16"):
        moe_ep.Buffer(hidden=H, num_experts=32, num_topk=17, max_tokens_per_rank=T, backend="reference")
    moe_ep.Buffer(hidden=H, num_experts=32, num_topk=16, max_tokens_per_rank=T, backend="reference").close()


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend must be"):
        moe_ep.Buffer(hidden=H, num_experts=E, num_topk=K, max_tokens_per_rank=T, backend="mpi")


def test_fp8_needs_scales(buf):
    x, idx, w = _inputs()
    with pytest.raises(ValueError, match="needs x_scales"):
        buf.dispatch(x.to(torch.float8_e4m3fn), idx, w)


def test_fp8_scales_shape(buf):
    x, idx, w = _inputs()
    with pytest.raises(ValueError, match=r"x_scales must have shape \[5, 2\]"):
        buf.dispatch(x.to(torch.float8_e4m3fn), idx, w, x_scales=torch.ones(5, 3))


def test_scales_without_fp8(buf):
    x, idx, w = _inputs()
    with pytest.raises(ValueError, match="x_scales is only for FP8"):
        buf.dispatch(x, idx, w, x_scales=torch.ones(5, 2))


def test_fp8_needs_hidden_multiple_of_128():
    with moe_ep.Buffer(hidden=72, num_experts=E, num_topk=K, max_tokens_per_rank=T, backend="reference",
                       low_latency=True) as b:
        x = torch.randn(3, 72).to(torch.bfloat16)
        with pytest.raises(ValueError, match="multiple of 128"):
            b.low_latency_dispatch(x, torch.randint(0, E, (3, K)), use_fp8=True)


def test_bad_expert_alignment(buf):
    x, idx, w = _inputs()
    with pytest.raises(ValueError, match="expert_alignment must be a positive int"):
        buf.dispatch(x, idx, w, expert_alignment=0)


def test_handle_from_another_buffer(buf):
    x, idx, w = _inputs()
    other = moe_ep.Buffer(hidden=H, num_experts=E, num_topk=K, max_tokens_per_rank=T, backend="reference")
    handle = other.dispatch(x, idx, w).handle
    with pytest.raises(ValueError, match="handle comes from another Buffer"):
        buf.combine(torch.zeros(5, H, dtype=torch.bfloat16), handle)
    other.close()


def test_handle_of_another_mode(buf):
    x, idx, w = _inputs()
    ll_handle = buf.low_latency_dispatch(x, idx).handle
    with pytest.raises(TypeError, match="handle must be a DispatchHandle"):
        buf.combine(x, ll_handle)
    normal = buf.dispatch(x, idx, w)
    with pytest.raises(TypeError, match="handle must be a LowLatencyHandle"):
        buf.low_latency_combine(torch.zeros(E, T, H, dtype=torch.bfloat16), idx, w, normal.handle)


def test_combine_rows_mismatch(buf):
    x, idx, w = _inputs()
    got = buf.dispatch(x, idx, w)
    with pytest.raises(ValueError, match=r"x must have shape \[5, 256\]"):
        buf.combine(got.x[:4].contiguous(), got.handle)


def test_combine_weights_checked(buf):
    x, idx, w = _inputs()
    got = buf.dispatch(x, idx, w)
    cases = [
        (got.topk_weights.double(), TypeError, "topk_weights must have dtype torch.float32"),
        (got.topk_weights[:4].contiguous(), ValueError, r"topk_weights must have shape \[5, 4\]"),
        (torch.zeros(5, K + 1), ValueError, r"topk_weights must have shape \[5, 4\]"),
        (torch.zeros(K, 5).t(), ValueError, "topk_weights must be contiguous"),
        (torch.zeros(5 * K + 1)[1:].view(5, K), ValueError, "topk_weights must start at a 16-byte aligned address"),
        ("w", TypeError, "topk_weights must be a torch.Tensor"),
    ]
    for bad, error, match in cases:
        with pytest.raises(error, match=match):
            buf.combine(got.x, got.handle, topk_weights=bad)
    out, out_w = buf.combine(got.x, got.handle, topk_weights=got.topk_weights)
    assert out.shape == (5, H) and out_w.shape == (5, K) and out_w.dtype == torch.float32


def test_cached_dispatch_takes_no_topk(buf):
    x, idx, w = _inputs()
    got = buf.dispatch(x, idx, w)
    with pytest.raises(ValueError, match="takes no topk_idx"):
        buf.dispatch(x, idx, w, handle=got.handle)


def test_dispatch_takes_no_layout(buf):
    x, idx, w = _inputs()
    with pytest.raises(TypeError, match="layout"):
        buf.dispatch(x, idx, w, layout=buf.get_dispatch_layout(idx))


def test_low_latency_needs_flag():
    with moe_ep.Buffer(hidden=H, num_experts=E, num_topk=K, max_tokens_per_rank=T, backend="reference") as b:
        x, idx, _ = _inputs()
        with pytest.raises(ValueError, match="low_latency=True"):
            b.low_latency_dispatch(x, idx)


def test_low_latency_combine_shape(buf):
    x, idx, w = _inputs()
    d = buf.low_latency_dispatch(x, idx)
    with pytest.raises(ValueError, match=r"x must have shape \[8, 16, 256\]"):
        buf.low_latency_combine(d.x[:, :8].contiguous(), idx, w, d.handle)


def test_closed_buffer():
    b = moe_ep.Buffer(hidden=H, num_experts=E, num_topk=K, max_tokens_per_rank=T, backend="reference")
    b.close()
    x, idx, w = _inputs()
    with pytest.raises(RuntimeError, match="closed"):
        b.dispatch(x, idx, w)


def test_nvshmem_without_gpu_is_a_clear_error():
    """On a gloo/CPU group the native backend cannot run; the error says why."""
    with pytest.raises(RuntimeError, match="backend='nvshmem' needs CUDA tensors"):
        moe_ep.Buffer(hidden=H, num_experts=E, num_topk=K, max_tokens_per_rank=T, backend="nvshmem")


def _two_rank_rules(rank: int, world: int) -> None:
    """Rules that need a group of 2: experts divisible by the group size; hierarchical=False refused when
    the group spans nodes (2 "nodes" of 1 rank), accepted on one node, hierarchical=True across nodes."""
    with pytest.raises(ValueError, match=r"num_experts \(5\) must be divisible by the group size \(2\)"):
        moe_ep.Buffer(hidden=H, num_experts=5, num_topk=K, max_tokens_per_rank=T, backend="reference")
    common = dict(hidden=H, num_experts=E, num_topk=K, max_tokens_per_rank=T, backend="reference")
    with pytest.raises(ValueError, match="hierarchical=False needs one node, but the group spans 2 nodes of 1 ranks"):
        moe_ep.Buffer(**common, ranks_per_node=1, hierarchical=False)
    with moe_ep.Buffer(**common, ranks_per_node=1) as b:
        assert (b.num_nodes, b.cfg.hierarchical) == (2, True)
    with moe_ep.Buffer(**common, hierarchical=False) as b:
        assert (b.num_nodes, b.cfg.hierarchical) == (1, False)
    _knobs_off_their_path(common, rank)


def _knobs_off_their_path(common: dict, rank: int) -> None:
    """A knob the Buffer's normal-mode kernels do not run is refused, not dropped (moe_ep.comm.config
    KNOB_PATHS): the NVLink kernels' knobs across nodes, the cross-node workspace on one node; per Buffer,
    from the environment (named), and per call; at their defaults, and where they apply, they pass."""
    nvlink_knobs = dict(send_warps=8, combine_send_warps=3, unroll=4, flag_batch=2, recv_run=3)
    for name, value in nvlink_knobs.items():
        with pytest.raises(ValueError, match=rf"^Config\.{name}={value} tunes kernels this Buffer's normal mode does "
                                             "not run: it runs on the cross-node kernels"):
            moe_ep.Buffer(**common, ranks_per_node=1, config=moe_ep.Config(**{name: value}))
    with pytest.raises(ValueError, match=r"^Config\.internode_workspace_bytes=4194304 tunes .* runs on one node"):
        moe_ep.Buffer(**common, config=moe_ep.Config(internode_workspace_bytes=4 << 20))
    os.environ["MOE_EP_RECV_RUN"] = "2"
    try:
        with pytest.raises(ValueError, match=r"^Config\.recv_run=2 \(from MOE_EP_RECV_RUN\) tunes"):
            moe_ep.Buffer(**common, ranks_per_node=1)
    finally:
        del os.environ["MOE_EP_RECV_RUN"]
    g = torch.Generator().manual_seed(rank)
    x, idx, w = (torch.randn(5, H, generator=g).to(torch.bfloat16), torch.randint(0, E, (5, K), generator=g),
                 torch.rand(5, K))
    with moe_ep.Buffer(**common, config=moe_ep.Config(**nvlink_knobs)) as one_node:
        one_node.dispatch(x, idx, w)
    honoured = moe_ep.Config(num_sms=3, eager_output_bytes=0, internode_workspace_bytes=4 << 20)
    with moe_ep.Buffer(**common, ranks_per_node=1, config=honoured) as cross:
        res = cross.dispatch(x, idx, w, config=honoured.replace(eager_output_bytes=1 << 20, recv_run=1))
        with pytest.raises(ValueError, match=r"^Config\.unroll=4 tunes kernels"):
            cross.combine(res.x, res.handle, config=honoured.replace(unroll=4))
        assert cross.combine(res.x, res.handle).shape == x.shape  # refused at once on every rank: still in step


def test_rules_of_a_two_rank_group():
    run_workers(2, _two_rank_rules)


def test_fault_tolerant_needs_low_latency() -> None:
    """fault_tolerant=True is for low-latency Buffers only (docs/api.md): refused without low_latency; the
    reference backend accepts it with low_latency (it honours masks set from Python)."""
    common = dict(hidden=H, num_experts=E, num_topk=K, max_tokens_per_rank=T, backend="reference")
    with pytest.raises(ValueError, match=r"fault_tolerant=True needs low_latency=True"):
        moe_ep.Buffer(**common, fault_tolerant=True)
    with moe_ep.Buffer(**common, low_latency=True, fault_tolerant=True) as b:
        assert b.cfg.fault_tolerant and b.masked_ranks == []


def test_auto_picks_reference_on_cpu(buf):
    assert moe_ep.Buffer(hidden=H, num_experts=E, num_topk=K, max_tokens_per_rank=T).backend_name == "reference"


def test_ranks_per_node_defaults_to_the_detected_node() -> None:
    with moe_ep.Buffer(hidden=H, num_experts=E, num_topk=K, max_tokens_per_rank=T, backend="reference") as b:
        assert (b.ranks_per_node, b.num_nodes) == (1, 1)


@pytest.mark.parametrize("value, error, message", [
    (0, ValueError, "ranks_per_node must be positive, got 0"),
    (-2, ValueError, "ranks_per_node must be positive, got -2"),
    (9, ValueError, "ranks_per_node must be at most 8"),
    (2, ValueError, r"ranks_per_node \(2\) must divide the group size \(1\)"),
    (1.0, TypeError, "ranks_per_node must be an int or None, got float"),
    ("1", TypeError, "ranks_per_node must be an int or None, got str"),
    (True, TypeError, "ranks_per_node must be an int or None, got bool"),
])
def test_bad_ranks_per_node(value: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        moe_ep.Buffer(hidden=H, num_experts=E, num_topk=K, max_tokens_per_rank=T, backend="reference",
                      ranks_per_node=value)


def misaligned(t: torch.Tensor) -> torch.Tensor:
    """The same values starting 8 bytes past a 16-byte boundary (a view into a larger buffer)."""
    flat = torch.empty(t.numel() * t.element_size() + 32, dtype=torch.uint8, device=t.device)
    start = (-flat.data_ptr()) % 16 + 8
    view = flat[start:start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    view.copy_(t)
    return view


@pytest.mark.parametrize("name", ["x", "topk_idx", "topk_weights"])
def test_misaligned_inputs_are_rejected(buf, name):
    x, idx, w = _inputs()
    args = {"x": x, "topk_idx": idx, "topk_weights": w}
    original = args[name]
    args[name] = misaligned(original)
    assert args[name].data_ptr() % 16 == 8 and torch.equal(args[name], original)
    with pytest.raises(ValueError, match=rf"{name} must start at a 16-byte aligned address"):
        buf.dispatch(args["x"], args["topk_idx"], args["topk_weights"])
    res = buf.dispatch(x, idx, w)  # the Buffer is untouched: the same call with aligned inputs works
    assert res.x.shape[1] == x.shape[1]


def test_dir_lists_the_lazy_names() -> None:
    names = dir(moe_ep)
    assert {"MoE", "TopKRouter", "RouterOutput", "CommTimeoutError", "Buffer"} <= set(names)
    assert all(hasattr(moe_ep, name) for name in moe_ep.__all__)


def test_buffer_repr() -> None:
    b = moe_ep.Buffer(hidden=H, num_experts=E, num_topk=K, max_tokens_per_rank=T, backend="reference")
    assert repr(b) == ("moe_ep.Buffer(backend='reference', rank=0 of 1, hidden=256, num_experts=8, num_topk=4, "
                       "max_tokens_per_rank=16, low_latency=False, device='cpu', ranks_per_node=1)")
    b.close()
    assert repr(b).startswith("moe_ep.Buffer(closed, rank=0 of 1")


def test_normal_path_and_workspace_fill_on_the_reference_backend(buf) -> None:
    assert buf.normal_path == "reference"
    buf.fill_workspace(0x7F)  # no symmetric workspace here: nothing to fill, nothing raised
    for bad in (-1, 256, 1.0, True):
        with pytest.raises(ValueError, match="value must be a byte"):
            buf.fill_workspace(bad)


_Case = tuple[str, Callable[[], object], tuple[str, str]]


def _rejection_cases(buf: moe_ep.Buffer, other: moe_ep.Buffer) -> list[_Case]:
    """One call per validation rule of the five communication calls, each breaking that rule alone, and
    the (argument, check) its error must carry for the rank's stamp (moe_ep.comm.call_check); `other`:
    a Buffer without low latency."""
    x, idx, w = _inputs()
    fp8 = x.to(torch.float8_e4m3fn)
    plain = buf.dispatch(x, idx, w)
    pairs = buf.dispatch(x, idx, w, expert_major=True)
    d = buf.low_latency_dispatch(x, idx)
    y = torch.zeros_like(d.x)
    foreign = other.dispatch(x, idx, w).handle
    bad = idx.clone()
    bad[0, 0] = E
    signal = torch.zeros(64, dtype=torch.int32)
    sbo = dict(overlap=True, packed_recv_count=d.count, comp_signal=signal, block_m=8, threshold=1, num_sms=2)
    return [
        ("layout dtype", lambda: buf.get_dispatch_layout(idx.int()), ("topk_idx", "dtype")),
        ("layout ids", lambda: buf.get_dispatch_layout(bad), ("topk_idx", "expert ids")),
        ("layout event", lambda: buf.get_dispatch_layout(idx, previous_event=1), ("previous_event", "type")),
        ("x type", lambda: buf.dispatch(x.tolist(), idx, w), ("x", "type")),
        ("x dtype", lambda: buf.dispatch(x.float(), idx, w), ("x", "dtype")),
        ("x shape", lambda: buf.dispatch(x[:, :8].contiguous(), idx, w), ("x", "shape")),
        ("x device", lambda: buf.dispatch(x.to("meta"), idx, w), ("x", "device")),
        ("x contiguity", lambda: buf.dispatch(torch.zeros(5, 2 * H, dtype=torch.bfloat16)[:, ::2], idx, w),
         ("x", "contiguity")),
        ("x alignment", lambda: buf.dispatch(misaligned(x), idx, w), ("x", "alignment")),
        ("x tokens", lambda: buf.dispatch(*_inputs(T + 1), worst_case=True), ("x", "token count")),
        ("fp8 without scales", lambda: buf.dispatch(fp8, idx, w), ("x_scales", "value")),
        ("scales without fp8", lambda: buf.dispatch(x, idx, w, x_scales=torch.ones(5, H // 128)),
         ("x_scales", "value")),
        ("scales shape", lambda: buf.dispatch(fp8, idx, w, x_scales=torch.ones(5, 1)), ("x_scales", "shape")),
        ("no routing", lambda: buf.dispatch(x, idx), ("topk_idx", "value")),
        ("cached with routing", lambda: buf.dispatch(x, idx, w, handle=plain.handle), ("topk_idx", "value")),
        ("cached tokens", lambda: buf.dispatch(x[:3], handle=plain.handle), ("x", "shape")),
        ("idx dtype", lambda: buf.dispatch(x, idx.int(), w), ("topk_idx", "dtype")),
        ("ids", lambda: buf.dispatch(x, bad, w), ("topk_idx", "expert ids")),
        ("weights dtype", lambda: buf.dispatch(x, idx, w.double()), ("topk_weights", "dtype")),
        ("alignment", lambda: buf.dispatch(x, idx, w, expert_alignment=0), ("expert_alignment", "value")),
        ("expert_major type", lambda: buf.dispatch(x, idx, w, expert_major="yes"), ("expert_major", "type")),
        ("expert_major handle", lambda: buf.dispatch(x, handle=plain.handle, expert_major=True),
         ("expert_major", "value")),
        ("cached pairs alignment", lambda: buf.dispatch(x, handle=pairs.handle, expert_alignment=4),
         ("expert_alignment", "value")),
        ("handle type", lambda: buf.dispatch(x, handle=d.handle), ("handle", "type")),
        ("handle buffer", lambda: buf.dispatch(x, handle=foreign), ("handle", "value")),
        ("num_sms", lambda: buf.dispatch(x, idx, w, num_sms=0), ("num_sms", "value")),
        ("config type", lambda: buf.dispatch(x, idx, w, config={}), ("config", "type")),
        ("config fixed", lambda: buf.combine(plain.x, plain.handle,
                                             config=moe_ep.Config(internode_workspace_bytes=1 << 30)),
         ("config", "value")),
        ("event", lambda: buf.combine(plain.x, plain.handle, previous_event="now"), ("previous_event", "type")),
        ("combine rows", lambda: buf.combine(plain.x[:1], plain.handle), ("x", "shape")),
        ("combine weights", lambda: buf.combine(plain.x, plain.handle, topk_weights=plain.topk_weights.double()),
         ("topk_weights", "dtype")),
        ("pair weights", lambda: buf.combine(plain.x, plain.handle, pair_weights=torch.ones(1)),
         ("pair_weights", "value")),
        ("pairs dtype", lambda: buf.combine(pairs.x.double(), pairs.handle), ("x", "dtype")),
        ("ll tokens", lambda: buf.low_latency_dispatch(*_inputs(T + 1)[:2]), ("x", "token count")),
        ("round_scale", lambda: buf.low_latency_dispatch(x, idx, round_scale=True), ("round_scale", "value")),
        ("ue8m0", lambda: buf.low_latency_dispatch(x, idx, use_fp8=True, use_ue8m0=True), ("use_ue8m0", "value")),
        ("nvfp4 and fp8", lambda: buf.low_latency_dispatch(x, idx, use_fp8=True, use_nvfp4=True,
                                                           x_global_scale=torch.ones(())), ("use_nvfp4", "value")),
        ("global scale alone", lambda: buf.low_latency_dispatch(x, idx, x_global_scale=torch.ones(())),
         ("x_global_scale", "value")),
        ("global scale missing", lambda: buf.low_latency_dispatch(x, idx, use_nvfp4=True), ("x_global_scale", "value")),
        ("global scale type", lambda: buf.low_latency_dispatch(x, idx, use_nvfp4=True, x_global_scale=1.0),
         ("x_global_scale", "type")),
        ("global scale dtype", lambda: buf.low_latency_dispatch(x, idx, use_nvfp4=True,
                                                                x_global_scale=torch.ones((), dtype=torch.float64)),
         ("x_global_scale", "dtype")),
        ("global scale shape", lambda: buf.low_latency_dispatch(x, idx, use_nvfp4=True,
                                                                x_global_scale=torch.ones(2, 2)),
         ("x_global_scale", "shape")),
        ("hook and async", lambda: buf.low_latency_dispatch(x, idx, return_recv_hook=True, async_op=True),
         ("return_recv_hook", "value")),
        ("ll not low latency", lambda: other.low_latency_dispatch(x, idx), ("low_latency", "value")),
        ("ll combine rows", lambda: buf.low_latency_combine(y[:, :8].contiguous(), idx, w, d.handle), ("x", "shape")),
        ("ll combine ids", lambda: buf.low_latency_combine(y, bad, w, d.handle), ("topk_idx", "expert ids")),
        ("ll combine handle", lambda: buf.low_latency_combine(y, idx, w, plain.handle), ("handle", "type")),
        ("overlap arguments alone", lambda: buf.low_latency_combine(y, idx, w, d.handle, block_m=8),
         ("block_m", "value")),
        ("ll num_sms without overlap", lambda: buf.low_latency_combine(y, idx, w, d.handle, num_sms=4),
         ("num_sms", "value")),
        ("overlap missing", lambda: buf.low_latency_combine(y, idx, w, d.handle, overlap=True), ("overlap", "value")),
        ("overlap block_m", lambda: buf.low_latency_combine(y, idx, w, d.handle, **{**sbo, "block_m": 0}),
         ("block_m", "value")),
        ("overlap count", lambda: buf.low_latency_combine(y, idx, w, d.handle,
                                                          **{**sbo, "packed_recv_count": d.count[:1]}),
         ("packed_recv_count", "shape")),
        ("overlap signal", lambda: buf.low_latency_combine(y, idx, w, d.handle, **{**sbo, "comp_signal": signal[:1]}),
         ("comp_signal", "shape")),
        ("overlap short signal", lambda: buf.low_latency_combine(y, idx, w, d.handle, **sbo), ("comp_signal", "value")),
    ]


def test_every_rejection_carries_its_codes(buf):
    """Each rule's error carries the codes of the argument and check that failed, which the rejecting
    rank's stamp sends its peers (read from the codes, never from the message)."""
    with moe_ep.Buffer(hidden=H, num_experts=E, num_topk=K, max_tokens_per_rank=T, backend="reference") as other:
        for what, call, want in _rejection_cases(buf, other):
            with pytest.raises((TypeError, ValueError)) as raised:
                call()
            status, reason = call_check._reason(raised.value)
            argument, check = divmod(reason, 16)
            assert status and (call_check.ARGUMENTS[argument], call_check.CHECKS[check]) == want, \
                f"{what}: {type(raised.value).__name__}: {raised.value}"
