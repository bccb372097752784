"""The native module on any machine: it is built wherever nvcc is, its NVSHMEM versions agree, its
phase names and error layout match comm.h, and NVSHMEM sessions fail clearly where they cannot run."""
from __future__ import annotations

import ctypes
import importlib
import importlib.metadata
import json
import pickle
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moe_ep.comm import _native, call_check, expert_major, nvfp4
from moe_ep.comm.backends.symmetric import NvshmemSession
from moe_ep.comm.errors import BadExpertIdError, CallMismatchError, CommTimeoutError, ErrorWatch, _ErrorState

ROOT = Path(__file__).resolve().parents[1]
COMM_H = ROOT / "csrc" / "runtime" / "comm.h"
ERROR_CODE_H = ROOT / "csrc" / "runtime" / "error_code.h"

needs_native = pytest.mark.skipif(not _native.available()[0], reason=f"moe_ep.comm._C unavailable: {_native.available()[1]}")


def _comm_h_phases() -> list[tuple[int, str]]:
    """(value, comment) of every Phase enumerator in comm.h; kPhaseNone has no comment and is 'none'."""
    body = re.search(r"enum Phase : int \{(.*?)\};", COMM_H.read_text(), re.S)[1]
    phases = []
    for name, value, comment in re.findall(r"(kPhase\w+)\s*=\s*(\d+),[ \t]*(?://\s*(.*))?", body):
        phases.append((int(value), comment.strip() if comment else "none"))
    return phases


def test_native_is_built_wherever_nvcc_is() -> None:
    ok, why = _native.available()
    if _native.find_nvcc() is not None:
        assert ok, why
    else:
        assert not ok and "not built" in why


@pytest.fixture
def fresh_load():
    """_native._load is cached per process: clear it around a test that fakes the install."""
    _native._load.cache_clear()
    yield
    _native._load.cache_clear()


def _why(monkeypatch: pytest.MonkeyPatch, *, info: bool, extension: bool, nvcc: bool, tmp_path: Path) -> str:
    """Why _C is unavailable in a faked install (build info written or not, _C file present or not,
    nvcc on this machine or not)."""
    build_info = tmp_path / "_build_info.json"
    if info:
        build_info.write_text(json.dumps({"nvshmem_dist": "nvidia-nvshmem-cu13", "nvshmem_dist_version": "3.4.5"}))
    monkeypatch.setattr(_native, "BUILD_INFO", build_info)
    monkeypatch.setattr(_native, "extension_file", lambda: tmp_path / "_C.so" if extension else None)
    monkeypatch.setattr(_native, "find_nvcc", lambda: Path("/opt/cuda/bin/nvcc") if nvcc else None)
    _native._load.cache_clear()
    ok, why = _native.available()
    assert not ok
    with pytest.raises(_native.NativeUnavailableError, match=re.escape(why)):
        _native.load()
    return why


def test_message_without_nvcc_says_no_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fresh_load) -> None:
    why = _why(monkeypatch, info=False, extension=False, nvcc=False, tmp_path=tmp_path)
    assert "not built" in why and "found no CUDA compiler" in why and "failed" not in why


def test_message_with_nvcc_says_the_build_failed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fresh_load) -> None:
    why = _why(monkeypatch, info=False, extension=False, nvcc=True, tmp_path=tmp_path)
    assert "not built" in why and "build failed" in why and "/opt/cuda/bin/nvcc" in why
    assert "no CUDA compiler" not in why


def test_message_for_an_unfinished_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fresh_load) -> None:
    for nvcc in (False, True):
        why = _why(monkeypatch, info=False, extension=True, nvcc=nvcc, tmp_path=tmp_path)
        assert "not built completely" in why and "_C.so is there" in why and "no CUDA compiler" not in why
    why = _why(monkeypatch, info=True, extension=False, nvcc=True, tmp_path=tmp_path)
    assert "_C is missing" in why and "build failed" in why and "no CUDA compiler" not in why


def test_message_when_the_built_module_does_not_import(monkeypatch: pytest.MonkeyPatch, fresh_load) -> None:
    if _native.build_info() is None:
        pytest.skip("moe_ep.comm._C is not built")
    real_import = importlib.import_module

    def fail(name: str, *args):
        if name == "moe_ep.comm._C":
            raise ImportError("undefined symbol: nvshmemx_fake")
        return real_import(name, *args)

    monkeypatch.setattr(importlib, "import_module", fail)
    ok, why = _native.available()
    assert not ok and "was built but does not import" in why and "nvshmemx_fake" in why
    assert "no CUDA compiler" not in why


@needs_native
def test_nvshmem_versions_agree() -> None:
    native = _native.load()
    info = _native.build_info()
    assert importlib.metadata.version(info["nvshmem_dist"]) == info["nvshmem_dist_version"]
    assert tuple(native.build_version()) == tuple(info["nvshmem_version"]) == tuple(native.runtime_version())


