"""tests/_dist.py's run_workers: a rank that dies without a traceback (killed by a signal, as the OOM killer
does) is named with its signal, whether its peers then fail (gloo sees the connection drop) or wait."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch.distributed as dist

from tests import _dist


def _one_rank_killed(rank: int, world: int, wait: str) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if wait == "barrier":
        dist.barrier()  # gloo notices the dropped connection: rank 0 raises
    else:
        time.sleep(600)  # rank 0 waits without noticing


@pytest.mark.parametrize("wait, message", [
    ("barrier", r"(?s)--- rank 0 ---\n.*--- without a traceback: rank 1 was killed by SIGKILL$"),
    ("sleep", r"^ranks \[0\] did not finish .*; before that rank 1 was killed by SIGKILL$"),
])
def test_a_killed_rank_is_named(monkeypatch: pytest.MonkeyPatch, wait: str, message: str) -> None:
    monkeypatch.setattr(_dist, "FAILED_PEER_GRACE_S", 1.0)
    with pytest.raises(AssertionError, match=message) as info:
        _dist.run_workers(2, _one_rank_killed, wait, timeout_s=120)
    assert "rank 1 ---" not in str(info.value)
