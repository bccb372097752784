"""Compiles moe_ep.moe._gemm, the FP8 grouped GEMM on CUTLASS (csrc/gemm/), apart from moe_ep.comm._C: plain nvcc
compiles for sm_90a (WGMMA and the TMA descriptor updates need the arch-specific target), no -rdc, no NVSHMEM,
then one shared-library link. Incremental like the _C build: pybind11's headers are copied from the (possibly
temporary) build environment into build_dir/deps/ only when they change; CUTLASS's headers are named where they
are installed (the target environment, or $MOE_EP_CUTLASS_DIR), which outlives the build."""
from __future__ import annotations

import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from .ninja_build import _ninja_executable, _ninja_path, _quote, jobs, sync_file, sync_tree
from .toolchain import Cuda, Cutlass

MODULE = "moe_ep.moe._gemm"
SOURCE_DIR = "gemm"  # under csrc/; ninja_build.NativeBuild leaves it out of _C
ARCH_FLAGS = ["-gencode=arch=compute_90a,code=sm_90a"]


@dataclass(frozen=True)
class GemmBuild:
    """One build of moe_ep.moe._gemm: every path in its build.ninja is under build_dir, csrc, the CUDA toolkit,
    the CUTLASS headers or the interpreter."""

    cuda: Cuda
    cutlass: Cutlass
    csrc: Path
    build_dir: Path
    output: Path  # where setuptools wants the module; ninja builds `module` and it is copied here

    @property
    def sources(self) -> list[Path]:
        return sorted(p for p in (self.csrc / SOURCE_DIR).rglob("*") if p.suffix in (".cu", ".cpp"))

    @property
    def pybind11_include(self) -> Path:
        return self.build_dir / "deps" / "pybind11" / "include"

    @property
    def module(self) -> Path:
        return self.build_dir / self.output.name

    @property
    def compile_flags(self) -> list[str]:
        includes = [self.csrc, self.cutlass.include_dir, self.pybind11_include, Path(sysconfig.get_paths()["include"])]
        return (["-O3", "-std=c++17", "-DNDEBUG", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC", "-Xcompiler",
                 "-fvisibility=hidden"] + ARCH_FLAGS + [f"-I{d}" for d in includes])


def ninja_text(build: GemmBuild) -> str:
    """The build.ninja for `build`: one compile per source, one link."""
    lines = [
        "ninja_required_version = 1.3",
        f"nvcc = {_quote([build.cuda.nvcc])}",
        f"cflags = {_quote(build.compile_flags)}",
        f"archflags = {_quote(ARCH_FLAGS)}",
        "",
        "rule compile",
        "  command = $nvcc $cflags -MD -MF $out.d -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = nvcc $in",
        "",
        "rule link",
        "  command = $nvcc -shared $archflags $in -o $out",
        "  description = link $out",
        "",
    ]
    objects = []
    for src in build.sources:
        obj = build.build_dir / "obj" / src.relative_to(build.csrc).with_suffix(src.suffix + ".o")
        objects.append(obj)
        lines.append(f"build {_ninja_path(obj)}: compile {_ninja_path(src)}")
    lines.append(f"build {_ninja_path(build.module)}: link {' '.join(_ninja_path(o) for o in objects)}")
    lines.append(f"default {_ninja_path(build.module)}")
    return "\n".join(lines) + "\n"


def run(build: GemmBuild) -> None:
    """Builds build.module incrementally and copies it to build.output."""
    import pybind11

    staged = sync_tree(Path(pybind11.get_include()), build.pybind11_include)
    build.build_dir.mkdir(parents=True, exist_ok=True)
    path = build.build_dir / "build.ninja"
    text = ninja_text(build)
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    print(f"moe_ep: building {MODULE} (sm_90a) in {build.build_dir} with {jobs()} parallel jobs, CUTLASS from "
          f"{build.cutlass.found_by} ({build.cutlass.include_dir}; {staged} dependency files changed)",
          file=sys.stderr, flush=True)
    subprocess.run([_ninja_executable(), "-C", str(build.build_dir), "-j", str(jobs())], check=True)
    sync_file(build.module, build.output)
