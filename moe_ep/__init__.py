"""moe_ep: expert-parallel dispatch/combine for Mixture-of-Experts models (see docs/api.md)."""
from __future__ import annotations

import importlib
from typing import Any

from .comm import fp8
from .moe import ops
from .comm.backends.symmetric import SymmetricHeapUsage, symmetric_heap_usage
from .comm.buffer import Buffer
from .comm.config import Config
from .comm.errors import BadExpertIdError, CallMismatchError, CommTimeoutError, PeerInputError, PeersLostError
from .comm.types import (
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
    "TopKRouter": "moe_ep.moe.router",
    "RouterOutput": "moe_ep.moe.router",
    "MoE": "moe_ep.moe.layer",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'moe_ep' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names and the lazy ones (tab completion, dir(moe_ep))."""
    return sorted({*globals(), *_LAZY})


__all__ = [
    "BadExpertIdError", "Buffer", "CallMismatchError", "CommTimeoutError", "Config", "DispatchHandle",
    "DispatchLayout", "DispatchResult", "EventHandle", "ExpertMajorLayout", "LowLatencyCombineResult",
    "LowLatencyDispatchResult", "LowLatencyHandle", "PeerInputError", "PeersLostError",
    "SymmetricHeapUsage", "fp8", "ops", "symmetric_heap_usage", *_LAZY,
]
