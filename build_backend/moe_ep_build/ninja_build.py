"""Compiles moe_ep.comm._C: writes a build.ninja (an nvcc -rdc compile of every csrc/ source outside csrc/gemm/,
then one nvcc link that device-links them with libnvshmem_device.a and host-links against libnvshmem_host.so.3)
and runs ninja on it.

Rebuilds are incremental across pip's isolated builds: pybind11 and NVSHMEM live in a temporary
environment that changes with every `pip install .`, so their headers and libraries are first
copied into build_dir/deps/ (a file only when its content changed, so its mtime moves only then),
and build.ninja names only those stable copies. A second install that changes nothing compiles
and links nothing ("ninja: no work to do.")."""
from __future__ import annotations

import filecmp
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, replace
from pathlib import Path

from .toolchain import Cuda, Nvshmem

EXTRA_FLAGS_ENV = "MOE_EP_NVCC_FLAGS"
# csrc/ folders that build a module of their own (gemm: moe_ep.moe._gemm, see gemm_build.py), never linked into _C.
SEPARATE_MODULE_DIRS = ("gemm",)
# Where an installed moe_ep/comm/_C finds the NVSHMEM wheel's library when imported without moe_ep.comm._native
# (which preloads it): site-packages/moe_ep/comm/../../nvidia/nvshmem/lib. Relative, so it never points into
# the temporary environment of an isolated build.
NVSHMEM_RPATH = "$ORIGIN/../../nvidia/nvshmem/lib"


@dataclass(frozen=True)
class NativeBuild:
    """Everything one build of moe_ep.comm._C needs; every path it puts into build.ninja is under
    build_dir, csrc, the CUDA toolkit or the interpreter, so it is the same from build to build."""

    cuda: Cuda
    nvshmem: Nvshmem
    archs: list[str]
    csrc: Path
    build_dir: Path
    output: Path  # where setuptools wants the module; ninja builds `module` and it is copied here

    @property
    def sources(self) -> list[Path]:
        """Every .cu and .cpp under csrc except the folders of the other modules (SEPARATE_MODULE_DIRS)."""
        return sorted(p for p in self.csrc.rglob("*") if p.suffix in (".cu", ".cpp")
                      and p.relative_to(self.csrc).parts[0] not in SEPARATE_MODULE_DIRS)

    @property
    def deps_dir(self) -> Path:
        """Stable copies of the headers and libraries that come from the (temporary) build environment."""
        return self.build_dir / "deps"

    @property
    def staged_nvshmem(self) -> Nvshmem:
        """The NVSHMEM wheel as copied into deps_dir: the headers and libraries build.ninja names."""
        return replace(self.nvshmem, root=self.deps_dir / "nvshmem")

    @property
    def pybind11_include(self) -> Path:
        return self.deps_dir / "pybind11" / "include"

    @property
    def module(self) -> Path:
        """The linked module inside build_dir, independent of where setuptools puts its copy."""
        return self.build_dir / self.output.name

    @property
    def arch_flags(self) -> list[str]:
        return [f"-gencode=arch=compute_{a},code=sm_{a}" for a in self.archs]

    @property
    def compile_flags(self) -> list[str]:
        includes = [self.csrc, self.staged_nvshmem.include_dir, self.pybind11_include,
                    Path(sysconfig.get_paths()["include"])]
        return (["-rdc=true", "-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden"]
                + self.arch_flags + [f"-I{d}" for d in includes]
                + shlex.split(os.environ.get(EXTRA_FLAGS_ENV, "")))


def _same_file(a: Path, b: Path) -> bool:
    return b.is_file() and a.stat().st_size == b.stat().st_size and filecmp.cmp(a, b, shallow=False)


def sync_file(src: Path, dst: Path) -> bool:
    """Copies src to dst (through a new file renamed over dst) unless dst already has the same bytes;
    returns whether it copied."""
    if _same_file(src, dst):
        return False
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)
    return True


def sync_tree(src: Path, dst: Path) -> int:
    """Makes dst a copy of the tree src, rewriting only the files whose content differs and removing
    files src no longer has; returns how many files it wrote or removed."""
    wanted = {p.relative_to(src) for p in src.rglob("*") if p.is_file()}
    changed = sum(sync_file(src / rel, dst / rel) for rel in sorted(wanted))
    if dst.is_dir():
        for p in sorted(dst.rglob("*"), reverse=True):
            if p.is_file() and p.relative_to(dst) not in wanted:
                p.unlink()
                changed += 1
    return changed


def stage_deps(build: NativeBuild) -> int:
    """Copies pybind11's and NVSHMEM's headers and the two NVSHMEM libraries the link needs into
    build.deps_dir; returns how many files changed there (0 on a rebuild in an unchanged environment)."""
    import pybind11

    wheel, staged = build.nvshmem, build.staged_nvshmem
    return (sync_tree(Path(pybind11.get_include()), build.pybind11_include)
            + sync_tree(wheel.include_dir, staged.include_dir)
            + sync_file(wheel.device_library, staged.device_library)
            + sync_file(wheel.host_library, staged.host_library))


