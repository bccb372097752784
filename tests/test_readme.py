"""The README's quick start runs as written under `torchrun --nproc-per-node 2` on CPU, and its
combined output equals, bit for bit, an independent brute-force computation over both ranks' inputs
(tests/oracle.py's combine order, with the README's stand-in experts written as plain loops)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from tests import oracle

ROOT = Path(__file__).resolve().parents[1]  # the checkout under test (the runner script lies elsewhere)
README = ROOT / "README.md"
WORLD = 2
# Runs the quick start (argv[1]) as torchrun's script, then saves what it computed for the test.
RUNNER = """
import os, sys, torch
ns = {"__name__": "__main__"}
exec(compile(open(sys.argv[1]).read(), "README.md quick start", "exec"), ns)
saved = {k: ns[k].cpu() for k in ("x", "topk_idx", "topk_weights", "out")}
torch.save({**saved, "num_experts": ns["num_experts"]}, os.path.join(sys.argv[2], f"rank{ns['rank']}.pt"))
"""


def quick_start_code(text: str) -> str:
    """The first python block of the README's "## Quick start" section."""
    section = text.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README.md's Quick start has no ```python block"
    return match[1]


def stand_in_expert_row(inp: oracle.Inputs, r: int, s: int, i: int, num_experts: int) -> torch.Tensor:
    """Rank r's expert output for token i of rank s, as the README defines its experts: the row times
    the sum, over the token's experts e that live on rank r, of (e + 1) * weight, rounded to bf16."""
    num_local = num_experts // WORLD
    scale = torch.zeros((), dtype=torch.float32)
    for e, w in zip(inp.topk_idx[s][i].tolist(), inp.topk_weights[s][i]):
        if e >= 0 and e // num_local == r:
            scale = scale + (e + 1) * w
    return (inp.x[s][i].float() * scale).to(torch.bfloat16)


def test_quick_start_runs_and_matches_brute_force(tmp_path: Path) -> None:
    script, runner = tmp_path / "quickstart.py", tmp_path / "runner.py"
    script.write_text(quick_start_code(README.read_text()))
    runner.write_text(RUNNER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
           str(runner), str(script), str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
                              "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert run.stdout.count("combine matches") == WORLD, run.stdout

    saved = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    inp = oracle.Inputs([d["x"] for d in saved], [d["topk_idx"] for d in saved], [d["topk_weights"] for d in saved])
    num_experts = saved[0]["num_experts"]
    for me in range(WORLD):
        want = oracle.expected_combine(inp, me, WORLD, num_experts,
                                       lambda r, s, i: stand_in_expert_row(inp, r, s, i, num_experts))
        oracle.assert_same_bits(saved[me]["out"], want, f"rank {me}'s combine output")


def fresh_machine_blocks() -> list[str]:
    """The bash blocks of the README's "## The two commands for a fresh machine" section."""
    section = README.read_text().split("\n## The two commands for a fresh machine\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert len(blocks) >= 3, blocks
    return blocks


def test_a_cpu_torch_comes_before_the_two_commands() -> None:
    """The section of the two commands opens with the command that installs a CPU build of torch."""
    blocks = fresh_machine_blocks()
    assert blocks[0].strip() == "pip install torch --index-url https://download.pytorch.org/whl/cpu", blocks[0]
    assert blocks[1].startswith("pip install . && torchrun") and blocks[2].startswith('pip install ".[test]"'), blocks


def test_ci_runs_the_readme_test_command() -> None:
    """.ci/run runs the README's test command as written, on a line of its own."""
    command = fresh_machine_blocks()[2].strip()
    assert command in (ROOT / ".ci" / "run").read_text().splitlines(), command


def test_no_test_counts_to_go_stale() -> None:
    """The README states no pass/skip counts of the suite (they change with every test added)."""
    assert not re.search(r"\d+ (passed|skipped|failed)", README.read_text())
