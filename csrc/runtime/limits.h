// The limits every kernel family shares, declared once here and exported to Python once
// (runtime_bindings.cpp: MAX_NODE_RANKS, MAX_TOPK), where moe_ep/comm/buffer.py validates against them.
// A limit of one family only (e.g. the cross-node grid, internode.h kMaxChannels) lives in that
// family's header and is exported by its bindings.
#pragma once

namespace moe_ep {

// Ranks of one NVLink domain (a node): the per-peer arrays of the signal words (comm.h), the NVLink
// normal path's group, the ranks a cross-node or low-latency kernel reaches by loads and stores.
constexpr int kMaxNodeRanks = 8;

// Top-k entries per token, on every path (row metadata, staged low-latency ids, shared-memory arrays).
constexpr int kMaxTopk = 16;

}  // namespace moe_ep
