// The warp-wide basics every kernel folder shares: the member mask of a full warp, for the *_sync
// intrinsics (ballots, shuffles, votes). Kernels run whole warps: blockDim.x is a multiple of 32.
#pragma once

namespace moe_ep {

constexpr unsigned kFullMask = 0xffffffffu;

}  // namespace moe_ep
