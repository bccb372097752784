"""moe_ep: expert-parallel dispatch/combine for Mixture-of-Experts models (see docs/api.md)."""
from __future__ import annotations

import importlib
from typing import Any

from . import fp8, ops
from .backends.symmetric import SymmetricHeapUsage, symmetric_heap_usage
from .buffer import Buffer
from .config import Config
from .errors import BadExpertIdError, CommTimeoutError, PeersLostError
from .types import (
    DispatchHandle,
    DispatchLayout,
    DispatchResult,
    EventHandle,
    ExpertMajorLayout,
    LowLatencyCombineResult,
    LowLatencyDispatchResult,
    LowLatencyHandle,
)

__version__ = "0.1.0"

# Imported on first use: the layer pulls in nn code.
_LAZY = {
    "TopKRouter": "moe_ep.router",
    "RouterOutput": "moe_ep.router",
    "MoE": "moe_ep.layer",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'moe_ep' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names and the lazy ones (tab completion, dir(moe_ep))."""
    return sorted({*globals(), *_LAZY})


__all__ = [
    "BadExpertIdError", "Buffer", "CommTimeoutError", "Config", "DispatchHandle", "DispatchLayout", "DispatchResult",
    "EventHandle", "ExpertMajorLayout", "LowLatencyCombineResult", "LowLatencyDispatchResult", "LowLatencyHandle", "PeersLostError",
    "SymmetricHeapUsage", "fp8", "ops", "symmetric_heap_usage", *_LAZY,
]
