"""The communication core: Buffer (validation, one backend per mode), the backends and the native loader,
the knobs (config), the result types, the errors, the topology, the expert-major pair layout, the FP8
block format and the NVFP4 format (nvfp4: DeepEP's low-latency use_nvfp4 layout). It never imports moe_ep.moe (tests/test_imports.py checks)."""
