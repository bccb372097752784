"""Which ranks of a process group share one NVLink domain ("node"): detected from the hosts the
ranks run on, or forced by the caller (Buffer(ranks_per_node=k)) so one machine can act as several
nodes. Nodes are contiguous rank ranges: rank r is in node r // ranks_per_node. Ranks on one host
that name the same GPU (same device UUID) share it (docs/one_gpu.md); they are on one host, so
detection puts them in one node. Buffer validates a forced value; this module only detects and records."""
from __future__ import annotations

import socket
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from . import _native


def max_ranks_per_node() -> int:
    """The largest node (NVLink domain) the native kernels serve (moe_ep.comm._C, else its fallback)."""
    return _native.constant("MAX_NODE_RANKS")


@dataclass(frozen=True)
class Topology:
    """The node layout a Buffer runs with."""

    ranks_per_node: int  # in effect: the forced value, else `detected`
    num_nodes: int
    detected: int  # the largest node size the hosts allow (see node_size)
    forced: bool  # ranks_per_node came from the caller
    ranks_per_gpu: int = 1  # the most ranks of the group that share one GPU (0: the ranks run on CPU)


def ranks_per_host(hostnames: list[str]) -> int:
    """Ranks per host, from every rank's hostname in rank order. Each host's ranks must be one
    contiguous range and every host must hold the same number, since nodes are equal contiguous
    rank ranges; otherwise a RuntimeError says what the launcher did instead."""
    runs: list[tuple[str, int]] = []  # (host, ranks) per contiguous run
    for host in hostnames:
        if runs and runs[-1][0] == host:
            runs[-1] = (host, runs[-1][1] + 1)
        else:
            runs.append((host, 1))
    hosts = [host for host, _ in runs]
    if len(set(hosts)) != len(hosts):
        raise RuntimeError("moe_ep: the ranks of one host must be contiguous (launch with torchrun, which numbers "
                           f"ranks host by host); got hosts in rank order {hostnames}")
    counts = {count for _, count in runs}
    if len(counts) != 1:
        raise RuntimeError("moe_ep: every host must run the same number of ranks; got "
                           + ", ".join(f"{host}: {count}" for host, count in runs))
    return counts.pop()


def node_size(per_host: int) -> int:
    """The node size for `per_host` ranks on each host: all of them up to 8; above 8 (more ranks
    on a host than one NVLink domain of the kernels serves) the largest divisor of `per_host` that
    is at most 8, so every host splits into equal nodes."""
    return max(d for d in range(1, max_ranks_per_node() + 1) if per_host % d == 0)


def device_uuid(device: Optional[torch.device]) -> Optional[str]:
    """The UUID of a CUDA device (None for the CPU or no device)."""
    if device is None or torch.device(device).type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(torch.device(device)).uuid)


def placements(group: dist.ProcessGroup, device: Optional[torch.device] = None) -> list[tuple[str, Optional[str]]]:
    """Collective over `group`: every rank's (hostname, device UUID or None), in group rank order."""
    mine = (socket.gethostname(), device_uuid(device))
    got: list[Optional[tuple[str, Optional[str]]]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(got, mine, group=group)
    return [(str(host), uuid) for host, uuid in got]


def hostnames(group: dist.ProcessGroup) -> list[str]:
    """Collective over `group`: every rank's hostname, in group rank order."""
    return [host for host, _ in placements(group)]


def ranks_per_gpu(places: list[tuple[str, Optional[str]]]) -> int:
    """The most ranks that name one GPU (same host and device UUID); 0 when no rank has one."""
    gpus = Counter(p for p in places if p[1] is not None)
    return max(gpus.values(), default=0)


def detect(group: dist.ProcessGroup) -> int:
    """Collective over `group`: the detected node size (node_size of the ranks per host); the ranks
    of one host are taken to share its NVLink domain."""
    return node_size(ranks_per_host(hostnames(group)))


def resolve(group: dist.ProcessGroup, ranks_per_node: Optional[int], device: Optional[torch.device] = None) -> Topology:
    """Collective over `group`: the topology with `ranks_per_node` forced (Buffer has validated it),
    or detected when it is None; `device` is this rank's (for ranks_per_gpu)."""
    return from_placements(placements(group, device), ranks_per_node)


def from_placements(places: list[tuple[str, Optional[str]]], ranks_per_node: Optional[int]) -> Topology:
    """The topology of ranks at `places` (placements' result), with `ranks_per_node` forced or detected."""
    detected = node_size(ranks_per_host([host for host, _ in places]))
    size = detected if ranks_per_node is None else ranks_per_node
    return Topology(ranks_per_node=size, num_nodes=len(places) // size, detected=detected,
                    forced=ranks_per_node is not None, ranks_per_gpu=ranks_per_gpu(places))
