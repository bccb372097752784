"""FP8 grouped GEMM with DeepSeek-V3 block scales as a native Hopper kernel: CUTLASS's pointer-array grouped GEMM
with software block scaling, built for sm_90a into the module moe_ep.moe._gemm (csrc/gemm/; apart from
moe_ep.comm._C: no NVSHMEM).

The arithmetic of moe_ep.moe.fp8_experts.grouped_gemm without a row gather: rows of `a` grouped by expert,
counts [E] on the device, each 128-deep K block's product scaled by (row scale x weight block scale) and added
into float32, rounded once to bf16. The counts never reach the host: a one-block kernel turns them into CUTLASS's
per-group tables (shapes, addresses, strides, scale layouts) on the stream, then the persistent grouped GEMM runs.
The scales are read in place (K-major: a_scale [M, K / 128] as fp8 dispatch delivers it), no transpose.
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Optional

import torch

BLOCK = 128


@dataclass(frozen=True)
class GemmConfig:
    """Which compiled kernel runs (a key of moe_ep.moe._gemm.TILE_CONFIGS) and the order in which its CTAs walk an
    expert's output tiles (a key of RASTERS): speed only, every choice computes the same sums."""

    tiles: str = "cooperative_128x128"
    raster: str = "along_m"


CONFIG = GemmConfig()


@functools.lru_cache(maxsize=None)
def _module() -> tuple[Optional[ModuleType], str]:
    """(moe_ep.moe._gemm, "") or (None, why it does not import)."""
    try:
        return importlib.import_module("moe_ep.moe._gemm"), ""
    except ImportError as error:
        return None, (f"moe_ep.moe._gemm is not built ({error}): install CUTLASS's headers "
                      f"(`pip install --no-deps nvidia-cutlass`) and reinstall moe_ep with nvcc 12.3+")


def unavailable_reason(device: Optional[torch.device] = None) -> Optional[str]:
    """Why grouped_gemm cannot run on `device` (default: the current CUDA device), or None when it can."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    module, why = _module()
    if module is None:
        return why
    capability = torch.cuda.get_device_capability(device)
    if capability != (9, 0):
        return f"the kernel is built for sm_90a (H100/H200) only; this GPU is sm_{capability[0]}{capability[1]}"
    return None


def available(device: Optional[torch.device] = None) -> bool:
    """Whether grouped_gemm runs here: CUDA, an sm90 GPU, moe_ep.moe._gemm built."""
    return unavailable_reason(device) is None


def _check(a: torch.Tensor, a_scale: torch.Tensor, counts: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
           out: Optional[torch.Tensor], config: GemmConfig) -> None:
    """ValueError naming the first argument that breaks the kernel's contract (dtypes, shapes, contiguity,
    128-multiples, one CUDA device, TMA's 16-byte alignment)."""
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"fp8 grouped GEMM (sm90): {what}")

    e4m3 = torch.float8_e4m3fn
    need(a.dim() == 2 and a.dtype == e4m3, f"a must be [M, K] float8_e4m3fn, got {tuple(a.shape)} {a.dtype}")
    need(b.dim() == 3 and b.dtype == e4m3, f"b must be [E, N, K] float8_e4m3fn, got {tuple(b.shape)} {b.dtype}")
    m, k = a.shape
    e, n, k_b = b.shape
    need(k_b == k, f"a has K = {k} but b has K = {k_b}")
    need(k > 0 and k % BLOCK == 0 and n > 0 and n % BLOCK == 0, f"K and N must be positive multiples of {BLOCK}, "
         f"got K = {k}, N = {n}")
    need(e > 0, "b has no experts (E = 0)")
    need(a_scale.dtype == torch.float32 and tuple(a_scale.shape) == (m, k // BLOCK),
         f"a_scale must be [M, K / {BLOCK}] = {(m, k // BLOCK)} float32, got {tuple(a_scale.shape)} {a_scale.dtype}")
    need(b_scale.dtype == torch.float32 and tuple(b_scale.shape) == (e, n // BLOCK, k // BLOCK),
         f"b_scale must be [E, N / {BLOCK}, K / {BLOCK}] = {(e, n // BLOCK, k // BLOCK)} float32, "
         f"got {tuple(b_scale.shape)} {b_scale.dtype}")
    need(counts.dim() == 1 and counts.numel() == e and counts.dtype in (torch.int32, torch.int64),
         f"counts must be [E] = [{e}] int32 or int64, got {tuple(counts.shape)} {counts.dtype}")
    if out is not None:
        need(out.dtype == torch.bfloat16 and tuple(out.shape) == (m, n),
             f"out must be [M, N] = {(m, n)} bfloat16, got {tuple(out.shape)} {out.dtype}")
    named = {"a": a, "a_scale": a_scale, "counts": counts, "b": b, "b_scale": b_scale}
    if out is not None:
        named["out"] = out
    for name, t in named.items():
        need(t.is_contiguous(), f"{name} must be contiguous")
    for name, t in named.items():
        need(t.is_cuda and t.device == a.device, f"{name} must be on a's CUDA device, got {t.device} (a: {a.device})")
    for name in ("a", "b", "out"):
        if name in named:
            need(named[name].data_ptr() % 16 == 0, f"{name} must start 16-byte aligned (TMA)")
    module, _ = _module()
    if module is not None:
        need(config.tiles in module.TILE_CONFIGS, f"config.tiles = {config.tiles!r}, expected one of "
             f"{sorted(module.TILE_CONFIGS)}")
        need(config.raster in module.RASTERS, f"config.raster = {config.raster!r}, expected one of "
             f"{sorted(module.RASTERS)}")


def grouped_gemm(a: torch.Tensor, a_scale: torch.Tensor, counts: torch.Tensor, b: torch.Tensor,
                 b_scale: torch.Tensor, out: Optional[torch.Tensor] = None,
                 config: GemmConfig = CONFIG) -> torch.Tensor:
    """a [M, K] e4m3 with a_scale [M, K / 128] float32, rows grouped by expert, counts [E] rows per expert on the
    device (sum M); b [E, N, K] e4m3 with b_scale [E, N / 128, K / 128] float32 -> [M, N] bf16 (into `out` when
    given), row p times b[its expert]^T with block scales, float32 sums. No host sync; rows past sum(counts) are
    left as they are, counts past M are clipped."""
    _check(a, a_scale, counts, b, b_scale, out, config)
    why = unavailable_reason(a.device)
    if why is not None:
        raise RuntimeError(f"fp8 grouped GEMM (sm90) cannot run: {why}")
    m, k = a.shape
    e, n, _ = b.shape
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    if m == 0:
        return out
    module, _ = _module()
    tiles = module.TILE_CONFIGS[config.tiles]
    counts32 = counts.to(torch.int32)
    with torch.cuda.device(a.device):
        workspace = torch.empty(module.workspace_bytes(e, tiles), dtype=torch.uint8, device=a.device)
        module.grouped_gemm(module.GroupedGemmArgs(
            a=a.data_ptr(), a_scale=a_scale.data_ptr(), b=b.data_ptr(), b_scale=b_scale.data_ptr(),
            counts=counts32.data_ptr(), out=out.data_ptr(), workspace=workspace.data_ptr(),
            workspace_bytes=workspace.numel(), rows=m, n=n, k=k, groups=e, config=tiles,
            raster=module.RASTERS[config.raster], stream=torch.cuda.current_stream(a.device).cuda_stream))
    return out