def test_wheel_version_mismatch_names_both_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    info = _native.build_info()
    if info is None:
        pytest.skip("moe_ep.comm._C is not built")
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
    fields = re.findall(r"^\s*(int|long long) (\w+);", body, re.M)
    ctype_of = {"int": ctypes.c_int, "long long": ctypes.c_longlong}
    assert [(name, ctype) for name, ctype in _ErrorState._fields_] == [(n, ctype_of[t]) for t, n in fields]


class _FakeNative:
    """The ErrorState calls of moe_ep.comm._C over ordinary host memory, so ErrorWatch runs without a GPU."""

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

    def error_state_bytes(self) -> int:
        return ctypes.sizeof(self.state)

    def error_state_fields(self) -> list[tuple[str, int, int]]:
        """comm.h's ErrorState read from the header: each field's name, offset and size (ints, then long longs)."""
        body = re.search(r"struct ErrorState \{(.*?)\};", COMM_H.read_text(), re.S)[1]
        fields, offset = [], 0
        for kind, name in re.findall(r"^\s*(int|long long) (\w+);", body, re.M):
            size = 4 if kind == "int" else 8
            offset = -(-offset // size) * size
            fields.append((name, offset, size))
            offset += size
        return fields

    @property
    def ERROR_MISMATCH(self) -> int:  # noqa: N802 - _C's attribute name
        return int(re.search(r"kErrorMismatch = (\d+)", ERROR_CODE_H.read_text())[1])


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


def test_error_watch_reports_a_bad_expert_id_once() -> None:
    fake = _FakeNative([c for _, c in _comm_h_phases()])
    watch = ErrorWatch(fake, timeout_s=100.0, num_experts=256)
    rng = random.Random(11)
    for value in (256, -2, (1 << 40) + rng.randrange(1000)):
        token, k = rng.randrange(4096), rng.randrange(8)
        fake.state.bad_claim, fake.state.bad_token, fake.state.bad_k, fake.state.bad_value = 1, token, k, value
        fake.state.bad_id = 1
        with pytest.raises(ValueError, match=rf"^topk_idx\[{token}, {k}\] = {value}: expert ids must lie in "
                                             rf"\[-1, 256\)"):
            watch.check()
        assert fake.state.bad_id == 0 and fake.state.bad_claim == 0
        watch.check()
    fake.state.code, fake.state.bad_id = 1, 1  # a timeout wins: the call's other outputs are not valid either
    with pytest.raises(CommTimeoutError):
        watch.check()


def test_error_watch_rejects_a_mismatched_build() -> None:
    fake = _FakeNative(["none"])
    fake.error_state_bytes = lambda: 16  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="reinstall moe_ep"):
        ErrorWatch(fake)
    fake = _FakeNative(["none"])  # the same size, two fields swapped: each field is checked, not only the size
    fields = fake.error_state_fields()
    fields[1], fields[2] = (fields[2][0], fields[1][1], 4), (fields[1][0], fields[2][1], 4)
    fake.error_state_fields = lambda: fields  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="reinstall moe_ep"):
        ErrorWatch(fake)


def test_error_watch_hands_a_stamp_mismatch_to_its_owner() -> None:
    """A mismatch record goes to on_mismatch with its stamp slot, once, the record cleared first (the
    owner reads every rank's stamp and raises)."""
    fake = _FakeNative([c for _, c in _comm_h_phases()])
    watch = ErrorWatch(fake, timeout_s=100.0)
    seen: list[int] = []

    def owner(slot: int) -> None:
        seen.append(slot)
        assert fake.state.code == 0, "the record must be cleared before the owner raises"
        raise CallMismatchError(f"slot {slot}")

    watch.on_mismatch = owner
    for slot in (1, 0):
        fake.state.code, fake.state.rank, fake.state.peer, fake.state.stamp_slot = fake.ERROR_MISMATCH, 0, 1, slot
        with pytest.raises(CallMismatchError, match=f"slot {slot}"):
            watch.check(timeouts_only=True)
        watch.check()
    assert seen == [1, 0]


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
    assert re.search(r"^native _C\s+(loads|not available: .+)$", out, re.M)
    assert re.search(r'^Buffer\(backend="auto"\) -> (nvshmem|reference) \(.+\)$', out, re.M)


