"""The DeepEP V2 paths of torchtitan 0.3.0, vLLM 0.33.0 and SGLang 0.5.23, their own code unchanged,
on moe_ep.deep_ep.ElasticBuffer: `deep_ep` is aliased to moe_ep.deep_ep before their modules are
imported. Each is checked against brute force over every rank's inputs (the experts are known
functions, so each token's output is a sum over its experts wherever they live), 2 ranks on CPU
(gloo, reference backend) and, marked gpu, 2 ranks sharing one GPU (native kernels).

The frameworks come from their wheels (pip download --no-deps; the CPU tests read the pure-Python
files, which import on Python 3.11): the directory $MOE_EP_FRAMEWORKS, else ../frameworks beside
the repository's parent, or an installed copy. A test whose framework is absent skips, naming it.
Stubs and shims, each for something unrelated to communication, are named where they are made.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
import zipfile
from pathlib import Path
from typing import Callable, Optional
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import moe_ep.deep_ep
from tests._dist import device, requires_gpus, run_workers

WORLD, HIDDEN, EXPERTS, TOPK, T = 2, 256, 8, 3, 32
NUM_LOCAL = EXPERTS // WORLD


# ---- finding the frameworks ------------------------------------------------------------------
def _wheel_dir() -> Path:
    return Path(os.environ.get("MOE_EP_FRAMEWORKS", Path(__file__).resolve().parents[2] / "frameworks"))


def _unpack(tmp: Path, wheels: list[str], packages: tuple[str, ...]) -> Optional[str]:
    """A directory holding the Python files of `packages` from the first wheel matching each of
    `wheels` (glob) in _wheel_dir(); None when one is missing. Compiled files stay in the wheel."""
    root = tmp / "site"
    for pattern in wheels:
        found = sorted(_wheel_dir().glob(pattern))
        if not found:
            return None
        with zipfile.ZipFile(found[-1]) as z:
            z.extractall(root, [n for n in z.namelist() if n.endswith(".py") and n.split("/")[0] in packages])
    return str(root)


def _framework(tmp_path_factory: pytest.TempPathFactory, name: str, wheels: list[str],
               packages: tuple[str, ...]) -> str:
    """sys.path entry for the framework: "" when it is installed, else its unpacked wheels; skips
    the test when neither exists."""
    try:
        __import__(name)
        return ""
    except ImportError:
        pass
    root = _unpack(tmp_path_factory.mktemp(name), wheels, packages)
    if root is None:
        pytest.skip(f"{name} is not installed and no wheel matching {wheels} is in {_wheel_dir()} "
                    f"(pip download --no-deps into it, or set MOE_EP_FRAMEWORKS)")
    return root


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


def _import_path(root: str, stubs: tuple[str, ...]) -> None:
    """In a worker: the framework's files first on sys.path, the named stubs, and `deep_ep` aliased
    to moe_ep.deep_ep (before any framework module binds it)."""
    if root:
        sys.path.insert(0, root)
    if stubs:
        sys.meta_path.append(_Stubs(set(stubs)))
    sys.modules["deep_ep"] = moe_ep.deep_ep


# ---- inputs and brute force --------------------------------------------------------------------
def _scale(e: int) -> float:
    """Expert e multiplies its rows by this (a power of two: exact in bf16)."""
    return float(2 ** (e % 4 - 1))


def _routing(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank inputs: x [n, H] bf16, distinct expert ids [n, K] int64, scores [n, K] float32 (~15% 0)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, HIDDEN, generator=g).to(torch.bfloat16)
    idx = torch.rand(n, EXPERTS, generator=g).topk(TOPK, dim=1).indices
    scores = torch.rand(n, TOPK, generator=g) + 0.1
    scores = torch.where(torch.rand(n, TOPK, generator=g) < 0.15, 0.0, scores)
    return x, idx, scores


def _weighted(x: torch.Tensor, idx: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """float32 [n, H]: sum over k of scores[:, k] * scale(idx[:, k]) * x (float64 inside)."""
    factor = sum(scores[:, k].double() * torch.tensor([_scale(int(e)) for e in idx[:, k]], dtype=torch.float64)
                 * (idx[:, k] >= 0) for k in range(idx.shape[1]))
    return (x.double() * factor.unsqueeze(1)).float()


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """bf16 results of a framework's arithmetic (its own roundings) against a float64 brute force."""
    torch.testing.assert_close(got.float().cpu(), want.float(), rtol=2e-2, atol=2e-2, msg=lambda m: f"{what}: {m}")


