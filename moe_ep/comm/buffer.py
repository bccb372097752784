"""Buffer: the public communication object. Every input is validated here, once, before any backend
runs (the rules: moe_ep.comm.validate, used by nothing else); backends below trust what they get. Every rank makes the same collective calls whatever its
inputs: a rank whose input is rejected makes the call on stand-in inputs, its stamp saying so
(moe_ep.comm.call_check), then raises; its peers raise PeerInputError once the stamps are in."""
from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass, field
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
    input_error,
)
from .config import DEFAULT_TIMEOUT_S, Config, default_num_sms
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
)
from .validate import CallChecks, check_event, check_expert_major, check_hook, check_num_sms

_buffer_ids = itertools.count(1)
_LowLatencyResult = TypeVar("_LowLatencyResult", LowLatencyDispatchResult, LowLatencyCombineResult)


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
    sms = check_num_sms(knobs.num_sms, device) if knobs.num_sms is not None else default_num_sms(device)
    if knobs.low_latency_num_sms is not None:
        if not low_latency:
            raise ValueError("Config.low_latency_num_sms needs low_latency=True (it sizes the low-latency kernels' grid)")
        check_num_sms(knobs.low_latency_num_sms, device)
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


def _kernel_found_ids() -> BadExpertIdError:
    """What a rank raises when its stamp says its kernels found a bad expert id and no record says which."""
    return input_error(BadExpertIdError, "topk_idx", "expert ids",
                       "topk_idx held an expert id outside [-1, num_experts) (found by the kernels; the call treated "
                       "it as -1 and every rank raised)")


@dataclass(frozen=True)
class _Call:
    """One communicating call between its stages (validate -> stamp -> backend call -> result): its kind and
    the words its stamp carries, the backend method with the options it gets whatever the inputs, and its
    inputs: the caller's, or stand-ins when this rank rejected its own (`rejection`, raised once the call ran,
    so that one rank's bad input does not desynchronise the group: docs/api.md, Errors)."""

    kind: int  # call_check's DISPATCH, CACHED, COMBINE, LL_DISPATCH or LL_COMBINE
    handle: int  # the number of the call that made the handle it uses (0: none)
    size: int  # the stamp's size word: what every rank must agree on (row format, with weights)
    backend: Callable[..., Any]
    options: dict[str, Any]
    async_op: bool = False
    previous_event: Optional[EventHandle] = None
    records_event: bool = False  # low-latency calls: the Buffer records the result's event (their backends do not)
    inputs: tuple[Any, ...] = ()
    input_options: dict[str, Any] = field(default_factory=dict)
    rejection: Optional[Exception] = None

    def taking(self, inputs: tuple[Any, ...], rejection: Optional[Exception] = None, **input_options: Any) -> "_Call":
        """This call on `inputs`; `rejection`: why this rank rejected its own (the stamp says so)."""
        return dataclasses.replace(self, inputs=inputs, input_options=input_options, rejection=rejection)


@dataclass(frozen=True)
class _ReceiveThenRaise:
    """The receive hook of a rank that rejected its low-latency input: it receives first (its peers' receive
    waits for this rank's sends), then raises the rank's error."""

    hook: Callable[[], None]
    error: Exception

    def __call__(self) -> NoReturn:
        try:
            self.hook()
        except OwnRejection:
            pass
        raise self.error


