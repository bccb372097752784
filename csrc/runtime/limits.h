// The limits every kernel family shares, declared once here and exported to Python once
// (runtime_bindings.cpp: MAX_NODE_RANKS, MAX_TOPK, MAX_RANKS_PER_GPU), where moe_ep/comm/buffer.py validates against them.
// A limit of one family only (e.g. the cross-node grid, internode.h kMaxChannels) lives in that
// family's header and is exported by its bindings.
#pragma once

namespace moe_ep {

// Ranks of one NVLink domain (a node): the per-peer arrays of the signal words (comm.h), the NVLink
// normal path's group, the ranks a cross-node or low-latency kernel reaches by loads and stores.
constexpr int kMaxNodeRanks = 8;

// Top-k entries per token, on every path (row metadata, staged low-latency ids, shared-memory arrays).
constexpr int kMaxTopk = 16;

// Ranks (NVSHMEM PEs) sharing one GPU. Without MPS, NVSHMEM's multi-process-per-GPU init keeps one
// CUDA IPC event handle per PE of a GPU in fixed arrays of MAX_PES_PER_GPU = 48 entries (its
// nvshmemi_types.h, 3.4.5 and 3.5 sources) and does not check the count: a 49th PE writes past them
// (64 ranks on one H200: SIGSEGV inside nvshmem init, 2026-12-03). Buffer refuses more on every rank.
constexpr int kMaxRanksPerGpu = 48;

}  // namespace moe_ep
