"""Buffer: the public communication object. Every input is validated here, once, before any backend
runs; backends below trust what they get."""
from __future__ import annotations

import itertools
from typing import Optional

import torch
import torch.distributed as dist

from . import _native, topology
from .backends.base import Backend, BufferConfig
from .types import (
    DispatchHandle,
    DispatchLayout,
    DispatchResult,
    EventHandle,
    LowLatencyCombineResult,
    LowLatencyDispatchResult,
    LowLatencyHandle,
)

DEFAULT_NUM_SMS = 24
_buffer_ids = itertools.count(1)


def _check_tensor(name: str, t: object, dtypes: tuple[torch.dtype, ...], shape: tuple[Optional[int], ...],
                  device: torch.device) -> torch.Tensor:
    """Type, dtype, rank, shape (None = any), device and contiguity of one input."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return t


def _check_aligned(name: str, t: torch.Tensor) -> torch.Tensor:
    """The kernels move rows as 16-byte vectors."""
    if t.data_ptr() % 16:
        raise ValueError(f"{name} must start at a 16-byte aligned address, got {t.data_ptr():#x}")
    return t


def _on_cpu(cfg: BufferConfig) -> bool:
    """On CPU a host-side check costs no device sync."""
    return cfg.device.type != "cuda"


def _device_of(group: dist.ProcessGroup, device: Optional[torch.device] = None) -> torch.device:
    """The device a Buffer's tensors live on: `device` when given (a CUDA device over a gloo group runs
    ranks that share a GPU, docs/one_gpu.md), else the current CUDA device for NCCL and the CPU otherwise."""
    nccl = dist.get_backend(group) == "nccl"
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    if isinstance(device, (str, int)):
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if not isinstance(device, torch.device) or device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be a CUDA or CPU torch.device, got {device!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device} but torch sees no CUDA device")
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        if device.index >= torch.cuda.device_count():
            raise ValueError(f"device={device} but torch sees {torch.cuda.device_count()} CUDA device(s)")
    elif nccl:
        raise ValueError("an NCCL group moves CUDA tensors only; device=cpu needs a gloo group")
    return device


def auto_backend(device: torch.device) -> tuple[str, str]:
    """The backend Buffer(backend="auto") picks for a group on `device`, and why. Groups that span
    nodes get the native backend too: it crosses nodes over NVSHMEM's network transports."""
    if device.type != "cuda":
        return "reference", f"the native backend needs CUDA tensors; this Buffer's device is {device.type}"
    ok, why = _native.available()
    return ("nvshmem", "moe_ep._C loads and the group runs on CUDA devices") if ok else ("reference", why)


def _pick_backend(name: str, device: torch.device) -> str:
    if name in ("reference", "nvshmem"):
        return name
    if name != "auto":
        raise ValueError(f"backend must be 'auto', 'reference' or 'nvshmem', got {name!r}")
    return auto_backend(device)[0]


def _check_ranks_per_node(ranks_per_node: Optional[int], world: int) -> None:
    """What a forced node size must satisfy before detection (no communication needed)."""
    if ranks_per_node is None:
        return
    if not isinstance(ranks_per_node, int) or isinstance(ranks_per_node, bool):
        raise TypeError(f"ranks_per_node must be an int or None, got {type(ranks_per_node).__name__}")
    if ranks_per_node <= 0:
        raise ValueError(f"ranks_per_node must be positive, got {ranks_per_node}")
    if ranks_per_node > topology.max_ranks_per_node():
        raise ValueError(f"ranks_per_node must be at most {topology.max_ranks_per_node()} (one NVLink domain), "
                         f"got {ranks_per_node}")
    if world % ranks_per_node:
        raise ValueError(f"ranks_per_node ({ranks_per_node}) must divide the group size ({world})")


def _resolve_topology(group: dist.ProcessGroup, ranks_per_node: Optional[int],
                      device: Optional[torch.device] = None) -> topology.Topology:
    """Collective: the detected topology, or the forced one if the hosts allow it."""
    _check_ranks_per_node(ranks_per_node, dist.get_world_size(group))
    topo = topology.resolve(group, ranks_per_node, device)
    if topo.ranks_per_node > topo.detected:
        raise ValueError(f"ranks_per_node={topo.ranks_per_node} exceeds the {topo.detected} ranks per node detected "
                         "(ranks on one host): a forced node size may only split a host's NVLink domain")
    return topo