class Buffer:
    """Expert-parallel dispatch/combine over a process group (see docs/api.md).

    Creating a Buffer is collective over `group`; so are close() and every communication call. Each
    communication call is one pipeline: validate (moe_ep.comm.validate's checks; a rejected input is
    replaced by stand-ins) -> stamp (moe_ep.comm.call_check) -> backend call (on the stream the call
    asks for: moe_ep.comm.streams) -> result (this rank's rejection raised, handles completed).
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, *, hidden: int, num_experts: int, num_topk: int,
                 max_tokens_per_rank: int, backend: str = "auto", low_latency: bool = False,
                 num_sms: Optional[int] = None, timeout_s: float = DEFAULT_TIMEOUT_S,
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
        self._checks = CallChecks(self.cfg, self.backend_name)  # the validate stage's rules (moe_ep.comm.validate)
        self._checks.path_sms(self.cfg.num_sms)
        self._checks.on_path(self.cfg.config, from_env=config is None)  # same on every rank: all raise alike
        self._backend: Optional[Backend] = self._make_backend()
        self._comm = CommStream(device)
        self._calls = CallOrder()  # numbers the communicating calls (moe_ep.comm.call_check)
        # check_calls=True: every call's stamps meet on the host first (the reference backend checks in band)
        self._host_check: Optional[HostCheck] = None
        if check_calls and self.backend_name != "reference":
            self._host_check = HostCheck(own_group(group, self.cfg.timeout_s), self.cfg.rank, self.cfg.timeout_s)
        at_exit.track(self.cfg.buffer_id, self)  # left with its peers at exit (moe_ep.comm.at_exit)

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

    # ---- the stages of every communication call -----------------------------------------------
    def _stamp(self, call: _Call) -> CallStamp:
        """Stamp stage: the call's number, what every rank must agree on, and whether (and why) this rank
        rejected its input."""
        return self._calls.stamp(call.kind, call.handle, call.size, call.rejection)

    def _run(self, call: _Call, stamp: CallStamp) -> Optional[Any]:
        """Backend call stage: with check_calls=True on the native backend the ranks' stamps first meet on
        the host (every call, so ranks making different calls meet there too, and all raise alike before
        anything launches); then the backend under the stream rule of moe_ep.comm.streams. None when the
        stamps said that this rank rejected its input (call_check.OwnRejection): the result stage says why."""
        try:
            if self._host_check is not None:
                self._host_check.verify(stamp)
            return self._comm.run(functools.partial(self._launch, call, stamp), previous_event=call.previous_event,
                                  async_op=call.async_op, inputs=(call.inputs, call.input_options, call.options))
        except OwnRejection:
            return None

    def _launch(self, call: _Call, stamp: CallStamp) -> Any:
        """What runs on the call's stream: the backend method, then a low-latency call's event (DeepEP's
        async_finish: recorded on the communication stream with async_op)."""
        result = call.backend(*call.inputs, stamp=stamp, **call.options, **call.input_options)
        if call.records_event:
            result.event = record_event(call.async_op, self.cfg.device)
        return result

    @staticmethod
    def _raise_rejection(call: _Call, got: Optional[Any]) -> None:
        """Result stage, first step of every call: this rank's rejection, now that the call ran and every
        rank has its stamp; or, when the stamps said this rank rejected and its host found nothing, the
        bad expert id its kernels found."""
        if call.rejection is not None:
            raise call.rejection
        if got is None:
            raise _kernel_found_ids()

    # ---- normal mode ------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, *, previous_event: Optional[EventHandle] = None,
                            async_op: bool = False) -> DispatchLayout:
        """Tokens per rank and per expert, and the token->rank mask (with async_op: on the communication
        stream, the layout's event set). No backend communicates here, so bad input raises at once and the
        call has no stamp: validate -> backend call -> result."""
        topk_idx, previous_event = self._validate_layout(topk_idx, previous_event)
        return self._comm.run(functools.partial(self._layout, topk_idx, bool(async_op)), previous_event=previous_event,
                              async_op=bool(async_op), inputs=(topk_idx,))

    def _validate_layout(self, topk_idx: object,
                         previous_event: object) -> tuple[torch.Tensor, Optional[EventHandle]]:
        """Validate stage of get_dispatch_layout: any number of tokens, every id in range."""
        topk_idx, bad_ids = self._checks.in_range_ids(self._checks.topk_idx(topk_idx, None, capped=False),
                                                      self.backend.checks_expert_ids)
        if bad_ids is not None:
            raise bad_ids
        return topk_idx, check_event(previous_event)

    def _layout(self, topk_idx: torch.Tensor, async_op: bool) -> DispatchLayout:
        """Backend call stage of get_dispatch_layout, on the call's stream: the layout, its event after it."""
        layout = self.backend.get_dispatch_layout(topk_idx)
        return dataclasses.replace(layout, event=record_event(async_op, self.cfg.device))

    def dispatch(self, x: torch.Tensor, topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None, *, x_scales: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, handle: Optional[DispatchHandle] = None, worst_case: bool = False,
                 expert_major: Optional[bool] = None, num_sms: Optional[int] = None, config: Optional[Config] = None,
                 previous_event: Optional[EventHandle] = None, async_op: bool = False) -> DispatchResult:
        """Send each token once to every rank holding one of its experts (docs/api.md); expert_major:
        the received rows as (row, local expert) pairs grouped by expert. Rejected arguments: this
        rank takes part as a rank without tokens (a cached dispatch: with zero rows), then raises; its
        peers raise PeerInputError where the call checks its stamps (docs/api.md, Errors)."""
        call = self._validate_dispatch(x, topk_idx, topk_weights, x_scales, expert_alignment, handle, worst_case,
                                       expert_major, num_sms, config, previous_event, async_op)
        stamp = self._stamp(call)
        return self._dispatch_result(call, stamp, self._run(call, stamp))

    def _validate_dispatch(self, x: object, topk_idx: object, topk_weights: object, x_scales: object,
                           expert_alignment: object, handle: object, worst_case: object, expert_major: object,
                           num_sms: Optional[int], config: Optional[Config], previous_event: object,
                           async_op: object) -> _Call:
        """Validate stage of a dispatch: a bad handle, SM budget, knobs or event raise at once; rejected
        tensors or flags give the stand-ins of a rank without tokens (a cached dispatch: zero rows); ids
        out of range are set to -1 and raised once the call ran."""
        checks = self._checks
        if handle is not None:
            checks.handle(handle, DispatchHandle)
        sms, knobs = checks.knobs(num_sms, config)
        previous_event = check_event(previous_event)
        fp8 = self._fp8_rows(x)
        call = _Call(DISPATCH if handle is None else CACHED, 0 if handle is None else handle.call, int(fp8),
                     self.backend.dispatch, dict(handle=handle, worst_case=bool(worst_case), num_sms=sms, knobs=knobs,
                                                 async_op=bool(async_op)),
                     async_op=bool(async_op), previous_event=previous_event)
        try:
            checks.dispatch(x, x_scales, topk_idx, topk_weights, handle, expert_alignment,
                            bool(worst_case) and handle is None)
            expert_major = check_expert_major(expert_major, handle, expert_alignment)
        except (TypeError, ValueError) as error:
            rows, scales = self._zero_rows((0 if handle is None else handle.num_tokens,), fp8)
            idx, weights = self._no_routing(0) if handle is None else (None, None)
            return call.taking((rows, scales, idx, weights), error, expert_alignment=1, expert_major=False)
        bad_ids = None
        if handle is None:
            topk_idx, bad_ids = checks.in_range_ids(topk_idx, self.backend.checks_expert_ids)
        return call.taking((x, x_scales, topk_idx, topk_weights), bad_ids, expert_alignment=expert_alignment,
                           expert_major=expert_major)

    def _dispatch_result(self, call: _Call, stamp: CallStamp, got: Optional[DispatchResult]) -> DispatchResult:
        """Result stage of a dispatch: this rank's rejection raised; a fresh handle names the call that made it."""
        self._raise_rejection(call, got)
        if call.kind == DISPATCH:
            got.handle.call = stamp.call
        return got

    def combine(self, x: torch.Tensor, handle: DispatchHandle, *, topk_weights: Optional[torch.Tensor] = None,
                pair_weights: Optional[torch.Tensor] = None, num_sms: Optional[int] = None,
                config: Optional[Config] = None, previous_event: Optional[EventHandle] = None, async_op: bool = False):
        """Sum each token's rows (and topk_weights rows) back on its source rank (docs/api.md); returns out,
        (out, weights) with topk_weights, and the EventHandle last when async_op. An expert-major
        handle's combine takes pairs and sums each row's first (pair_weights: times each pair's weight).
        Rejected tensors: this rank sends zero rows (and weights) back, then raises; its peers raise
        PeerInputError where the call checks its stamps (docs/api.md, Errors)."""
        call = self._validate_combine(x, handle, topk_weights, pair_weights, num_sms, config, previous_event, async_op)
        stamp = self._stamp(call)
        return self._combine_result(call, self._run(call, stamp))

    def _validate_combine(self, x: object, handle: object, topk_weights: object, pair_weights: object,
                          num_sms: Optional[int], config: Optional[Config], previous_event: object,
                          async_op: object) -> _Call:
        """Validate stage of a combine: a bad handle, SM budget, knobs or event raise at once; rejected
        tensors give zero rows (and zero weights) as stand-ins."""
        checks = self._checks
        checks.handle(handle, DispatchHandle)
        sms, knobs = checks.knobs(num_sms, config)
        previous_event = check_event(previous_event)
        with_weights = topk_weights is not None
        call = _Call(COMBINE, handle.call, int(with_weights), self.backend.combine,
                     dict(handle=handle, num_sms=sms, knobs=knobs, async_op=bool(async_op)),
                     async_op=bool(async_op), previous_event=previous_event)
        try:
            checks.combine(x, handle, topk_weights, pair_weights)
        except (TypeError, ValueError) as error:
            layout = handle.expert_major
            m = handle.num_recv_rows if layout is None else layout.num_pairs
            rows, _ = self._zero_rows((m,), False)
            shape = (m, self.cfg.num_topk) if layout is None else (m,)
            weights = torch.zeros(shape, dtype=torch.float32, device=self.cfg.device) if with_weights else None
            return call.taking((rows,), error, topk_weights=weights, pair_weights=None)
        return call.taking((x,), topk_weights=topk_weights, pair_weights=pair_weights)

    def _combine_result(self, call: _Call, got: Optional[tuple[torch.Tensor, Optional[torch.Tensor],
                                                                  Optional[EventHandle]]]):
        """Result stage of a combine: this rank's rejection raised; out, then the weights when the call had
        topk_weights (the stamp's size word), then the event when async."""
        self._raise_rejection(call, got)
        out, weights, event = got
        result = (out, weights) if call.size else (out,)
        if call.async_op:
            result += (event,)
        return result if len(result) > 1 else out

    # ---- low-latency mode -------------------------------------------------------------------
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, *, use_fp8: bool = False,
                             round_scale: bool = False, use_ue8m0: bool = False, use_nvfp4: bool = False,
                             x_global_scale: Optional[torch.Tensor] = None,
                             return_recv_hook: bool = False, async_op: bool = False) -> LowLatencyDispatchResult:
        """Expert-major dispatch with fixed capacity and no host sync (docs/api.md); FP8 scales in DeepEP's
        token-major layout per expert, with use_ue8m0 packed as DeepEP's UE8M0 int32; use_nvfp4 casts each
        rank's rows with its x_global_scale to NVFP4 in DeepEP's views (moe_ep.comm.nvfp4; the global scale
        is read on the device, never on the host). Rejected tensors or flags: this rank takes part as a rank
        without tokens, then raises (with a receive hook: the hook does); its peers raise PeerInputError where
        the call checks its stamps. With async_op the call runs on the communication stream and the result's
        event is recorded there (DeepEP's async_finish; a receive hook runs on the caller's stream, so the
        two exclude each other)."""
        call = self._validate_low_latency_dispatch(x, topk_idx, use_fp8, round_scale, use_ue8m0, use_nvfp4,
                                                   x_global_scale, return_recv_hook, async_op)
        stamp = self._stamp(call)
        return self._low_latency_dispatch_result(call, stamp, self._run(call, stamp))

    def _validate_low_latency_dispatch(self, x: object, topk_idx: object, use_fp8: object, round_scale: object,
                                       use_ue8m0: object, use_nvfp4: object, x_global_scale: object,
                                       return_recv_hook: object, async_op: object) -> _Call:
        """Validate stage of a low-latency dispatch: the mode, FP8's hidden size and async_op with a hook
        raise at once; rejected tensors or flags give the stand-ins of a rank without tokens (in the row
        format its peers expect); ids out of range are set to -1 and raised once the call ran."""
        checks = self._checks
        checks.low_latency()
        if use_fp8:
            checks.fp8_hidden("use_fp8")
        check_hook(async_op, return_recv_hook)
        # the stamp's size word: the row format every rank must agree on (0 bf16, 1 FP8, 2 NVFP4)
        row_format = NVFP4_ROWS if use_nvfp4 else int(bool(use_fp8))
        call = _Call(LL_DISPATCH, 0, row_format, self.backend.low_latency_dispatch,
                     dict(return_recv_hook=bool(return_recv_hook), async_op=bool(async_op)), async_op=bool(async_op),
                     records_event=True)
        try:
            x_global_scale = checks.low_latency_dispatch(x, topk_idx, bool(use_fp8), bool(round_scale),
                                                         bool(use_ue8m0), bool(use_nvfp4), x_global_scale)
        except (TypeError, ValueError) as error:
            rows, _ = self._zero_rows((0,), False)
            idx, _ = self._no_routing(0)
            nvfp4_ok = bool(use_nvfp4) and not use_fp8 and self.cfg.hidden % nvfp4.constants().block == 0
            scale = torch.ones((), dtype=torch.float32, device=self.cfg.device) if nvfp4_ok else None
            return call.taking((rows, idx), error, use_fp8=bool(use_fp8) and not use_nvfp4, round_scale=False,
                               use_ue8m0=False, use_nvfp4=nvfp4_ok, x_global_scale=scale)
        topk_idx, bad_ids = checks.in_range_ids(topk_idx, self.backend.checks_expert_ids)
        return call.taking((x, topk_idx), bad_ids, use_fp8=bool(use_fp8), round_scale=bool(round_scale),
                           use_ue8m0=bool(use_ue8m0), use_nvfp4=bool(use_nvfp4), x_global_scale=x_global_scale)

    def _low_latency_dispatch_result(self, call: _Call, stamp: CallStamp,
                                     got: Optional[LowLatencyDispatchResult]) -> LowLatencyDispatchResult:
        """Result stage of a low-latency dispatch: its handle keeps the topk_idx it exchanged (a combine whose
        own is rejected uses it) and names the call; then as _low_latency_result."""
        if got is not None:
            got.handle.topk_idx, got.handle.call = call.inputs[1], stamp.call
        return self._low_latency_result(call, got)

    def _low_latency_result(self, call: _Call, got: Optional[_LowLatencyResult]) -> _LowLatencyResult:
        """Result stage of a low-latency call: this rank's rejection raised once the call ran, or, with a
        receive hook, by the hook once it has received (the peers' receive waits for this rank's sends)."""
        if call.rejection is not None and got is not None and got.hook is not None:
            got.hook = _ReceiveThenRaise(got.hook, call.rejection)
            return got
        self._raise_rejection(call, got)
        return got

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
        call = self._validate_low_latency_combine(x, topk_idx, topk_weights, handle, return_recv_hook, async_op,
                                                  overlap, packed_recv_count, comp_signal, block_m, threshold, num_sms)
        stamp = self._stamp(call)
        return self._low_latency_result(call, self._run(call, stamp))

    def _validate_low_latency_combine(self, x: object, topk_idx: object, topk_weights: object, handle: object,
                                      return_recv_hook: object, async_op: object, overlap: object,
                                      packed_recv_count: object, comp_signal: object, block_m: object,
                                      threshold: object, num_sms: object) -> _Call:
        """Validate stage of a low-latency combine: the mode, the handle and async_op with a hook raise at
        once; rejected tensors give zero rows routed by the dispatch's topk_idx; rejected ids alone keep x
        and route by the dispatch's topk_idx too (what the peers send back follows it)."""
        cfg, checks = self.cfg, self._checks
        checks.low_latency()
        checks.handle(handle, LowLatencyHandle)
        check_hook(async_op, return_recv_hook)
        call = _Call(LL_COMBINE, handle.call, 0, self.backend.low_latency_combine,
                     dict(handle=handle, return_recv_hook=bool(return_recv_hook), async_op=bool(async_op)),
                     async_op=bool(async_op), records_event=True)
        try:
            checks.low_latency_combine(x, topk_idx, topk_weights, handle)
            signals = checks.overlap(handle, overlap, packed_recv_count, comp_signal, block_m, threshold, num_sms)
        except (TypeError, ValueError) as error:
            rows, _ = self._zero_rows((cfg.num_local_experts, cfg.world_size * cfg.max_tokens_per_rank), False)
            return call.taking((rows, handle.topk_idx, self._no_routing(handle.num_tokens)[1]), error, overlap=None)
        bad_ids = checks.in_range_ids(topk_idx, self.backend.checks_expert_ids)[1]
        routing = handle.topk_idx if bad_ids is not None else topk_idx
        return call.taking((x, routing, topk_weights), bad_ids, overlap=signals)

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
