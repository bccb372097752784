"""The moe_ep Buffers behind a DeepEP-style object: DeepEP's constructors take a process group and
byte budgets, moe_ep's Buffer takes shapes, so the drop-ins (v1.Buffer, elastic.ElasticBuffer) make
their moe_ep Buffers on first use, on the group and device that suit the call's tensors."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

import moe_ep
from moe_ep.comm.buffer import _device_of, _resolve_topology, auto_backend
from moe_ep.comm.config import DEFAULT_TIMEOUT_S


class BufferFactory:
    """Creates moe_ep Buffers for one DeepEP-style object. Construction is collective over `group`
    (it resolves the topology once); so is every create()."""

    def __init__(self, group: dist.ProcessGroup, backend: str, ranks_per_node: Optional[int]) -> None:
        self.group, self.backend = group, backend
        gpu = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        topo = _resolve_topology(group, ranks_per_node, gpu)
        self.ranks_per_node, self.num_nodes = topo.ranks_per_node, topo.num_nodes
        self.ranks_per_gpu = topo.ranks_per_gpu
        self._device_group: Optional[dist.ProcessGroup] = None

    def group_for(self, device: torch.device) -> tuple[dist.ProcessGroup, Optional[torch.device]]:
        """The group (and device argument) of the moe_ep Buffers for tensors on `device`: the caller's
        group, except for CUDA tensors over a CPU (gloo) group, as vLLM passes its CPU group. Then the
        native backend runs over that group with device=`device` (it needs the group only to start
        NVSHMEM), and so does the reference backend when ranks share a GPU (NCCL refuses them);
        otherwise the reference backend gets an NCCL group of the same ranks, created once, by the
        members alone."""
        if device.type != "cuda" or _device_of(self.group).type == "cuda":
            return self.group, None
        native = self.backend == "nvshmem" or (self.backend == "auto" and auto_backend(device)[0] == "nvshmem")
        if native or self.ranks_per_gpu > 1:
            return self.group, device
        if self._device_group is None:
            self._device_group = dist.new_group(dist.get_process_group_ranks(self.group), backend="nccl",
                                                use_local_synchronization=True)
        return self._device_group, None

    def create(self, x: torch.Tensor, num_experts: int, num_topk: int, max_tokens: int, low_latency: bool = False,
               timeout_s: float = DEFAULT_TIMEOUT_S, fault_tolerant: bool = False) -> moe_ep.Buffer:
        """A moe_ep Buffer for rows like x's (hidden size, device) and these shapes (collective)."""
        group, device = self.group_for(x.device)
        return moe_ep.Buffer(group, hidden=x.shape[1], num_experts=num_experts, num_topk=num_topk,
                             max_tokens_per_rank=max_tokens, backend=self.backend, low_latency=low_latency,
                             ranks_per_node=self.ranks_per_node, device=device, timeout_s=timeout_s,
                             fault_tolerant=fault_tolerant)
