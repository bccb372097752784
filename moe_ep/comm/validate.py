"""The checks of a Buffer call's arguments: the validate stage of moe_ep.comm.buffer, their only user,
so every input is still checked once, where it enters, and nothing below re-checks it.

Every error raised here carries the codes of the argument and the check that failed
(call_check.input_error): a rank that rejects its input sends them in its stamp, and its peers'
PeerInputError names them without reading the message.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import _native, nvfp4
from .backends.base import BufferConfig
from .call_check import input_error
from .config import PER_BUFFER, Config, env_var
from .errors import BadExpertIdError
from .types import DispatchHandle, EventHandle, LowLatencyHandle, LowLatencyOverlap


def check_tensor(name: str, t: object, dtypes: tuple[torch.dtype, ...], shape: tuple[Optional[int], ...],
                 device: torch.device) -> torch.Tensor:
    """Type, dtype, rank, shape (None = any), device and contiguity of one input."""
    if not isinstance(t, torch.Tensor):
        raise input_error(TypeError, name, "type", f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise input_error(TypeError, name, "dtype",
                          f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise input_error(ValueError, name, "shape", f"{name} must have shape {want}, got {list(t.shape)}")
    if t.device != device:
        raise input_error(ValueError, name, "device", f"{name} must be on {device}, got {t.device}")
    if not t.is_contiguous():
        raise input_error(ValueError, name, "contiguity", f"{name} must be contiguous")
    return t


def check_aligned(name: str, t: torch.Tensor) -> torch.Tensor:
    """The kernels move rows as 16-byte vectors."""
    if t.data_ptr() % 16:
        raise input_error(ValueError, name, "alignment",
                          f"{name} must start at a 16-byte aligned address, got {t.data_ptr():#x}")
    return t


def check_positive(name: str, value: object) -> int:
    """A positive int (bool excluded)."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise input_error(ValueError, name, "value", f"{name} must be a positive int, got {value!r}")
    return value


def check_num_sms(num_sms: object, device: torch.device) -> int:
    """A positive int within the device's SMs."""
    check_positive("num_sms", num_sms)
    if device.type == "cuda":
        available = torch.cuda.get_device_properties(device).multi_processor_count
        if num_sms > available:
            raise input_error(ValueError, "num_sms", "value", f"num_sms ({num_sms}) exceeds the {available} SMs of {device}")
    return num_sms


def check_event(previous_event: object) -> Optional[EventHandle]:
    if previous_event is not None and not isinstance(previous_event, EventHandle):
        raise input_error(TypeError, "previous_event", "type",
                          f"previous_event must be an EventHandle, got {type(previous_event).__name__}")
    return previous_event


def check_hook(async_op: object, return_recv_hook: object) -> None:
    """A low-latency call's receive hook runs on the caller's stream, so it excludes async_op."""
    if async_op and return_recv_hook:
        raise input_error(ValueError, "return_recv_hook", "value",
                          "async_op=True and return_recv_hook=True exclude each other: the hook's receive runs on "
                          "the caller's stream")


def check_expert_major(expert_major: object, handle: Optional[DispatchHandle], expert_alignment: object) -> bool:
    """Whether a dispatch gives pairs: expert_major as given, None meaning no for a fresh dispatch
    and the handle's kind for a cached one. With worst_case the pairs are a static bound
    (expert_major.worst_case_pairs); a cached dispatch keeps its handle's layout."""
    if expert_major is not None and not isinstance(expert_major, bool):
        raise input_error(TypeError, "expert_major", "type",
                          f"expert_major must be None, True or False, got {expert_major!r}")
    layout = handle.expert_major if handle is not None else None
    if handle is None:
        return bool(expert_major)
    if expert_major and layout is None:
        raise input_error(ValueError, "expert_major", "value",
                          "expert_major=True with a handle needs the handle of an expert-major dispatch")
    if expert_major is not False and layout is not None and expert_alignment not in (1, layout.alignment):
        raise input_error(ValueError, "expert_alignment", "value",
                          f"a cached expert-major dispatch keeps its handle's layout (expert_alignment="
                          f"{layout.alignment}); got expert_alignment={expert_alignment}")
    return layout is not None if expert_major is None else expert_major


