"""Build support for moe_ep: the PEP 517 backend (hooks) and the ninja build of moe_ep.comm._C."""
