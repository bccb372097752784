"""Run a test module's kernel cases in Triton's interpreter on the CPU: a subprocess, because
TRITON_INTERPRET=1 must be set before Triton loads."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_interpreted(module: str, function: str, timeout_s: int = 600) -> None:
    """Call `module.function()` (e.g. "tests.test_fp8_experts", "interpreted_kernel_cases") interpreted;
    skipped without Triton, a failure carries the subprocess's output."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = f"import {module} as t; t.{function}()"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=timeout_s)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
