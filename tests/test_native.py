"""The native module on any machine: it is built wherever nvcc is, its NVSHMEM versions agree, its
phase names and error layout match comm.h, and NVSHMEM sessions fail clearly where they cannot run."""
from __future__ import annotations

import ctypes
import importlib.metadata
import os
import pickle
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moe_ep import _native
from moe_ep.backends.symmetric import CommTimeoutError, ErrorWatch, NvshmemSession, _ErrorState

ROOT = Path(__file__).resolve().parents[1]
COMM_H = ROOT / "csrc" / "runtime" / "comm.h"

needs_native = pytest.mark.skipif(not _native.available()[0], reason=f"moe_ep._C unavailable: {_native.available()[1]}")


def _nvcc_present() -> bool:
    home = os.environ.get("CUDA_HOME")
    return bool(home and (Path(home) / "bin" / "nvcc").is_file()) or shutil.which("nvcc") is not None


def _comm_h_phases() -> list[tuple[int, str]]:
    """(value, comment) of every Phase enumerator in comm.h; kPhaseNone has no comment and is 'none'."""
    body = re.search(r"enum Phase : int \{(.*?)\};", COMM_H.read_text(), re.S)[1]
    phases = []
    for name, value, comment in re.findall(r"(kPhase\w+)\s*=\s*(\d+),[ \t]*(?://\s*(.*))?", body):
        phases.append((int(value), comment.strip() if comment else "none"))
    return phases


def test_native_is_built_wherever_nvcc_is() -> None:
    ok, why = _native.available()
    if _nvcc_present():
        assert ok, why
    else:
        assert not ok and "not built" in why


@needs_native
def test_nvshmem_versions_agree() -> None:
    native = _native.load()
    info = _native.build_info()
    assert importlib.metadata.version(info["nvshmem_dist"]) == info["nvshmem_dist_version"]
    assert tuple(native.build_version()) == tuple(info["nvshmem_version"]) == tuple(native.runtime_version())


def test_wheel_version_mismatch_names_both_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    info = _native.build_info()
    if info is None:
        pytest.skip("moe_ep._C is not built")
    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda dist: "9.9.9" if dist == info["nvshmem_dist"] else real_version(dist))
    _native._load.cache_clear()
    try:
        ok, why = _native.available()
        with pytest.raises(_native.NativeUnavailableError, match="9.9.9"):
            _native.load()
    finally:
        monkeypatch.undo()
        _native._load.cache_clear()
    assert not ok and info["nvshmem_dist_version"] in why and "9.9.9" in why


@needs_native
def test_phase_names_match_comm_h() -> None:
    phases = _comm_h_phases()
    names = _native.load().phase_names()
    assert [v for v, _ in phases] == list(range(len(names)))
    assert names == [c for _, c in phases]


def test_error_state_layout_matches_comm_h() -> None:
    body = re.search(r"struct ErrorState \{(.*?)\};", COMM_H.read_text(), re.S)[1]
    fields = re.findall(r"^\s*int (\w+);", body, re.M)
    assert [name for name, _ in _ErrorState._fields_] == fields
    assert all(ctype is ctypes.c_int for _, ctype in _ErrorState._fields_)


class _FakeNative:
    """The ErrorState calls of moe_ep._C over ordinary host memory, so ErrorWatch runs without a GPU."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.state = _ErrorState()
        self.freed: list[int] = []

    def alloc_error_state(self) -> tuple[int, int]:
        return ctypes.addressof(self.state), 0xD0000000

    def free_error_state(self, host_ptr: int) -> None:
        self.freed.append(host_ptr)

    def phase_names(self) -> list[str]:
        return self.names


def test_error_watch_reports_a_recorded_timeout_once() -> None:
    names = [c for _, c in _comm_h_phases()]
    fake = _FakeNative(names)
    watch = ErrorWatch(fake, timeout_s=100.0)
    assert watch.device_ptr == 0xD0000000
    watch.check()
    rng = random.Random(7)
    for _ in range(5):
        rank, peer, phase = rng.randrange(8), rng.randrange(8), rng.randrange(1, len(names))
        fake.state.code, fake.state.rank, fake.state.phase, fake.state.peer = 1, rank, phase, peer
        with pytest.raises(CommTimeoutError) as err:
            watch.check()
        assert str(err.value) == (f"moe_ep rank {rank}: timed out after 100.0 s in phase '{names[phase]}' "
                                  f"waiting for rank {peer}")
        assert (err.value.rank, err.value.peer, err.value.phase) == (rank, peer, names[phase])
        watch.check()
    address = ctypes.addressof(fake.state)
    watch.close()
    watch.close()
    assert fake.freed == [address] and watch.device_ptr == 0


def test_comm_timeout_error_message_and_pickling() -> None:
    err = CommTimeoutError(1, 0, "dispatch: waiting for a peer's rows to land", 100.0)
    assert str(err) == ("moe_ep rank 1: timed out after 100.0 s in phase "
                        "'dispatch: waiting for a peer's rows to land' waiting for rank 0")
    again = pickle.loads(pickle.dumps(err))
    assert isinstance(again, CommTimeoutError) and str(again) == str(err) and again.peer == 0


@needs_native
def test_runtime_errors_are_exceptions_before_init() -> None:
    native = _native.load()
    assert not native.is_initialized()
    for call in (native.my_pe, native.n_pes, native.barrier_all, lambda: native.sym_malloc(64)):
        with pytest.raises(RuntimeError, match="not initialised"):
            call()
    native.finalize()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_session_without_gpu_raises_a_clear_error() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match=r"cannot start an NVSHMEM session: no CUDA device"):
            NvshmemSession.acquire(dist.group.WORLD, torch.device("cuda", 0), 1 << 20)
    finally:
        dist.destroy_process_group()


def test_info_reports_build_and_backend() -> None:
    out = subprocess.run([sys.executable, "-m", "moe_ep.info"], capture_output=True, text=True, check=True).stdout
    assert re.search(r"^torch\s+" + re.escape(torch.__version__), out, re.M)
    assert re.search(r"^moe_ep\._C\s+(loads|not available: .+)$", out, re.M)
    assert re.search(r'^Buffer\(backend="auto"\) -> (nvshmem|reference) \(.+\)$', out, re.M)
