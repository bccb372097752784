"""Every knob and default of moe_ep in one place: moe_ep.Config (the kernel knobs), the SM budget's
one default, a Buffer's timeout, and the Python-side sizing numbers. The memory layouts themselves
belong to the C++ code that lays them out (moe_ep.comm._C, `_native.constant`) and are not repeated here.

moe_ep.Config is given per Buffer (`Buffer(config=...)`) and overridable per call (`dispatch(...,
config=...)`, `combine(..., config=...)`). The knobs change only how fast the kernels run, never
their results (the same bits for every value). Defaults below are measured on 2 x H200
(docs/benchmarks.md). Environment variables may set the defaults of a Buffer made without a config,
read once where the Buffer is made. Each knob is honoured by the kernels it tunes (KNOB_PATHS) and
refused with a ValueError by a Buffer whose normal mode runs other kernels, unless left at its default:

| knob | variable | default | honoured by |
|---|---|---|---|
| num_sms | MOE_EP_NUM_SMS | DEFAULT_NUM_SMS (24), at most the GPU's SMs | normal mode, both paths |
| send_warps | MOE_EP_SEND_WARPS | 24 | normal mode on one node (NVLink kernels) |
| combine_send_warps | MOE_EP_COMBINE_SEND_WARPS | 16 | NVLink kernels |
| unroll | MOE_EP_UNROLL | 6 | NVLink kernels |
| flag_batch | MOE_EP_FLAG_BATCH | 4 | NVLink kernels |
| recv_run | MOE_EP_RECV_RUN | 1 | NVLink kernels |
| eager_output_bytes | MOE_EP_EAGER_OUTPUT_BYTES | 1 GiB | normal mode, both paths |
| internode_workspace_bytes | MOE_EP_INTERNODE_WORKSPACE_BYTES | 2 GiB | normal mode across nodes (cross-node kernels) |
| low_latency_num_sms | MOE_EP_LOW_LATENCY_NUM_SMS | every SM of the GPU | low-latency mode (needs low_latency=True) |

The SM budget has one default, DEFAULT_NUM_SMS; per mode:
- normal mode: `num_sms` (call, else its Config's, else the Buffer's) is the blocks of a dispatch or
  combine; a Buffer given none takes MOE_EP_NUM_SMS, else DEFAULT_NUM_SMS at most the GPU's SMs
  (default_num_sms). Across nodes it is the channels, at most INTERNODE_MAX_CHANNELS (more is refused).
- low-latency mode: the calls take no `num_sms`; `low_latency_num_sms` spreads their fixed grid (per
  Buffer, every SM by default). low_latency_combine's `num_sms` is single-batch overlap's and needs
  overlap=True (refused otherwise).
- DeepEP drop-in (moe_ep.deep_ep): `Buffer.num_sms` and `Config().num_sms` start at DEFAULT_NUM_SMS
  (DeepEP's own is 20; here the number sizes moe_ep's kernels), changed by `Buffer.set_num_sms`; V2's
  `get_theoretical_num_sms` is the normal-mode default above.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from . import _native

DEFAULT_NUM_SMS = 24
DEFAULT_TIMEOUT_S = 100.0  # how long a kernel waits for a peer before the call raises CommTimeoutError
PER_BUFFER = ("internode_workspace_bytes", "low_latency_num_sms")  # fixed at creation (memory, the low-latency context)
# The normal-mode kernels ("nvlink": one node; "cross-node": the hierarchical kernels) each knob tunes; the
# others are honoured wherever their mode runs (low_latency_num_sms: its own check, low_latency=True).
KNOB_PATHS = {"send_warps": ("nvlink",), "combine_send_warps": ("nvlink",), "unroll": ("nvlink",),
              "flag_batch": ("nvlink",), "recv_run": ("nvlink",), "internode_workspace_bytes": ("cross-node",)}

# Symmetric heap sizing (moe_ep.comm.backends.symmetric): NVSHMEM takes its own symmetric buffers (teams,
# barriers, collectives) from the heap at init, so the heap is the callers' needs plus the headroom,
# rounded up to the granularity; each caller adds the slack per allocation it makes (the allocator rounds).
HEAP_HEADROOM_BYTES = 256 << 20
HEAP_GRANULARITY_BYTES = 2 << 20
ALLOCATION_SLACK_BYTES = 2 << 20

# Low-latency per-expert kernels (moe_ep.comm.backends.low_latency): P = clamp(LL_PER_EXPERT_GRID // E_l,
# 1, LL_MAX_BLOCKS_PER_EXPERT) blocks per expert, about two blocks per SM on an H200 (one wave). From the
# Buffer's dimensions only, never the local GPU: every rank must launch the same combine send grid.
LL_PER_EXPERT_GRID = 256
LL_MAX_BLOCKS_PER_EXPERT = 32

# DeepEP drop-in sizing (moe_ep.deep_ep). Top-k columns of the V1 normal-mode Buffers: callers' top-k is
# padded to it with -1, so calls with any top-k up to it, and without top-k, share one Buffer.
DEEP_EP_NORMAL_TOPK = 16
DEEP_EP_HINT_TOKENS_PER_RANK = 4096  # V1 Config.get_nvl_buffer_size_hint: one round of this many tokens per rank
DEEP_EP_SIZING_TOPK = 32  # V2 get_buffer_size_hint: DeepEP's top-k when the caller gives none
DEEP_EP_SIZE_ALIGNMENT_BYTES = 2 << 20  # V2 get_buffer_size_hint rounds up to this


@dataclass(frozen=True)
class Config:
    """Kernel knobs of one Buffer (a call may override the per-call ones; module docstring)."""

    num_sms: Optional[int] = None  # SMs of a normal-mode call; None: default_num_sms
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
        allowed = unroll_values()
        if self.unroll not in allowed:
            raise ValueError(f"Config.unroll must be one of {allowed}, got {self.unroll!r}")
        for name in ("num_sms", "low_latency_num_sms"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1, 1 << 16)

    def replace(self, **changes: object) -> "Config":
        """A copy with `changes` (checked like the constructor)."""
        return dataclasses.replace(self, **changes)

    def off_path(self, path: str) -> list[str]:
        """The knobs set away from their defaults that the normal-mode kernels `path` do not run (KNOB_PATHS)."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return [name for name, paths in KNOB_PATHS.items() if path not in paths and getattr(self, name) != defaults[name]]

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "Config":
        """Defaults, with each knob's MOE_EP_<KNOB> variable (where set and not empty) in its place."""
        environ = os.environ if environ is None else environ
        values = {}
        for f in dataclasses.fields(cls):
            var = env_var(f.name)
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


def env_var(knob: str) -> str:
    """The environment variable that gives a knob's default (Config.from_env)."""
    return f"MOE_EP_{knob.upper()}"


def default_num_sms(device: torch.device) -> int:
    """The SM budget of a normal-mode call on `device` when nothing names one: DEFAULT_NUM_SMS, at most a
    CUDA device's SMs."""
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return min(DEFAULT_NUM_SMS, torch.cuda.get_device_properties(device).multi_processor_count)


def unroll_values() -> tuple[int, ...]:
    """The Config.unroll values the NVLink kernels are built for (C++'s kUnrollValues, a bit per value)."""
    mask = _native.constant("TUNING_UNROLL_MASK")
    return tuple(u for u in range(mask.bit_length()) if mask >> u & 1)


def _check_int(name: str, value: object, lo: int, hi: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ValueError(f"Config.{name} must be an int in {lo}..{hi}, got {value!r}")
