"""FP8 grouped GEMMs with DeepSeek-V3 block scales as native Hopper kernels: CUTLASS's pointer-array grouped GEMM
with software block scaling, built for sm_90a into the module moe_ep.moe._gemm (csrc/gemm/; apart from
moe_ep.comm._C: no NVSHMEM). grouped_gemm groups the rows (forward, data gradients); wgrad_gemm groups the
reduction dimension (weight gradients, over operands moe_ep.moe.fp8_wgrad quantizes).

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
from typing import Callable, Optional

import torch

BLOCK = 128


@dataclass(frozen=True)
class GemmConfig:
    """Which compiled kernel runs (a key of moe_ep.moe._gemm.TILE_CONFIGS) and the order in which its CTAs walk an
    expert's output tiles (a key of RASTERS): speed only, every choice computes the same sums."""

    tiles: str = "cooperative_128x128"
    raster: str = "along_m"


CONFIG = GemmConfig()
WGRAD_CONFIG = GemmConfig()  # its tiles: a key of moe_ep.moe._gemm.WGRAD_TILE_CONFIGS
GROUP_COLUMN_ALIGN = 16  # wgrad_gemm: group starts (columns) are multiples of this (TMA: 16-byte aligned e4m3)


def k_grouped_columns(tokens: int, groups: int) -> int:
    """Columns of a K-grouped FP8 operand of `tokens` tokens in `groups` groups, each group's start rounded up to
    16: a static bound, tokens + 15 * groups rounded up to a multiple of 16 (no host sync for the counts)."""
    align = GROUP_COLUMN_ALIGN
    return (tokens + (align - 1) * groups + align - 1) // align * align


def k_grouped_scale_blocks(tokens: int, groups: int) -> int:
    """A static bound of the 128-token scale blocks of `tokens` tokens in `groups` groups (each group's last block
    may be partial): tokens // 128 + groups + 1. A K-grouped operand with C rows has C times that many scales."""
    return tokens // BLOCK + groups + 1


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


def _requirer(where: str) -> Callable[[bool, str], None]:
    """need(ok, what): ValueError "<where>: <what>" unless ok."""
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"{where}: {what}")
    return need


def _check_tensors(need: Callable[[bool, str], None], named: dict[str, torch.Tensor], out: Optional[torch.Tensor],
                   config: GemmConfig, configs: str) -> None:
    """The rules both GEMMs share, after their own: every tensor (out too, when given) contiguous and on a's CUDA
    device, a, b and out 16-byte aligned (TMA); config's keys among the built module's (`configs`: the name of its
    tile table, TILE_CONFIGS or WGRAD_TILE_CONFIGS)."""
    a = named["a"]
    if out is not None:
        named = named | {"out": out}
    for name, t in named.items():
        need(t.is_contiguous(), f"{name} must be contiguous")
    for name, t in named.items():
        need(t.is_cuda and t.device == a.device, f"{name} must be on a's CUDA device, got {t.device} (a: {a.device})")
    for name in ("a", "b", "out"):
        if name in named:
            need(named[name].data_ptr() % 16 == 0, f"{name} must start 16-byte aligned (TMA)")
    module, _ = _module()
    if module is not None:
        tiles = getattr(module, configs)
        need(config.tiles in tiles, f"config.tiles = {config.tiles!r}, expected one of {sorted(tiles)}")
        need(config.raster in module.RASTERS, f"config.raster = {config.raster!r}, expected one of "
             f"{sorted(module.RASTERS)}")


def _check(a: torch.Tensor, a_scale: torch.Tensor, counts: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
           out: Optional[torch.Tensor], config: GemmConfig) -> None:
    """ValueError naming the first argument that breaks the kernel's contract (dtypes, shapes, contiguity,
    128-multiples, one CUDA device, TMA's 16-byte alignment)."""
    need = _requirer("fp8 grouped GEMM (sm90)")
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
    _check_tensors(need, {"a": a, "a_scale": a_scale, "counts": counts, "b": b, "b_scale": b_scale}, out, config,
                   "TILE_CONFIGS")


def grouped_gemm(a: torch.Tensor, a_scale: torch.Tensor, counts: torch.Tensor, b: torch.Tensor,
                 b_scale: torch.Tensor, out: Optional[torch.Tensor] = None,
                 config: GemmConfig = CONFIG) -> torch.Tensor:
    """a [M, K] e4m3 with a_scale [M, K / 128] float32, rows grouped by expert, counts [E] rows per expert on the
    device (sum M); b [E, N, K] e4m3 with b_scale [E, N / 128, K / 128] float32 -> [M, N] bf16 (into `out` when
    given), row p times b[its expert]^T with block scales, float32 sums. No host sync; rows past sum(counts) are
    left as they are, counts past M are clipped."""
    _check(a, a_scale, counts, b, b_scale, out, config)
    _require_available(a, "fp8 grouped GEMM (sm90)")
    m, k = a.shape
    e, n, _ = b.shape
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    if m == 0:
        return out
    _launch("grouped_gemm", (a, a_scale, b, b_scale, counts, out), config, groups=e, rows=m, n=n, k=k)
    return out


def _require_available(a: torch.Tensor, what: str) -> None:
    why = unavailable_reason(a.device)
    if why is not None:
        raise RuntimeError(f"{what} cannot run: {why}")


