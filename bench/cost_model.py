"""Cost model of moe_ep's cross-node path on a real cluster (docs/benchmarks.md, "Cost model").

Prints, for EP sizes 16..256 in nodes of 8 GPUs, the expected bytes each GPU moves per call over
its NIC and over NVLink for N1 (4096 tokens, hidden 7168, top-8 of 256 experts, uniform routing)
and L1 (128 tokens, FP8 dispatch, BF16 combine), and the time those bytes take at NIC_GBPS per GPU
and NVLINK_GBPS, plus the round latency of the normal-mode kernels (rounds of C token slots from
moe_ep.comm._C.internode_plan, the kernel's own layout). A model, not a measurement: it assumes the
links run at the given rates and that the legs overlap (time = the slower leg + round latency).

    python bench/cost_model.py
"""
from __future__ import annotations

from math import comb

from moe_ep.comm import _native

NIC_GBPS = 50.0  # one 400 Gb/s NIC per GPU
NVLINK_GBPS = 350.0  # per direction, measured on our 2xH200 (docs/benchmarks.md)
HOP_US = 8.0  # one signalled network hop (put + signal seen), assumed
ROUND_HOPS = 3  # send, forward, credit: network/NVLink hops a round of the normal mode waits for
H, E, K, L = 7168, 256, 8, 8


def p_hit(group_experts: int) -> float:
    """Probability that a token's K distinct experts (of E, uniform) include one of `group_experts`."""
    return 1 - comb(E - group_experts, K) / comb(E, K)


def n1(r: int, tokens: int = 4096, fp8: bool = False) -> dict:
    nodes = r // L
    row = (H + 4 * H // 128 if fp8 else 2 * H) + _native.load().INTERNODE_ROW_META_BYTES
    node_hit = p_hit(E // nodes)
    rank_hit = p_hit(E // r)
    net = tokens * (nodes - 1) * node_hit * row  # one row per (token, other node) leaves this GPU
    # the forwarder stores each arriving row (and each own-node row) at the other ranks of its node
    rows_in = tokens * nodes * node_hit
    nvl = rows_in * (L * rank_hit / node_hit - rank_hit / node_hit) * row
    round_tokens, ws_bytes = _native.load().internode_plan(r, L, tokens, H, K, E, 2 << 30)
    rounds = -(-tokens // round_tokens)
    t_net, t_nvl = net / NIC_GBPS / 1e3, nvl / NVLINK_GBPS / 1e3
    return dict(net_mb=net / 1e6, nvl_mb=nvl / 1e6, rounds=rounds, ws_gb=ws_bytes / 1e9, net_us=t_net,
                nvl_us=t_nvl, us=max(t_net, t_nvl) + rounds * ROUND_HOPS * HOP_US)


def l1(r: int, tokens: int = 128) -> dict:
    nodes = r // L
    remote_ranks = (r - L) * p_hit(E // r)  # destination ranks in other nodes per token
    dispatch = tokens * remote_ranks * (H + 4 * H // 128 + 48)
    combine = tokens * K * (r - L) / r * 2 * H  # one bf16 row per (token, expert) on another node
    return dict(nodes=nodes, dispatch_us=dispatch / NIC_GBPS / 1e3 + 2 * HOP_US,
                combine_us=combine / NIC_GBPS / 1e3 + 2 * HOP_US)


def main() -> None:
    print(f"NIC {NIC_GBPS:.0f} GB/s per GPU, NVLink {NVLINK_GBPS:.0f} GB/s, {HOP_US:.0f} us per hop, nodes of {L}")
    print("| EP | nodes | N1 rounds (C) | workspace GB | BF16 dispatch: NIC MB / us | NVLink MB / us | "
          "model us | L1 dispatch us | L1 combine us |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in (16, 32, 64, 128, 256):
        a, b = n1(r), l1(r)
        print(f"| {r} | {r // L} | {a['rounds']} | {a['ws_gb']:.2f} | {a['net_mb']:.1f} / {a['net_us']:.0f} | "
              f"{a['nvl_mb']:.1f} / {a['nvl_us']:.0f} | {a['us']:.0f} | {b['dispatch_us']:.0f} | "
              f"{b['combine_us']:.0f} |")


if __name__ == "__main__":
    main()