def test_fallback_constants_equal_the_kernels_limits() -> None:
    limits = (ROOT / "csrc" / "runtime" / "limits.h").read_text()
    for name, constant in (("MAX_TOPK", "kMaxTopk"), ("MAX_NODE_RANKS", "kMaxNodeRanks"),
                           ("MAX_RANKS_PER_GPU", "kMaxRanksPerGpu")):
        assert int(re.search(rf"constexpr int {constant} = (\d+);", limits)[1]) == _native.FALLBACK_CONSTANTS[name]
    low_latency = (ROOT / "csrc" / "kernels" / "low_latency" / "low_latency.h").read_text()
    for name, constant in (("NVFP4_BLOCK", "kNvfp4Block"), ("NVFP4_E2M1_MAX", "kNvfp4E2m1Max"),
                           ("NVFP4_TILE_ROWS", "kNvfp4TileRows"), ("NVFP4_TILE_GROUP_ROWS", "kNvfp4TileGroupRows"),
                           ("NVFP4_TILE_SCALES", "kNvfp4TileScales")):
        value = int(re.search(rf"constexpr int {constant} = (\d+);", low_latency)[1])
        assert value == _native.FALLBACK_CONSTANTS[name], name
    if _native.available()[0]:
        native = _native.load()
        for name, fallback in _native.FALLBACK_CONSTANTS.items():
            assert getattr(native, name, fallback) == fallback == _native.constant(name), name


def test_call_stamp_layout_matches_call_check() -> None:
    """The notify kernels' stamp (runtime/call_stamp.h) is the one moe_ep.comm.call_check writes and reads:
    as many words, the status word where it is, the bad-id status the kernels set."""
    text = (ROOT / "csrc" / "runtime" / "call_stamp.h").read_text()
    consts = {name: int(v) for name, v in re.findall(r"constexpr int (kStamp\w+) = (\d+);", text)}
    stamp = call_check.CallOrder().stamp(call_check.DISPATCH, error=BadExpertIdError("topk_idx values must lie in"))
    assert consts["kStampWords"] == call_check.STAMP_WORDS == len(stamp.words)
    assert stamp.words[consts["kStampStatus"]] == stamp.status == consts["kStampBadIds"]
    assert call_check.STATUS[consts["kStampBadIds"]] is BadExpertIdError
    if _native.available()[0]:
        assert _native.load().STAMP_WORDS == call_check.STAMP_WORDS


def test_constant_from_the_module_else_the_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    class Exports:
        MAX_TOPK = 12

    monkeypatch.setattr(_native, "_load", lambda: Exports())
    assert _native.constant("MAX_TOPK") == 12
    monkeypatch.setattr(_native, "_load", lambda: object())  # a _C that does not export it
    assert _native.constant("MAX_TOPK") == _native.FALLBACK_CONSTANTS["MAX_TOPK"]
    monkeypatch.setattr(_native, "_load", lambda: "moe_ep.comm._C is not built")  # no _C at all
    assert _native.constant("MAX_TOPK") == _native.FALLBACK_CONSTANTS["MAX_TOPK"]


@needs_native
def test_low_latency_region_layout_is_csrc_s() -> None:
    """The low-latency region as low_latency.h's comment lays it out, worked by hand for R=4, T=3, H=128,
    K=2 on 2 nodes (P * E_l = 5 scratch blocks): areas in order, each 256-byte aligned."""
    got = _native.load().ll_region_layout(4, 3, 128, 2, 5)
    payload = 2 * 4 * 3 * 2 * 128  # [2][R][T][2H] bytes = 6144
    meta = 2 * 4 * 3 * 48  # [2][R][T][48] = 1152 -> next 256: 6144 + 1152 = 7296 -> 7424
    combine = 2 * 3 * 2 * 128 * 2  # [2][T][K][H] bf16 = 3072
    scratch = 5 * 8 * 128 * 2  # [P * E_l][8][H] bf16 = 10240
    assert got == {"dispatch_payload": 0, "dispatch_meta": payload, "combine_payload": 7424,
                   "combine_scratch": 7424 + combine, "signals": 7424 + combine + scratch,
                   "total": 7424 + combine + scratch + 256}  # 6 * 4 * 8 = 192 signal bytes -> 256
    assert meta == 7296 - payload
    with pytest.raises(ValueError, match="sizes must be positive"):
        _native.load().ll_region_layout(0, 3, 128, 2, 0)


