"""`python -m moe_ep.info`: what moe_ep runs on here — torch, CUDA, NVSHMEM, GPUs and their links,
whether moe_ep.comm._C is usable, the node topology, the NVSHMEM transport settings for traffic between
nodes, and the backend Buffer(backend="auto") would pick."""
from __future__ import annotations

import ctypes
import importlib.metadata
import os
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from .comm import _native, topology
from .comm.backends.symmetric import NATIVE_DEFAULTS, TRANSPORT_VARS, nvshmem_defaults
from .comm.buffer import auto_backend

# NVSHMEM's own defaults for TRANSPORT_VARS (its environment-variable reference).
_NVSHMEM_DEFAULTS = {
    "NVSHMEM_REMOTE_TRANSPORT": "ibrc, unless NVSHMEM was built for UCX",
    "NVSHMEM_IB_ENABLE_IBGDA": "false",
    "NVSHMEM_IBGDA_NIC_HANDLER": "auto",
    "NVSHMEM_ENABLE_NIC_PE_MAPPING": "false: each PE takes the NIC closest to its GPU",
    "NVSHMEM_HCA_LIST": "every HCA",
    "NVSHMEM_HCA_PE_MAPPING": "none",
    "NVSHMEM_DISABLE_NVLS": "false",
}
INFINIBAND_DIR = Path("/sys/class/infiniband")


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvcc_version() -> str:
    home = os.environ.get("CUDA_HOME")
    nvcc = str(Path(home) / "bin" / "nvcc") if home and (Path(home) / "bin" / "nvcc").is_file() else shutil.which("nvcc")
    if nvcc is None:
        return "not found"
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout
    match = re.search(r"release (\d+\.\d+)", out)
    return f"{match[1] if match else '?'} ({nvcc})"


def _dotted(version: object) -> str:
    return ".".join(str(v) for v in version)


def _native_lines() -> list[str]:
    info = _native.build_info()
    ok, why = _native.available()
    lines = []
    if info is None:
        wheels = [f"{d} {v}" for d in ("nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12") if (v := _version(d))]
        lines.append(f"NVSHMEM      wheel {', '.join(wheels) or 'not installed'}")
    else:
        runtime = _dotted(_native.load().runtime_version()) if ok else "not loaded"
        lines.append(f"NVSHMEM      wheel {info['nvshmem_dist']} {_version(info['nvshmem_dist']) or 'not installed'}; "
                     f"built against {_dotted(info['nvshmem_version'])}; runtime {runtime}")
        lines.append(f"native _C    built with CUDA {_dotted(info['cuda_version'])} for "
                     + ", ".join(f"sm_{a}" for a in info["cuda_archs"]))
    lines.append("native _C    " + ("loads" if ok else f"not available: {why}"))
    return lines


def _gpu_lines() -> list[str]:
    if not torch.cuda.is_available():
        return ["GPUs         none (torch.cuda.is_available() is False)"]
    count = torch.cuda.device_count()
    lines = [f"GPUs         {count}"]
    for i in range(count):
        p = torch.cuda.get_device_properties(i)
        lines.append(f"  cuda:{i}     {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
                     f"{p.total_memory / 2**30:.1f} GiB")
    smi = shutil.which("nvidia-smi")
    topo = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, check=False) if smi else None
    if topo is not None and topo.returncode == 0:
        lines.append("Topology     nvidia-smi topo -m:")
        lines += ["  " + line for line in topo.stdout.rstrip().splitlines()]
    elif count > 1:
        lines.append("Peer access  (row can access column; nvidia-smi not available)")
        lines.append("        " + " ".join(f"{j:>5}" for j in range(count)))
        for i in range(count):
            cells = ["-" if i == j else ("yes" if torch.cuda.can_device_access_peer(i, j) else "no") for j in range(count)]
            lines.append(f"  {i:>5} " + " ".join(f"{c:>5}" for c in cells))
    return lines


