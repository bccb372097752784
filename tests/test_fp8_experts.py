"""FP8 experts (moe_ep.moe.fp8_experts): the block-scaled grouped GEMM and the SwiGLU quantization against
float64 oracles written here, MoE(fp8_experts=True) against a dense FP8-emulating MoE over all
ranks' tokens, and its backward (moe_ep.moe.fp8_normal) against float64 autograd through that dense MoE. On CPU the Triton kernels run in Triton's interpreter (a subprocess with
TRITON_INTERPRET=1; skipped without Triton), and the layer runs the torch versions; on a GPU, the
kernels themselves and the layer on the native backend against the reference one, bit for bit."""
from __future__ import annotations

from typing import Optional

import pytest
import torch

import moe_ep
from moe_ep.moe import fp8_experts as fe, fp8_normal
from moe_ep.moe.layer import MoE
from tests._interpret import run_interpreted
from tests._dist import device, requires_gpus, run_workers
from tests.oracle import fp8_dequantize, fp8_quantize, fp8_quantize_weight_blocks

E4M3_STEP = 2.0 ** -3  # one e4m3 step relative to a normal value (3 mantissa bits), an upper bound
E4M3_TINY = 2.0 ** -9  # the e4m3 subnormal step, in units of the block scale


# ---- oracles ---------------------------------------------------------------------------------------
def _row_scales_f64(a: torch.Tensor) -> torch.Tensor:
    """Per row per 128 columns: max(amax, 1e-4) / 448, in float64."""
    n, k = a.shape
    return a.double().abs().view(n, k // 128, 128).amax(-1).clamp_min(1e-4) / 448.0


def _expand(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Block scales [r, c] -> [rows, cols], each block's scale over its 128 x 128 (or 1 x 128) elements."""
    r, c = scale.shape
    if r == 0:
        return scale.double().new_zeros(rows, cols)
    return scale.double().repeat_interleave(rows // r, 0).repeat_interleave(cols // c, 1)


def _gemm_oracle(aq, a_scale, rows, counts, bq, b_scale) -> torch.Tensor:
    """float64: pair p's dequantized row times its expert's dequantized weight, transposed."""
    a = aq.double() * _expand(a_scale, *aq.shape)
    if rows is not None:
        a = a[rows]
    out, start = [], 0
    for e, c in enumerate(counts.tolist()):
        w = bq[e].double() * _expand(b_scale[e], *bq.shape[1:])
        out.append(a[start:start + c] @ w.t())
        start += c
    return torch.cat(out)


def _within_bf16(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """got (bf16, float32 sums inside) against a float64 want: a few bf16 roundings of the largest value."""
    assert not torch.isnan(got.float()).any(), f"{what}: rows left unwritten (NaN poison)"
    err = (got.double() - want).abs().max().item()
    assert err <= 2 ** -7 * want.abs().max().item() + 1e-6, f"{what}: max error {err:.3e}"


def _within_one_step(q: torch.Tensor, qs: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Dequantized q (e4m3, per-128 scales qs) within one e4m3 step of float64 want, element by element."""
    deq = q.double() * _expand(qs, *q.shape)
    bound = torch.maximum(want.abs() * E4M3_STEP, _expand(qs, *q.shape) * E4M3_TINY) * (1 + 1e-6)
    assert bool(((deq - want).abs() <= bound).all()), f"{what}: a value off by more than one e4m3 step"


def _swiglu_f64(h13: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    f = h13.shape[1] // 2
    g, u = h13[:, :f].double(), h13[:, f:].double()
    return g * torch.sigmoid(g) * u * w.double().unsqueeze(1)


# ---- the pieces -----------------------------------------------------------------------------------
def _gemm_case(dev: torch.device, seed: int, e: int, n: int, k: int, counts: list[int], m: int, gather: bool,
               tiles: Optional[fe.GemmTiles]) -> None:
    """grouped_gemm on random FP8 inputs, output poisoned first, against _gemm_oracle (tiles None: the kernel
    fe.gemm_kernel picks, CUTLASS's sm90 one where it is built)."""
    g = torch.Generator().manual_seed(seed)
    aq, a_scale = fp8_quantize(torch.randn(m, k, generator=g) * 3)
    bq, b_scale = fp8_quantize_weight_blocks(torch.randn(e, n, k, generator=g) * 0.05)
    c = torch.tensor(counts)
    rows = torch.randint(0, m, (sum(counts),), generator=g) if gather else None
    p = sum(counts) if gather else m
    want = _gemm_oracle(aq, a_scale, rows, c, bq, b_scale)
    to = lambda t: None if t is None else t.to(dev)  # noqa: E731
    out = torch.full((p, n), float("nan"), dtype=torch.bfloat16, device=dev)
    if dev.type == "cpu":  # the Triton kernel itself, interpreted
        fe._grouped_gemm_triton(aq, a_scale, rows, c, bq, b_scale, out, tiles)
    else:
        fe.grouped_gemm(to(aq), to(a_scale), to(rows), to(c), to(bq), to(b_scale), tiles=tiles, out=out)
    _within_bf16(out.cpu(), want, f"grouped_gemm {counts} gather={gather}")


def _swiglu_case(dev: torch.device, p: int, f: int) -> None:
    g = torch.Generator().manual_seed(p + f)
    h13 = (torch.randn(p, 2 * f, generator=g) * 2).to(torch.bfloat16)
    w = torch.rand(p, generator=g)
    want = _swiglu_f64(h13, w)
    if dev.type == "cpu":
        q, qs = fe._swiglu_quant_triton(h13, w)
    else:
        q, qs = fe.swiglu_quant(h13.to(dev), w.to(dev))
        q, qs = q.cpu(), qs.cpu()
    scale_want = _row_scales_f64(want)
    assert torch.allclose(qs.double(), scale_want, rtol=1e-5, atol=0), "swiglu_quant: scales"
    if dev.type == "cuda":
        _within_one_step(q, qs, want, "swiglu_quant")
    else:  # Triton 3.9's interpreter converts float32 to e4m3 loosely (to the binade or the next
        # step): here only the layout and the sign are checked, the rounding on the GPU
        deq = q.double() * _expand(qs, *q.shape)
        tiny = _expand(qs, *q.shape) * E4M3_TINY
        ok = (deq * want >= 0) & (deq.abs() <= want.abs() * 2 + tiny) & (deq.abs() * 2 + tiny >= want.abs())
        assert bool(ok.all()), \
            "swiglu_quant (interpreted): a value off by more than a factor of two"


def _kernel_cases(dev: torch.device) -> None:
    small = fe.GemmTiles(bm=16, bn=64, num_warps=4, num_stages=1, tma=False)
    _gemm_case(dev, 1, 3, 256, 256, [5, 0, 37], 50, True, small)  # an empty expert, partial tiles
    _gemm_case(dev, 2, 2, 128, 384, [16, 33], 49, False, small)  # no gather, tile-sized and not
    _gemm_case(dev, 3, 4, 256, 128, [0, 0, 9, 0], 12, True, fe.GemmTiles(bm=32, bn=128, num_warps=4, num_stages=1, tma=False))
    tma = fe.GemmTiles(bm=16, bn=64, num_warps=4, num_stages=1, tma=True)  # tiles may cross experts: masked
    _gemm_case(dev, 6, 3, 256, 256, [5, 0, 37], 50, True, tma)
    _gemm_case(dev, 7, 3, 384, 256, [21, 0, 30], 51, False, fe.GemmTiles(bm=16, bn=256, num_warps=4, num_stages=1, tma=True))
    _swiglu_case(dev, 40, 256)
    _swiglu_case(dev, 1, 128)
    if dev.type == "cuda":  # the shipped tiles on shapes where they matter
        _gemm_case(dev, 4, 8, 1024, 2048, [300, 0, 129, 128, 1, 700, 64, 250], 900, True, fe.TILES)
        _gemm_case(dev, 5, 8, 512, 1024, [300, 0, 129, 128, 1, 700, 64, 250], 1572, False, fe.TILES)
        _gemm_case(dev, 10, 8, 1024, 2048, [300, 0, 129, 128, 1, 700, 64, 250], 900, True, None)
        _gemm_case(dev, 11, 8, 512, 1024, [300, 0, 129, 128, 1, 700, 64, 250], 1572, False, None)
        for tiles in (fe.GemmTiles(64, 128, 4, 4, tma=False), fe.GemmTiles(128, 128, 8, 3, tma=True)):
            _gemm_case(dev, 8, 8, 1024, 2048, [300, 0, 129, 128, 1, 700, 64, 250], 900, True, tiles)
            _gemm_case(dev, 9, 8, 512, 1024, [300, 0, 129, 128, 1, 700, 64, 250], 1572, False, tiles)
        _swiglu_case(dev, 1000, 1024)


def interpreted_kernel_cases() -> None:
    """Entry of the interpreter subprocess (TRITON_INTERPRET=1 must be set before Triton loads)."""
    _kernel_cases(torch.device("cpu"))


def test_kernels_in_triton_interpreter() -> None:
    run_interpreted("tests.test_fp8_experts", "interpreted_kernel_cases")


def test_weight_blocks_match_definition() -> None:
    """quantize_weight_blocks against tests/oracle.py's quantiser (one scale per 128 x 128), bit for bit."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(3, 256, 384, generator=g) * torch.rand(3, 256, 1, generator=g)
    w[1, :128, :128] = 0  # an all-zero block takes the amax floor
    q, s = fe.quantize_weight_blocks(w)
    want_q, want_s = fp8_quantize_weight_blocks(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2, 3)
    assert torch.equal(s.view(torch.int32), want_s.view(torch.int32)), "scales"
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)), "values"


def test_torch_versions_match_oracles() -> None:
    """The CPU path of the layer: torch grouped_gemm and swiglu_quant against the same oracles."""
    g = torch.Generator().manual_seed(11)
    aq, a_scale = fp8_quantize(torch.randn(40, 256, generator=g))
    bq, b_scale = fp8_quantize_weight_blocks(torch.randn(3, 128, 256, generator=g) * 0.1)
    rows, counts = torch.randint(0, 40, (30,), generator=g), torch.tensor([10, 0, 20])
    _within_bf16(fe.grouped_gemm(aq, a_scale, rows, counts, bq, b_scale), _gemm_oracle(aq, a_scale, rows, counts, bq, b_scale),
                 "torch grouped_gemm")
    h13, w = (torch.randn(30, 256, generator=g) * 2).to(torch.bfloat16), torch.rand(30, generator=g)
    q, qs = fe.swiglu_quant(h13, w)
    _within_one_step(q, qs, _swiglu_f64(h13, w), "torch swiglu_quant")


# ---- the layer ------------------------------------------------------------------------------------
HIDDEN, FFN, EXPERTS, TOPK = 256, 128, 8, 3


def _dense_fp8(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, full: dict) -> torch.Tensor:
    """FP8 MoE emulated in float64: FP8 rows, 128 x 128 FP8 weights, bf16 gate/up output, FP8 activation."""
    xd = fp8_dequantize(*fp8_quantize(x.to(torch.bfloat16)))
    out = torch.zeros(x.shape[0], HIDDEN, dtype=torch.float64)
    for e in range(EXPERTS):
        w13 = torch.cat([full["w1"][e], full["w3"][e]])
        q13, s13 = fp8_quantize_weight_blocks(w13.unsqueeze(0))
        q2, s2 = fp8_quantize_weight_blocks(full["w2"][e].unsqueeze(0))
        for k in range(TOPK):
            rows = (idx[:, k] == e).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            h13 = (xd[rows] @ (q13[0].double() * _expand(s13[0], 2 * FFN, HIDDEN)).t()).to(torch.bfloat16)
            a = _swiglu_f64(h13, weights[rows, k])
            ad = fp8_dequantize(*fp8_quantize(a.float()))
            out[rows] += ad @ (q2[0].double() * _expand(s2[0], HIDDEN, FFN)).t()
    return out


def _full_weights(dev: torch.device) -> dict[str, torch.Tensor]:
    """Every expert's weights, rounded to bf16 (what the MoE's bf16 parameters hold)."""
    g = torch.Generator().manual_seed(5)
    w = {"w1": torch.randn(EXPERTS, FFN, HIDDEN, generator=g) * HIDDEN ** -0.5,
         "w3": torch.randn(EXPERTS, FFN, HIDDEN, generator=g) * HIDDEN ** -0.5,
         "w2": torch.randn(EXPERTS, HIDDEN, FFN, generator=g) * FFN ** -0.5}
    return {name: t.to(torch.bfloat16).float() for name, t in w.items()}


def _fp8_moe(buf: moe_ep.Buffer, full: dict) -> MoE:
    torch.manual_seed(3)
    moe = MoE(buf, FFN, dtype=torch.bfloat16, fp8_experts=True)
    state = moe.state_dict()
    for e in range(EXPERTS):
        for name, w in full.items():
            state[f"experts.{e}.{name}"] = w[e]
    moe.load_state_dict(state)
    return moe


def _layer_case(rank: int, world: int, backend: str = "reference") -> torch.Tensor:
    """MoE(fp8_experts=True) on this rank's tokens (rank 2 has none at 4 ranks) against _dense_fp8."""
    tokens = [37, 21, 0, 15][rank % 4]
    buf = moe_ep.Buffer(None, device=device(), hidden=HIDDEN, num_experts=EXPERTS, num_topk=TOPK,
                        max_tokens_per_rank=64, backend=backend)
    full = _full_weights(buf.device)
    moe = _fp8_moe(buf, full)
    g = torch.Generator().manual_seed(50 + rank)
    x = (torch.randn(tokens, HIDDEN, generator=g) * 2).to(buf.device)
    with torch.no_grad():
        out = moe(x.to(torch.bfloat16), mode="normal")
        routing = moe.last_routing
        want = _dense_fp8(x.cpu(), routing.topk_idx.cpu(), routing.topk_weights.cpu(), full)
    assert out.dtype == torch.bfloat16 and out.shape == (tokens, HIDDEN)
    err = (out.cpu().double() - want).abs().max().item() if tokens else 0.0
    assert err <= 2e-2 * (want.abs().max().item() if tokens else 0.0) + 1e-6, f"rank {rank}: FP8 MoE error {err:.3e}"
    with torch.no_grad():  # a changed weight is quantized again
        moe.experts.w2.mul_(0.5)
        half = moe(x.to(torch.bfloat16), mode="normal")
    assert torch.allclose(half.float(), out.float() * 0.5, rtol=2 ** -6, atol=1e-3 * max(float(out.abs().max()) if tokens else 0, 1))
    buf.close()
    return out


# ---- the layer's backward ---------------------------------------------------------------------------
TRAIN_TOKENS = (37, 21, 0, 15)  # rank r's tokens (rank 2 has none at 4 ranks)


def _train_inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank `rank`'s tokens [n, H] bf16, distinct top-k expert ids [n, K], positive weights [n, K] and the
    output's gradient [n, H] bf16, drawn from a generator seeded by the rank (every rank draws everyone's)."""
    n = TRAIN_TOKENS[rank % 4]
    g = torch.Generator().manual_seed(900 + rank)
    x = (torch.randn(n, HIDDEN, generator=g) * 2).to(torch.bfloat16)
    idx = torch.rand(n, EXPERTS, generator=g).argsort(1)[:, :TOPK].contiguous()
    w = torch.rand(n, TOPK, generator=g) + 0.1
    grad = torch.randn(n, HIDDEN, generator=g).to(torch.bfloat16)
    return x, idx, w, grad


def _st(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """x's value rounded, x's gradient unchanged (straight-through)."""
    return x + (rounded - x).detach()


class _RoundGrad(torch.autograd.Function):
    """Identity whose backward rounds the gradient to bf16, then with `fp8` to FP8 per row per 128 channels."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, fp8: bool) -> torch.Tensor:
        ctx.fp8 = fp8
        return t.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        g = g.to(torch.bfloat16).double()
        return (fp8_dequantize(*fp8_quantize(g.float())) if ctx.fp8 else g), None


def _tokens_fp8(t: torch.Tensor) -> torch.Tensor:
    """t [n, C] (one expert's rows, in the layer's pair order) rounded to bf16, then to FP8 with one scale per
    channel per 128 rows (blocks from the first row, the last zero-padded), dequantized: [C, n] float64."""
    n = t.shape[0]
    padded = t.new_zeros(t.shape[1], -(-n // 128) * 128)
    padded[:, :n] = t.to(torch.bfloat16).double().t()
    return fp8_dequantize(*fp8_quantize(padded.float()))[:, :n]


class _WgradFP8(torch.autograd.Function):
    """a @ w.t() whose gradient for `w` is the FP8 weight gradient: the output gradient and `a` each rounded to
    FP8 along the rows (_tokens_fp8), their float64 product; none for `a`."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a)
        return a @ w.t()

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[None, torch.Tensor]:
        (a,) = ctx.saved_tensors
        return None, _tokens_fp8(g) @ _tokens_fp8(a).t()


def _mm_fp8(a: torch.Tensor, w: torch.Tensor, fp8_wgrad: bool) -> torch.Tensor:
    """a @ w.t() whose gradient for `a` comes from the output gradient rounded to bf16 and then FP8 (the FP8
    experts' dgrad; `a`'s gradient rounded to bf16, the dgrad GEMM's output) and for `w` from the unrounded one (bf16
    wgrad) or, with fp8_wgrad, from both operands rounded to FP8 along the rows (_WgradFP8)."""
    a_only = _RoundGrad.apply(_RoundGrad.apply(a, False) @ w.detach().t(), True)
    w_only = _WgradFP8.apply(a.detach(), w) if fp8_wgrad else a.detach() @ w.t()
    return a_only + w_only - a.detach() @ w.detach().t()


def _dense_fp8_grads(world: int, full: dict, fp8_wgrad: bool = False) -> dict[str, torch.Tensor]:
    """float64 autograd through the FP8 MoE over every rank's tokens, each forward rounding straight-through and
    the gradients the GEMMs read rounded as the layer does (_mm_fp8), one GEMM per expert over its rows in token
    order (the layer's pair order: source rank, then token): the gradients of the tokens and weights of all ranks
    (concatenated in rank order) and of every expert's w1, w3, w2."""
    inputs = [_train_inputs(r) for r in range(world)]
    x = torch.cat([i[0] for i in inputs]).double().requires_grad_()
    idx = torch.cat([i[1] for i in inputs])
    w = torch.cat([i[2] for i in inputs]).double().requires_grad_()
    grad = torch.cat([i[3] for i in inputs]).double()
    ws = {name: t.double().requires_grad_() for name, t in full.items()}
    xd = _st(x, fp8_dequantize(*fp8_quantize(x.float())))
    out = torch.zeros_like(x)
    for e in range(EXPERTS):
        w13 = torch.cat([ws["w1"][e], ws["w3"][e]])
        q13, s13 = fp8_quantize_weight_blocks(w13.unsqueeze(0))
        q2, s2 = fp8_quantize_weight_blocks(ws["w2"][e].unsqueeze(0))
        w13d = _st(w13, q13[0].double() * _expand(s13[0], 2 * FFN, HIDDEN))
        w2d = _st(ws["w2"][e], q2[0].double() * _expand(s2[0], HIDDEN, FFN))
        hit = idx == e  # distinct top-k: at most one slot per row
        rows = hit.any(1).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        h13 = _mm_fp8(xd[rows], w13d, fp8_wgrad)
        h13 = _st(h13, h13.to(torch.bfloat16).double())  # the gate/up GEMM's bf16 output
        g, u = h13[:, :FFN], h13[:, FFN:]
        a = g * torch.sigmoid(g) * u * (w * hit).sum(1)[rows].unsqueeze(1)
        ad = _st(a, fp8_dequantize(*fp8_quantize(a.float())))
        out = out.index_add(0, rows, _mm_fp8(ad, w2d, fp8_wgrad))
    out.backward(grad)
    return {"x": x.grad, "weights": w.grad, **{name: t.grad for name, t in ws.items()}}


def _near(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Within 1 % in norm (3e-3 seen on the CPU): the oracle rounds where the layer does, so what is left is float32
    against float64 sums and the few FP8 roundings that land on the other side of an e4m3 step."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
    assert not torch.isnan(got.float()).any(), f"{what}: NaN"
    err = float(torch.linalg.vector_norm(got.double() - want) / torch.linalg.vector_norm(want).clamp_min(1e-30))
    assert err <= 1e-2, f"{what}: relative error {err:.3e}"


def _train_case(rank: int, world: int, backend: str = "reference",
                fp8_wgrad: bool = False) -> dict[str, torch.Tensor]:
    """One FP8Normal forward + backward on this rank's inputs (weight gradients in bf16, or FP8 with fp8_wgrad)
    against _dense_fp8_grads: the tokens' and top-k weights' gradients of this rank's rows and this rank's experts'
    weight gradients; returns them."""
    buf = moe_ep.Buffer(None, device=device(), hidden=HIDDEN, num_experts=EXPERTS, num_topk=TOPK,
                        max_tokens_per_rank=64, backend=backend)
    full = _full_weights(buf.device)
    moe = _fp8_moe(buf, full)
    x, idx, w, grad = (t.to(buf.device) for t in _train_inputs(rank))
    x.requires_grad_()
    w.requires_grad_()
    e = moe.experts
    out = fp8_normal.FP8Normal.apply(x, idx, w, e.w1, e.w3, e.w2, buf, e, moe.fp8_weights, fp8_wgrad)
    out.backward(grad)
    got = {"x": x.grad, "weights": w.grad, "w1": e.w1.grad, "w3": e.w3.grad, "w2": e.w2.grad}
    want = _dense_fp8_grads(world, full, fp8_wgrad)
    first = sum(TRAIN_TOKENS[r % 4] for r in range(rank))
    mine = slice(first, first + x.shape[0])
    local = slice(e.first_expert, e.first_expert + e.num_local_experts)
    if x.shape[0]:
        _near(got["x"].cpu(), want["x"][mine], f"rank {rank}: tokens' gradient")
        _near(got["weights"].cpu(), want["weights"][mine], f"rank {rank}: top-k weights' gradient")
    for name in ("w1", "w3", "w2"):
        _near(got[name].cpu(), want[name][local], f"rank {rank}: {name}'s gradient")
    buf.close()
    return got


def _bad_config_case() -> None:
    buf = moe_ep.Buffer(None, hidden=192, num_experts=4, num_topk=2, max_tokens_per_rank=8)
    with pytest.raises(ValueError, match="multiples of 128"):
        MoE(buf, 128, fp8_experts=True)
    buf.close()
    buf = moe_ep.Buffer(None, hidden=128, num_experts=4, num_topk=2, max_tokens_per_rank=8)
    with pytest.raises(ValueError, match="no overlap mode"):
        MoE(buf, 128, fp8_experts=True, overlap=True)
    with pytest.raises(ValueError, match="fp8_wgrad=True needs fp8_experts=True"):
        MoE(buf, 128, fp8_wgrad=True)
    buf.close()


def _worker(rank: int, world: int) -> None:
    _layer_case(rank, world)
    for fp8_wgrad in (False, True):
        _train_case(rank, world, fp8_wgrad=fp8_wgrad)
    if world == 1:
        _bad_config_case()


@pytest.mark.parametrize("world", [1, 4])
def test_fp8_layer(world: int) -> None:
    run_workers(world, _worker)


# ---- GPU -------------------------------------------------------------------------------------------
def _gpu_worker(rank: int, world: int) -> None:
    if rank == 0:
        _kernel_cases(device())
    native = _layer_case(rank, world, backend="auto")
    reference = _layer_case(rank, world, backend="reference")
    assert torch.equal(native, reference), f"rank {rank}: native and reference FP8 MoE outputs differ"
    for fp8_wgrad in (False, True):
        native = _train_case(rank, world, backend="auto", fp8_wgrad=fp8_wgrad)
        reference = _train_case(rank, world, backend="reference", fp8_wgrad=fp8_wgrad)
        for name, t in native.items():
            assert torch.equal(t, reference[name]), \
                f"rank {rank}, fp8_wgrad={fp8_wgrad}: native and reference FP8 MoE {name} gradients differ"


@requires_gpus()
def test_fp8_experts_gpu() -> None:
    run_workers(2, _gpu_worker, backend="gpu")
