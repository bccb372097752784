"""PEP 517 backend: setuptools.build_meta, plus the build requirements of moe_ep.comm._C.

When nvcc is present the build also needs pybind11, ninja and the NVSHMEM wheel matching nvcc's CUDA
major version. That wheel is pinned to the version the target environment already has (torch pins
one exactly), so the module is compiled against the same NVSHMEM it will load; see
`nvshmem_requirement`. moe_ep.moe._gemm (csrc/gemm/, CUTLASS) is built besides when CUTLASS's headers are found
(toolchain.find_cutlass: $MOE_EP_CUTLASS_DIR, else an installed nvidia-cutlass wheel, in the build environment or
the target one), else the build says in one line why it is skipped; nvidia-cutlass is no build requirement, since
its dependencies (cuda-python, scipy, networkx, ...) would come into every isolated build for headers alone. Without nvcc the build says, in one line, that it installs without _C; with nvcc but no GPU, it
says first what it compiles for and how to skip that.

`--config-settings native=0|1|auto` (pip) sets $MOE_EP_NATIVE for the hooks of that one install
(see toolchain.build_cuda): 0 skips the native build even where nvcc is, 1 fails without nvcc.
"""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Any, Optional

from setuptools import build_meta as _setuptools
from setuptools.build_meta import build_sdist, get_requires_for_build_sdist  # served by setuptools unchanged

from .toolchain import NATIVE_ENV, build_cuda, cuda_archs, find_cutlass, gemm_skip_reason, native_mode

__all__ = [
    "build_editable", "build_sdist", "build_wheel", "get_requires_for_build_editable",
    "get_requires_for_build_sdist", "get_requires_for_build_wheel", "prepare_metadata_for_build_editable",
    "prepare_metadata_for_build_wheel",
]

NVSHMEM_VERSION_ENV = "MOE_EP_NVSHMEM_VERSION"

# Run by the target environment's interpreter: the installed version of the NVSHMEM wheel, else the
# version the installed torch requires, else nothing.
_TARGET_ENV_QUERY = r"""
import importlib.metadata as md, re, sys
dist = sys.argv[1]
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
try:
    print(md.version(dist))
except md.PackageNotFoundError:
    try:
        reqs = md.requires("torch") or []
    except md.PackageNotFoundError:
        reqs = []
    for req in reqs:
        m = re.match(r"\s*([A-Za-z0-9_.-]+)\s*==\s*([^\s;,]+)", req)
        if m and norm(m[1]) == norm(dist):
            print(m[2])
            break
"""


def _target_env_version(dist: str) -> Optional[str]:
    """The NVSHMEM version the environment being installed into has or needs.

    pip runs this backend in an isolated environment whose PYTHONPATH hides the target's packages;
    the same interpreter without that PYTHONPATH sees them.
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", _TARGET_ENV_QUERY, dist], capture_output=True, text=True,
                         env=env, check=False).stdout.strip()
    return out or None


def nvshmem_requirement(dist: str) -> str:
    """`dist==V` with V from $MOE_EP_NVSHMEM_VERSION or the target environment, else plain `dist`."""
    version = os.environ.get(NVSHMEM_VERSION_ENV) or _target_env_version(dist)
    return f"{dist}=={version}" if version else dist


def _native_requirements() -> list[str]:
    """What the build environment needs besides setuptools: nothing when this install builds no _C."""
    cuda = build_cuda()
    if cuda is None:
        return []
    return ["pybind11>=2.12", "ninja", nvshmem_requirement(cuda.nvshmem_dist)]


ConfigSettings = Optional[dict[str, Any]]


def _take_native_setting(config_settings: ConfigSettings) -> ConfigSettings:
    """Moves the `native` config setting into $MOE_EP_NATIVE (setup.py runs in this process and
    reads it there) and returns the settings setuptools should see."""
    if not config_settings or "native" not in config_settings:
        return config_settings
    rest = dict(config_settings)
    os.environ[NATIVE_ENV] = str(rest.pop("native"))
    return rest or None


def _has_gpu() -> bool:
    """An NVIDIA GPU is visible to this machine's driver (no CUDA call: the build may run without one)."""
    gpus = "/proc/driver/nvidia/gpus"
    return os.path.isdir(gpus) and bool(os.listdir(gpus))


def _say_native_build_without_gpu() -> None:
    """One line on stderr, before the build requirements are fetched, when _C will be compiled on a machine
    without a GPU: what it compiles for, that it takes minutes, and how to skip it."""
    if build_cuda() is not None and not _has_gpu():
        archs = ", ".join(f"sm_{a}" for a in cuda_archs())
        print(f"moe_ep: no GPU here, but nvcc is: compiling moe_ep.comm._C for {archs} (minutes on a small machine; "
              f"the reference backend needs none of it). To skip it: {NATIVE_ENV}=0 pip install .", file=sys.stderr,
              flush=True)


def get_requires_for_build_wheel(config_settings: ConfigSettings = None) -> list[str]:
    """setuptools' build requirements plus, when _C is built, pybind11, ninja and the NVSHMEM wheel."""
    config_settings = _take_native_setting(config_settings)
    _say_native_build_without_gpu()
    return _setuptools.get_requires_for_build_wheel(config_settings) + _native_requirements()


def get_requires_for_build_editable(config_settings: ConfigSettings = None) -> list[str]:
    """As get_requires_for_build_wheel, for `pip install -e`."""
    config_settings = _take_native_setting(config_settings)
    _say_native_build_without_gpu()
    return _setuptools.get_requires_for_build_editable(config_settings) + _native_requirements()


def prepare_metadata_for_build_wheel(metadata_directory: str, config_settings: ConfigSettings = None) -> str:
    """The metadata's dependencies (the NVSHMEM pin) depend on whether _C is built, hence the setting."""
    return _setuptools.prepare_metadata_for_build_wheel(metadata_directory, _take_native_setting(config_settings))


def prepare_metadata_for_build_editable(metadata_directory: str, config_settings: ConfigSettings = None) -> str:
    """As prepare_metadata_for_build_wheel, for `pip install -e`."""
    return _setuptools.prepare_metadata_for_build_editable(metadata_directory, _take_native_setting(config_settings))


def _say_if_pure_python() -> None:
    """One line on stderr when this install builds no _C, and why."""
    if build_cuda() is None:
        why = f"{NATIVE_ENV}=0" if native_mode() == "off" else "no nvcc ($CUDA_HOME/bin/nvcc or on PATH)"
        print(f"moe_ep: {why}: installing without moe_ep.comm._C (reference backend only)", file=sys.stderr)


def _say_if_no_gemm() -> None:
    """One line on stderr when _C is built but moe_ep.moe._gemm (the CUTLASS FP8 grouped GEMM) is not, and why."""
    cuda = build_cuda()
    if cuda is not None:
        why = gemm_skip_reason(cuda, find_cutlass())
        if why is not None:
            print(f"moe_ep: {why}: skipping moe_ep.moe._gemm (the Triton FP8 grouped GEMM serves)", file=sys.stderr)


def build_wheel(wheel_directory: str, config_settings: ConfigSettings = None,
                metadata_directory: Optional[str] = None) -> str:
    """setuptools' wheel, after the native setting is applied (setup.py builds _C through ninja)."""
    config_settings = _take_native_setting(config_settings)
    _say_if_pure_python()
    _say_if_no_gemm()
    return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory: str, config_settings: ConfigSettings = None,
                   metadata_directory: Optional[str] = None) -> str:
    """As build_wheel, for `pip install -e`."""
    config_settings = _take_native_setting(config_settings)
    _say_if_pure_python()
    _say_if_no_gemm()
    return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