@needs_native
@pytest.mark.parametrize("slots, hidden", [(130, 112), (256, 2064), (40, 16)])
def test_nvfp4_scale_layout_is_csrc_s(slots: int, hidden: int) -> None:
    """moe_ep.comm.nvfp4's swizzled scale storage puts row t's scale j at low_latency.h's nvfp4_scale_offset
    (per expert), and nothing else but zero padding: the Python views and the kernel agree on every byte."""
    native = _native.load()
    layout = nvfp4.NvFp4Layout(2, slots, hidden)
    t, j = torch.meshgrid(torch.arange(slots), torch.arange(hidden // 16), indexing="ij")
    linear = torch.stack([(t * 7 + j * 3) % 255 + 1, (t * 5 + j * 11) % 255 + 1]).to(torch.uint8)  # none zero
    storage = layout.swizzle(linear.view(torch.float8_e4m3fn)).view(torch.uint8).view(2, -1)
    per_expert = storage.shape[1]
    offsets = torch.tensor([native.ll_nvfp4_scale_offset(layout.scale_tiles, r, c)
                            for r, c in zip(t.flatten().tolist(), j.flatten().tolist())])
    assert int(offsets.max()) < per_expert and offsets.unique().numel() == offsets.numel()
    assert torch.equal(storage[:, offsets], linear.view(2, -1))
    assert int((storage != 0).sum()) == linear.numel()  # the rest is padding, zero
    with pytest.raises(ValueError, match="ll_nvfp4_scale_offset"):
        native.ll_nvfp4_scale_offset(layout.scale_tiles, 0, 4 * layout.scale_tiles)


# ---- Named launcher arguments (csrc/runtime/named_args.h; each folder's bindings.cpp) ----
# Every launcher takes one struct with named fields; its check (args.check(dims), the same one the context's
# launch method runs first) raises ValueError naming the launcher and the field. No GPU needed.

_R, _T, _H, _K, _E = 4, 64, 256, 4, 16  # dims of every case below: M <= R * T rows, E_l = 4


def _ptrs(*names: str) -> dict[str, int]:
    """A distinct fake device address for each field."""
    return {name: 0x1000 * (i + 1) for i, name in enumerate(names)}


def _intranode_dims(native):
    return native.IntranodeDims(rank=1, nranks=_R, max_tokens=_T, hidden=_H, num_topk=_K, num_experts=_E)


def _internode_dims(native):
    return native.InternodeDims(rank=1, nranks=_R, ranks_per_node=2, max_tokens=_T, hidden=_H, num_topk=_K,
                                num_experts=_E, round_tokens=16)


def _low_latency_dims(native):
    return native.LowLatencyDims(rank=1, nranks=_R, ranks_per_node=2, num_local_experts=_E // _R, num_topk=_K,
                                 hidden=_H, max_tokens=_T)


# (args class, dims factory, valid fields, a required pointer set to 0, an out-of-range size, its whole message)
_ARGS_CASES = [
    ("IntranodeLayoutArgs", _intranode_dims,
     dict(_ptrs("topk_idx", "tokens_per_rank", "tokens_per_expert", "is_token_in_rank"), num_tokens=_T),
     "tokens_per_expert", dict(num_tokens=_T + 1), f"num_tokens = {_T + 1} exceeds max_tokens = {_T}"),
    ("IntranodeNotifyArgs", _intranode_dims,
     dict(_ptrs("topk_idx", "is_token_in_rank", "pos", "recv_info", "tokens_per_expert"), num_tokens=5,
          expert_alignment=128, worst_case=False),
     "pos", dict(expert_alignment=0), "expert_alignment = 0, expected at least 1"),
    ("IntranodeDispatchArgs", _intranode_dims,
     dict(_ptrs("x", "topk_idx", "topk_weights", "pos", "recv_info", "out_x", "out_topk_idx", "out_topk_weights",
                "out_src_rank", "out_src_index"),
          num_tokens=5, row_bytes=2 * _H, num_scales=0, num_rows=7, worst_case=False, cached=False, num_blocks=20),
     "out_x", dict(row_bytes=3 * _H),
     f"row_bytes = {3 * _H}, expected hidden * 2 = {2 * _H} (bf16) or hidden * 1 = {_H} (FP8)"),
    ("IntranodeCombineArgs", _intranode_dims,
     dict(_ptrs("x", "src_rank", "src_index", "is_token_in_rank", "pos", "recv_info", "out"), num_rows=7,
          num_tokens=5, with_weights=False, num_blocks=20),
     "src_rank", dict(num_rows=-1), "num_rows = -1 is negative"),
    ("IntranodeExpandArgs", _intranode_dims,
     dict(_ptrs("rows", "src_rank", "recv_info", "scales", "out_x", "out_scales"), num_pairs=9, num_rows=7,
          expert_alignment=1, row_bytes=_H, num_scales=_H // 128, num_blocks=20),
     "out_scales", dict(num_pairs=_R * _T * _K + 1),
     f"num_pairs = {_R * _T * _K + 1} exceeds nranks * max_tokens * min(num_topk, local experts) + "
     f"(expert_alignment - 1) * local experts = {_R * _T * _K}"),
    ("InternodeRouteArgs", _internode_dims,
     dict(_ptrs("topk_idx", "in_rank", "pos", "in_node", "tokens_per_rank", "tokens_per_expert"), num_tokens=5),
     "in_node", dict(num_tokens=-1), "num_tokens = -1 is negative"),
    ("InternodeNotifyArgs", _internode_dims,
     dict(_ptrs("tokens_per_rank", "tokens_per_expert", "recv_info", "tokens_per_expert_aligned"), num_tokens=0,
          expert_alignment=1, worst_case=True),
     "tokens_per_expert_aligned", dict(num_tokens=_T + 1), f"num_tokens = {_T + 1} exceeds max_tokens = {_T}"),
    ("InternodeDispatchArgs", _internode_dims,
     dict(_ptrs("x", "x_scales", "topk_idx", "topk_weights", "pos", "in_node", "recv_info", "out_x", "out_scales",
                "out_topk_idx", "out_topk_weights", "out_src_rank", "out_src_index", "forward_mask", "own_row"),
          num_tokens=5, row_bytes=_H, num_scales=_H // 128, num_rows=7, worst_case=False, cached=False,
          num_blocks=20),
     "x_scales", dict(num_scales=1),
     f"num_scales = 1 with FP8 rows (row_bytes = {_H} = hidden * 1), expected hidden / 128 = {_H // 128}"),
    ("InternodeCombineArgs", _internode_dims,
     dict(_ptrs("x", "src_index", "recv_info", "forward_mask", "own_row", "in_node", "out", "topk_weights",
                "out_topk_weights"),
          num_tokens=5, num_rows=7, with_weights=True, num_blocks=20),
     "out_topk_weights", dict(num_blocks=0), "num_blocks = 0, expected at least 1"),
    ("LowLatencyDispatchArgs", _low_latency_dims,
     dict(_ptrs("x", "topk_idx", "recv_x", "recv_scales", "src_rank", "src_index", "src_k", "count"), num_tokens=5,
          use_fp8=True, round_scale=True, send=True, receive=True),
     "recv_scales", dict(num_tokens=_T + 1), f"num_tokens = {_T + 1} exceeds max_tokens = {_T}"),
    ("LowLatencyCombineArgs", _low_latency_dims,
     dict(_ptrs("y", "src_rank", "src_index", "src_k", "count", "topk_idx", "topk_weights", "out"), num_tokens=5,
          send=True, receive=True),
     "topk_weights", dict(num_tokens=-3), "num_tokens = -3 is negative"),
]
_LAUNCHER = {"IntranodeLayoutArgs": "IntranodeContext.layout", "IntranodeNotifyArgs": "IntranodeContext.notify",
             "IntranodeDispatchArgs": "IntranodeContext.dispatch", "IntranodeCombineArgs": "IntranodeContext.combine",
             "IntranodeExpandArgs": "IntranodeContext.expand",
             "InternodeRouteArgs": "InternodeContext.route", "InternodeNotifyArgs": "InternodeContext.notify",
             "InternodeDispatchArgs": "InternodeContext.dispatch", "InternodeCombineArgs": "InternodeContext.combine",
             "LowLatencyDispatchArgs": "LowLatencyContext.dispatch",
             "LowLatencyCombineArgs": "LowLatencyContext.combine"}


@needs_native
@pytest.mark.parametrize("name, dims, valid, null, bad, message", _ARGS_CASES, ids=[c[0] for c in _ARGS_CASES])
def test_launch_args_are_checked_by_name(name, dims, valid, null, bad, message) -> None:
    native = _native.load()
    cls, d = getattr(native, name), dims(native)
    args = cls(**valid)
    args.check(d)
    for field, value in valid.items():  # every field reads back, read-only
        assert getattr(args, field) == value, field
    with pytest.raises(AttributeError):
        setattr(args, null, 0)
    assert repr(args).startswith(f"{name}(") and f"{null}={valid[null]}" in repr(args)
    where = re.escape(_LAUNCHER[name])
    with pytest.raises(ValueError, match=rf"^{where}: {null} is null$"):
        cls(**{**valid, null: 0}).check(d)
    with pytest.raises(ValueError, match=rf"^{where}: {re.escape(message)}$"):
        cls(**{**valid, **bad}).check(d)
    with pytest.raises(TypeError):  # keyword-only
        cls(*valid.values())


def _struct_fields(header: str, struct: str) -> list[str]:
    """The field names of `struct` in a csrc header (one declaration per line, comma lists allowed)."""
    body = re.search(rf"struct {struct} \{{(.*?)\n\}};", (ROOT / "csrc" / header).read_text(), re.S)[1]
    names = []
    for decl in re.findall(r"^\s*(?:uintptr_t|int|bool)\s+([^;]+);", body, re.M):
        names += [n.split("[")[0].strip() for n in decl.split(",")]  # an array field by its name
    return names


@needs_native
@pytest.mark.parametrize("name, header, struct, unbound", [
    ("IntranodeDims", "kernels/intranode/intranode.h", "Dims", set()),
    ("IntranodeLayoutArgs", "kernels/intranode/intranode.h", "LayoutArgs", set()),
    ("IntranodeNotifyArgs", "kernels/intranode/intranode.h", "NotifyArgs", {"host_info", "stamp"}),
    ("IntranodeDispatchArgs", "kernels/intranode/intranode.h", "DispatchArgs", set()),
    ("IntranodeCombineArgs", "kernels/intranode/intranode.h", "CombineArgs", set()),
    ("IntranodeExpandArgs", "kernels/intranode/intranode.h", "ExpandArgs", set()),
    ("InternodeRouteArgs", "kernels/internode/internode.h", "RouteArgs", set()),
    ("InternodeNotifyArgs", "kernels/internode/internode.h", "NotifyArgs", {"host_info", "stamp"}),
    ("InternodeDispatchArgs", "kernels/internode/internode.h", "DispatchArgs", set()),
    ("InternodeCombineArgs", "kernels/internode/internode.h", "CombineArgs", set()),
    ("LowLatencyDims", "kernels/low_latency/low_latency.h", "Dims", set()),
    ("LowLatencyDispatchArgs", "kernels/low_latency/low_latency.h", "DispatchLaunchArgs", set()),
    ("LowLatencyCombineArgs", "kernels/low_latency/low_latency.h", "CombineLaunchArgs", set()),
])
def test_launch_args_bind_every_field(name, header, struct, unbound) -> None:
    """A field added to a launcher's struct must reach Python (or be named here as the context's own)."""
    fields = _struct_fields(header, struct)
    assert len(fields) >= 6 and unbound <= set(fields)
    cls = getattr(_native.load(), name)
    assert [f for f in fields if f not in unbound and not hasattr(cls, f)] == []
    for f in unbound:
        assert not hasattr(cls, f)


@needs_native
def test_launch_args_checks_follow_the_call_sizes() -> None:
    """A pointer whose tensor is empty may be 0 (torch gives empty CUDA tensors address 0); the checks ask
    for a pointer only when the launch uses it."""
    native = _native.load()
    d = _intranode_dims(native)
    # no tokens and no rows received: only recv_info is needed
    native.IntranodeDispatchArgs(x=0, pos=0, recv_info=1, num_tokens=0, row_bytes=2 * _H, num_scales=0, num_rows=0,
                                 out_x=0, worst_case=False, cached=False, num_blocks=1).check(d)
    cached = dict(x=1, pos=2, recv_info=3, num_tokens=5, row_bytes=_H, num_scales=_H // 128, num_rows=_R * _T,
                  out_x=4, x_scales=5, out_scales=6, worst_case=True, cached=True, num_blocks=1)
    native.IntranodeDispatchArgs(**cached).check(d)  # a cached dispatch: no topk, no src_rank / src_index
    with pytest.raises(ValueError, match=r"^IntranodeContext.dispatch: topk_idx is null$"):
        native.IntranodeDispatchArgs(**{**cached, "cached": False}).check(d)
    worst = rf"num_rows = 7 in worst-case mode, expected nranks \* max_tokens = {_R * _T}$"
    with pytest.raises(ValueError, match=worst):
        native.IntranodeDispatchArgs(**{**cached, "num_rows": 7}).check(d)
    with pytest.raises(ValueError, match=r"num_scales = 2 with bf16 rows"):
        native.IntranodeDispatchArgs(**{**cached, "row_bytes": 2 * _H}).check(d)
    # rows that stay in the workspace (expert-major NVLink dispatch): no out_x, and none may be given
    native.IntranodeDispatchArgs(**{**cached, "out_x": 0, "expert_major": True}).check(d)
    with pytest.raises(ValueError, match=r"^IntranodeContext.dispatch: out_x is null$"):
        native.IntranodeDispatchArgs(**{**cached, "out_x": 0}).check(d)
    with pytest.raises(ValueError, match=r"out_x must be 0 with expert_major"):
        native.IntranodeDispatchArgs(**{**cached, "expert_major": True}).check(d)
    # an expand with no pairs reads and writes nothing but recv_info; bf16 pairs need no scales
    native.IntranodeExpandArgs(rows=0, num_pairs=0, num_rows=0, expert_alignment=1, src_rank=0, recv_info=1,
                               row_bytes=2 * _H, num_scales=0, out_x=0, num_blocks=1).check(d)
    expand = dict(rows=1, num_pairs=3, num_rows=2, expert_alignment=1, src_rank=2, recv_info=3, row_bytes=2 * _H,
                  num_scales=0, out_x=4, num_blocks=1)
    native.IntranodeExpandArgs(**expand).check(d)
    # the most pairs a layout of R * T rows holds (the Python side's own formula, so the two cannot drift)
    most = expert_major.worst_case_pairs(_R * _T, _K, _E // _R, 3)
    native.IntranodeExpandArgs(**{**expand, "num_pairs": most, "expert_alignment": 3}).check(d)
    with pytest.raises(ValueError, match=rf"num_pairs = {most + 1} exceeds .* = {most}$"):
        native.IntranodeExpandArgs(**{**expand, "num_pairs": most + 1, "expert_alignment": 3}).check(d)
    with pytest.raises(ValueError, match=r"expert_alignment = 0"):
        native.IntranodeExpandArgs(**{**expand, "expert_alignment": 0}).check(d)
    with pytest.raises(ValueError, match=r"^IntranodeContext.expand: out_scales is null$"):
        native.IntranodeExpandArgs(**{**expand, "row_bytes": _H, "num_scales": _H // 128, "scales": 5}).check(d)
    combine = dict(x=1, num_rows=3, src_rank=2, src_index=3, is_token_in_rank=4, pos=5, recv_info=6, num_tokens=2,
                   out=7, with_weights=False, num_blocks=1)
    native.IntranodeCombineArgs(**combine).check(d)  # no weights: neither weight pointer is needed
    with pytest.raises(ValueError, match=r"^IntranodeContext.combine: topk_weights is null$"):
        native.IntranodeCombineArgs(**{**combine, "with_weights": True}).check(d)
    ll = _low_latency_dims(native)
    recv = dict(x=0, topk_idx=0, num_tokens=9, recv_x=1, src_rank=2, src_index=3, src_k=4, count=5, use_fp8=False,
                round_scale=False, send=False, receive=True)
    native.LowLatencyDispatchArgs(**recv).check(ll)  # a receive-only launch reads no x
    with pytest.raises(ValueError, match=r"^LowLatencyContext.dispatch: x is null$"):
        native.LowLatencyDispatchArgs(**{**recv, "send": True}).check(ll)
    with pytest.raises(ValueError, match=r"^LowLatencyContext.dispatch: round_scale needs use_fp8$"):
        native.LowLatencyDispatchArgs(**{**recv, "round_scale": True}).check(ll)
    with pytest.raises(ValueError, match=r"send and receive are both false"):
        native.LowLatencyDispatchArgs(**{**recv, "receive": False}).check(ll)
    with pytest.raises(ValueError, match=r"^LowLatencyContext.dispatch: ue8m0 needs use_fp8, round_scale"):
        native.LowLatencyDispatchArgs(**{**recv, "use_fp8": True, "recv_scales": 6, "ue8m0": True}).check(ll)


@needs_native
def test_low_latency_nvfp4_fields_are_checked() -> None:
    """use_nvfp4 needs recv_scales (a receive) and x_global_scale (a send: every send block reads g, even one
    without tokens), excludes use_fp8, needs hidden % 16 == 0; x_global_scale without it is an error."""
    native = _native.load()
    d = _low_latency_dims(native)
    both = dict(x=1, topk_idx=2, num_tokens=3, recv_x=4, recv_scales=5, src_rank=6, src_index=7, src_k=8, count=9,
                use_fp8=False, round_scale=False, use_nvfp4=True, x_global_scale=10, send=True, receive=True)
    native.LowLatencyDispatchArgs(**both).check(d)
    native.LowLatencyDispatchArgs(**{**both, "x_global_scale": 0, "send": False}).check(d)  # receive only
    native.LowLatencyDispatchArgs(**{**both, "recv_scales": 0, "receive": False}).check(d)  # send only
    native.LowLatencyDispatchArgs(**{**both, "num_tokens": 0, "x": 0, "topk_idx": 0}).check(d)
    where = r"^LowLatencyContext\.dispatch: "
    for change, message in ((dict(x_global_scale=0), "x_global_scale is null"),
                            (dict(x_global_scale=0, num_tokens=0), "x_global_scale is null"),
                            (dict(recv_scales=0), "recv_scales is null"),
                            (dict(use_fp8=True), "use_nvfp4 and use_fp8 exclude each other"),
                            (dict(use_nvfp4=False), "x_global_scale needs use_nvfp4")):
        with pytest.raises(ValueError, match=where + re.escape(message) + "$"):
            native.LowLatencyDispatchArgs(**{**both, **change}).check(d)
    odd = native.LowLatencyDims(rank=1, nranks=_R, ranks_per_node=2, num_local_experts=_E // _R, num_topk=_K,
                                hidden=_H + 8, max_tokens=_T)
    message = f"use_nvfp4 needs hidden to be a multiple of 16, got {_H + 8}"
    with pytest.raises(ValueError, match=where + re.escape(message) + "$"):
        native.LowLatencyDispatchArgs(**both).check(odd)


@needs_native
def test_contexts_check_their_addresses_before_allocating() -> None:
    """A null address given to a context names its field (checked before any CUDA call, so also here)."""
    native = _native.load()
    runtime = native.RuntimeContext(rank=0, nranks=2, timeout_s=1.0, error=1, verdict=2)
    for field, value, message in (("error", 0, "error is null"), ("verdict", 0, "verdict is null"),
                                  ("rank", 2, "rank = 2, expected 0..1"),
                                  ("timeout_s", 0.0, "timeout_s = 0.0+, expected a positive number of seconds")):
        with pytest.raises(ValueError, match=rf"^RuntimeContext: {message}"):
            native.RuntimeContext(**{**dict(rank=0, nranks=2, timeout_s=1.0, error=1, verdict=2), field: value})
    assert (runtime.rank, runtime.nranks, runtime.timeout_s, runtime.error, runtime.verdict) == (0, 2, 1.0, 1, 2)
    intranode = dict(runtime=runtime, max_tokens=_T, hidden=_H, num_topk=_K, num_experts=_E,
                     epochs=2, block_counters=3, layout_scratch=4, signals=[5, 6], workspace=[7, 8],
                     row_flags=[9, 10])
    for field, value, message in (("epochs", 0, "epochs is null"), ("workspace", [7, 0], r"workspace\[1\] is null"),
                                  ("num_topk", 17, "num_topk = 17, expected 1..16"),
                                  ("num_experts", 15, "num_experts = 15, expected a positive multiple of nranks")):
        with pytest.raises(ValueError, match=rf"^IntranodeContext: {message}"):
            native.IntranodeContext(**{**intranode, field: value})
    internode = dict(runtime=native.RuntimeContext(rank=0, nranks=4, timeout_s=1.0, error=1, verdict=2), ranks_per_node=2,
                     max_tokens=_T, hidden=_H, num_topk=_K, num_experts=_E, round_tokens=16, epochs=2,
                     block_counters=3, workspace=4, node_peers=[5, 6])
    for field, value, message in (("epochs", 0, "epochs is null"), ("node_peers", [0, 6], r"node_peers\[0\] is null"),
                                  ("round_tokens", _T + 1, f"round_tokens = {_T + 1}, expected 1..{_T}")):
        with pytest.raises(ValueError, match=rf"^InternodeContext: {message}"):
            native.InternodeContext(**{**internode, field: value})
    low_latency = dict(runtime=native.RuntimeContext(rank=1, nranks=_R, timeout_s=1.0, error=1, verdict=2), ranks_per_node=2,
                       num_local_experts=_E // _R, num_topk=_K, hidden=_H, max_tokens=_T, epochs=2, masked=0, sym=3,
                       node_sym=[4, 5],
                       dispatch_payload_offset=0, dispatch_meta_offset=256, combine_payload_offset=512,
                       combine_scratch_offset=768, signals_offset=1024, done_counters=6, combine_stash=7,
                       blocks_per_expert=8, num_sms=132)
    ctx = native.LowLatencyContext(**low_latency)  # masked may be 0 (fault tolerance off); nothing is allocated
    assert repr(ctx.dims) == repr(_low_latency_dims(native))
    for field, message in (("done_counters", "done_counters is null"), ("sym", "sym is null"),
                           ("blocks_per_expert", "blocks_per_expert = 0, expected at least 1")):
        with pytest.raises(ValueError, match=rf"^LowLatencyContext: {message}$"):
            native.LowLatencyContext(**{**low_latency, field: 0})
    with pytest.raises(ValueError, match=r"^LowLatencyContext.combine: out is null$"):
        ctx.combine(native.LowLatencyCombineArgs(y=1, src_rank=2, src_index=3, src_k=4, count=5, topk_idx=6,
                                                 topk_weights=7, num_tokens=1, out=0, send=False, receive=True), 0)


@needs_native
def test_low_latency_combine_overlap_fields_are_checked() -> None:
    """num_sms > 0 (single-batch overlap) needs comp_signal (for a send), block_m and threshold; without it
    none of the three may be set."""
    native = _native.load()
    d = _low_latency_dims(native)
    base = dict(y=1, src_rank=2, src_index=3, src_k=4, count=5, topk_idx=6, topk_weights=7, num_tokens=1, out=8,
                send=True, receive=True)
    overlap = dict(num_sms=3, comp_signal=9, block_m=64, threshold=2)
    native.LowLatencyCombineArgs(**base, **overlap).check(d)
    native.LowLatencyCombineArgs(**{**base, "send": False}, **{**overlap, "comp_signal": 0}).check(d)  # receive only
    where = r"^LowLatencyContext\.combine: "
    for change, message in ((dict(comp_signal=0), "comp_signal is null"),
                            (dict(block_m=0), "block_m = 0, expected at least 1"),
                            (dict(threshold=-1), "threshold = -1, expected at least 1"),
                            (dict(num_sms=-2), "num_sms = -2 is negative"),
                            (dict(num_sms=0), "comp_signal, block_m and threshold need num_sms > 0 (overlap)")):
        with pytest.raises(ValueError, match=where + re.escape(message) + "$"):
            native.LowLatencyCombineArgs(**base, **{**overlap, **change}).check(d)


@needs_native
def test_cross_node_sm_budget_is_checked_not_capped() -> None:
    """A cross-node call runs one block per channel: a budget above INTERNODE_MAX_CHANNELS is an error naming
    the field (it used to be capped silently)."""
    native = _native.load()
    most = native.INTERNODE_MAX_CHANNELS
    valid_fields = {case[0]: case[2] for case in _ARGS_CASES}
    for name in ("InternodeDispatchArgs", "InternodeCombineArgs"):
        cls, valid = getattr(native, name), valid_fields[name]
        cls(**{**valid, "num_blocks": most}).check(_internode_dims(native))
        with pytest.raises(ValueError, match=rf"num_blocks = {most + 1}, expected 1\.\.{most}$"):
            cls(**{**valid, "num_blocks": most + 1}).check(_internode_dims(native))
