"""FP8 experts: the pairs and per-128 scales an FP8 expert-major dispatch delivers feed FP8 grouped GEMMs directly.

Scales are DeepSeek-V3's blocks: activations carry one float32 scale per row per 128 channels
(moe_ep.comm.fp8, what FP8 dispatch sends), weights one per 128 x 128 block. The forward, per (row, local
expert) pair grouped by expert (moe_ep.comm.expert_major's layout, made by the dispatch itself):
  1. gate/up GEMM: the pairs' FP8 rows (no dequantization pass, no gather), times the FP8 w13 -> h13 [P, 2F]
     bf16. Each 128-deep K step's product is scaled by (row scale x block scale) and added to a float32
     accumulator.
  2. SwiGLU x router weight, quantized again to FP8 with per-128 scales, in one pass.
  3. down GEMM, the same kernel -> [P, H] bf16 (the expert-major combine sums each row's pairs).
The backward (pairs_backward) runs the two data-gradient GEMMs (dgrad) in FP8 on the same kernel: the
gradients quantized per row per 128 channels like the forward's rows, against the transposed FP8 weights
(FP8WeightCache.get_transposed: the same 128 x 128 blocks, transposed); the SwiGLU backward in one pass; and
the weight gradients (wgrad) as bf16 grouped GEMMs (moe_ep.moe.experts.groups_of) over the values the forward's
GEMMs read, or with fp8_wgrad (MoE(fp8_wgrad=True)) as FP8 K-grouped GEMMs over those values quantized along each
expert's tokens (moe_ep.moe.fp8_wgrad); at this layer's shapes both are bound by writing dW (docs/benchmarks.md).
The weights are quantized once and kept until a weight changes (FP8WeightCache). The GEMMs run CUTLASS's sm90
kernel where it is built and the GPU is an H100/H200 (moe_ep.moe.fp8_grouped_gemm_sm90), else the Triton kernels
below, all with the same bits; without CUDA a torch version of the same formulas (dequantize, float32 matmul)
serves, so CPU tests and CPU installs run the layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..comm import fp8
from ..comm.row_sum import use_triton
from .expert_kernels import swiglu_backward, swiglu_wide
from . import fp8_grouped_gemm_sm90 as sm90
from . import fp8_wgrad as fp8_wgrad_module
from .experts import GroupedExperts, groups_of
from .grouped_gemm import launch_grid

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # CPU-only installs: the torch versions serve
    triton = None

BLOCK = fp8.BLOCK


# ---- weights ---------------------------------------------------------------------------------------
def quantize_weight_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, N, K] (N, K multiples of 128) -> (e4m3 [E, N, K], float32 scales [E, N / 128, K / 128]):
    one scale per 128 x 128 block, amax / 448 with amax floored as moe_ep.comm.fp8 floors it."""
    e, n, k = w.shape
    blocks = w.detach().float().view(e, n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=(2, 4)).clamp_min(fp8.AMAX_FLOOR)
    scale = amax / torch.full_like(amax, fp8.FP8_MAX)
    q = (blocks / scale[:, :, None, :, None]).to(torch.float8_e4m3fn).view(e, n, k)
    return q, scale.contiguous()


