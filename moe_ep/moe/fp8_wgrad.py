"""FP8 weight gradients of grouped experts ("wgrad", K-grouped):

    out[e] = sum over the tokens t of group e of dy[t, :]^T x[t, :]  ->  [E, M, N] bf16

for dy [P, M] and x [P, N] rows grouped by expert (group e: rows [o_e, o_e + counts[e]), o_e the sum of the counts
before it; counts [E] on the device, never read by the host on CUDA), both operands in FP8 e4m3 with DeepSeek-V3's
1 x 128 scales along the reduction (token) dimension, float32 sums, each 128-token block's partial product scaled
by a_scale[m, blk] * b_scale[n, blk], bf16 rounded once (nearest even); out[e] = 0 for a group without tokens.

The K-grouped FP8 layout (quantize_k_grouped(t [P, C], counts [E]) -> (q_t, scales)). Counts are clipped first:
a negative count counts as 0 and group e keeps n_e = min(counts[e], P - min(o_e, P)) tokens, so the groups never
reach past row P (what the sm90 kernel's tables do too). Then:
  q_t     [C, Pc] float8_e4m3fn, t transposed: group e's token i (row o_e + i of t) at column c_e + i, with
          c_e = sum_{e' < e} roundup16(n_e') (16-element aligned group starts: TMA's 16-byte rule) and
          Pc = k_grouped_columns(P, E) = roundup16(P + 15 E), a static bound (no host sync). Every other column
          (a group's [c_e + n_e, c_e + roundup16(n_e)) and the tail [c_E, Pc)) is 0.
  scales  [C * k_grouped_scale_blocks(P, E)] float32 (P // 128 + E + 1 blocks, a static bound): one scale per
          (channel, 128-token block of a group: blocks start at the group's first token, the last may be partial),
          group-major: group e's block [C, kb_e] row-major at offset C * s_e, kb_e = ceil(n_e / 128),
          s_e = sum_{e' < e} kb_e'; every scale past C * s_E is 0.
  Each block: scale = max(amax over its tokens, 1e-4) / 448 (float32, true division) and values x / scale
  rounded to e4m3 (nearest even): moe_ep.comm.fp8's rule, along the token dimension.

On CUDA one Triton pass quantizes (_quantize_k_grouped_kernel: the group placement computed per program from
the counts, on the device); quantize_k_grouped_torch gives the same bits anywhere (host loop over the groups).
weight_grad quantizes both operands and runs the CUTLASS K-grouped GEMM (moe_ep.moe.fp8_grouped_gemm_sm90.wgrad_gemm)
on an sm90 GPU with moe_ep.moe._gemm built; elsewhere the same formula in torch (dequantize, float32 matmul per
group, bf16 once: one host sync for the counts), so CPU runs it too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..comm import fp8
from ..comm.row_sum import use_triton
from . import fp8_grouped_gemm_sm90 as sm90
from .fp8_grouped_gemm_sm90 import GROUP_COLUMN_ALIGN, k_grouped_columns, k_grouped_scale_blocks

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch versions serve
    triton = None

BLOCK = fp8.BLOCK
_TAIL = 16 * BLOCK  # columns past the last group each idle program of the Triton quantizer zeros

__all__ = ["KGroupedLayout", "k_grouped_layout", "k_grouped_columns", "k_grouped_scale_blocks", "quantize_k_grouped",
           "quantize_k_grouped_torch", "dequantize_k_grouped", "k_grouped_gemm", "weight_grad"]


def _round_up(value: int, step: int) -> int:
    return (value + step - 1) // step * step


@dataclass(frozen=True)
class KGroupedLayout:
    """Where each group of a K-grouped operand of `tokens` rows lies, on the host (the torch versions and tests;
    the kernels derive the same placement on the device)."""

    tokens: int  # P
    starts: tuple[int, ...]  # o_e: the group's first row of t (clipped to P)
    counts: tuple[int, ...]  # n_e: its tokens after clipping
    columns: tuple[int, ...]  # c_e: its first column of q_t
    blocks: tuple[int, ...]  # s_e: its first scale block

    @property
    def groups(self) -> int:
        return len(self.counts)

    def block_count(self, e: int) -> int:
        """kb_e = ceil(n_e / 128)."""
        return -(-self.counts[e] // BLOCK)


def k_grouped_layout(counts: torch.Tensor, tokens: int) -> KGroupedLayout:
    """The placement of `counts` [E] over `tokens` rows (module docstring). Reads counts on the host (a sync on
    CUDA): for the torch versions and tests only."""
    starts, clipped, columns, blocks = [], [], [], []
    row = column = block = 0
    for count in counts.tolist():
        start = min(row, tokens)
        n = min(max(int(count), 0), tokens - start)
        starts.append(start)
        clipped.append(n)
        columns.append(column)
        blocks.append(block)
        row += max(int(count), 0)
        column += _round_up(n, GROUP_COLUMN_ALIGN)
        block += -(-n // BLOCK)
    return KGroupedLayout(tokens, tuple(starts), tuple(clipped), tuple(columns), tuple(blocks))


def _check_quantize(t: torch.Tensor, counts: torch.Tensor) -> None:
    if t.dim() != 2 or not t.is_floating_point():
        raise ValueError(f"quantize_k_grouped: t must be [P, C] floating point (bf16), got {tuple(t.shape)} {t.dtype}")
    if counts.dim() != 1 or counts.numel() == 0 or counts.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"quantize_k_grouped: counts must be [E] (E > 0) int32 or int64, got {tuple(counts.shape)} "
                         f"{counts.dtype}")
    if counts.device != t.device:
        raise ValueError(f"quantize_k_grouped: counts must be on t's device {t.device}, got {counts.device}")


def quantize_k_grouped(t: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t [P, C] (bf16) with rows grouped by `counts` [E] (int32/int64, on t's device) -> (q_t [C, Pc] e4m3,
    scales [C * k_grouped_scale_blocks(P, E)] float32) in the K-grouped layout (module docstring). On CUDA one
    Triton pass with no host sync; elsewhere quantize_k_grouped_torch (the same bits)."""
    _check_quantize(t, counts)
    if use_triton(t):
        return _quantize_k_grouped_triton(t if t.stride(1) == 1 else t.contiguous(), counts.contiguous())
    return quantize_k_grouped_torch(t, counts)


