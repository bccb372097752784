"""The communication core: Buffer (validation, one backend per mode), the backends and the native loader,
the knobs (config), the result types, the errors, the topology, the expert-major pair layout and the FP8
block format. It never imports moe_ep.moe (tests/test_imports.py checks)."""
