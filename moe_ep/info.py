"""`python -m moe_ep.info`: what moe_ep runs on here — torch, CUDA, NVSHMEM, GPUs and their links,
whether moe_ep._C is usable, and the backend Buffer(backend="auto") would pick."""
from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Optional

import torch

from . import _native


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvcc_version() -> str:
    home = os.environ.get("CUDA_HOME")
    nvcc = str(Path(home) / "bin" / "nvcc") if home and (Path(home) / "bin" / "nvcc").is_file() else shutil.which("nvcc")
    if nvcc is None:
        return "not found"
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout
    match = re.search(r"release (\d+\.\d+)", out)
    return f"{match[1] if match else '?'} ({nvcc})"


def _dotted(version: object) -> str:
    return ".".join(str(v) for v in version)


def _native_lines() -> list[str]:
    info = _native.build_info()
    ok, why = _native.available()
    lines = []
    if info is None:
        wheels = [f"{d} {v}" for d in ("nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12") if (v := _version(d))]
        lines.append(f"NVSHMEM      wheel {', '.join(wheels) or 'not installed'}")
    else:
        runtime = _dotted(_native.load().runtime_version()) if ok else "not loaded"
        lines.append(f"NVSHMEM      wheel {info['nvshmem_dist']} {_version(info['nvshmem_dist']) or 'not installed'}; "
                     f"built against {_dotted(info['nvshmem_version'])}; runtime {runtime}")
        lines.append(f"moe_ep._C    built with CUDA {_dotted(info['cuda_version'])} for "
                     + ", ".join(f"sm_{a}" for a in info["cuda_archs"]))
    lines.append("moe_ep._C    " + ("loads" if ok else f"not available: {why}"))
    return lines


def _gpu_lines() -> list[str]:
    if not torch.cuda.is_available():
        return ["GPUs         none (torch.cuda.is_available() is False)"]
    count = torch.cuda.device_count()
    lines = [f"GPUs         {count}"]
    for i in range(count):
        p = torch.cuda.get_device_properties(i)
        lines.append(f"  cuda:{i}     {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
                     f"{p.total_memory / 2**30:.1f} GiB")
    smi = shutil.which("nvidia-smi")
    topo = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, check=False) if smi else None
    if topo is not None and topo.returncode == 0:
        lines.append("Topology     nvidia-smi topo -m:")
        lines += ["  " + line for line in topo.stdout.rstrip().splitlines()]
    elif count > 1:
        lines.append("Peer access  (row can access column; nvidia-smi not available)")
        lines.append("        " + " ".join(f"{j:>5}" for j in range(count)))
        for i in range(count):
            cells = ["-" if i == j else ("yes" if torch.cuda.can_device_access_peer(i, j) else "no") for j in range(count)]
            lines.append(f"  {i:>5} " + " ".join(f"{c:>5}" for c in cells))
    return lines


def auto_backend() -> tuple[str, str]:
    """The backend Buffer(backend="auto") picks here for one GPU per rank, and why."""
    ok, why = _native.available()
    if not ok:
        return "reference", why
    if not torch.cuda.is_available():
        return "reference", "no CUDA device"
    if torch.cuda.device_count() < 2:
        return "reference", "only 1 GPU: the NVSHMEM backend needs one GPU per rank and at least 2 ranks"
    return "nvshmem", f"moe_ep._C loads and {torch.cuda.device_count()} GPUs are visible"


def report() -> str:
    """The whole report as text."""
    lines = [
        f"moe_ep       {_version('moe_ep') or 'not installed'}",
        f"torch        {torch.__version__} (CUDA runtime {torch.version.cuda or 'none'})",
        f"nvcc         {_nvcc_version()}",
        *_native_lines(),
        *_gpu_lines(),
    ]
    backend, why = auto_backend()
    lines.append(f'Buffer(backend="auto") -> {backend} ({why})')
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
