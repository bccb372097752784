"""Nodes: topology detection, forced ranks_per_node, and the reference backend's two-level combine
against brute force over all ranks' inputs (gloo, CPU, R = 4 as 2 x 2, 4 x 1 and 1 x 4)."""
from __future__ import annotations

import os
import re
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import moe_ep
from moe_ep.comm import _native, topology
from moe_ep.comm.buffer import _check_ranks_per_gpu, auto_backend
from tests._dist import run_workers
from tests.oracle import (
    expected_combine,
    expected_combine_weights,
    expected_dispatch,
    expected_layout,
    local_weights,
    make_inputs,
)

WORLD = 4
# (seed, tokens per rank, hidden, experts, topk, routing, max_tokens_per_rank): -1 entries
# ('random', 'skewed'), a rank with 0 tokens, K = 1, every token on several ranks (E = R).
CASES = [
    (31, [30, 0, 17, 25], 256, 16, 8, "random", 32),
    (32, [20, 13, 20, 7], 128, 8, 1, "random", 24),
    (33, [40, 9, 0, 33], 512, 32, 4, "skewed", 48),
    (34, [16, 16, 16, 16], 128, 4, 4, "random", 16),
    (35, [11, 23, 5, 0], 64, 8, 3, "one_expert", 24),
]


