"""Compiles moe_ep._C: writes a build.ninja (an nvcc -rdc compile of every csrc/ source, then one nvcc
link that device-links them with libnvshmem_device.a and host-links against libnvshmem_host.so.3)
and runs ninja on it."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from .toolchain import Cuda, Nvshmem

EXTRA_FLAGS_ENV = "MOE_EP_NVCC_FLAGS"
# Where an installed moe_ep/_C finds the NVSHMEM wheel's library when imported without moe_ep._native
# (which preloads it): site-packages/moe_ep/../nvidia/nvshmem/lib. Relative, so it never points into
# the temporary environment of an isolated build.
NVSHMEM_RPATH = "$ORIGIN/../nvidia/nvshmem/lib"


@dataclass(frozen=True)
class NativeBuild:
    """Everything one build of moe_ep._C needs."""

    cuda: Cuda
    nvshmem: Nvshmem
    archs: list[str]
    csrc: Path
    build_dir: Path
    output: Path

    @property
    def sources(self) -> list[Path]:
        return sorted(p for p in self.csrc.rglob("*") if p.suffix in (".cu", ".cpp"))

    @property
    def arch_flags(self) -> list[str]:
        return [f"-gencode=arch=compute_{a},code=sm_{a}" for a in self.archs]

    @property
    def compile_flags(self) -> list[str]:
        import pybind11

        includes = [self.csrc, self.nvshmem.include_dir, Path(pybind11.get_include()),
                    Path(sysconfig.get_paths()["include"])]
        return (["-rdc=true", "-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden"]
                + self.arch_flags + [f"-I{d}" for d in includes]
                + shlex.split(os.environ.get(EXTRA_FLAGS_ENV, "")))


def _quote(args: list[str]) -> str:
    """Shell-quote for a ninja command line ($ is ninja's escape character)."""
    return " ".join(shlex.quote(str(a)) for a in args).replace("$", "$$")


def write_ninja(build: NativeBuild) -> Path:
    """Writes build_dir/build.ninja and returns its path."""
    build.build_dir.mkdir(parents=True, exist_ok=True)
    lib = build.nvshmem.device_library
    lines = [
        "ninja_required_version = 1.3",
        f"nvcc = {_quote([build.cuda.nvcc])}",
        f"cflags = {_quote(build.compile_flags)}",
        f"archflags = {_quote(build.arch_flags)}",
        f"devlib = {_quote([lib])}",
        f"hostlib = {_quote(['-Xlinker', build.nvshmem.host_library])}",
        f"rpath = {_quote(['-Xlinker', '-rpath', '-Xlinker', NVSHMEM_RPATH])}",
        "",
        "rule compile",
        "  command = $nvcc $cflags -MD -MF $out.d -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = nvcc $in",
        "",
        "rule link",
        "  command = $nvcc -shared -rdc=true $archflags $in $devlib $hostlib $rpath -o $out",
        "  description = device link + link $out",
        "",
    ]
    objects = []
    for src in build.sources:
        obj = build.build_dir / "obj" / src.relative_to(build.csrc).with_suffix(src.suffix + ".o")
        objects.append(obj)
        lines.append(f"build {_ninja_path(obj)}: compile {_ninja_path(src)}")
    lines.append(f"build {_ninja_path(build.output)}: link {' '.join(_ninja_path(o) for o in objects)}")
    lines.append(f"default {_ninja_path(build.output)}")
    path = build.build_dir / "build.ninja"
    path.write_text("\n".join(lines) + "\n")
    return path


def _ninja_path(path: Path) -> str:
    """A path in a ninja build statement, where '$', ' ' and ':' need a '$' escape."""
    return str(path).replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def _ninja_executable() -> str:
    found = shutil.which("ninja")
    if found:
        return found
    import ninja

    return str(Path(ninja.BIN_DIR) / "ninja")


def run(build: NativeBuild) -> None:
    """Builds build.output (incrementally: ninja keeps its state in build_dir)."""
    write_ninja(build)
    build.output.parent.mkdir(parents=True, exist_ok=True)
    cmd = [_ninja_executable(), "-C", str(build.build_dir)]
    if os.environ.get("MAX_JOBS"):
        cmd += ["-j", os.environ["MAX_JOBS"]]
    subprocess.run(cmd, check=True)


def write_build_info(build: NativeBuild, path: Path) -> None:
    """Records what _C was built against; moe_ep._native checks the installed NVSHMEM against it."""
    info = {
        "cuda_version": list(build.cuda.version),
        "cuda_archs": build.archs,
        "nvshmem_dist": build.nvshmem.dist,
        "nvshmem_dist_version": build.nvshmem.dist_version,
        "nvshmem_version": list(build.nvshmem.header_version),
    }
    path.write_text(json.dumps(info, indent=2) + "\n")
