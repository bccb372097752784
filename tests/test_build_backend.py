"""The build backend's first words on a machine without a GPU: with nvcc there it says, before the
build requirements are fetched, which SM versions it compiles moe_ep.comm._C for and how to skip that;
with a GPU, or without nvcc, it says nothing of the kind."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "build_backend"))
from moe_ep_build import hooks  # noqa: E402  (the backend's folder, as pyproject.toml's backend-path)


@pytest.mark.parametrize("archs, written", [(None, "sm_90"), ("90;100", "sm_90, sm_100")])
def test_gpu_less_native_build_says_what_it_compiles_and_how_to_skip_it(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, archs: str, written: str) -> None:
    monkeypatch.setattr(hooks, "build_cuda", lambda: object())  # nvcc found
    monkeypatch.setattr(hooks, "_has_gpu", lambda: False)
    if archs is None:
        monkeypatch.delenv("MOE_EP_CUDA_ARCH", raising=False)
    else:
        monkeypatch.setenv("MOE_EP_CUDA_ARCH", archs)
    hooks._say_native_build_without_gpu()
    err = capsys.readouterr().err
    assert f"compiling moe_ep.comm._C for {written} " in err and "To skip it: MOE_EP_NATIVE=0 pip install ." in err, err


@pytest.mark.parametrize("nvcc, gpu", [(True, True), (False, False)])
def test_no_such_words_with_a_gpu_or_without_nvcc(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
                                                  nvcc: bool, gpu: bool) -> None:
    monkeypatch.setattr(hooks, "build_cuda", lambda: object() if nvcc else None)
    monkeypatch.setattr(hooks, "_has_gpu", lambda: gpu)
    hooks._say_native_build_without_gpu()
    assert capsys.readouterr().err == ""
