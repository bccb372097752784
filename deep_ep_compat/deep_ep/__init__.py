"""The top-level `deep_ep` package, served by moe_ep (distribution moe-ep-deep-ep: `pip install ./deep_ep_compat`),
so frameworks' DeepEP code (Megatron-Core, torchtitan, vLLM, SGLang) imports moe_ep unchanged. It replaces
a real DeepEP install (both are `deep_ep`): install one or the other. Every name is moe_ep.deep_ep's own
object; docs/deep_ep_compat.md lists where the behaviour differs from DeepEP's."""
from moe_ep.deep_ep import (Buffer, Config, DispatchHandle, EPHandle, ElasticBuffer, EventHandle, EventOverlap,
                            HybridEPBuffer, HybridEpConfigInstance, LowLatencyHandle, get_logical_domain_size,
                            get_physical_domain_size, topk_idx_t)

__all__ = ["Buffer", "Config", "DispatchHandle", "EPHandle", "ElasticBuffer", "EventHandle", "EventOverlap",
           "HybridEPBuffer", "HybridEpConfigInstance", "LowLatencyHandle", "get_logical_domain_size",
           "get_physical_domain_size", "topk_idx_t"]
