"""Grouped GEMMs over rows grouped by expert, as Triton kernels with no host sync: the row tiles of every
expert from per-expert counts on the device, the rows optionally gathered inside the loads.

`expert_tile` (the tile -> expert map) is shared with the FP8 kernel of moe_ep.fp8_experts; `mm` is the
bf16 kernel the experts can use in place of torch._grouped_mm where it is faster (uneven groups:
its row tile can be smaller than the 128 rows torch's kernels round every group up to).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: callers keep their torch paths
    triton = None


@dataclass(frozen=True)
class Tiles:
    """A grouped GEMM's launch shape: rows x columns per program, K step, warps, pipeline stages."""

    bm: int = 128
    bn: int = 128
    bk: int = 64
    num_warps: int = 8
    num_stages: int = 3


if triton is not None:

    @triton.jit
    def expert_tile(pid, counts_ptr, rows_ptr, N, E, GATHER: tl.constexpr, E_POW2: tl.constexpr, BM: tl.constexpr,
                    BN: tl.constexpr):
        """Program pid's tile: (expert e, or E past the last expert's tiles; the tile's rows [BM] int64;
        which of them are the expert's; the rows of A they read (rows_ptr[row] with GATHER, else row);
        first row of the tile; its columns [BN]; which are < N).

        Column tiles run fastest, so programs running at once share their row tiles and one expert's
        weights in L2. Row tiles are laid out expert by expert, ceil(count / BM) each, found by a scan
        of the counts [E] on the device; the grid is sized for the most tiles any counts can need
        (rows / BM + E row tiles), and programs past the last tile have nothing to do.
        """
        n_tiles = tl.cdiv(N, BN)
        tile_m = pid // n_tiles
        tile_n = pid % n_tiles
        experts = tl.arange(0, E_POW2)
        counts = tl.load(counts_ptr + experts, mask=experts < E, other=0)
        tiles = (counts + BM - 1) // BM
        tiles_end = tl.cumsum(tiles, 0)
        e = tl.sum((tiles_end <= tile_m).to(tl.int32), 0)
        here = experts == e
        first_row = tl.sum(tl.where(here, tl.cumsum(counts, 0) - counts, 0), 0)
        count = tl.sum(tl.where(here, counts, 0), 0)
        first_tile = tl.sum(tl.where(here, tiles_end - tiles, 0), 0)
        local = (tile_m - first_tile) * BM + tl.arange(0, BM)
        tile_row = first_row + (tile_m - first_tile) * BM
        col = tile_n * BN + tl.arange(0, BN)
        row = (first_row + local).to(tl.int64)
        row_ok = local < count
        if GATHER:
            src = tl.load(rows_ptr + row, mask=row_ok, other=0).to(tl.int64)
        else:
            src = row
        return e, row, row_ok, src, tile_row, col, col < N

    @triton.jit
    def _mm_kernel(a_ptr, rows_ptr, b_ptr, out_ptr, counts_ptr, N, K, E, GATHER: tl.constexpr,
                   B_NK: tl.constexpr, E_POW2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """out[p] = a[src_p] @ B[e_p], B[e] = b[e]^T (b [E, N, K], B_NK) or b[e] (b [E, K, N]), float32
        accumulation in K order, one program per (row tile, column tile) as expert_tile lays them out."""
        e, row, row_ok, src, _tile_row, col, col_ok = expert_tile(tl.program_id(0), counts_ptr, rows_ptr, N, E, GATHER,
                                                                  E_POW2, BM, BN)
        if e < E:
            b_base = b_ptr + e.to(tl.int64) * N * K
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(0, K, BK):
                k = k0 + tl.arange(0, BK)
                k_ok = k < K
                a = tl.load(a_ptr + src[:, None] * K + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                if B_NK:
                    b = tl.load(b_base + col[None, :].to(tl.int64) * K + k[:, None],
                                mask=col_ok[None, :] & k_ok[:, None], other=0.0)
                else:
                    b = tl.load(b_base + k[:, None].to(tl.int64) * N + col[None, :],
                                mask=col_ok[None, :] & k_ok[:, None], other=0.0)
                acc = tl.dot(a, b, acc)
            tl.store(out_ptr + row[:, None] * N + col[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & col_ok[None, :])


def launch_grid(rows: int, num_experts: int, n: int, bm: int, bn: int) -> tuple[int]:
    """Programs for expert_tile: every row tile any counts can need (rows / bm + E) times the column tiles."""
    return ((rows // bm + num_experts) * triton.cdiv(n, bn),)


def mm(a: torch.Tensor, rows: Optional[torch.Tensor], counts: torch.Tensor, b: torch.Tensor, b_nk: bool,
       tiles: Tiles = Tiles(), out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """a [M, K] (bf16, CUDA), rows [P] (None: a itself) grouped by expert with counts [E] on the device;
    b [E, N, K] (b_nk: pair p times b[e]^T) or [E, K, N] (times b[e]) -> [P, N] in a's dtype."""
    p = a.shape[0] if rows is None else rows.shape[0]
    e = b.shape[0]
    n, k = (b.shape[1], b.shape[2]) if b_nk else (b.shape[2], b.shape[1])
    if out is None:
        out = torch.empty(p, n, dtype=a.dtype, device=a.device)
    if p:
        _mm_kernel[launch_grid(p, e, n, tiles.bm, tiles.bn)](
            a, rows if rows is not None else counts, b, out, counts.to(torch.int32), n, k, e, GATHER=rows is not None,
            B_NK=b_nk, E_POW2=triton.next_power_of_2(e), BM=tiles.bm, BN=tiles.bn, BK=tiles.bk,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out
