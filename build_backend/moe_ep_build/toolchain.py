"""Finds what the native modules are built with: nvcc and its CUDA version, the GPU archs, the NVSHMEM wheel
(moe_ep.comm._C) and the CUTLASS headers (moe_ep.moe._gemm)."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ARCH_ENV = "MOE_EP_CUDA_ARCH"
DEFAULT_ARCHS = ("90",)
# Whether to build moe_ep.comm._C: "0" never (pure-Python install), "1" always (fail without nvcc), unset or
# "auto" when nvcc is found. `pip install . --config-settings native=0` sets it for one install.
NATIVE_ENV = "MOE_EP_NATIVE"
# A CUTLASS checkout or include folder (holding cutlass/cutlass.h, or include/cutlass/cutlass.h) for moe_ep.moe._gemm;
# unset, the headers of the nvidia-cutlass wheel (cutlass_library/source/include) are used where it is installed.
CUTLASS_DIR_ENV = "MOE_EP_CUTLASS_DIR"
# CUTLASS's sm90 grouped GEMM with device problem shapes patches TMA descriptors on the device: CUDA 12.3 or later.
GEMM_MIN_CUDA = (12, 3)
NATIVE_MODES = {"0": "off", "off": "off", "false": "off", "no": "off", "1": "on", "on": "on", "true": "on",
                "yes": "on", "": "auto", "auto": "auto"}


@dataclass(frozen=True)
class Cuda:
    """The CUDA compiler and the toolkit version it reports."""

    nvcc: Path
    version: tuple[int, int]

    @property
    def nvshmem_dist(self) -> str:
        """The NVSHMEM wheel built for this CUDA major version."""
        return f"nvidia-nvshmem-cu{self.version[0]}"


@dataclass(frozen=True)
class Nvshmem:
    """An installed nvidia-nvshmem-cu1X wheel: its version, headers and libraries."""

    dist: str
    dist_version: str
    root: Path
    header_version: tuple[int, int, int]

    @property
    def include_dir(self) -> Path:
        return self.root / "include"

    @property
    def device_library(self) -> Path:
        return self.root / "lib" / "libnvshmem_device.a"

    @property
    def host_library(self) -> Path:
        """The wheel ships only the SONAME file, so the link passes it to the linker by path."""
        return self.root / "lib" / "libnvshmem_host.so.3"


@dataclass(frozen=True)
class Cutlass:
    """CUTLASS's C++ headers (the folder holding cutlass/ and cute/) and where they were found."""

    include_dir: Path
    found_by: str  # "$MOE_EP_CUTLASS_DIR", "this interpreter" or "the target environment"


def find_nvcc() -> Optional[Path]:
    """$CUDA_HOME/bin/nvcc, else nvcc on PATH, else None."""
    home = os.environ.get("CUDA_HOME")
    if home and (Path(home) / "bin" / "nvcc").is_file():
        return Path(home) / "bin" / "nvcc"
    found = shutil.which("nvcc")
    return Path(found) if found else None


def find_cuda() -> Optional[Cuda]:
    """The CUDA toolkit to build with, or None when there is no nvcc."""
    nvcc = find_nvcc()
    if nvcc is None:
        return None
    out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=True).stdout
    match = re.search(r"release (\d+)\.(\d+)", out)
    if match is None:
        raise RuntimeError(f"cannot read the CUDA version from `{nvcc} --version`:\n{out}")
    return Cuda(nvcc=nvcc, version=(int(match[1]), int(match[2])))


def native_mode() -> str:
    """"off", "on" or "auto", from $MOE_EP_NATIVE."""
    raw = os.environ.get(NATIVE_ENV, "")
    mode = NATIVE_MODES.get(raw.strip().lower())
    if mode is None:
        raise ValueError(f"{NATIVE_ENV}={raw!r}: expected 0 (skip the native build), 1 (require it) or auto")
    return mode


def build_cuda() -> Optional[Cuda]:
    """The CUDA toolkit to build moe_ep.comm._C with, or None when this install builds no _C: $MOE_EP_NATIVE
    is 0, or it is unset/auto and there is no nvcc. With MOE_EP_NATIVE=1 a missing nvcc is an error."""
    mode = native_mode()
    if mode == "off":
        return None
    cuda = find_cuda()
    if cuda is None and mode == "on":
        raise RuntimeError(f"{NATIVE_ENV}=1 but no nvcc was found ($CUDA_HOME/bin/nvcc or on PATH)")
    return cuda


