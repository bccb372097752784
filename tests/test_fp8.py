"""FP8 quantisation follows docs/api.md to the bit, on every device."""
from __future__ import annotations

import pytest
import torch

from moe_ep.comm import fp8
from tests._interpret import run_interpreted
from tests.oracle import e4m3_bits, fp8_quantize


def _rows(seed: int, n: int = 64, hidden: int = 512) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=g) * 10.0 ** torch.empty(n, 1).uniform_(-6, 3, generator=g)
    x[0, :128] = 0  # an all-zero block takes the 1e-4 floor
    return x.to(torch.bfloat16)


def _same_bits(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor], what: str,
               exact: torch.Tensor | None = None) -> None:
    """(values, scales) bit for bit; values only where `exact` (a mask) when given."""
    assert torch.equal(got[1].cpu().view(torch.int32), want[1].view(torch.int32)), f"{what}: scales"
    a, b = got[0].cpu().view(torch.uint8), want[0].view(torch.uint8)
    if exact is not None:
        a, b = a[exact], b[exact]
    bad = (a != b).sum().item()
    assert bad == 0, f"{what}: {bad} of {a.numel()} values differ"


def interpreter_exact(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Where Triton's interpreter converts float32 to e4m3 exactly: not a tie between two e4m3 values
    and not rounded up into the next binade (the interpreter rounds ties up and drops the carry there,
    e.g. 31.97 -> 16, measured on Triton 3.9), and normal (it rounds subnormals loosely); there the
    bits are the definition's."""
    v = (x.float().view(x.shape[0], x.shape[1] // 128, 128) / scales.unsqueeze(-1)).view(x.shape).double().abs()
    q = e4m3_bits(v.float()).view(torch.float8_e4m3fn).double()
    carried = (torch.frexp(q).mantissa == 0.5) & (q > v)
    _, exp = torch.frexp(v)
    step = torch.ldexp(torch.ones_like(v), torch.clamp(exp - 1, min=-6) - 3)  # e4m3's spacing at v
    tie = torch.frac(v / step) == 0.5
    subnormal = (v > 0) & (v < 2.0 ** -6)
    return ~(carried | tie | subnormal)


@pytest.mark.parametrize("round_scale", [False, True])
def test_quantize_matches_definition(round_scale: bool) -> None:
    """The torch version against tests/oracle.py's quantiser, written from the definition."""
    x = _rows(1)
    _same_bits(fp8.quantize(x, round_scale), fp8_quantize(x, round_scale), "torch quantize")
    q, scales = fp8_quantize(x, round_scale)
    # e4m3 keeps 3 mantissa bits (relative error <= 2^-4), subnormals step by 2^-9 of the scale
    err = (fp8.dequantize(q, scales) - x.float()).abs().view(x.shape[0], -1, 128)
    bound = torch.maximum(x.float().abs().view_as(err) * 2 ** -4, scales.unsqueeze(-1) * 2 ** -10)
    assert (err <= bound).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("round_scale", [False, True])
def test_cuda_matches_cpu(round_scale: bool) -> None:
    """On CUDA (the Triton kernel without round_scale) every bit is the definition's."""
    for seed, n, hidden in ((2, 256, 7168), (6, 37, 384)):
        x = _rows(seed, n=n, hidden=hidden)
        want = fp8_quantize(x, round_scale)
        _same_bits(fp8.quantize(x.cuda(), round_scale), want, f"CUDA seed {seed}")
        _same_bits(fp8.quantize(x, round_scale), want, f"CPU seed {seed}")
        _same_bits(fp8.quantize(x.float().cuda(), round_scale), fp8_quantize(x.float(), round_scale),
                   f"CUDA float32 seed {seed}")


def interpreted_cases() -> None:
    """The Triton quantize kernel (run on CPU tensors under TRITON_INTERPRET=1) against the oracle's
    quantiser: scales bit for bit, values bit for bit wherever the interpreter converts exactly
    (interpreter_exact; the rest is checked on the GPU by test_cuda_matches_cpu). Tiny to huge
    magnitudes, an all-zero block, a row count that is no multiple of the kernel's 16 rows, bf16 and
    float32 input."""
    for seed, n, dtype in ((3, 37, torch.bfloat16), (4, 5, torch.float32), (5, 0, torch.bfloat16)):
        x = _rows(seed, n=max(n, 1), hidden=384)[:n].to(dtype)
        want = fp8_quantize(x)
        exact = interpreter_exact(x, want[1])
        assert n == 0 or exact.float().mean() > 0.8, f"seed {seed}: too few entries checked"
        _same_bits(fp8._quantize_triton(x.contiguous()), want, f"interpreted seed {seed}", exact)


def test_quantize_kernel_in_triton_interpreter() -> None:
    run_interpreted("tests.test_fp8", "interpreted_cases")


def _dequantize_oracle(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 products (exact: 4 by 24 significant bits), rounded to float32 and then to bf16."""
    return (q.double() * scales.double().repeat_interleave(128, dim=-1)).float().to(torch.bfloat16)


def _dequantize_case(dev: torch.device, seed: int, n: int) -> None:
    q, scales = fp8_quantize(_rows(seed, n=max(n, 1), hidden=384)[:n])
    want = _dequantize_oracle(q, scales)
    got = fp8.dequantize(q.to(dev), scales.to(dev), torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got.cpu().view(torch.int16), want.view(torch.int16)), (
        f"dequantize to bf16, seed {seed}: bits differ")


def test_dequantize_to_bf16_matches_definition() -> None:
    for seed, n in ((7, 37), (8, 0)):
        _dequantize_case(torch.device("cpu"), seed, n)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dequantize_to_bf16_on_cuda() -> None:
    """The Triton dequantize kernel, every bit the definition's (rows no multiple of its 16, and none). Not run
    in Triton's interpreter: it rounds float32 to bf16 otherwise than a GPU does (seen on Triton 3.9)."""
    for seed, n in ((9, 37), (10, 256), (11, 0)):
        _dequantize_case(torch.device("cuda"), seed, n)

