"""`import moe_ep.deep_ep as deep_ep`: DeepEP's Python API over moe_ep, so code written for DeepEP switches by
import (docs/deep_ep_compat.md). v1.py: DeepEP V1's Buffer, Config, EventOverlap and handles."""
from __future__ import annotations

from .hybrid_ep_buffer import HybridEPBuffer, HybridEpConfigInstance
from .v1 import Buffer, Config, DispatchHandle, EventHandle, EventOverlap, LowLatencyHandle, topk_idx_t

__all__ = ["Buffer", "Config", "DispatchHandle", "EventHandle", "EventOverlap", "LowLatencyHandle", "topk_idx_t",
           "HybridEPBuffer", "HybridEpConfigInstance"]
