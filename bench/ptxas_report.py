"""Registers, stack and spills of every moe_ep kernel, as ptxas reports them for the real build.

Compiles every .cu file under a csrc tree (default: this checkout's csrc/) with nvcc and the flags
of the real build, taken from build_backend/moe_ep_build/ninja_build.py (NativeBuild.compile_flags:
-rdc=true -O3 -std=c++17, the GPU archs of $MOE_EP_CUDA_ARCH (default sm_90), -I<csrc>, the headers
of the installed NVSHMEM wheel (nvidia-nvshmem-cu<CUDA major>), $MOE_EP_NVCC_FLAGS), plus
`-Xptxas -v`, and prints a markdown table, one row per kernel (ptxas entry function):
kernel | registers | stack | spill stores | spill loads.

Kernel names are demangled with c++filt when it is on PATH, then shortened to namespace::name<template
arguments>: the return type, the argument list, "moe_ep::", anonymous namespaces and the file-hash
prefixes of -rdc statics are dropped, so a kernel keeps its name when its file moves. --compare
OTHER_CSRC compiles a second tree (the "before") and prints both side by side, matched by that name.
The flags come from this checkout's build backend for both trees, so only the sources differ.

Run it with the interpreter that has the NVSHMEM wheel (the build's venv), e.g.
    /work/venv/bin/python bench/ptxas_report.py --compare /tmp/old/csrc > bench/results/ptxas.md
Standard library only; needs nvcc (as the build finds it: $CUDA_HOME/bin/nvcc or PATH).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "build_backend"))

from moe_ep_build import ninja_build, toolchain  # noqa: E402

ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'")
PROPERTIES = re.compile(r"Function properties for (\S+)")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
REGISTERS = re.compile(r"Used (\d+) registers")
# -rdc prefixes a file-local (static or anonymous-namespace) symbol with its file's module id, and the
# anonymous namespace's mangled name carries it too: both change when the file moves.
RDC_STATIC = re.compile(r"^__nv_static_\d+__\w+?_cu_[0-9a-f]+_(?=_Z)")
ANONYMOUS = re.compile(r"(\(anonymous namespace\)|_GLOBAL__N__\w+?_cu_[0-9a-f]+)::")


@dataclass
class Kernel:
    """One entry function of one arch as ptxas reported it."""

    mangled: str
    arch: str
    source: Path
    registers: int | None = None
    stack: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    name: str = field(default="")


class _WheelHeaders(ninja_build.NativeBuild):
    """The real build's flags, but with the NVSHMEM headers read from the installed wheel instead of
    the build directory's staged copy (this script stages nothing)."""

    @property
    def staged_nvshmem(self) -> toolchain.Nvshmem:
        return self.nvshmem


def build_for(csrc: Path, scratch: Path) -> ninja_build.NativeBuild:
    """The NativeBuild of the real build for the tree `csrc`; scratch holds the objects."""
    cuda = toolchain.find_cuda()
    if cuda is None:
        raise SystemExit("nvcc not found ($CUDA_HOME/bin/nvcc or PATH)")
    nvshmem = toolchain.find_nvshmem(cuda.nvshmem_dist)
    if nvshmem is None:
        raise SystemExit(f"{cuda.nvshmem_dist} is not installed for {sys.executable}: run this with the build's venv")
    return _WheelHeaders(cuda=cuda, nvshmem=nvshmem, archs=toolchain.cuda_archs(), csrc=csrc.resolve(),
                         build_dir=scratch, output=scratch / "_C.so")


def parse_ptxas(text: str, source: Path) -> list[Kernel]:
    """The entry functions in one compile's ptxas -v output, in the order ptxas compiled them."""
    kernels: list[Kernel] = []
    current: Kernel | None = None
    properties_of = ""
    for line in text.splitlines():
        if m := ENTRY.search(line):
            current = Kernel(mangled=m[1], arch=m[2], source=source)
            kernels.append(current)
        elif m := PROPERTIES.search(line):
            properties_of = m[1]
        elif (m := FRAME.search(line)) and current is not None and properties_of == current.mangled:
            current.stack, current.spill_stores, current.spill_loads = (int(g) for g in m.groups())
        elif (m := REGISTERS.search(line)) and current is not None:
            current.registers = int(m[1])
            current = None  # the entry's report is complete; what follows belongs to other functions
    return kernels


def compile_one(build: ninja_build.NativeBuild, source: Path, scratch: Path) -> list[Kernel]:
    """Compiles `source` as the build does, plus -Xptxas -v; returns its kernels."""
    obj = scratch / (source.relative_to(build.csrc).as_posix().replace("/", "__") + ".o")
    cmd = [str(build.cuda.nvcc), *build.compile_flags, "-Xptxas", "-v", "-c", str(source), "-o", str(obj)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"nvcc failed on {source}:\n{done.stdout}{done.stderr}")
    return parse_ptxas(done.stdout + done.stderr, source.relative_to(build.csrc))


