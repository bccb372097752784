"""`deep_ep.hybrid_ep_buffer`, HybridEP's module (torchtitan's HybridEP dispatcher imports `indices_to_map`
from it; `HybridEPBuffer` is defined there): moe_ep.deep_ep.hybrid_ep_buffer's."""
from moe_ep.deep_ep.hybrid_ep_buffer import HybridEPBuffer, indices_to_map

__all__ = ["HybridEPBuffer", "indices_to_map"]