def _launch(kind: str, tensors: tuple[torch.Tensor, ...], config: GemmConfig, groups: int, **sizes: int) -> None:
    """Launch the built module's `kind` ("grouped_gemm" or "wgrad_gemm") on a's device and its current stream, with
    a fresh workspace: the addresses of tensors (a, a_scale, b, b_scale, counts, out; counts as int32), `groups`,
    the kind's size fields and config's tile and raster values."""
    module, _ = _module()
    wgrad = kind == "wgrad_gemm"
    tiles = (module.WGRAD_TILE_CONFIGS if wgrad else module.TILE_CONFIGS)[config.tiles]
    workspace_bytes = (module.wgrad_workspace_bytes if wgrad else module.workspace_bytes)(groups, tiles)
    a, a_scale, b, b_scale, counts, out = tensors
    counts32 = counts.to(torch.int32)
    with torch.cuda.device(a.device):
        workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=a.device)
        args = (module.WgradGemmArgs if wgrad else module.GroupedGemmArgs)(
            a=a.data_ptr(), a_scale=a_scale.data_ptr(), b=b.data_ptr(), b_scale=b_scale.data_ptr(),
            counts=counts32.data_ptr(), out=out.data_ptr(), workspace=workspace.data_ptr(),
            workspace_bytes=workspace.numel(), groups=groups, config=tiles, raster=module.RASTERS[config.raster],
            stream=torch.cuda.current_stream(a.device).cuda_stream, **sizes)
        getattr(module, kind)(args)


def _check_wgrad(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                 counts: torch.Tensor, tokens: int, out: Optional[torch.Tensor], config: GemmConfig) -> None:
    """ValueError naming the first argument that breaks wgrad_gemm's contract (dtypes, shapes, the static bounds of
    the K-grouped layout, contiguity, one CUDA device, TMA's 16-byte alignment)."""
    need = _requirer("fp8 wgrad GEMM (sm90)")
    e4m3 = torch.float8_e4m3fn
    need(a.dim() == 2 and a.dtype == e4m3, f"a must be [M, columns] float8_e4m3fn, got {tuple(a.shape)} {a.dtype}")
    need(b.dim() == 2 and b.dtype == e4m3, f"b must be [N, columns] float8_e4m3fn, got {tuple(b.shape)} {b.dtype}")
    m, columns = a.shape
    n, columns_b = b.shape
    need(columns_b == columns, f"a has {columns} columns but b has {columns_b}")
    need(m > 0 and n > 0 and n % 8 == 0, f"M must be positive and N a positive multiple of 8, got M = {m}, N = {n}")
    need(counts.dim() == 1 and counts.numel() > 0 and counts.dtype in (torch.int32, torch.int64),
         f"counts must be [E] (E > 0) int32 or int64, got {tuple(counts.shape)} {counts.dtype}")
    e = counts.numel()
    need(tokens >= 0, f"tokens = {tokens} is negative")
    need(columns % GROUP_COLUMN_ALIGN == 0 and columns >= k_grouped_columns(tokens, e),
         f"a and b must have a multiple of {GROUP_COLUMN_ALIGN} columns, at least k_grouped_columns(tokens = "
         f"{tokens}, E = {e}) = {k_grouped_columns(tokens, e)}, got {columns}")
    blocks = k_grouped_scale_blocks(tokens, e)
    for name, scale, rows in (("a_scale", a_scale, m), ("b_scale", b_scale, n)):
        need(scale.dtype == torch.float32 and scale.dim() == 1 and scale.numel() >= rows * blocks,
             f"{name} must be float32 [>= {rows} * k_grouped_scale_blocks(tokens, E) = {rows * blocks}], "
             f"got {tuple(scale.shape)} {scale.dtype}")
    if out is not None:
        need(out.dtype == torch.bfloat16 and tuple(out.shape) == (e, m, n),
             f"out must be [E, M, N] = {(e, m, n)} bfloat16, got {tuple(out.shape)} {out.dtype}")
    _check_tensors(need, {"a": a, "a_scale": a_scale, "b": b, "b_scale": b_scale, "counts": counts}, out, config,
                   "WGRAD_TILE_CONFIGS")


def wgrad_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
               counts: torch.Tensor, tokens: int, out: Optional[torch.Tensor] = None,
               config: GemmConfig = WGRAD_CONFIG) -> torch.Tensor:
    """The weight gradient over K-grouped FP8 operands (moe_ep.moe.fp8_wgrad.quantize_k_grouped's layout):
    a [M, columns] and b [N, columns] e4m3, group e's tokens at columns [c_e, c_e + n_e), a_scale / b_scale float32
    with group e's [M, kb_e] / [N, kb_e] block row-major at M * s_e / N * s_e, counts [E] tokens per group on the
    device (clipped so that they sum to at most `tokens`, the rows the operands came from), columns a multiple of 16
    and at least k_grouped_columns(tokens, E) -> out [E, M, N] bf16 (into `out` when given):
      out[e] = sum over group e's 128-token blocks of (a_blk @ b_blk^T) * a_scale[:, blk] * b_scale[:, blk]^T
    in float32, rounded once; out[e] = 0 where group e has no tokens. No host sync; every element written."""
    _check_wgrad(a, a_scale, b, b_scale, counts, tokens, out, config)
    _require_available(a, "fp8 wgrad GEMM (sm90)")
    m, columns = a.shape
    n, e = b.shape[0], counts.numel()
    if out is None:
        out = torch.empty(e, m, n, dtype=torch.bfloat16, device=a.device)
    _launch("wgrad_gemm", (a, a_scale, b, b_scale, counts, out), config, groups=e, m=m, n=n, tokens=tokens,
            columns=columns)
    return out