def demangle(names: list[str]) -> list[str]:
    """c++filt's demangling of each name (unchanged when c++filt is not on PATH)."""
    cxxfilt = shutil.which("c++filt")
    if cxxfilt is None or not names:
        return names
    out = subprocess.run([cxxfilt], input="\n".join(names) + "\n", capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    return lines if len(lines) == len(names) else names


def strip_arguments(name: str) -> str:
    """`void ns::f<8>(A, B)` -> `ns::f<8>`: drops a trailing balanced argument list, then everything up
    to the last space outside template brackets (the return type)."""
    if name.endswith(")"):
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                name = name[:i]
                break
    depth, start = 0, 0
    for i, ch in enumerate(name):
        depth += {"<": 1, ">": -1}.get(ch, 0)
        if ch == " " and depth == 0:
            start = i + 1
    return name[start:]


def short_name(demangled: str) -> str:
    """The matching key of a kernel: namespace::name<template arguments>, without moe_ep:: and
    anonymous namespaces."""
    name = strip_arguments(ANONYMOUS.sub("", demangled))
    return name.removeprefix("moe_ep::")


def kernels_of(csrc: Path, jobs: int) -> list[Kernel]:
    """Every kernel of every .cu file under csrc, named (short_name, plus the arch when several)."""
    with tempfile.TemporaryDirectory(prefix="ptxas_report_") as tmp:
        scratch = Path(tmp)
        build = build_for(csrc, scratch)
        sources = [p for p in build.sources if p.suffix == ".cu"]
        print(f"ptxas_report: {len(sources)} .cu files under {csrc}, {jobs} parallel nvcc", file=sys.stderr)
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            found = [k for ks in pool.map(lambda s: compile_one(build, s, scratch), sources) for k in ks]
    plain = [RDC_STATIC.sub("", k.mangled) for k in found]
    several_archs = len({k.arch for k in found}) > 1
    seen: dict[str, int] = {}
    for kernel, demangled in zip(found, demangle(plain)):
        name = short_name(demangled)
        if several_archs:
            name += f" [{kernel.arch}]"
        seen[name] = seen.get(name, 0) + 1
        kernel.name = name if seen[name] == 1 else f"{name} ({kernel.source})"
    return sorted(found, key=lambda k: k.name)


def _cell(value: int | None) -> str:
    return "?" if value is None else str(value)


def table(kernels: list[Kernel]) -> str:
    """The markdown table of one tree."""
    rows = ["| kernel | registers | stack | spill stores | spill loads |", "| --- | ---: | ---: | ---: | ---: |"]
    rows += [f"| `{k.name}` | {_cell(k.registers)} | {_cell(k.stack)} | {_cell(k.spill_stores)} | {_cell(k.spill_loads)} |"
             for k in kernels]
    return "\n".join(rows)


def _numbers(k: Kernel | None) -> tuple[int | None, ...]:
    return (None,) * 4 if k is None else (k.registers, k.stack, k.spill_stores, k.spill_loads)


def comparison(before: list[Kernel], after: list[Kernel]) -> str:
    """Both trees side by side, one row per kernel name (either tree), and a last column saying what changed."""
    old = {k.name: k for k in before}
    new = {k.name: k for k in after}
    header = "| kernel |" + "".join(f" {col} before | {col} after |"
                                    for col in ("registers", "stack", "spill stores", "spill loads")) + " change |"
    rows = [header, "| --- |" + " ---: |" * 8 + " --- |"]
    same = 0
    for name in sorted(old.keys() | new.keys()):
        a, b = _numbers(old.get(name)), _numbers(new.get(name))
        if name not in old:
            change = "only after"
        elif name not in new:
            change = "only before"
        elif a == b:
            change = "="
            same += 1
        else:
            change = ", ".join(f"{col} {x} -> {y}" for col, x, y in
                               zip(("registers", "stack", "spill stores", "spill loads"), a, b) if x != y)
        cells = "".join(f" {'-' if k is None else _cell(x)} |"
                        for pair in zip(a, b) for x, k in zip(pair, (old.get(name), new.get(name))))
        rows.append(f"| `{name}` |{cells} {change} |")
    rows.append("")
    rows.append(f"{len(old.keys() | new.keys())} kernels; {same} identical in both trees.")
    return "\n".join(rows)


def _git(csrc: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(csrc), *args], capture_output=True, text=True, check=True).stdout.strip()


def label_of(csrc: Path) -> str:
    """Which sources a tree holds: its checkout's short commit, the last commit that changed the csrc
    tree when that is an older one, and "+ uncommitted changes" when it has some; else just its path."""
    try:
        head = _git(csrc, "rev-parse", "--short", "HEAD")
        changed = _git(csrc, "log", "-1", "--format=%h", "--", ".")
        dirty = _git(csrc, "status", "--porcelain", "--", ".")
    except (OSError, subprocess.CalledProcessError):
        return str(csrc)
    label = head if changed in ("", head) else f"{head}, csrc as of {changed}"
    return f"{label} + uncommitted changes ({csrc})" if dirty else f"{label} ({csrc})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--csrc", type=Path, default=ROOT / "csrc", help="the tree to report (default: %(default)s)")
    parser.add_argument("--compare", type=Path, metavar="OTHER_CSRC",
                        help="a second csrc tree, printed side by side as the 'before'")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel nvcc (default: %(default)s)")
    args = parser.parse_args(argv)
    scratch = Path(tempfile.gettempdir()) / "ptxas_report"
    flags = " ".join(build_for(args.csrc, scratch).compile_flags)
    flags = flags.replace(str(args.csrc.resolve()), "<csrc>").replace(str(scratch), "<scratch>")
    after = kernels_of(args.csrc, args.jobs)
    print(f"nvcc flags of build_backend/moe_ep_build/ninja_build.py, plus `-Xptxas -v` (`<csrc>`: the tree "
          f"compiled; `<scratch>`: a temporary folder, so pybind11's -I names nothing, which no .cu needs):\n"
          f"`{flags}`\n")
    if args.compare is None:
        print(f"Tree: {label_of(args.csrc)}\n")
        print(table(after))
        return
    before = kernels_of(args.compare, args.jobs)
    print(f"Before: {label_of(args.compare)}.\nAfter: {label_of(args.csrc)}.\n")
    print(comparison(before, after))


if __name__ == "__main__":
    main()
