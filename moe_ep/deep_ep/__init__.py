"""`import moe_ep.deep_ep as deep_ep`: DeepEP's Python API over moe_ep, so code written for DeepEP switches by
import (docs/deep_ep_compat.md). v1.py: DeepEP V1's Buffer, Config, EventOverlap and handles; elastic.py:
DeepEP V2's ElasticBuffer and EPHandle; hybrid_ep_buffer.py: HybridEP's HybridEPBuffer."""
from __future__ import annotations

from moe_ep.deep_ep.elastic import EPHandle, ElasticBuffer, get_logical_domain_size, get_physical_domain_size
from moe_ep.deep_ep.hybrid_ep_buffer import HybridEPBuffer, HybridEpConfigInstance
from moe_ep.deep_ep.v1 import Buffer, Config, DispatchHandle, EventHandle, EventOverlap, LowLatencyHandle, topk_idx_t

__all__ = ["Buffer", "Config", "DispatchHandle", "EPHandle", "ElasticBuffer", "EventHandle", "EventOverlap",
           "HybridEPBuffer", "HybridEpConfigInstance", "LowLatencyHandle", "get_logical_domain_size",
           "get_physical_domain_size", "topk_idx_t"]