def quantize_k_grouped_torch(t: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_k_grouped in torch ops, one group at a time (reads counts on the host): each group's rows,
    transposed and zero-padded to whole 128-token blocks, through moe_ep.comm.fp8's torch quantizer (true float32
    divisions, e4m3 nearest even), so its bits are the Triton kernel's."""
    _check_quantize(t, counts)
    p, c = t.shape
    layout = k_grouped_layout(counts, p)
    q_t = torch.zeros(c, k_grouped_columns(p, layout.groups), dtype=torch.float8_e4m3fn, device=t.device)
    scales = torch.zeros(c * k_grouped_scale_blocks(p, layout.groups), dtype=torch.float32, device=t.device)
    for e in range(layout.groups):
        n, kb = layout.counts[e], layout.block_count(e)
        if n == 0:
            continue
        padded = t.new_zeros(c, kb * BLOCK, dtype=torch.float32)
        padded[:, :n] = t[layout.starts[e]:layout.starts[e] + n].t().float()
        q, s = fp8._quantize_torch(padded, round_scale=False)  # q [C, kb * 128], s [C, kb]
        width = _round_up(n, GROUP_COLUMN_ALIGN)
        q_t[:, layout.columns[e]:layout.columns[e] + width] = q[:, :width]
        scales[c * layout.blocks[e]:c * (layout.blocks[e] + kb)] = s.reshape(-1)
    return q_t, scales


