// Host side that the NVLink (intranode/) and cross-node (internode/) normal-mode bindings share: the
// checks of their dimensions and of the dispatch / combine fields they have in common, and the common
// part of their contexts. Each folder's bindings.cpp checks its own fields beside these. Host only
// (runtime/named_args.h). D is the folder's Dims (nranks R, max_tokens T, hidden H), A an args struct.
#pragma once
#include <cstdint>
#include <string>

#include "runtime/context.h"
#include "runtime/named_args.h"

namespace moe_ep {

// The dimensions both contexts check: rank of nranks (at most max_ranks), max_tokens, hidden (rows of
// int4), num_topk (at most max_topk), num_experts (E_l per rank).
inline void check_normal_dims(const ArgCheck& c, int rank, int nranks, int max_ranks, int max_tokens, int hidden,
                              int num_topk, int max_topk, int num_experts) {
  if (nranks < 1 || nranks > max_ranks || rank < 0 || rank >= nranks)
    c.fail("rank " + std::to_string(rank) + " of " + std::to_string(nranks) + " (at most " +
           std::to_string(max_ranks) + " ranks)");
  c.at_least("max_tokens", max_tokens, 1);
  c.positive_multiple("hidden", hidden, 8);
  c.in_range("num_topk", num_topk, 1, max_topk);
  c.positive_multiple("num_experts", num_experts, nranks, "nranks");
}

// A context's fields that both folders' Context structs have: the runtime's (checked when it was made),
// then its own addresses checked (none may be 0); the caller sets and checks the rest.
template <class Context, class D>
Context normal_context(const ArgCheck& c, const D& dims, const RuntimeContext& rt, uintptr_t epochs,
                       uintptr_t block_counters) {
  c.pointer("epochs", epochs);
  c.pointer("block_counters", block_counters);
  Context ctx{};
  ctx.dims = dims;
  ctx.ws = workspace_layout(dims);
  ctx.timeout_ns = rt.timeout_ns;
  ctx.error = rt.error;
  ctx.verdict = rt.verdict;
  ctx.epochs = epochs;
  ctx.block_counters = block_counters;
  return ctx;
}

// Rows of a normal-mode dispatch: bf16 (row_bytes = 2H, no scales) or e4m3 (row_bytes = H, H a multiple
// of 128, num_scales = H / 128 float32 scales per row).
inline void check_row_format(const ArgCheck& c, int hidden, int row_bytes, int num_scales) {
  const std::string rb = "row_bytes = " + std::to_string(row_bytes);
  if (row_bytes == 2 * hidden) {
    if (num_scales != 0)
      c.fail("num_scales = " + std::to_string(num_scales) + " with bf16 rows (" + rb + " = hidden * 2), expected 0");
  } else if (row_bytes == hidden) {
    if (hidden % 128 != 0)
      c.fail("FP8 rows (" + rb + " = hidden * 1) need hidden to be a multiple of 128, got " + std::to_string(hidden));
    if (num_scales != hidden / 128)
      c.fail("num_scales = " + std::to_string(num_scales) + " with FP8 rows (" + rb + " = hidden * 1), expected " +
             "hidden / 128 = " + std::to_string(hidden / 128));
  } else {
    c.fail(rb + ", expected hidden * 2 = " + std::to_string(2 * hidden) + " (bf16) or hidden * 1 = " +
           std::to_string(hidden) + " (FP8)");
  }
}

// N tokens in (x, x_scales, topk_idx, topk_weights, pos), M rows out (the out_ pointers), the counts in
// recv_info. M has no upper bound: a call that streams in rounds of at most T tokens (moe_ep/comm/backends/engine.py)
// writes each round's rows at their final place in the whole output (recv_info's first rows say where).
// A cached dispatch reads no topk and writes no topk, src_rank or src_index; one with rows_out false
// writes no x (an NVLink dispatch whose rows stay in the workspace).
template <class D, class A>
void check_normal_dispatch(const ArgCheck& c, const D& d, const A& a, bool rows_out = true) {
  c.count("num_tokens", a.num_tokens, "max_tokens", d.max_tokens);
  c.at_least("num_rows", a.num_rows, 0);
  check_row_format(c, d.hidden, a.row_bytes, a.num_scales);
  c.at_least("num_blocks", a.num_blocks, 1);
  const bool in = a.num_tokens > 0, out = a.num_rows > 0, fp8 = a.num_scales > 0, fresh = !a.cached;
  c.pointer("x", a.x, in);
  c.pointer("x_scales", a.x_scales, in && fp8);
  c.pointer("topk_idx", a.topk_idx, in && fresh);
  c.pointer("topk_weights", a.topk_weights, in && fresh);
  c.pointer("pos", a.pos, in);
  c.pointer("recv_info", a.recv_info);
  c.pointer("out_x", a.out_x, out && rows_out);
  c.pointer("out_scales", a.out_scales, out && fp8);
  c.pointer("out_topk_idx", a.out_topk_idx, out && fresh);
  c.pointer("out_topk_weights", a.out_topk_weights, out && fresh);
  c.pointer("out_src_rank", a.out_src_rank, out && fresh);
  c.pointer("out_src_index", a.out_src_index, out && fresh);
}

// M received rows in (x, src_index, and topk_weights with weights; any M, as for dispatch: a round of a
// streamed call reads its rows where they are in the whole output), N tokens out (out, and
// out_topk_weights with weights).
template <class D, class A>
void check_normal_combine(const ArgCheck& c, const D& d, const A& a) {
  c.at_least("num_rows", a.num_rows, 0);
  c.count("num_tokens", a.num_tokens, "max_tokens", d.max_tokens);
  c.at_least("num_blocks", a.num_blocks, 1);
  const bool in = a.num_rows > 0, out = a.num_tokens > 0;
  c.pointer("x", a.x, in);
  c.pointer("src_index", a.src_index, in);
  c.pointer("recv_info", a.recv_info);
  c.pointer("out", a.out, out);
  c.pointer("topk_weights", a.topk_weights, a.with_weights && in);
  c.pointer("out_topk_weights", a.out_topk_weights, a.with_weights && out);
}

}  // namespace moe_ep
