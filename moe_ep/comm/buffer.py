"""Buffer: the public communication object. Every input is validated here, once, before any backend
runs; backends below trust what they get. Every rank makes the same collective calls whatever its
inputs: a rank whose input is rejected makes the call on stand-in inputs, its stamp saying so
(moe_ep.comm.call_check), then raises; its peers raise PeerInputError once the stamps are in."""
from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, Callable, NoReturn, Optional, TypeVar

import torch
import torch.distributed as dist

from . import _native, at_exit, nvfp4, topology
from .backends.base import Backend, BufferConfig, record_event
from .backends.engine import own_group
from .call_check import (
    CACHED,
    COMBINE,
    DISPATCH,
    LL_COMBINE,
    LL_DISPATCH,
    NVFP4_ROWS,
    CallOrder,
    CallStamp,
    HostCheck,
    OwnRejection,
)
from .config import DEFAULT_NUM_SMS, PER_BUFFER, Config
from .errors import BadExpertIdError
from .streams import CommStream
from .types import (
    DispatchHandle,
    DispatchLayout,
    DispatchResult,
    EventHandle,
    LowLatencyCombineResult,
    LowLatencyDispatchResult,
    LowLatencyHandle,
    LowLatencyOverlap,
)

_buffer_ids = itertools.count(1)
_LowLatencyResult = TypeVar("_LowLatencyResult", LowLatencyDispatchResult, LowLatencyCombineResult)
_Result = TypeVar("_Result")


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
    return ("nvshmem", "moe_ep.comm._C loads and the group runs on CUDA devices") if ok else ("reference", why)


def _pick_backend(name: str, device: torch.device, world: int) -> str:
    """The backend's name; for the native one, what it needs of this rank (checked before any collective)."""
    if name not in ("auto", "reference", "nvshmem"):
        raise ValueError(f"backend must be 'auto', 'reference' or 'nvshmem', got {name!r}")
    name = auto_backend(device)[0] if name == "auto" else name
    if name == "nvshmem":
        if device.type != "cuda":
            raise RuntimeError("backend='nvshmem' needs CUDA tensors: give the Buffer an NCCL group, or a gloo group "
                               f"and device=torch.device('cuda', i); this Buffer's device is {device}")
        ok, why = _native.available()
        if not ok:
            raise RuntimeError(f"backend='nvshmem' is unavailable: {why}")
        most = _native.load().INTERNODE_MAX_RANKS
        if world > most:
            raise ValueError(f"backend='nvshmem' serves groups of at most {most} ranks, got {world}")
    return name


def _check_num_sms(num_sms: int, device: torch.device, default: bool = False) -> int:
    """A positive int within the device's SMs; the default is clipped to them instead."""
    if not isinstance(num_sms, int) or isinstance(num_sms, bool) or num_sms <= 0:
        raise ValueError(f"num_sms must be a positive int, got {num_sms!r}")
    if device.type == "cuda":
        available = torch.cuda.get_device_properties(device).multi_processor_count
        if num_sms > available:
            if default:
                return available
            raise ValueError(f"num_sms ({num_sms}) exceeds the {available} SMs of {device}")
    return num_sms


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


def _local_settings(group: dist.ProcessGroup, world: int, *, hidden: Any, num_experts: Any, num_topk: Any,
                    max_tokens_per_rank: Any, backend: Any, low_latency: Any, num_sms: Any, timeout_s: Any,
                    ranks_per_node: Any, hierarchical: Any, fault_tolerant: Any, check_calls: Any,
                    device: Any, config: Any) -> tuple[dict[str, Any], torch.device]:
    """This rank's Buffer arguments checked on their own (no communication): what every rank must agree
    on, in the order a mismatch is reported (the resolved Config last), and the Buffer's device."""
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
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
    device = _device_of(group, device)
    name = _pick_backend(backend, device, world)
    if fault_tolerant and not low_latency:
        raise ValueError("fault_tolerant=True needs low_latency=True: only the low-latency calls skip masked ranks")
    _check_ranks_per_node(ranks_per_node, world)
    if hierarchical is not None and not isinstance(hierarchical, bool):
        raise TypeError(f"hierarchical must be None, True or False, got {hierarchical!r}")
    if not isinstance(check_calls, bool):
        raise TypeError(f"check_calls must be True or False, got {check_calls!r}")
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"config must be a moe_ep.Config, got {type(config).__name__}")
    knobs = config if config is not None else Config.from_env()  # the environment gives defaults only
    if num_sms is not None:
        knobs = knobs.replace(num_sms=num_sms)
    sms = _check_num_sms(knobs.num_sms if knobs.num_sms is not None else DEFAULT_NUM_SMS, device,
                         default=knobs.num_sms is None)
    if knobs.low_latency_num_sms is not None:
        if not low_latency:
            raise ValueError("Config.low_latency_num_sms needs low_latency=True (it sizes the low-latency kernels' grid)")
        _check_num_sms(knobs.low_latency_num_sms, device)
    return {
        "backend": name, "device type": device.type, "hidden": hidden, "num_experts": num_experts,
        "num_topk": num_topk, "max_tokens_per_rank": max_tokens_per_rank, "low_latency": bool(low_latency),
        "num_sms": sms, "timeout_s": float(timeout_s), "ranks_per_node": ranks_per_node,
        "hierarchical": hierarchical, "fault_tolerant": bool(fault_tolerant), "check_calls": check_calls,
        "config": knobs.replace(num_sms=sms),
    }, device


_ERRORS = {"TypeError": TypeError, "ValueError": ValueError}  # what a peer's rejection is re-raised as
_RESOLVED = ("ranks_per_node", "hierarchical")  # compared as the topology resolves them


