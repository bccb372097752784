"""FP8 quantisation follows docs/api.md to the bit, on every device."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_ep.comm import fp8
from tests._interpret import run_interpreted


def _rows(seed: int, n: int = 64, hidden: int = 512) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=g) * 10.0 ** torch.empty(n, 1).uniform_(-6, 3, generator=g)
    x[0, :128] = 0  # an all-zero block takes the 1e-4 floor
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("round_scale", [False, True])
def test_quantize_matches_definition(round_scale: bool) -> None:
    x = _rows(1)
    q, scales = fp8.quantize(x, round_scale)
    blocks = x.float().numpy().reshape(x.shape[0], -1, 128)
    amax = np.maximum(np.abs(blocks).max(-1), np.float32(1e-4)).astype(np.float32)
    want = (amax / np.float32(448.0)).astype(np.float32)  # IEEE float32 division
    if round_scale:
        mantissa, exponent = np.frexp(want)
        want = np.where(mantissa == 0.5, want, np.ldexp(np.float32(1.0), exponent)).astype(np.float32)
        assert np.all(want >= amax / np.float32(448.0))
    assert np.array_equal(scales.numpy().view(np.int32), want.view(np.int32))
    values = torch.from_numpy(blocks / want[..., None]).to(torch.float8_e4m3fn).view(x.shape)
    assert torch.equal(q.view(torch.uint8), values.view(torch.uint8))
    # e4m3 keeps 3 mantissa bits (relative error <= 2^-4), subnormals step by 2^-9 of the scale
    err = (fp8.dequantize(q, scales) - x.float()).abs().view(x.shape[0], -1, 128)
    bound = torch.maximum(x.float().abs().view_as(err) * 2 ** -4, scales.unsqueeze(-1) * 2 ** -10)
    assert (err <= bound).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("round_scale", [False, True])
def test_cuda_matches_cpu(round_scale: bool) -> None:
    x = _rows(2, n=256, hidden=7168)
    q_cpu, s_cpu = fp8.quantize(x, round_scale)
    q_gpu, s_gpu = fp8.quantize(x.cuda(), round_scale)
    assert torch.equal(s_gpu.cpu().view(torch.int32), s_cpu.view(torch.int32))
    assert torch.equal(q_gpu.cpu().view(torch.uint8), q_cpu.view(torch.uint8))


def interpreted_cases() -> None:
    """The Triton quantize kernel (run on CPU tensors under TRITON_INTERPRET=1) against the torch version,
    bit for bit: tiny to huge magnitudes, an all-zero block, a row count that is no multiple of the
    kernel's 16 rows, and bf16 as well as float32 input."""
    for seed, n, dtype in ((3, 37, torch.bfloat16), (4, 5, torch.float32), (5, 0, torch.bfloat16)):
        x = _rows(seed, n=max(n, 1), hidden=384)[:n].to(dtype)
        q, s = fp8._quantize_triton(x.contiguous())
        q_want, s_want = fp8._quantize_torch(x, False)
        assert torch.equal(s.view(torch.int32), s_want.view(torch.int32)), f"seed {seed}: scales"
        # Triton's interpreter emulates the e4m3 rounding inexactly (a quotient of 31.5 can come out 16,
        # not 32): the values' bits are checked on the GPU (test_cuda_matches_cpu); here, that every
        # entry is the right one (same sign, within a factor of two) and most agree to the bit
        same = q.view(torch.uint8) == q_want.view(torch.uint8)
        got, want = q.float(), q_want.float()
        near = (got * want > 0) & (got.abs() <= 2 * want.abs()) & (want.abs() <= 2 * got.abs())
        assert (same | near).all(), f"seed {seed}: values"
        assert n == 0 or same.float().mean() > 0.9, f"seed {seed}: values"


def test_quantize_kernel_in_triton_interpreter() -> None:
    run_interpreted("tests.test_fp8", "interpreted_cases")