class CallChecks:
    """The checks that depend on one Buffer: its dimensions, its device, its backend and its normal path."""

    def __init__(self, cfg: BufferConfig, backend_name: str) -> None:
        self.cfg, self.backend_name = cfg, backend_name

    @property
    def normal_kernels(self) -> str:
        """The normal-mode kernels this Buffer's topology runs on the native backend (config.KNOB_PATHS)."""
        return "cross-node" if self.cfg.hierarchical else "nvlink"

    # ---- knobs ------------------------------------------------------------------------------
    def path_sms(self, sms: int) -> int:
        """The SM budget within what the normal path's kernels take: the cross-node kernels run one block
        per channel, at most INTERNODE_MAX_CHANNELS (a larger budget is an error, not a silent cap)."""
        most = _native.constant("INTERNODE_MAX_CHANNELS")
        if self.cfg.hierarchical and self.backend_name == "nvshmem" and sms > most:
            raise input_error(ValueError, "num_sms", "value",
                              f"num_sms ({sms}) exceeds the {most} channels (SMs) the cross-node kernels run; "
                              f"pass num_sms <= {most}")
        return sms

    def on_path(self, knobs: Config, from_env: bool = False) -> Config:
        """Knobs this Buffer's normal-mode kernels honour: one that tunes other kernels (config.KNOB_PATHS)
        must keep its default, so no knob is dropped silently. The rule is the native backend's, kept on
        every backend so a program's validity does not depend on it."""
        off = knobs.off_path(self.normal_kernels)
        if off:
            name = off[0]
            where = "one node (the NVLink kernels)" if self.normal_kernels == "nvlink" else \
                "the cross-node kernels (the group spans nodes, or hierarchical=True)"
            source = f" (from {env_var(name)})" if from_env else ""
            raise input_error(ValueError, "config", "value",
                              f"Config.{name}={getattr(knobs, name)}{source} tunes kernels this Buffer's normal mode "
                              f"does not run: it runs on {where}; leave {name} at its default")
        return knobs

    def knobs(self, num_sms: Optional[int], config: Optional[Config]) -> tuple[int, Config]:
        """A call's SM budget and kernel knobs: num_sms, else config.num_sms, else the Buffer's; the knobs
        of `config`, else the Buffer's. A call may not change what sizes the Buffer's memory."""
        knobs = self.cfg.config
        if config is not None:
            if not isinstance(config, Config):
                raise input_error(TypeError, "config", "type",
                                  f"config must be a moe_ep.Config, got {type(config).__name__}")
            fixed = [name for name in PER_BUFFER if getattr(config, name) != getattr(knobs, name)]
            if fixed:
                raise input_error(ValueError, "config", "value",
                                  f"Config.{fixed[0]} is fixed when the Buffer is made ({getattr(knobs, fixed[0])}); "
                                  f"a call cannot change it (got {getattr(config, fixed[0])})")
            sms = config.num_sms if config.num_sms is not None else knobs.num_sms
            knobs = self.on_path(config)
        else:
            sms = knobs.num_sms
        # the SM budget travels on its own: no Config is built per call
        return self.path_sms(check_num_sms(num_sms if num_sms is not None else sms, self.cfg.device)), knobs

    # ---- the Buffer, its handles ------------------------------------------------------------
    def low_latency(self) -> None:
        if not self.cfg.low_latency:
            raise input_error(ValueError, "low_latency", "value",
                              "low-latency calls need a Buffer created with low_latency=True")

    def handle(self, handle: object, kind: type) -> None:
        if not isinstance(handle, kind):
            raise input_error(TypeError, "handle", "type", f"handle must be a {kind.__name__}, got {type(handle).__name__}")
        if handle.buffer_id != self.cfg.buffer_id:
            raise input_error(ValueError, "handle", "value", "handle comes from another Buffer")

    # ---- tensors ----------------------------------------------------------------------------
    def tokens(self, n: int, what: str, capped: bool) -> None:
        """Calls with static shapes (worst-case mode, low latency) hold at most max_tokens_per_rank tokens;
        exact-size normal calls stream any number through the workspace in rounds of that size."""
        if capped and n > self.cfg.max_tokens_per_rank:
            raise input_error(ValueError, what, "token count",
                              f"{what} has {n} tokens, above max_tokens_per_rank={self.cfg.max_tokens_per_rank}, the "
                              "most a static-shape call (worst_case=True or low latency) may carry; exact-size normal "
                              "calls take any number")

    def topk_idx(self, topk_idx: object, n: Optional[int], capped: bool = True) -> torch.Tensor:
        """Shape, dtype, device, contiguity, alignment and token count (capped: `tokens`); the values:
        in_range_ids."""
        cfg = self.cfg
        t = check_aligned("topk_idx", check_tensor("topk_idx", topk_idx, (torch.int64,), (n, cfg.num_topk), cfg.device))
        self.tokens(t.shape[0], "topk_idx", capped)
        return t

    def in_range_ids(self, topk_idx: torch.Tensor, kernels_check: bool) -> tuple[torch.Tensor, Optional[ValueError]]:
        """topk_idx with every id outside [-1, E) set to -1, and the BadExpertIdError the call raises once its
        communication is done, unless the backend's kernels check each id themselves (`kernels_check`): a
        host check, one reduction and one sync; none while a CUDA graph is being captured."""
        cfg = self.cfg
        capturing = cfg.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if kernels_check or not topk_idx.numel() or capturing:
            return topk_idx, None
        lo, hi = torch.stack(torch.aminmax(topk_idx)).tolist()
        if lo >= -1 and hi < cfg.num_experts:
            return topk_idx, None
        error = input_error(BadExpertIdError, "topk_idx", "expert ids",
                            f"topk_idx values must lie in [-1, {cfg.num_experts}), got min {lo} and max {hi}")
        return torch.where((topk_idx >= -1) & (topk_idx < cfg.num_experts), topk_idx, -1), error

    def weights(self, topk_weights: object, n: int) -> torch.Tensor:
        return check_aligned("topk_weights", check_tensor("topk_weights", topk_weights, (torch.float32,),
                                                          (n, self.cfg.num_topk), self.cfg.device))

    def x(self, x: object, fp8_ok: bool, capped: bool = True) -> torch.Tensor:
        dtypes = (torch.bfloat16, torch.float8_e4m3fn) if fp8_ok else (torch.bfloat16,)
        t = check_tensor("x", x, dtypes, (None, self.cfg.hidden), self.cfg.device)
        self.tokens(t.shape[0], "x", capped)
        return check_aligned("x", t)

    def fp8_hidden(self, argument: str) -> None:
        """FP8 rows carry one scale per 128 channels; `argument`: what asked for FP8 (x's dtype, or use_fp8)."""
        if self.cfg.hidden % 128 != 0:
            raise input_error(ValueError, argument, "value", f"FP8 needs hidden to be a multiple of 128, got {self.cfg.hidden}")

    # ---- normal mode ------------------------------------------------------------------------
    def dispatch(self, x: object, x_scales: object, topk_idx: object, topk_weights: object,
                 handle: Optional[DispatchHandle], expert_alignment: object, worst_case: bool) -> None:
        """Every tensor argument of a dispatch and expert_alignment (the handle is checked before)."""
        cfg = self.cfg
        x = self.x(x, fp8_ok=True, capped=worst_case)
        n = x.shape[0]
        if x.dtype == torch.float8_e4m3fn:
            self.fp8_hidden("x")
            if x_scales is None:
                raise input_error(ValueError, "x_scales", "value", "FP8 dispatch needs x_scales [N, hidden / 128] float32")
            check_aligned("x_scales", check_tensor("x_scales", x_scales, (torch.float32,), (n, cfg.num_scales),
                                                   cfg.device))
        elif x_scales is not None:
            raise input_error(ValueError, "x_scales", "value", "x_scales is only for FP8 (torch.float8_e4m3fn) x")
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise input_error(ValueError, "topk_idx", "value",
                                  "a cached dispatch (handle=...) takes no topk_idx or topk_weights")
            if n != handle.num_tokens:
                raise input_error(ValueError, "x", "shape", f"x has {n} tokens but the handle was made for {handle.num_tokens}")
        else:
            if topk_idx is None or topk_weights is None:
                raise input_error(ValueError, "topk_idx", "value",
                                  "dispatch needs topk_idx and topk_weights (or a handle for a cached dispatch)")
            self.topk_idx(topk_idx, n, capped=worst_case)
            self.weights(topk_weights, n)
        check_positive("expert_alignment", expert_alignment)

    def combine(self, x: object, handle: DispatchHandle, topk_weights: object, pair_weights: object) -> None:
        """A combine's tensors: rows [M, H] bf16 (16-byte aligned, the kernels read them) and topk_weights
        [M, K]; for an expert-major handle pairs [P, H] bf16 or float32 (summed into fresh rows first),
        topk_weights [P] and pair_weights [P] float32."""
        cfg, layout = self.cfg, handle.expert_major
        if layout is None:
            if pair_weights is not None:
                raise input_error(ValueError, "pair_weights", "value",
                                  "pair_weights needs the handle of an expert-major dispatch (expert_major=True)")
            check_aligned("x", check_tensor("x", x, (torch.bfloat16,), (handle.num_recv_rows, cfg.hidden), cfg.device))
            if topk_weights is not None:
                self.weights(topk_weights, handle.num_recv_rows)
            return
        p = layout.num_pairs
        check_tensor("x", x, (torch.bfloat16, torch.float32), (p, cfg.hidden), cfg.device)
        for name, t in (("topk_weights", topk_weights), ("pair_weights", pair_weights)):
            if t is not None:
                check_tensor(name, t, (torch.float32,), (p,), cfg.device)

    # ---- low-latency mode -------------------------------------------------------------------
    def low_latency_dispatch(self, x: object, topk_idx: object, use_fp8: bool, round_scale: bool, use_ue8m0: bool,
                             use_nvfp4: bool, x_global_scale: object) -> Optional[torch.Tensor]:
        """A low-latency dispatch's tensors and row format; returns the NVFP4 global scale (None without NVFP4)."""
        x = self.x(x, fp8_ok=False)
        self.topk_idx(topk_idx, x.shape[0])
        if round_scale and not use_fp8:
            raise input_error(ValueError, "round_scale", "value", "round_scale applies only with use_fp8=True")
        if use_ue8m0 and not (use_fp8 and round_scale and self.cfg.hidden % 512 == 0):
            raise input_error(ValueError, "use_ue8m0", "value",
                              "use_ue8m0=True needs use_fp8=True, round_scale=True (power-of-two scales) and "
                              f"hidden % 512 == 0 (four exponents per int32), got hidden {self.cfg.hidden}")
        return self.nvfp4(use_nvfp4, use_fp8, x_global_scale)

    def nvfp4(self, use_nvfp4: bool, use_fp8: bool, x_global_scale: object) -> Optional[torch.Tensor]:
        """NVFP4's flags and its global scale: a float32 tensor on the Buffer's device, shape [] or [k] with
        k >= 1 (the kernels read the first element, as DeepEP's does; vLLM passes one value per local expert,
        all equal). Its values are not read here: that would be a host sync in a call that must have none
        (CUDA graphs capture it); what a g that is not finite and positive gives is in moe_ep.comm.nvfp4's
        docstring, the same bytes on every backend."""
        cfg = self.cfg
        if not use_nvfp4:
            if x_global_scale is not None:
                raise input_error(ValueError, "x_global_scale", "value", "x_global_scale applies only with use_nvfp4=True")
            return None
        if use_fp8:
            raise input_error(ValueError, "use_nvfp4", "value",
                              "use_nvfp4=True and use_fp8=True exclude each other: pass use_fp8=False with NVFP4")
        block = nvfp4.constants().block
        if cfg.hidden % block:
            raise input_error(ValueError, "use_nvfp4", "value",
                              f"use_nvfp4=True needs hidden % {block} == 0 (one e4m3 scale per {block} channels), "
                              f"got hidden {cfg.hidden}")
        if x_global_scale is None:
            raise input_error(ValueError, "x_global_scale", "value",
                              "use_nvfp4=True needs x_global_scale, a float32 tensor holding the call's global scale")
        if not isinstance(x_global_scale, torch.Tensor):
            raise input_error(TypeError, "x_global_scale", "type",
                              f"x_global_scale must be a torch.Tensor, got {type(x_global_scale).__name__}")
        if x_global_scale.dtype != torch.float32:
            raise input_error(TypeError, "x_global_scale", "dtype",
                              f"x_global_scale must have dtype torch.float32, got {x_global_scale.dtype}")
        if x_global_scale.dim() > 1 or x_global_scale.numel() == 0:
            raise input_error(ValueError, "x_global_scale", "shape",
                              "x_global_scale must have shape [] or [k] (k >= 1, one value for the whole call), "
                              f"got {list(x_global_scale.shape)}")
        if x_global_scale.device != cfg.device:
            raise input_error(ValueError, "x_global_scale", "device",
                              f"x_global_scale must be on {cfg.device}, got {x_global_scale.device}")
        return x_global_scale

    def low_latency_combine(self, x: object, topk_idx: object, topk_weights: object, handle: LowLatencyHandle) -> None:
        """A low-latency combine's expert-major rows [E_l, R * T, H] bf16 and its routing of the handle's tokens."""
        cfg, n = self.cfg, handle.num_tokens
        check_tensor("x", x, (torch.bfloat16,), (cfg.num_local_experts, cfg.world_size * cfg.max_tokens_per_rank,
                                                 cfg.hidden), cfg.device)
        self.topk_idx(topk_idx, n)
        self.weights(topk_weights, n)
        check_aligned("x", x)

    def overlap(self, handle: LowLatencyHandle, overlap: object, packed_recv_count: object, comp_signal: object,
                block_m: object, threshold: object, num_sms: object) -> Optional[LowLatencyOverlap]:
        """low_latency_combine's single-batch-overlap arguments (None without overlap=True, where none
        of them may be given). packed_recv_count is DeepEP's (the dispatch's count, which the handle
        already holds): only its shape is checked."""
        cfg = self.cfg
        given = {"packed_recv_count": packed_recv_count, "comp_signal": comp_signal, "block_m": block_m,
                 "threshold": threshold, "num_sms": num_sms}
        if not overlap:
            extra = [name for name, value in given.items() if value is not None]
            if extra:
                raise input_error(ValueError, extra[0], "value",
                                  f"{', '.join(extra)} apply only with overlap=True (single-batch overlap)")
            return None
        missing = [name for name, value in given.items() if value is None]
        if missing:
            raise input_error(ValueError, "overlap", "value", f"overlap=True needs {', '.join(missing)}")
        check_tensor("packed_recv_count", packed_recv_count, (torch.int32,), tuple(handle.count.shape), cfg.device)
        for name in ("block_m", "threshold", "num_sms"):
            check_positive(name, given[name])
        num_sms = check_num_sms(num_sms, cfg.device)
        blocks = -(-cfg.world_size * cfg.max_tokens_per_rank // block_m)
        signal = check_tensor("comp_signal", comp_signal, (torch.int32,), (None,), cfg.device)
        if signal.numel() < cfg.num_local_experts * blocks:
            raise input_error(ValueError, "comp_signal", "shape",
                              f"comp_signal must have shape [*] with at least num_local_experts * ceil(R * T / block_m)"
                              f" = {cfg.num_local_experts * blocks} words, got {signal.numel()}")
        return LowLatencyOverlap(signal, block_m, threshold, num_sms, blocks)