def _agree(group: dist.ProcessGroup, settings: Optional[dict[str, Any]],
           error: Optional[Exception]) -> list[dict[str, Any]]:
    """Collective (one all_gather_object, before anything is allocated): raises on every rank when a rank's
    arguments were invalid (`error`, None for valid `settings`) or a setting differs between ranks, so
    that no rank goes on to allocate and wait for peers that will never join it. Returns every rank's
    settings; ranks_per_node and hierarchical are compared once resolved (_check_same_topology)."""
    mine = (type(error).__name__, str(error)) if error is not None else settings
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    if error is not None:
        raise error
    failed = [(rank, got) for rank, got in enumerate(everyone) if isinstance(got, tuple)]
    if failed:
        rank, (kind, message) = failed[0]
        raise _ERRORS.get(kind, RuntimeError)(
            f"rank {rank} rejected its Buffer arguments ({kind}: {message}); creating a Buffer is collective, "
            "so no rank created it")
    _check_same([{k: v for k, v in got.items() if k not in _RESOLVED} for got in everyone])
    return everyone


def _check_same(settings: list[dict[str, Any]]) -> None:
    """ValueError naming the first setting whose value differs between ranks, and every rank's value."""
    for key, value in settings[0].items():
        values = [got[key] for got in settings]
        if any(v != value for v in values):
            raise ValueError(f"every rank must create the Buffer with the same {key}; got "
                             + ", ".join(f"{v!r} on rank {r}" for r, v in enumerate(values)))


def _check_same_topology(everyone: list[dict[str, Any]], detected: int) -> None:
    """ranks_per_node and hierarchical as every rank resolves them (None: the detected node size; the
    cross-node kernels when the group spans nodes) must agree too; `detected` is the same on every rank."""
    world = len(everyone)
    resolved = []
    for got in everyone:
        size = detected if got["ranks_per_node"] is None else got["ranks_per_node"]
        hierarchical = got["hierarchical"] if got["hierarchical"] is not None else world // size > 1
        resolved.append({"ranks_per_node": size, "hierarchical": hierarchical})
    _check_same(resolved)


def _check_ranks_per_gpu(backend: str, ranks_per_gpu: int) -> None:
    """NVSHMEM serves at most MAX_RANKS_PER_GPU ranks sharing one GPU and crashes in its init beyond
    (csrc/runtime/limits.h); every rank has the same count (the topology's exchange), so all raise alike."""
    most = _native.constant("MAX_RANKS_PER_GPU")
    if backend == "nvshmem" and ranks_per_gpu > most:
        raise ValueError(f"moe_ep: {ranks_per_gpu} ranks of the group share one GPU, but NVSHMEM serves at most "
                         f"{most} processes per GPU (its init would crash): use at most {most} ranks per GPU, "
                         "or backend='reference'")


def _take_part(error: Exception, standin: Callable[[], object]) -> NoReturn:
    """Make the call on stand-in inputs whose stamp carries the rejection, so that every peer's exchange
    finds this rank (and raises PeerInputError where the call checks stamps), then raise this rank's
    `error`: one rank's bad input must not desynchronise the group (docs/api.md, Errors)."""
    try:
        standin()
    except OwnRejection:
        pass
    raise error


def _raise_after_receive(error: Exception, run: Callable[[], _LowLatencyResult]) -> _LowLatencyResult:
    """A low-latency call that takes part for rejected input: raise once it ran, or, with a receive
    hook, from the hook once it has received (the peers' receive waits for this rank's sends)."""
    try:
        result = run()
    except OwnRejection:
        raise error from None
    if result.hook is None:
        raise error
    hook = result.hook

    def receive() -> None:
        try:
            hook()
        except OwnRejection:
            pass
        raise error

    result.hook = receive
    return result


def _kernel_found_ids() -> BadExpertIdError:
    """What a rank raises when its stamp says its kernels found a bad expert id and no record says which."""
    return BadExpertIdError("topk_idx held an expert id outside [-1, num_experts) (found by the kernels; the call "
                            "treated it as -1 and every rank raised)")