def _row_transform(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per receiving rank r: the expert output of a row x is bf16(x * scale[r] + shift[r]); random
    magnitudes, so rounding each node's partial to bf16 changes some sums."""
    g = torch.Generator().manual_seed(seed + 1000)
    sign = torch.where(torch.rand(WORLD, generator=g) < 0.5, -1.0, 1.0)
    return sign * (0.25 + 4 * torch.rand(WORLD, generator=g)), 3 * torch.randn(WORLD, generator=g)


def _check_combine(buf: moe_ep.Buffer, inp, me: int, experts: int, seed: int, worst_case: bool) -> tuple[int, int]:
    """Combine (rows, and topk_weights with them) against the two-level oracle; returns how many
    output values (rows, weights) differ from the flat sum."""
    scale, shift = _row_transform(seed)
    x, idx, w = inp.x[me], inp.topk_idx[me], inp.topk_weights[me]
    got = buf.dispatch(x, idx, w, worst_case=worst_case)
    if not worst_case:
        want = expected_dispatch(inp, me, WORLD, experts)
        assert torch.equal(got.x.view(torch.int16), want.x.view(torch.int16))
        assert got.src_rank.tolist() == want.src_rank and got.src_index.tolist() == want.src_index
    y = (got.x.float() * scale[me] + shift[me]).to(torch.bfloat16)
    out = buf.combine(y, got.handle)
    out_rows, out_w = buf.combine(y, got.handle, topk_weights=got.topk_weights * scale[me] + shift[me])
    assert torch.equal(out_rows.view(torch.int16), out.view(torch.int16))

    def row_of(r: int, s: int, i: int) -> torch.Tensor:
        return (inp.x[s][i].float() * scale[r] + shift[r]).to(torch.bfloat16)

    def weights_of(r: int, s: int, i: int) -> torch.Tensor:
        return local_weights(inp, r, s, i, experts, WORLD) * scale[r] + shift[r]

    want_w = expected_combine_weights(inp, me, WORLD, experts, weights_of, ranks_per_node=buf.ranks_per_node)
    assert torch.equal(out_w.view(torch.int32), want_w.view(torch.int32)), "combined weights"
    flat_w = expected_combine_weights(inp, me, WORLD, experts, weights_of)
    if buf.ranks_per_node in (1, WORLD):
        assert torch.equal(out_w.view(torch.int32), flat_w.view(torch.int32)), "combined weights: flat rule"

    want = expected_combine(inp, me, WORLD, experts, row_of, ranks_per_node=buf.ranks_per_node)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    flat = expected_combine(inp, me, WORLD, experts, row_of)
    if buf.ranks_per_node in (1, WORLD):  # one rank per node, or one node: the flat rule exactly
        assert torch.equal(out.view(torch.int16), flat.view(torch.int16))
    nowhere = ~expected_layout(inp, me, WORLD, experts)[2].any(dim=1)
    assert (out[nowhere].view(torch.int16) == 0).all()  # +0.0 for tokens that went nowhere
    assert (out_w[nowhere].view(torch.int32) == 0).all()
    return (int((out.view(torch.int16) != flat.view(torch.int16)).sum()),
            int((out_w.view(torch.int32) != flat_w.view(torch.int32)).sum()))


def _combine_worker(rank: int, world: int) -> None:
    differs = torch.zeros(2, dtype=torch.int64)  # rows, weights
    for seed, tokens, hidden, experts, topk, routing, t in CASES:
        inp = make_inputs(seed, tokens, hidden, experts, topk, routing)
        for ranks_per_node in (2, 1, 4):
            with moe_ep.Buffer(hidden=hidden, num_experts=experts, num_topk=topk, max_tokens_per_rank=t,
                               backend="reference", ranks_per_node=ranks_per_node) as buf:
                assert (buf.ranks_per_node, buf.num_nodes) == (ranks_per_node, world // ranks_per_node)
                assert (buf.cfg.node, buf.cfg.local_rank) == divmod(rank, ranks_per_node)
                try:
                    for worst_case in (False, True):
                        n = _check_combine(buf, inp, rank, experts, seed, worst_case)
                        differs += torch.tensor(n) if ranks_per_node == 2 else 0
                except AssertionError as e:
                    raise AssertionError(f"case seed={seed} ranks_per_node={ranks_per_node} rank={rank}: {e}") from e
    dist.all_reduce(differs)
    assert (differs > 0).all(), \
        f"2 nodes x 2 gave the flat sum everywhere (rows, weights differ: {differs.tolist()}): the cases do not test the two levels"


def _detection_worker(rank: int, world: int) -> None:
    group = dist.group.WORLD
    kwargs = dict(hidden=64, num_experts=8, num_topk=2, max_tokens_per_rank=8, backend="reference")
    # every rank on this host: one node of min(world, 8) ranks
    assert topology.resolve(group, None) == topology.Topology(ranks_per_node=world, num_nodes=1, detected=world,
                                                              forced=False, ranks_per_gpu=0)
    with moe_ep.Buffer(**kwargs) as buf:
        assert (buf.ranks_per_node, buf.num_nodes) == (world, 1)
    with pytest.raises(ValueError, match=r"ranks_per_node \(3\) must divide the group size \(4\)"):
        moe_ep.Buffer(**kwargs, ranks_per_node=3)

    # two hosts of two ranks each
    with mock.patch("socket.gethostname", return_value=f"host{rank // 2}"):
        assert topology.resolve(group, None) == topology.Topology(2, 2, 2, False, 0)
        assert topology.resolve(group, 1) == topology.Topology(1, 4, 2, True, 0)
        with moe_ep.Buffer(**kwargs) as buf:
            assert (buf.ranks_per_node, buf.num_nodes) == (2, 2)
        with pytest.raises(ValueError, match="ranks_per_node=4 exceeds the 2 ranks per node detected"):
            moe_ep.Buffer(**kwargs, ranks_per_node=4)
    with mock.patch("socket.gethostname", return_value=f"host{rank % 2}"):
        with pytest.raises(RuntimeError, match="must be contiguous"):
            moe_ep.Buffer(**kwargs)
    with mock.patch("socket.gethostname", return_value=f"host{rank // 3}"):
        with pytest.raises(RuntimeError, match="same number of ranks"):
            topology.detect(group)


def _world_worker(rank: int, world: int) -> None:
    _detection_worker(rank, world)
    _combine_worker(rank, world)


def test_two_level_combine_and_detection_on_four_ranks() -> None:
    run_workers(WORLD, _world_worker)


@pytest.mark.parametrize("hosts, per_host", [
    (["a"], 1), (["a", "a", "b", "b"], 2), (["n0"] * 8 + ["n1"] * 8, 8), (["x", "y", "z"], 1),
])
def test_ranks_per_host(hosts: list[str], per_host: int) -> None:
    assert topology.ranks_per_host(hosts) == per_host


@pytest.mark.parametrize("hosts, message", [
    (["a", "b", "a", "b"], "must be contiguous"), (["a", "a", "a", "b"], "same number of ranks"),
    (["a", "a", "b"], "same number of ranks"),
])
def test_ranks_per_host_rejects_uneven_layouts(hosts: list[str], message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        topology.ranks_per_host(hosts)


@pytest.mark.parametrize("per_host, size", [(1, 1), (2, 2), (7, 7), (8, 8), (9, 3), (10, 5), (12, 6), (16, 8)])
def test_node_size_is_at_most_8_and_divides_the_host(per_host: int, size: int) -> None:
    assert topology.node_size(per_host) == size


@pytest.mark.parametrize("gpus", [1, 2])
def test_more_ranks_on_one_gpu_than_nvshmem_serves_is_refused(gpus: int) -> None:
    """NVSHMEM's init crashes past MAX_RANKS_PER_GPU processes on one GPU: counted per GPU (host, UUID)
    over every rank's placement, refused for the native backend only."""
    most = _native.constant("MAX_RANKS_PER_GPU")
    for per_gpu in (most, most + 1):
        places = [("host0", f"GPU-{r % gpus}") for r in range(per_gpu * gpus)]
        topo = topology.from_placements(places, 8)
        assert topo.ranks_per_gpu == per_gpu
        _check_ranks_per_gpu("reference", topo.ranks_per_gpu)
        if per_gpu == most:
            _check_ranks_per_gpu("nvshmem", topo.ranks_per_gpu)
        else:
            with pytest.raises(ValueError, match=rf"{per_gpu} ranks of the group share one GPU, but NVSHMEM serves at "
                                                 rf"most {most} processes per GPU"):
                _check_ranks_per_gpu("nvshmem", topo.ranks_per_gpu)


def test_auto_picks_native_whatever_the_group_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """No rule on the group size any more: CUDA + moe_ep.comm._C is enough, across nodes too."""
    monkeypatch.setattr(_native, "available", lambda: (True, ""))
    assert auto_backend(torch.device("cuda", 0))[0] == "nvshmem"
    assert auto_backend(torch.device("cpu"))[0] == "reference"
    monkeypatch.setattr(_native, "available", lambda: (False, "moe_ep.comm._C is not built"))
    assert auto_backend(torch.device("cuda", 0)) == ("reference", "moe_ep.comm._C is not built")


def test_nvshmem_defaults_leave_the_users_values(monkeypatch: pytest.MonkeyPatch) -> None:
    from moe_ep.comm.backends.symmetric import TRANSPORT_VARS, apply_nvshmem_defaults

    for key in TRANSPORT_VARS:
        monkeypatch.delenv(key, raising=False)
    line = apply_nvshmem_defaults(spans_hosts=False)
    assert "NVSHMEM_IB_ENABLE_IBGDA" not in os.environ and "NVSHMEM_IB_ENABLE_IBGDA" not in line
    assert "set by moe_ep: NVSHMEM_DISABLE_NVLS=1;" in line

    monkeypatch.setenv("NVSHMEM_REMOTE_TRANSPORT", "ibrc")
    line = apply_nvshmem_defaults(spans_hosts=True)
    assert os.environ["NVSHMEM_IB_ENABLE_IBGDA"] == "1"
    assert line.endswith("set by moe_ep: NVSHMEM_IB_ENABLE_IBGDA=1, NVSHMEM_DISABLE_NVLS=1; "
                         "as the user had them: NVSHMEM_REMOTE_TRANSPORT=ibrc")

    monkeypatch.setenv("NVSHMEM_IB_ENABLE_IBGDA", "0")
    monkeypatch.setenv("NVSHMEM_DISABLE_NVLS", "0")
    line = apply_nvshmem_defaults(spans_hosts=True)
    assert os.environ["NVSHMEM_IB_ENABLE_IBGDA"] == "0"
    assert "set by moe_ep: nothing;" in line and "NVSHMEM_IB_ENABLE_IBGDA=0" in line


def test_info_reports_transport_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from moe_ep import info

    monkeypatch.delenv("NVSHMEM_IB_ENABLE_IBGDA", raising=False)
    monkeypatch.delenv("NVSHMEM_ENABLE_NIC_PE_MAPPING", raising=False)
    monkeypatch.setenv("NVSHMEM_REMOTE_TRANSPORT", "ibrc")
    monkeypatch.setenv("NVSHMEM_HCA_LIST", "mlx5_0:1")
    out = info.report()
    assert re.search(r"^  NVSHMEM_REMOTE_TRANSPORT +ibrc \(environment\)$", out, re.M)
    assert re.search(r"^  NVSHMEM_IB_ENABLE_IBGDA +unset: moe_ep sets 1 when the group spans hosts", out, re.M)
    assert "NVSHMEM_HCA_LIST takes effect only with NVSHMEM_ENABLE_NIC_PE_MAPPING=1" in out
    assert re.search(r"^GDRCopy +(libgdrapi\S* loads|libgdrapi not found: .+)$", out, re.M)
    has_ib = info.INFINIBAND_DIR.is_dir() and any(info.INFINIBAND_DIR.iterdir())
    assert ("no InfiniBand device found" in out) != has_ib
    assert re.search(r"^Nodes +.+$", out, re.M)