def cuda_archs() -> list[str]:
    """SM versions to compile for: $MOE_EP_CUDA_ARCH (e.g. "90;100" or "90a"), default sm_90."""
    raw = os.environ.get(ARCH_ENV, "")
    archs = [a for a in re.split(r"[;,\s]+", raw) if a] or list(DEFAULT_ARCHS)
    bad = [a for a in archs if not re.fullmatch(r"\d{2,3}[af]?", a)]
    if bad:
        raise ValueError(f"{ARCH_ENV}={raw!r}: expected SM versions like '90' or '90;100', got {bad}")
    return archs


def find_nvshmem(dist: str) -> Optional[Nvshmem]:
    """The installed NVSHMEM wheel `dist` (headers and libraries), or None when it is not installed."""
    try:
        distribution = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
    root = Path(str(distribution.locate_file("nvidia/nvshmem"))).resolve()
    return Nvshmem(dist=dist, dist_version=distribution.version, root=root,
                   header_version=header_version(root / "include"))


def header_version(include_dir: Path) -> tuple[int, int, int]:
    """NVSHMEM_VENDOR_{MAJOR,MINOR,PATCH}_VERSION from the NVSHMEM headers."""
    text = (include_dir / "non_abi" / "nvshmem_version.h").read_text()
    parts = []
    for part in ("MAJOR", "MINOR", "PATCH"):
        match = re.search(rf"#define\s+NVSHMEM_VENDOR_{part}_VERSION\s+(\d+)", text)
        if match is None:
            raise RuntimeError(f"NVSHMEM_VENDOR_{part}_VERSION not found in {include_dir}")
        parts.append(int(match[1]))
    return parts[0], parts[1], parts[2]


# Run by the target environment's interpreter: the folder of the cutlass_library package, found without importing
# it (its __init__ imports its generator), else nothing.
_CUTLASS_QUERY = r"""
import importlib.util
spec = importlib.util.find_spec("cutlass_library")
if spec is not None and spec.submodule_search_locations:
    print(list(spec.submodule_search_locations)[0])
"""


def _cutlass_include(root: Path) -> Optional[Path]:
    """root itself or root/include when it holds cutlass/cutlass.h and cute/, else None."""
    for candidate in (root, root / "include"):
        if (candidate / "cutlass" / "cutlass.h").is_file() and (candidate / "cute").is_dir():
            return candidate
    return None


def find_cutlass() -> Optional[Cutlass]:
    """CUTLASS's headers from $MOE_EP_CUTLASS_DIR (an error when it names no CUTLASS), else from the nvidia-cutlass
    wheel as this interpreter sees it, else as the target environment does (pip's isolated build hides the target's
    packages behind PYTHONPATH; the same interpreter without it sees them), else None."""
    raw = os.environ.get(CUTLASS_DIR_ENV, "")
    if raw:
        include = _cutlass_include(Path(raw).expanduser())
        if include is None:
            raise RuntimeError(f"{CUTLASS_DIR_ENV}={raw!r} holds neither cutlass/cutlass.h nor include/cutlass/cutlass.h")
        return Cutlass(include_dir=include.resolve(), found_by=f"${CUTLASS_DIR_ENV}")
    spec = importlib.util.find_spec("cutlass_library")
    if spec is not None and spec.submodule_search_locations:
        include = _cutlass_include(Path(list(spec.submodule_search_locations)[0]) / "source")
        if include is not None:
            return Cutlass(include_dir=include.resolve(), found_by="this interpreter")
    if os.environ.get("PYTHONPATH"):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        out = subprocess.run([sys.executable, "-c", _CUTLASS_QUERY], capture_output=True, text=True, env=env,
                             check=False).stdout.strip()
        include = _cutlass_include(Path(out) / "source") if out else None
        if include is not None:
            return Cutlass(include_dir=include.resolve(), found_by="the target environment")
    return None


def gemm_skip_reason(cuda: Cuda, cutlass: Optional[Cutlass]) -> Optional[str]:
    """Why moe_ep.moe._gemm is not built with this toolkit and these headers, or None when it is."""
    if cuda.version < GEMM_MIN_CUDA:
        need = ".".join(map(str, GEMM_MIN_CUDA))
        return f"nvcc is CUDA {cuda.version[0]}.{cuda.version[1]}, CUTLASS's sm90 grouped GEMM needs {need} or later"
    if cutlass is None:
        return (f"no CUTLASS headers (`pip install --no-deps nvidia-cutlass`, the headers suffice, or "
                f"{CUTLASS_DIR_ENV}=<cutlass checkout>)")
    return None
