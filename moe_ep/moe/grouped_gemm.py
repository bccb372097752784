"""How a Triton grouped GEMM over rows grouped by expert finds its work with no host sync: the row
tiles of every expert from per-expert counts on the device, the rows optionally gathered (moe_ep.moe.fp8_experts'
kernel uses it). A bf16 kernel on the same map lost to torch._grouped_mm on every row GEMM of the layer,
equal groups or not (bench/results/h200_2026-12-02_gemm_tiles_run2.txt), so bf16 stays with torch.
"""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: callers keep their torch paths
    triton = None


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


def launch_grid(rows: int, num_experts: int, n: int, bm: int, bn: int) -> tuple[int]:
    """Programs for expert_tile: every row tile any counts can need (rows / bm + E) times the column tiles."""
    return ((rows // bm + num_experts) * triton.cdiv(n, bn),)