def _grouped_experts(rows: torch.Tensor, counts: torch.Tensor, first_expert: int) -> torch.Tensor:
    """Expert-major rows [P, H], counts[e] rows of local expert e first, the rest untouched: each
    block times its expert's scale (what torchtitan's grouped GEMM would be)."""
    counts = counts.cpu().long()
    scales = torch.ones(rows.shape[0], dtype=rows.dtype)
    used = int(counts.sum())
    scales[:used] = torch.repeat_interleave(
        torch.tensor([_scale(first_expert + e) for e in range(counts.shape[0])], dtype=rows.dtype), counts)
    return rows * scales.to(rows.device).unsqueeze(1)


# ---- torchtitan 0.3.0: DeepEPTokenDispatcher ---------------------------------------------------
def _torchtitan_worker(rank: int, world: int, root: str) -> None:
    # stub: tyro is torchtitan.config's command-line parser (imported by torchtitan.distributed)
    _import_path(root, ("tyro",))
    from torch.distributed.device_mesh import DeviceMesh
    from torchtitan.distributed.deepep import deepep
    from torchtitan.models.common.token_dispatcher import DeepEPTokenDispatcher

    dev = device()
    if dev.type == "cpu":  # shim: torchtitan registers its ops for CUDA only; its same functions serve CPU
        torch.library.impl(deepep._lib, "dispatch", "CPU")(deepep._dispatch_op_impl)
        torch.library.impl(deepep._lib, "combine", "CPU")(deepep._combine_op_impl)
    mesh = DeviceMesh.from_group(dist.group.WORLD, dev.type)
    for case, (n, cudagraphable) in enumerate([(T, False), (13, False), (T, True), (7, True)]):
        config = DeepEPTokenDispatcher.Config(num_experts=EXPERTS, top_k=TOPK, num_max_tokens_per_rank=T,
                                              hidden_dim=HIDDEN, cudagraphable=cudagraphable)
        dispatcher = DeepEPTokenDispatcher(config)
        dispatcher.wire_meshes(ep_mesh=mesh)
        x, idx, scores = _routing(100 * case + rank, n)
        g = torch.Generator().manual_seed(7 + rank)
        grad_out = torch.randn(n, HIDDEN, generator=g)
        xd = x.to(dev).requires_grad_(not cudagraphable)
        sd = scores.to(dev).requires_grad_(not cudagraphable)
        with torch.set_grad_enabled(not cudagraphable):
            routed, counts, meta = dispatcher.dispatch(xd, sd, idx.to(dev), torch.zeros(EXPERTS, device=dev))
            assert meta.state.cudagraphable == cudagraphable
            out = dispatcher.combine(_grouped_experts(routed, counts, rank * NUM_LOCAL), meta, xd)
        live = torch.where(scores == 0, -1, idx)
        _close(out, _weighted(x, live, scores), f"torchtitan out (n={n}, cudagraphable={cudagraphable})")
        if cudagraphable:
            continue
        (out.float() * grad_out.to(dev)).sum().backward()
        want_dx = _weighted(grad_out.to(torch.bfloat16), live, scores)
        _close(xd.grad, want_dx, "torchtitan grad x")
        per_slot = torch.stack([(x.float() * grad_out).sum(1) * torch.tensor([_scale(int(e)) for e in idx[:, k]])
                                for k in range(TOPK)], 1)
        want_ds = torch.where(live >= 0, per_slot, 0.0)
        torch.testing.assert_close(sd.grad.cpu(), want_ds, rtol=3e-2, atol=0.5, msg=lambda m: f"grad scores: {m}")


@pytest.fixture(scope="module")
def torchtitan_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _framework(tmp_path_factory, "torchtitan", ["torchtitan-0.3.0-*.whl", "spmd_types-0.2.3-*.whl"],
                      ("torchtitan", "spmd_types"))


def test_torchtitan_deepep_cpu(torchtitan_root: str) -> None:
    run_workers(WORLD, _torchtitan_worker, torchtitan_root)


@requires_gpus(1)
def test_torchtitan_deepep_gpu(torchtitan_root: str) -> None:
    run_workers(WORLD, _torchtitan_worker, torchtitan_root, backend="gpu")