class Buffer:
    """Expert-parallel dispatch/combine over a process group (see docs/api.md).

    Creating a Buffer is collective over `group`; so are close() and every communication call.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, *, hidden: int, num_experts: int, num_topk: int,
                 max_tokens_per_rank: int, backend: str = "auto", low_latency: bool = False,
                 num_sms: Optional[int] = None, timeout_s: float = 100.0,
                 ranks_per_node: Optional[int] = None, hierarchical: Optional[bool] = None,
                 fault_tolerant: bool = False, device: Optional[torch.device] = None) -> None:
        group = group if group is not None else dist.group.WORLD
        if not dist.is_initialized():
            raise RuntimeError("moe_ep.Buffer needs torch.distributed to be initialised (init_process_group)")
        world = dist.get_world_size(group)
        for name, value in (("hidden", hidden), ("num_experts", num_experts), ("num_topk", num_topk),
                            ("max_tokens_per_rank", max_tokens_per_rank)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if hidden % 8 != 0:
            raise ValueError(f"hidden must be a multiple of 8, got {hidden}")
        if num_experts % world != 0:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by the group size ({world})")
        max_topk = _native.constant("MAX_TOPK")
        if num_topk > max_topk:
            raise ValueError(f"num_topk must be at most {max_topk}, got {num_topk}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        device = _device_of(group, device)
        self.backend_name = _pick_backend(backend, device)
        if self.backend_name == "nvshmem" and device.type == "cuda" and _native.available()[0]:
            from .backends.symmetric import NvshmemSession

            NvshmemSession.check_usable()  # before the collectives below, which would wait for a lost peer
        if fault_tolerant and not (low_latency and self.backend_name == "nvshmem"):
            raise ValueError("fault_tolerant=True needs low_latency=True and the native backend (backend='nvshmem'): "
                             "only the low-latency kernels can mask a rank that went silent")
        topo = _resolve_topology(group, ranks_per_node, device)
        if hierarchical is not None and not isinstance(hierarchical, bool):
            raise TypeError(f"hierarchical must be None, True or False, got {hierarchical!r}")
        if hierarchical is False and topo.num_nodes > 1:
            raise ValueError(f"hierarchical=False needs one node, but the group spans {topo.num_nodes} nodes of "
                             f"{topo.ranks_per_node} ranks")
        self.cfg = BufferConfig(
            group=group, rank=dist.get_rank(group), world_size=world, hidden=hidden, num_experts=num_experts,
            num_topk=num_topk, max_tokens_per_rank=max_tokens_per_rank, low_latency=bool(low_latency),
            num_sms=self._check_num_sms(num_sms if num_sms is not None else DEFAULT_NUM_SMS, device, default=num_sms is None),
            timeout_s=float(timeout_s), buffer_id=next(_buffer_ids), device=device,
            ranks_per_node=topo.ranks_per_node, hierarchical=bool(hierarchical) or topo.num_nodes > 1,
            fault_tolerant=bool(fault_tolerant), ranks_per_gpu=topo.ranks_per_gpu,
        )
        self._backend: Optional[Backend] = self._make_backend()

    def _make_backend(self) -> Backend:
        if self.backend_name == "reference":
            from .backends.reference import ReferenceBackend

            return ReferenceBackend(self.cfg)
        if self.cfg.device.type != "cuda":
            raise RuntimeError("backend='nvshmem' needs CUDA tensors: give the Buffer an NCCL group, or a gloo group "
                               f"and device=torch.device('cuda', i); this Buffer's device is {self.cfg.device}")
        ok, why = _native.available()
        if not ok:
            raise RuntimeError(f"backend='nvshmem' is unavailable: {why}")
        most = _native.load().INTERNODE_MAX_RANKS
        if self.cfg.world_size > most:
            raise ValueError(f"backend='nvshmem' serves groups of at most {most} ranks, got {self.cfg.world_size}")
        from .backends.nvshmem import NvshmemBackend

        return NvshmemBackend(self.cfg)

    @staticmethod
    def _check_num_sms(num_sms: int, device: torch.device, default: bool = False) -> int:
        if not isinstance(num_sms, int) or isinstance(num_sms, bool) or num_sms <= 0:
            raise ValueError(f"num_sms must be a positive int, got {num_sms!r}")
        if device.type == "cuda":
            available = torch.cuda.get_device_properties(device).multi_processor_count
            if num_sms > available:
                if default:
                    return available
                raise ValueError(f"num_sms ({num_sms}) exceeds the {available} SMs of {device}")
        return num_sms

    # ---- properties -------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.cfg.rank

    @property
    def group_size(self) -> int:
        return self.cfg.world_size

    @property
    def ranks_per_node(self) -> int:
        """Ranks of one node (NVLink domain); node n holds ranks [n * ranks_per_node, (n + 1) * ranks_per_node)."""
        return self.cfg.ranks_per_node

    @property
    def num_nodes(self) -> int:
        return self.cfg.num_nodes

    @property
    def ranks_per_gpu(self) -> int:
        """The most ranks of the group that share one GPU (0 on CPU). Above 1 the ranks are
        time-sliced on their GPU: results are valid, timings say nothing about links."""
        return self.cfg.ranks_per_gpu

    @property
    def num_local_experts(self) -> int:
        return self.cfg.num_local_experts

    @property
    def device(self) -> torch.device:
        return self.cfg.device

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            raise RuntimeError("this Buffer is closed")
        return self._backend

    # ---- validation helpers -----------------------------------------------------------------
    def _check_tokens(self, n: int, what: str) -> None:
        if n > self.cfg.max_tokens_per_rank:
            raise ValueError(f"{what} has {n} tokens, above max_tokens_per_rank={self.cfg.max_tokens_per_rank}")

    @property
    def masked_ranks(self) -> list[int]:
        """Ranks a fault-tolerant low-latency Buffer stopped waiting for (they missed the timeout);
        later calls treat their experts as dropped. Always empty without fault_tolerant=True."""
        return self.backend.masked_ranks() if self.cfg.fault_tolerant else []

    def _check_topk_idx(self, topk_idx: object, n: Optional[int], check_values: bool) -> torch.Tensor:
        """Shape/dtype/alignment always; the value range too when asked (where the backend's kernels do
        not check every id themselves, without a host sync)."""
        cfg = self.cfg
        t = _check_aligned("topk_idx", _check_tensor("topk_idx", topk_idx, (torch.int64,), (n, cfg.num_topk),
                                                      cfg.device))
        self._check_tokens(t.shape[0], "topk_idx")
        capturing = cfg.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if t.numel() and check_values and not capturing:
            lo, hi = torch.stack(torch.aminmax(t)).tolist()  # one reduction, one host sync
            if lo < -1 or hi >= cfg.num_experts:
                raise ValueError(f"topk_idx values must lie in [-1, {cfg.num_experts}), got min {lo} and max {hi}")
        return t

    def _check_weights(self, topk_weights: object, n: int) -> torch.Tensor:
        return _check_aligned("topk_weights", _check_tensor("topk_weights", topk_weights, (torch.float32,),
                                                            (n, self.cfg.num_topk), self.cfg.device))

    def _check_x(self, x: object, fp8_ok: bool) -> torch.Tensor:
        dtypes = (torch.bfloat16, torch.float8_e4m3fn) if fp8_ok else (torch.bfloat16,)
        t = _check_tensor("x", x, dtypes, (None, self.cfg.hidden), self.cfg.device)
        self._check_tokens(t.shape[0], "x")
        return _check_aligned("x", t)

    def _check_fp8_hidden(self) -> None:
        if self.cfg.hidden % 128 != 0:
            raise ValueError(f"FP8 needs hidden to be a multiple of 128, got {self.cfg.hidden}")

    def _check_handle(self, handle: object, kind: type) -> None:
        if not isinstance(handle, kind):
            raise TypeError(f"handle must be a {kind.__name__}, got {type(handle).__name__}")
        if handle.buffer_id != self.cfg.buffer_id:
            raise ValueError("handle comes from another Buffer")

    def _sms(self, num_sms: Optional[int]) -> int:
        return self.cfg.num_sms if num_sms is None else self._check_num_sms(num_sms, self.cfg.device)

    @staticmethod
    def _check_event(previous_event: object) -> Optional[EventHandle]:
        if previous_event is not None and not isinstance(previous_event, EventHandle):
            raise TypeError(f"previous_event must be an EventHandle, got {type(previous_event).__name__}")
        return previous_event

    # ---- normal mode ------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor) -> DispatchLayout:
        """Tokens per rank and per expert, and the token->rank mask."""
        backend = self.backend
        return backend.get_dispatch_layout(self._check_topk_idx(topk_idx, None, not backend.checks_expert_ids))

    def dispatch(self, x: torch.Tensor, topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None, *, x_scales: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, handle: Optional[DispatchHandle] = None, worst_case: bool = False,
                 num_sms: Optional[int] = None,
                 previous_event: Optional[EventHandle] = None, async_op: bool = False) -> DispatchResult:
        """Send each token once to every rank holding one of its experts (docs/api.md)."""
        cfg = self.cfg
        x = self._check_x(x, fp8_ok=True)
        n = x.shape[0]
        if x.dtype == torch.float8_e4m3fn:
            self._check_fp8_hidden()
            if x_scales is None:
                raise ValueError("FP8 dispatch needs x_scales [N, hidden / 128] float32")
            _check_aligned("x_scales", _check_tensor("x_scales", x_scales, (torch.float32,), (n, cfg.num_scales),
                                                     cfg.device))
        elif x_scales is not None:
            raise ValueError("x_scales is only for FP8 (torch.float8_e4m3fn) x")
        if handle is not None:
            self._check_handle(handle, DispatchHandle)
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("a cached dispatch (handle=...) takes no topk_idx or topk_weights")
            if n != handle.num_tokens:
                raise ValueError(f"x has {n} tokens but the handle was made for {handle.num_tokens}")
        else:
            if topk_idx is None or topk_weights is None:
                raise ValueError("dispatch needs topk_idx and topk_weights (or a handle for a cached dispatch)")
            self._check_topk_idx(topk_idx, n, not self.backend.checks_expert_ids)
            self._check_weights(topk_weights, n)
        if not isinstance(expert_alignment, int) or isinstance(expert_alignment, bool) or expert_alignment < 1:
            raise ValueError(f"expert_alignment must be a positive int, got {expert_alignment!r}")
        return self.backend.dispatch(
            x, x_scales, topk_idx, topk_weights, handle=handle, expert_alignment=expert_alignment,
            worst_case=bool(worst_case), num_sms=self._sms(num_sms), previous_event=self._check_event(previous_event),
            async_op=bool(async_op),
        )

    def combine(self, x: torch.Tensor, handle: DispatchHandle, *, topk_weights: Optional[torch.Tensor] = None,
                num_sms: Optional[int] = None, previous_event: Optional[EventHandle] = None, async_op: bool = False):
        """Sum each token's rows (and topk_weights rows) back on its source rank (docs/api.md); returns out,
        (out, weights) with topk_weights, and the EventHandle last when async_op."""
        self._check_handle(handle, DispatchHandle)
        x = _check_tensor("x", x, (torch.bfloat16,), (handle.num_recv_rows, self.cfg.hidden), self.cfg.device)
        _check_aligned("x", x)
        if topk_weights is not None:
            self._check_weights(topk_weights, handle.num_recv_rows)
        out, weights, event = self.backend.combine(x, handle, topk_weights=topk_weights, num_sms=self._sms(num_sms),
                                                   previous_event=self._check_event(previous_event),
                                                   async_op=bool(async_op))
        result = (out,) if topk_weights is None else (out, weights)
        if async_op:
            result += (event,)
        return result if len(result) > 1 else out

    # ---- low-latency mode -------------------------------------------------------------------
    def _check_low_latency(self) -> None:
        if not self.cfg.low_latency:
            raise ValueError("low-latency calls need a Buffer created with low_latency=True")

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, *, use_fp8: bool = False,
                             round_scale: bool = False, return_recv_hook: bool = False) -> LowLatencyDispatchResult:
        """Expert-major dispatch with fixed capacity and no host sync (docs/api.md)."""
        self._check_low_latency()
        x = self._check_x(x, fp8_ok=False)
        self._check_topk_idx(topk_idx, x.shape[0], check_values=_on_cpu(self.cfg))
        if use_fp8:
            self._check_fp8_hidden()
        elif round_scale:
            raise ValueError("round_scale applies only with use_fp8=True")
        return self.backend.low_latency_dispatch(x, topk_idx, use_fp8=bool(use_fp8), round_scale=bool(round_scale),
                                                 return_recv_hook=bool(return_recv_hook))

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: LowLatencyHandle, *, return_recv_hook: bool = False) -> LowLatencyCombineResult:
        """Weighted sum of each token's expert outputs, ascending k, one rounding (docs/api.md)."""
        cfg = self.cfg
        self._check_low_latency()
        self._check_handle(handle, LowLatencyHandle)
        slots = cfg.world_size * cfg.max_tokens_per_rank
        _check_tensor("x", x, (torch.bfloat16,), (cfg.num_local_experts, slots, cfg.hidden), cfg.device)
        self._check_topk_idx(topk_idx, handle.num_tokens, check_values=_on_cpu(cfg))
        self._check_weights(topk_weights, handle.num_tokens)
        _check_aligned("x", x)
        return self.backend.low_latency_combine(x, topk_idx, topk_weights, handle,
                                                return_recv_hook=bool(return_recv_hook))

    # ---- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Free communication resources (collective)."""
        if self._backend is not None:
            self._backend.close()
            self._backend = None

    def abort(self) -> None:
        """Give this Buffer up without its peers (not collective), after a CommTimeoutError or with
        masked ranks, when a peer may be dead: close() would wait for it forever. Frees nothing that
        needs the peers; NVSHMEM is then unusable in this process (docs/api.md, Errors)."""
        if self._backend is not None:
            self._backend.abort()
            self._backend = None

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
