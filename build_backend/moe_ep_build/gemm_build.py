"""Compiles moe_ep.moe._gemm, the FP8 grouped GEMM on CUTLASS (csrc/gemm/), apart from moe_ep.comm._C: plain nvcc
compiles for sm_90a (WGMMA and the TMA descriptor updates need the arch-specific target), no -rdc, no NVSHMEM,
then one shared-library link. Incremental like the _C build: pybind11's headers are copied from the (possibly
temporary) build environment into build_dir/deps/ only when they change; CUTLASS's headers are named where they
are installed (the target environment, or $MOE_EP_CUTLASS_DIR), which outlives the build."""
from __future__ import annotations

import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from .ninja_build import jobs, ninja_file, run_ninja, sync_file, sync_tree, write_ninja
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
    variables: dict[str, list[object]] = {"nvcc": [build.cuda.nvcc], "cflags": build.compile_flags,
                                          "archflags": ARCH_FLAGS}
    return ninja_file(variables=variables, link_command="$nvcc -shared $archflags $in -o $out",
                      link_description="link $out", csrc=build.csrc, sources=build.sources,
                      build_dir=build.build_dir, module=build.module)


def run(build: GemmBuild) -> None:
    """Builds build.module incrementally and copies it to build.output."""
    import pybind11

    staged = sync_tree(Path(pybind11.get_include()), build.pybind11_include)
    write_ninja(build.build_dir, ninja_text(build))
    print(f"moe_ep: building {MODULE} (sm_90a) in {build.build_dir} with {jobs()} parallel jobs, CUTLASS from "
          f"{build.cutlass.found_by} ({build.cutlass.include_dir}; {staged} dependency files changed)",
          file=sys.stderr, flush=True)
    run_ninja(build.build_dir)
    sync_file(build.module, build.output)
