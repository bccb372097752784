"""The sm90 CUTLASS FP8 grouped GEMM (moe_ep.moe.fp8_grouped_gemm_sm90) against the torch version of the same
formula (moe_ep.moe.fp8_experts._grouped_gemm_torch: dequantize, float32 matmul per expert, on the CPU), on fresh
random inputs with uneven counts (empty experts, one expert with every row, single rows, partial tiles, counts
past M clipped, rows past sum(counts) left alone), `out` poisoned with NaN first so an unwritten row shows; every
tile config and raster order, the same bits on a second run, and the Triton kernel (fp8_experts.grouped_gemm)
within tolerance. On a machine without an sm90 GPU or without the built module, the GPU tests skip; the argument
checks (Python's and the module's own) run on the CPU."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from moe_ep.moe import fp8_experts as fe
from moe_ep.moe import fp8_grouped_gemm_sm90 as sm90

CONFIGS = [sm90.GemmConfig(tiles, raster) for tiles in ("cooperative_128x128", "pingpong_64x128")
           for raster in ("along_m", "along_n")]


@dataclass(frozen=True)
class Case:
    """One GEMM: E experts of [N, K], `counts` rows each, `m` rows in a (sum(counts) unless said otherwise)."""

    counts: tuple[int, ...]
    n: int
    k: int
    m: Optional[int] = None

    @property
    def rows(self) -> int:
        return sum(self.counts) if self.m is None else self.m


def _router_counts(tokens: int, experts: int, topk: int, seed: int) -> tuple[int, ...]:
    """Rows per expert of `tokens` tokens routed top-k over random scores (uneven, some experts may get none)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randn(tokens, experts, generator=g).topk(topk, dim=1).indices
    return tuple(torch.bincount(idx.flatten(), minlength=experts).tolist())


CASES = [
    Case((0, 37, 0, 130, 1, 0, 200, 9), 256, 384),  # empty experts first and between, a single row, partial tiles
    Case((0, 0, 300, 0), 384, 256),  # one expert has every row; 3 column tiles (odd for a 1 x 2 cluster)
    Case((2, 0, 1), 128, 128, m=7),  # rows 3..6 are nobody's: left as they were
    Case((0, 0, 0), 256, 128, m=5),  # no rows at all: nothing written
    Case((5, 10), 128, 256, m=8),  # counts past M: the second expert gets rows 5..7 only
    Case(_router_counts(512, 128, 8, seed=3), 512, 1024),  # 128 experts, router-like
    Case(_router_counts(24, 128, 8, seed=5), 256, 512),  # 128 experts, most of them empty
    Case((700, 129, 128, 1, 1000, 64, 250, 0), 1024, 2048),  # thousands of rows, many K blocks
]


