"""Low-latency mode's experts over the expert-major receive buffers, computing only each expert's
valid rows (its count, read on the device: no host sync, so CUDA graphs and torch.compile keep working).

Decode's rows are few (a 128-token micro-batch gives each of 128 experts about 16 rows of its
R * T slots), so the step is bound by reading the experts' weights once: the batched matmul over
every slot computed ~8x the rows and ran at 1.43x the weight-read time (issue 44). Here one Triton
kernel runs twice per call, each program owning (a row tile, a column tile, an expert) and
streaming that expert's weight columns once for its rows:
  1. gate/up: h[e, r] = silu(x[e, r] . w1[e]^T) * (x[e, r] . w3[e]^T), both accumulated in
     float32 from one read of x, the activation in float32, rounded once to the weights' dtype;
  2. down: y[e, r] = h[e, r] . w2[e]^T, float32 accumulation, rounded once.
Row tiles past an expert's count return at once; rows past it are left unwritten (the combine reads
only counted rows). Row tiles of one (column tile, expert) are neighbours in the grid, so a second row
tile reads the weights from L2. One K order per output, no atomics: the bits repeat from run to run.
Registered as the custom op `moe_ep::decode_experts` (torch.compile traces it by its fake).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm.row_sum import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: GroupedExperts keeps its batched matmul there
    triton = None


@dataclass(frozen=True)
class DecodeTiles:
    """The kernel's launch shape: rows, columns and K depth of a program's tile; warps, pipeline stages."""

    bm: int = 32
    bn: int = 64
    bk: int = 128
    num_warps: int = 4
    num_stages: int = 3


TILES = DecodeTiles()


if triton is not None:
    from .expert_kernels import activation

    @triton.jit
    def _masked_gemm_kernel(x_ptr, w_ptr, w3_ptr, counts_ptr, out_ptr, C, K, N, w_stride_e, w_stride_n,
                            SWIGLU: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """out[e, r, n] for r < counts[e]: x [E, C, K] contiguous, w [E, N, K] with strides (w_stride_e,
        w_stride_n, 1) -> out [E, C, N] contiguous; with SWIGLU, w3 (same strides) too and
        out = silu(x . w^T) * (x . w3^T). Program (row tile, column tile, expert)."""
        m_tile, n_tile, e = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
        count = tl.load(counts_ptr + e)
        if m_tile * BM < count:
            rows = m_tile * BM + tl.arange(0, BM)
            row_ok = rows < count
            cols = n_tile * BN + tl.arange(0, BN)
            col_ok = cols < N
            x_rows = x_ptr + (e * C + rows)[:, None] * K
            w_cols = e * w_stride_e + cols[None, :].to(tl.int64) * w_stride_n
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            acc3 = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(0, K, BK):
                k = k0 + tl.arange(0, BK)
                k_ok = k < K
                a = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b_ok = k_ok[:, None] & col_ok[None, :]
                acc = tl.dot(a, tl.load(w_ptr + w_cols + k[:, None], mask=b_ok, other=0.0), acc)
                if SWIGLU:
                    acc3 = tl.dot(a, tl.load(w3_ptr + w_cols + k[:, None], mask=b_ok, other=0.0), acc3)
            if SWIGLU:
                _sig, _silu, acc = activation(acc, acc3, 1.0)
            out = out_ptr + (e * C + rows)[:, None] * N + cols[None, :]
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _masked_gemm(x: torch.Tensor, w: torch.Tensor, w3: torch.Tensor | None, counts: torch.Tensor,
                 tiles: DecodeTiles) -> torch.Tensor:
    e, c, k = x.shape
    n = w.shape[1]
    out = torch.empty(e, c, n, dtype=w.dtype, device=x.device)
    if e and c and n:
        grid = (triton.cdiv(c, tiles.bm), triton.cdiv(n, tiles.bn), e)
        _masked_gemm_kernel[grid](x, w, w if w3 is None else w3, counts, out, c, k, n, w.stride(0), w.stride(1),
                                  SWIGLU=w3 is not None, BM=tiles.bm, BN=tiles.bn, BK=tiles.bk,
                                  num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out


def run(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor,
        tiles: DecodeTiles = TILES) -> torch.Tensor:
    """x [E, C, H] contiguous rows in the weights' dtype, w1/w3 [E, F, H] and w2 [E, H, F] (each with a
    unit last stride; w1 and w3 with the same strides), counts [E] int32 on the device -> [E, C, H]
    in the weights' dtype, rows past counts[e] unwritten."""
    h = _masked_gemm(x, w1, w3, counts, tiles)
    return _masked_gemm(h, w2, None, counts, tiles)


def supported(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> bool:
    """The kernel runs on CUDA with Triton, bf16 weights, unit last strides, w1 and w3 strided alike."""
    return (use_triton(x) and w1.dtype == torch.bfloat16 and all(w.stride(-1) == 1 for w in (w1, w3, w2))
            and w1.stride() == w3.stride())


@torch.library.custom_op("moe_ep::decode_experts", mutates_args=())
def decode_experts(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                   counts: torch.Tensor) -> torch.Tensor:
    """`run` as a custom op (callers check `supported` first)."""
    return run(x.contiguous(), w1, w3, w2, counts.to(torch.int32))


@decode_experts.register_fake
def _(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], x.shape[1], w2.shape[1], dtype=w2.dtype)
