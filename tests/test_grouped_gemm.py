"""The bf16 grouped GEMM (moe_ep.grouped_gemm.mm) against a float64 loop over experts: rows gathered or
not, weights [E, N, K] or [E, K, N], empty experts and partial tiles, output poisoned first. On CPU the
kernel runs in Triton's interpreter (a subprocess with TRITON_INTERPRET=1; skipped without Triton), in
float32: Triton 3.9's interpreter gets bf16 dot products wrong; on a GPU in bf16."""
from __future__ import annotations

from typing import Optional

import pytest
import torch

from moe_ep import grouped_gemm as gg
from tests._interpret import run_interpreted



def _oracle(a: torch.Tensor, rows: Optional[torch.Tensor], counts: list[int], b: torch.Tensor, b_nk: bool) -> torch.Tensor:
    x = a.double() if rows is None else a.double()[rows]
    out, start = [], 0
    for e, c in enumerate(counts):
        w = b[e].double().t() if b_nk else b[e].double()
        out.append(x[start:start + c] @ w)
        start += c
    return torch.cat(out)


def _case(dev: torch.device, seed: int, e: int, n: int, k: int, counts: list[int], m: int, gather: bool, b_nk: bool,
          tiles: gg.Tiles) -> None:
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    a = torch.randn(m, k, generator=g).to(dtype)
    b = (torch.randn(e, n, k, generator=g) if b_nk else torch.randn(e, k, n, generator=g)).to(dtype)
    rows = torch.randint(0, m, (sum(counts),), generator=g) if gather else None
    want = _oracle(a, rows, counts, b, b_nk)
    out = torch.full(want.shape, float("nan"), dtype=dtype, device=dev)
    gg.mm(a.to(dev), None if rows is None else rows.to(dev), torch.tensor(counts, device=dev), b.to(dev), b_nk,
          tiles, out=out)
    got = out.cpu().double()
    assert not torch.isnan(got).any(), f"{counts}: rows left unwritten"
    err = (got - want).abs().max().item()
    assert err <= 2 ** -7 * want.abs().max().item(), f"{counts} gather={gather} b_nk={b_nk}: max error {err:.3e}"


def kernel_cases(dev: torch.device) -> None:
    small = gg.Tiles(bm=16, bn=32, bk=32, num_warps=4, num_stages=1)
    _case(dev, 1, 3, 64, 96, [5, 0, 37], 50, True, True, small)
    _case(dev, 2, 3, 80, 64, [16, 33, 0], 49, False, False, small)  # N and K not multiples of the tile
    _case(dev, 3, 2, 64, 64, [0, 9], 12, True, False, small)
    if dev.type == "cuda":
        for tiles in (gg.Tiles(), gg.Tiles(64, 128, 64, 4, 4)):
            _case(dev, 4, 8, 1024, 2048, [300, 0, 129, 128, 1, 700, 64, 250], 900, True, True, tiles)
            _case(dev, 5, 8, 512, 1024, [300, 0, 129, 128, 1, 700, 64, 250], 1572, False, False, tiles)


def interpreted_kernel_cases() -> None:
    """Entry of the interpreter subprocess (TRITON_INTERPRET=1 must be set before Triton loads)."""
    kernel_cases(torch.device("cpu"))


def test_kernel_in_triton_interpreter() -> None:
    run_interpreted("tests.test_grouped_gemm", "interpreted_kernel_cases")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or gg.triton is None, reason="needs a CUDA GPU and Triton")
def test_kernel_gpu() -> None:
    kernel_cases(torch.device("cuda"))