if triton is not None:
    from ..comm.fp8 import quantize_blocks

    @triton.jit
    def _lane(values, lanes, e):
        """values[e] of a per-group vector (lanes = its indices)."""
        return tl.sum(tl.where(lanes == e, values, 0), axis=0)

    @triton.jit
    def _quantize_k_grouped_kernel(t_ptr, counts_ptr, q_ptr, s_ptr, P, C, E, PC, T_STRIDE, EP: tl.constexpr,
                                   BC: tl.constexpr, TAIL: tl.constexpr):
        """Program (blk, channel tile) over t's rows T_STRIDE elements apart: scale block `blk` of the whole operand
        (group e's blocks are [s_e, s_e + kb_e)) for BC channels. Every program derives the placement from the E
        counts (clipped to P rows, prefix sums over EP >= E lanes): the group of its block, then reads the block's
        <= 128 rows x BC channels once, transposes them and writes e4m3 columns (zeros up to the group's 16-aligned
        end) and one scale per channel (quantize_blocks: moe_ep.comm.fp8's arithmetic). The programs past the last
        block (blk = s_E + j; the grid has P // 128 + E + 1 > s_E blocks) zero scale block blk and the columns
        [c_E + j * TAIL, c_E + (j + 1) * TAIL) below Pc: with TAIL = 16 * 128 they cover [c_E, Pc), since there
        are at least (P - sum n_e + E + 1) / 128 of them and Pc - c_E <= P - sum n_e + 15 E + 15."""
        blk = tl.program_id(0)
        ch = tl.program_id(1) * BC + tl.arange(0, BC)
        ch_ok = ch < C
        ch64 = ch.to(tl.int64)
        lanes = tl.arange(0, EP)
        raw = tl.maximum(tl.load(counts_ptr + lanes, mask=lanes < E, other=0).to(tl.int64), 0)
        start = tl.minimum(tl.cumsum(raw, axis=0) - raw, P)
        n = tl.minimum(raw, P - start)
        kb = (n + 127) // 128
        width = (n + 15) // 16 * 16
        kb_end = tl.cumsum(kb, axis=0)
        col_end = tl.cumsum(width, axis=0)
        total = tl.sum(kb, axis=0)
        if blk < total:
            e = tl.sum((kb_end <= blk).to(tl.int32), axis=0)  # the group holding block blk
            n_e = _lane(n, lanes, e)
            kb_e = _lane(kb, lanes, e)
            s_e = _lane(kb_end - kb, lanes, e)
            c_e = _lane(col_end - width, lanes, e)
            b = blk - s_e  # the block within its group
            tok = b * 128 + tl.arange(0, 128)
            x = tl.load(t_ptr + (_lane(start, lanes, e) + tok)[:, None] * T_STRIDE + ch64[None, :],
                        mask=(tok < n_e)[:, None] & ch_ok[None, :], other=0.0).to(tl.float32)
            q, s = quantize_blocks(tl.trans(x))  # [BC, 128] and [BC]: tokens past n_e give 0
            tl.store(q_ptr + ch64[:, None] * PC + (c_e + tok)[None, :],
                     q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
                     mask=ch_ok[:, None] & (tok < (n_e + 15) // 16 * 16)[None, :])
            tl.store(s_ptr + C * s_e + ch64 * kb_e + b, s, mask=ch_ok)
        else:
            zeros = tl.zeros([BC, 128], tl.float32).to(q_ptr.dtype.element_ty)
            first = tl.sum(width, axis=0) + (blk - total) * TAIL
            for j in tl.static_range(TAIL // 128):
                cols = first + j * 128 + tl.arange(0, 128)
                tl.store(q_ptr + ch64[:, None] * PC + cols[None, :], zeros, mask=ch_ok[:, None] & (cols < PC)[None, :])
            tl.store(s_ptr + blk.to(tl.int64) * C + ch64, tl.zeros([BC], tl.float32), mask=ch_ok)


def _quantize_k_grouped_triton(t: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_k_grouped in _quantize_k_grouped_kernel; t's channels contiguous (its rows may be a column slice of a
    wider tensor's), counts contiguous, on one CUDA device."""
    p, c = t.shape
    e = counts.numel()
    columns, blocks = k_grouped_columns(p, e), k_grouped_scale_blocks(p, e)
    q_t = torch.empty(c, columns, dtype=torch.float8_e4m3fn, device=t.device)
    scales = torch.empty(c * blocks, dtype=torch.float32, device=t.device)
    if c:
        channels = 64
        _quantize_k_grouped_kernel[(blocks, triton.cdiv(c, channels))](
            t, counts, q_t, scales, p, c, e, columns, t.stride(0), EP=max(16, triton.next_power_of_2(e)), BC=channels,
            TAIL=_TAIL, num_warps=4)
    return q_t, scales


def dequantize_k_grouped(q_t: torch.Tensor, scales: torch.Tensor, counts: torch.Tensor,
                         tokens: int) -> list[torch.Tensor]:
    """The groups of a K-grouped operand of `tokens` rows, dequantized: group e as float32 [C, n_e] (each value
    times its block's scale). Reads counts on the host."""
    layout = k_grouped_layout(counts, tokens)
    c = q_t.shape[0]
    groups = []
    for e in range(layout.groups):
        n, kb, s0, c0 = layout.counts[e], layout.block_count(e), layout.blocks[e], layout.columns[e]
        block_scales = scales[c * s0:c * (s0 + kb)].view(c, kb).repeat_interleave(BLOCK, dim=1)[:, :n]
        groups.append(q_t[:, c0:c0 + n].float() * block_scales)
    return groups


def _k_grouped_gemm_torch(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                          counts: torch.Tensor, tokens: int) -> torch.Tensor:
    """k_grouped_gemm in torch: dequantize both operands, float32 matmul per group, bf16 once (zeros for a group
    without tokens)."""
    parts = [ae @ be.t() for ae, be in zip(dequantize_k_grouped(a, a_scale, counts, tokens),
                                           dequantize_k_grouped(b, b_scale, counts, tokens))]
    return torch.stack(parts).to(torch.bfloat16)


def k_grouped_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                   counts: torch.Tensor, tokens: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out [E, M, N] bf16, out[e] = group e's a_e b_e^T, for K-grouped operands of `tokens` rows (a, a_scale =
    quantize_k_grouped of [tokens, M]; b, b_scale of [tokens, N]; the same counts). The CUTLASS kernel where it
    runs (sm90 GPU, moe_ep.moe._gemm built, N % 8 == 0; no host sync), else the torch version (into `out` when
    given, either way)."""
    if a.is_cuda and sm90.available(a.device) and b.shape[0] % 8 == 0:
        return sm90.wgrad_gemm(a, a_scale, b, b_scale, counts, tokens, out=out)
    result = _k_grouped_gemm_torch(a, a_scale, b, b_scale, counts, tokens)
    if out is None:
        return result
    return out.copy_(result)


def weight_grad(dy: torch.Tensor, x: torch.Tensor, counts: torch.Tensor,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """dy [P, M] and x [P, N] (bf16) with rows grouped by `counts` [E] (int32/int64, on their device) ->
    [E, M, N] bf16: out[e] = sum over group e's rows t of dy[t]^T x[t], both quantized by quantize_k_grouped
    (1 x 128 scales along the tokens), float32 sums, zeros for an empty group. See k_grouped_gemm for which
    GEMM runs."""
    if dy.dim() != 2 or x.dim() != 2 or dy.shape[0] != x.shape[0]:
        raise ValueError(f"weight_grad: dy and x must be [P, M] and [P, N] with one P, got {tuple(dy.shape)} and "
                         f"{tuple(x.shape)}")
    if x.device != dy.device:
        raise ValueError(f"weight_grad: x must be on dy's device {dy.device}, got {x.device}")
    q_dy, s_dy = quantize_k_grouped(dy, counts)
    q_x, s_x = quantize_k_grouped(x, counts)
    return k_grouped_gemm(q_dy, s_dy, q_x, s_x, counts, dy.shape[0], out=out)
