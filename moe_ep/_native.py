"""Loads moe_ep._C safely: preloads the NVSHMEM host library from its wheel and checks that the
installed NVSHMEM is the one _C was built against, so a mismatch is an error naming both versions
rather than a crash inside NVSHMEM."""
from __future__ import annotations

import ctypes
import functools
import importlib
import importlib.metadata
import json
from pathlib import Path
from types import ModuleType
from typing import Any

PACKAGE_DIR = Path(__file__).resolve().parent
BUILD_INFO = PACKAGE_DIR / "_build_info.json"
HOST_LIBRARY = "libnvshmem_host.so.3"


class NativeUnavailableError(RuntimeError):
    """moe_ep._C cannot be used here; the message says why."""


def build_info() -> dict[str, Any] | None:
    """What _C was built against (written by setup.py next to it), or None when it was not built."""
    if not BUILD_INFO.is_file():
        return None
    return json.loads(BUILD_INFO.read_text())


def _version_text(version: Any) -> str:
    return ".".join(str(v) for v in version)


def nvshmem_host_library(dist: str) -> Path:
    """Path of libnvshmem_host.so.3 inside the installed NVSHMEM wheel `dist`."""
    try:
        distribution = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        raise NativeUnavailableError(f"moe_ep._C needs the {dist} wheel, which is not installed") from None
    path = Path(str(distribution.locate_file("nvidia/nvshmem/lib"))) / HOST_LIBRARY
    if not path.is_file():
        raise NativeUnavailableError(f"{dist} {distribution.version} is installed but {path} is missing")
    return path


def _import_checked() -> ModuleType:
    info = build_info()
    if info is None:
        raise NativeUnavailableError(
            f"moe_ep._C is not built ({BUILD_INFO.name} is missing in {PACKAGE_DIR}): the install found no CUDA "
            "compiler; reinstall with nvcc on PATH or CUDA_HOME set")
    dist, built = info["nvshmem_dist"], info["nvshmem_dist_version"]
    library = nvshmem_host_library(dist)
    installed = importlib.metadata.version(dist)
    if installed != built:
        raise NativeUnavailableError(
            f"moe_ep._C was built against {dist} {built} but {installed} is installed: "
            f"pip install {dist}=={built}, or rebuild moe_ep")
    try:
        ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    except OSError as err:
        raise NativeUnavailableError(f"cannot load {library}: {err}") from err
    try:
        module = importlib.import_module("moe_ep._C")
    except ImportError as err:
        raise NativeUnavailableError(f"moe_ep._C does not import: {err}") from err
    build_version, runtime_version = tuple(module.build_version()), tuple(module.runtime_version())
    if build_version != runtime_version:
        raise NativeUnavailableError(
            f"moe_ep._C was compiled with NVSHMEM {_version_text(build_version)} but {library} is NVSHMEM "
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
    """The moe_ep._C module; raises NativeUnavailableError saying why it cannot be used."""
    result = _load()
    if isinstance(result, str):
        raise NativeUnavailableError(result)
    return result


def available() -> tuple[bool, str]:
    """(True, "") when moe_ep._C loads, else (False, why)."""
    result = _load()
    return (False, result) if isinstance(result, str) else (True, "")
