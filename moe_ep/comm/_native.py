"""Loads moe_ep.comm._C safely: preloads the NVSHMEM host library from its wheel and checks that the
installed NVSHMEM is the one _C was built against, so a mismatch is an error naming both versions
rather than a crash inside NVSHMEM."""
from __future__ import annotations

import ctypes
import functools
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

PACKAGE_DIR = Path(__file__).resolve().parent
BUILD_INFO = PACKAGE_DIR / "_build_info.json"
HOST_LIBRARY = "libnvshmem_host.so.3"
# Limits and format constants compiled into the kernels, for Python to validate against and lay data out by.
# `constant` reads them from moe_ep.comm._C where it loads and exports them; these fallbacks, equal to the C++
# values (tests/test_native.py checks), serve the pure-Python install, so that the reference backend accepts
# what the kernels do and returns what they return.
FALLBACK_CONSTANTS = {
    "MAX_TOPK": 16,  # top-k entries per token, every path (csrc/runtime/limits.h kMaxTopk)
    "MAX_NODE_RANKS": 8,  # ranks of one NVLink domain (csrc/runtime/limits.h kMaxNodeRanks)
    "MAX_RANKS_PER_GPU": 48,  # NVSHMEM PEs sharing one GPU (csrc/runtime/limits.h kMaxRanksPerGpu)
    "INTERNODE_MAX_CHANNELS": 64,  # SMs (channels) of a cross-node call (csrc/kernels/internode/internode.h kMaxChannels)
    "LL_META_BYTES": 48,  # one staged low-latency token's meta row (csrc/kernels/low_latency/low_latency.h kMetaBytes)
    "TUNING_MAX_WARPS": 32,  # warps of a normal-mode dispatch / combine block (csrc/kernels/intranode/intranode.h kHostWarps)
    "TUNING_UNROLL_MASK": 0b1010000,  # Config.unroll values, bit u for u (csrc/kernels/intranode/intranode.h kUnrollValues)
    # NVFP4 rows and their scale tiles (csrc/kernels/low_latency/low_latency.h kNvfp4*; moe_ep/comm/nvfp4.py)
    "NVFP4_BLOCK": 16,
    "NVFP4_E2M1_MAX": 6,
    "NVFP4_TILE_ROWS": 128,
    "NVFP4_TILE_GROUP_ROWS": 32,
    "NVFP4_TILE_SCALES": 4,
}
REBUILD = ("reinstall with `python -m pip install .` (offline: `python -m pip install --no-build-isolation "
           "--no-deps -e .`) and read the build's output")


class NativeUnavailableError(RuntimeError):
    """moe_ep.comm._C cannot be used here; the message says why."""


def build_info() -> dict[str, Any] | None:
    """What _C was built against (written by setup.py next to it), or None when it was not built."""
    if not BUILD_INFO.is_file():
        return None
    return json.loads(BUILD_INFO.read_text())


def find_nvcc() -> Path | None:
    """The nvcc the build would use: $CUDA_HOME/bin/nvcc, else nvcc on PATH (as moe_ep_build.toolchain)."""
    home = os.environ.get("CUDA_HOME")
    if home and (Path(home) / "bin" / "nvcc").is_file():
        return Path(home) / "bin" / "nvcc"
    found = shutil.which("nvcc")
    return Path(found) if found else None


def extension_file() -> Path | None:
    """The compiled moe_ep.comm._C file, found without importing it, or None."""
    spec = importlib.util.find_spec("moe_ep.comm._C")
    return Path(spec.origin) if spec is not None and spec.origin else None


def _not_built() -> str:
    """Why there is no usable build: the build records success by writing BUILD_INFO next to _C, so
    without it either the install had no nvcc (and built nothing) or the build failed."""
    missing = f"{BUILD_INFO.name} is missing in {PACKAGE_DIR}"
    extension = extension_file()
    if extension is not None:
        return f"moe_ep.comm._C is not built completely ({extension.name} is there but {missing}): {REBUILD}"
    nvcc = find_nvcc()
    if nvcc is not None:
        return (f"moe_ep.comm._C is not built ({missing}) although nvcc is here ({nvcc}): it was installed with "
                f"MOE_EP_NATIVE=0 (or --config-settings native=0), its build failed, or moe_ep was installed before "
                f"nvcc was; {REBUILD}")
    return (f"moe_ep.comm._C is not built ({missing}): the install found no CUDA compiler; reinstall with nvcc on PATH "
            "or CUDA_HOME set")


def _version_text(version: Any) -> str:
    return ".".join(str(v) for v in version)


def nvshmem_host_library(dist: str) -> Path:
    """Path of libnvshmem_host.so.3 inside the installed NVSHMEM wheel `dist`."""
    try:
        distribution = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        raise NativeUnavailableError(f"moe_ep.comm._C needs the {dist} wheel, which is not installed") from None
    path = Path(str(distribution.locate_file("nvidia/nvshmem/lib"))) / HOST_LIBRARY
    if not path.is_file():
        raise NativeUnavailableError(f"{dist} {distribution.version} is installed but {path} is missing")
    return path


def _import_checked() -> ModuleType:
    info = build_info()
    if info is None:
        raise NativeUnavailableError(_not_built())
    if extension_file() is None:
        raise NativeUnavailableError(
            f"moe_ep.comm._C is missing in {PACKAGE_DIR} although {BUILD_INFO.name} says it was built: the build failed "
            f"or _C was removed; {REBUILD}")
    dist, built = info["nvshmem_dist"], info["nvshmem_dist_version"]
    library = nvshmem_host_library(dist)
    installed = importlib.metadata.version(dist)
    if installed != built:
        raise NativeUnavailableError(
            f"moe_ep.comm._C was built against {dist} {built} but {installed} is installed: "
            f"python -m pip install {dist}=={built}, or rebuild moe_ep")
    try:
        ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    except OSError as err:
        raise NativeUnavailableError(f"cannot load {library}: {err}") from err
    try:
        module = importlib.import_module("moe_ep.comm._C")
    except ImportError as err:
        raise NativeUnavailableError(f"moe_ep.comm._C was built but does not import ({err}): the build is broken or "
                                     f"incomplete; {REBUILD}") from err
    build_version, runtime_version = tuple(module.build_version()), tuple(module.runtime_version())
    if build_version != runtime_version:
        raise NativeUnavailableError(
            f"moe_ep.comm._C was compiled with NVSHMEM {_version_text(build_version)} but {library} is NVSHMEM "
            f"{_version_text(runtime_version)}")
    return module


@functools.lru_cache(maxsize=None)
def _load() -> ModuleType | str:
    """The module, or why it cannot be used (checked once per process)."""
    try:
        return _import_checked()
    except NativeUnavailableError as err:
        return str(err)


def load() -> ModuleType:
    """The moe_ep.comm._C module; raises NativeUnavailableError saying why it cannot be used."""
    result = _load()
    if isinstance(result, str):
        raise NativeUnavailableError(result)
    return result


def available() -> tuple[bool, str]:
    """(True, "") when moe_ep.comm._C loads, else (False, why)."""
    result = _load()
    return (False, result) if isinstance(result, str) else (True, "")


def constant(name: str) -> int:
    """A limit shared with the kernels (a key of FALLBACK_CONSTANTS): moe_ep.comm._C's value where _C loads
    and exports it, else the fallback."""
    fallback = FALLBACK_CONSTANTS[name]
    ok, _ = available()
    return int(getattr(load(), name, fallback)) if ok else fallback
