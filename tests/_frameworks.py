"""What the framework tests (test_frameworks_v2, test_frameworks_low_latency, test_frameworks_hybrid) share:
where the unpacked frameworks are, skip markers, the import set-up of a worker (sys.path, stand-in
modules), and the experts as known functions with their brute force.

The frameworks import `deep_ep`: moe_ep's optional package (`pip install ./deep_ep_compat`), installed,
never aliased; the tests skip without it.

The frameworks are not installed: the tests read the files of their wheels they use (the imported parts
are pure Python) from $MOE_EP_FRAMEWORKS, else <repo>/.frameworks (git-ignored), their dependencies from
its deps/ folder; tests/fetch_frameworks.py fills it.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Optional
from unittest import mock

import pytest
import torch

import moe_ep.deep_ep

ROOT = Path(__file__).resolve().parents[1]
FRAMEWORKS = Path(os.environ.get("MOE_EP_FRAMEWORKS", ROOT / ".frameworks"))

# stubs: model hub, HTTP server, tokenizer and grammar packages that vllm's config modules import
VLLM_STUBS = ("transformers", "huggingface_hub", "safetensors", "aiohttp", "uvloop", "xgrammar", "fastapi",
              "httpx2", "llguidance", "truststore")
# stubs: web server, notebook, image, tokenizer, model-format and TLS packages SGLang's modules import
SGLANG_STUBS = ("starlette", "IPython", "aiohttp", "torchvision", "truststore", "sentencepiece",
                "compressed_tensors", "gguf")


# How to get the `deep_ep` package the frameworks import (from the repository root).
INSTALL_DEEP_EP = "pip install ./deep_ep_compat"


@functools.cache
def deep_ep_missing() -> Optional[str]:
    """Why `import deep_ep` does not give moe_ep's package (not installed, or another `deep_ep` such as
    DeepEP's own), or None when it does."""
    if importlib.util.find_spec("deep_ep") is None:
        return f"the deep_ep package is not installed ({INSTALL_DEEP_EP})"
    import deep_ep

    if getattr(deep_ep, "Buffer", None) is not moe_ep.deep_ep.Buffer:
        return f"the deep_ep at {deep_ep.__file__} is not moe_ep's ({INSTALL_DEEP_EP} in its place)"
    return None


def needs_deep_ep() -> pytest.MarkDecorator:
    """Skip unless `import deep_ep` gives moe_ep's package."""
    missing = deep_ep_missing()
    return pytest.mark.skipif(missing is not None, reason=str(missing))


def needs(package: str, version: str) -> pytest.MarkDecorator:
    """Skip unless the framework's unpacked package is in FRAMEWORKS and `deep_ep` is moe_ep's package."""
    if not (FRAMEWORKS / package).is_dir():
        return pytest.mark.skip(reason=f"{package} {version} is not unpacked in {FRAMEWORKS} (MOE_EP_FRAMEWORKS)")
    missing = deep_ep_missing()
    return pytest.mark.skipif(missing is not None, reason=f"{package} {version} imports deep_ep: {missing}")


def skip_unless_its_torch(package: str, version: str) -> None:
    """On the GPU, vLLM and SGLang import their CUDA platform and its compiled extensions, built for the
    torch their wheel pins: skip, naming both versions, on another torch (their CPU paths are pure Python)."""
    metadata = FRAMEWORKS / f"{package}-{version}.dist-info" / "METADATA"
    pins = [line.split("==", 1)[1].strip() for line in metadata.read_text().splitlines()
            if line.startswith("Requires-Dist: torch==")] if metadata.is_file() else []
    if pins and pins[0] != torch.__version__.split("+")[0]:
        pytest.skip(f"{package} {version}'s CUDA path loads extensions built for torch {pins[0]} (its wheel pins "
                    f"torch=={pins[0]}); this machine has torch {torch.__version__}")


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Stand-in modules for packages a framework imports but the tested path never uses: every
    attribute is a MagicMock."""

    def __init__(self, roots: set[str]) -> None:
        self.roots = roots

    def find_spec(self, name: str, path: object, target: object = None) -> Optional[importlib.machinery.ModuleSpec]:
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda attr: mock.MagicMock(name=f"{spec.name}.{attr}")
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def import_path(stubs: tuple[str, ...]) -> None:
    """In a worker: the unpacked frameworks and their dependencies on sys.path, and stand-ins for the named
    packages where they are not importable."""
    for path in (FRAMEWORKS / "deps", FRAMEWORKS):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    missing = {name for name in stubs if importlib.util.find_spec(name) is None}
    if missing:
        sys.meta_path.append(_Stubs(missing))


# ---- experts as known functions and the brute force ---------------------------------------------
def scale(e: int) -> float:
    """Expert e multiplies its rows by this (a power of two: exact in bf16)."""
    return float(2 ** (e % 4 - 1))


def weighted(x: torch.Tensor, idx: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """float32 [n, H]: sum over k of scores[:, k] * scale(idx[:, k]) * x (float64 inside; x may be float64)."""
    factor = sum(scores[:, k].double() * torch.tensor([scale(int(e)) for e in idx[:, k]], dtype=torch.float64)
                 * (idx[:, k] >= 0) for k in range(idx.shape[1]))
    return (x.double() * factor.unsqueeze(1)).float()


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """bf16 results of a framework's arithmetic (its own roundings) against a float64 brute force."""
    torch.testing.assert_close(got.float().cpu(), want.float(), rtol=2e-2, atol=2e-2, msg=lambda m: f"{what}: {m}")


def reduced_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Rows [M, H] of experts that weight and reduce themselves (vLLM's TopKWeightAndReduceNoOP
    contract): row m = sum over k with ids[m, k] >= 0 of weights[m, k] * scale(ids[m, k]) * x[m]."""
    factor_of = torch.tensor([[scale(int(e)) for e in row] for row in ids.cpu().tolist()], dtype=torch.float32)
    factor = (torch.where(ids.cpu() >= 0, weights.float().cpu() * factor_of, 0.0)).sum(1, keepdim=True)
    return (x.float() * factor.to(x.device)).to(torch.bfloat16)
