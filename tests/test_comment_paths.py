"""Every file that a comment, a docstring or the docs name exists, so no comment points at a file that
moved or went away. A path-like token (dir/name.ext, or a bare name.ext, with a .py, .h, .cuh, .cu,
.cpp, .md or .sh extension) in the comments and docstrings of moe_ep/**/*.py, csrc/**/*.{h,cuh,cu,cpp},
tests/*.py, bench/*.py and setup.py, and in the text of docs/*.md and README.md, must name a file of the
repository: a path relative to the root, csrc/, moe_ep/, or the naming file's folder or one of its
parents; a bare name the name of any file. URLs are skipped; the lists below name the few paths of other
projects and of files that a reader or a command makes."""
from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOKEN = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w-]*\w\.(?:py|h|cuh|cu|cpp|md|sh))(?![\w/])")
URL = re.compile(r"\w+://\S+")
C_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)

# Files of other projects, named where moe_ep follows them or is tested against them.
OTHER_PROJECTS = {
    # DeepEP
    "deep_ep/buffer.py", "deep_ep/utils.py", "deep_ep/buffers/elastic.py", "csrc/deep_ep.cpp",
    "csrc/kernels/internode_ll.cu", "internode_ll.cu", "tests/utils.py", "tests/test_intranode.py",
    "tests/test_low_latency.py", "test_intranode.py", "test_low_latency.py",
    # vLLM
    "fused_moe/prepare_finalize/deepep_ll.py", "fused_moe/oracle/nvfp4.py", "quantization/utils/flashinfer_fp4_moe.py",
    "deepep_ll.py", "flashinfer_cutedsl_batched_moe.py", "all2all.py",
    # SGLang
    "batch_overlap/single_batch_overlap.py", "layers/moe/token_dispatcher/deepep.py", "moe_runner/deep_gemm.py",
    "hybridep.py",
    # PyTorch, CUDA, NVSHMEM
    "aten/src/ATen/native/cuda/GroupMM.cu", "GroupMM.cu", "cuda_fp8.h", "cuda_fp4.h", "nvshmemi_types.h",
}
# Files a reader or a command makes: the README's example, ptxas_report's output, fetch_frameworks' placeholder.
MADE_ELSEWHERE = {"quickstart.py", "bench/results/ptxas.md", "NAME.py"}
def _files() -> list[str]:
    """The repository's files as git tracks them (untracked ones too, not ignored)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return sorted({f for f in out.split() if (ROOT / f).is_file()})


def _python_text(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring."""
    found = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
             if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = node.body[0] if node.body else None
            if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str):
                found.append((doc.lineno, doc.value.value))
    return found


def _scanned(name: str) -> bool:
    parts = name.split("/")
    if name.endswith(".py"):
        return parts[0] == "moe_ep" or (parts[0] in ("tests", "bench") and len(parts) == 2) or name == "setup.py"
    if name.endswith((".h", ".cuh", ".cu", ".cpp")):
        return parts[0] == "csrc"
    return name == "README.md" or (parts[0] == "docs" and len(parts) == 2 and name.endswith(".md"))


def _texts(name: str) -> list[tuple[int, str]]:
    source = (ROOT / name).read_text()
    if name.endswith(".py"):
        return _python_text(source)
    if name.endswith(".md"):
        return [(1, source)]
    return [(source.count("\n", 0, m.start()) + 1, m.group()) for m in C_COMMENT.finditer(source)]


def _resolves(token: str, name: str, files: set[str], names: set[str]) -> bool:
    """Whether `token`, named in file `name`, is one of the repository's `files` (a bare name: one of their
    `names`); ignored files on this disk, such as .carry/, do not count: a clean clone lacks them."""
    if "/" not in token:
        return token in names
    folder = (ROOT / name).parent
    bases = [ROOT / "csrc", ROOT / "moe_ep", folder, *folder.parents]
    return any((base / token).resolve().relative_to(ROOT).as_posix() in files
               for base in bases if base == ROOT or ROOT in base.parents)


def _stale() -> list[tuple[str, int, str]]:
    files = _files()
    known, names = set(files), {Path(f).name for f in files}
    stale = []
    for name in filter(_scanned, files):
        for line, text in _texts(name):
            text = URL.sub(" ", text)
            for match in TOKEN.finditer(text):
                token = match.group(1)
                if token in OTHER_PROJECTS or token in MADE_ELSEWHERE:
                    continue
                if not _resolves(token, name, known, names):
                    stale.append((name, line + text.count("\n", 0, match.start()), token))
    return stale


def test_every_path_named_in_comments_exists() -> None:
    stale = _stale()
    assert not stale, "paths that name no file:\n" + "\n".join(f"{f}:{line}: {token}" for f, line, token in stale)


@pytest.mark.parametrize("token, name, resolves", [
    ("moe_ep/comm/config.py", "csrc/kernels/intranode/intranode.h", True),
    ("moe_ep/config.py", "csrc/kernels/intranode/intranode.h", False),
    ("backends/engine.py", "moe_ep/comm/backends/low_latency.py", True),
    ("runtime/comm.h", "moe_ep/comm/errors.py", True),
    ("comm.h", "moe_ep/comm/errors.py", True),
    ("no_such_file.py", "README.md", False),
])
def test_how_a_path_resolves(token: str, name: str, resolves: bool) -> None:
    """A path is found from the root, csrc/, moe_ep/ or the naming file's folders; a bare name anywhere."""
    files = _files()
    assert _resolves(token, name, set(files), {Path(f).name for f in files}) is resolves


def test_an_ignored_file_does_not_resolve() -> None:
    """A file on this disk that git ignores (a .carry/ script, say) is absent from a clean clone, so naming it fails."""
    folder = ROOT / "moe_ep" / "__pycache__"
    folder.mkdir(exist_ok=True)
    made = folder / "named_but_ignored.py"
    made.write_text("")
    try:
        files = _files()
        assert not _resolves("moe_ep/__pycache__/named_but_ignored.py", "README.md", set(files),
                             {Path(f).name for f in files})
    finally:
        made.unlink()


def test_the_scan_finds_tokens() -> None:
    """The scan reads comments, docstrings and docs text, and skips code and URLs."""
    source = '"""See moe_ep/comm/buffer.py."""\nx = "not/a/comment.py"  # and csrc/runtime/comm.h\n'
    texts = [t for _, t in _python_text(source)]
    assert [m.group(1) for t in texts for m in TOKEN.finditer(URL.sub(" ", t))] == ["csrc/runtime/comm.h",
                                                                                  "moe_ep/comm/buffer.py"]
    assert not TOKEN.findall(URL.sub(" ", "https://github.com/deepseek-ai/DeepEP/blob/main/deep_ep/x.py"))