def dequantize_weight_blocks(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of quantize_weight_blocks up to rounding -> float32 [E, N, K]."""
    e, n, k = q.shape
    blocks = q.float().view(e, n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    return (blocks * scale[:, :, None, :, None]).view(e, n, k)


@dataclass
class FP8ExpertWeights:
    """The experts' weights in FP8 with their block scales: w13 [E_l, 2F, H] and w2 [E_l, H, F] (the forward's
    GEMMs), or transposed, w13 [E_l, H, 2F] and w2 [E_l, F, H] (the backward's data-gradient GEMMs)."""

    w13: torch.Tensor
    w13_scale: torch.Tensor  # [E_l, w13.shape[1] / 128, w13.shape[2] / 128] float32
    w2: torch.Tensor
    w2_scale: torch.Tensor  # [E_l, w2.shape[1] / 128, w2.shape[2] / 128] float32

    def transposed(self) -> "FP8ExpertWeights":
        """Each expert's weight and scale grid transposed: the block quantization of the transposed weight,
        since a 128 x 128 block's amax does not depend on its orientation."""
        def t(x: torch.Tensor) -> torch.Tensor:
            return x.transpose(1, 2).contiguous()
        return FP8ExpertWeights(t(self.w13), t(self.w13_scale), t(self.w2), t(self.w2_scale))


class FP8WeightCache:
    """The FP8 copy of one GroupedExperts' weights (and, once a backward asked, its transpose), quantized again
    only when a weight changed (its storage or its version counter: optimizer steps and load_state_dict bump it)."""

    def __init__(self) -> None:
        self._key: Optional[tuple] = None
        self._weights: Optional[FP8ExpertWeights] = None
        self._transposed: Optional[FP8ExpertWeights] = None

    def get(self, experts: GroupedExperts) -> FP8ExpertWeights:
        params = (experts.w1, experts.w3, experts.w2)
        key = tuple((p.data_ptr(), p._version, p.device, p.dtype) for p in params)
        if key != self._key or self._weights is None:
            w13, w13_scale = quantize_weight_blocks(experts.fused_w13)
            w2, w2_scale = quantize_weight_blocks(experts.w2)
            self._weights, self._transposed, self._key = FP8ExpertWeights(w13, w13_scale, w2, w2_scale), None, key
        return self._weights

    def get_transposed(self, experts: GroupedExperts) -> FP8ExpertWeights:
        """get(experts).transposed(), kept beside it."""
        weights = self.get(experts)
        if self._transposed is None:
            self._transposed = weights.transposed()
        return self._transposed


# ---- torch versions ------------------------------------------------------------------------------
def _grouped_gemm_torch(a: torch.Tensor, a_scale: torch.Tensor, rows: Optional[torch.Tensor], counts: torch.Tensor,
                        b: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    if rows is not None:
        a, a_scale = a.index_select(0, rows), a_scale.index_select(0, rows)
    x = fp8.dequantize(a, a_scale)
    w = dequantize_weight_blocks(b, b_scale)
    parts = [rows_e @ w[e].t() for e, rows_e in enumerate(x.split(counts.tolist()))]
    return torch.cat(parts).to(out_dtype) if parts else x.new_empty(0, b.shape[1], dtype=out_dtype)


def _swiglu_quant_torch(h13: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return fp8.quantize(swiglu_wide(h13, scale))


# ---- Triton kernels ------------------------------------------------------------------------------
if triton is not None:
    from .expert_kernels import activation
    from ..comm.fp8 import quantize_blocks
    from .grouped_gemm import expert_tile

    @triton.jit
    def _k_step(kb, a_rows, a_desc, b_cols, b_desc, as_rows, bs_cols, row_ok, col_ok, tile_row, b_row,
                A_TMA: tl.constexpr, B_TMA: tl.constexpr):
        """K step kb: (the tiles' product a . b, float32 [BM, BN], and its scale as x bs [BM, BN])."""
        k = kb * 128 + tl.arange(0, 128)
        if A_TMA:
            a = a_desc.load([tile_row, kb * 128])
        else:
            a = tl.load(a_rows + k[None, :], mask=row_ok[:, None], other=0.0)
        if B_TMA:
            b = tl.trans(b_desc.load([b_row, kb * 128]))
        else:
            b = tl.load(b_cols + k[:, None], mask=col_ok[None, :], other=0.0)
        sa = tl.load(as_rows + kb, mask=row_ok, other=0.0)
        sb = tl.load(bs_cols + kb, mask=col_ok, other=0.0)
        return tl.dot(a, b), sa[:, None] * sb[None, :]

    @triton.jit
    def _grouped_gemm_kernel(a_ptr, as_ptr, rows_ptr, b_ptr, bs_ptr, out_ptr, counts_ptr, a_desc, b_desc, N, K, E,
                             GATHER: tl.constexpr, E_POW2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                             A_TMA: tl.constexpr, B_TMA: tl.constexpr):
        """out[p, n] = sum_kb (a[src_p, kb] . b[e_p, n, kb]) * as[src_p, kb] * bs[e_p, n / 128, kb].

        Protocol: one program per (row tile, column tile) as moe_ep.moe.grouped_gemm.expert_tile lays them
        out (no host sync). K steps are 128 deep, one scale block each; rows past the expert's count
        are masked in loads and stores. With B_TMA (A_TMA) the weight (row) tiles come through a TMA
        descriptor over b viewed as [E * N, K] (a as [M, K]): a tile may then read the next expert's
        rows or columns, or zeros past the end, which the masked store drops; A_TMA only without GATHER.
        """
        e, row, row_ok, src, tile_row, col, col_ok = expert_tile(tl.program_id(0), counts_ptr, rows_ptr, N, E, GATHER,
                                                                 E_POW2, BM, BN)
        if e < E:
            kb_count = K // 128
            e64 = e.to(tl.int64)
            b_row = e * N + (tl.program_id(0) % tl.cdiv(N, BN)) * BN
            a_rows = a_ptr + src[:, None] * K
            b_cols = b_ptr + e64 * N * K + col[None, :].to(tl.int64) * K
            as_rows = as_ptr + src * kb_count
            bs_cols = bs_ptr + (e64 * tl.cdiv(N, 128) + col // 128) * kb_count
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for kb in range(0, kb_count):
                p0, s0 = _k_step(kb, a_rows, a_desc, b_cols, b_desc, as_rows, bs_cols, row_ok, col_ok, tile_row, b_row,
                                 A_TMA, B_TMA)
                acc += p0 * s0
            tl.store(out_ptr + row[:, None] * N + col[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _swiglu_quant_kernel(h_ptr, scale_ptr, q_ptr, qs_ptr, P, F, BR: tl.constexpr):
        """BR rows x one 128-column block: a = silu(g) * u * w in float32, then e4m3 with one scale per
        row per block (amax floored at 1e-4, / 448, a true division as moe_ep.comm.fp8 does it)."""
        row = tl.program_id(0) * BR + tl.arange(0, BR)
        blk = tl.program_id(1)
        col = blk * 128 + tl.arange(0, 128)
        ok = row < P
        r64 = row.to(tl.int64)
        g = tl.load(h_ptr + r64[:, None] * 2 * F + col[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        u = tl.load(h_ptr + r64[:, None] * 2 * F + F + col[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        w = tl.load(scale_ptr + row, mask=ok, other=0.0)
        _sig, _silu, a = activation(g, u, w[:, None])  # the bf16 experts' activation formula
        q, s = quantize_blocks(a)
        tl.store(q_ptr + r64[:, None] * F + col[None, :], q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
                 mask=ok[:, None])
        tl.store(qs_ptr + r64 * (F // 128) + blk, s, mask=ok)


@dataclass(frozen=True)
class GemmTiles:
    """The grouped GEMM's launch shape, picked by bench/gemm_tiles.py on an H200 at issue 21's shape
    (bench/results/h200_2026-12-02_gemm_tiles_run2.txt): 64 x 256 with TMA weight tiles was the
    fastest pair of forward GEMMs on unequal groups (a fresh router's), 10 % behind the best on equal ones."""

    bm: int = 64
    bn: int = 256
    num_warps: int = 8
    num_stages: int = 3
    tma: bool = True  # weight tiles (and, without a gather, row tiles) through TMA descriptors


TILES = GemmTiles()


def _grouped_gemm_triton(a: torch.Tensor, a_scale: torch.Tensor, rows: Optional[torch.Tensor], counts: torch.Tensor,
                         b: torch.Tensor, b_scale: torch.Tensor, out: torch.Tensor, tiles: GemmTiles) -> torch.Tensor:
    p = out.shape[0]
    e, n, k = b.shape
    if p == 0:
        return out
    grid = launch_grid(p, e, n, tiles.bm, tiles.bn)
    a_tma = tiles.tma and rows is None
    a_desc = TensorDescriptor.from_tensor(a, [tiles.bm, BLOCK]) if a_tma else None
    b_desc = TensorDescriptor.from_tensor(b.view(e * n, k), [tiles.bn, BLOCK]) if tiles.tma else None
    _grouped_gemm_kernel[grid](a, a_scale, rows if rows is not None else counts, b, b_scale, out,
                               counts.to(torch.int32), a_desc, b_desc, n, k, e, GATHER=rows is not None,
                               E_POW2=triton.next_power_of_2(e), BM=tiles.bm, BN=tiles.bn, A_TMA=a_tma,
                               B_TMA=tiles.tma, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out


def _swiglu_quant_triton(h13: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    p, f = h13.shape[0], h13.shape[1] // 2
    q = torch.empty(p, f, dtype=torch.float8_e4m3fn, device=h13.device)
    qs = torch.empty(p, f // BLOCK, dtype=torch.float32, device=h13.device)
    if p:
        rows = 16
        _swiglu_quant_kernel[(triton.cdiv(p, rows), f // BLOCK)](h13, scale, q, qs, p, f, BR=rows, num_warps=4)
    return q, qs


# ---- entry points ----------------------------------------------------------------------------------
GEMM_KERNELS = ("cutlass_sm90", "triton", "torch")


def gemm_kernel(device: torch.device, out_dtype: torch.dtype = torch.bfloat16,
                tiles: Optional[GemmTiles] = None) -> str:
    """Which of GEMM_KERNELS grouped_gemm runs on `device`: "cutlass_sm90" (moe_ep.moe.fp8_grouped_gemm_sm90: bf16
    out, an sm90 GPU, the module built, no tiles asked for), else "triton" on CUDA, else "torch"."""
    cuda = device.type == "cuda"
    if tiles is None and out_dtype == torch.bfloat16 and cuda and sm90.available(device):
        return "cutlass_sm90"
    return "triton" if cuda and triton is not None else "torch"


def grouped_gemm(a: torch.Tensor, a_scale: torch.Tensor, rows: Optional[torch.Tensor], counts: torch.Tensor,
                 b: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                 tiles: Optional[GemmTiles] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """FP8 grouped GEMM with block scales: a [M, K] e4m3 with a_scale [M, K / 128]; the P pairs'
    rows of a are rows [P] (None: a itself, P = M), grouped by expert, counts [E] per expert on the
    device; b [E, N, K] e4m3 with b_scale [E, N / 128, K / 128] -> [P, N] in out_dtype, pair p times
    b[its expert]^T, accumulated in float32 (into `out` when given: [P, N] in out_dtype). Every kernel
    (gemm_kernel) gives the same bits; CUTLASS's reads whole rows, so gathered rows are copied first
    (P x K bytes), Triton's gathers inside its loads with `tiles` (default TILES)."""
    kernel = gemm_kernel(a.device, out_dtype, tiles)
    if kernel == "cutlass_sm90":
        if rows is not None:
            a, a_scale = a.index_select(0, rows), a_scale.index_select(0, rows)
        return sm90.grouped_gemm(a, a_scale, counts, b, b_scale, out=out)
    if kernel == "triton":
        if out is None:
            p = a.shape[0] if rows is None else rows.shape[0]
            out = torch.empty(p, b.shape[1], dtype=out_dtype, device=a.device)
        return _grouped_gemm_triton(a, a_scale, rows, counts, b, b_scale, out, tiles or TILES)
    result = _grouped_gemm_torch(a, a_scale, rows, counts, b, b_scale, out_dtype)
    return result if out is None else out.copy_(result)


def swiglu_quant(h13: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """h13 [P, 2F] (gate | up), scale [P] float32 -> silu(gate) * up * scale as e4m3 [P, F] with
    float32 scales [P, F / 128] (moe_ep.comm.fp8's rule), computed in float32, in one pass."""
    if use_triton(h13):
        return _swiglu_quant_triton(h13.contiguous(), scale.contiguous())
    return _swiglu_quant_torch(h13, scale)


def check_shapes(hidden: int, ffn_hidden: int) -> None:
    """FP8 experts need whole 128 x 128 weight blocks."""
    if hidden % BLOCK or ffn_hidden % BLOCK:
        raise ValueError(f"FP8 experts need hidden and ffn_hidden to be multiples of {BLOCK}, "
                         f"got {hidden} and {ffn_hidden}")


@dataclass
class PairsSaved:
    """What pairs_forward keeps for pairs_backward besides its inputs."""

    h13: torch.Tensor  # [P, 2F] bf16, the gate/up output
    a: torch.Tensor  # [P, F] e4m3, the activation the down GEMM read
    a_scale: torch.Tensor  # [P, F / 128] float32


def pairs_forward(weights: FP8ExpertWeights, x: torch.Tensor, x_scale: torch.Tensor, pair_weights: torch.Tensor,
                  counts: torch.Tensor) -> tuple[torch.Tensor, PairsSaved]:
    """The FP8 experts over pairs grouped by local expert (an FP8 expert-major dispatch's): x [P, H] e4m3 with
    x_scale [P, H / 128], pair_weights [P] float32, counts [E_l] pairs per expert on the device ->
    (y [P, H] bf16, pair p = w_p * expert(x_p); what pairs_backward needs)."""
    h13 = grouped_gemm(x, x_scale, None, counts, weights.w13, weights.w13_scale)
    a, a_scale = swiglu_quant(h13, pair_weights)
    return grouped_gemm(a, a_scale, None, counts, weights.w2, weights.w2_scale), PairsSaved(h13, a, a_scale)


@dataclass
class PairGrads:
    """pairs_backward's results: the pairs' row gradient, their router weights' gradient and the weight
    gradients (None where not asked for; the row gradient always, since a combine moves rows anyway)."""

    x: torch.Tensor  # [P, H] bf16
    pair_weights: torch.Tensor  # [P] float32
    w1: Optional[torch.Tensor]  # [E_l, F, H] in the gradient's dtype (bf16)
    w3: Optional[torch.Tensor]  # [E_l, F, H]
    w2: Optional[torch.Tensor]  # [E_l, H, F]


def pairs_backward(transposed: FP8ExpertWeights, x: torch.Tensor, x_scale: torch.Tensor, saved: PairsSaved,
                   pair_weights: torch.Tensor, counts: torch.Tensor, dy: torch.Tensor, need_w1: bool,
                   need_w3: bool, need_w2: bool, fp8_wgrad: bool = False) -> PairGrads:
    """The backward of pairs_forward for dy [P, H] bf16, the gradient of y: the two data-gradient GEMMs in FP8
    (dy and the gate/up gradient quantized per row per 128 channels as moe_ep.comm.fp8.quantize does, against
    `transposed`, FP8WeightCache.get_transposed), the SwiGLU backward in one pass, the weight gradients over the
    values the forward's GEMMs read (x and the activation dequantized from FP8): bf16 grouped GEMMs, or with
    fp8_wgrad FP8 ones with 1 x 128 scales along each expert's tokens (moe_ep.moe.fp8_wgrad)."""
    dyq, dys = fp8.quantize(dy)
    da = grouped_gemm(dyq, dys, None, counts, transposed.w2, transposed.w2_scale)
    del dyq, dys
    dh13, dpair, _ = swiglu_backward(saved.h13, da, pair_weights)
    del da
    dhq, dhs = fp8.quantize(dh13)
    dx = grouped_gemm(dhq, dhs, None, counts, transposed.w13, transposed.w13_scale)
    del dhq, dhs
    wgrad = _FP8Wgrad(counts, dh13.shape[0]) if fp8_wgrad else _Bf16Wgrad(groups_of(dh13, counts))
    f = dh13.shape[1] // 2
    dw2 = wgrad.mm_t(wgrad.operand(dy), wgrad.operand(fp8.dequantize(saved.a, saved.a_scale, dy.dtype))) \
        if need_w2 else None
    dw1 = dw3 = None
    if need_w1 or need_w3:  # one tensor each: autograd then keeps them as they are (a view of a shared one is copied)
        xs = wgrad.operand(fp8.dequantize(x, x_scale, dh13.dtype))
        dw1 = wgrad.mm_t(wgrad.operand(dh13[:, :f]), xs) if need_w1 else None
        dw3 = wgrad.mm_t(wgrad.operand(dh13[:, f:]), xs) if need_w3 else None
    return PairGrads(dx, dpair, dw1, dw3, dw2)


@dataclass
class _Bf16Wgrad:
    """Weight gradients as bf16 grouped GEMMs (experts.groups_of): an operand is its bf16 rows."""

    groups: Any

    def operand(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def mm_t(self, g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.groups.mm_t(g, v)


@dataclass
class _FP8Wgrad:
    """Weight gradients in FP8: an operand is its K-grouped quantization (quantize_k_grouped: each
    expert's tokens in 128-token blocks), quantized once however many GEMMs read it."""

    counts: torch.Tensor
    tokens: int

    def operand(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return fp8_wgrad_module.quantize_k_grouped(t, self.counts)

    def mm_t(self, g: tuple[torch.Tensor, torch.Tensor], v: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return fp8_wgrad_module.k_grouped_gemm(*g, *v, self.counts, self.tokens)
