"""The optional `deep_ep` package (deep_ep_compat/, `pip install ./deep_ep_compat`): `import deep_ep` and each
module path the frameworks import give moe_ep.deep_ep's own objects, every `from deep_ep... import` in the
unpacked frameworks is served, the package is released with its moe_ep, and moe_ep ships no `deep_ep`."""
from __future__ import annotations

import ast
import importlib
import importlib.metadata
import re
from pathlib import Path
from types import ModuleType

import pytest

import moe_ep
import moe_ep.deep_ep
from moe_ep.deep_ep import hybrid_ep_buffer
from tests._frameworks import FRAMEWORKS, ROOT, needs_deep_ep

# Each module path of the package: the moe_ep module whose objects it gives, and the names it has
# (deep_ep: all of moe_ep.deep_ep's; deep_ep.utils: Megatron-Core's; deep_ep.hybrid_ep_buffer: torchtitan's
# and the module's class).
MODULES: dict[str, tuple[ModuleType, list[str]]] = {
    "deep_ep": (moe_ep.deep_ep, moe_ep.deep_ep.__all__),
    "deep_ep.utils": (moe_ep.deep_ep, ["EventHandle", "EventOverlap"]),
    "deep_ep.hybrid_ep_buffer": (hybrid_ep_buffer, ["HybridEPBuffer", "indices_to_map"]),
}
FRAMEWORK_PACKAGES = ("megatron", "torchtitan", "vllm", "sglang")
DISTRIBUTION = "moe-ep-deep-ep"


def framework_imports() -> set[tuple[str, str]]:
    """(module, name) of every `from deep_ep... import name` and (module, "") of every `import deep_ep...`
    in the unpacked frameworks' Python files."""
    found: set[tuple[str, str]] = set()
    for package in FRAMEWORK_PACKAGES:
        for path in (FRAMEWORKS / package).rglob("*.py"):
            text = path.read_text(errors="replace")
            if "deep_ep" not in text:
                continue
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "deep_ep":
                    found.update((node.module, a.name) for a in node.names)
                elif isinstance(node, ast.Import):
                    found.update((a.name, "") for a in node.names if a.name.split(".")[0] == "deep_ep")
    return found


@needs_deep_ep()
def test_import_deep_ep() -> None:
    from deep_ep import Buffer, ElasticBuffer, HybridEPBuffer

    assert Buffer is moe_ep.deep_ep.Buffer and ElasticBuffer is moe_ep.deep_ep.ElasticBuffer
    assert HybridEPBuffer is moe_ep.deep_ep.HybridEPBuffer


@needs_deep_ep()
@pytest.mark.parametrize("path", sorted(MODULES))
def test_names_are_moe_ep_deep_eps_objects(path: str) -> None:
    """Each module has exactly its names (its __all__), each the very object of moe_ep's module."""
    module, (source, names) = importlib.import_module(path), MODULES[path]
    assert sorted(module.__all__) == sorted(names), f"{path}.__all__"
    for name in names:
        assert getattr(module, name) is getattr(source, name), f"{path}.{name} is not {source.__name__}.{name}"


@needs_deep_ep()
def test_every_framework_import_is_served() -> None:
    """Every `deep_ep` module and name the unpacked frameworks import is in the package."""
    imports = framework_imports()
    if not imports:
        pytest.skip(f"no framework importing deep_ep is unpacked in {FRAMEWORKS} (MOE_EP_FRAMEWORKS)")
    for path, name in sorted(imports):
        assert path in MODULES, f"the frameworks import {path}, which the deep_ep package lacks"
        assert not name or name in MODULES[path][1], f"the frameworks import {name} from {path}, which lacks it"


def test_released_with_its_moe_ep() -> None:
    """deep_ep_compat/pyproject.toml's version and its moe_ep pin are moe_ep's version (the names it
    re-exports are that release's)."""
    text = (ROOT / "deep_ep_compat" / "pyproject.toml").read_text()
    assert re.search(r'^version = "([^"]+)"', text, re.M)[1] == moe_ep.__version__
    assert re.search(r'"moe_ep==([^"]+)"', text)[1] == moe_ep.__version__


def test_moe_ep_ships_no_deep_ep() -> None:
    """moe_ep's own distribution has no top-level `deep_ep` (it installs beside a real DeepEP), and an
    installed `deep_ep` belongs to the package's distribution alone."""
    files = importlib.metadata.files("moe_ep") or []
    assert not [f for f in files if Path(f).parts[0] == "deep_ep"], "moe_ep's distribution ships deep_ep"
    owners = importlib.metadata.packages_distributions().get("deep_ep", [])
    assert not owners or {re.sub(r"[-_.]+", "-", o).lower() for o in owners} == {DISTRIBUTION}, owners
