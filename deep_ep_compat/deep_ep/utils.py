"""`deep_ep.utils`, whose events Megatron-Core's flex dispatcher imports (`from deep_ep.utils import
EventHandle, EventOverlap`): moe_ep.deep_ep's."""
from moe_ep.deep_ep import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