def _topology_lines() -> list[str]:
    """Nodes of the initialised default group; without one, what this host's GPUs imply."""
    if dist.is_available() and dist.is_initialized():
        gpu = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        places = topology.placements(dist.group.WORLD, gpu)
        topo = topology.from_placements(places, None)
        lines = [f"Nodes        {dist.get_world_size()} ranks: {topo.num_nodes} node(s) of {topo.ranks_per_node} "
                 "ranks (detected from the ranks' hostnames)"]
        gpus = Counter(p for p in places if p[1] is not None)
        for (host, uuid), ranks in gpus.items():
            lines.append(f"GPU          {host} {uuid}: {ranks} rank(s)"
                         + (" share it (time-sliced: results valid, timings say nothing about links; "
                            "docs/one_gpu.md)" if ranks > 1 else ""))
        return lines
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return ["Nodes        no GPU here: the native backend has nothing to run on (reference backend only)"]
    blocked = [f"{i}-{j}" for i in range(count) for j in range(i + 1, count)
               if not torch.cuda.can_device_access_peer(i, j)]
    if blocked:
        return [f"Nodes        GPU pairs {', '.join(blocked)} have no peer access: NVSHMEM cannot reach them by loads "
                "and stores; detection goes by hostname, so pass Buffer(ranks_per_node=1) here"]
    size = topology.node_size(count)
    return [f"Nodes        torch.distributed is not initialised; with one rank per GPU this host is "
            f"{count // size} node(s) of {size} ranks (all {count} GPUs have peer access); "
            "Buffer(ranks_per_node=k) splits it further"]


def _gdrcopy_library() -> Optional[str]:
    """The name under which GDRCopy's user library loads, or None."""
    for name in ("libgdrapi.so.2", "libgdrapi.so"):
        try:
            ctypes.CDLL(name)
        except OSError:
            continue
        return name
    return None


def _transport_lines() -> list[str]:
    """The NVSHMEM settings that decide how traffic between nodes runs, and what is missing for it."""
    lines = ["NVSHMEM transport settings (the environment's value, else what applies):"]
    across = nvshmem_defaults(spans_hosts=True)
    for key in TRANSPORT_VARS:
        if key in os.environ:
            value = f"{os.environ[key]} (environment)"
        elif key in across:
            value = (f"unset: moe_ep sets {across[key]} when the group spans hosts, "
                     f"else NVSHMEM's default {_NVSHMEM_DEFAULTS[key]}")
        elif key in NATIVE_DEFAULTS:
            value = f"unset: moe_ep.comm._C sets {NATIVE_DEFAULTS[key]}"
        else:
            value = f"unset: NVSHMEM's default ({_NVSHMEM_DEFAULTS[key]})"
        lines.append(f"  {key:<30} {value}")
    mapped = [key for key in ("NVSHMEM_HCA_LIST", "NVSHMEM_HCA_PE_MAPPING") if key in os.environ]
    if mapped and os.environ.get("NVSHMEM_ENABLE_NIC_PE_MAPPING") != "1":
        verb = "takes" if len(mapped) == 1 else "take"
        lines.append(f"  {' and '.join(mapped)} {verb} effect only with NVSHMEM_ENABLE_NIC_PE_MAPPING=1, "
                     "which is not set")
    if os.environ.get("NVSHMEM_REMOTE_TRANSPORT") == "none":
        lines.append("  NVSHMEM_REMOTE_TRANSPORT=none: NVSHMEM reaches peers over P2P only, never a GPU on another "
                     "host")
    gdrcopy = _gdrcopy_library()
    lines.append("GDRCopy      " + (f"{gdrcopy} loads" if gdrcopy else
                                    "libgdrapi not found: NVSHMEM's proxy (IBRC) transport needs GDRCopy for signals "
                                    "and atomics across nodes"))
    devices = sorted(p.name for p in INFINIBAND_DIR.iterdir()) if INFINIBAND_DIR.is_dir() else []
    lines.append("InfiniBand   " + (", ".join(devices) + f" ({INFINIBAND_DIR})" if devices else
                                    "no InfiniBand device found: cross-node traffic needs NVSHMEM's IBGDA or IBRC "
                                    "transport; groups here stay on this host, where NVSHMEM's P2P transport "
                                    "carries every leg (docs/multinode.md)"))
    return lines


def report() -> str:
    """The whole report as text."""
    lines = [
        f"moe_ep       {_version('moe_ep') or 'not installed'}",
        f"torch        {torch.__version__} (CUDA runtime {torch.version.cuda or 'none'})",
        f"nvcc         {_nvcc_version()}",
        *_native_lines(),
        *_gpu_lines(),
        *_topology_lines(),
        *_transport_lines(),
    ]
    backend, why = auto_backend(torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    lines.append(f'Buffer(backend="auto") -> {backend} ({why})')
    return "\n".join(lines)


def main() -> None:
    """Prints the report; under torchrun (the ranks placed as moe_ep.launch does) rank 0 prints it
    with the group's nodes and how many ranks share each GPU."""
    if "RANK" not in os.environ:
        print(report())
        return
    from .launch import init_distributed

    init_distributed()
    try:
        text = report()
        if dist.get_rank() == 0:
            print(text)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