def _inputs(case: Case, seed: int) -> tuple[torch.Tensor, ...]:
    """Fresh FP8 rows and weights (e4m3 by torch's cast) with positive random scales, on the CPU."""
    g = torch.Generator().manual_seed(seed)
    e, n, k, m = len(case.counts), case.n, case.k, case.rows
    a = (torch.randn(m, k, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    a_scale = torch.rand(m, k // 128, generator=g) * 0.02 + 0.001
    b = (torch.randn(e, n, k, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    b_scale = torch.rand(e, n // 128, k // 128, generator=g) * 0.02 + 0.001
    return a, a_scale, b, b_scale


def _oracle(case: Case, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    """float32 [M, N], NaN in the rows no expert owns: the torch version over the counts as clipped to M."""
    left, clipped = case.rows, []
    for c in case.counts:
        clipped.append(min(c, left))
        left -= clipped[-1]
    owned = sum(clipped)
    want = torch.full((case.rows, case.n), float("nan"))
    want[:owned] = fe._grouped_gemm_torch(a[:owned], a_scale[:owned], None, torch.tensor(clipped), b, b_scale,
                                          torch.float32)
    return want


def _within(got: torch.Tensor, want: torch.Tensor, what: str, steps: float = 1.0) -> None:
    """got (bf16) against want (float32, NaN where nothing may be written): the same rows NaN, the others within
    `steps` bf16 roundings of the largest value."""
    got, want = got.float().cpu(), want.float()
    assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{what}: rows written where they should not be, or not"
    ok = ~torch.isnan(want)
    if bool(ok.any()):
        err = (got[ok] - want[ok]).abs().max().item()
        bound = steps * 2 ** -7 * want[ok].abs().max().item() + 1e-6
        assert err <= bound, f"{what}: max error {err:.3e} > {bound:.3e}"


# ---- the argument checks (CPU) ---------------------------------------------------------------------
def _valid_cpu() -> dict[str, torch.Tensor]:
    a, a_scale, b, b_scale = _inputs(Case((3, 1), 256, 256), seed=0)
    return {"a": a, "a_scale": a_scale, "counts": torch.tensor([3, 1], dtype=torch.int32), "b": b, "b_scale": b_scale}


@pytest.mark.parametrize("change, message", [
    (lambda t: t.update(a=t["a"].to(torch.bfloat16)), "a must be"),
    (lambda t: t.update(b=t["b"][:, :, :128].contiguous()), "a has K = 256 but b has K = 128"),
    (lambda t: t.update(a=t["a"][:, :192].contiguous(), b=t["b"][:, :, :192].contiguous()), "multiples of 128"),
    (lambda t: t.update(a_scale=t["a_scale"].double()), "a_scale must be"),
    (lambda t: t.update(b_scale=t["b_scale"][:, :1].contiguous()), "b_scale must be"),
    (lambda t: t.update(counts=torch.tensor([4])), "counts must be"),
    (lambda t: t.update(counts=t["counts"].float()), "counts must be"),
    (lambda t: t.update(b=t["b"].transpose(1, 2).contiguous().transpose(1, 2)), "b must be contiguous"),
    (lambda t: t.update(out=torch.empty(4, 256, dtype=torch.float32)), "out must be"),
    (lambda t: None, "must be on a's CUDA device"),
])
def test_bad_arguments_raise_value_error(change, message: str) -> None:
    """Each rule of the kernel's contract, broken alone, raises ValueError naming it (before any GPU work)."""
    t = _valid_cpu()
    change(t)
    with pytest.raises(ValueError, match=message):
        sm90.grouped_gemm(t["a"], t["a_scale"], t["counts"], t["b"], t["b_scale"], out=t.get("out"))


def test_native_checks_name_the_field() -> None:
    """The module's own checks (csrc/gemm/bindings.cpp), which need no GPU: a bad field raises ValueError naming
    it; a call with no rows returns without touching the device."""
    module, why = sm90._module()
    if module is None:
        pytest.skip(why)
    fields = dict(a=16, a_scale=16, b=16, b_scale=16, counts=16, out=16, workspace=128, workspace_bytes=1, rows=4,
                  n=256, k=256, groups=2, config=0, raster=0, stream=0)
    module.GroupedGemmArgs(**fields).check()
    for change, message in (({"n": 100}, "n = 100"), ({"k": 0}, "k = 0"), ({"groups": 0}, "groups = 0"),
                            ({"config": 2}, "config = 2"), ({"raster": 5}, "raster = 5"), ({"b": 0}, "b is null"),
                            ({"a": 8}, "a = 8 is not 16-byte aligned"), ({"workspace": 64}, "workspace = 64")):
        with pytest.raises(ValueError, match=f"fp8_grouped_gemm: {message}"):
            module.GroupedGemmArgs(**(fields | change)).check()
    module.grouped_gemm(module.GroupedGemmArgs(**(fields | {"rows": 0, "a": 0, "out": 0})))
    assert set(module.TILE_CONFIGS) == {"cooperative_128x128", "pingpong_64x128"}
    assert set(module.RASTERS) == {"along_m", "along_n"}


# ---- the kernel (GPU) --------------------------------------------------------------------------------
needs_sm90 = pytest.mark.skipif(not sm90.available(), reason=str(sm90.unavailable_reason()))


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("index", range(len(CASES)))
def test_matches_torch_version(index: int) -> None:
    """Every config on poisoned outputs against the torch version; the same bits on a second run; the Triton
    kernel within tolerance of it (both round to bf16, so two roundings apart at most)."""
    case = CASES[index]
    a, a_scale, b, b_scale = _inputs(case, seed=100 + index)
    want = _oracle(case, a, a_scale, b, b_scale)
    dev = torch.device("cuda")
    args = [t.to(dev) for t in (a, a_scale)] + [torch.tensor(case.counts, dtype=torch.int32, device=dev)] + \
           [t.to(dev) for t in (b, b_scale)]
    for config in CONFIGS:
        outs = []
        for _ in range(2):
            out = torch.full((case.rows, case.n), float("nan"), dtype=torch.bfloat16, device=dev)
            assert sm90.grouped_gemm(*args, out=out, config=config) is out
            outs.append(out)
        torch.cuda.synchronize()
        _within(outs[0], want, f"{case} {config}")
        assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)), f"{case} {config}: bits differ"
    if sum(case.counts) == case.rows:  # the Triton kernel has no clipping to compare
        triton_out = fe.grouped_gemm(args[0], args[1], None, args[2], args[3], args[4], tiles=fe.TILES)
        _within(sm90.grouped_gemm(*args), triton_out.float().cpu(), f"{case} against Triton", steps=2.0)


@pytest.mark.gpu
@needs_sm90
def test_int64_counts_and_fresh_output() -> None:
    """int64 counts (as torch.bincount gives them) and out=None: the same result as int32 counts into `out`."""
    case = CASES[0]
    a, a_scale, b, b_scale = (t.cuda() for t in _inputs(case, seed=7))
    counts = torch.tensor(case.counts, device="cuda")
    got = sm90.grouped_gemm(a, a_scale, counts, b, b_scale)
    assert got.dtype == torch.bfloat16 and got.shape == (case.rows, case.n)
    again = sm90.grouped_gemm(a, a_scale, counts.to(torch.int32), b, b_scale, out=torch.empty_like(got))
    assert torch.equal(got.view(torch.int16), again.view(torch.int16))