class Buffer:
    """Expert-parallel dispatch/combine over a process group (see docs/api.md).

    Creating a Buffer is collective over `group`; so are close() and every communication call.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, *, hidden: int, num_experts: int, num_topk: int,
                 max_tokens_per_rank: int, backend: str = "auto", low_latency: bool = False,
                 num_sms: Optional[int] = None, timeout_s: float = 100.0,
                 ranks_per_node: Optional[int] = None, hierarchical: Optional[bool] = None,
                 fault_tolerant: bool = False, check_calls: bool = False, device: Optional[torch.device] = None,
                 config: Optional[Config] = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("moe_ep.Buffer needs torch.distributed to be initialised (init_process_group)")
        group = group if group is not None else dist.group.WORLD
        if dist.get_rank(group) < 0:
            raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the Buffer's group: "
                             "create a Buffer on the ranks of its group only")
        world = dist.get_world_size(group)
        settings: Optional[dict[str, Any]] = None
        error: Optional[Exception] = None
        try:
            settings, device = _local_settings(
                group, world, hidden=hidden, num_experts=num_experts, num_topk=num_topk,
                max_tokens_per_rank=max_tokens_per_rank, backend=backend, low_latency=low_latency, num_sms=num_sms,
                timeout_s=timeout_s, ranks_per_node=ranks_per_node, hierarchical=hierarchical,
                fault_tolerant=fault_tolerant, check_calls=check_calls, device=device, config=config)
        except (TypeError, ValueError, RuntimeError) as e:
            error = e
        if settings is not None and settings["backend"] == "nvshmem":
            from .backends.symmetric import NvshmemSession

            NvshmemSession.check_usable()  # before the collectives below, which would wait for a lost peer
        everyone = _agree(group, settings, error)
        self.backend_name: str = settings["backend"]
        topo = _resolve_topology(group, ranks_per_node, device)  # collective
        _check_same_topology(everyone, topo.detected)
        _check_ranks_per_gpu(self.backend_name, topo.ranks_per_gpu)
        if hierarchical is False and topo.num_nodes > 1:
            raise ValueError(f"hierarchical=False needs one node, but the group spans {topo.num_nodes} nodes of "
                             f"{topo.ranks_per_node} ranks")
        self.cfg = BufferConfig(
            group=group, rank=dist.get_rank(group), world_size=world, hidden=hidden, num_experts=num_experts,
            num_topk=num_topk, max_tokens_per_rank=max_tokens_per_rank, low_latency=bool(low_latency),
            num_sms=settings["num_sms"], timeout_s=float(timeout_s), buffer_id=next(_buffer_ids), device=device,
            ranks_per_node=topo.ranks_per_node, hierarchical=bool(hierarchical) or topo.num_nodes > 1,
            fault_tolerant=bool(fault_tolerant), ranks_per_gpu=topo.ranks_per_gpu, config=settings["config"],
        )
        self._check_path_sms(self.cfg.num_sms)
        self._backend: Optional[Backend] = self._make_backend()
        self._comm = CommStream(device)
        self._calls = CallOrder()  # numbers the communicating calls (moe_ep.comm.call_check)
        # check_calls=True: every call's stamps meet on the host first (the reference backend checks in band)
        self._host_check: Optional[HostCheck] = None
        if check_calls and self.backend_name != "reference":
            self._host_check = HostCheck(own_group(group, self.cfg.timeout_s), self.cfg.rank, self.cfg.timeout_s)
        at_exit.track(self.cfg.buffer_id, self)  # left with its peers at exit (moe_ep.comm.at_exit)

    def _checked(self, stamp: CallStamp, call: Callable[[], _Result]) -> _Result:
        """Runs a backend call; with check_calls=True on the native backend the ranks' stamps first meet
        on the host (every call, so ranks making different calls meet there too), raising on every rank
        alike before anything launches."""
        if self._host_check is not None:
            self._host_check.verify(stamp)
        return call()

    def _make_backend(self) -> Backend:
        if self.backend_name == "reference":
            from .backends.reference import ReferenceBackend

            return ReferenceBackend(self.cfg)
        from .backends.nvshmem import NvshmemBackend

        return NvshmemBackend(self.cfg)

    def __repr__(self) -> str:
        cfg = self.cfg
        state = "closed" if self._backend is None else f"backend={self.backend_name!r}"
        return (f"moe_ep.Buffer({state}, rank={cfg.rank} of {cfg.world_size}, hidden={cfg.hidden}, "
                f"num_experts={cfg.num_experts}, num_topk={cfg.num_topk}, max_tokens_per_rank={cfg.max_tokens_per_rank}, "
                f"low_latency={cfg.low_latency}, device={str(cfg.device)!r}, ranks_per_node={cfg.ranks_per_node})")

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
    def normal_path(self) -> str:
        """Which kernels serve normal mode: "reference", "nvlink" (one node) or "cross-node"
        (several nodes, or hierarchical=True)."""
        return self.backend.normal_path

    def fill_workspace(self, value: int) -> None:
        """A testing aid (local, not collective): set every byte of this rank's normal-mode symmetric
        workspace to `value` (0..255), so rows a call fails to write cannot pass for results. Call it
        only while no rank is inside a call of this Buffer (e.g. between barriers); it returns once the
        bytes are set, so a barrier after it orders them before any peer's next write (a fill still
        queued would overwrite what a peer's next call put here); nothing on the reference backend."""
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 255:
            raise ValueError(f"value must be a byte (0..255), got {value!r}")
        self.backend.fill_workspace(value)
        if self.cfg.device.type == "cuda":
            torch.cuda.synchronize(self.cfg.device)

    @property
    def config(self) -> Config:
        """The Buffer's kernel knobs, num_sms resolved (moe_ep.Config); a call may override them."""
        return self.cfg.config

    @property
    def num_local_experts(self) -> int:
        return self.cfg.num_local_experts

    @property
    def max_tokens_per_rank(self) -> int:
        """Tokens per rank of one round of the normal-mode workspace (what its memory is sized for): the
        most a static-shape call (worst_case=True, low latency) may carry; an exact-size call streams any
        number through it in rounds of this many."""
        return self.cfg.max_tokens_per_rank

    @property
    def device(self) -> torch.device:
        return self.cfg.device

    @property
    def comm_stream(self) -> CommStream:
        """The communication stream async calls run on (moe_ep.comm.streams; created on first use)."""
        return self._comm

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            raise RuntimeError("this Buffer is closed")
        return self._backend

    # ---- validation helpers -----------------------------------------------------------------
    def _check_tokens(self, n: int, what: str, capped: bool) -> None:
        """Calls with static shapes (worst-case mode, low latency) hold at most max_tokens_per_rank tokens;
        exact-size normal calls stream any number through the workspace in rounds of that size."""
        if capped and n > self.cfg.max_tokens_per_rank:
            raise ValueError(f"{what} has {n} tokens, above max_tokens_per_rank={self.cfg.max_tokens_per_rank}, the "
                             "most a static-shape call (worst_case=True or low latency) may carry; exact-size normal "
                             "calls take any number")

    @property
    def masked_ranks(self) -> list[int]:
        """Ranks a fault-tolerant low-latency Buffer skips: set with set_rank_masked, or (native backend)
        masked when they missed the timeout; their experts count as dropped. Always empty without
        fault_tolerant=True. Reads the device mask after the current stream's work."""
        if not self.cfg.fault_tolerant:
            return []
        return torch.nonzero(self.backend.rank_mask()).flatten().tolist()

    @property
    def rank_mask(self) -> torch.Tensor:
        """The fault-tolerant mask itself: int32 [R] on the Buffer's device, 1 per masked rank (read it
        without a host sync, as DeepEP's low_latency_query_mask_buffer does). Do not write it: use
        set_rank_masked / clear_rank_masks."""
        self._check_fault_tolerant("rank_mask")
        return self.backend.rank_mask()

    def set_rank_masked(self, rank: int, masked: bool = True) -> None:
        """Local: this rank's later low-latency calls skip `rank` (masked=True: send it nothing, wait for
        nothing from it, its experts dropped) or include it again (False). Stream-ordered, no host sync.
        Ranks that stay in the group must agree on the mask, as with DeepEP's mask buffer."""
        self._check_fault_tolerant("set_rank_masked")
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.cfg.world_size:
            raise ValueError(f"rank must be an int in [0, {self.cfg.world_size}), got {rank!r}")
        if rank == self.cfg.rank:
            raise ValueError(f"rank {rank} cannot mask itself")
        self.backend.rank_mask()[rank] = int(bool(masked))

    def clear_rank_masks(self) -> None:
        """Local: unmask every rank (stream-ordered)."""
        self._check_fault_tolerant("clear_rank_masks")
        self.backend.rank_mask().zero_()

    def _check_fault_tolerant(self, what: str) -> None:
        if not self.cfg.fault_tolerant:
            raise ValueError(f"{what} needs a Buffer created with low_latency=True, fault_tolerant=True")

    def _check_topk_idx(self, topk_idx: object, n: Optional[int], capped: bool = True) -> torch.Tensor:
        """Shape, dtype, device, contiguity, alignment and token count (capped: _check_tokens); the
        values: _in_range_ids."""
        cfg = self.cfg
        t = _check_aligned("topk_idx", _check_tensor("topk_idx", topk_idx, (torch.int64,), (n, cfg.num_topk),
                                                      cfg.device))
        self._check_tokens(t.shape[0], "topk_idx", capped)
        return t

    def _in_range_ids(self, topk_idx: torch.Tensor) -> tuple[torch.Tensor, Optional[ValueError]]:
        """topk_idx with every id outside [-1, E) set to -1, and the ValueError the call raises once its
        communication is done, on backends whose kernels do not check each id themselves (a host check:
        one reduction, one sync; none while a CUDA graph is being captured)."""
        cfg = self.cfg
        capturing = cfg.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if self.backend.checks_expert_ids or not topk_idx.numel() or capturing:
            return topk_idx, None
        lo, hi = torch.stack(torch.aminmax(topk_idx)).tolist()
        if lo >= -1 and hi < cfg.num_experts:
            return topk_idx, None
        error = BadExpertIdError(f"topk_idx values must lie in [-1, {cfg.num_experts}), got min {lo} and max {hi}")
        return torch.where((topk_idx >= -1) & (topk_idx < cfg.num_experts), topk_idx, -1), error

    def _check_weights(self, topk_weights: object, n: int) -> torch.Tensor:
        return _check_aligned("topk_weights", _check_tensor("topk_weights", topk_weights, (torch.float32,),
                                                            (n, self.cfg.num_topk), self.cfg.device))

    def _check_x(self, x: object, fp8_ok: bool, capped: bool = True) -> torch.Tensor:
        dtypes = (torch.bfloat16, torch.float8_e4m3fn) if fp8_ok else (torch.bfloat16,)
        t = _check_tensor("x", x, dtypes, (None, self.cfg.hidden), self.cfg.device)
        self._check_tokens(t.shape[0], "x", capped)
        return _check_aligned("x", t)

    def _check_fp8_hidden(self) -> None:
        if self.cfg.hidden % 128 != 0:
            raise ValueError(f"FP8 needs hidden to be a multiple of 128, got {self.cfg.hidden}")

    def _check_handle(self, handle: object, kind: type) -> None:
        if not isinstance(handle, kind):
            raise TypeError(f"handle must be a {kind.__name__}, got {type(handle).__name__}")
        if handle.buffer_id != self.cfg.buffer_id:
            raise ValueError("handle comes from another Buffer")

    def _knobs(self, num_sms: Optional[int], config: Optional[Config]) -> tuple[int, Config]:
        """A call's SM budget and kernel knobs: num_sms, else config.num_sms, else the Buffer's; the knobs
        of `config`, else the Buffer's. A call may not change what sizes the Buffer's memory."""
        knobs = self.cfg.config
        if config is not None:
            if not isinstance(config, Config):
                raise TypeError(f"config must be a moe_ep.Config, got {type(config).__name__}")
            fixed = [name for name in PER_BUFFER if getattr(config, name) != getattr(knobs, name)]
            if fixed:
                raise ValueError(f"Config.{fixed[0]} is fixed when the Buffer is made ({getattr(knobs, fixed[0])}); "
                                 f"a call cannot change it (got {getattr(config, fixed[0])})")
            sms = config.num_sms if config.num_sms is not None else knobs.num_sms
            knobs = config
        else:
            sms = knobs.num_sms
        # the SM budget travels on its own: no Config is built per call
        return self._check_path_sms(_check_num_sms(num_sms if num_sms is not None else sms, self.cfg.device)), knobs

    def _check_path_sms(self, sms: int) -> int:
        """The SM budget within what the normal path's kernels take: the cross-node kernels run one block
        per channel, at most INTERNODE_MAX_CHANNELS (a larger budget is an error, not a silent cap)."""
        most = _native.constant("INTERNODE_MAX_CHANNELS")
        if self.cfg.hierarchical and self.backend_name == "nvshmem" and sms > most:
            raise ValueError(f"num_sms ({sms}) exceeds the {most} channels (SMs) the cross-node kernels run; "
                             f"pass num_sms <= {most}")
        return sms

    @staticmethod
    def _check_event(previous_event: object) -> Optional[EventHandle]:
        if previous_event is not None and not isinstance(previous_event, EventHandle):
            raise TypeError(f"previous_event must be an EventHandle, got {type(previous_event).__name__}")
        return previous_event

    # ---- stand-ins for rejected input (docs/api.md, Errors) -----------------------------------
    def _zero_rows(self, lead: tuple[int, ...], fp8: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Zero rows [*lead, H] (bf16, or e4m3 with zero scales) in place of rejected ones."""
        cfg = self.cfg
        dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        scales = torch.zeros(*lead, cfg.num_scales, dtype=torch.float32, device=cfg.device) if fp8 else None
        return torch.zeros(*lead, cfg.hidden, dtype=dtype, device=cfg.device), scales

    def _no_routing(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """topk_idx and topk_weights of n tokens that go nowhere."""
        cfg = self.cfg
        return (torch.full((n, cfg.num_topk), -1, dtype=torch.int64, device=cfg.device),
                torch.zeros(n, cfg.num_topk, dtype=torch.float32, device=cfg.device))

    def _fp8_rows(self, x: object) -> bool:
        """Whether a dispatch moves FP8 rows, which sets the size of what it exchanges (every rank must agree):
        x is e4m3 and hidden allows FP8. A rejected x of another dtype counts as bf16."""
        return isinstance(x, torch.Tensor) and x.dtype == torch.float8_e4m3fn and self.cfg.hidden % 128 == 0

    # ---- normal mode ------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, *, previous_event: Optional[EventHandle] = None,
                            async_op: bool = False) -> DispatchLayout:
        """Tokens per rank and per expert, and the token->rank mask (with async_op: on the communication
        stream, the layout's event set). No backend communicates here, so bad input raises at once."""
        topk_idx, bad_ids = self._in_range_ids(self._check_topk_idx(topk_idx, None, capped=False))
        if bad_ids is not None:
            raise bad_ids
        previous_event = self._check_event(previous_event)

        def work() -> DispatchLayout:
            layout = self.backend.get_dispatch_layout(topk_idx)
            return dataclasses.replace(layout, event=record_event(bool(async_op), self.cfg.device))

        return self._comm.run(work, previous_event=previous_event, async_op=bool(async_op), inputs=(topk_idx,))

    @staticmethod
    def _check_expert_major(expert_major: object, handle: Optional[DispatchHandle], expert_alignment: object) -> bool:
        """Whether a dispatch gives pairs: expert_major as given, None meaning no for a fresh dispatch
        and the handle's kind for a cached one. With worst_case the pairs are a static bound
        (expert_major.worst_case_pairs); a cached dispatch keeps its handle's layout."""
        if expert_major is not None and not isinstance(expert_major, bool):
            raise TypeError(f"expert_major must be None, True or False, got {expert_major!r}")
        layout = handle.expert_major if handle is not None else None
        if handle is None:
            return bool(expert_major)
        if expert_major and layout is None:
            raise ValueError("expert_major=True with a handle needs the handle of an expert-major dispatch")
        if expert_major is not False and layout is not None and expert_alignment not in (1, layout.alignment):
            raise ValueError(f"a cached expert-major dispatch keeps its handle's layout (expert_alignment="
                             f"{layout.alignment}); got expert_alignment={expert_alignment}")
        return layout is not None if expert_major is None else expert_major

    def _check_dispatch(self, x: object, x_scales: object, topk_idx: object, topk_weights: object,
                        handle: Optional[DispatchHandle], expert_alignment: object, worst_case: bool) -> None:
        """Every tensor argument of a dispatch and expert_alignment (the handle is checked before)."""
        cfg = self.cfg
        x = self._check_x(x, fp8_ok=True, capped=worst_case)
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
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("a cached dispatch (handle=...) takes no topk_idx or topk_weights")
            if n != handle.num_tokens:
                raise ValueError(f"x has {n} tokens but the handle was made for {handle.num_tokens}")
        else:
            if topk_idx is None or topk_weights is None:
                raise ValueError("dispatch needs topk_idx and topk_weights (or a handle for a cached dispatch)")
            self._check_topk_idx(topk_idx, n, capped=worst_case)
            self._check_weights(topk_weights, n)
        if not isinstance(expert_alignment, int) or isinstance(expert_alignment, bool) or expert_alignment < 1:
            raise ValueError(f"expert_alignment must be a positive int, got {expert_alignment!r}")

    def dispatch(self, x: torch.Tensor, topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None, *, x_scales: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, handle: Optional[DispatchHandle] = None, worst_case: bool = False,
                 expert_major: Optional[bool] = None, num_sms: Optional[int] = None, config: Optional[Config] = None,
                 previous_event: Optional[EventHandle] = None, async_op: bool = False) -> DispatchResult:
        """Send each token once to every rank holding one of its experts (docs/api.md); expert_major:
        the received rows as (row, local expert) pairs grouped by expert. Rejected arguments: this
        rank takes part as a rank without tokens (a cached dispatch: with zero rows), then raises; its
        peers raise PeerInputError where the call checks its stamps (docs/api.md, Errors)."""
        if handle is not None:
            self._check_handle(handle, DispatchHandle)
        sms, knobs = self._knobs(num_sms, config)
        previous_event = self._check_event(previous_event)
        kind, made_by = (DISPATCH, 0) if handle is None else (CACHED, handle.call)
        fp8 = int(self._fp8_rows(x))

        def run(*args: Any, stamp: CallStamp, **kwargs: Any) -> DispatchResult:
            """The backend's dispatch under the stream rule of moe_ep.comm.streams."""
            work = functools.partial(self.backend.dispatch, *args, handle=handle, worst_case=bool(worst_case),
                                     num_sms=sms, knobs=knobs, async_op=bool(async_op), stamp=stamp, **kwargs)
            return self._checked(stamp, lambda: self._comm.run(work, previous_event=previous_event,
                                                               async_op=bool(async_op), inputs=(args, handle)))

        try:
            self._check_dispatch(x, x_scales, topk_idx, topk_weights, handle, expert_alignment,
                                 bool(worst_case) and handle is None)
            expert_major = self._check_expert_major(expert_major, handle, expert_alignment)
        except (TypeError, ValueError) as error:
            stamp = self._calls.stamp(kind, made_by, fp8, error)
            rows, scales = self._zero_rows((0 if handle is None else handle.num_tokens,), bool(fp8))
            idx, weights = self._no_routing(0) if handle is None else (None, None)
            _take_part(error, lambda: run(rows, scales, idx, weights, stamp=stamp, expert_alignment=1,
                                          expert_major=False))
        bad_ids = None
        if handle is None:
            topk_idx, bad_ids = self._in_range_ids(topk_idx)
        stamp = self._calls.stamp(kind, made_by, fp8, bad_ids)
        try:
            result = run(x, x_scales, topk_idx, topk_weights, stamp=stamp, expert_alignment=expert_alignment,
                         expert_major=expert_major)
        except OwnRejection:
            raise (bad_ids if bad_ids is not None else _kernel_found_ids()) from None
        if bad_ids is not None:
            raise bad_ids
        if handle is None:
            result.handle.call = stamp.call
        return result

    def _check_combine(self, x: object, handle: DispatchHandle, topk_weights: object, pair_weights: object) -> None:
        """A combine's tensors: rows [M, H] bf16 (16-byte aligned, the kernels read them) and topk_weights
        [M, K]; for an expert-major handle pairs [P, H] bf16 or float32 (summed into fresh rows first),
        topk_weights [P] and pair_weights [P] float32."""
        cfg, layout = self.cfg, handle.expert_major
        if layout is None:
            if pair_weights is not None:
                raise ValueError("pair_weights needs the handle of an expert-major dispatch (expert_major=True)")
            _check_aligned("x", _check_tensor("x", x, (torch.bfloat16,), (handle.num_recv_rows, cfg.hidden), cfg.device))
            if topk_weights is not None:
                self._check_weights(topk_weights, handle.num_recv_rows)
            return
        p = layout.num_pairs
        _check_tensor("x", x, (torch.bfloat16, torch.float32), (p, cfg.hidden), cfg.device)
        for name, t in (("topk_weights", topk_weights), ("pair_weights", pair_weights)):
            if t is not None:
                _check_tensor(name, t, (torch.float32,), (p,), cfg.device)

    def combine(self, x: torch.Tensor, handle: DispatchHandle, *, topk_weights: Optional[torch.Tensor] = None,
                pair_weights: Optional[torch.Tensor] = None, num_sms: Optional[int] = None,
                config: Optional[Config] = None, previous_event: Optional[EventHandle] = None, async_op: bool = False):
        """Sum each token's rows (and topk_weights rows) back on its source rank (docs/api.md); returns out,
        (out, weights) with topk_weights, and the EventHandle last when async_op. An expert-major
        handle's combine takes pairs and sums each row's first (pair_weights: times each pair's weight).
        Rejected tensors: this rank sends zero rows (and weights) back, then raises; its peers raise
        PeerInputError where the call checks its stamps (docs/api.md, Errors)."""
        self._check_handle(handle, DispatchHandle)
        sms, knobs = self._knobs(num_sms, config)
        previous_event = self._check_event(previous_event)
        with_weights = int(topk_weights is not None)

        def run(x: torch.Tensor, stamp: CallStamp,
                **kwargs: Any) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[EventHandle]]:
            """The backend's combine under the stream rule of moe_ep.comm.streams."""
            work = functools.partial(self.backend.combine, x, handle=handle, num_sms=sms, knobs=knobs,
                                     async_op=bool(async_op), stamp=stamp, **kwargs)
            return self._checked(stamp, lambda: self._comm.run(work, previous_event=previous_event,
                                                               async_op=bool(async_op), inputs=(x, handle, kwargs)))

        try:
            self._check_combine(x, handle, topk_weights, pair_weights)
        except (TypeError, ValueError) as error:
            stamp = self._calls.stamp(COMBINE, handle.call, with_weights, error)
            layout = handle.expert_major
            m = handle.num_recv_rows if layout is None else layout.num_pairs
            rows, _ = self._zero_rows((m,), False)
            shape = (m, self.cfg.num_topk) if layout is None else (m,)
            weights = torch.zeros(shape, dtype=torch.float32, device=self.cfg.device) if with_weights else None
            _take_part(error, lambda: run(rows, stamp, topk_weights=weights, pair_weights=None))
        stamp = self._calls.stamp(COMBINE, handle.call, with_weights)
        out, weights, event = run(x, stamp, topk_weights=topk_weights, pair_weights=pair_weights)
        result = (out,) if topk_weights is None else (out, weights)
        if async_op:
            result += (event,)
        return result if len(result) > 1 else out

    # ---- low-latency mode -------------------------------------------------------------------
    def _check_low_latency(self) -> None:
        if not self.cfg.low_latency:
            raise ValueError("low-latency calls need a Buffer created with low_latency=True")

    def _low_latency_run(self, call: Callable[..., _LowLatencyResult], async_op: object, return_recv_hook: object,
                         **fixed: Any) -> Callable[..., _LowLatencyResult]:
        """A low-latency backend call under the stream rule of moe_ep.comm.streams: with async_op on the
        communication stream, the result's event recorded there (DeepEP's async_finish; a receive hook
        runs on the caller's stream, so the two exclude each other)."""
        if async_op and return_recv_hook:
            raise ValueError("async_op=True and return_recv_hook=True exclude each other: the hook's receive "
                             "runs on the caller's stream")
        device = self.cfg.device

        def run(*args: Any, **kwargs: Any) -> _LowLatencyResult:
            def work() -> _LowLatencyResult:
                result = call(*args, return_recv_hook=bool(return_recv_hook), async_op=bool(async_op), **fixed,
                              **kwargs)
                result.event = record_event(bool(async_op), device)
                return result

            return self._comm.run(work, previous_event=None, async_op=bool(async_op), inputs=(args, kwargs))

        return run

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, *, use_fp8: bool = False,
                             round_scale: bool = False, use_ue8m0: bool = False, use_nvfp4: bool = False,
                             x_global_scale: Optional[torch.Tensor] = None,
                             return_recv_hook: bool = False, async_op: bool = False) -> LowLatencyDispatchResult:
        """Expert-major dispatch with fixed capacity and no host sync (docs/api.md); FP8 scales in DeepEP's
        token-major layout per expert, with use_ue8m0 packed as DeepEP's UE8M0 int32; use_nvfp4 casts each
        rank's rows with its x_global_scale to NVFP4 in DeepEP's views (moe_ep.comm.nvfp4; the global scale
        is read on the device, never on the host). Rejected tensors or flags: this rank takes part as a rank
        without tokens, then raises (with a receive hook: the hook does); its peers raise PeerInputError where
        the call checks its stamps."""
        self._check_low_latency()
        if use_fp8:
            self._check_fp8_hidden()
        run = self._low_latency_run(self.backend.low_latency_dispatch, async_op, return_recv_hook)
        # the stamp's size word: the row format every rank must agree on (0 bf16, 1 FP8, 2 NVFP4)
        row_format = NVFP4_ROWS if use_nvfp4 else int(bool(use_fp8))

        def routed(x: torch.Tensor, idx: torch.Tensor, stamp: CallStamp, **kwargs: Any) -> LowLatencyDispatchResult:
            """The call; its handle keeps the topk_idx it exchanged (a combine whose own is rejected uses it)."""
            result = self._checked(stamp, lambda: run(x, idx, stamp=stamp, **kwargs))
            result.handle.topk_idx, result.handle.call = idx, stamp.call
            return result

        try:
            x = self._check_x(x, fp8_ok=False)
            self._check_topk_idx(topk_idx, x.shape[0])
            if round_scale and not use_fp8:
                raise ValueError("round_scale applies only with use_fp8=True")
            if use_ue8m0 and not (use_fp8 and round_scale and self.cfg.hidden % 512 == 0):
                raise ValueError("use_ue8m0=True needs use_fp8=True, round_scale=True (power-of-two scales) and "
                                 f"hidden % 512 == 0 (four exponents per int32), got hidden {self.cfg.hidden}")
            x_global_scale = self._check_nvfp4(bool(use_nvfp4), bool(use_fp8), x_global_scale)
        except (TypeError, ValueError) as error:
            stamp = self._calls.stamp(LL_DISPATCH, 0, row_format, error)
            rows, _ = self._zero_rows((0,), False)
            idx, _ = self._no_routing(0)
            nvfp4_ok = bool(use_nvfp4) and not use_fp8 and self.cfg.hidden % nvfp4.constants().block == 0
            standin_scale = torch.ones((), dtype=torch.float32, device=self.cfg.device) if nvfp4_ok else None
            return _raise_after_receive(error, lambda: routed(
                rows, idx, stamp, use_fp8=bool(use_fp8) and not use_nvfp4, round_scale=False, use_ue8m0=False,
                use_nvfp4=nvfp4_ok, x_global_scale=standin_scale))
        topk_idx, bad_ids = self._in_range_ids(topk_idx)
        stamp = self._calls.stamp(LL_DISPATCH, 0, row_format, bad_ids)

        def call() -> LowLatencyDispatchResult:
            return routed(x, topk_idx, stamp, use_fp8=bool(use_fp8), round_scale=bool(round_scale),
                          use_ue8m0=bool(use_ue8m0), use_nvfp4=bool(use_nvfp4), x_global_scale=x_global_scale)

        return call() if bad_ids is None else _raise_after_receive(bad_ids, call)

    def _check_nvfp4(self, use_nvfp4: bool, use_fp8: bool, x_global_scale: object) -> Optional[torch.Tensor]:
        """NVFP4's flags and its global scale: a float32 tensor on the Buffer's device, shape [] or [k] with
        k >= 1 (the kernels read the first element, as DeepEP's does; vLLM passes one value per local expert,
        all equal). Its values are not read here: that would be a host sync in a call that must have none
        (CUDA graphs capture it); what a g that is not finite and positive gives is in moe_ep.comm.nvfp4's
        docstring, the same bytes on every backend."""
        cfg = self.cfg
        if not use_nvfp4:
            if x_global_scale is not None:
                raise ValueError("x_global_scale applies only with use_nvfp4=True")
            return None
        if use_fp8:
            raise ValueError("use_nvfp4=True and use_fp8=True exclude each other: pass use_fp8=False with NVFP4")
        block = nvfp4.constants().block
        if cfg.hidden % block:
            raise ValueError(f"use_nvfp4=True needs hidden % {block} == 0 (one e4m3 scale per {block} channels), "
                             f"got hidden {cfg.hidden}")
        if x_global_scale is None:
            raise ValueError("use_nvfp4=True needs x_global_scale, a float32 tensor holding the call's global scale")
        if not isinstance(x_global_scale, torch.Tensor):
            raise TypeError(f"x_global_scale must be a torch.Tensor, got {type(x_global_scale).__name__}")
        if x_global_scale.dtype != torch.float32:
            raise TypeError(f"x_global_scale must have dtype torch.float32, got {x_global_scale.dtype}")
        if x_global_scale.dim() > 1 or x_global_scale.numel() == 0:
            raise ValueError("x_global_scale must have shape [] or [k] (k >= 1, one value for the whole call), "
                             f"got {list(x_global_scale.shape)}")
        if x_global_scale.device != cfg.device:
            raise ValueError(f"x_global_scale must be on {cfg.device}, got {x_global_scale.device}")
        return x_global_scale

    def _check_overlap(self, handle: LowLatencyHandle, overlap: object, packed_recv_count: object,
                       comp_signal: object, block_m: object, threshold: object,
                       num_sms: object) -> Optional[LowLatencyOverlap]:
        """low_latency_combine's single-batch-overlap arguments (None without overlap=True, where none
        of them may be given). packed_recv_count is DeepEP's (the dispatch's count, which the handle
        already holds): only its shape is checked."""
        cfg = self.cfg
        given = {"packed_recv_count": packed_recv_count, "comp_signal": comp_signal, "block_m": block_m,
                 "threshold": threshold, "num_sms": num_sms}
        if not overlap:
            extra = [name for name, value in given.items() if value is not None]
            if extra:
                raise ValueError(f"{', '.join(extra)} apply only with overlap=True (single-batch overlap)")
            return None
        missing = [name for name, value in given.items() if value is None]
        if missing:
            raise ValueError(f"overlap=True needs {', '.join(missing)}")
        _check_tensor("packed_recv_count", packed_recv_count, (torch.int32,), tuple(handle.count.shape), cfg.device)
        for name in ("block_m", "threshold", "num_sms"):
            value = given[name]
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        num_sms = _check_num_sms(num_sms, cfg.device)
        blocks = -(-cfg.world_size * cfg.max_tokens_per_rank // block_m)
        signal = _check_tensor("comp_signal", comp_signal, (torch.int32,), (None,), cfg.device)
        if signal.numel() < cfg.num_local_experts * blocks:
            raise ValueError(f"comp_signal must have shape [*] with at least num_local_experts * ceil(R * T / block_m)"
                             f" = {cfg.num_local_experts * blocks} words, got {signal.numel()}")
        return LowLatencyOverlap(signal, block_m, threshold, num_sms, blocks)

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: LowLatencyHandle, *, return_recv_hook: bool = False,
                            async_op: bool = False, overlap: bool = False,
                            packed_recv_count: Optional[torch.Tensor] = None,
                            comp_signal: Optional[torch.Tensor] = None, block_m: Optional[int] = None,
                            threshold: Optional[int] = None,
                            num_sms: Optional[int] = None) -> LowLatencyCombineResult:
        """Weighted sum of each token's expert outputs, ascending k, one rounding (docs/api.md). Rejected
        tensors: this rank sends zero rows back and receives by its dispatch's topk_idx (rejected ids
        alone: it sends x), then raises (with a receive hook: the hook does); its peers raise
        PeerInputError where the call checks its stamps.

        overlap=True (SGLang's single-batch overlap): x is still being written by a GEMM beside the call,
        which brings comp_signal[e * ceil(R*T / block_m) + j] to `threshold` once rows [j * block_m,
        (j + 1) * block_m) of local expert e are in x; the call reads each block only then and runs on at
        most num_sms SMs. packed_recv_count: the dispatch's count (DeepEP's argument; the handle has it).
        The result is the same bits as without overlap."""
        cfg = self.cfg
        self._check_low_latency()
        self._check_handle(handle, LowLatencyHandle)
        run = self._low_latency_run(self.backend.low_latency_combine, async_op, return_recv_hook, handle=handle)

        def checked(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, stamp: CallStamp,
                    signals: Optional[LowLatencyOverlap] = None) -> LowLatencyCombineResult:
            return self._checked(stamp, lambda: run(x, idx, weights, stamp=stamp, overlap=signals))

        lead, n = (cfg.num_local_experts, cfg.world_size * cfg.max_tokens_per_rank), handle.num_tokens
        try:
            _check_tensor("x", x, (torch.bfloat16,), (*lead, cfg.hidden), cfg.device)
            self._check_topk_idx(topk_idx, n)
            self._check_weights(topk_weights, n)
            _check_aligned("x", x)
            signals = self._check_overlap(handle, overlap, packed_recv_count, comp_signal, block_m, threshold, num_sms)
        except (TypeError, ValueError) as error:
            stamp = self._calls.stamp(LL_COMBINE, handle.call, 0, error)
            rows, _ = self._zero_rows(lead, False)
            return _raise_after_receive(error, lambda: checked(rows, handle.topk_idx, self._no_routing(n)[1], stamp))
        bad_ids = self._in_range_ids(topk_idx)[1]
        stamp = self._calls.stamp(LL_COMBINE, handle.call, 0, bad_ids)
        if bad_ids is not None:  # receive what the dispatch's routing says the peers send back
            return _raise_after_receive(bad_ids, lambda: checked(x, handle.topk_idx, topk_weights, stamp, signals))
        return checked(x, topk_idx, topk_weights, stamp, signals)

    def synchronize(self) -> None:
        """Local: waits for the work queued on the current stream and raises what this Buffer's kernels
        recorded and no call raised yet (CommTimeoutError, CallMismatchError; BadExpertIdError): the host
        check after an async call or a CUDA graph replay, whose calls cannot raise themselves."""
        self.backend.synchronize()

    # ---- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Free communication resources (collective)."""
        if self._backend is not None:
            self._backend.close()
            self._backend = None
        at_exit.untrack(self.cfg.buffer_id)

    def leave(self, timeout_s: float) -> bool:
        """At exit (moe_ep.comm.at_exit): close with the peers, or give the Buffer up alone (abort) where
        they do not all come within timeout_s; whether it closed with them."""
        clean = True
        if self._backend is not None:
            clean = self._backend.leave(timeout_s)
            self._backend = None
        at_exit.untrack(self.cfg.buffer_id)
        return clean

    def abort(self) -> None:
        """Give this Buffer up without its peers (not collective), after a CommTimeoutError or with
        masked ranks, when a peer may be dead: close() would wait for it forever. Frees nothing that
        needs the peers; NVSHMEM is then unusable in this process (docs/api.md, Errors)."""
        if self._backend is not None:
            self._backend.abort()
            self._backend = None
        at_exit.untrack(self.cfg.buffer_id)

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
