"""moe_ep.Config: every kernel knob in one place, given per Buffer (`Buffer(config=...)`) and
overridable per call (`dispatch(..., config=...)`, `combine(..., config=...)`).

The knobs change only how fast the kernels run, never their results (the same bits for every
value). Defaults below are measured on 2 x H200 (docs/benchmarks.md). Environment variables may set
the defaults of a Buffer made without a config, read once where the Buffer is made:

| knob | variable | default |
|---|---|---|
| num_sms | MOE_EP_NUM_SMS | 24, at most the GPU's SMs |
| send_warps | MOE_EP_SEND_WARPS | 24 |
| combine_send_warps | MOE_EP_COMBINE_SEND_WARPS | 16 |
| unroll | MOE_EP_UNROLL | 6 |
| flag_batch | MOE_EP_FLAG_BATCH | 4 |
| recv_run | MOE_EP_RECV_RUN | 1 |
| eager_output_bytes | MOE_EP_EAGER_OUTPUT_BYTES | 1 GiB |
| internode_workspace_bytes | MOE_EP_INTERNODE_WORKSPACE_BYTES | 2 GiB |
| low_latency_num_sms | MOE_EP_LOW_LATENCY_NUM_SMS | every SM of the GPU |
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Mapping, Optional

from . import _native

DEFAULT_NUM_SMS = 24
PER_BUFFER = ("internode_workspace_bytes", "low_latency_num_sms")  # fixed at creation (memory, the low-latency context)


@dataclass(frozen=True)
class Config:
    """Kernel knobs of one Buffer (a call may override the per-call ones; module docstring)."""

    num_sms: Optional[int] = None  # SMs of a normal-mode call; None: DEFAULT_NUM_SMS, at most the GPU's
    send_warps: int = 24  # NVLink dispatch: warps per 32-warp block that send first, the rest receive
    combine_send_warps: int = 16  # NVLink combine: warps per block that send first, the rest reduce
    unroll: int = 6  # NVLink kernels: int4 loads in flight per lane in every row copy (4 or 6)
    flag_batch: int = 4  # NVLink kernels: row flags a sending warp raises per system fence (1..32)
    recv_run: int = 1  # NVLink dispatch: positions per receive work item; combine: tokens per item (1..32)
    # normal dispatch outside worst-case mode: outputs of R * T rows up to this size are allocated before the
    # counts are known, so the kernel starts before the host waits for them (0: always exact-size, after the wait)
    eager_output_bytes: int = 1 << 30
    internode_workspace_bytes: int = 2 << 30  # cross-node workspace per GPU; its token rounds follow (per Buffer)
    # SMs the low-latency kernels spread over (their grid is at most 2 blocks per SM); None: every SM (per Buffer)
    low_latency_num_sms: Optional[int] = None

    def __post_init__(self) -> None:
        most = _native.constant("TUNING_MAX_WARPS")
        for name, lo, hi in (("send_warps", 1, most), ("combine_send_warps", 1, most), ("flag_batch", 1, 32),
                             ("recv_run", 1, 32), ("eager_output_bytes", 0, 1 << 48), ("internode_workspace_bytes", 1 << 20, 1 << 40)):
            _check_int(name, getattr(self, name), lo, hi)
        if self.unroll not in (4, 6):
            raise ValueError(f"Config.unroll must be 4 or 6, got {self.unroll!r}")
        for name in ("num_sms", "low_latency_num_sms"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1, 1 << 16)

    def replace(self, **changes: object) -> "Config":
        """A copy with `changes` (checked like the constructor)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "Config":
        """Defaults, with each knob's MOE_EP_<KNOB> variable (where set and not empty) in its place."""
        environ = os.environ if environ is None else environ
        values = {}
        for f in dataclasses.fields(cls):
            var = f"MOE_EP_{f.name.upper()}"
            text = environ.get(var, "")
            if text:
                try:
                    values[f.name] = int(text)
                except ValueError:
                    raise ValueError(f"{var}={text!r}: expected an integer") from None
        try:
            return cls(**values)
        except ValueError as e:
            raise ValueError(f"{e} (from the MOE_EP_* environment)") from None


def _check_int(name: str, value: object, lo: int, hi: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ValueError(f"Config.{name} must be an int in {lo}..{hi}, got {value!r}")