def _quote(args: list[object]) -> str:
    """Shell-quote for a ninja command line ($ is ninja's escape character)."""
    return " ".join(shlex.quote(str(a)) for a in args).replace("$", "$$")


def ninja_file(*, variables: dict[str, list[object]], link_command: str, link_description: str, csrc: Path,
               sources: list[Path], build_dir: Path, module: Path, link_inputs: tuple[Path, ...] = ()) -> str:
    """A build.ninja with one nvcc compile per source ($nvcc $cflags, objects under build_dir/obj/) and one link
    of them into `module` by `link_command`; `link_inputs` are the link's implicit inputs (they relink on change).
    `variables` are ninja variables (shell-quoted) that the commands name."""
    lines = ["ninja_required_version = 1.3"] + [f"{name} = {_quote(value)}" for name, value in variables.items()] + [
        "",
        "rule compile",
        "  command = $nvcc $cflags -MD -MF $out.d -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = nvcc $in",
        "",
        "rule link",
        f"  command = {link_command}",
        f"  description = {link_description}",
        "",
    ]
    objects = []
    for src in sources:
        obj = build_dir / "obj" / src.relative_to(csrc).with_suffix(src.suffix + ".o")
        objects.append(obj)
        lines.append(f"build {_ninja_path(obj)}: compile {_ninja_path(src)}")
    implicit = f" | {' '.join(_ninja_path(p) for p in link_inputs)}" if link_inputs else ""
    lines.append(f"build {_ninja_path(module)}: link {' '.join(_ninja_path(o) for o in objects)}{implicit}")
    lines.append(f"default {_ninja_path(module)}")
    return "\n".join(lines) + "\n"


def ninja_text(build: NativeBuild) -> str:
    """The build.ninja for `build`: one compile per source, one link; the libraries are implicit
    inputs of the link, so a changed NVSHMEM relinks."""
    nvshmem = build.staged_nvshmem
    variables: dict[str, list[object]] = {
        "nvcc": [build.cuda.nvcc],
        "cflags": build.compile_flags,
        "archflags": build.arch_flags,
        "devlib": [nvshmem.device_library],
        "hostlib": ["-Xlinker", nvshmem.host_library],
        "rpath": ["-Xlinker", "-rpath", "-Xlinker", NVSHMEM_RPATH],
    }
    return ninja_file(variables=variables,
                      link_command="$nvcc -shared -rdc=true $archflags $in $devlib $hostlib $rpath -o $out",
                      link_description="device link + link $out", csrc=build.csrc, sources=build.sources,
                      build_dir=build.build_dir, module=build.module,
                      link_inputs=(nvshmem.device_library, nvshmem.host_library))


def write_ninja(build_dir: Path, text: str) -> Path:
    """Writes build_dir/build.ninja (only when its text changed) and returns its path."""
    build_dir.mkdir(parents=True, exist_ok=True)
    path = build_dir / "build.ninja"
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    return path


def run_ninja(build_dir: Path) -> None:
    """Runs ninja on build_dir/build.ninja with jobs() parallel compiles."""
    subprocess.run([_ninja_executable(), "-C", str(build_dir), "-j", str(jobs())], check=True)


def _ninja_path(path: Path) -> str:
    """A path in a ninja build statement, where '$', ' ' and ':' need a '$' escape."""
    return str(path).replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def _ninja_executable() -> str:
    found = shutil.which("ninja")
    if found:
        return found
    import ninja

    return str(Path(ninja.BIN_DIR) / "ninja")


def jobs() -> int:
    """Parallel compiles: $MAX_JOBS, else ninja's own default, two more than the CPUs this process may use
    (an nvcc compile is a chain of single-threaded tools that also wait on files)."""
    if os.environ.get("MAX_JOBS"):
        return int(os.environ["MAX_JOBS"])
    return (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)) + 2


def run(build: NativeBuild) -> None:
    """Builds build.module incrementally (ninja keeps its state in build_dir) and copies it to build.output."""
    staged = stage_deps(build)
    write_ninja(build.build_dir, ninja_text(build))
    print(f"moe_ep: building moe_ep.comm._C in {build.build_dir} with {jobs()} parallel jobs "
          f"({staged} dependency files changed)", file=sys.stderr, flush=True)
    run_ninja(build.build_dir)
    sync_file(build.module, build.output)  # a new file, never rewritten in place under a process that maps it


def write_build_info(build: NativeBuild, path: Path) -> None:
    """Records what _C was built against; moe_ep.comm._native checks the installed NVSHMEM against it."""
    info = {
        "cuda_version": list(build.cuda.version),
        "cuda_archs": build.archs,
        "nvshmem_dist": build.nvshmem.dist,
        "nvshmem_dist_version": build.nvshmem.dist_version,
        "nvshmem_version": list(build.nvshmem.header_version),
    }
    path.write_text(json.dumps(info, indent=2) + "\n")
